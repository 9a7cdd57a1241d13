"""Where a batched plain decode step spends its time, by category, at several batch sizes.

    python benchmarks/decode_profile.py                      # batch 8, 16, 32 on the shipped tiny target
    python benchmarks/decode_profile.py --batch-sizes 16 --ops 20
    python benchmarks/decode_profile.py --enforce-eager       # the step op by op

For each batch size: N greedy requests are prefilled, then stepped to a steady state; ms per step is the median of
--rounds timed runs of --steps steps, then one more run under cProfile splits a step into the categories below
(inclusive times, so Python-heavy parts read a little high). The step is the compiled one, as every eyas command runs
it on CPU: its kernels (everything between two attentions) are one category, the attention over the paged cache
another; with --enforce-eager the eager step's attention, MoE and the rest. --ops adds torch.profiler's most
expensive ops (the compiled kernels' own work does not show there).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from pathlib import Path

import torch
from decode import prompts_for

from eyas import LLM, SamplingParams
from eyas.engine.compiled_step import CompiledTarget, Kernel
from eyas.paths import DEFAULT_MODEL
from eyas.threads import parallel_threads


def start(llm: LLM, batch: int, prompt_len: int) -> list:
    """Add `batch` requests and step until every one has prefilled and decoded a few tokens."""
    params = SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True)
    seqs = [llm.add_request(p, params) for p in prompts_for(batch, prompt_len, llm.model.config.vocab_size)]
    while any(s.num_computed < s.num_prompt_tokens for s in seqs):
        llm.step()
    for _ in range(4):
        llm.step()
    return seqs


def time_steps(llm: LLM, steps: int) -> float:
    start_time = time.perf_counter()
    for _ in range(steps):
        llm.step()
    return (time.perf_counter() - start_time) / steps * 1e3


def categories(stats: pstats.Stats, steps: int) -> dict[str, float]:
    """ms per step of each category, from a cProfile run of `steps` steps."""
    by_name: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for (file, line, name), (_, _, _, cumtime, _) in stats.stats.items():
        by_name.setdefault((file, name), []).append((line, cumtime))

    def cum(suffix: str, name: str | None, pick=None) -> float:
        hits = [(line, t) for (file, n), entries in by_name.items() if file.endswith(suffix)
                and (name is None or n == name) for line, t in entries]
        if pick is not None:
            hits = [pick(hits)] if hits else []
        return sum(t for _, t in hits) * 1e3 / steps

    # deepseek_v3.py has several forwards (and llm.py several steps): told apart by their first source line
    import eyas.models.deepseek_v3 as dsv3

    def at(function):
        line = function.__code__.co_firstlineno
        return lambda hits: next((h for h in hits if h[0] == line), (0, 0.0))

    compiled = cum("engine/compiled_step.py", "forward", at(CompiledTarget.forward))
    out = {"schedule": cum("engine/scheduler.py", "schedule"), "metadata": cum("models/attention.py", "build")}
    if compiled:
        out["compiled kernels (all but attention)"] = cum("engine/compiled_step.py", "__call__", at(Kernel.__call__))
        out["attention over the paged cache"] = cum("models/attention.py", "paged_latent_attention")
        out["model, other"] = compiled - out["compiled kernels (all but attention)"] - \
            out["attention over the paged cache"]
    else:
        out["attention"] = cum("models/deepseek_v3.py", "forward", at(dsv3.MLAttention.forward))
        out["  of it, paged attention"] = cum("models/attention.py", "paged_latent_attention")
        out["MoE"] = cum("models/deepseek_v3.py", "forward", at(dsv3.MoE.forward))
        out["  of it, routing"] = cum("models/deepseek_v3.py", "route")
        out["model, other"] = cum("models/deepseek_v3.py", "forward", at(dsv3.DeepseekV3Model.forward)) - \
            out["attention"] - out["MoE"]
    out["lm head"] = cum("models/deepseek_v3.py", "compute_logits")
    out["sampling"] = (cum("engine/sampling.py", "process_logits") + cum("engine/sampling.py", "sample")
                       + cum("engine/verifier.py", "_greedy"))  # an all-greedy batch: one argmax over its rows
    out["commit (append, stop checks)"] = cum("engine/scheduler.py", "commit")
    step = cum("engine/llm.py", "step", at(LLM.step))
    accounted = sum(v for k, v in out.items() if not k.startswith(" "))
    out["step, other (llm + runner Python)"] = step - accounted
    out["step total"] = step
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--steps", type=int, default=20, help="steps per timed run")
    ap.add_argument("--rounds", type=int, default=3, help="timed runs per batch size; the median is printed")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: what every eyas command "
                    "picks, see eyas.threads: 1 for the bundled target, its attention over large batches on one a "
                    "core)")
    ap.add_argument("--ops", type=int, default=0, help="also print torch.profiler's top N ops by self CPU time")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="the model's dtype (default float32)")
    ap.add_argument("--enforce-eager", action="store_true", help="profile the step op by op (default: the "
                    "compiled step, as every eyas command runs on CPU)")
    args = ap.parse_args()

    llm = LLM(args.model, max_num_seqs=max(args.batch_sizes), threads=args.threads,
              compiled_step=not args.enforce_eager, dtype=args.dtype)
    threads = f"{torch.get_num_threads()} (attention over large batches {parallel_threads()})"
    print(f"model {args.model.name}, threads {threads}, prompt {args.prompt_len} tokens, "
          f"{'eager' if args.enforce_eager else 'compiled step'}, {args.dtype}, torch {torch.__version__}")
    for batch in args.batch_sizes:
        seqs = start(llm, batch, args.prompt_len)
        ms = statistics.median(time_steps(llm, args.steps) for _ in range(args.rounds))
        profiler = cProfile.Profile()
        profiler.runcall(time_steps, llm, args.steps)
        cats = categories(pstats.Stats(profiler), args.steps)
        print(f"\nbatch {batch}: {ms:.2f} ms/step, {batch / ms * 1e3:.0f} tok/s (context ~{len(seqs[0])} tokens)")
        print("  under cProfile, ms/step:")
        for name, value in cats.items():  # in order, each "of it" line under its category
            print(f"    {name:<36} {value:7.2f}")
        if args.ops:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                time_steps(llm, args.steps)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.ops))
        for seq in seqs:
            llm.abort(seq)


if __name__ == "__main__":
    main()
