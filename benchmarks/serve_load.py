"""A hostile load on `eyas serve`: streaming clients that sometimes disconnect mid-stream, with and without clients
that give up before their first token (10-500 ms timeouts), each phase on a fresh server started by this script.

    python benchmarks/serve_load.py --clients 48 --abandoning 4 --duration 180

Per phase it prints the real clients' generated tokens/s, requests finished and dropped, the tokens the engine
generated that no client read, statuses (any 5xx is a failure), KV blocks still in use after the load, the server's
RSS before and after, and the server's log: tracebacks and disconnect lines. The last line is the throughput ratio
with / without the abandoning clients.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
from vllm_interop import free_port, stop, wait_healthy

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["def parse(path):\n", "import os\n\nclass Cache:\n", "for i in range(", "# Sort the list\n",
           "def main():\n    args = ", "x = [", "with open(name) as f:\n", "class Node:\n    def __init__(self"]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def server_counter(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    match = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M)
    return float(match.group(1)) if match else float("nan")


class Load:
    def __init__(self, url: str, model: str, deadline: float, rng: random.Random) -> None:
        self.url, self.model, self.deadline, self.rng = url, model, deadline, rng
        self.tokens = 0  # generated tokens the real clients received
        self.finished = self.dropped = self.abandoned = 0
        self.statuses: Counter[int | str] = Counter()

    async def streaming_client(self, http: httpx.AsyncClient, i: int) -> None:
        n = 0
        while time.monotonic() < self.deadline:
            n += 1
            drop_after = self.rng.randint(2, 20) if n % 3 == 0 else None  # every third request disconnects
            body = {"model": self.model, "prompt": self.rng.choice(PROMPTS), "stream": True, "ignore_eos": True,
                    "max_tokens": self.rng.randint(16, 96), "temperature": 0.8, "seed": i * 100_000 + n,
                    "return_token_ids": True}
            try:
                async with http.stream("POST", "/v1/completions", json=body) as r:
                    self.statuses[r.status_code] += 1
                    chunks = 0
                    async for line in r.aiter_lines():
                        if not line.startswith("data: {"):
                            continue
                        choice = json.loads(line[6:])["choices"][0]
                        self.tokens += len(choice.get("token_ids") or [])
                        chunks += 1
                        if drop_after is not None and chunks >= drop_after:
                            self.dropped += 1
                            break
                    else:
                        self.finished += 1
            except httpx.HTTPError as e:
                self.statuses[type(e).__name__] += 1

    async def abandoning_client(self, http: httpx.AsyncClient, i: int) -> None:
        """Sends a request and gives up after 10-500 ms, before its first token for the most part."""
        n = 0
        while time.monotonic() < self.deadline:
            n += 1
            timeout = self.rng.uniform(0.01, 0.5)
            body = {"model": self.model, "prompt": self.rng.choice(PROMPTS) * self.rng.randint(1, 20),
                    "max_tokens": 96, "ignore_eos": True, "stream": n % 2 == 0}
            try:
                r = await http.post("/v1/completions", json=body, timeout=timeout)
                self.statuses[f"abandoning {r.status_code}"] += 1
            except httpx.TimeoutException:
                self.abandoned += 1
            except httpx.HTTPError as e:
                self.statuses[f"abandoning {type(e).__name__}"] += 1

    async def run(self, clients: int, abandoning: int) -> None:
        limits = httpx.Limits(max_connections=clients + abandoning + 4)
        async with httpx.AsyncClient(base_url=self.url, timeout=120, limits=limits) as http:
            await asyncio.gather(*(self.streaming_client(http, i) for i in range(clients)),
                                 *(self.abandoning_client(http, i) for i in range(abandoning)))


def phase(args: argparse.Namespace, abandoning: int) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = Path(tempfile.mkstemp(prefix="eyas-serve-", suffix=".log")[1])
    command = [sys.executable, "-m", "eyas.cli", "serve", "--model", str(args.model), "--port", str(port),
               "--max-num-seqs", str(args.max_num_seqs), *args.serve_args]
    with open(log_path, "w") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
    try:
        wait_healthy(server, url, log_path, 300, "eyas serve")
    except RuntimeError as error:
        raise SystemExit(str(error)) from error
    try:
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        rss_before = rss_mb(server.pid)
        load = Load(url, model, time.monotonic() + args.duration, random.Random(args.seed))
        start = time.monotonic()
        asyncio.run(load.run(args.clients, abandoning))
        elapsed = time.monotonic() - start
        time.sleep(1.0)  # aborts are applied between steps
        result = {"abandoning_clients": abandoning, "tokens_per_s": load.tokens / elapsed, "tokens": load.tokens,
                  "seconds": elapsed, "finished": load.finished, "dropped": load.dropped,
                  "abandoned": load.abandoned, "statuses": {str(k): v for k, v in load.statuses.items()},
                  "server_errors": sum(v for k, v in load.statuses.items() if str(k).split()[-1].startswith("5")),
                  "kv_blocks_used_after": server_counter(url, "eyas:kv_cache_blocks_used"),
                  # tokens the engine generated that no client read: past a dropped stream's end, or abandoned
                  "tokens_unread": server_counter(url, "eyas:generation_tokens_total") - load.tokens,
                  "rss_mb_before": rss_before,
                  "rss_mb_after": rss_mb(server.pid)}
    finally:
        stop(server)
    text = log_path.read_text(errors="replace")
    result["log_tracebacks"] = text.count("Traceback (most recent call last)")
    result["log_lines"] = len(text.splitlines())
    result["log_disconnect_lines"] = sum("disconnect" in line.lower() for line in text.splitlines())
    result["log"] = str(log_path)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=ROOT / "examples" / "tiny-deepseek-v3")
    parser.add_argument("--clients", type=int, default=48, help="streaming clients (default: 48)")
    parser.add_argument("--abandoning", type=int, default=4, help="clients that give up after 10-500 ms in the "
                        "second phase (default: 4)")
    parser.add_argument("--duration", type=float, default=180, help="seconds per phase (default: 180)")
    parser.add_argument("--max-num-seqs", type=int, default=16, help="the server's --max-num-seqs (default: 16)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("serve_args", nargs=argparse.REMAINDER, help="after --: more `eyas serve` arguments")
    args = parser.parse_args(argv)
    args.serve_args = [a for a in args.serve_args if a != "--"]
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    results = []
    for abandoning in (0, args.abandoning):
        result = phase(args, abandoning)
        results.append(result)
        print(f"{abandoning} abandoning clients: {result['tokens_per_s']:.1f} tok/s ({result['tokens']} tokens in "
              f"{result['seconds']:.0f} s), {result['finished']} finished, {result['dropped']} dropped, "
              f"{result['abandoned']} abandoned, {result['tokens_unread']:.0f} tokens generated and unread; "
              f"statuses {result['statuses']}; 5xx {result['server_errors']}; KV "
              f"blocks after {result['kv_blocks_used_after']:.0f}; RSS {result['rss_mb_before']:.0f} -> "
              f"{result['rss_mb_after']:.0f} MB; server log {result['log_lines']} lines, "
              f"{result['log_tracebacks']} tracebacks, {result['log_disconnect_lines']} disconnect lines "
              f"({result['log']})", flush=True)
    ratio = results[1]["tokens_per_s"] / results[0]["tokens_per_s"]
    print(f"throughput with {args.abandoning} abandoning clients / without: {ratio:.3f}")
    if args.json:
        args.json.write_text(json.dumps({"phases": results, "ratio": ratio}, indent=2) + "\n")
    return 0 if all(r["server_errors"] == 0 and r["kv_blocks_used_after"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
