"""`eyas train`: the loss falls, online and offline agree, resume is exact, data parallel equals one process."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from tiny import interrupt_training, make_tokenized_target

from eyas.train.config import TrainConfig
from eyas.train.trainer import train


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    target = root / "target"
    make_tokenized_target(target)
    data = root / "data.jsonl"
    lines = []
    for i in range(24):
        lines.append({"messages": [{"role": "user", "content": f"def add_{i}(a, b):"},
                                   {"role": "assistant", "content": f"    return a + b + {i}\n" * 3}]})
        lines.append({"text": f"for i in range({i}):\n    print(i, {i})\n" * 2})
    data.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return root, target, data


def config(setup, out, **kw):
    root, target, data = setup
    base = dict(target=str(target), out=str(root / out), data=str(data), draft_arch="mla", aux_layer_ids=[1, 2, 3],
                draft_vocab_size=0, lr=3e-3, warmup_steps=2, max_steps=12, batch_size=4, max_length=64, save_every=4,
                seed=0)
    base.update(kw)
    return TrainConfig(**base)


def read_log(path):
    records = {}
    for line in path.read_text().splitlines():
        r = json.loads(line)
        records[r["step"]] = r
    return [records[s] for s in sorted(records)]


@pytest.mark.parametrize("arch", ["mla", "mha"])
def test_loss_falls_and_accuracy_rises(setup, arch):
    cfg = config(setup, f"run_{arch}", draft_arch=arch, max_steps=30, draft_vocab_size=512)
    train(cfg)
    log = read_log(setup[0] / f"run_{arch}" / "train_log.jsonl")
    def mean(records, key, k=None):
        return sum(r[key] if k is None else r[key][k] for r in records) / len(records)

    first, last = log[:3], log[-3:]
    # soft cross-entropy against a random target cannot fall below that target's entropy (~6.6 nats per step)
    assert mean(last, "loss") < mean(first, "loss") - 0.5
    for k in range(3):
        assert mean(last, "acc_per_step", k) > mean(first, "acc_per_step", k)
    out = setup[0] / f"run_{arch}"
    assert (out / "draft" / "config.json").is_file() and (out / "train_curves.png").is_file()
    # the trained draft serves: speculative greedy equals plain greedy
    from eyas import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = ["def add_3(a, b):\n", "for i in range("]
    plain = LLM(setup[1]).generate(prompts, params)
    spec = LLM(setup[1], speculative_method="eagle", draft_model=out / "draft").generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]


def test_online_and_offline_give_the_same_loss(setup):
    import torch

    from eyas import load_model
    from eyas.engine.llm import load_tokenizer
    from eyas.train.data import load_dataset
    from eyas.train.hidden_states import dump_hidden_states

    root, target_dir, data = setup
    target = load_model(target_dir)
    examples = load_dataset(data, load_tokenizer(target_dir), 64)
    dump = root / "dump"
    dump_hidden_states(target, examples, dump, (1, 2, 3), examples_per_shard=16, dtype=torch.float32, batch_size=1,
                       target_path=target_dir)
    online = train(config(setup, "online", max_steps=2))
    offline = train(config(setup, "offline", data=None, hidden_states=str(dump), max_steps=2))
    assert online["loss_per_step"] == pytest.approx(offline["loss_per_step"], rel=1e-5, abs=1e-6)


def test_bfloat16_target_trains_a_float32_draft(setup):
    """--target-dtype bfloat16: the target computes its hidden states and logits in bf16, the draft's own weights
    train and are saved in float32, and the loss stays near the float32 target's (bf16 rounds the features)."""
    from safetensors import safe_open

    fp32 = train(config(setup, "target_fp32", max_steps=2))
    bf16 = train(config(setup, "target_bf16", max_steps=2, target_dtype="bfloat16"))
    assert bf16["loss_per_step"] == pytest.approx(fp32["loss_per_step"], rel=2e-2)
    assert bf16["loss_per_step"] != fp32["loss_per_step"]  # the target really ran in bf16
    with safe_open(str(setup[0] / "target_bf16" / "draft" / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F32"}


def test_bf16_mixed_precision_keeps_float32_weights(setup):
    """--mixed-precision bf16: the draft's matmuls run in bf16 (the loss moves off the float32 one, but stays near
    it), its weights and optimizer state stay float32, and its loss still falls."""
    import torch
    from safetensors import safe_open

    fp32 = train(config(setup, "mp_no", max_steps=2, mixed_precision="no"))
    bf16 = train(config(setup, "mp_bf16", max_steps=2, mixed_precision="bf16"))
    assert bf16["loss_per_step"] == pytest.approx(fp32["loss_per_step"], rel=2e-2)
    assert bf16["loss_per_step"] != fp32["loss_per_step"]  # autocast really ran
    with safe_open(str(setup[0] / "mp_bf16" / "draft" / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F32"}
    state = torch.load(setup[0] / "mp_bf16" / "checkpoint" / "state.pt", weights_only=True)
    moments = [v for s in state["optimizer"]["state"].values() for k, v in s.items() if k.startswith("exp_avg")]
    assert moments and {m.dtype for m in moments} == {torch.float32}
    longer = train(config(setup, "mp_bf16_long", max_steps=20, mixed_precision="bf16"))
    first = read_log(setup[0] / "mp_bf16_long" / "train_log.jsonl")[0]
    assert longer["loss"] < first["loss"] - 0.5


def test_resume_reads_a_setting_added_later_as_its_default(setup):
    """A checkpoint saved before a setting existed resumes when the run keeps that setting's default, and refuses,
    naming the setting, when it does not."""
    import torch

    cfg = config(setup, "old_checkpoint", max_steps=2, save_every=2)
    train(cfg)
    path = setup[0] / "old_checkpoint" / "checkpoint" / "state.pt"
    state = torch.load(path, weights_only=True)
    del state["config"]["mixed_precision"]
    torch.save(state, path)
    train(config(setup, "old_checkpoint", max_steps=2, save_every=2), resume=True)
    with pytest.raises(ValueError, match=r"other settings \(mixed_precision\)"):
        train(config(setup, "old_checkpoint", max_steps=2, save_every=2, mixed_precision="bf16"), resume=True)


def test_target_logits_only_where_a_loss_reads_them(setup):
    """target_features computes the vocab-wide head only at positions before a loss token, in row-major order: the
    rows equal the full head's there."""
    import torch

    from eyas import load_model
    from eyas.engine.llm import load_tokenizer
    from eyas.train.batches import collate, target_features
    from eyas.train.data import load_dataset

    root, target_dir, data = setup
    target = load_model(target_dir, dtype="float32")
    examples = [e for e in load_dataset(data, load_tokenizer(target_dir), 64) if not all(e.loss_mask)][:4]  # chats
    batch = collate([{"input_ids": e.input_ids, "loss_mask": e.loss_mask} for e in examples], 64)
    aux, logits = target_features(target, batch, (1, 2, 3))
    hidden, _ = target.model(batch["input_ids"])
    dense = target.compute_logits(hidden)
    read = torch.zeros_like(batch["loss_mask"], dtype=torch.bool)
    read[:, :-1] = batch["loss_mask"][:, 1:] > 0
    assert 0 < read.sum() < read.numel()  # prompts and padding read no logits
    assert logits.shape == (read.sum(), target.config.vocab_size)
    torch.testing.assert_close(logits, dense[read], rtol=1e-5, atol=1e-5)


def run_cli(args, env=None):
    return subprocess.Popen([sys.executable, "-m", "eyas.cli", *args], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)


def cli_args(setup, out, steps=12):
    root, target, data = setup
    return ["train", "--target", str(target), "--data", str(data), "--out", str(root / out), "--aux-layer-ids",
            "1", "2", "3", "--lr", "3e-3", "--warmup-steps", "2", "--max-steps", str(steps), "--batch-size", "4",
            "--max-length", "64", "--save-every", "3", "--draft-vocab-size", "0"]


def test_kill_9_then_resume_continues_exactly(setup):
    root = setup[0]
    assert run_cli(cli_args(setup, "whole")).wait() == 0
    proc = run_cli(cli_args(setup, "killed"))
    log = root / "killed" / "train_log.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (log.exists() and len(log.read_text().splitlines()) >= 5):
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert 5 <= len(log.read_text().splitlines()) < 12, "the run should have been killed mid-way"
    assert run_cli(cli_args(setup, "killed") + ["--resume"]).wait() == 0
    whole, resumed = read_log(root / "whole" / "train_log.jsonl"), read_log(log)
    # the records past the checkpoint were dropped on resuming, then written again: each step once, in order
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == list(range(1, 13))
    for a, b in zip(whole, resumed):
        assert a["loss"] == b["loss"] and a["acc_per_step"] == b["acc_per_step"], a["step"]


def test_two_process_data_parallel_equals_one_process(setup):
    root = setup[0]
    assert run_cli(cli_args(setup, "one", steps=3)).wait() == 0
    torchrun = shutil.which("torchrun") or "torchrun"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([torchrun, "--standalone", "--nproc_per_node", "2", "-m", "eyas.cli",
                           *cli_args(setup, "two", steps=3)], env=env, capture_output=True, text=True, timeout=300)
    # the first lines that name an error, then the end: a rank's own error sits far above torchrun's summary
    errors = [line for line in proc.stderr.splitlines() if "Error" in line or "error:" in line or "abort" in line]
    assert proc.returncode == 0, "\n".join(errors[:20]) + "\n...\n" + proc.stderr[-2000:]
    one, two = read_log(root / "one" / "train_log.jsonl"), read_log(root / "two" / "train_log.jsonl")
    assert len(one) == len(two) == 3
    for a, b in zip(one, two):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)
        assert a["loss_per_step"] == pytest.approx(b["loss_per_step"], rel=1e-4)


def test_frozen_lm_head_stays_the_targets(setup):
    import torch
    from safetensors.torch import load_file

    from eyas import load_model

    cfg = config(setup, "frozen", max_steps=3, draft_vocab_size=512, freeze_lm_head=True)
    train(cfg)
    draft = load_file(setup[0] / "frozen" / "draft" / "model.safetensors")
    target = load_model(setup[1])
    rows = torch.arange(512) + draft["d2t"]
    assert torch.equal(draft["lm_head.weight"].float(), target.lm_head.weight[rows])
    log = read_log(setup[0] / "frozen" / "train_log.jsonl")
    assert len(log) == 3 and log[-1]["loss"] > 0


def run_torchrun(args, nproc=2):
    torchrun = shutil.which("torchrun") or "torchrun"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([torchrun, "--standalone", "--nproc_per_node", str(nproc), *args], env=env,
                          capture_output=True, text=True, timeout=300)
    # the first lines that name an error, then the end: a rank's own error sits far above torchrun's summary
    errors = [line for line in proc.stderr.splitlines() if "Error" in line or "error:" in line or "abort" in line]
    assert proc.returncode == 0, "\n".join(errors[:20]) + "\n...\n" + proc.stderr[-2000:]


def assert_same_steps(expected, got):
    assert [r["step"] for r in got] == [r["step"] for r in expected]
    for a, b in zip(expected, got):
        assert b["loss_per_step"] == pytest.approx(a["loss_per_step"], rel=1e-5), a["step"]
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5, abs=2e-4), a["step"]  # logged to 4 places


def test_fsdp_two_processes_equal_one_process(setup):
    import torch
    from safetensors.torch import load_file

    root = setup[0]
    train(config(setup, "fsdp_one", max_steps=3))
    run_torchrun(["-m", "eyas.cli", *cli_args(setup, "fsdp_two", steps=3), "--fsdp"])
    assert_same_steps(read_log(root / "fsdp_one" / "train_log.jsonl"), read_log(root / "fsdp_two" / "train_log.jsonl"))
    # the exported draft is the whole one, and trained the same
    one, two = (load_file(root / out / "draft" / "model.safetensors") for out in ("fsdp_one", "fsdp_two"))
    assert sorted(one) == sorted(two)
    for key in one:
        assert one[key].shape == two[key].shape and torch.allclose(one[key], two[key], rtol=1e-5, atol=1e-5), key
    # the checkpoint holds whole tensors in exactly the unsharded form: same keys, same optimizer layout
    one, two = (torch.load(root / out / "checkpoint" / "state.pt", weights_only=True) for out in ("fsdp_one",
                                                                                                   "fsdp_two"))
    assert one["step"] == two["step"] == 3 and one["config"] == two["config"]
    assert list(one["draft"]) == list(two["draft"])
    for key in one["draft"]:
        assert torch.allclose(one["draft"][key], two["draft"][key], rtol=1e-5, atol=1e-5), key
    assert one["optimizer"]["param_groups"] == two["optimizer"]["param_groups"]
    assert one["optimizer"]["state"].keys() == two["optimizer"]["state"].keys()
    for i, state in one["optimizer"]["state"].items():
        assert state.keys() == two["optimizer"]["state"][i].keys()
        for name, value in state.items():
            other = two["optimizer"]["state"][i][name]
            assert type(other) is torch.Tensor and other.shape == value.shape, (i, name)
            assert torch.allclose(value, other, rtol=1e-4, atol=1e-7), (i, name)


STOP_AFTER = """
import json, sys

from eyas.train.config import TrainConfig
from eyas.train.trainer import train


def stop(step, record):
    if step == int(sys.argv[2]):  # on every rank, after that step's checkpoint: as if the job had been stopped there
        import torch.distributed as dist

        if dist.is_initialized():  # together: a rank that left first would abort the other's pending collectives
            dist.barrier()
            dist.destroy_process_group()
        sys.exit(0)


train(TrainConfig(**json.loads(sys.argv[1])), resume=True, on_step=stop)
"""


def test_resume_across_fsdp_and_world_sizes(setup, tmp_path):
    """Checkpoints are whole tensors whichever way they were made: 2 sharded ranks for 2 steps, then 1 plain
    process for 2 more, then 2 sharded ranks again give the losses of one uninterrupted plain run."""
    from dataclasses import asdict

    root = setup[0]
    train(config(setup, "mixed_whole", max_steps=6))
    script = tmp_path / "stop_after.py"
    script.write_text(STOP_AFTER)

    def until(stop, fsdp):
        return [str(script), json.dumps(asdict(config(setup, "mixed", max_steps=6, save_every=2, fsdp=fsdp))),
                str(stop)]

    run_torchrun(until(2, fsdp=True))
    plain = subprocess.run([sys.executable, *until(4, fsdp=False)], capture_output=True, text=True, timeout=300)
    assert plain.returncode == 0, plain.stderr[-2000:]
    assert [r["step"] for r in read_log(root / "mixed" / "train_log.jsonl")] == [1, 2, 3, 4]
    run_torchrun(until(6, fsdp=True))
    assert_same_steps(read_log(root / "mixed_whole" / "train_log.jsonl"), read_log(root / "mixed" / "train_log.jsonl"))


def run_cli_captured(args):
    return subprocess.run([sys.executable, "-m", "eyas.cli", *args], capture_output=True, text=True, timeout=300)


def test_ctrl_c_saves_a_checkpoint_and_exits_with_one_line(setup):
    """SIGINT mid-run: the step in progress finishes, a checkpoint of it is written, the exit code is 130 and
    stderr carries no traceback; --resume then completes the run."""
    import torch

    root = setup[0]
    args = cli_args(setup, "interrupted", steps=400)
    args[args.index("--save-every") + 1] = "1000"  # nothing would be saved before the end but for the interrupt
    log = root / "interrupted" / "train_log.jsonl"
    returncode, stderr = interrupt_training(args, log)
    assert returncode == 130, stderr[-2000:]
    assert "Traceback" not in stderr and "interrupted" in stderr
    state = torch.load(root / "interrupted" / "checkpoint" / "state.pt", weights_only=True)
    steps = [r["step"] for r in read_log(log)]
    assert 3 <= state["step"] < 400 and steps == list(range(1, state["step"] + 1))
    assert (root / "interrupted" / "draft" / "model.safetensors").is_file()
    finished = run_cli_captured(cli_args(setup, "interrupted", steps=state["step"] + 2) + ["--resume"])
    assert finished.returncode == 0, finished.stderr[-2000:]
    assert [r["step"] for r in read_log(log)] == list(range(1, state["step"] + 3))


def test_resume_with_a_larger_max_steps_extends_the_run(setup):
    root = setup[0]
    assert run_cli_captured(cli_args(setup, "extended", steps=6)).returncode == 0
    before = read_log(root / "extended" / "train_log.jsonl")
    again = run_cli_captured(cli_args(setup, "extended", steps=6))  # the same --out without --resume
    assert again.returncode == 2 and "--resume" in again.stderr and "Traceback" not in again.stderr
    extended = run_cli_captured(cli_args(setup, "extended", steps=10) + ["--resume"])
    assert extended.returncode == 0, extended.stderr[-2000:]
    after = read_log(root / "extended" / "train_log.jsonl")
    assert [r["step"] for r in after] == list(range(1, 11))
    assert [r["loss"] for r in after[:6]] == [r["loss"] for r in before]
    assert after[9]["lr"] != before[5]["lr"]  # the schedule now runs to step 10


def test_recipe_file_round_trip(setup, tmp_path):
    """The settings file a run writes reads back, through --config, as the same TrainConfig; the command line
    wins over the file; a key eyas does not know, or a value of the wrong kind, is an error naming it."""
    from eyas.cli import parse_args
    from eyas.train.cli import config_from_args

    cfg = config(setup, "recipe", max_steps=2, save_every=2, draft_vocab_size=512, freeze_lm_head=True,
                 eval_prompts=None, threads=1)
    train(cfg)
    recipe = setup[0] / "recipe" / "train_config.yaml"
    assert config_from_args(parse_args(["train", "--config", str(recipe)])) == cfg
    overridden = config_from_args(parse_args(["train", "--config", str(recipe), "--lr", "0.5"]))
    assert overridden.lr == 0.5 and overridden.max_steps == cfg.max_steps
    hand_written = tmp_path / "r.yaml"
    hand_written.write_text("max-steps: 7\nlr: 3e-3\naux_layer_ids: [1, 2, 3]\nfreeze_lm_head: true\n")
    read = parse_args(["train", "--config", str(hand_written)])
    assert (read.max_steps, read.lr, read.aux_layer_ids, read.freeze_lm_head) == (7, 3e-3, [1, 2, 3], True)
    for text, message in [("max_stepz: 3\n", "unknown setting 'max_stepz'"),
                          ("max_steps: 2.5\n", "max_steps expects int"),
                          ("freeze_lm_head: 1\n", "freeze_lm_head is a switch"),
                          ("draft_arch: gru\n", "draft_arch is 'gru'"),
                          ("aux_layer_ids: 3\n", "aux_layer_ids expects a list")]:
        hand_written.write_text(text)
        with pytest.raises(ValueError, match=message):
            parse_args(["train", "--config", str(hand_written)])


def test_eagle31_switches_train_and_are_recorded(setup):
    """--fc-norm --norm-output --norm-before-residual: the draft trains with its norms, the exported config and
    weights carry them, and --resume refuses a run with other switches, naming them."""
    from safetensors import safe_open

    cfg = config(setup, "eagle31", max_steps=3, save_every=3, fc_norm=True, norm_output=True,
                 norm_before_residual=True)
    record = train(cfg)
    assert record["loss"] > 0
    out = setup[0] / "eagle31"
    written = json.loads((out / "draft" / "config.json").read_text())
    assert (written["fc_norm"], written["norm_output"], written["norm_before_residual"],
            written["norm_before_fc"]) == (True, True, True, False)
    with safe_open(str(out / "draft" / "model.safetensors"), "pt") as f:
        norms = [f.get_tensor(f"fc_norm.{i}.weight") for i in range(3)]
    assert all(n.shape == (32,) for n in norms) and any((n != 1).any() for n in norms)  # they were trained
    with pytest.raises(ValueError, match=r"other settings \(norm_output\)"):
        train(config(setup, "eagle31", max_steps=4, fc_norm=True, norm_before_residual=True), resume=True)
    with pytest.raises(ValueError, match="exclude each other"):
        config(setup, "eagle31_both", fc_norm=True, norm_before_fc=True)


def test_acceptance_aware_loss_trains_and_is_part_of_the_run(setup):
    first = train(config(setup, "lk", max_steps=2, save_every=2, loss="lk-lambda"))
    assert first["loss"] > 0 and all(0 <= a <= 1 for a in first["acc_per_step"])
    with pytest.raises(ValueError, match=r"other settings \(loss\)"):
        train(config(setup, "lk", max_steps=3), resume=True)
    with pytest.raises(ValueError, match="is not one of kl"):
        config(setup, "lk_bad", loss="lk")


def test_runs_cannot_trample_each_other_and_a_cut_checkpoint_falls_back(setup, tmp_path):
    """OUT is locked while a run trains (a second run refuses, naming the first's PID); OUT is checked writable
    before the target loads; a state.pt cut short resumes from the checkpoint before it."""
    import torch

    root = setup[0]
    args = cli_args(setup, "locked", steps=400)
    args[args.index("--save-every") + 1] = "1000"
    first = run_cli(args)
    log = root / "locked" / "train_log.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (log.exists() and log.read_text().count("\n") >= 1):
        time.sleep(0.05)
    second = run_cli_captured(cli_args(setup, "locked", steps=400) + ["--resume"])
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    assert second.returncode == 2 and f"in use by another training run (PID {first.pid})" in second.stderr
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="cannot write the output directory"):
        train(TrainConfig(target="/no/such/target", out=str(blocker / "run"), data=str(setup[2])))
    train(config(setup, "fallback", max_steps=4, save_every=2))
    assert not (root / "fallback" / ".lock").exists()  # a finished run leaves no lock behind
    ckpt = root / "fallback" / "checkpoint"
    assert torch.load(ckpt / "state.prev.pt", weights_only=True)["step"] == 2
    before = read_log(root / "fallback" / "train_log.jsonl")
    (ckpt / "state.pt").write_bytes((ckpt / "state.pt").read_bytes()[:1000])  # cut short
    train(config(setup, "fallback", max_steps=6, save_every=2), resume=True)
    after = read_log(root / "fallback" / "train_log.jsonl")
    assert [r["step"] for r in after] == list(range(1, 7))
    assert [r["loss"] for r in after[:4]] == [r["loss"] for r in before]  # steps 3 and 4 ran again, the same


def test_eval_every_logs_the_acceptance_length_and_plots_it(setup, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"category": "code", "prompt": "def add_3(a, b):\n"}) + "\n"
                       + json.dumps({"category": "chat", "turns": ["def add_5(a, b):"]}) + "\n")
    train(config(setup, "evaluated", max_steps=4, eval_every=2, eval_prompts=str(prompts), eval_num_prompts=2,
                 eval_max_new_tokens=6))
    out = setup[0] / "evaluated"
    measured = {r["step"]: r["eval_acceptance_length"] for r in read_log(out / "train_log.jsonl")
                if "eval_acceptance_length" in r}
    assert sorted(measured) == [2, 4] and all(1.0 <= al <= 4.0 for al in measured.values())
    assert (out / "train_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_crafted_training_state_is_refused_in_one_line_without_torchs_advice(tmp_path, capsys):
    """A state.pt holding objects other than tensors (a pickle GLOBAL) or of another shape is refused, naming the
    file, and the run falls back to the state before it; torch's hint to load with weights_only=False never shows."""
    import argparse

    import torch

    from eyas.train.checkpointing import RunDir, load_training_state

    run_dir = RunDir(tmp_path)
    ckpt = run_dir.checkpoint
    ckpt.mkdir()
    good = {"step": 2, "config": {"lr": 1e-3}, "draft": {"w": torch.ones(2)}, "optimizer": {"state": {}}}
    torch.save(good, ckpt / "state.prev.pt")
    for crafted in ({"step": 3, "config": argparse.Namespace(lr=1.0)}, [1, 2, 3], {"step": "3"}):
        torch.save(crafted, ckpt / "state.pt")
        state = load_training_state(run_dir, torch.device("cpu"))
        assert state["step"] == 2 and torch.equal(state["draft"]["w"], good["draft"]["w"])
        err = capsys.readouterr().err
        assert str(ckpt / "state.pt") in err and "weights_only" not in err and len(err.strip().splitlines()) == 1
    torch.save([1], ckpt / "state.prev.pt")
    with pytest.raises(ValueError, match="no readable training state"):
        load_training_state(run_dir, torch.device("cpu"))


def test_a_run_that_teaches_nothing_says_so_and_fails(setup, tmp_path, capsys):
    """A draft vocabulary holding none of the target's next tokens at the loss positions drops every position from
    the loss: loss 0.0 at every step. The run says so and `eyas train` exits 1, instead of printing a result."""
    import torch
    from transformers import AutoTokenizer

    from eyas import load_model
    from eyas.cli import main as cli
    from eyas.train.data import load_dataset
    from eyas.train.vocab import save_vocab

    root, target_dir, data = setup
    target = load_model(target_dir)
    predicted = set()
    with torch.no_grad():
        for example in load_dataset(data, AutoTokenizer.from_pretrained(target_dir), 64):
            predicted |= set(target(torch.tensor([example.input_ids]))[0].argmax(-1).tolist())
    never = [i for i in range(8192) if i not in predicted][:4]  # ids the target never predicts here
    d2t = torch.tensor(never) - torch.arange(4)
    t2d = torch.zeros(8192, dtype=torch.bool)
    t2d[never] = True
    save_vocab(tmp_path / "vocab.safetensors", d2t, t2d, {})
    code = cli(["train", "--target", str(target_dir), "--data", str(data), "--vocab-file",
                str(tmp_path / "vocab.safetensors"), "--out", str(tmp_path / "run"), "--max-steps", "3",
                "--batch-size", "4", "--max-length", "64", "--aux-layer-ids", "1", "2", "3"])
    captured = capsys.readouterr()
    assert code == 1 and "no position was taught" in captured.err and "--draft-vocab-size 0" in captured.err
    assert "last step:" not in captured.out


def tensorboard_scalars(event_dir):
    """{tag: {step: value}} as TensorBoard's own reader gives them (events an earlier run wrote past a resume's
    purge step are dropped by the reader, as in the TensorBoard UI)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(event_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def test_report_to_tensorboard_writes_the_logged_scalars_across_a_resume(setup, tmp_path):
    """`eyas train --report-to tensorboard`: event files under OUT/tensorboard hold the loss, the per-position
    accuracies and the engine's AL at exactly the steps and values of train_log.jsonl, after a run killed at step 3
    (its steps 4-5 logged but not checkpointed) resumed to 6: the rerun steps show once, with the rerun's values."""
    from eyas.cli import main as cli

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"category": "code", "prompt": "def add_3(a, b):\n"}) + "\n")
    args = cli_args(setup, "tensorboard", steps=6) + ["--report-to", "tensorboard", "--eval-every", "3",
                                                     "--eval-prompts", str(prompts), "--eval-num-prompts", "1",
                                                     "--eval-max-new-tokens", "6"]
    out = setup[0] / "tensorboard"
    assert cli(args[:args.index("--max-steps") + 1] + ["5"] + args[args.index("--max-steps") + 2:]) == 0
    (out / "checkpoint" / "state.pt").unlink()  # as if killed after step 5, with the checkpoint of step 3
    assert (out / "checkpoint" / "state.prev.pt").exists()
    assert cli(args + ["--resume"]) == 0
    log = read_log(out / "train_log.jsonl")
    assert [r["step"] for r in log] == list(range(1, 7))
    got = tensorboard_scalars(out / "tensorboard")
    assert got["train/loss"] == {r["step"]: pytest.approx(r["loss"], rel=1e-6) for r in log}
    for k in range(3):
        assert got[f"train/acc_per_step/{k}"] == {r["step"]: pytest.approx(r["acc_per_step"][k], abs=1e-6)
                                                  for r in log}
    assert got["train/eval_acceptance_length"] == {
        r["step"]: pytest.approx(r["eval_acceptance_length"], rel=1e-6) for r in log if "eval_acceptance_length" in r}
    assert sorted(got["train/eval_acceptance_length"]) == [3, 6]


def test_report_to_a_logger_that_is_not_installed_fails_before_loading_anything(setup, tmp_path, capsys,
                                                                               monkeypatch):
    import importlib.util

    from eyas.cli import main as cli

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    code = cli(cli_args(setup, "no-wandb") + ["--report-to", "tensorboard", "wandb"])
    err = capsys.readouterr().err
    assert code != 0 and "--report-to wandb needs the wandb package" in err and "pip install wandb" in err
    assert not (setup[0] / "no-wandb" / "checkpoint").exists()
