"""`eyas eval`: acceptance per category through the real engine, and its report files."""

import json

import pytest
import torch

from eyas import LLM, SamplingParams
from eyas.cli import main as cli
from eyas.eval.acceptance import evaluate, read_prompts


@pytest.fixture(scope="module")
def copying(tmp_path_factory):
    from test_checkpoint import add_mtp_weights
    from test_speculative import rig_bigram_target_and_copying_mtp
    from tiny import YARN, make_hf_checkpoint

    path = tmp_path_factory.mktemp("copying")
    make_hf_checkpoint(path, rope_parameters=YARN)
    add_mtp_weights(path)
    rig_bigram_target_and_copying_mtp(path)
    return path


def test_report_adds_up_the_requests(copying):
    records = [{"category": "a", "turns": None, "prompt": None}, {"category": "b", "turns": None, "prompt": None}]
    llm = LLM(copying, speculative_method="mtp", num_speculative_tokens=3)
    llm.encode = lambda prompt: [5, 6, 7] if prompt == "x" else [9, 10]  # token-id prompts, no tokenizer needed
    records[0]["prompt"], records[1]["prompt"] = "x", "y"
    report = evaluate(llm, records, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    totals = llm.speculative.metrics
    assert report["overall"]["verify_steps"] == totals.num_verify_steps
    assert report["overall"]["accepted_drafts"] == totals.num_accepted
    assert report["overall"]["acceptance_length"] == pytest.approx(totals.acceptance_length, abs=1e-4)
    assert set(report["categories"]) == {"a", "b"}
    for c in report["categories"].values():
        assert c["requests"] == 1 and c["generated_tokens"] == 20 and c["acceptance_length"] > 3
        assert len(c["accepted_per_position"]) == 3 and c["accepted_per_position"][0] > 0.9


def test_cli_writes_json_and_plot(tmp_path, capsys):
    from eyas.engine.llm import DEFAULT_MODEL

    if not (DEFAULT_MODEL / "model.safetensors").is_file():
        pytest.skip("no shipped model")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"category": "code", "prompt": "def f(x):\n"}) + "\n"
                       + json.dumps({"category": "chat", "turns": ["Complete: def g():", "Again."]}) + "\n")
    torch.manual_seed(0)
    code = cli(["eval", str(prompts), "--speculative-method", "mtp", "--max-new-tokens", "8",
                "--out", str(tmp_path / "r.json")])
    assert code == 0
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["categories"]["chat"]["requests"] == 2 and report["categories"]["code"]["requests"] == 1
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_prompts_file(tmp_path):
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"category": "x"}\n')
    with pytest.raises(ValueError, match="p.jsonl:1"):
        read_prompts(bad)
