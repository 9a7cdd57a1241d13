"""`eyas bench serve`: load an OpenAI-compatible server with streaming requests and report latency and throughput,
like `vllm bench serve`.

    eyas bench serve --speculative-method mtp --num-speculative-tokens 3 --concurrency 1 4 16
    eyas bench serve --base-url http://127.0.0.1:8000 --dataset prompts.jsonl --request-rate 8

Without --base-url it serves --model itself, in this process, on a free loopback port: once plain and once
speculative (the speculative arguments as `eyas serve` reads them: the bundled target drafts with its bundled MLA
draft unless told otherwise; `--speculative-method none` runs plain only), one server at a time so the two never
share the CPU; with --repeats N, N times each, alternating which server goes first, and the comparison takes the
median of the N paired ratios. The load runs in this process too, so on CPU the client's Python competes with the
engine thread for the GIL; both servers pay that cost alike. Every request sends `ignore_eos` and `max_tokens`, so
every output has the length the load asked for.

Per request, from the SSE stream (token counts from `return_token_ids`, so a chunk carrying several accepted
speculative tokens counts them all):
    TTFT  send -> first chunk with a token
    TPOT  (E2E - TTFT) / (output tokens - 1), the mean time per token after the first
    E2E   send -> last byte
Acceptance length is read from the server's /metrics speculative counters (vLLM's names), before and after a run:
    AL = 1 + delta(accepted tokens) / delta(drafts)      # tokens each verify step of one sequence yields
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from eyas.engine_args import EngineArgs
from eyas.records import read_prompt_file

if TYPE_CHECKING:
    import httpx

    from eyas.client import ServerClient

PERCENTILES = (50, 90, 99)


@dataclass(slots=True)
class BenchRequest:
    endpoint: str  # "completions" | "chat/completions"
    prompt: list[int] | str | list[dict]  # token ids or text (completions), messages (chat)
    prompt_len: int  # tokens, when known before sending (random dataset); -1 otherwise
    output_len: int  # max_tokens, sent with ignore_eos: the exact number of tokens expected


@dataclass(slots=True)
class RequestResult:
    prompt_len: int
    expected_output_len: int
    output_len: int = 0
    ttft: float | None = None  # seconds
    tpot: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)  # gaps between token-carrying chunks
    status: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None


# -- the load -------------------------------------------------------------------------------------------------------

def random_requests(num: int, input_len: int, output_len: int, range_ratio: float, vocab_size: int,
                    special_ids: set[int], seed: int) -> list[BenchRequest]:
    """Token-id prompts of input_len * [1 - r, 1 + r] tokens, outputs of output_len * [1 - r, 1 + r] tokens."""
    rng = random.Random(seed)
    allowed = [t for t in range(vocab_size) if t not in special_ids]

    def around(n: int) -> int:
        return max(1, rng.randint(math.floor(n * (1 - range_ratio)), math.ceil(n * (1 + range_ratio))))

    out = []
    for _ in range(num):
        n = around(input_len)
        out.append(BenchRequest("completions", [rng.choice(allowed) for _ in range(n)], n, around(output_len)))
    return out


def file_requests(path: Path, num: int | None, output_len: int) -> list[BenchRequest]:
    """JSONL records with a `prompt` string (/v1/completions), chat `messages` or `turns` (/v1/chat/completions;
    the first turn), repeated in order up to `num`."""
    prompts = read_prompt_file(path)
    num = num or len(prompts)
    return [BenchRequest("completions" if isinstance(p, str) else "chat/completions", p, -1, output_len)
            for p in (prompts[i % len(prompts)] for i in range(num))]


async def send(http: httpx.AsyncClient, model: str, req: BenchRequest, temperature: float,
               timeout: float | None = None) -> RequestResult:
    """One streaming request; its timings come from the SSE chunks as they arrive. It may take `timeout` seconds in
    all (httpx's own timeout bounds each read, which a server sending a byte now and then never trips)."""
    from eyas.client import MAX_RESPONSE_BYTES

    body = _request_body(model, req, temperature)
    result = RequestResult(req.prompt_len, req.output_len)
    counted = 0  # tokens seen in the chunks, for a server that sends no usage
    start = last = time.perf_counter()

    async def read() -> None:
        nonlocal counted, last
        async with http.stream("POST", f"/v1/{req.endpoint}", json=body) as r:
            result.status = r.status_code
            if r.status_code != 200:
                result.error = (await r.aread()).decode(errors="replace")[:500]
                return
            async for line in _lines(r, MAX_RESPONSE_BYTES):
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = json.dumps(chunk["error"])[:500]
                    return
                if chunk.get("usage"):
                    tokens = chunk["usage"].get("completion_tokens")
                    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
                        result.error = f"usage.completion_tokens is {tokens!r:.60}; expected a whole number"
                        return
                    result.output_len = tokens
                    if req.prompt_len < 0:
                        result.prompt_len = chunk["usage"]["prompt_tokens"]
                choices = chunk.get("choices") or []
                n = sum(len(c.get("token_ids") or []) for c in choices)
                counted += n
                # a server without return_token_ids: a chunk with text still marks a step's tokens arriving
                if n == 0 and not any(c.get("text") or (c.get("delta") or {}).get("content") for c in choices):
                    continue
                now = time.perf_counter()
                if result.ttft is None:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now

    try:
        await asyncio.wait_for(read(), timeout)
    except asyncio.TimeoutError:
        result.error = f"TimeoutError: no complete answer within {timeout:g} s"
        return result
    except Exception as e:  # a dropped connection or a malformed chunk: the request failed, the run goes on
        result.error = f"{type(e).__name__}: {e}"
        return result
    if result.error is not None:
        return result
    _finish(result, req, time.perf_counter() - start, counted)
    return result


def _request_body(model: str, req: BenchRequest, temperature: float) -> dict:
    """The streaming request's JSON: `ignore_eos` with `max_tokens`, so the output has exactly the length asked for,
    and `return_token_ids`, so a chunk carrying several speculative tokens counts them all."""
    body = {"model": model, "max_tokens": req.output_len, "temperature": temperature, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True, "return_token_ids": True}
    body["messages" if req.endpoint == "chat/completions" else "prompt"] = req.prompt
    return body


def _finish(result: RequestResult, req: BenchRequest, e2e: float, counted: int) -> None:
    """Fill in a completed stream's E2E, output length (the usage's, else the tokens counted in the chunks) and
    TPOT, and mark an output of another length than asked for as an error."""
    result.e2e = e2e
    result.output_len = result.output_len or counted
    if result.output_len > 1 and result.ttft is not None:
        result.tpot = (result.e2e - result.ttft) / (result.output_len - 1)
    if result.output_len != req.output_len:
        result.error = f"expected {req.output_len} output tokens, got {result.output_len}"


async def _lines(r: httpx.Response, limit: int) -> AsyncIterator[str]:
    """The lines of a streamed answer, refusing one of more than `limit` bytes in all (httpx's aiter_lines would
    hold an endless line in memory)."""
    received, pending = 0, []
    async for data in r.aiter_bytes():
        received += len(data)
        if received > limit:
            raise ValueError(f"the answer is larger than {limit} bytes; stopped reading there")
        *complete, rest = data.split(b"\n")
        if complete:
            complete[0] = b"".join(pending) + complete[0]
            pending = []
        for line in complete:
            yield line.rstrip(b"\r").decode(errors="replace")
        pending.append(rest)
    if any(pending):
        yield b"".join(pending).rstrip(b"\r").decode(errors="replace")


async def run_load(base_url: str, model: str, requests: list[BenchRequest], concurrency: int, request_rate: float,
                   temperature: float, api_key: str | None, seed: int, timeout: float,
                   desc: str) -> tuple[list[RequestResult], float]:
    """Send `requests` with at most `concurrency` in flight, arriving as a Poisson process of `request_rate`
    per second (inf: all at once). Returns the results in request order and the wall time of the run."""
    import httpx
    from tqdm import tqdm

    rng = random.Random(seed)
    limit = asyncio.Semaphore(concurrency)
    bar = tqdm(total=len(requests), desc=desc, unit="req", file=sys.stderr, leave=False)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=timeout, limits=limits) as http:
        async def one(req: BenchRequest) -> RequestResult:
            async with limit:
                result = await send(http, model, req, temperature, timeout)
            bar.update(1)
            return result

        start = time.perf_counter()
        tasks = []
        for i, req in enumerate(requests):
            if i and math.isfinite(request_rate):
                await asyncio.sleep(rng.expovariate(request_rate))
            tasks.append(asyncio.create_task(one(req)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    bar.close()
    return list(results), duration


# -- the server's counters ------------------------------------------------------------------------------------------

SPEC_COUNTERS = {"drafts": "vllm:spec_decode_num_drafts", "draft_tokens": "vllm:spec_decode_num_draft_tokens",
                 "accepted": "vllm:spec_decode_num_accepted_tokens"}


def spec_counters(client: ServerClient) -> dict[str, float] | None:
    """The speculative counters from /metrics, summed over label sets; None when the server has none, or when its
    /metrics cannot be read (a warning says why)."""
    from eyas.client import ServerError

    try:
        counters = client.spec_counters()
    except ServerError as e:
        print(f"eyas bench: no acceptance length: {e}", file=sys.stderr)
        return None
    totals = {key: counters[metric] for key, metric in SPEC_COUNTERS.items() if metric in counters}
    return totals if len(totals) == len(SPEC_COUNTERS) else None


def acceptance(before: dict[str, float] | None, after: dict[str, float] | None,
               url: str = "the server") -> dict | None:
    """Acceptance from the counters' deltas over a run; None without counters, or when they cannot be trusted (a
    counter went backwards or is not a count: a warning names it)."""
    from eyas.client import ServerError, counter_deltas

    if before is None or after is None:
        return None
    try:
        vllm = counter_deltas(url, {SPEC_COUNTERS[k]: v for k, v in before.items()},
                              {SPEC_COUNTERS[k]: v for k, v in after.items()})
    except ServerError as e:
        print(f"eyas bench: no acceptance length: {e}", file=sys.stderr)
        return None
    delta = {k: vllm[metric] for k, metric in SPEC_COUNTERS.items()}
    if delta["drafts"] <= 0:
        return None
    return {"acceptance_length": 1 + delta["accepted"] / delta["drafts"],
            "acceptance_rate": delta["accepted"] / delta["draft_tokens"] if delta["draft_tokens"] else 0.0,
            "num_drafts": delta["drafts"], "num_draft_tokens": delta["draft_tokens"],
            "num_accepted_tokens": delta["accepted"]}


# -- statistics -----------------------------------------------------------------------------------------------------

def summarize(values: list[float]) -> dict[str, float | None]:
    """Mean and percentiles in milliseconds (linear interpolation, so p50 <= p90 <= p99)."""
    import numpy as np

    if not values:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    ms = np.asarray(values) * 1000
    return {"mean": float(ms.mean()), **{f"p{p}": float(np.percentile(ms, p)) for p in PERCENTILES}}


def run_report(server: str, concurrency: int, results: list[RequestResult], duration: float,
               spec: dict | None) -> dict:
    ok = [r for r in results if r.ok]
    output_tokens = sum(r.output_len for r in ok)
    return {
        "server": server, "concurrency": concurrency, "num_requests": len(results), "completed": len(ok),
        "failed": len(results) - len(ok), "duration_s": duration,
        "request_throughput": len(ok) / duration, "output_throughput": output_tokens / duration,
        "total_input_tokens": sum(r.prompt_len for r in ok), "total_output_tokens": output_tokens,
        "ttft_ms": summarize([r.ttft for r in ok]), "tpot_ms": summarize([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": summarize([x for r in ok for x in r.itl]), "e2e_ms": summarize([r.e2e for r in ok]),
        "acceptance_length": spec["acceptance_length"] if spec else None, "speculative": spec,
        # the share of output tokens committed by verify steps that had drafts (the rest: drafting was off)
        "drafted_share": (spec["num_drafts"] + spec["num_accepted_tokens"]) / output_tokens
        if spec and output_tokens else None,
        "errors": sorted({r.error for r in results if r.error})[:5],
        "requests": [{k: v for k, v in asdict(r).items() if k != "itl"} for r in results],
    }


def comparison(runs: list[dict]) -> list[dict]:
    """Speculative against plain at each concurrency: TPOT ratio (< 1 is faster) and throughput ratio (> 1).

    With repeats, each repeat's speculative run is paired with that repeat's plain run; the row gives the median of
    the paired ratios and all of them (this machine's noise moves single runs by several percent)."""
    import numpy as np

    by = {(r["server"], r["concurrency"], r.get("repeat", 0)): r for r in runs}
    rows: dict[int, dict] = {}
    for (server, c, repeat), spec in by.items():
        plain = by.get(("plain", c, repeat))
        if server != "speculative" or plain is None:
            continue
        row = rows.setdefault(c, {"concurrency": c, "tpot_ratios": [], "throughput_ratios": [], "spec": []})
        if spec["tpot_ms"]["mean"] and plain["tpot_ms"]["mean"]:
            row["tpot_ratios"].append(spec["tpot_ms"]["mean"] / plain["tpot_ms"]["mean"])
        if plain["output_throughput"]:
            row["throughput_ratios"].append(spec["output_throughput"] / plain["output_throughput"])
        row["spec"].append(spec)

    def median(values: list[float]) -> float | None:
        return float(np.median(values)) if values else None

    out = []
    for row in rows.values():
        spec_runs = row.pop("spec")
        counters = [r["speculative"] for r in spec_runs if r["speculative"]]
        drafts = sum(c["num_drafts"] for c in counters)
        accepted = sum(c["num_accepted_tokens"] for c in counters)
        tokens = sum(r["total_output_tokens"] for r in spec_runs)
        out.append({"concurrency": row["concurrency"], "tpot_ratio": median(row["tpot_ratios"]),
                    "throughput_ratio": median(row["throughput_ratios"]),
                    "tpot_ratios": row["tpot_ratios"], "throughput_ratios": row["throughput_ratios"],
                    "acceptance_length": 1 + accepted / drafts if drafts else None,
                    "drafted_share": (drafts + accepted) / tokens if counters and tokens else None})
    return out


def print_run(run: dict, file=sys.stdout) -> None:
    def row(name: str, s: dict) -> str:
        cells = "  ".join(f"{s[k]:9.2f}" if s[k] is not None else f"{'-':>9}" for k in ("mean", "p50", "p90", "p99"))
        return f"  {name:<9}{cells}"

    al = f", acceptance length {run['acceptance_length']:.2f}" if run["acceptance_length"] else ""
    print(f"== {run['server']}, concurrency {run['concurrency']}: {run['completed']}/{run['num_requests']} ok in "
          f"{run['duration_s']:.2f} s, {run['request_throughput']:.2f} req/s, "
          f"{run['output_throughput']:.1f} output tok/s{al}", file=file)
    print(f"  {'ms':<9}{'mean':>9}  {'p50':>9}  {'p90':>9}  {'p99':>9}", file=file)
    for name, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E", "e2e_ms")):
        print(row(name, run[key]), file=file)
    for error in run["errors"]:
        print(f"  error: {error}", file=file)


def print_comparison(rows: list[dict], file=sys.stdout) -> None:
    if not rows:
        return
    repeats = max(len(r["throughput_ratios"]) for r in rows)
    print("== speculative vs plain" + (f", median of {repeats} paired repeats" if repeats > 1 else ""), file=file)
    # "drafted": share of output tokens from verify steps that had drafts; the acceptance length describes only those
    print(f"  {'concurrency':>11}  {'TPOT spec/plain':>15}  {'tok/s spec/plain':>16}  {'accept len':>10}  "
          f"{'drafted':>7}" + ("  tok/s ratio of each repeat" if repeats > 1 else ""), file=file)
    for r in rows:
        tpot = f"{r['tpot_ratio']:.3f}" if r["tpot_ratio"] else "-"
        tput = f"{r['throughput_ratio']:.3f}" if r["throughput_ratio"] else "-"
        al = f"{r['acceptance_length']:.2f}" if r["acceptance_length"] else "-"
        drafted = f"{r['drafted_share']:.0%}" if r.get("drafted_share") is not None else "-"
        each = "  " + " ".join(f"{x:.3f}" for x in r["throughput_ratios"]) if repeats > 1 else ""
        print(f"  {r['concurrency']:>11}  {tpot:>15}  {tput:>16}  {al:>10}  {drafted:>7}{each}", file=file)


# -- servers --------------------------------------------------------------------------------------------------------

@contextmanager
def serve_in_thread(llm, model_name: str) -> Iterator[str]:
    """`eyas serve` for `llm` on a free loopback port, in a background thread; yields its base URL."""
    import uvicorn

    from eyas.serve.app import build_app

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    server = uvicorn.Server(uvicorn.Config(build_app(llm, model_name), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, name="eyas-bench-server", daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not server.started:
        if time.time() > deadline or not thread.is_alive():
            raise RuntimeError(f"the benchmark server on port {port} did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def bench_servers(args: argparse.Namespace, repeat: int = 0) -> Iterator[tuple[str, str, str]]:
    """(label, base URL, model name) for each server to load, started and stopped in turn: plain first on even
    repeats, speculative first on odd ones, so a drift in the machine's speed does not favour either."""
    if args.base_url:
        yield "server", args.base_url.rstrip("/"), args.served_model_name or _remote_model(args)
        return
    engine = EngineArgs.from_cli_args(args)
    speculates = engine.speculative_config() is not None
    name = args.served_model_name or Path(args.model).name
    servers = (("plain", replace(engine, speculative_method="none")), ("speculative", engine))
    for label, server in servers if repeat % 2 == 0 else servers[::-1]:
        if label == "speculative" and not speculates:
            continue
        llm = server.build_llm()
        with serve_in_thread(llm, name) as url:
            yield label, url, name
        del llm


def _remote_model(args: argparse.Namespace) -> str:
    from eyas.client import ServerClient

    client = ServerClient(args.base_url, api_key=args.api_key, timeout=30, retries=0)
    client.close()
    return client.model


def load_requests(args: argparse.Namespace) -> list[BenchRequest]:
    if args.dataset != "random":
        return file_requests(Path(args.dataset), args.num_prompts, args.output_len)
    from eyas.engine.llm import load_tokenizer

    tokenizer = load_tokenizer(args.model)
    if tokenizer is not None:
        vocab, special = len(tokenizer), set(tokenizer.all_special_ids)
    else:
        vocab, special = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"], set()
    return random_requests(args.num_prompts or 100, args.input_len, args.output_len, args.range_ratio, vocab,
                           special, args.seed)


def bench_serve(args: argparse.Namespace) -> dict:
    """Run every (server, concurrency) and return the report; prints each run's table as it finishes."""
    from eyas.client import ServerClient

    requests = load_requests(args)
    warmup = [BenchRequest(r.endpoint, r.prompt, r.prompt_len, min(r.output_len, 8)) for r in requests[:2]]
    runs = []
    for repeat in range(args.repeats):
        for label, url, model in bench_servers(args, repeat):
            metrics = ServerClient(url, model, args.api_key, timeout=10, retries=0)
            # the first requests pay one-off costs (allocations, lazy imports); keep them out of the figures
            asyncio.run(run_load(url, model, warmup, len(warmup), math.inf, args.temperature, args.api_key,
                                 args.seed, args.request_timeout, f"{label} warmup"))
            for c in args.concurrency:
                name = f"{label} c={c}" + (f" repeat {repeat + 1}/{args.repeats}" if args.repeats > 1 else "")
                if args.num_warmups:
                    warm = [requests[i % len(requests)] for i in range(args.num_warmups)]
                    asyncio.run(run_load(url, model, warm, c, math.inf, args.temperature, args.api_key, args.seed,
                                         args.request_timeout, f"{name} warmup"))
                before = spec_counters(metrics)
                results, duration = asyncio.run(run_load(url, model, requests, c, args.request_rate,
                                                         args.temperature, args.api_key, args.seed,
                                                         args.request_timeout, name))
                run = run_report(label, c, results, duration, acceptance(before, spec_counters(metrics), url))
                run["repeat"] = repeat
                print_run(run)
                runs.append(run)
            metrics.close()
    rows = comparison(runs)
    print_comparison(rows)
    # strict JSON: paths and an infinite request rate as strings
    config = {k: str(v) if isinstance(v, Path) or (isinstance(v, float) and not math.isfinite(v)) else v
              for k, v in vars(args).items() if k not in ("func", "api_key")}  # no secret in a report
    return {"config": config, "runs": runs, "comparison": rows}


def _bench_serve(args: argparse.Namespace) -> int:
    report = bench_serve(args)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, allow_nan=False) + "\n")
        print(f"wrote {args.json}")
    return 0 if all(r["failed"] == 0 for r in report["runs"]) else 1


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_cli(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks", description="Benchmarks.")
    sub = bench.add_subparsers(dest="bench_command", required=True)
    p = sub.add_parser("serve", help="load an OpenAI-compatible server and report TTFT, TPOT, throughput",
                       description=__doc__, formatter_class=bench.formatter_class)
    EngineArgs.add_cli_args(p, model_help="target checkpoint to serve (and whose tokenizer draws random "
                            "prompts); default: the bundled tiny DeepSeek-V3",
                            title="the servers started without --base-url")
    p.add_argument("--base-url", help="load this running server instead of starting one (e.g. "
                   "http://127.0.0.1:8000)")
    p.add_argument("--served-model-name", help="the `model` sent with each request (default: the directory name, "
                   "or the first of --base-url's /v1/models)")
    p.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY' (with --base-url)")
    p.add_argument("--dataset", default="random", help="'random' (token-id prompts) or a JSONL file of "
                   "{\"prompt\": ...}, {\"messages\": [...]} or {\"turns\": [...]} records")
    p.add_argument("--num-prompts", type=int, help="requests per run (default: 100 random, or the file's records)")
    p.add_argument("--input-len", type=int, default=128, help="random prompt length in tokens")
    p.add_argument("--output-len", type=int, default=128, help="tokens generated per request (ignore_eos)")
    p.add_argument("--range-ratio", type=float, default=0.0, help="random lengths are drawn from "
                   "len * [1 - r, 1 + r]")
    p.add_argument("--concurrency", type=_positive_int, nargs="+", default=[1], help="requests in flight at most; "
                   "one run per value")
    p.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals per second (default "
                   "inf: all at once, limited by --concurrency)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--seed", type=int, default=0, help="seeds the random prompts and the arrival times")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds one request may take, its whole "
                   "stream included (a request still unfinished then fails)")
    p.add_argument("--num-warmups", type=int, default=0, help="untimed requests (the timed ones' prompts, "
                   "cycled) sent at each concurrency before its timed run: a server that adapts to its load, as "
                   "eyas's verify width does, is then measured as one that has been serving at that load")
    p.add_argument("--repeats", type=_positive_int, default=1, help="run every (server, concurrency) this many "
                   "times, alternating which server goes first; the comparison gives the median of the paired "
                   "ratios (single runs on a shared machine move by several percent)")
    p.add_argument("--json", type=Path, metavar="OUT", help="write the whole report (every request too) here")
    p.set_defaults(func=_bench_serve)
