"""The compiled step against the eager one, plain and speculative, at several concurrencies, in one run.

    python benchmarks/compiled_step.py                                  # bundled target + MLA draft, c = 1 4 16 32
    python benchmarks/compiled_step.py --concurrency 1 4 --rounds 5 --out report.json

Four engines on the same prompts (greedy, --new-tokens each, ignore_eos): plain and speculative (the bundled MLA
draft, default adaptive width), each eager (--enforce-eager) and compiled (the default on CPU). Per concurrency c,
each engine is warmed at c, then --rounds rounds run every engine once in turn; a figure is its median round.
Greedy outputs of every engine must equal eager plain decoding's, token for token. The kernels are compiled (or
loaded from the disk cache) before anything is timed; the seconds that took are reported.
"""

from __future__ import annotations

import json
import time

from width_policy import run_args, timed_rounds, warm_up

from eyas import LLM, SamplingParams
from eyas.config import SpeculativeConfig
from eyas.records import read_prompt_file


def main() -> None:
    args = run_args(__doc__, warmup_runs=1).parse_args()

    prompts = read_prompt_file(args.prompts)
    common = dict(max_num_seqs=max(args.concurrency), threads=args.threads, dtype="float32")
    spec = SpeculativeConfig(method="eagle", draft_model=str(args.draft_model),
                             num_speculative_tokens=args.num_speculative_tokens, adaptive_width=True)
    start = time.perf_counter()
    llms = {"eager plain": LLM(args.model, **common),
            "compiled plain": LLM(args.model, compiled_step=True, progress=print, **common),
            "eager draft": LLM(args.model, speculative_config=spec, **common),
            "compiled draft": LLM(args.model, speculative_config=spec, compiled_step=True, **common)}
    print(f"engines built in {time.perf_counter() - start:.1f} s (compiling: "
          f"{llms['compiled plain'].runner.compiled.seconds:.1f} s)", flush=True)
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    report = {"model": str(args.model), "draft_model": str(args.draft_model), "new_tokens": args.new_tokens,
              "rounds": args.rounds, "results": {}}
    for c in args.concurrency:
        batch = [prompts[i % len(prompts)] for i in range(c)]
        warm_up(llms, batch, params, args.warmup_runs)
        tok_s = timed_rounds(llms, batch, params, args.rounds)
        ratios = {"compiled / eager, plain": tok_s["compiled plain"] / tok_s["eager plain"],
                  "compiled / eager, draft": tok_s["compiled draft"] / tok_s["eager draft"],
                  "compiled draft / compiled plain": tok_s["compiled draft"] / tok_s["compiled plain"],
                  "compiled draft / eager plain": tok_s["compiled draft"] / tok_s["eager plain"]}
        report["results"][c] = {"tok_s": {k: round(v, 1) for k, v in tok_s.items()},
                                "ratios": {k: round(v, 3) for k, v in ratios.items()}}
        print(f"c={c}: tok/s " + "  ".join(f"{k} {v:.0f}" for k, v in tok_s.items()))
        print("      " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()), flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
