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

Where the CPU has AMX tiles, calls over bfloat16 latents run on them (`on_tiles`): the scores and the weighted sums
are tile products, the softmax weights rounded to bfloat16. A verify step's 16 query rows (4 positions x 4 heads)
over 200 positions took 21 us against 73 on the vector path, one decode row's 4 query rows 17 against 20, and 128
heads (a DeepSeek-V3 layer's rows) ran 2.6x faster: `python benchmarks/latent_attention.py --batch 1 --concurrency`
with `--heads 128`. The bundled target's speculative step at batch 1 went from 1.44x plain to 1.52-1.60x (synthetic
acceptance 0.8), and its plain decode stayed within 2% (0.98-0.99x the vector path at c = 1 to 32).

It is built as eyas.models.c_kernels builds every C kernel; where none builds, attention falls back to SDPA with a
warning, once. Large calls split their sequences (or a prompt chunk's positions) among threads (`threads`):
the C function releases the GIL while it runs.
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
    run = library.latent_attention_run
    run.restype = ctypes.c_int
    run.argtypes = [
        ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
        ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_float,
        ctypes.c_void_p, ctypes.c_int]
    # q, q in bfloat16, kv, kv in bfloat16, kv strides (batch, position), bias, H, B, R, S, D, DV, scale, out, out
    # in bfloat16
    library.latent_attention_tiles.restype = ctypes.c_int
    library.latent_attention_tiles.argtypes = [ctypes.c_int]
    library.tiles = bool(library.latent_attention_tiles(1))  # before any call: every call goes the same way
    library.latent_attention_fits_registers.restype = ctypes.c_int
    library.fits_registers = bool(library.latent_attention_fits_registers())
    return library


def on_tiles() -> bool:
    """Whether calls over bfloat16 latents run on AMX tiles (their softmax weights rounded to bfloat16; see
    latent_attention.c), as they do wherever the CPU has them; elsewhere the vector path computes them with float32
    weights."""
    library = _library()
    return library is not None and library.tiles


def use_tiles(wanted: bool) -> bool:
    """Turn the tiles off (or back on) for every call from now on, for a benchmark to time the vector path beside
    them in one process (a model's decode and verify steps must not see both: their numbers differ); whether calls
    now run on tiles."""
    library = _library()
    if library is None:
        return False
    library.tiles = bool(library.latent_attention_tiles(int(wanted)))
    return library.tiles


def load() -> bool:
    """Build (first use on this machine) and load the kernel now, not inside the first step that attends; whether
    it runs."""
    return _library() is not None


def reads(cache: torch.Tensor) -> bool:
    """Whether the kernel attends over this cache of latents (on CPU, float32 or bfloat16), for queries in float32
    or bfloat16 (over bfloat16 latents it rounds float32 queries to bfloat16 where the CPU has bfloat16 dot
    products: a bfloat16 model's queries lose nothing). Over float32 latents only where its accumulators fit the
    CPU's registers (AVX-512, or AVX2 with FMA): built generic for other CPUs they spill, and SDPA, which computes a
    float32 row alike whatever rows run beside it, is faster (on an AVX2 AMD EPYC before the kernel had AVX2 blocking
    it took 3-7x SDPA's time, `python benchmarks/latent_attention.py --concurrency`); over bfloat16 latents
    everywhere, as SDPA in bfloat16 does not."""
    library = _library()
    return (cache.device.type == "cpu" and cache.dtype in LATENT_DTYPES and library is not None
            and (library.fits_registers or cache.dtype == torch.bfloat16))


def takes(queries: torch.Tensor, kv: torch.Tensor, value_dim: int) -> bool:
    """Whether the kernel runs this call: float32 or bfloat16 queries over latents it reads, on CPU with no gradient
    wanted, latents with unit stride along their width."""
    return (queries.dtype in LATENT_DTYPES and queries.device.type == "cpu" and reads(kv)
            and not (torch.is_grad_enabled() and (queries.requires_grad or kv.requires_grad))
            and value_dim <= kv.shape[-1] and kv.stride(-1) == 1)


@functools.cache
def _pool(threads: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(threads, thread_name_prefix="eyas-attention")


def _parts(batch: int, rows: int, heads: int, seq_len: int, threads: int) -> list[tuple[int, int, int, int]]:
    """The call split into at most `threads` parts (first batch row, batch rows, first query row, query rows): by
    batch rows, or a single sequence's rows by whole positions (a prompt chunk's), each part about as many
    (position, context position) pairs as a causal chunk at the end of seq_len positions gives it."""
    if batch == 1 and rows // heads > 1:
        positions = rows // heads
        count = min(threads, positions)
        pairs = [seq_len - positions + j + 1 for j in range(positions)]  # what position j sees
        total, bounds, seen = sum(pairs), [0], 0
        for j, n in enumerate(pairs):  # a part ends before the position whose middle passes its share
            if j and len(bounds) < count and (seen + n / 2) * count > total * len(bounds):
                bounds.append(j * heads)
            seen += n
        bounds.append(rows)
        return [(0, 1, a, b - a) for a, b in zip(bounds, bounds[1:]) if b > a]
    count = max(1, min(threads, batch))
    bounds = [batch * t // count for t in range(count + 1)]
    return [(a, b - a, 0, rows) for a, b in zip(bounds, bounds[1:])]


def latent_attention(queries: torch.Tensor, kv: torch.Tensor, bias: torch.Tensor, scale: float, value_dim: int,
                     threads: int = 1, out: torch.Tensor | None = None) -> torch.Tensor:
    """queries [batch, rows, D] (float32 or bfloat16); kv [batch, S, D] (any batch and row strides); bias [batch,
    bias_rows, S], 0 where visible and -inf elsewhere, query row r reading bias row r // (rows // bias_rows) ->
    [batch, rows, value_dim] in the queries' dtype (into `out` when given, contiguous): softmax(queries . kv * scale +
    bias) . kv[..., :value_dim]. With `threads` > 1 the call is split among that many threads (by batch rows, or a
    single sequence's query rows; the call releases the GIL), the first part on the calling thread (handing every
    part to the pool made a decode step's attention slower on 2 threads than on 1: a step at 32 sequences 17.9 ms
    on 1, 14.5 with the caller taking a part); each row's numbers are the same either way."""
    batch, rows, width = queries.shape
    seq_len = kv.shape[1]
    if kv.shape != (batch, seq_len, width) or bias.shape[0] != batch or bias.shape[2] != seq_len \
            or rows % bias.shape[1]:
        raise ValueError(f"latent_attention: queries {tuple(queries.shape)}, latents {tuple(kv.shape)} and bias "
                         f"{tuple(bias.shape)} do not fit together")
    queries, bias = queries.contiguous(), bias.to(torch.float32).contiguous()
    if out is None:
        out = torch.empty(batch, rows, value_dim, dtype=queries.dtype)
    elif out.shape != (batch, rows, value_dim) or out.dtype != queries.dtype or not out.is_contiguous():
        raise ValueError(f"latent_attention: out {tuple(out.shape)} {out.dtype} is not a contiguous "
                         f"{(batch, rows, value_dim)} {queries.dtype}")
    run, heads = _library().latent_attention_run, rows // bias.shape[1]
    q_half, kv_half = queries.dtype == torch.bfloat16, kv.dtype == torch.bfloat16
    q_size, kv_size, out_size = queries.element_size(), kv.element_size(), out.element_size()

    def part(first: int, count: int, row: int, row_count: int) -> int:
        return run(queries.data_ptr() + (first * rows + row) * width * q_size, q_half,
                   kv.data_ptr() + first * kv.stride(0) * kv_size, kv_half, kv.stride(0), kv.stride(1),
                   bias.data_ptr() + (first * bias.shape[1] + row // heads) * seq_len * 4, heads, count, row_count,
                   seq_len, width, value_dim, scale, out.data_ptr() + (first * rows + row) * value_dim * out_size,
                   q_half)  # out is in the queries' dtype

    parts = _parts(batch, rows, heads, seq_len, threads)
    others = [_pool(len(parts) - 1).submit(part, *p) for p in parts[1:]] if len(parts) > 1 else []
    codes = [part(*parts[0])] + [f.result() for f in others]  # the first part on this thread
    code = next((c for c in codes if c != 0), 0)
    _check(code, f"queries {tuple(queries.shape)} over latents {tuple(kv.shape)}")
    return out


def latent_attention_alone(q: torch.Tensor, cache: torch.Tensor, first_slot: int, seq_len: int, bias: torch.Tensor,
                           scale: float, value_dim: int) -> torch.Tensor:
    """One sequence's query rows q [rows, heads, D] (contiguous) over the slots first_slot.. first_slot + seq_len - 1
    of cache [slots, D], with bias [rows, seq_len] (float32, contiguous): [rows, heads, value_dim] in q's dtype.
    latent_attention for a batch of one whose context is one run of the cache, with nothing to check or copy (the
    caller has: `takes` on the same tensors, once per step)."""
    rows, heads, width = q.shape
    out = torch.empty(rows, heads, value_dim, dtype=q.dtype)
    code = _library().latent_attention_run(
        q.data_ptr(), q.dtype == torch.bfloat16, cache.data_ptr() + first_slot * cache.stride(0) * cache.element_size(),
        cache.dtype == torch.bfloat16, 0, cache.stride(0), bias.data_ptr(), heads, 1, rows * heads, seq_len, width,
        value_dim, scale, out.data_ptr(), q.dtype == torch.bfloat16)
    _check(code, f"queries {tuple(q.shape)} over {seq_len} latents")
    return out


def _check(code: int, call: str) -> None:
    if code != 0:
        raise RuntimeError(f"latent_attention: {call}: {ERRORS.get(code, code)}")
