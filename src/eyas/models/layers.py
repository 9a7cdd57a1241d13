"""Building blocks shared by the target and the draft heads: norms, rope, the dense SwiGLU MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from eyas.config import RopeConfig

# a packed RMSNorm takes its fused form up to this many rows: measured per norm of 192 (512) values, 1 row 13 (9) us
# against 22 (14) us for F.rms_norm, 16 rows 18 (15) against 26 (16), 64 rows 31 (37) against 30 (24), 512 rows
# 106 (228) against 78 (105)
FUSED_NORM_ROWS = 32


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.weight_pair: torch.Tensor | None = None  # set by pack()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (self.weight_pair is not None and x.dtype == torch.float32 and not torch.compiler.is_compiling()
                and x.numel() <= FUSED_NORM_ROWS * x.shape[-1]):  # (a compiler fuses the plain form itself)
            dim = x.shape[-1]
            return F.layer_norm(torch.cat([x, -x], dim=-1), self.weight_pair.shape, self.weight_pair, None,
                                self.eps)[..., :dim]
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # reduced precision: normalise in float32, round, then scale (the reference's order)
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)

    def pack(self) -> None:
        """For inference on CPU: [x, -x] has mean 0 and variance mean(x^2), so layer_norm over it, with the weight
        repeated, is x's RMS norm. On CPU F.rms_norm runs as several ops (12 us for one row of 192 here) and
        layer_norm as one fused kernel (5 us for this form); a decode step on the bundled target runs 33 norms, 50
        with an EAGLE-3 draft. Past FUSED_NORM_ROWS rows the doubled input costs more than the ops it saves. The
        weight becomes frozen, as in every packed module."""
        if self.weight_pair is None and self.weight.device.type == "cpu" and self.weight.dtype == torch.float32:
            self.weight.requires_grad_(False)
            self.weight_pair = torch.cat([self.weight.detach(), self.weight.detach()])


def embedding(num_embeddings: int, embedding_dim: int) -> nn.Embedding:
    """nn.Embedding with its usual N(0, 1) init, except on the meta device (load_model builds there, then assigns the
    checkpoint's weights): a meta normal_ imports torch._dynamo, a second of every start-up."""
    weight = torch.empty(num_embeddings, embedding_dim)
    if not weight.is_meta:
        nn.init.normal_(weight)
    return nn.Embedding(num_embeddings, embedding_dim, _weight=weight)


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.gate_up: torch.Tensor | None = None  # set by pack()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None:
            gate, up = F.linear(x, self.gate_up).chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def pack(self) -> None:
        """For inference: gate and up become two halves of one [2I, H] matrix, so a step runs one matmul for both
        (a small-batch step is dominated by the number of ops). The weights keep their names and values, as frozen
        views of the packed matrix."""
        if self.gate_up is None:
            self.gate_up = pack_rows(self.gate_proj, self.up_proj)


def pack_for_inference(model: nn.Module) -> None:
    """Lay out every linear weight for small-batch matmuls (see gemv_layout), then pack every module that can (MLP,
    MLA and MHA input projections): fewer, larger matmuls per step. Inference only: the weights become frozen, so a
    packed module must not be trained. Values and names are unchanged, so state_dict still matches the checkpoint."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    # linears grouped by weight, so a weight shared by several (the MTP layer's head) is laid out once and stays
    # shared; each old weight is freed once its group is done (peak memory: one matrix more, not a model more)
    sharing: dict[int, list[nn.Linear]] = {}
    for module in model.modules():
        # a weight tied to an embedding keeps its rows: an embedding looks up rows
        if isinstance(module, nn.Linear) and module.weight.is_contiguous() and id(module.weight) not in embeddings:
            sharing.setdefault(id(module.weight), []).append(module)
    for linears in sharing.values():
        weight = nn.Parameter(gemv_layout(linears[0].weight.detach()), requires_grad=False)
        for linear in linears:
            linear.weight = weight
    for module in model.modules():
        if hasattr(module, "pack"):
            module.pack()


def gemv_layout(weight: torch.Tensor) -> torch.Tensor:
    """The same [out, in] weight stored transposed (column-major), on CPU. F.linear then multiplies by a contiguous
    [in, out] matrix, which CPU BLAS streams 1.5-2.5x faster than [out, in] rows when a step has one or a few tokens
    and the weight comes from DRAM (measured on the bundled target's shapes); large batches run at the same speed.
    Other devices keep their layout."""
    return weight.t().contiguous().t() if weight.device.type == "cpu" else weight


def pack_rows(*linears: nn.Linear) -> torch.Tensor:
    """Concatenate the weights of bias-free linears over their output rows into one tensor (in gemv_layout) and make
    each weight a frozen view of its rows; returns the packed tensor."""
    packed = gemv_layout(torch.cat([lin.weight.detach() for lin in linears]))
    start = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight = nn.Parameter(packed[start:start + rows], requires_grad=False)
        start += rows
    return packed


class Rotary(nn.Module):
    """cos/sin tables indexed by absolute position; YaRN's attention factor is folded into them."""

    def __init__(self, rope: RopeConfig, max_positions: int) -> None:
        super().__init__()
        if torch.get_default_device().type == "meta":
            # a loader's skeleton, whose tables the loader builds on the weights' device: shapes only (computed on
            # meta they run torch's Python meta kernels, whose first call imports its compiler, 1.4 s of start-up)
            empty = torch.empty(max_positions, rope.head_dim // 2)
            self.register_buffer("cos", empty, persistent=False)
            self.register_buffer("sin", empty, persistent=False)
        else:
            inv_freq, attention_factor = rope.inv_freq_and_attention_factor()
            freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
            self.register_buffer("cos", freqs.cos() * attention_factor, persistent=False)  # [max_pos, rope_dim // 2]
            self.register_buffer("sin", freqs.sin() * attention_factor, persistent=False)
        self.interleave = rope.interleave
        self.max_positions = max_positions

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions], self.sin[positions]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """Rotate x [..., rope_dim] with cos/sin broadcastable to [..., rope_dim // 2].

    Interleaved checkpoints (DeepSeek) pair dims (0,1), (2,3), ...; the result is written de-interleaved, as
    transformers does: q and k go through the same permutation, so their dot products are unchanged.
    """
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
