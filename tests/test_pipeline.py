"""`eyas pipeline`: one recipe runs regenerate -> calibrate-vocab -> dump -> train -> eval -> export; killed in a
stage, a rerun skips the stages already done and resumes the one that was cut."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml
from tiny import make_tokenized_target, reply, stand_in

from eyas.pipeline import PipelineError, read_recipe, stage_commands


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    target = root / "target"
    make_tokenized_target(target)
    data = root / "conversations.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"def add_{i}(a, b):"},
                                                     {"role": "assistant", "content": "    return a + b\n"}]}) + "\n"
                            for i in range(16)))
    extra = root / "text.jsonl"
    extra.write_text("".join(json.dumps({"text": f"for i in range({i}):\n    print(i)\n"}) + "\n" for i in range(8)))
    prompts = root / "prompts.jsonl"
    prompts.write_text(json.dumps({"category": "code", "prompt": "def f(x):\n"}) + "\n")
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump({
        "target": str(target), "work_dir": str(root / "work"), "data": str(data), "extra_data": [str(extra)],
        "regenerate": {"max_new_tokens": 6, "threads": 1},
        "calibrate_vocab": {"draft_vocab_size": 512, "max_length": 64},
        "dump_hidden_states": {"max_length": 64, "aux_layer_ids": [1, 2, 3]},
        "train": {"max_steps": 40, "batch_size": 4, "max_length": 64, "save_every": 2, "warmup_steps": 2},
        "eval": {"prompts": str(prompts), "max_new_tokens": 6, "speed_prompts": 0},
        "export": {"formats": ["vllm", "sglang"]},
    }))
    return path


def run(recipe_path):
    return subprocess.Popen([sys.executable, "-m", "eyas.cli", "pipeline", str(recipe_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_killed_in_training_then_rerun_resumes(recipe):
    work = recipe.parent / "work"
    log = work / "draft" / "train_log.jsonl"
    proc = run(recipe)
    deadline = time.time() + 240
    while time.time() < deadline and not (log.exists() and len(log.read_text().splitlines()) >= 5):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert 5 <= len(log.read_text().splitlines()) < 40, "the pipeline should have been killed in training"
    stale = work / "draft" / "export-vllm" / "stale.bin"  # an earlier export's file: the export stage removes it
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"old")
    assert set(json.loads((work / "stages.json").read_text())) == {"regenerate", "calibrate_vocab",
                                                                   "dump_hidden_states"}
    proc = run(recipe)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    for stage in ("regenerate", "calibrate_vocab", "dump_hidden_states"):
        assert f"{stage}: done earlier, skipped" in stderr
    steps = [json.loads(line)["step"] for line in log.read_text().splitlines()]
    assert steps == list(range(1, 41))  # each step once: the records past the checkpoint were rerun
    assert len((work / "regenerated.jsonl").read_text().splitlines()) == 16
    assert len((work / "train_data.jsonl").read_text().splitlines()) == 24
    report = json.loads((work / "draft" / "eval.json").read_text())
    assert report["settings"]["draft_model"] == str(work / "draft" / "draft")
    for fmt in ("vllm", "sglang"):
        assert (work / "draft" / f"export-{fmt}" / "model.safetensors").is_file()
    assert not stale.exists()
    # all done: a third run skips every stage
    proc = run(recipe)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0 and stderr.count("done earlier, skipped") == 7, stderr[-3000:]


def test_bad_recipes_are_refused_naming_the_key(tmp_path):
    path = tmp_path / "r.yaml"
    for recipe, message in [({"work_dir": "w", "data": "d", "trian": {}}, "unknown key"),
                            ({"work_dir": "w"}, "data must be set"),
                            ({"work_dir": "w", "data": "d", "train": {"lr": "fast"}}, "lr"),
                            ({"work_dir": "w", "data": "d", "train": {"out": "x"}}, "pipeline sets itself"),
                            ({"work_dir": "w", "data": "d", "regenerate": {"max_new_tokenz": 3}},
                             "unknown setting 'max_new_tokenz'")]:
        path.write_text(yaml.safe_dump(recipe))
        with pytest.raises((PipelineError, ValueError), match=message):
            stage_commands(read_recipe(path), path)


def answer_every_chat(seen: list):
    """A stand-in's handler: one short reply to every chat request, each request's Authorization header kept in
    `seen`."""
    def handle(h):
        seen.append(h.headers.get("Authorization"))
        if h.command == "GET":
            return reply(h, {"object": "list", "data": [{"id": "stand-in", "object": "model"}]})
        reply(h, {"object": "chat.completion", "usage": {"completion_tokens": 2, "prompt_tokens": 3},
                  "choices": [{"index": 0, "finish_reason": "length",
                               "message": {"role": "assistant", "content": "return 1"}}]})

    return handle


def test_an_api_key_in_a_recipe_is_sent_but_never_printed_or_written(tmp_path, capsys):
    from eyas.pipeline import run_pipeline

    key = "sk-recipe-secret-4f9c"
    data = tmp_path / "conversations.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "def f():"},
                                             {"role": "assistant", "content": "pass"}]}) + "\n")
    seen: list = []
    with stand_in(answer_every_chat(seen)) as url:
        path = tmp_path / "recipe.yaml"
        path.write_text(yaml.safe_dump({
            "work_dir": str(tmp_path / "work"), "data": str(data),
            "regenerate": {"server": url, "api_key": key, "max_new_tokens": 4, "retries": 0},
            "train": {"max_steps": 0}}))  # refused by train: the pipeline stops after regenerate
        assert run_pipeline(path, dry_run=True) == 0
        code = run_pipeline(path)
    out, err = capsys.readouterr()
    assert code != 0 and "regenerate" in json.loads((tmp_path / "work" / "stages.json").read_text())
    assert f"Bearer {key}" in seen  # the server got the key...
    assert "--api-key ***" in out and "--api-key ***" in err
    assert key not in out + err  # ...and nothing printed it or wrote it under the work dir
    for f in (tmp_path / "work").rglob("*"):
        assert not f.is_file() or key.encode() not in f.read_bytes(), f


def test_names_and_export_formats_cannot_leave_the_work_dir(tmp_path):
    path = tmp_path / "r.yaml"
    for recipe, message in [({"name": ".."}, "name is '..'"), ({"name": "a/b"}, "name is 'a/b'"),
                            ({"name": ".hidden"}, "name is '.hidden'"),
                            ({"export": {"format": "vllm/../../x"}}, "export format 'vllm/../../x' is not one of"),
                            ({"export": {"formats": ["vllm", ".."]}}, "export format '..' is not one of")]:
        path.write_text(yaml.safe_dump({"work_dir": str(tmp_path / "w"), "data": "d", **recipe}))
        with pytest.raises(PipelineError, match=message.replace(".", r"\.").replace("/", "/")):
            stage_commands(read_recipe(path), path)


def test_the_stale_export_cleanup_removes_only_an_export_dir_in_the_work_dir(tmp_path):
    from eyas.pipeline import remove_stale_export

    work = tmp_path / "work"
    stale = work / "draft" / "export-vllm"
    stale.mkdir(parents=True)
    (stale / "old.safetensors").write_bytes(b"old")
    remove_stale_export(stale, work)
    assert not stale.exists()
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / "model.safetensors").write_bytes(b"keep")
    link = work / "draft" / "export-sglang"
    link.symlink_to(outside, target_is_directory=True)
    for directory in (outside, link, work / "draft", work / "draft" / ".." / ".." / "precious",
                      work / "draft" / "eval"):
        with pytest.raises(PipelineError, match="not an export directory"):
            remove_stale_export(directory, work)
    assert (outside / "model.safetensors").read_bytes() == b"keep"


def test_dry_run_and_run_name_missing_inputs_before_any_stage(tmp_path, capsys):
    from eyas.pipeline import run_pipeline

    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({"work_dir": str(tmp_path / "work"), "data": str(tmp_path / "selected.jsonl"),
                                    "extra_data": [str(tmp_path / "text.jsonl")], "train": {"max_steps": 2}}))
    assert run_pipeline(path, dry_run=True) == 1
    out = capsys.readouterr().out
    assert f"missing input: data: {tmp_path / 'selected.jsonl'}" in out
    assert f"missing input: extra_data: {tmp_path / 'text.jsonl'}" in out
    with pytest.raises(PipelineError, match="missing inputs: data: .*selected.jsonl; extra_data: .*text.jsonl"):
        run_pipeline(path)
    assert not (tmp_path / "work").exists()  # nothing started, so nothing looks resumable


def test_from_a_stage_reruns_it_and_the_later_ones_moving_resumable_outputs_aside(recipe, capsys):
    """After the full run of test_killed_in_training_then_rerun_resumes: --from eval reruns eval and the exports
    only; forget_from train moves the draft's directory aside instead of deleting it."""
    from eyas.pipeline import forget_from, run_pipeline

    work = recipe.parent / "work"
    if not (work / "draft" / "eval.json").is_file():
        pytest.skip("runs after test_killed_in_training_then_rerun_resumes")
    assert run_pipeline(recipe, from_stage="eval") == 0
    err = capsys.readouterr().err
    assert err.count("done earlier, skipped") == 4  # regenerate, calibrate_vocab, dump_hidden_states, train
    assert "draft: eval: eyas eval" in err and "draft: export vllm: eyas export" in err
    stages = stage_commands(read_recipe(recipe), recipe)
    done = json.loads((work / "stages.json").read_text())
    forget_from("train", stages, done, read_recipe(recipe), work)
    assert not (work / "draft").exists() and (work / "draft.old-1" / "draft" / "model.safetensors").is_file()
    assert set(done) == {"regenerate", "calibrate_vocab", "dump_hidden_states"}
    (work / "draft.old-1").rename(work / "draft")
    with pytest.raises(PipelineError, match="--from regenerate: this recipe runs only"):
        forget_from("regenerate", [s for s in stages if s[0] != "regenerate"], {}, read_recipe(recipe), work)


def test_a_dflash_recipe_dumps_trains_and_evaluates_a_block_draft(recipe, tmp_path):
    """train.draft_arch dflash: the dump's layers become the draft's target layers, eval runs it as dflash; the
    stages a block draft has no use for are refused before anything runs."""
    base = yaml.safe_load(recipe.read_text())
    dflash = {"target": base["target"], "work_dir": str(tmp_path / "work"), "name": "block", "data": base["data"],
              "dump_hidden_states": {"max_length": 64, "aux_layer_ids": [1, 3]},
              "train": {"draft_arch": "dflash", "block_size": 4, "num_anchors": 8, "max_steps": 4, "batch_size": 4,
                        "max_length": 64, "warmup_steps": 2},
              "eval": base["eval"]}
    path = tmp_path / "dflash.yaml"
    for stage in ("calibrate_vocab", "export"):
        path.write_text(yaml.safe_dump({**dflash, stage: base[stage]}))
        with pytest.raises(PipelineError, match=f"{stage} with train.draft_arch dflash"):
            stage_commands(read_recipe(path), path)
    path.write_text(yaml.safe_dump(dflash))
    commands = dict(stage_commands(read_recipe(path), path))
    assert commands["eval"][commands["eval"].index("--speculative-method") + 1] == "dflash"
    proc = run(path)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    own = tmp_path / "work" / "block"
    config = json.loads((own / "draft" / "config.json").read_text())
    assert config["dflash_config"]["target_layer_ids"] == [0, 2]  # hidden_states 1 and 3: layers 0 and 2's outputs
    report = json.loads((own / "eval.json").read_text())
    assert len(report["overall"]["accepted_per_position"]) == 3  # block 4: three drafts a step
