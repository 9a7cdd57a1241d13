"""`eyas train --draft-arch dflash`: a DFlash block draft learns, is saved in z-lab's layout and serves, resumes
exactly, trains data parallel as one process does, and refuses the EAGLE-3 settings it would ignore."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tiny import interrupt_training, make_tokenized_target

from eyas.train.config import TrainConfig
from eyas.train.dflash import choose_mask_token_id
from eyas.train.trainer import train


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("train-dflash")
    target = root / "target"
    make_tokenized_target(target)
    data = root / "data.jsonl"
    lines = [{"messages": [{"role": "user", "content": f"def add_{i}(a, b):"},
                           {"role": "assistant", "content": f"    return a + b + {i}\n" * 3}]} for i in range(24)]
    data.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return root, target, data


def config(setup, out, **kw):
    root, target, data = setup
    base = dict(target=str(target), out=str(root / out), data=str(data), draft_arch="dflash", block_size=4,
                num_anchors=8, lr=3e-3, warmup_steps=2, max_steps=8, batch_size=4, max_length=64, save_every=4,
                seed=0)
    base.update(kw)
    return TrainConfig(**base)


def read_log(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("attention", ["mha", "mla", "mha-vocab"])
def test_the_block_loss_falls_and_the_saved_draft_serves_losslessly(setup, attention):
    """mha-vocab: a compressed vocabulary of the data's 24 most frequent loss tokens, its own head."""
    from eyas import load_model
    from eyas.checkpoint import load_dflash_draft
    from eyas.config import SpeculativeConfig
    from eyas.engine.llm import LLM
    from eyas.sampling_params import SamplingParams

    root, target_dir, _ = setup
    mla = {"block_attention": "mla", "block_kv_lora_rank": 16} if attention == "mla" else {}
    vocab = {"draft_vocab_size": 24} if attention == "mha-vocab" else {}
    run = root / f"learns-{attention}"
    train(config(setup, run.name, max_steps=40, save_every=40, block_loss="ce", **mla, **vocab))
    log = read_log(run / "train_log.jsonl")
    first, last = log[:5], log[-5:]
    mean = lambda rs, f: sum(f(r) for r in rs) / len(rs)  # noqa: E731
    assert mean(last, lambda r: r["loss"]) < mean(first, lambda r: r["loss"]) - 0.8
    assert mean(last, lambda r: r["acc_per_step"][0]) > mean(first, lambda r: r["acc_per_step"][0]) + 0.2
    assert len(log[0]["acc_per_step"]) == 3  # rows 1..block_size-1
    draft_dir = run / "draft"
    raw = json.loads((draft_dir / "config.json").read_text())
    assert raw["architectures"] == ["DFlashDraftModel"] and raw["block_size"] == 4
    # one layer: z-lab's rule reads the target's middle layer; the tokenizer's pad token is the mask
    assert raw["dflash_config"] == {"target_layer_ids": [2], "mask_token_id": 2,
                                    **({"attention_mode": "mla"} if mla else {})}
    target = load_model(target_dir)
    if mla:  # the target's MLA shape, its latent as wide as asked
        assert (raw["kv_lora_rank"], raw["qk_rope_head_dim"], raw["q_lora_rank"]) == \
            (16, target.config.qk_rope_head_dim, target.config.q_lora_rank)
    assert raw.get("draft_vocab_size") == vocab.get("draft_vocab_size")
    draft = load_dflash_draft(draft_dir, target)
    state = torch.load(run / "checkpoint" / "state.pt", weights_only=True)
    own = draft.state_dict()
    shared = ("embed_tokens.weight",) if vocab else ("embed_tokens.weight", "lm_head.weight")
    assert draft.shared_weights == shared and set(state["draft"]) == {k for k in own if k not in shared}
    for key, value in state["draft"].items():
        assert torch.equal(own[key], value), key
    prompts = ["def add_3(a, b):\n", "def add_7(a, b):\n    return"]
    params = SamplingParams(temperature=0, max_tokens=24)
    plain = [o.token_ids for o in LLM(str(target_dir)).generate(prompts, params)]
    spec = SpeculativeConfig(method="dflash", draft_model=str(draft_dir))
    outs = LLM(str(target_dir), speculative_config=spec).generate(prompts, params)
    assert [o.token_ids for o in outs] == plain
    assert sum(o.num_drafted for o in outs) > 0  # the draft ran (a random target: its own answers, not the data)
    if vocab:  # its head started from the target's rows of its tokens; soft labels are the target's over them
        loaded = LLM(str(target_dir), speculative_config=spec)
        assert loaded.draft.t2d.sum() == 24
        soft = root / "soft-vocab"
        train(config(setup, soft.name, max_steps=3, save_every=3, block_labels="soft", **vocab))
        assert all(0 < r["loss"] < 20 for r in read_log(soft / "train_log.jsonl"))


class Killed(Exception):
    pass


def kill_after(last):
    def on_step(step, record):
        if step == last:
            raise Killed(step)
    return on_step


def test_resume_continues_exactly(setup):
    """Killed after step 6 (its checkpoint is step 4's), then resumed: steps 5 and 6 run again, the same, and
    the run ends where the uninterrupted one does, to the byte."""
    root = setup[0]
    train(config(setup, "whole", max_steps=8))
    with pytest.raises(Killed):
        train(config(setup, "halves", max_steps=8), on_step=kill_after(6))
    train(config(setup, "halves", max_steps=8), resume=True)
    whole, halves = read_log(root / "whole" / "train_log.jsonl"), read_log(root / "halves" / "train_log.jsonl")
    assert [r["step"] for r in halves] == list(range(1, 9))
    for a, b in zip(whole, halves):
        assert (a["loss"], a["acc_per_step"], a["grad_norm"]) == (b["loss"], b["acc_per_step"], b["grad_norm"])
    for name in ("model.safetensors", "config.json"):
        assert (root / "whole" / "draft" / name).read_bytes() == (root / "halves" / "draft" / name).read_bytes()


def test_ctrl_c_saves_a_checkpoint_and_resume_completes_the_run(setup):
    """SIGINT mid-run of a DFlash draft: the step in progress finishes, its checkpoint and the draft are written,
    the exit code is 130 with no traceback; --resume then runs the remaining steps."""
    root, target, data = setup
    args = ["train", "--draft-arch", "dflash", "--target", str(target), "--data", str(data), "--block-size", "4",
            "--num-anchors", "8", "--batch-size", "4", "--max-length", "64", "--lr", "3e-3", "--warmup-steps", "2",
            "--save-every", "1000", "--out", str(root / "interrupted")]  # nothing saved before the end but for it
    log = root / "interrupted" / "train_log.jsonl"
    returncode, stderr = interrupt_training([*args, "--max-steps", "400"], log)
    assert returncode == 130, stderr[-2000:]
    assert "Traceback" not in stderr and "interrupted" in stderr
    state = torch.load(root / "interrupted" / "checkpoint" / "state.pt", weights_only=True)
    assert 3 <= state["step"] < 400 and [r["step"] for r in read_log(log)] == list(range(1, state["step"] + 1))
    assert json.loads((root / "interrupted" / "draft" / "config.json").read_text())["block_size"] == 4
    finished = subprocess.run([sys.executable, "-m", "eyas.cli", *args, "--max-steps", str(state["step"] + 2),
                               "--resume"], capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr[-2000:]
    assert [r["step"] for r in read_log(log)] == list(range(1, state["step"] + 3))


def test_two_process_data_parallel_equals_one_process(setup):
    root, target, data = setup
    args = ["train", "--draft-arch", "dflash", "--target", str(target), "--data", str(data), "--block-size", "4",
            "--num-anchors", "8", "--max-steps", "3", "--batch-size", "4", "--max-length", "64", "--lr", "3e-3",
            "--warmup-steps", "2"]
    one = subprocess.run([sys.executable, "-m", "eyas.cli", *args, "--out", str(root / "one")], capture_output=True,
                         text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-2000:]
    torchrun = shutil.which("torchrun") or "torchrun"
    two = subprocess.run([torchrun, "--standalone", "--nproc_per_node", "2", "-m", "eyas.cli", *args, "--out",
                          str(root / "two")], env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True,
                         text=True, timeout=300)
    assert two.returncode == 0, two.stderr[-2000:]
    a, b = read_log(root / "one" / "train_log.jsonl"), read_log(root / "two" / "train_log.jsonl")
    assert [r["step"] for r in b] == [1, 2, 3]
    for x, y in zip(a, b):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5) and y["acc_per_step"] == x["acc_per_step"]
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-4, abs=2e-4)


def test_fsdp_two_processes_equal_one_process_and_resume_plainly(setup):
    """--fsdp shards the block draft's own weights (never the target's embedding and lm_head); its checkpoint is a
    plain one: the sharded run's steps equal one process's, and one plain process resumes it to the same end."""
    root, target, data = setup
    args = ["train", "--draft-arch", "dflash", "--target", str(target), "--data", str(data), "--block-size", "4",
            "--num-anchors", "8", "--batch-size", "4", "--max-length", "64", "--lr", "3e-3", "--warmup-steps", "2",
            "--num-draft-layers", "2", "--aux-layer-ids", "1", "3"]
    one = subprocess.run([sys.executable, "-m", "eyas.cli", *args, "--max-steps", "4", "--out", str(root / "fsdp-one")],
                         capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-2000:]
    torchrun = shutil.which("torchrun") or "torchrun"
    two = subprocess.run([torchrun, "--standalone", "--nproc_per_node", "2", "-m", "eyas.cli", *args, "--fsdp",
                          "--max-steps", "2", "--out", str(root / "fsdp-two")],
                         env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300)
    assert two.returncode == 0, two.stderr[-2000:]
    rest = subprocess.run([sys.executable, "-m", "eyas.cli", *args, "--max-steps", "4", "--resume", "--out",
                           str(root / "fsdp-two")], capture_output=True, text=True, timeout=300)
    assert rest.returncode == 0, rest.stderr[-2000:]
    a, b = read_log(root / "fsdp-one" / "train_log.jsonl"), read_log(root / "fsdp-two" / "train_log.jsonl")
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for x, y in zip(a, b):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5) and y["acc_per_step"] == x["acc_per_step"]
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-4, abs=2e-4)


@pytest.mark.parametrize("setting, flag", [({"fc_norm": True}, "--fc-norm"), ({"ttt_steps": 5}, "--ttt-steps"),
                                          ({"loss": "lk-alpha"}, "--loss"),
                                          ({"freeze_lm_head": True}, "--freeze-lm-head")])
def test_eagle3_settings_are_refused_by_name(setup, setting, flag):
    with pytest.raises(ValueError, match=f"{flag}: EAGLE-3 settings, which a DFlash draft does not have"):
        config(setup, "refused", **setting)


def test_dflash_settings_are_checked(setup):
    with pytest.raises(ValueError, match="--block-loss is 'kl'"):
        config(setup, "refused", block_loss="kl")
    with pytest.raises(ValueError, match="--block-labels is 'target'"):
        config(setup, "refused", block_labels="target")
    with pytest.raises(ValueError, match="--block-size must be in 2..64"):
        config(setup, "refused", block_size=1)
    with pytest.raises(ValueError, match="--block-attention is 'gqa'"):
        config(setup, "refused", block_attention="gqa")
    with pytest.raises(ValueError, match="--block-kv-lora-rank 16: the latent width of MLA-shaped layers"):
        config(setup, "refused", block_kv_lora_rank=16)
    with pytest.raises(ValueError, match="--block-size, --num-anchors, --block-attention: DFlash settings, which an "
                                         r"EAGLE-3 draft \(--draft-arch mla\) does not have"):
        config(setup, "refused", draft_arch="mla", block_attention="mla")
    with pytest.raises(ValueError, match="a target with 4 layers has no 2 distinct default target layers .* pass "
                                         "--aux-layer-ids"):
        train(config(setup, "refused", num_draft_layers=2))


class Tokenizer(SimpleNamespace):
    def __len__(self):
        return self.n


def tokenizer(n, pad, eos=1, bos=0):
    return Tokenizer(n=n, pad_token_id=pad, eos_token_id=eos, bos_token_id=bos)


def test_the_mask_token_rule():
    assert choose_mask_token_id(129280, tokenizer(128815, 1)) == 128815  # an embedding padded past the tokenizer
    assert choose_mask_token_id(8192, tokenizer(8192, 2)) == 2  # every row used: the pad token
    assert choose_mask_token_id(8192, tokenizer(8192, 2), override=7) == 7
    with pytest.raises(ValueError, match="--mask-token-id"):
        choose_mask_token_id(8192, tokenizer(8192, None))
    with pytest.raises(ValueError, match="--mask-token-id"):
        choose_mask_token_id(8192, tokenizer(8192, 1))  # the pad token is the end of sentence: the data holds it
    with pytest.raises(ValueError, match="0..8191"):
        choose_mask_token_id(8192, tokenizer(8192, 2), override=8192)


@pytest.mark.parametrize("labels", ["hard", "soft"])
def test_online_and_offline_give_the_same_loss(setup, labels):
    """From a dump of the target layer the draft reads (hidden_states index 3: layer 2's output), the run is the
    online run: the same anchors, blocks and losses; with soft labels the target's distribution comes from the
    dump's last hidden state through the target's head, as online from its forward."""
    from eyas import load_model
    from eyas.engine.llm import load_tokenizer
    from eyas.train.data import load_dataset
    from eyas.train.hidden_states import dump_hidden_states

    root, target_dir, data = setup
    target = load_model(target_dir)
    examples = load_dataset(data, load_tokenizer(target_dir), 64)
    dump = root / "dump"
    if not (dump / "manifest.json").exists():
        dump_hidden_states(target, examples, dump, (3,), examples_per_shard=16, dtype=torch.float32, batch_size=1,
                           target_path=target_dir)
    online = read_log_of(train, config(setup, f"online-{labels}", max_steps=3, block_labels=labels))
    offline = read_log_of(train, config(setup, f"offline-{labels}", data=None, hidden_states=str(dump), max_steps=3,
                                        block_labels=labels))
    assert json.loads((root / f"offline-{labels}" / "draft" / "config.json").read_text())["dflash_config"][
        "target_layer_ids"] == [2]
    for a, b in zip(online, offline):
        assert b["loss_per_step"] == pytest.approx(a["loss_per_step"], rel=1e-5, abs=1e-6)
        assert b["acc_per_step"] == a["acc_per_step"]


def read_log_of(run, cfg):
    run(cfg)
    return read_log(Path(cfg.out) / "train_log.jsonl")


def test_inspect_reads_a_dflash_draft_and_names_what_does_not_fit(setup, tmp_path):
    """`eyas export` has nothing to convert; `eyas inspect TARGET DRAFT` recognises a DFlash draft by its
    config.json and loads it as the engine does: the layers it reads as hidden_states indices, the block; a target
    layer past the target's depth is a mismatch."""
    from eyas import load_model
    from eyas.export import export_draft, save_dflash_draft
    from eyas.inspect import inspect_report
    from eyas.models.dflash import init_dflash_draft, new_dflash_config

    _, target_dir, _ = setup
    target = load_model(target_dir)
    draft = init_dflash_draft(target, new_dflash_config(target.config, 2, 4, (0, 2), 2), seed=1)
    save_dflash_draft(draft, tmp_path / "draft")
    report = inspect_report(target_dir, tmp_path / "draft")
    assert report["ok"] and report["method"] == "dflash", report["problems"]
    with pytest.raises(ValueError, match="is a DFlash block draft .* eyas export converts EAGLE-3 drafts only"):
        export_draft(tmp_path / "draft", tmp_path / "exported", "vllm", target_dir)
    assert not (tmp_path / "exported").exists()
    assert report["draft"]["read as hidden_states"] == [1, 3]
    assert report["draft"]["block"].startswith("4 rows")
    raw = json.loads((tmp_path / "draft" / "config.json").read_text())
    raw["dflash_config"]["target_layer_ids"] = [0, 9]
    (tmp_path / "draft" / "config.json").write_text(json.dumps(raw))
    report = inspect_report(target_dir, tmp_path / "draft")
    assert not report["ok"] and "target_layer_ids" in report["problems"][0] and "0..3" in report["problems"][0]


def test_an_mla_shaped_draft_inspects_and_refuses_the_speculators_format(setup, tmp_path):
    """inspect names the MLA shape and what the draft keeps per context position (the latent and the roped key per
    layer); the speculators format, which has only Qwen3 attention, is refused by name and writes nothing."""
    from eyas import load_model
    from eyas.config import ConfigError
    from eyas.export import export_draft, save_dflash_draft
    from eyas.inspect import inspect_report
    from eyas.models.dflash import init_dflash_draft, new_dflash_config

    _, target_dir, _ = setup
    target = load_model(target_dir)
    c = target.config
    config = new_dflash_config(c, 2, 4, (0, 2), 2, attention_mode="mla", kv_lora_rank=16)
    save_dflash_draft(init_dflash_draft(target, config, seed=1), tmp_path / "draft")
    report = inspect_report(target_dir, tmp_path / "draft")
    assert report["ok"], report["problems"]
    assert report["draft"]["layers"].startswith("2 x MLA-shaped") and "kv_lora 16" in report["draft"]["layers"]
    assert report["draft"]["kept per context position"] == f"{2 * (16 + c.qk_rope_head_dim)} values (all layers)"
    with pytest.raises(ConfigError, match="attention_mode .*mla.* has no speculators format"):
        export_draft(tmp_path / "draft", tmp_path / "exported", "speculators", target_dir)
    assert not (tmp_path / "exported").exists()
