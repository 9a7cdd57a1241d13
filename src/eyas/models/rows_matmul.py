"""The C kernel for a few rows times a large linear stored in gemv_layout (rows_matmul.c), on CPU: the logits of
a step's decode and verify rows through the target's lm_head and the draft's, float32 whether the weight is float32
or bfloat16 (widened exactly as it is read: half the bytes, and the logits of its float32 copy bit for bit).

On the bundled target's lm_head (8192 x 192), one thread: 4 rows took 0.40 ms through CPU BLAS against 0.19 ms
here, 1 row 0.10 against 0.09, 32 rows 1.5 against 1.3 (AVX-512); on an AVX2 EPYC 16 rows 0.84 against 0.78 and 32
rows 1.40 against 1.41, and with the head evicted before each call, as a step leaves it, 2 / 4 / 8 rows 0.39 / 1.11
/ 1.01 ms against 0.31 / 0.42 / 0.68 (`python benchmarks/rows_matmul.py [--cold]` measures them on the machine at
hand). Each row's logits are computed the same way whatever rows run beside it. Built by eyas.models.c_kernels;
where it cannot be, F.linear runs instead, after a warning.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
from torch import nn

from eyas.models import c_kernels

SOURCE = Path(__file__).with_name("rows_matmul.c")
KERNELS = {torch.float32: "rows_matmul_f32", torch.bfloat16: "rows_matmul_bf16"}  # the weight's dtype -> its kernel


@functools.cache
def _library() -> ctypes.CDLL | None:
    library = c_kernels.build(SOURCE, "the lm_head", "F.linear")
    if library is None:
        return None
    for fn in (library.rows_matmul_f32, library.rows_matmul_bf16):
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                       ctypes.c_void_p]  # x, M, K, w, N, out
    return library


def load() -> bool:
    """Build (first use on this machine) and load the kernel now, not inside the first step; whether it runs."""
    return _library() is not None


def takes(x: torch.Tensor, linear: nn.Linear) -> bool:
    """Whether `linear(x)` runs here: rows [M, K] on CPU with no gradient wanted, a bias-free float32 or bfloat16
    weight in gemv_layout (its transpose contiguous, as pack_for_inference leaves every linear on CPU), rows in
    float32 or the weight's dtype, and torch on one thread (the kernel runs on one; with more, BLAS spreads a large
    head over all of them)."""
    w = linear.weight
    return (x.dim() == 2 and w.dtype in KERNELS and x.dtype in (torch.float32, w.dtype)
            and x.device.type == w.device.type == "cpu"
            and torch.get_num_threads() == 1
            and linear.bias is None and w.t().is_contiguous() and x.shape[1] == w.shape[1]
            and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)) and _library() is not None)


def rows_matmul(x: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    """linear(x) for x [M, K] (see takes): [M, N], float32."""
    x = x.float().contiguous()  # exact from bfloat16
    w = linear.weight.t()  # [K, N], contiguous
    out = torch.empty(x.shape[0], w.shape[1], dtype=torch.float32)
    kernel = getattr(_library(), KERNELS[w.dtype])
    kernel(x.data_ptr(), x.shape[0], x.shape[1], w.data_ptr(), w.shape[1], out.data_ptr())
    return out


def linear_rows(x: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    """linear(x) for x [..., K], through the kernel where it takes the call (then float32, whatever the dtypes)."""
    rows = x.reshape(-1, x.shape[-1])
    if not takes(rows, linear):
        return linear(x)
    return rows_matmul(rows, linear).view(*x.shape[:-1], linear.weight.shape[0])

