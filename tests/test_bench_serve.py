"""`eyas bench serve` run in-process against a tiny random target with an MTP layer: every request completes with
the length it asked for, the figures are well-formed, and the speculative server's acceptance length is read from
its /metrics counters."""

import argparse
import json
import math

import pytest
from tiny import KEY, running

from eyas import LLM
from eyas.bench import SPEC_COUNTERS, acceptance, add_cli, bench_serve, comparison, summarize

STATS = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_cli(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", "serve", *argv])


def check_run(run: dict) -> None:
    assert run["failed"] == 0 and run["completed"] == run["num_requests"], run["errors"]
    for r in run["requests"]:
        assert r["status"] == 200 and r["error"] is None
        assert r["output_len"] == r["expected_output_len"]
        assert 0 < r["ttft"] <= r["e2e"]
    assert run["total_output_tokens"] == sum(r["expected_output_len"] for r in run["requests"])
    assert run["request_throughput"] > 0 and run["output_throughput"] > 0
    for key in STATS:
        s = run[key]
        assert set(s) == {"mean", "p50", "p90", "p99"}
        assert 0 <= s["p50"] <= s["p90"] <= s["p99"], (key, s)


def test_bench_plain_vs_mtp(checkpoint, tmp_path):
    out = tmp_path / "bench.json"
    args = parse("--model", str(checkpoint), "--num-prompts", "6", "--input-len", "16", "--output-len", "12",
                 "--range-ratio", "0.5", "--concurrency", "1", "3", "--speculative-method", "mtp",
                 "--num-speculative-tokens", "2", "--speculative-width", "fixed", "--max-num-seqs", "4",
                 "--repeats", "2", "--json", str(out))  # a fixed width: this random draft would not pay its way
    assert args.func(args) == 0
    report = json.loads(out.read_text())
    # the second repeat starts with the speculative server
    assert [(r["server"], r["concurrency"], r["repeat"]) for r in report["runs"]] == \
        [("plain", 1, 0), ("plain", 3, 0), ("speculative", 1, 0), ("speculative", 3, 0),
         ("speculative", 1, 1), ("speculative", 3, 1), ("plain", 1, 1), ("plain", 3, 1)]
    for run in report["runs"]:
        check_run(run)
        lens = [r["expected_output_len"] for r in run["requests"]]
        assert len(lens) == 6 and all(6 <= n <= 18 for n in lens) and len(set(lens)) > 1  # 12 * [0.5, 1.5]
        assert all(8 <= r["prompt_len"] <= 24 for r in run["requests"])
        if run["server"] == "plain":
            assert run["acceptance_length"] is None and run["speculative"] is None
        else:
            spec = run["speculative"]
            assert 1 <= run["acceptance_length"] <= 3  # 1 + accepted / drafts, K = 2
            # K drafts per verify step, fewer near the end of a request
            assert 0 < spec["num_drafts"] <= spec["num_draft_tokens"] <= 2 * spec["num_drafts"]
            assert run["acceptance_length"] == pytest.approx(1 + spec["num_accepted_tokens"] / spec["num_drafts"])
            # drafting is on throughout here: most tokens come from steps with drafts (not a request's first)
            assert 0.5 < run["drafted_share"] <= 1
    assert [r["concurrency"] for r in report["comparison"]] == [1, 3]
    for row in report["comparison"]:
        assert row["tpot_ratio"] > 0 and row["throughput_ratio"] > 0 and row["acceptance_length"] >= 1
        assert len(row["throughput_ratios"]) == len(row["tpot_ratios"]) == 2
    assert report["config"]["speculative_method"] == "mtp" and report["config"]["request_rate"] == "inf"


def test_bench_a_running_server_with_a_jsonl_dataset_and_poisson_arrivals(checkpoint, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": "def add(a, b):\n"}) + "\n" +
                    json.dumps({"messages": [{"role": "user", "content": "Write a loop."}]}) + "\n")
    llm = LLM(checkpoint, max_num_seqs=4)
    received = []  # max_tokens of every request the engine takes
    add_request = llm.add_request
    llm.add_request = lambda prompt, params: received.append(params.max_tokens) or add_request(prompt, params)
    with running(llm) as (url, _):
        args = parse("--base-url", url, "--api-key", KEY, "--model", str(checkpoint), "--dataset", str(data),
                     "--num-prompts", "4", "--output-len", "5", "--concurrency", "2", "--request-rate", "40",
                     "--num-warmups", "3")
        report = bench_serve(args)
    [run] = report["runs"]
    check_run(run)
    # two short requests once, then 3 untimed at the run's concurrency before its 4 timed ones
    assert len(received) == 2 + 3 + 4 and run["num_requests"] == 4
    assert run["server"] == "server" and report["comparison"] == [] and run["acceptance_length"] is None
    assert report["config"]["served_model_name"] is None  # found in /v1/models
    assert "api_key" not in report["config"] and KEY not in json.dumps(report)  # the key is sent, never reported
    assert all(r["prompt_len"] > 0 and r["output_len"] == 5 for r in run["requests"])


def fake_run(server: str, concurrency: int, repeat: int, tok_s: float, tpot_ms: float,
             counters: dict | None = None) -> dict:
    return {"server": server, "concurrency": concurrency, "repeat": repeat, "output_throughput": tok_s,
            "tpot_ms": {"mean": tpot_ms}, "total_output_tokens": 100, "speculative": counters}


def test_comparison_pairs_each_repeat_and_takes_the_median():
    spec = {"num_drafts": 10, "num_accepted_tokens": 15}
    runs = [fake_run("plain", 1, 0, 100, 10), fake_run("speculative", 1, 0, 150, 5, spec),
            fake_run("speculative", 1, 1, 120, 8, spec), fake_run("plain", 1, 1, 60, 16),  # a slow moment: 2x
            fake_run("plain", 1, 2, 100, 10), fake_run("speculative", 1, 2, 110, 9, spec),
            fake_run("plain", 4, 0, 200, 20)]  # no speculative run at 4: no row
    [row] = comparison(runs)
    assert row["concurrency"] == 1
    assert row["throughput_ratios"] == [1.5, 2.0, 1.1] and row["throughput_ratio"] == 1.5
    assert row["tpot_ratios"] == [0.5, 0.5, 0.9] and row["tpot_ratio"] == 0.5
    assert row["acceptance_length"] == 2.5  # 1 + 45 / 30 over the three speculative runs
    assert row["drafted_share"] == pytest.approx((30 + 45) / 300)


def test_acceptance_length_from_counter_deltas():
    before = dict.fromkeys(SPEC_COUNTERS, 10.0)
    after = {"drafts": 14.0, "draft_tokens": 22.0, "accepted": 16.0}  # 4 verify steps, 12 drafted, 6 accepted
    a = acceptance(before, after)
    assert a["acceptance_length"] == 2.5 and a["acceptance_rate"] == 0.5 and a["num_drafts"] == 4
    assert acceptance(before, before) is None and acceptance(None, after) is None


def test_summarize_is_in_milliseconds_and_ordered():
    s = summarize([0.001 * i for i in range(1, 101)])
    assert s["mean"] == pytest.approx(50.5) and s["p50"] == pytest.approx(50.5)
    assert s["p50"] <= s["p90"] <= s["p99"] <= 100
    assert summarize([]) == {"mean": None, "p50": None, "p90": None, "p99": None}
    assert math.isinf(parse().request_rate) and parse().concurrency == [1]
