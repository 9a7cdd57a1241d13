"""DFlash block drafts against an EAGLE-3 draft on the same target, data and training budget.

Trains, one after another and with the same thread count:
  (a) an EAGLE-3 draft (`--eagle-flags`, by default the MLA EAGLE-3.1 recipe that won the recipe comparison);
  (b) a DFlash draft for every --block-sizes (and every --dflash variant given as NAME=FLAGS);
all on the same data, the same number of steps, batch and length (so the same training tokens); then `eyas eval`
measures each on the held-out prompts: greedy, the EAGLE-3 draft at K = --num-speculative-tokens, a DFlash draft at
its whole block (K = B - 1), both at a fixed width, and the batch-1 tokens/s of speculative against plain decoding on
the eval's speed prompts (measured within each eval, plain first). Prints a table with the ratios to the EAGLE-3
draft and writes WORK/summary.json.

    python benchmarks/dflash_compare.py --target examples/tiny-deepseek-v3 \\
        --data scripts/tiny_target/stage3-regenerated.jsonl --steps 400 --block-sizes 4 8 16

Tokens/s are only as good as the machine is quiet; AL is measured at a fixed width and does not depend on load.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", type=Path, default=REPO / "examples" / "tiny-deepseek-v3")
    p.add_argument("--data", type=Path, default=REPO / "examples" / "data" / "conversations.jsonl",
                   help="training conversations (the target's own answers teach a draft most)")
    p.add_argument("--prompts", type=Path, default=REPO / "examples" / "prompts" / "eval.jsonl")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--max-length", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup-steps", type=int, default=30)
    p.add_argument("--block-sizes", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--dflash-flags", default="--num-draft-layers 1 --aux-layer-ids 2 4 5",
                   help="`eyas train` flags of every DFlash draft")
    p.add_argument("--dflash", action="append", default=[], metavar="NAME=FLAGS",
                   help="a DFlash variant at the first --block-sizes, with these flags added (repeatable)")
    p.add_argument("--eagle-flags", default="--draft-arch mla --fc-norm --norm-output --draft-vocab-size 0",
                   help="`eyas train` flags of the EAGLE-3 draft compared against")
    p.add_argument("--num-speculative-tokens", type=int, default=3, help="the EAGLE-3 draft's K")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/dflash-compare"))
    p.add_argument("--reuse", action="store_true", help="skip the trainings and evals whose outputs exist")
    return p.parse_args()


def run(cmd: list[str], log: Path) -> float:
    """Run an eyas command line to completion, its output in `log`; returns its wall time."""
    print("$", shlex.join(cmd), flush=True)
    start = time.perf_counter()
    with open(log, "w") as f:
        code = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO).returncode
    seconds = time.perf_counter() - start
    if code:
        sys.exit(f"failed ({code}) after {seconds:.0f} s: see {log}")
    print(f"  ({seconds:.0f} s, log {log})", flush=True)
    return seconds


def main() -> None:
    args = parse_args()
    work = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    eyas = [sys.executable, "-m", "eyas.cli"]
    common = ["--target", str(args.target), "--data", str(args.data), "--max-steps", str(args.steps),
              "--batch-size", str(args.batch_size), "--max-length", str(args.max_length), "--lr", str(args.lr),
              "--warmup-steps", str(args.warmup_steps), "--save-every", str(args.steps), "--threads",
              str(args.threads)]
    runs = [("eagle3", "eagle", shlex.split(args.eagle_flags), args.num_speculative_tokens)]
    dflash = ["--draft-arch", "dflash", *shlex.split(args.dflash_flags)]
    runs += [(f"dflash-b{b}", "dflash", [*dflash, "--block-size", str(b)], b - 1) for b in args.block_sizes]
    for spec in args.dflash:
        name, sep, flags = spec.partition("=")
        if not sep or not name:
            sys.exit(f"--dflash {spec!r}: expected NAME=FLAGS")
        b = args.block_sizes[0]
        runs.append((name, "dflash", [*dflash, "--block-size", str(b), *shlex.split(flags)], b - 1))
    rows = []
    for name, method, flags, k in runs:
        out = work / name
        if not (args.reuse and (out / "draft" / "model.safetensors").is_file()):
            run([*eyas, "train", *common, *flags, "--out", str(out)], work / f"train-{name}.log")
        report = work / f"eval-{name}.json"
        if not (args.reuse and report.is_file()):
            run([*eyas, "eval", str(args.prompts), "--model", str(args.target), "--speculative-method", method,
                 "--draft-model", str(out / "draft"), "--num-speculative-tokens", str(k), "--speculative-width",
                 "fixed", "--temperature", "0", "--max-new-tokens", str(args.max_new_tokens), "--threads",
                 str(args.threads), "--out", str(report)], work / f"eval-{name}.log")
        r = json.loads(report.read_text())
        log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
        rows.append({"name": name, "method": method, "k": k, "flags": flags,
                     "al": r["overall"]["acceptance_length"],
                     "al_non_repetitive": r["overall"].get("acceptance_length_non_repetitive"),
                     "repetitive_share": r["overall"].get("repetitive_share"),
                     "accepted_per_position": r["overall"]["accepted_per_position"],
                     "speed": r.get("speed"),
                     # the same cap for every draft: steps x batch x max length (batches pad to their longest)
                     "train_token_budget": len(log) * args.batch_size * args.max_length,
                     "train_tokens_per_s": log[-1]["tokens_per_s"], "final_loss": log[-1]["loss"]})
    print_table(rows, args)
    (work / "summary.json").write_text(json.dumps({"settings": {k: str(v) if isinstance(v, Path) else v
                                                                for k, v in vars(args).items()}, "rows": rows},
                                                  indent=2) + "\n")
    print(f"wrote {work / 'summary.json'}")


def print_table(rows: list[dict], args: argparse.Namespace) -> None:
    ref = rows[0]
    head = ["draft", "K", "AL", "AL non-rep", "x EAGLE-3 AL", "accept@1..K", "spec tok/s", "plain tok/s",
            "speedup", "x EAGLE-3 tok/s"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for row in rows:
        speed = row["speed"] or {}
        ref_speed = (ref["speed"] or {}).get("speculative_tokens_per_s")
        cells = [row["name"], str(row["k"]), f"{row['al']:.3f}",
                 f"{row['al_non_repetitive']:.3f}" if row["al_non_repetitive"] is not None else "-",
                 f"{row['al'] / ref['al']:.3f}", " / ".join(f"{x:.2f}" for x in row["accepted_per_position"]),
                 str(speed.get("speculative_tokens_per_s", "-")), str(speed.get("plain_tokens_per_s", "-")),
                 str(speed.get("speedup", "-")),
                 f"{speed['speculative_tokens_per_s'] / ref_speed:.3f}" if speed and ref_speed else "-"]
        print("| " + " | ".join(cells) + " |")
    print(f"same data ({args.data.name}), {args.steps} steps of {args.batch_size} x up to {args.max_length} tokens "
          f"for every draft; eval {args.prompts.name}, greedy, fixed width, {args.threads} thread(s)")


if __name__ == "__main__":
    main()
