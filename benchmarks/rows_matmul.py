"""The logits kernel (eyas.models.rows_matmul) against CPU BLAS (F.linear) on the bundled target's lm_head shape
(8192 x 192, in gemv_layout as the engine stores it), one thread, in one run:

    python benchmarks/rows_matmul.py [--rows 1 2 4 8 32] [--cold] [--dtype bfloat16]

Milliseconds per call, the best of 5 rounds of 40 calls; the two results must agree to 1e-4. With --dtype
bfloat16 the weight is bfloat16 (a bfloat16 model's head): F.linear then gives bfloat16 logits, the kernel float32
ones, the same as from the weight's float32 copy; the kernel's time beside that copy's is printed too. With --cold,
a 64 MB buffer is written before each call, so the weight comes from memory as in a step (the rest of the model
evicts it); each figure is then the median of 40 calls.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn

from eyas.models import rows_matmul
from eyas.models.layers import gemv_layout


def best_ms(fn) -> float:
    fn()
    if COLD is not None:
        times = []
        for _ in range(40):
            COLD.add_(1.0)
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2] * 1e3
    times = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(40):
            fn()
        times.append((time.perf_counter() - start) / 40)
    return min(times) * 1e3


COLD: torch.Tensor | None = None  # with --cold: written before each call, to evict the weight from every cache


def main() -> None:
    global COLD
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 32])
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=192)
    ap.add_argument("--cold", action="store_true", help="evict the weight from the caches before each call")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="the weight's dtype")
    args = ap.parse_args()
    if args.cold:
        COLD = torch.zeros(16 * 2**20)
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    head = nn.Linear(args.hidden, args.vocab, bias=False)
    head.weight = nn.Parameter(gemv_layout(head.weight.detach().to(dtype)), requires_grad=False)
    float_copy = nn.Linear(args.hidden, args.vocab, bias=False)
    float_copy.weight = nn.Parameter(gemv_layout(head.weight.detach().float()), requires_grad=False)
    if not rows_matmul.load():
        raise SystemExit("the kernel could not be built (see the warning above)")
    with torch.no_grad():
        for rows in args.rows:
            x = torch.randn(rows, args.hidden).to(dtype)
            torch.testing.assert_close(rows_matmul.rows_matmul(x, head), F.linear(x, head.weight).float(),
                                       rtol=1e-4 if dtype == torch.float32 else 2e-2, atol=1e-4)
            blas = best_ms(lambda x=x: F.linear(x, head.weight))
            kernel = best_ms(lambda x=x: rows_matmul.rows_matmul(x, head))
            line = (f"{rows:>3} rows x {args.vocab} x {args.hidden}: F.linear {blas:.3f} ms, kernel {kernel:.3f} ms, "
                    f"{blas / kernel:.2f}x")
            if dtype != torch.float32:
                copy = best_ms(lambda x=x: rows_matmul.rows_matmul(x, float_copy))
                line += f"; the kernel over the float32 copy {copy:.3f} ms ({copy / kernel:.2f}x)"
            print(line)


if __name__ == "__main__":
    main()
