"""The target's decode and verify forward as ahead-of-time compiled kernels (AOTInductor, C++ on CPU).

Eager, a batch-1 decode step of the bundled target runs some 400 small ops, and at a few rows most of each op's
time is dispatch, not arithmetic. Compiled, everything between two attentions is one kernel call: layer i's
output projection, residual, norm and MLP or MoE, then layer i+1's norm, projections, rope and absorbed queries.
The paged-cache write and the attention over the cache stay eager (their shapes change with every context); so do
prompt chunks, which are few and long, except in bfloat16 (below).

    first      layer 0's attention inputs                          (h, cos, sin) -> (q, latent)
    step       layer i after its attention, then layer i+1's       (h, out, cos, sin) -> (h, q, latent)
               attention inputs
    last       the last layer after its attention, the final norm  (h, out) -> (normed h, h)

On CPU each layer has one kernel of its own with its weights frozen in as constants (`_Frozen`), compiled for any
row count from 1 to MAX_ROWS with the compiler's GEMM templates tried against ATen's (`max_autotune`): constant
weights are packed once for the CPU's instructions, where weights passed to one kernel shared by every layer of a
kind were repacked by CPU BLAS on every call. In bfloat16 (AMX, AVX512-BF16) those ran about 2x slower than float32;
in float32, on an AVX2 CPU, the bundled target's kernels took 1.22 ms for 4 verify rows against 1.76 (one thread,
weights in cache), and decoding ran 1.08-1.13x as fast at 1 and 4 sequences, 0.94-0.99x at 16 and 32 (see
docs/serving.md). A kernel is compiled once per set of weights, torch version and thread count and kept on disk
(`cache_dir()`); a later start loads it in a few seconds.

In bfloat16 every step runs the kernels, prompt chunks too (`every_step`), and each kernel rounds a row alike
whatever rows run beside it, so a row's bits never depend on the batch. In float32 steps with a prompt chunk of
more than FEW_ROWS rows in all, and steps of more than MAX_ROWS rows, run eager: CPU BLAS multiplies a chunk's rows
faster than the kernels' GEMMs (16 sequences decoding beside arriving prompts ran 0.90x as fast with every step in
the kernels), but an eager step costs ~10 ms however few its rows (`FEW_ROWS`).

Calls go straight to the compiled runner (`loader.run`), which costs a few microseconds a call where a
`torch.compile`d function's guards and wrapper cost about 30.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from eyas.models import deepseek_v3, eagle3, layers
from eyas.models.attention import SHORT_QUERY, AttentionMetadata
from eyas.models.deepseek_v3 import DecoderLayer, DeepseekV3Model, MLAttention, MoE
from eyas.models.eagle3 import Eagle3Draft
from eyas.models.mtp import MTPDraft
from eyas.paths import compiled_dir as cache_dir

# the most rows a compiled step takes: 32 sequences verifying 3 drafts each (a compiled MoE layer runs each row's
# chosen experts, 1.7x faster than all experts over all rows from 16 to 160 rows)
MAX_ROWS = 128
# float32 steps of at most this many rows run the kernels though a prompt chunk is among them: an eager step's GEMMs
# take few rows poorly (bundled target, one thread, one prompt: 17 tokens 12.6 ms eager against 6.8 in the kernels,
# 24 tokens 14.1 / 9.2, 40 tokens 17.2-18.3 / 13.8; 48 tokens 20.0 / 18.2-19.0, 64 tokens 22.4-23.0 / 21.4-22.0, 128
# tokens 32.8-35.0 / 42.3, the kernels' absorbed attention over a chunk's keys growing with its rows)
FEW_ROWS = 40
# packed forms computed from other tensors, which no kernel reads (traced code takes the plain form and fuses it)
DERIVED = ("weight_pair",)


class _Frozen(nn.Module):
    """`fn(*args)` over modules whose tensors export keeps as the kernel's constants."""

    def __init__(self, modules: Sequence[nn.Module], fn: Callable) -> None:
        super().__init__()
        self.parts = nn.ModuleList(modules)
        self.fn = fn

    def forward(self, *inputs: torch.Tensor):
        return self.fn(*inputs)


def every_step(dtype: torch.dtype) -> bool:
    """Whether every step runs the kernels, prompt chunks too: bfloat16 ones, whose rounding of a row must not depend
    on the path it takes (see the module docstring). Float32 steps with prompt chunks run eager above FEW_ROWS rows,
    where CPU BLAS is faster than the kernels' GEMMs at their 128 rows a call."""
    return dtype == torch.bfloat16


def _weights_digest(modules: Sequence[nn.Module]) -> str:
    """A digest of every tensor a kernel over `modules` may freeze in: each module's and submodule's parameters,
    buffers and the packed tensors set by pack() (plain attributes), with their names, shapes and dtypes."""
    digest = hashlib.sha256()
    for top in modules:
        for _, module in top.named_modules():
            held = [*module._parameters.items(), *module._buffers.items(),
                    *((n, t) for n, t in vars(module).items() if isinstance(t, torch.Tensor) and n not in DERIVED)]
            for name, t in held:
                if t is not None:
                    digest.update(f"{name}{tuple(t.shape)}{t.dtype}".encode())
                    digest.update(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:24]


class Kernel:
    """One compiled kernel, its layer's weights inside: called with its arguments. The compiled code reads each
    input with the strides it was traced with and checks none of them, so arguments are made contiguous."""

    def __init__(self, name: str, loader) -> None:
        self.name = name
        self.loader = loader

    def __call__(self, *args: torch.Tensor) -> list[torch.Tensor]:
        return self.loader.run([a.contiguous() for a in args])


@functools.cache
def _source_digest() -> str:
    """The model code the kernels are traced from: a change to it compiles them again."""
    digest = hashlib.sha256()
    for module in (deepseek_v3, eagle3, layers, sys.modules[__name__]):
        digest.update(Path(module.__file__).read_bytes())
    return digest.hexdigest()[:16]


def compile_kernel(name: str, modules: Sequence[nn.Module], fn: Callable, args: Sequence[torch.Tensor],
                   rows: tuple[int, int], progress: Callable[[], None] | None = None, settings: str = "") -> Kernel:
    """Export `fn(*args)`, the tensors of `modules` frozen in as constants, for args whose dim 0 (rows) is anything
    in rows = (least, most), or exactly their own when least == most; compile it with AOTInductor, or load it from
    the disk cache when compiled before for these weights. `settings` (config_settings) is what else the code depends
    on: two models with the same tensors but another MoE routing or another draft switch compile apart. `progress`
    is called before compiling (not before loading)."""
    if len({id(a) for a in args}) < len(args):  # export would make them one input of the kernel
        raise ValueError(f"compiling {name}: one example tensor is passed for two arguments")
    least, most = rows
    if not least <= args[0].shape[0] <= most or (least < most and args[0].shape[0] < 2):
        raise ValueError(f"compiling {name}: example args of {args[0].shape[0]} rows for kernels of {rows} rows "
                         "(a dynamic kernel is traced at 2 rows or more)")
    # the compiler writes the thread count torch runs on into the code (at one thread, no parallel region at all): a
    # kernel compiled for one thread would run on one whatever --threads a later engine is given
    key = json.dumps({
        "name": name, "torch": torch.__version__, "source": _source_digest(), "rows": rows, "settings": settings,
        "threads": torch.get_num_threads(), "weights": _weights_digest(modules),
        "args": [(list(a.shape[1:]), str(a.dtype)) for a in args]}, sort_keys=True)
    path = cache_dir() / f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:24]}.pt2"
    if not path.is_file():
        if progress is not None:
            progress()
        with warnings.catch_warnings():  # torch's notices about its own internals, nothing the user can act on
            warnings.simplefilter("ignore", FutureWarning)
            warnings.filterwarnings("ignore", message="TypedStorage is deprecated")
            # (torch.export.Dim imports sympy, a third of a second of a start-up that only loads)
            dim = torch.export.Dim("rows", min=least, max=most) if least < most else None
            _compile(_Frozen(modules, fn), args, [{0: dim} if dim is not None else None for _ in args], path)
    with _unpacked_apart():
        # the loader torch._inductor.aoti_load_package makes, made here: importing torch._inductor imports its
        # compiler (torch._dynamo, sympy), 1.5 s of every start-up that finds its kernels already compiled
        loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
    return Kernel(name, loader)


@contextmanager
def _unpacked_apart():
    """AOTInductor unpacks a package into a new directory under the temporary directory ($TMPDIR) and removes it
    only when the loader is destroyed, which a process stopped by a signal never reaches (a server stopped with
    SIGTERM left 15 MB in /tmp each time). Here it unpacks into a directory of this process's own, removed once the
    kernel is loaded: the loaded library stays mapped and the loader reads no file after."""
    unpacked = tempfile.mkdtemp(prefix="eyas-kernel-")
    before = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = unpacked
    try:
        yield
    finally:
        if before is None:
            del os.environ["TMPDIR"]
        else:
            os.environ["TMPDIR"] = before
        shutil.rmtree(unpacked, ignore_errors=True)


def _compile(frozen: _Frozen, args: Sequence[torch.Tensor], dynamic: list, path: Path) -> None:
    """Export and compile `frozen` into the package at `path`."""
    with torch.inference_mode(False), torch.no_grad():
        program = torch.export.export(frozen, tuple(args), dynamic_shapes=[tuple(dynamic)], strict=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:  # a complete file only, even if interrupted
        # constant weights, and GEMM templates (with their AVX2, AVX-512, AMX or AVX512-BF16 micro-kernels) tried
        # against ATen's at compile time, each a row-wise kernel for any row count
        configs = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN",
                   "autotune_num_choices_displayed": 0, "max_autotune_report_choices_stats": False}
        staged = torch._inductor.aoti_compile_and_package(program, package_path=str(Path(tmp) / path.name),
                                                          inductor_configs=configs)
        os.replace(staged, path)


# config fields no kernel reads (the embedding, the head and where the file was are outside every kernel)
OUTSIDE_KERNELS = ("source", "vocab_size", "bos_token_id", "eos_token_ids", "torch_dtype", "max_position_embeddings",
                   "num_nextn_predict_layers", "tie_word_embeddings")


def config_settings(config: Any) -> str:
    """A model config's fields as a kernel's cache key reads them: all but OUTSIDE_KERNELS, at any depth."""
    def kept(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: kept(v) for k, v in value.items() if k not in OUTSIDE_KERNELS}
        if isinstance(value, (list, tuple)):
            return [kept(v) for v in value]
        return value
    return json.dumps(kept(dataclasses.asdict(config)), sort_keys=True, default=str)


class CompiledTarget:
    """The compiled decode/verify forward of a DeepseekV3Model (see the module docstring)."""

    def __init__(self, model: DeepseekV3Model, progress: Callable[[str], None] | None = None) -> None:
        self.model = model
        config = model.config
        self.num_layers = config.num_hidden_layers
        self.attentions = [layer.self_attn for layer in model.layers[:self.num_layers]]
        for layer in model.layers[:self.num_layers]:
            if isinstance(layer.mlp, MoE):
                layer.mlp.pack_all()
        calls = _target_calls(model)
        start = time.perf_counter()
        kernels = []
        for n, (name, modules, fn, args) in enumerate(calls):
            line = (f"compiling the decode step: kernel {n + 1}/{len(calls)} ({name}), once for these weights "
                    f"(kept in {cache_dir()})")
            told = (lambda line=line: progress(line)) if progress is not None else None
            kernel = compile_kernel(name, modules, fn, args, (1, MAX_ROWS), told, config_settings(config))
            _check_against_eager(name, kernel, fn, args)
            _warm_every_row_count(kernel, args, (1, MAX_ROWS))
            kernels.append(kernel)
        self.seconds = time.perf_counter() - start
        self.first, self.steps, self.last = kernels[0], kernels[1:-1], kernels[-1]
        # in bfloat16 every step runs the kernels, prompt chunks too, MAX_ROWS rows a call: a row's bits then never
        # depend on which path ran it or beside which rows, which greedy decoding in bfloat16 needs
        self.every_step = every_step(model.embed_tokens.weight.dtype)

    @staticmethod
    def takes(attn: AttentionMetadata) -> bool:
        """Whether the compiled step runs this batch: decode and verify rows only, at most MAX_ROWS of them, or any
        rows at most FEW_ROWS."""
        return attn.num_tokens <= FEW_ROWS or (
            attn.num_tokens <= MAX_ROWS and all(g.query_rows.shape[1] <= SHORT_QUERY for g in attn.groups))

    def runs(self, attn: AttentionMetadata) -> bool:
        """Whether this step runs compiled: any batch where every_step, else the ones `takes` accepts."""
        return self.every_step or self.takes(attn)

    def forward(self, input_ids: torch.Tensor, attn: AttentionMetadata, kv_caches: Sequence[torch.Tensor],
                aux_hidden_state_ids: Sequence[int] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """DeepseekV3Model.forward for a batch `runs` accepts: the same outputs."""
        model = self.model
        cos, sin = (t.to(model.embed_tokens.weight.dtype) for t in model.rotary(attn.positions))
        h = model.embed_tokens(input_ids)
        captured = {0: h} if 0 in aux_hidden_state_ids else {}
        q, latent = _in_pieces(self.first, h, cos, sin)
        for i in range(self.num_layers):
            out = self.attentions[i].cached_attention(q, latent, attn, kv_caches[i])
            if i + 1 < self.num_layers:
                h, q, latent = _in_pieces(self.steps[i], h, out, cos, sin)
            else:
                normed, h = _in_pieces(self.last, h, out)
            if i + 1 in aux_hidden_state_ids:
                captured[i + 1] = h
        return normed, [captured[i] for i in aux_hidden_state_ids]


def _in_pieces(kernel: Kernel, *args: torch.Tensor, least_rows: int = 1) -> list[torch.Tensor]:
    """A kernel over rows of any count: MAX_ROWS at a time (each row's outputs are its own), no piece under
    `least_rows` (the fewest the kernel takes)."""
    rows = args[0].shape[0]
    if rows <= MAX_ROWS:
        return kernel(*args)
    bounds = [*range(0, rows, MAX_ROWS), rows]
    bounds[-2] = min(bounds[-2], rows - least_rows)
    pieces = [kernel(*(a[start:end] for a in args)) for start, end in zip(bounds, bounds[1:])]
    return [torch.cat(outputs) for outputs in zip(*pieces)]


def _target_calls(model: DeepseekV3Model) -> list[tuple]:
    """Each call of a step: (kernel name, the modules whose tensors it reads, the function over them, example args):
    a kernel a layer, for every row count."""
    config = model.config
    layers = list(model.layers[:config.num_hidden_layers])
    kinds = [type(layer.mlp).__name__.lower() for layer in layers]  # "mlp" (dense) or "moe"
    weight, attn = model.embed_tokens.weight, layers[0].self_attn
    dtype, device = weight.dtype, weight.device
    cos, sin = (t.to(dtype) for t in model.rotary(torch.arange(2, device=device)))
    h = torch.zeros(2, config.hidden_size, dtype=dtype, device=device)
    out = torch.zeros(2, attn.num_heads, attn.kv_lora_rank, dtype=dtype, device=device)
    found = [("first-layer0", _attention_parts(layers[0]), _first_fn(layers[0]), (h, cos, sin))]
    found += [(f"step-{kind}-layer{i}", [*_after_parts(layers[i]), *_attention_parts(layers[i + 1])],
               _step_fn(layers[i], layers[i + 1]), (h, out, cos, sin)) for i, kind in enumerate(kinds[:-1])]
    found.append((f"last-{kinds[-1]}-layer{len(kinds) - 1}", [*_after_parts(layers[-1]), model.norm],
                  _last_fn(layers[-1], model.norm), (h, out)))
    return found


class _CompiledSteps:
    """What a compiled draft passes through to the draft it wraps: everything but its steps."""

    draft: Eagle3Draft | MTPDraft

    def combine_hidden_states(self, target_hidden: torch.Tensor, aux_hidden_states: list[torch.Tensor]
                              ) -> torch.Tensor:
        return self.draft.combine_hidden_states(target_hidden, aux_hidden_states)

    def compute_logits(self, prenorm: torch.Tensor) -> torch.Tensor:
        return self.draft.compute_logits(prenorm)

    def greedy_tokens(self, prenorm: torch.Tensor) -> torch.Tensor:
        return self.draft.greedy_tokens(prenorm)

    def cache_entry_shape(self) -> tuple[int, ...]:
        return self.draft.cache_entry_shape()


class CompiledDraft(_CompiledSteps):
    """An EAGLE-3 draft whose steps over decode rows run as compiled kernels: step 0's fusion of the target's states
    (fc and its norms); the layer up to its cache write (embedding, rope, input norms, projections: queries and cache
    entries); and after its attention (output projection, residual, MLP and the carried state). The attention over
    the draft's cache runs eager between them. Steps it does not take (`CompiledTarget.takes`) run the draft eager,
    except in bfloat16, where the kernels run every step, a prompt's positions too, MAX_ROWS rows a call (as the
    target's do): on the bundled draft 512 prompt positions took 12.0 ms against 16.7 eager, and the adaptive
    width's estimate of the draft's cost per prompt position fell from 102-107 us to 20 (random prompts, 4
    sequences). Otherwise it is the draft (the engine's DraftHead)."""

    def __init__(self, draft: Eagle3Draft, progress: Callable[[str], None] | None = None) -> None:
        self.draft = draft
        self.aux_hidden_state_ids = draft.aux_hidden_state_ids
        layer = draft.layers[0]
        dtype, device = draft.fc.weight.dtype, draft.fc.weight.device
        rows, H = 2, draft.config.hidden_size
        # distinct tensors: export takes one tensor passed twice for one input
        hidden, residual = (torch.zeros(rows, H, dtype=dtype, device=device) for _ in range(2))
        aux = [torch.zeros(rows, draft.config.target_hidden_size, dtype=draft.embed_tokens.weight.dtype, device=device)
               for _ in range(draft.config.num_aux_hidden_states)]  # the target's states, in the target's dtype
        token_ids, positions = torch.zeros(rows, dtype=torch.long, device=device), torch.arange(rows, device=device)

        def inputs(token_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor):
            cos, sin = (t.to(dtype) for t in draft.rotary(positions))
            return layer.attention_inputs(draft.embed(token_ids, hidden.dtype), hidden, cos, sin)

        with torch.no_grad():
            q, _, _ = inputs(token_ids, hidden, positions)
            out = torch.zeros(*q.shape[:2], _value_width(layer), dtype=dtype, device=device)
        arch = draft.config.arch
        fusion = [draft.fc, *([draft.fc_norm] if draft.config.fc_norm else []),
                  *([draft.input_norm] if draft.config.norm_before_fc else [])]
        before = [draft.embed_tokens, draft.rotary, layer.input_layernorm, layer.hidden_norm, layer.self_attn]
        after = [layer.self_attn, layer.post_attention_layernorm, layer.mlp, draft.norm]
        calls = [(f"draft-{arch}-fuse", fusion, lambda *aux: (draft.combine_hidden_states(hidden, list(aux)),), aux),
                 (f"draft-{arch}-inputs", before, inputs, (token_ids, hidden, positions)),
                 (f"draft-{arch}-outputs", after, lambda residual, out: (draft.carried(layer.after_attention(
                     residual, out)),), (residual, out))]
        self.every_step = every_step(dtype)
        start = time.perf_counter()
        self.fuse, self.inputs, self.outputs = _draft_kernels("the draft", [(*call, (1, MAX_ROWS)) for call in calls],
                                                              config_settings(draft.config), progress)
        self.seconds = time.perf_counter() - start

    def combine_hidden_states(self, target_hidden: torch.Tensor, aux_hidden_states: list[torch.Tensor]
                              ) -> torch.Tensor:
        if target_hidden.shape[0] > MAX_ROWS and not self.every_step:
            return self.draft.combine_hidden_states(target_hidden, aux_hidden_states)
        return _in_pieces(self.fuse, *aux_hidden_states)[0]

    def __call__(self, hidden: torch.Tensor, next_token_ids: torch.Tensor, attn: AttentionMetadata,
                 cache: torch.Tensor) -> torch.Tensor:
        if not (self.every_step or CompiledTarget.takes(attn)):
            return self.draft(hidden, next_token_ids, attn, cache)
        q, entry, residual = _in_pieces(self.inputs, next_token_ids, hidden, attn.positions)
        out = self.draft.layers[0].attend(q, entry, attn, cache)
        return _in_pieces(self.outputs, residual, out)[0]


class CompiledMTP(_CompiledSteps):
    """The MTP layer as a draft whose steps over decode rows run as compiled kernels, as the target's layers do: its
    input fusion (the token's embedding and enorm, hnorm, eh_proj) with the layer up to its cache write (rope
    inside), then the layer after its attention, whose MoE has a one-row form that reads only the row's routed experts.
    The attention over the draft's cache runs eager between them; steps it does not take (`CompiledTarget.takes`) run
    the layer eager, except in bfloat16, where the kernels run every step, as CompiledDraft's do."""

    def __init__(self, draft: MTPDraft, progress: Callable[[str], None] | None = None) -> None:
        self.draft = draft
        self.aux_hidden_state_ids = draft.aux_hidden_state_ids
        layer = draft.layer
        dtype, device = layer.eh_proj.weight.dtype, layer.eh_proj.weight.device
        H = layer.eh_proj.weight.shape[0]

        def inputs(token_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor):
            cos, sin = (t.to(hidden.dtype) for t in draft.rotary(positions))
            embeds = layer.embed_tokens(token_ids).to(hidden.dtype)
            h = layer.eh_proj(torch.cat([layer.enorm(embeds), layer.hnorm(hidden)], -1))
            return (h, *layer.attention_inputs(h, cos, sin))

        def examples(rows: int) -> tuple[torch.Tensor, ...]:  # (token ids, hidden, positions, h, out)
            a = layer.self_attn
            return (torch.zeros(rows, dtype=torch.long, device=device),
                    torch.zeros(rows, H, dtype=dtype, device=device), torch.arange(rows, device=device),
                    torch.zeros(rows, H, dtype=dtype, device=device),
                    torch.zeros(rows, a.num_heads, a.kv_lora_rank, dtype=dtype, device=device))

        before = [layer.embed_tokens, draft.rotary, layer.enorm, layer.hnorm, layer.eh_proj, *_attention_parts(layer)]
        after = _after_parts(layer)
        outputs = lambda h, out: (layer.after_attention(h, out),)  # noqa: E731
        two, one = examples(2), examples(1)
        calls = [("mtp-inputs", before, inputs, two[:3], (1, MAX_ROWS)),
                 ("mtp-outputs", after, outputs, two[3:], (2, MAX_ROWS)),
                 ("mtp-outputs-1row", after, outputs, one[3:], (1, 1))]
        self.every_step = every_step(dtype)
        start = time.perf_counter()
        self.inputs, self.outputs, self.outputs_one_row = _draft_kernels("the MTP layer", calls,
                                                                         config_settings(draft.config), progress)
        self.seconds = time.perf_counter() - start

    def __call__(self, hidden: torch.Tensor, next_token_ids: torch.Tensor, attn: AttentionMetadata,
                 cache: torch.Tensor) -> torch.Tensor:
        draft, layer = self.draft, self.draft.layer
        if not (self.every_step or CompiledTarget.takes(attn)):
            return draft(hidden, next_token_ids, attn, cache)
        h, q, latent = _in_pieces(self.inputs, next_token_ids, hidden, attn.positions)
        out = layer.self_attn.cached_attention(q, latent, attn, cache)
        if attn.num_tokens == 1:
            return self.outputs_one_row(h, out)[0]
        return _in_pieces(self.outputs, h, out, least_rows=2)[0]


def _draft_kernels(what: str, calls: list[tuple], settings: str, progress: Callable[[str], None] | None
                   ) -> list[Kernel]:
    """Each (name, modules, fn, example args, rows) of a draft's step compiled (or loaded), checked against the eager
    function and called once at every row count it takes."""
    kernels = []
    for n, (name, modules, fn, args, rows) in enumerate(calls):
        line = (f"compiling {what}'s step: kernel {n + 1}/{len(calls)} ({name}), once for its weights "
                f"(kept in {cache_dir()})")
        kernel = compile_kernel(name, modules, fn, args, rows,
                                (lambda line=line: progress(line)) if progress is not None else None, settings)
        _check_against_eager(f"{what} ({name})", kernel, fn, args, rows)
        _warm_every_row_count(kernel, args, rows)
        kernels.append(kernel)
    return kernels


def _value_width(layer) -> int:
    """The width of one head's attention output over the cache: the latent (MLA), or head_dim."""
    a = layer.self_attn
    return a.kv_lora_rank if isinstance(a, MLAttention) else a.head_dim


def _warm_every_row_count(kernel: Kernel, args: Sequence[torch.Tensor], rows: tuple[int, int]) -> None:
    """Call a kernel once at every row count it takes. Its GEMMs set themselves up for each new row count on
    their first call (measured on the bundled target's kernels in bfloat16: 0.8 ms against 0.2 after, the target's
    0.6-1.4 against 0.4-0.6): without this a server's first prompts of each length paid it, and so did the adaptive
    width's timings of the draft's work on prompts. All row counts of the bundled target and draft: about a second."""
    with torch.inference_mode():
        for n in range(rows[0], rows[1] + 1):
            kernel(*[torch.zeros(n, *a.shape[1:], dtype=a.dtype, device=a.device) for a in args])


def _check_against_eager(what: str, kernel: Kernel, fn: Callable, args: Sequence[torch.Tensor],
                         rows: tuple[int, int] = (1, MAX_ROWS)) -> None:
    """A kernel's outputs on random rows are the eager function's, to rounding: a kernel built from another layer's
    weights, or loaded for code it was not traced from, would compute something else."""
    generator = torch.Generator(device=args[0].device).manual_seed(0)
    n = min(max(3, rows[0]), rows[1])
    inputs = [torch.randn(n, *a.shape[1:], generator=generator, dtype=a.dtype, device=a.device)
              if a.is_floating_point() else  # token ids and positions
              torch.randint(0, 16, (n, *a.shape[1:]), generator=generator, dtype=a.dtype, device=a.device)
              for a in args]
    with torch.inference_mode():
        expected = fn(*inputs)
        got = kernel(*inputs)
    tolerance = 1e-3 if args[0].dtype == torch.float32 else 5e-2
    for i, (e, g) in enumerate(zip(expected, got)):
        if e.shape != g.shape or not torch.allclose(e, g, rtol=tolerance, atol=tolerance):
            error = (e - g).abs().max().item() if e.shape == g.shape else f"shape {tuple(g.shape)}"
            raise RuntimeError(f"the compiled step's kernel for {what} differs from the eager layer in output {i} "
                               f"({error}); run with --enforce-eager, and clear {cache_dir()} if it persists")


def _attention_parts(layer: DecoderLayer) -> list[nn.Module]:
    return [layer.input_layernorm, layer.self_attn]


def _after_parts(layer: DecoderLayer) -> list[nn.Module]:
    return [layer.self_attn, layer.post_attention_layernorm, layer.mlp]


def _first_fn(layer: DecoderLayer) -> Callable:
    return lambda h, cos, sin: layer.attention_inputs(h, cos, sin)


def _step_fn(layer: DecoderLayer, next_layer: DecoderLayer) -> Callable:
    def step(h, out, cos, sin):
        h = layer.after_attention(h, out)
        return (h, *next_layer.attention_inputs(h, cos, sin))
    return step


def _last_fn(layer: DecoderLayer, norm: nn.Module) -> Callable:
    def last(h, out):
        h = layer.after_attention(h, out)
        return norm(h), h
    return last
