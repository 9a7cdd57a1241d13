"""`eyas eval`: acceptance per category through the real engine, and its report files."""

import json
from pathlib import Path

import pytest
import torch

from eyas import LLM, SamplingParams
from eyas.cli import main as cli
from eyas.eval.acceptance import evaluate
from eyas.records import read_eval_prompts


@pytest.fixture(scope="module")
def copying(tmp_path_factory):
    from tiny import YARN, add_mtp_weights, make_hf_checkpoint, rig_bigram_target_and_copying_mtp

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
    totals = llm.scheduler.metrics
    assert report["overall"]["verify_steps"] == totals.num_verify_steps
    assert report["overall"]["accepted_drafts"] == totals.num_accepted
    assert report["overall"]["acceptance_length"] == pytest.approx(totals.acceptance_length, abs=1e-4)
    assert set(report["categories"]) == {"a", "b"}
    for c in report["categories"].values():
        assert c["requests"] == 1 and c["generated_tokens"] == 20 and c["acceptance_length"] > 3
        assert len(c["accepted_per_position"]) == 3 and c["accepted_per_position"][0] > 0.9


def test_cli_writes_json_and_plot(tmp_path, capsys):
    from eyas.paths import DEFAULT_MODEL

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


def test_without_out_the_report_and_plot_land_beside_the_draft(tmp_path, monkeypatch, capsys):
    from types import SimpleNamespace

    from eyas.eval.acceptance import default_report_path
    from eyas.paths import DEFAULT_DRAFT, DEFAULT_MODEL

    def spec(method, draft=None):
        return SimpleNamespace(method=method, draft_model=draft)

    assert default_report_path(spec("eagle", "runs/mla/draft"), DEFAULT_MODEL) == Path("runs/mla/draft-eval.json")
    assert default_report_path(spec("eagle", str(DEFAULT_DRAFT)), DEFAULT_MODEL) == Path(
        f"eval-{DEFAULT_DRAFT.name}.json")  # never into the installed package
    assert default_report_path(spec("mtp"), DEFAULT_MODEL) == Path(f"eval-mtp-{DEFAULT_MODEL.name}.json")
    if not (DEFAULT_MODEL / "model.safetensors").is_file():
        pytest.skip("no shipped model")
    monkeypatch.chdir(tmp_path)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"category": "code", "prompt": "def f(x):\n"}) + "\n")
    assert cli(["eval", str(prompts), "--speculative-method", "mtp", "--max-new-tokens", "4",
                "--speed-prompts", "0"]) == 0
    out = tmp_path / f"eval-mtp-{DEFAULT_MODEL.name}.json"
    assert json.loads(out.read_text())["overall"]["requests"] == 1
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote eval-mtp-{DEFAULT_MODEL.name}.json and" in capsys.readouterr().err


def test_bad_prompts_file(tmp_path):
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"category": "x"}\n')
    with pytest.raises(ValueError, match="p.jsonl:1"):
        read_eval_prompts(bad)


def test_a_random_draft_is_reported_slower_than_plain(tmp_path, capsys):
    """A draft that accepts nothing costs K draft steps and K extra verify rows for no gain: eval measures the
    speed against plain decoding on the same engine, and both eval and generate say it does not pay."""
    from eyas.checkpoint import load_model
    from eyas.eval.acceptance import slower_than_plain_warning
    from eyas.export import save_draft
    from eyas.models.eagle3 import init_draft, new_draft_config
    from eyas.paths import DEFAULT_MODEL

    assert slower_than_plain_warning(0.96, 96, 100, 1.2) is None  # within timing noise: no warning
    assert "costs more than it saves" in slower_than_plain_warning(0.5, 50, 100, 1.0)
    # a draft accepting almost nothing is reported even when a busy clock times it as fast as plain decoding
    assert "costs more than it saves" in slower_than_plain_warning(1.02, 102, 100, 1.0)
    assert "train the draft longer" in slower_than_plain_warning(0.5, 50, 100, 1.5)
    accepting = slower_than_plain_warning(0.8, 80, 100, 3.5)  # it accepts well; training would not help
    assert "though it accepts well" in accepting and "train" not in accepting
    target = load_model(DEFAULT_MODEL)
    draft = init_draft(target, new_draft_config(target.config, "mla", (2, 4, 5), 0), seed=1)
    torch.nn.init.normal_(draft.lm_head.weight, std=1.0)  # proposals unrelated to the target's
    save_draft(draft, tmp_path / "random")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"category": "code", "prompt": f"def f_{i}(x):\n"}) + "\n"
                               for i in range(2)))
    args = ["--speculative-method", "eagle", "--draft-model", str(tmp_path / "random"), "--num-speculative-tokens",
            "5", "--max-new-tokens", "48"]
    assert cli(["eval", str(prompts), *args, "--speed-prompts", "2", "--out", str(tmp_path / "r.json")]) == 0
    speed = json.loads((tmp_path / "r.json").read_text())["speed"]
    assert speed["acceptance_length"] < 1.3 and speed["speedup"] < 0.95 and speed["same_tokens_as_plain"]
    assert "costs more than it saves" in capsys.readouterr().err
    assert cli(["generate", "--prompt", "def f(x):\n", *args]) == 0
    assert "costs more than it saves" in capsys.readouterr().err


def test_repetitive_outputs_are_counted_apart(copying):
    """A loop cannot pass for a good draft: the report says how many outputs repeat themselves and gives the AL
    over the others; the copying target here writes loops, so all its outputs count as repetitive."""
    from eyas.eval.acceptance import is_repetitive, repeated_share

    assert repeated_share([1, 2, 3, 4] * 8) == pytest.approx(28 / 32)  # all but the first 4-gram's first tokens
    assert repeated_share(list(range(40))) == 0.0
    assert repeated_share([5, 6, 7]) == 0.0
    assert not is_repetitive(list(range(20)) + [0, 1, 2, 3])  # one repeat: 4 of 24 tokens
    records = [{"category": "a", "turns": None, "prompt": "x"}]
    llm = LLM(copying, speculative_method="mtp", num_speculative_tokens=3)
    llm.encode = lambda prompt: [5, 6, 7]
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
    report = evaluate(llm, records, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    overall = report["overall"]
    assert is_repetitive(out.token_ids) and overall["repetitive_outputs"] == 1 and overall["repetitive_share"] == 1
    assert overall["acceptance_length_non_repetitive"] == 1.0  # no verify step left to count


def test_eval_through_a_server_equals_in_process_eval(tmp_path):
    """`eyas serve` stands in for the engine a user deploys on: eval --server, one request at a time, reads the
    same acceptance from the server's counters as the in-process eval counts (greedy), per category too."""
    from tiny import make_served_checkpoint, running

    from eyas.client import ServerClient, ServerError
    from eyas.eval.acceptance import evaluate_by_server

    target = make_served_checkpoint(tmp_path / "target")
    records = [{"category": "code", "prompt": "def f(x):\n", "turns": None},
               {"category": "chat", "prompt": None, "turns": ["Write a loop.", "Again, shorter."]},
               {"category": "code", "prompt": "import os\n", "turns": None}]
    params = SamplingParams(temperature=0, max_tokens=12)
    local = evaluate(LLM(target, max_num_seqs=1, speculative_method="mtp"), records, params)
    with running(LLM(target, max_num_seqs=1, speculative_method="mtp"), api_key=None) as (url, _):
        remote = evaluate_by_server(ServerClient(url), records, params)
    for key in ("acceptance_length", "verify_steps", "accepted_drafts", "accepted_per_position", "requests",
                "generated_tokens", "repetitive_outputs"):
        assert remote["overall"][key] == local["overall"][key], key
        for category in ("code", "chat"):
            assert remote["categories"][category][key] == local["categories"][category][key], (category, key)
    assert local["overall"]["verify_steps"] > 0
    overall = remote["overall"]  # every request returned tokens: those after each one's first, per verify step
    assert overall["acceptance_length_returned"] == round((overall["generated_tokens"] - overall["requests"])
                                                          / overall["verify_steps"], 4)
    with running(LLM(target, max_num_seqs=1, speculative_method="mtp"), api_key=None) as (url, _):
        grouped = evaluate_by_server(ServerClient(url), records * 2, params, concurrency=3)
    for key in ("verify_steps", "accepted_drafts", "requests", "generated_tokens"):  # every record twice
        assert grouped["overall"][key] == 2 * local["overall"][key], key
    for key in ("acceptance_length", "accepted_per_position"):
        assert grouped["overall"][key] == local["overall"][key], key
    assert grouped["overall"]["acceptance_length_non_repetitive"] is None  # no per-request split when grouped
    with running(LLM(target, max_num_seqs=1), api_key=None) as (url, _):  # a server that does not speculate
        with pytest.raises(ServerError, match="no vllm:spec_decode_num_drafts counter"):
            evaluate_by_server(ServerClient(url), records[:1], params)


def test_eval_reads_sglang_per_response_counts_when_there_are_no_counters():
    """SGLang: no /metrics, each response's meta_info has spec_verify_ct (and an acceptance histogram): AL is
    completion tokens / verify steps, position k accepted in the steps that accepted k drafts or more."""
    import httpx

    from eyas.client import ServerClient
    from eyas.eval.acceptance import evaluate_by_server

    def sglang(request):
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        if request.url.path == "/metrics":
            return httpx.Response(404, text="Not Found")
        # 10 tokens in 4 verify steps: 2 steps accepted 1 draft, 2 accepted 2 (2 + 2 + 3 + 3 = 10)
        return httpx.Response(200, json={"choices": [{"text": "x", "finish_reason": "length"}],
                                         "usage": {"completion_tokens": 10},
                                         "meta_info": {"spec_verify_ct": 4, "spec_accept_histogram": [0, 2, 2]}})

    client = ServerClient("http://sglang:30000", transport=httpx.MockTransport(sglang))
    records = [{"category": "code", "prompt": "def f(x):\n", "turns": None}] * 2
    for concurrency in (1, 2):
        overall = evaluate_by_server(client, records, SamplingParams(temperature=0, max_tokens=10),
                                     concurrency)["overall"]
        assert (overall["requests"], overall["verify_steps"], overall["accepted_drafts"]) == (2, 8, 12)
        assert overall["acceptance_length"] == 2.5 and overall["accepted_per_position"] == [1.0, 0.5]


def vllm_stand_in(metrics: list[str], answer: dict | None = None):
    """A vLLM whose /metrics answers the texts of `metrics` in turn (the last one from then on)."""
    import httpx

    reads = []

    def vllm(request):
        if request.url.path == "/metrics":
            reads.append(1)
            return httpx.Response(200, text=metrics[min(len(reads), len(metrics)) - 1])
        return httpx.Response(200, json=answer or {"choices": [{"text": "x", "finish_reason": "length"}],
                                                   "usage": {"completion_tokens": 10}})

    return httpx.MockTransport(vllm)


def counters(drafts, accepted=0, drafted=0) -> str:
    return (f"vllm:spec_decode_num_drafts_total{{model_name=\"m\"}} {drafts}\n"
            f"vllm:spec_decode_num_draft_tokens_total{{model_name=\"m\"}} {drafted}\n"
            f"vllm:spec_decode_num_accepted_tokens_total{{model_name=\"m\"}} {accepted}\n")


@pytest.mark.parametrize("before, after, expected", [
    (counters(2000, 6000, 9000), counters(20, 50, 90),
     "http://vllm:8000/metrics: counter vllm:spec_decode_num_drafts went from 2000 to 20: the server restarted or "
     "the counter was reset; rerun"),
    (counters(0), counters("NaN"), "http://vllm:8000/metrics: counter vllm:spec_decode_num_drafts is nan"),
    (counters(0), counters(4.5), "http://vllm:8000/metrics: counter vllm:spec_decode_num_drafts is 4.5"),
    (counters(0), counters(4, accepted=30, drafted=12), "vllm:spec_decode_num_accepted_tokens rose by 30 but "
     "vllm:spec_decode_num_draft_tokens only by 12"),
    (counters(0), counters(4) + 'vllm:spec_decode_num_drafts_total{model_name="m"} 1 1712345678000\n',
     None),  # a timestamp is not the value: 4 + 1 drafts
])
def test_eval_by_server_refuses_counters_that_do_not_count(before, after, expected):
    """A restarted server's counters go backwards; their delta would read as an acceptance length (4.03 from
    verify_steps -1980). Such counters, and ones that are not whole numbers, stop eval naming the server and the
    counter."""
    from eyas.client import ServerClient, ServerError
    from eyas.eval.acceptance import evaluate_by_server

    client = ServerClient("http://vllm:8000", model="m", retries=0, transport=vllm_stand_in([before, after]))
    records = [{"category": "code", "prompt": "def f(x):\n", "turns": None}]
    params = SamplingParams(temperature=0, max_tokens=10)
    if expected is None:
        assert evaluate_by_server(client, records, params)["overall"]["verify_steps"] == 5
        return
    with pytest.raises(ServerError) as refused:
        evaluate_by_server(client, records, params)
    assert expected in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize("meta, tokens, expected", [
    ({"spec_verify_ct": 12}, 10, "http://sglang:30000: an answer counts 12 verify steps (meta_info.spec_verify_ct) "
                                 "for 10 tokens"),
    ({"spec_verify_ct": -1}, 10, "meta_info.spec_verify_ct is -1"),
    ({"spec_verify_ct": 4}, -10, "usage.completion_tokens is -10"),
    ({"spec_verify_ct": 4}, 10.5, "usage.completion_tokens is 10.5"),
])
def test_eval_by_server_refuses_per_response_counts_that_do_not_count(meta, tokens, expected):
    from eyas.client import ServerClient, ServerError
    from eyas.eval.acceptance import evaluate_by_server

    answer = {"choices": [{"text": "x", "finish_reason": "length"}], "usage": {"completion_tokens": tokens},
              "meta_info": meta}
    client = ServerClient("http://sglang:30000", model="m", retries=0, transport=vllm_stand_in([""], answer))
    with pytest.raises(ServerError) as refused:
        evaluate_by_server(client, [{"category": "c", "prompt": "p", "turns": None}],
                           SamplingParams(temperature=0, max_tokens=10))
    assert expected in str(refused.value) and "\n" not in str(refused.value)


def test_eval_cli_names_a_restarted_server_in_one_line(tmp_path, capsys):
    """Through the command line: exit 2, one line naming the server and the counter, no report."""
    from tiny import reply, stand_in

    reads = []

    def restarted(h):
        if h.path == "/metrics":
            reads.append(1)
            reply(h, counters(2000, 6000, 9000) if len(reads) == 1 else counters(20, 50, 90))
        else:
            reply(h, {"choices": [{"text": "x", "finish_reason": "length"}], "usage": {"completion_tokens": 10}})

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"category": "code", "prompt": "def f(x):\n"}) + "\n")
    with stand_in(restarted) as url:
        code = cli(["eval", str(prompts), "--server", url, "--served-model-name", "m", "--retries", "0",
                    "--request-timeout", "5"])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    assert captured.err == (f"eyas eval: error: {url}/metrics: counter vllm:spec_decode_num_drafts went from 2000 "
                            "to 20: the server restarted or the counter was reset; rerun\n")
