"""The adaptive verify width against every fixed width, and against plain decoding, at several concurrencies, in one
run on a warm engine (as a server runs: its width policy has seen traffic before the timed requests).

    python benchmarks/width_policy.py                                  # bundled target + MLA draft, c = 1 4 16 32
    python benchmarks/width_policy.py --concurrency 16 32 --rounds 5 --out report.json

Per concurrency c: c x --requests-per-slot prompts of --prompts (at least --min-requests) run with at most c at a time,
a new one taking each finished one's place as on a server (greedy, --new-tokens each or, with --range-ratio, lengths
spread around it, ignore_eos), through a plain engine, an engine verifying a fixed width w for every w in 0..K, and the
adaptive one. (Exactly c requests started together end in a tail of a few sequences that accepted least, whose steps run
at a small batch: there a width that drafts less loses least, and the tail weighs on the run as it seldom does on a
server.) Each engine is warmed at that concurrency first (--warmup-runs whole runs). Then --rounds rounds run every
engine once, in turn (each round starting one engine further on, so none always runs after the same one), so a slow
spell of a shared machine hits all alike; a configuration's figure is its median round. Printed per concurrency: output
tok/s of each, the best fixed width in hindsight, adaptive / best fixed (of the medians, and within each round: how far
apart two engines run in one round shows what the medians' ratio is worth) and speculative / plain, and the widths the
adaptive policy chose (share of decode steps at each); the report also keeps every round. Greedy outputs of every engine
are checked equal to plain's, token for token.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time
from collections import Counter
from pathlib import Path

from eyas import LLM, SamplingParams
from eyas.config import SpeculativeConfig
from eyas.models.dflash import read_dflash_config
from eyas.paths import DEFAULT_DRAFT, DEFAULT_EVAL_PROMPTS, DEFAULT_MODEL
from eyas.records import read_prompt_file


def engines(args: argparse.Namespace) -> dict[str, LLM]:
    """name -> engine: plain, fixed-0..fixed-K, adaptive; one lane per sequence up to the largest concurrency."""
    common = dict(max_num_seqs=max(args.concurrency), threads=args.threads, compiled_step=not args.enforce_eager,
                  dtype=args.dtype)
    method = "dflash" if read_dflash_config(args.draft_model) is not None else "eagle"  # a block draft, or a chain
    out = {"plain": LLM(args.model, **common)}
    top = max(args.concurrency)
    for w in range(args.num_speculative_tokens + 1):
        rule = [{"batch_start": 1, "batch_end": top, "num_tokens": w}]
        config = SpeculativeConfig(method=method, draft_model=str(args.draft_model),
                                   num_speculative_tokens=args.num_speculative_tokens,
                                   num_speculative_tokens_per_batch_size=rule)
        out[f"fixed-{w}"] = LLM(args.model, speculative_config=config, **common)
    config = SpeculativeConfig(method=method, draft_model=str(args.draft_model),
                               num_speculative_tokens=args.num_speculative_tokens, adaptive_width=True)
    out["adaptive"] = LLM(args.model, speculative_config=config, **common)
    return out


def count_widths(llm: LLM) -> Counter:
    """Wrap the proposer's width choice so each decode step's width is counted (the counter is returned)."""
    proposer, widths = llm.runner.proposer, Counter()
    choose = proposer.width

    def counted(batch):
        width = choose(batch)
        # a step with no prompt positions (with requests waiting for a place, `prefill_next` holds on every step)
        if all(seq.num_computed >= len(seq) - 1 for seq in batch.seqs):
            widths[width] += 1
        return width

    proposer.width = counted
    return widths


def warm_up(llms: dict[str, LLM], batch: list, params: SamplingParams | list[SamplingParams], runs: int,
            concurrency: int | None = None) -> None:
    for llm in llms.values():
        llm.scheduler.max_num_seqs = concurrency or len(batch)
        for _ in range(runs):
            llm.generate(batch, params, use_tqdm=False)


def timed_rounds(llms: dict[str, LLM], batch: list, params: SamplingParams | list[SamplingParams], rounds: int,
                 concurrency: int | None = None, each_round: dict[str, list[float]] | None = None
                 ) -> dict[str, float]:
    """Output tok/s of each engine over `batch` (`params` for all, or one per request), at most `concurrency`
    sequences at a time (default all of them): the median of `rounds` rounds, each running every engine once in
    turn, round r starting from the r-th engine so none always runs after the same one (`each_round`, when given,
    gets every round's figure per engine). Greedy outputs must equal the first run's, token for token."""
    concurrency = concurrency or len(batch)
    seconds: dict[str, list[float]] = {name: [] for name in llms}
    reference, first = None, None
    for llm in llms.values():
        llm.scheduler.max_num_seqs = concurrency
    names = list(llms)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            llm = llms[name]
            start = time.perf_counter()
            outs = llm.generate(batch, params, use_tqdm=False)
            seconds[name].append(time.perf_counter() - start)
            tokens = [o.token_ids for o in outs]
            if reference is None:
                reference, first = tokens, name
            elif tokens != reference:
                raise SystemExit(f"c={concurrency}: {name}'s greedy output differs from {first}'s")
    tokens = sum(p.max_tokens for p in params) if isinstance(params, list) else len(batch) * params.max_tokens
    if each_round is not None:
        each_round.update({name: [tokens / t for t in s] for name, s in seconds.items()})
    return {name: tokens / statistics.median(s) for name, s in seconds.items()}


def output_lengths(num: int, new_tokens: int, range_ratio: float) -> SamplingParams | list[SamplingParams]:
    """Greedy params generating `new_tokens` each, or with `range_ratio`, new_tokens x [1 - r, 1 + r] per request
    (seeded: every engine and round gets the same lengths)."""
    if not range_ratio:
        return SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    rng = random.Random(0)
    low, high = max(1, math.floor(new_tokens * (1 - range_ratio))), math.ceil(new_tokens * (1 + range_ratio))
    return [SamplingParams(temperature=0, max_tokens=rng.randint(low, high), ignore_eos=True) for _ in range(num)]


def run_args(doc: str, warmup_runs: int) -> argparse.ArgumentParser:
    """The flags of a benchmark that runs engines side by side on the eval prompts at several concurrencies."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--draft-model", type=Path, default=DEFAULT_DRAFT,
                    help="an EAGLE-3 draft, or a DFlash block draft (known by its config.json; give K <= block - 1)")
    ap.add_argument("--prompts", type=Path, default=DEFAULT_EVAL_PROMPTS)
    ap.add_argument("--num-speculative-tokens", type=int, default=3, help="K: the widest width (default 3)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32])
    ap.add_argument("--new-tokens", type=int, default=96, help="tokens generated per request (default 96)")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds; the median is kept (default 3)")
    ap.add_argument("--warmup-runs", type=int, default=warmup_runs,
                    help=f"untimed runs per engine and concurrency (default {warmup_runs})")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="the target's dtype (default float32)")
    ap.add_argument("--out", type=Path, help="write the report here as JSON")
    return ap


def main() -> None:
    ap = run_args(__doc__, warmup_runs=2)
    ap.add_argument("--enforce-eager", action="store_true",
                    help="every engine op by op (default: the compiled step, as every eyas command runs on CPU)")
    ap.add_argument("--requests-per-slot", type=int, default=3,
                    help="requests per concurrency slot: c x this many run, at most c at a time (default 3)")
    ap.add_argument("--range-ratio", type=float, default=0.0,
                    help="each request generates --new-tokens x [1 - r, 1 + r] tokens (drawn once, seeded; default 0: "
                         "all alike, so plain decoding runs its requests in lockstep, each wave prefilled together, "
                         "as drafting, which commits a different number of tokens per sequence, does not)")
    ap.add_argument("--min-requests", type=int, default=16,
                    help="at least this many requests a round, whatever c (default 16: at c=1, 3 requests made a "
                         "round of half a second, and one slow spell moved a round's ratio by 18%%)")
    args = ap.parse_args()

    prompts = read_prompt_file(args.prompts)
    llms = engines(args)
    widths = count_widths(llms["adaptive"])
    if not 0 <= args.range_ratio < 1:
        ap.error(f"--range-ratio must be in [0, 1), got {args.range_ratio}")
    report = {"model": str(args.model), "draft_model": str(args.draft_model), "new_tokens": args.new_tokens,
              "range_ratio": args.range_ratio,
              "requests_per_slot": args.requests_per_slot, "min_requests": args.min_requests, "rounds": args.rounds,
              "results": {}}
    for c in args.concurrency:
        batch = [prompts[i % len(prompts)] for i in range(max(c * args.requests_per_slot, args.min_requests))]
        params = output_lengths(len(batch), args.new_tokens, args.range_ratio)
        warm_up(llms, batch, params, args.warmup_runs, c)
        widths.clear()
        each_round: dict[str, list[float]] = {}
        tok_s = timed_rounds(llms, batch, params, args.rounds, c, each_round)
        fixed = {name: v for name, v in tok_s.items() if name.startswith("fixed-")}
        best = max(fixed, key=fixed.get)
        # a round runs every engine once, back to back: the ratio within each round shows how far the medians' ratio
        # is from the spread of the machine (the best fixed width is the largest of several near-equal figures)
        per_round = [a / b for a, b in zip(each_round["adaptive"], each_round[best])]
        spec_best = max(tok_s["adaptive"], fixed[best])
        steps = sum(widths.values())
        shares = {w: round(n / steps, 3) for w, n in sorted(widths.items())} if steps else {}
        report["results"][c] = {"tok_s": {k: round(v, 1) for k, v in tok_s.items()}, "best_fixed": best,
                                "adaptive_over_best_fixed": round(tok_s["adaptive"] / fixed[best], 3),
                                "adaptive_over_best_fixed_each_round": [round(r, 3) for r in per_round],
                                "tok_s_each_round": {k: [round(v, 1) for v in vs] for k, vs in each_round.items()},
                                "adaptive_over_plain": round(tok_s["adaptive"] / tok_s["plain"], 3),
                                "best_speculative_over_plain": round(spec_best / tok_s["plain"], 3),
                                "adaptive_width_shares": shares}
        cells = "  ".join(f"{k} {v:.0f}" for k, v in tok_s.items())
        print(f"c={c}: tok/s {cells}")
        print(f"      adaptive / best fixed ({best}) {tok_s['adaptive'] / fixed[best]:.3f} (each round: "
              f"{' '.join(f'{r:.3f}' for r in per_round)}), adaptive / plain {tok_s['adaptive'] / tok_s['plain']:.3f}; "
              f"adaptive widths (share of decode steps) {shares}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
