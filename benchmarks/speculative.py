"""Speculative vs plain decode throughput on the shipped tiny target, measured in one run.

    python benchmarks/speculative.py --synthetic-acceptance-rate 0.8      # engine overhead, K = 3
    python benchmarks/speculative.py --speculative-method eagle --draft-model DIR
    python benchmarks/speculative.py --speculative-method eagle \
        --draft-model examples/tiny-deepseek-v3-eagle3-mla --prompts examples/prompts/eval.jsonl

With --synthetic-acceptance-rate each draft position is accepted with that probability whatever the draft says
(the output is then not the target's), so the figure measures the engine's overhead apart from draft quality:
the bound on the speedup is the mean acceptance length, 1 + r + r^2 + ... + r^K (2.95 for r = 0.8, K = 3).
Without it the real acceptance rule runs and the tokens must equal plain greedy decoding.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from eyas import LLM, SamplingParams
from eyas.config import SpeculativeConfig
from eyas.paths import DEFAULT_MODEL


def timed(llm: LLM, prompts: list, params: SamplingParams):
    if llm.speculative is not None:  # each repeat draws the same synthetic acceptances: fastest is not luckiest
        llm.runner.verifier.accept.generator.manual_seed(0)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    return time.perf_counter() - start, outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--speculative-method", default="mtp", choices=["mtp", "eagle"])
    ap.add_argument("--draft-model", type=Path)
    ap.add_argument("--num-speculative-tokens", type=int, default=3)
    ap.add_argument("--synthetic-acceptance-rate", type=float)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="the target's dtype (default float32)")
    ap.add_argument("--enforce-eager", action="store_true", help="both engines op by op (default: the compiled step, "
                    "as every eyas command runs on CPU)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per configuration; the best is kept")
    ap.add_argument("--prompts", type=Path, help="JSONL prompts as `eyas generate --prompt-file` reads them (an eval "
                    "file's first turns are chat messages), instead of the built-in code snippets")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    config = SpeculativeConfig(method=args.speculative_method,
                               draft_model=str(args.draft_model) if args.draft_model else None,
                               num_speculative_tokens=args.num_speculative_tokens,
                               synthetic_acceptance_rate=args.synthetic_acceptance_rate)
    prompts: list = ["def parse_args(argv):\n", "import os\n\n\nclass Config:\n", "    for line in lines:\n",
               "def main():\n    ", "# utility functions\n", "class Error(Exception):\n", "    if not path:\n",
               "import sys\n"]
    if args.prompts:
        from eyas.records import read_prompt_file

        prompts = read_prompt_file(args.prompts)
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    rate = args.synthetic_acceptance_rate
    print(f"model {args.model.name}, {args.speculative_method} K={args.num_speculative_tokens}, "
          f"{'synthetic acceptance ' + str(rate) if rate is not None else 'real acceptance'}, "
          f"threads {args.threads}, {args.dtype}, {args.new_tokens} new tokens, greedy, "
          f"{'eager' if args.enforce_eager else 'compiled step'}")
    # speedup / AL: the share of the acceptance length that reaches the user (1 when a speculative step costs what
    # a plain step costs)
    print(f"{'batch':>5} {'plain tok/s':>12} {'spec tok/s':>11} {'speedup':>8} {'accept len':>11} {'speedup/AL':>11}"
          "  same tokens")
    for batch in args.batch_sizes:
        # at most `batch` sequences at a time; with --prompts every prompt runs (batch 1: one after another)
        plain = LLM(args.model, max_num_seqs=batch, compiled_step=not args.enforce_eager, dtype=args.dtype,
                    threads=args.threads)
        spec = LLM(args.model, max_num_seqs=batch, speculative_config=config, compiled_step=not args.enforce_eager,
                   dtype=args.dtype, threads=args.threads)
        batch_prompts = prompts if args.prompts else [prompts[i % len(prompts)] for i in range(batch)]
        timed(plain, batch_prompts, SamplingParams(temperature=0, max_tokens=8))  # warm-up
        timed(spec, batch_prompts, SamplingParams(temperature=0, max_tokens=8))
        # plain and speculative runs alternate, so a slow spell of this shared machine hits both alike
        runs = [(timed(plain, batch_prompts, params), timed(spec, batch_prompts, params))
                for _ in range(args.repeats)]
        plain_s, plain_out = min((r[0] for r in runs), key=lambda r: r[0])
        spec_s, spec_out = min((r[1] for r in runs), key=lambda r: r[0])
        total = len(batch_prompts) * args.new_tokens
        al = sum(o.acceptance_length for o in spec_out) / len(spec_out)
        same = all(a.token_ids == b.token_ids for a, b in zip(plain_out, spec_out))
        print(f"{batch:>5} {total / plain_s:>12.1f} {total / spec_s:>11.1f} {plain_s / spec_s:>7.2f}x "
              f"{al:>11.2f} {plain_s / spec_s / al:>11.2f}  {same if rate is None else 'n/a (synthetic)'}")


if __name__ == "__main__":
    main()
