"""The C kernel for attention over MLA latents at decode and verify rows (latent_attention.c) on CPU: float32
queries over latents kept in float32 or bfloat16.

At 16 sequences of the eval prompts the attention over the paged latents was 40% of a compiled decode step, and
torch's fused SDPA ran it at about 5 GB/s of latents against the 12-13 GB/s that one core of the Xeon measured
streams: its blocks pack every 512 positions of latents for a product with only a few query rows. The kernel reads
the context once per block of query rows, scoring and summing each block of positions while it is in cache, and
computes each row the same way whatever the other rows are. A step's latents at 32 sequences (some 130 MB over the
bundled target's 8 layers at 220-token contexts) come from memory, not cache, and bfloat16 latents halve them:
`python benchmarks/latent_attention.py --batch 32 --context 220` (contexts of 110 to 220 positions, one thread)
times a decode call at 1300 us over float32 latents, 915 over bfloat16 ones and 2084 through SDPA (a version that
read the context twice, scores then sums, took 1470 and 1068).

It is built as eyas.models.c_kernels builds every C kernel; where none builds, attention falls back to SDPA with a
warning, once. Large calls split their sequences among threads as SDPA's would (`threads`): the C function
releases the GIL while it runs.
"""

from __future__ import annotations

import ctypes
import functools
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from eyas.models import c_kernels

SOURCE = Path(__file__).with_name("latent_attention.c")
LATENT_DTYPES = (torch.float32, torch.bfloat16)
ERRORS = {-1: "out of memory for the scores", -2: "the value is wider than the key, or the rows are not a multiple "
          "of the bias rows", -3: "a query row sees no position"}


def library_path() -> Path:
    """Where the kernel built from this source, with these flags, for this CPU, is kept."""
    return c_kernels.library_path(SOURCE)


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The compiled kernel, built on first use; None where it cannot be built (SDPA runs instead)."""
    library = c_kernels.build(SOURCE, "attention over MLA latents", "torch's SDPA")
    if library is None:
        return None
    for run in (library.latent_attention_f32, library.latent_attention_bf16):
        run.restype = ctypes.c_int
        run.argtypes = [
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
            ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_float,
            ctypes.c_void_p]  # q, kv, kv strides (batch, position), bias, H, B, R, S, D, DV, scale, out
    return library


def _run(kv: torch.Tensor):
    """The C function for latents of kv's dtype."""
    library = _library()
    return library.latent_attention_f32 if kv.dtype == torch.float32 else library.latent_attention_bf16


def load() -> bool:
    """Build (first use on this machine) and load the kernel now, not inside the first step that attends; whether
    it runs."""
    return _library() is not None


def reads(cache: torch.Tensor) -> bool:
    """Whether the kernel attends over this cache of latents (on CPU, float32 or bfloat16): its queries are then
    float32, whatever the model's dtype (over bfloat16 latents it rounds them to bfloat16 where the CPU has
    bfloat16 dot products: a bfloat16 model's queries lose nothing)."""
    return cache.device.type == "cpu" and cache.dtype in LATENT_DTYPES and _library() is not None


def takes(queries: torch.Tensor, kv: torch.Tensor, value_dim: int) -> bool:
    """Whether the kernel runs this call: float32 queries over latents it reads, on CPU with no gradient wanted,
    latents with unit stride along their width."""
    return (queries.dtype == torch.float32 and queries.device.type == "cpu" and reads(kv)
            and not (torch.is_grad_enabled() and (queries.requires_grad or kv.requires_grad))
            and value_dim <= kv.shape[-1] and kv.stride(-1) == 1)


@functools.cache
def _pool(threads: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(threads, thread_name_prefix="eyas-attention")


def latent_attention(queries: torch.Tensor, kv: torch.Tensor, bias: torch.Tensor, scale: float, value_dim: int,
                     threads: int = 1) -> torch.Tensor:
    """queries [batch, rows, D]; kv [batch, S, D] (any batch and row strides); bias [batch, bias_rows, S], 0 where
    visible and -inf elsewhere, query row r reading bias row r // (rows // bias_rows) -> [batch, rows, value_dim]:
    softmax(queries . kv * scale + bias) . kv[..., :value_dim]. With `threads` > 1 the batch rows are split among
    that many threads (the call releases the GIL); each row's numbers are the same either way."""
    batch, rows, width = queries.shape
    seq_len = kv.shape[1]
    if kv.shape != (batch, seq_len, width) or bias.shape[0] != batch or bias.shape[2] != seq_len \
            or rows % bias.shape[1]:
        raise ValueError(f"latent_attention: queries {tuple(queries.shape)}, latents {tuple(kv.shape)} and bias "
                         f"{tuple(bias.shape)} do not fit together")
    queries, bias = queries.contiguous(), bias.to(torch.float32).contiguous()
    out = torch.empty(batch, rows, value_dim, dtype=torch.float32)
    run, heads, size = _run(kv), rows // bias.shape[1], queries.element_size()

    def part(first: int, count: int) -> int:  # batch rows first..first + count - 1
        return run(queries.data_ptr() + first * queries.stride(0) * size,
                   kv.data_ptr() + first * kv.stride(0) * kv.element_size(), kv.stride(0), kv.stride(1),
                   bias.data_ptr() + first * bias.stride(0) * size, heads, count, rows, seq_len, width, value_dim,
                   scale, out.data_ptr() + first * out.stride(0) * size)

    threads = max(1, min(threads, batch))
    if threads == 1:
        code = part(0, batch)
    else:
        bounds = [batch * t // threads for t in range(threads + 1)]
        codes = list(_pool(threads).map(part, bounds[:-1], [b - a for a, b in zip(bounds, bounds[1:])]))
        code = next((c for c in codes if c != 0), 0)
    _check(code, f"queries {tuple(queries.shape)} over latents {tuple(kv.shape)}")
    return out


def latent_attention_alone(q: torch.Tensor, cache: torch.Tensor, first_slot: int, seq_len: int, bias: torch.Tensor,
                           scale: float, value_dim: int) -> torch.Tensor:
    """One sequence's query rows q [rows, heads, D] (contiguous) over the slots first_slot.. first_slot + seq_len - 1
    of cache [slots, D], with bias [rows, seq_len] (float32, contiguous): [rows, heads, value_dim]. latent_attention
    for a batch of one whose context is one run of the cache, with nothing to check or copy (the caller has:
    `takes` on the same tensors, once per step)."""
    rows, heads, width = q.shape
    out = torch.empty(rows, heads, value_dim, dtype=torch.float32)
    size = cache.element_size()
    code = _run(cache)(
        q.data_ptr(), cache.data_ptr() + first_slot * cache.stride(0) * size, 0, cache.stride(0), bias.data_ptr(),
        heads, 1, rows * heads, seq_len, width, value_dim, scale, out.data_ptr())
    _check(code, f"queries {tuple(q.shape)} over {seq_len} latents")
    return out


def _check(code: int, call: str) -> None:
    if code != 0:
        raise RuntimeError(f"latent_attention: {call}: {ERRORS.get(code, code)}")
