"""The C kernel for attention over MLA latents (eyas.models.latent_kernel) against torch's fused SDPA, in one run:

    python benchmarks/latent_attention.py                      # one layer's call, then whole decode runs
    python benchmarks/latent_attention.py --concurrency 16 32 --skip-calls
    python benchmarks/latent_attention.py --batch 1 --heads 128 --concurrency   # the calls only

1. One layer's attention call, float32, one thread: --batch sequences of --context positions (each sequence's
   context its own length, 0.5 to 1x --context, causal), 4 heads, 576-wide latents, 512-wide values, at 1 and 4
   positions per sequence (decode and verify at K=3); microseconds per call, the median of --repeats over --layers
   distinct caches (as the layers of a step read them, not from cache), each kernel against SDPA, and the kernel
   over the same latents kept in bfloat16 (as a bfloat16 model keeps them): on AMX tiles where the CPU has them,
   beside the vector path over the same latents. --heads 128 --batch 1: a DeepSeek-V3 layer's query rows.
2. The bundled target, compiled step, plain greedy decoding of 96 tokens on 3c eval prompts at most c at a time, the
   attention through the kernel (as eyas runs it: every short query row in one call, padded to the longest context,
   which the kernel does not read past a row's own), through the kernel with each far longer context attended alone
   (as SDPA needs: `AttentionMetadata.build` without `free_padding`), and through SDPA (the kernel switched off in
   the same process), interleaved rounds; output tok/s and the ratios to the kernel's. Tokens must be equal (SDPA's
   in float32 only: in bfloat16 it rounds a row by the rows beside it).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from eyas import LLM, SamplingParams
from eyas.models import latent_kernel
from eyas.paths import DEFAULT_EVAL_PROMPTS, DEFAULT_MODEL
from eyas.records import read_prompt_file


def one_call(batch: int, context: int, positions: int, heads: int, layers: int, repeats: int) -> dict[str, float]:
    """Microseconds per call over `layers` caches, median of `repeats`: the kernel over float32 latents, over
    bfloat16 latents (and, where that runs on AMX tiles, on the vector path too), SDPA."""
    width, value = 576, 512
    generator = torch.Generator().manual_seed(0)
    caches = [torch.randn(batch, context, width, generator=generator) for _ in range(layers)]
    q = torch.randn(batch, positions * heads, width, generator=generator)
    bias = torch.zeros(batch, positions, context)
    for b in range(batch):
        length = context // 2 + (context // 2) * b // max(1, batch - 1)
        for j in range(positions):
            bias[b, j, length - positions + j + 1:] = float("-inf")
    head_bias = bias.repeat_interleave(heads, 1)[:, None]

    halves = [kv.bfloat16() for kv in caches]

    def kernel(kv):
        return latent_kernel.latent_attention(q, kv, bias, 0.1, value)

    def sdpa(kv):
        return F.scaled_dot_product_attention(q[:, None], kv[:, None], kv[:, None], attn_mask=head_bias, scale=0.1)

    def timed(fn, latents) -> float:
        for kv in latents:
            fn(kv)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            for kv in latents:
                fn(kv)
            times.append((time.perf_counter() - start) / layers)
        return statistics.median(times) * 1e6

    out = {"float32": timed(kernel, caches), "bfloat16": timed(kernel, halves)}
    if latent_kernel.on_tiles():
        latent_kernel.use_tiles(False)
        try:
            out["bfloat16 vector"] = timed(kernel, halves)
        finally:
            latent_kernel.use_tiles(True)
    out["sdpa"] = timed(sdpa, caches)
    return out


def decode_runs(concurrency: list[int], rounds: int, dtype: str) -> None:
    prompts = read_prompt_file(DEFAULT_EVAL_PROMPTS)
    llm = LLM(DEFAULT_MODEL, max_num_seqs=max(concurrency), threads=1, compiled_step=True, dtype=dtype)
    params = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
    takes, free_padding = latent_kernel.takes, llm.runner.free_padding
    # (the kernel runs, padding is free): the kernel, the kernel with long contexts alone, SDPA
    configs = {"kernel": (True, free_padding), "kernel, long alone": (True, False), "sdpa": (False, False)}
    print(f"{'c':>3} {'kernel tok/s':>13} {'long alone tok/s':>17} {'SDPA tok/s':>11} {'kernel / long alone':>20} "
          f"{'kernel / SDPA':>14}")
    for c in concurrency:
        llm.scheduler.max_num_seqs = c
        batch = [prompts[i % len(prompts)] for i in range(3 * c)]
        seconds: dict[str, list[float]] = {name: [] for name in configs}
        tokens = {}
        for r in range(rounds + 1):  # the first round warms up
            for name, (kernel, free) in configs.items():
                latent_kernel.takes = takes if kernel else (lambda *args: False)
                llm.runner.free_padding = free
                start = time.perf_counter()
                outs = llm.generate(batch, params, use_tqdm=False)
                if r:
                    seconds[name].append(time.perf_counter() - start)
                tokens[name] = [o.token_ids for o in outs]
        latent_kernel.takes, llm.runner.free_padding = takes, free_padding
        # the same calls with more padding must give the same tokens; SDPA too in float32 (in bfloat16 it rounds a
        # row by the rows beside it)
        for name in configs if llm.runner.dtype == torch.float32 else ["kernel, long alone"]:
            if tokens[name] != tokens["kernel"]:
                raise SystemExit(f"c={c}: the greedy tokens of '{name}' differ from the kernel's")
        tok_s = {name: len(batch) * 96 / statistics.median(s) for name, s in seconds.items()}
        kernel = tok_s["kernel"]
        print(f"{c:>3} {kernel:>13.1f} {tok_s['kernel, long alone']:>17.1f} {tok_s['sdpa']:>11.1f} "
              f"{kernel / tok_s['kernel, long alone']:>19.2f}x {kernel / tok_s['sdpa']:>13.2f}x", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--heads", type=int, default=4, help="query heads per position (default 4, the bundled model's)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--concurrency", type=int, nargs="*", default=[1, 16, 32],
                    help="decode runs at these concurrencies (default 1 16 32; none: the calls only)")
    ap.add_argument("--rounds", type=int, default=3, help="timed decode rounds per engine (default 3)")
    ap.add_argument("--skip-calls", action="store_true", help="only the decode runs")
    ap.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16"],
                    help="the decode runs' dtype (default float32; auto: as eyas runs, bfloat16 on CPUs with AMX)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if not args.skip_calls:
        tiles = latent_kernel.on_tiles()
        print(f"one layer's call: {args.batch} sequences, contexts {args.context // 2}-{args.context}, {args.heads} "
              f"heads, 576-wide latents, one thread; us per call (bfloat16 latents on AMX tiles: {tiles})")
        for positions in (1, 4):
            t = one_call(args.batch, args.context, positions, args.heads, args.layers, args.repeats)
            line = (f"  {positions} position(s) per sequence: kernel {t['float32']:.0f}, SDPA {t['sdpa']:.0f} "
                    f"({t['sdpa'] / t['float32']:.2f}x); kernel over bfloat16 latents {t['bfloat16']:.0f} "
                    f"({t['float32'] / t['bfloat16']:.2f}x float32's)")
            if tiles:
                line += (f", on the vector path {t['bfloat16 vector']:.0f} (tiles "
                         f"{t['bfloat16 vector'] / t['bfloat16']:.2f}x the vector path)")
            print(line, flush=True)
    if args.concurrency:
        decode_runs(args.concurrency, args.rounds, args.dtype)


if __name__ == "__main__":
    main()
