"""The C kernel for attention over MLA latents (eyas.models.latent_kernel) against torch's fused SDPA, in one run:

    python benchmarks/latent_attention.py                      # one layer's call, then whole decode runs
    python benchmarks/latent_attention.py --concurrency 16 32 --skip-calls

1. One layer's attention call, float32, one thread: --batch sequences of --context positions (each sequence's
   context its own length, 0.5 to 1x --context, causal), 4 heads, 576-wide latents, 512-wide values, at 1 and 4
   positions per sequence (decode and verify at K=3); microseconds per call, the median of --repeats over --layers
   distinct caches (as the layers of a step read them, not from cache), each kernel against SDPA, and the kernel
   over the same latents kept in bfloat16 (as a bfloat16 model keeps them).
2. The bundled target, compiled step, plain greedy decoding of 96 tokens on 3c eval prompts at most c at a time, the
   attention through the kernel and through SDPA (the kernel switched off in the same process), interleaved rounds;
   output tok/s and their ratio. Tokens must be equal.
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


def one_call(batch: int, context: int, positions: int, layers: int, repeats: int) -> tuple[float, float, float]:
    """Microseconds per call (kernel over float32 latents, kernel over bfloat16 latents, SDPA) over `layers`
    caches, median of `repeats`."""
    heads, width, value = 4, 576, 512
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

    out = []
    for fn, latents in ((kernel, caches), (kernel, halves), (sdpa, caches)):
        for kv in latents:
            fn(kv)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            for kv in latents:
                fn(kv)
            times.append((time.perf_counter() - start) / layers)
        out.append(statistics.median(times) * 1e6)
    return out[0], out[1], out[2]


def decode_runs(concurrency: list[int], rounds: int) -> None:
    prompts = read_prompt_file(DEFAULT_EVAL_PROMPTS)
    llm = LLM(DEFAULT_MODEL, max_num_seqs=max(concurrency), threads=1, compiled_step=True, dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
    takes = latent_kernel.takes
    print(f"{'c':>3} {'kernel tok/s':>13} {'SDPA tok/s':>11} {'kernel / SDPA':>14}")
    for c in concurrency:
        llm.scheduler.max_num_seqs = c
        batch = [prompts[i % len(prompts)] for i in range(3 * c)]
        seconds: dict[str, list[float]] = {"kernel": [], "sdpa": []}
        tokens = {}
        for r in range(rounds + 1):  # the first round warms up
            for name in seconds:
                latent_kernel.takes = takes if name == "kernel" else (lambda *args: False)
                start = time.perf_counter()
                outs = llm.generate(batch, params, use_tqdm=False)
                if r:
                    seconds[name].append(time.perf_counter() - start)
                tokens[name] = [o.token_ids for o in outs]
        latent_kernel.takes = takes
        if tokens["kernel"] != tokens["sdpa"]:
            raise SystemExit(f"c={c}: the kernel's greedy tokens differ from SDPA's")
        tok_s = {name: len(batch) * 96 / statistics.median(s) for name, s in seconds.items()}
        print(f"{c:>3} {tok_s['kernel']:>13.1f} {tok_s['sdpa']:>11.1f} {tok_s['kernel'] / tok_s['sdpa']:>13.2f}x",
              flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 32])
    ap.add_argument("--rounds", type=int, default=3, help="timed decode rounds per engine (default 3)")
    ap.add_argument("--skip-calls", action="store_true", help="only the decode runs")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if not args.skip_calls:
        print(f"one layer's call: {args.batch} sequences, contexts {args.context // 2}-{args.context}, 4 heads, "
              "576-wide latents, float32, one thread; us per call")
        for positions in (1, 4):
            kernel, half, sdpa = one_call(args.batch, args.context, positions, args.layers, args.repeats)
            print(f"  {positions} position(s) per sequence: kernel {kernel:.0f}, SDPA {sdpa:.0f} "
                  f"({sdpa / kernel:.2f}x); kernel over bfloat16 latents {half:.0f} ({kernel / half:.2f}x float32's)",
                  flush=True)
    decode_runs(args.concurrency, args.rounds)


if __name__ == "__main__":
    main()
