"""Where a step's time goes, phase by phase: plain decoding and each draft given, one request at a time (or
--batch at a time) on held-out prompts, greedy, fixed width, real acceptance, the defaults' compiled step and dtype.

    python benchmarks/step_phases.py       # plain, the bundled EAGLE-3 MLA draft at K=3, the DFlash draft at K=7, 3
    python benchmarks/step_phases.py --draft eagle:examples/tiny-deepseek-v3-eagle3-mha:3 --draft mtp::3
    python benchmarks/step_phases.py --batch 16 --num-prompts 32 --max-new-tokens 64 \
        --draft eagle:examples/tiny-deepseek-v3-eagle3-mla:1

Each phase is timed by perf_counter around the engine's own method: the whole step (ModelRunner.run), the target
forward over the step's rows (ModelRunner.forward), the acceptance (Verifier.__call__), the draft's work
(propose) and, for a block draft, its two parts: writing the new positions' context into the draft's cache and the
block forward; for a chain (EAGLE-3, MTP), each draft forward and each draft head (its greedy proposals). Medians
over every step of the run (the few prompt steps included), the tokens a step committed, and a step's time over the
plain step's: speedup / acceptance length is that ratio's inverse (a step commits its tokens in that time against
one token per plain step), so a chain of K draft steps, each some share of a plain step, bounds it whatever the
acceptance.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

from eyas import LLM, SamplingParams
from eyas.config import SpeculativeConfig
from eyas.paths import DEFAULT_MODEL
from eyas.records import read_prompt_file

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DRAFTS = [f"eagle:{REPO / 'examples' / 'tiny-deepseek-v3-eagle3-mla'}:3",
                  f"dflash:{REPO / 'examples' / 'tiny-deepseek-v3-dflash'}:7",
                  f"dflash:{REPO / 'examples' / 'tiny-deepseek-v3-dflash'}:3"]


def timed(times: dict[str, list[float]], obj: object, method: str, phase: str) -> None:
    """Replace obj.method with a wrapper adding each call's seconds to times[phase]."""
    inner = getattr(obj, method)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        out = inner(*args, **kwargs)
        times[phase].append(time.perf_counter() - start)
        return out

    setattr(obj, method, wrapper)


class TimedCall:
    """A callable object timed as `timed` times a method (calling an object looks __call__ up on its type)."""

    def __init__(self, inner: object, times: dict[str, list[float]], phase: str) -> None:
        self.inner, self.times, self.phase = inner, times, phase

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        out = self.inner(*args, **kwargs)
        self.times[self.phase].append(time.perf_counter() - start)
        return out

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def measure(model: Path, config: SpeculativeConfig | None, prompts: list, max_tokens: int, dtype: str, batch: int
            ) -> dict:
    llm = LLM(model, max_num_seqs=batch, compiled_step=True, threads=1, dtype=dtype,
              **({"speculative_config": config} if config is not None else {}))
    llm.generate(prompts[:batch], SamplingParams(temperature=0, max_tokens=16))  # first calls and caches, untimed
    runner, times = llm.runner, defaultdict(list)
    timed(times, runner, "run", "step")
    timed(times, runner, "forward", "target forward")
    runner.verifier = TimedCall(runner.verifier, times, "acceptance")
    if runner.proposer is not None:
        timed(times, runner.proposer, "propose", "propose")
        if hasattr(runner.proposer, "_block"):  # a block draft
            timed(times, runner.proposer, "_write_context", "propose: context write")
            timed(times, runner.proposer, "_block", "propose: block forward")
        else:  # a chain: its draft forwards (a compiled draft is called as an object) and its heads
            draft = runner.proposer.draft
            timed(times, draft, "greedy_tokens", "propose: draft head")
            runner.proposer.draft = TimedCall(draft, times, "propose: draft forward")
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    start = time.perf_counter()
    tokens = sum(len(out.token_ids) for i in range(0, len(prompts), batch)
                 for out in llm.generate(prompts[i:i + batch], params))
    seconds = time.perf_counter() - start
    steps = len(times["step"])
    row = {"dtype": str(llm.runner.dtype).removeprefix("torch."), "tokens_per_s": round(tokens / seconds, 1),
           "steps": steps, "tokens_per_step": round(tokens / steps, 3)}
    if times.get("propose: draft forward"):
        row["draft forwards per step"] = round(len(times["propose: draft forward"]) / steps, 2)
    return row | {f"{phase} ms": round(1e3 * statistics.median(t), 3) for phase, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--draft", action="append", metavar="METHOD:PATH:K",
                    help="a draft to measure beside plain decoding (repeatable; METHOD eagle, mtp or dflash, PATH "
                         "empty for mtp); default: "
                         + ", ".join(d.replace(str(REPO) + "/", "") for d in DEFAULT_DRAFTS))
    ap.add_argument("--prompts", type=Path, default=REPO / "examples" / "prompts" / "eval.jsonl")
    ap.add_argument("--num-prompts", type=int, default=16, help="the file's first prompts (default 16)")
    ap.add_argument("--batch", type=int, default=1, help="prompts decoded together, the next ones when they are done "
                    "(default 1)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="the target's dtype (default auto, as eyas runs: bfloat16 on CPUs with AMX)")
    ap.add_argument("--out", type=Path, help="write the rows here as JSON")
    args = ap.parse_args()
    prompts = read_prompt_file(args.prompts)[:args.num_prompts]
    configs: list[tuple[str, SpeculativeConfig | None]] = [("plain", None)]
    for spec in args.draft or DEFAULT_DRAFTS:
        method, path, k = spec.split(":")
        configs.append((f"{method} {Path(path).name} K={k}".replace("  ", " "),
                        SpeculativeConfig(method=method, draft_model=path or None, num_speculative_tokens=int(k),
                                          adaptive_width=False)))
    rows = {}
    for name, config in configs:
        rows[name] = row = measure(args.model, config, prompts, args.max_new_tokens, args.dtype, args.batch)
        row["step / plain step"] = round(row["step ms"] / rows["plain"]["step ms"], 3)
        print(name, json.dumps(row), flush=True)
    if args.out:
        settings = {k: str(v).replace(str(REPO) + "/", "") for k, v in vars(args).items()}
        args.out.write_text(json.dumps({"settings": settings, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
