"""DeepSeek-V3 target (also Kimi-K2 and q_lora-null V2-style configs): MLA attention, grouped-top-k MoE, YaRN.

Parameter names are HF's, so safetensors load with no conversion. Two attention paths:
- no cache (`attn is None`): inputs [batch, seq, hidden], the expanded form (kv_b_proj makes per-head K and V),
  causal; used by scoring, training and tests.
- paged (`attn` given): inputs [num_tokens, hidden] from several sequences; the cache holds per token only the
  normalised latent and the roped shared key [kv_lora_rank + qk_rope_head_dim]; decode and verify rows (up to
  SHORT_QUERY per sequence) attend in the absorbed form (W_UK folded into the query, W_UV applied after), longer
  prompt chunks in the expanded form from the cached latents.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from eyas.config import DeepseekV3Config
from eyas.models.attention import SHORT_QUERY, AttentionMetadata, paged_latent_attention, sequence_context
from eyas.models.layers import MLP, RMSNorm, Rotary, apply_rope, embedding, gemv_layout, pack_rows
from eyas.models.rows_matmul import linear_rows


class MLAttention(nn.Module):
    def __init__(self, config: DeepseekV3Config, input_size: int | None = None) -> None:
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        input_size = input_size or hidden  # EAGLE-3 MLA drafts attend over a 2H input
        self.num_heads = heads
        self.nope_dim, self.rope_dim, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.scale = config.softmax_scale
        self.interleave = config.rope.interleave
        qk_dim = self.nope_dim + self.rope_dim
        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(input_size, heads * qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(input_size, config.q_lora_rank, bias=config.attention_bias)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
            self.q_b_proj = nn.Linear(config.q_lora_rank, heads * qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(input_size, self.kv_lora_rank + self.rope_dim, bias=config.attention_bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, config.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, heads * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(heads * self.v_dim, hidden, bias=config.attention_bias)
        self.q_kv_a: torch.Tensor | None = None  # set by pack()
        self.w_uk: torch.Tensor | None = None  # [heads, nope, kv_lora_rank], set by pack()
        self.w_uv_t: torch.Tensor | None = None  # [heads, kv_lora_rank, v], set by pack()

    @property
    def q_input_proj(self) -> nn.Linear:
        """The projection of the input on the query side: q_proj, or q_a_proj when queries are low-rank."""
        return self.q_proj if hasattr(self, "q_proj") else self.q_a_proj

    def pack(self) -> None:
        """For inference: the two projections of the input (queries, or their low-rank part, and the latent) as one
        matmul; the weights stay as frozen views of the packed matrix (see MLP.pack). And the absorbed-form
        matrices, each laid out as its matmul reads it fastest."""
        first = self.q_input_proj
        if self.q_kv_a is None and first.bias is None and self.kv_a_proj_with_mqa.bias is None:
            self.q_kv_a = pack_rows(first, self.kv_a_proj_with_mqa)
        if self.w_uk is None:
            w_uk, w_uv_t = self._absorbed()
            # on CPU each gets a row-major copy (kv_b_proj's size in all): with its weights cold, one decode row
            # through W_UV^T takes 40 us this way against 87 us as a view of kv_b_proj in gemv_layout
            on_cpu = w_uk.device.type == "cpu"
            self.w_uk = w_uk.contiguous() if on_cpu else w_uk
            self.w_uv_t = w_uv_t.contiguous() if on_cpu else w_uv_t

    def _absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [heads, nope, kv_lora_rank] (folded into the query) and W_UV^T [heads, kv_lora_rank, v] (applied to
        the attention's latent output), as views of kv_b_proj's weight."""
        w_kv = self.kv_b_proj.weight.detach().view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        w_uk, w_uv = w_kv.split([self.nope_dim, self.v_dim], dim=1)
        return w_uk, w_uv.transpose(1, 2)

    def _project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Queries split into (nope, roped) per head, and the latent (normalised kv, roped shared key)."""
        latent_dim = self.kv_lora_rank + self.rope_dim
        if self.q_kv_a is not None:
            q, latent = F.linear(x, self.q_kv_a).split([self.q_kv_a.shape[0] - latent_dim, latent_dim], dim=-1)
        else:
            q, latent = self.q_input_proj(x), self.kv_a_proj_with_mqa(x)
        if not hasattr(self, "q_proj"):
            q = self.q_b_proj(self.q_a_layernorm(q))
        q = q.unflatten(-1, (self.num_heads, self.nope_dim + self.rope_dim))
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        kv, k_rope = latent.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.kv_a_layernorm(kv)
        # the shared rope key rides along as one more head, so q and k rotate in one call
        rotated = apply_rope(torch.cat([q_rope, k_rope.unsqueeze(-2)], dim=-2), cos.unsqueeze(-2), sin.unsqueeze(-2),
                             self.interleave)
        return q_nope, rotated[..., :-1, :], kv, rotated[..., -1, :]

    def absorbed_inputs(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """For decode and verify rows (the absorbed form): the queries in the latent space [tokens, heads,
        kv_lora_rank + rope_dim] and the latents to cache [tokens, kv_lora_rank + rope_dim]."""
        q_nope, q_rope, kv, k_rope = self._project(x, cos, sin)
        w_uk = self.w_uk if self.w_uk is not None else self._absorbed()[0]
        if q_nope.dtype == torch.float32:
            q_latent = torch.matmul(q_nope.transpose(0, 1), w_uk).transpose(0, 1)
        else:  # a linear per head: compiled bfloat16 kernels round a batched matmul's rows by the row count
            q_latent = torch.stack([F.linear(q_nope[:, h], w_uk[h].t()) for h in range(self.num_heads)], dim=1)
        return torch.cat([q_latent, q_rope], dim=-1), torch.cat([kv, k_rope], dim=-1)

    def cached_attention(self, q: torch.Tensor, latent: torch.Tensor, attn: AttentionMetadata,
                         latent_cache: torch.Tensor) -> torch.Tensor:
        """Write the rows' latents, then attend over each sequence's context in the absorbed form: [rows, heads,
        kv_lora_rank], in q's dtype."""
        latent_cache[attn.slot_mapping] = latent.to(latent_cache.dtype)
        out = paged_latent_attention(q, latent_cache, attn, self.kv_lora_rank, self.scale)
        return out.to(q.dtype)

    def absorbed_output(self, out_latent: torch.Tensor) -> torch.Tensor:
        """The attention's output [tokens, heads, kv_lora_rank] (latent values) through W_UV and o_proj."""
        w_uv_t = self.w_uv_t if self.w_uv_t is not None else self._absorbed()[1]
        return self.o_proj(torch.matmul(out_latent.transpose(0, 1), w_uv_t).transpose(0, 1).flatten(-2))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionMetadata | None = None,
                latent_cache: torch.Tensor | None = None) -> torch.Tensor:
        if attn is None:
            return self._expanded(x, cos, sin)
        if all(g.query_rows.shape[1] <= SHORT_QUERY for g in attn.groups):  # decode and verify rows only
            q, latent = self.absorbed_inputs(x, cos, sin)
            return self.absorbed_output(self.cached_attention(q, latent, attn, latent_cache))
        q_nope, q_rope, kv, k_rope = self._project(x, cos, sin)
        # write this step's latents, then attend over each sequence's whole context: decode and verify rows in the
        # absorbed form (one latent per key), prompt chunks in the expanded form (per-head keys and values from
        # the latents), which for a chunk of T queries costs a few times fewer operations than the absorbed one
        latent_cache[attn.slot_mapping] = torch.cat([kv, k_rope], dim=-1).to(latent_cache.dtype)
        short = [g for g in attn.groups if g.query_rows.shape[1] <= SHORT_QUERY]
        chunks = [g for g in attn.groups if g.query_rows.shape[1] > SHORT_QUERY]
        out = x.new_empty(x.shape[0], self.num_heads, self.v_dim)
        if short:  # the short rows (in one or more groups, see AttentionMetadata.build); only they are absorbed
            rows = short[0].rows if len(short) == 1 else torch.cat([g.rows for g in short])
            out[rows] = self._absorbed_attention(q_nope, q_rope, latent_cache, attn, short, rows)
        for group in chunks:
            rows = slice(group.first_row, group.first_row + group.query_rows.shape[1])
            out[rows] = self._chunk_attention(q_nope[rows], q_rope[rows], sequence_context(latent_cache, group),
                                              group.attn_bias[0])
        return self.o_proj(out.flatten(-2))

    def _absorbed_attention(self, q_nope: torch.Tensor, q_rope: torch.Tensor, latent_cache: torch.Tensor,
                            attn: AttentionMetadata, groups: list, rows: torch.Tensor) -> torch.Tensor:
        """The absorbed form over `groups` (beside prompt chunks), whose flat rows are `rows`: [len(rows), heads,
        v_dim]; only their queries are projected into the latent space."""
        w_uk = self.w_uk if self.w_uk is not None else self._absorbed()[0]
        q_latent = torch.matmul(q_nope[rows].transpose(0, 1), w_uk).transpose(0, 1)  # [rows, heads, kv_lora_rank]
        q = torch.cat([q_latent, q_rope[rows]], dim=-1)
        full = q.new_empty(attn.num_tokens, *q.shape[1:])  # the groups' rows only: their padding reads them too
        full[rows] = q
        out_latent = paged_latent_attention(full, latent_cache, attn, self.kv_lora_rank, self.scale, groups)[rows]
        w_uv_t = self.w_uv_t if self.w_uv_t is not None else self._absorbed()[1]
        return torch.matmul(out_latent.to(q_nope.dtype).transpose(0, 1), w_uv_t).transpose(0, 1)

    def _chunk_attention(self, q_nope: torch.Tensor, q_rope: torch.Tensor, latents: torch.Tensor,
                         attn_bias: torch.Tensor) -> torch.Tensor:
        """One sequence's prompt chunk [T, heads, ...] over its context latents [S, latent_dim] in the expanded
        form, attn_bias [1, T, S]. Returns [T, heads, v_dim]."""
        latents = latents.to(q_nope.dtype)
        k_nope, v = self.kv_b_proj(latents[:, :self.kv_lora_rank]).unflatten(-1, (self.num_heads, -1)).split(
            [self.nope_dim, self.v_dim], -1)  # [S, heads, nope], [S, heads, v]
        k_rope = latents[:, None, self.kv_lora_rank:].expand(-1, self.num_heads, -1)
        q = torch.cat([q_nope, q_rope], dim=-1).transpose(0, 1)  # [heads, T, qk]
        k = torch.cat([k_nope, k_rope], dim=-1).transpose(0, 1)
        pad = q.shape[-1] - v.shape[-1]
        if pad > 0 and q.device.type == "cpu":  # the fused CPU kernel wants v as wide as q and k (see _expanded)
            v = F.pad(v, (0, pad))
        # 4-D: with 3-D inputs SDPA takes its unfused path on CPU (339-token prompt: 5.6 ms a layer against 2.6)
        out = F.scaled_dot_product_attention(q[None], k[None], v.transpose(0, 1)[None],
                                             attn_mask=attn_bias[None].to(q.dtype), scale=self.scale)
        return out[0, ..., :self.v_dim].transpose(0, 1)

    def expanded_qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Per-head q [..., heads, qk_head_dim], k (same), v [..., heads, v_head_dim]: the expanded form, for
        attention without a cache (scoring, training)."""
        q_nope, q_rope, kv, k_rope = self._project(x, cos, sin)
        k_nope, v = self.kv_b_proj(kv).unflatten(-1, (self.num_heads, -1)).split([self.nope_dim, self.v_dim], -1)
        k = torch.cat([k_nope, k_rope.unsqueeze(-2).expand(*k_nope.shape[:-1], -1)], dim=-1)
        return torch.cat([q_nope, q_rope], dim=-1), k, v

    def _expanded(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v = self.expanded_qkv(x, cos, sin)
        pad = q.shape[-1] - v.shape[-1]
        if pad > 0 and x.device.type == "cpu":
            # CPU's fused attention kernel wants v as wide as q and k; on the bundled target's training batches
            # (4 x 128 tokens) zero-padded v runs it 1.8x faster than the unfused fallback; the padding is cut off
            v = F.pad(v, (0, pad))
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=True, scale=self.scale)[..., :self.v_dim]
        return self.o_proj(out.transpose(1, 2).flatten(-2))


# at most this many rows take MoE._few_tokens (every chosen expert over every row); more take the grouped path.
# Measured on the bundled target in decode steps, where 24 or more rows choose all 8 experts, the 7 MoE layers of a
# step: 24 rows 2.4 ms against 4.6 ms grouped, 32 rows 2.7 against 4.5, 48 rows 3.5 against 4.7, 64 rows 4.4 against
# 5.4; whole plain decode steps at batch 64 run at the same speed either way (all experts over all rows is
# num_experts / num_experts_per_tok times the matmul work).
FEW_TOKENS = 48
ALL_EXPERTS_SHARE = 4  # see MoE.pack_all


class MoE(nn.Module):
    """Sigmoid router; a correction bias picks experts (never weighs them); group-limited top-k; shared experts."""

    def __init__(self, config: DeepseekV3Config) -> None:
        super().__init__()
        self.config = config
        num_experts = config.n_routed_experts
        self.gate = nn.Module()
        self.gate.weight = nn.Parameter(torch.zeros(num_experts, config.hidden_size))
        self.gate.register_buffer("e_score_correction_bias", torch.zeros(num_experts))
        self.experts = nn.ModuleList(MLP(config.hidden_size, config.moe_intermediate_size) for _ in range(num_experts))
        self.shared_experts = (MLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts)
                               if config.n_shared_experts else None)
        self.stacked_gate_up: torch.Tensor | None = None  # [num_experts, hidden, 2 * moe_intermediate], set by pack()
        self.stacked_down: torch.Tensor | None = None  # [num_experts, moe_intermediate, hidden], set by pack()
        self.all_gate_up: torch.Tensor | None = None  # [num_experts * 2 * moe_intermediate, hidden], see pack_all
        self.all_down: torch.Tensor | None = None  # [hidden, num_experts * moe_intermediate], see pack_all

    def pack(self) -> None:
        """For inference: every routed expert's gate_up and down_proj as one slice of a stacked tensor, so rows that
        choose most experts run all of them in two batched matmuls (see _all_experts). Each expert's weights become
        frozen views of the stacks, laid out as gemv_layout lays them out, so an expert alone multiplies as before."""
        if self.stacked_gate_up is not None:
            return
        for expert in self.experts:
            expert.pack()
        self.stacked_gate_up = torch.stack([e.gate_up.t() for e in self.experts])
        self.stacked_down = torch.stack([e.down_proj.weight.detach().t() for e in self.experts])
        inter = self.config.moe_intermediate_size
        for expert, gate_up, down in zip(self.experts, self.stacked_gate_up, self.stacked_down):
            expert.gate_up = gate_up.t()
            expert.gate_proj.weight = nn.Parameter(expert.gate_up[:inter], requires_grad=False)
            expert.up_proj.weight = nn.Parameter(expert.gate_up[inter:], requires_grad=False)
            expert.down_proj.weight = nn.Parameter(down.t(), requires_grad=False)

    def pack_all(self) -> bool:
        """For a compiled step (its weights frozen in, on CPU), where a row's few chosen experts are a large share
        of them (at most ALL_EXPERTS_SHARE times the experts a token chooses, as the bundled target's 8 for 2): every
        routed expert over every row as two linears, the routing weights applied between them and the sum over
        experts done inside the second (see _all_linear). Against the chosen experts' slices in the bundled target's
        bfloat16 kernels on an AMX Xeon (eval prompts, one process alternating): plain decoding 1.12x at batch 4,
        1.12x at 16, 1.10x at 32 and 0.94x at batch 1; speculative at batch 1 (K=3) 1.00x. Whether it packed them;
        needs pack() first."""
        c = self.config
        if self.stacked_gate_up is None or c.n_routed_experts > ALL_EXPERTS_SHARE * c.num_experts_per_tok:
            return False
        hidden = c.hidden_size
        self.all_gate_up = self.stacked_gate_up.permute(0, 2, 1).reshape(-1, hidden).contiguous()
        self.all_down = self.stacked_down.reshape(-1, hidden).t().contiguous()
        return True

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [num_tokens, hidden] -> (expert ids, weights), both [num_tokens, num_experts_per_tok]."""
        c = self.config
        scores = F.linear(x.float(), self.gate.weight.float()).sigmoid()  # [num_tokens, num_experts]
        choice = scores + self.gate.e_score_correction_bias.float()
        if c.topk_group < c.n_group:
            # rank groups by the sum of their two best experts; keep the topk_group best groups
            grouped = choice.view(x.shape[0], c.n_group, -1)  # [num_tokens, n_group, experts_per_group]
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)
            cutoff = group_scores.topk(c.topk_group, dim=-1).values[:, -1:]
            choice = grouped.masked_fill((group_scores < cutoff)[..., None], float("-inf")).flatten(1)
        expert_ids = choice.topk(c.num_experts_per_tok, dim=-1, sorted=False).indices
        weights = scores.gather(1, expert_ids)
        if c.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return expert_ids, weights * c.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        expert_ids, weights = self.route(x)
        # the eager paths add expert outputs in ascending expert order: the summation order does not depend on the
        # path (the last bits still can: CPU matmuls round differently for different row counts); the compiled
        # kernels' _all_linear sums inside its matmul, and in bfloat16 every step runs it
        if torch.compiler.is_compiling() and self.all_gate_up is not None:
            out = self._all_linear(x, expert_ids, weights)
        elif torch.compiler.is_compiling() and self.stacked_gate_up is not None:
            # a compiled step (at most compiled_step.MAX_ROWS rows; the experts a row chose are known only when it runs)
            out = self._chosen_experts(x, expert_ids, weights)
        elif x.shape[0] <= FEW_TOKENS:
            out = self._few_tokens(x, expert_ids, weights)
        else:
            out = self._grouped(x, expert_ids, weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out.view(shape)

    def _few_tokens(self, x, expert_ids, weights):
        """Decode and verify rows: each chosen expert runs once over all the rows, and each row keeps the expert's
        output times its routing weight, 0 where the row did not choose it. Extra rows cost a small-batch matmul
        next to nothing (it reads the same weights); the gather and scatter of the grouped path cost more."""
        dense = self._dense_weights(x, expert_ids, weights)
        chosen = sorted(set(expert_ids.flatten().tolist()))
        if self.stacked_gate_up is not None and 2 * len(chosen) >= len(self.experts):
            return self._all_experts(x, dense)
        out = torch.zeros_like(x)
        for e in chosen:
            out += self.experts[e](x) * dense[:, e, None]
        return out

    def _dense_weights(self, x, expert_ids, weights):
        """Each row's routing weight for every expert, 0 where it did not choose it: [rows, num_experts]."""
        dense = torch.zeros(x.shape[0], len(self.experts), dtype=x.dtype, device=x.device)
        return dense.scatter(1, expert_ids, weights.to(x.dtype))

    def _all_experts(self, x, dense):
        """_few_tokens when the rows choose at least half the experts (batched decode: 16 rows choose nearly all 8
        of the bundled target's): every expert over every row in two batched matmuls and a weighted sum, 6 ops in
        place of 5 per chosen expert, for at most twice the matmul work on the same weights. Each expert's output
        is the one its own MLP gives, and an expert a row did not choose adds its output times 0."""
        gate, up = torch.matmul(x, self.stacked_gate_up).chunk(2, dim=-1)  # [num_experts, rows, inter] each
        out = torch.bmm(F.silu(gate) * up, self.stacked_down)  # [num_experts, rows, hidden]
        return (out * dense.t()[:, :, None]).sum(0)

    def _all_linear(self, x, expert_ids, weights):
        """Every expert over every row, its output times the row's routing weight for it (0 where not chosen):
        gate_up of all experts as one linear, down over all experts' weighted outputs as another."""
        num_experts = len(self.experts)
        dense = self._dense_weights(x, expert_ids, weights)
        gate, up = F.linear(x, self.all_gate_up).view(x.shape[0], num_experts, -1).chunk(2, dim=-1)
        return F.linear((F.silu(gate) * up * dense[:, :, None]).flatten(1), self.all_down)

    def _chosen_experts(self, x, expert_ids, weights):
        """Each row through its own chosen experts' slices of the stacks, in two batched matmuls, added in ascending
        expert order as the other paths add them. A step's few rows read from memory only the experts they chose;
        running all 8 of the bundled target's over 4 verify rows took 2.5 times as long, and at 32 rows 1.8 times
        (AOTInductor kernels, one thread, weights in cache)."""
        ids, order = expert_ids.sort(dim=1)  # [rows, k]
        gate, up = torch.matmul(x[:, None, None, :], self.stacked_gate_up[ids]).chunk(2, dim=-1)  # [rows, k, 1, inter]
        out = torch.matmul(F.silu(gate) * up, self.stacked_down[ids])  # [rows, k, 1, hidden]
        return (out[:, :, 0] * weights.gather(1, order)[:, :, None].to(x.dtype)).sum(1)

    def _grouped(self, x, expert_ids, weights):
        """Few tokens per expert: group the (token, slot) pairs by expert with one sort; each expert runs once."""
        out = torch.zeros_like(x)
        order = expert_ids.flatten().argsort(stable=True)
        counts = torch.bincount(expert_ids.flatten(), minlength=len(self.experts)).tolist()
        token_idx = order // expert_ids.shape[1]
        weights = weights.flatten()[order, None].to(x.dtype)
        start = 0
        for e, count in enumerate(counts):
            if count:
                rows = token_idx[start:start + count]
                out.index_add_(0, rows, self.experts[e](x[rows]) * weights[start:start + count])
                start += count
        return out


class DecoderLayer(nn.Module):
    def __init__(self, config: DeepseekV3Config, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = MLAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MoE(config) if config.is_moe_layer(layer_idx) else MLP(config.hidden_size, config.intermediate_size)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionMetadata | None = None,
                latent_cache: torch.Tensor | None = None) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, attn, latent_cache)
        return h + self.mlp(self.post_attention_layernorm(h))

    # the layer split around its attention, as the compiled step runs it (eyas.engine.compiled_step): everything up
    # to the cache write, and everything after the attention over the cache

    def attention_inputs(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode and verify rows: (queries in the latent space, latents to cache), see MLAttention."""
        return self.self_attn.absorbed_inputs(self.input_layernorm(h), cos, sin)

    def after_attention(self, h: torch.Tensor, out_latent: torch.Tensor) -> torch.Tensor:
        h = h + self.self_attn.absorbed_output(out_latent)
        return h + self.mlp(self.post_attention_layernorm(h))


class SharedHead(nn.Module):
    def __init__(self, config: DeepseekV3Config) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)


class MTPLayer(DecoderLayer):
    """DeepSeek NextN: predicts token t+2 from the target's hidden state at t and the embedding of token t+1.

    Stored as `model.layers.{num_hidden_layers + i}.*`: a full decoder layer plus enorm, hnorm, eh_proj,
    shared_head.{norm, head} and its own copy of embed_tokens.
    """

    def __init__(self, config: DeepseekV3Config, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.embed_tokens = embedding(config.vocab_size, config.hidden_size)
        self.enorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hnorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.shared_head = SharedHead(config)

    def forward(self, next_token_ids: torch.Tensor, previous_hidden: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, attn: AttentionMetadata | None = None,
                latent_cache: torch.Tensor | None = None) -> torch.Tensor:
        """Returns the layer's output before shared_head.norm; `compute_logits` finishes it."""
        h = self.eh_proj(torch.cat([self.enorm(self.embed_tokens(next_token_ids)), self.hnorm(previous_hidden)], -1))
        return super().forward(h, cos, sin, attn, latent_cache)

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        return linear_rows(self.shared_head.norm(h), self.shared_head.head)


class DeepseekV3Model(nn.Module):
    def __init__(self, config: DeepseekV3Config) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = embedding(config.vocab_size, config.hidden_size)
        L = config.num_hidden_layers
        # MTP layers sit after the decoder layers, as in DeepSeek's checkpoints (model.layers.61 in V3)
        self.layers = nn.ModuleList([DecoderLayer(config, i) for i in range(L)]
                                    + [MTPLayer(config, L + i) for i in range(config.num_nextn_predict_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = Rotary(config.rope, config.max_position_embeddings)

    def forward(self, input_ids: torch.Tensor, attn: AttentionMetadata | None = None,
                kv_caches: Sequence[torch.Tensor] | None = None,
                aux_hidden_state_ids: Sequence[int] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Final-normed hidden states and the hidden states at `aux_hidden_state_ids` (HF `hidden_states` indices,
        see eyas.aux_layers), in the order asked.

        input_ids: [batch, seq] without a cache, or [num_tokens] with `attn` and `kv_caches` (one per layer).
        """
        positions = attn.positions if attn is not None else torch.arange(input_ids.shape[-1],
                                                                          device=input_ids.device)
        cos, sin = self.rotary(positions)
        h = self.embed_tokens(input_ids)
        captured = {0: h} if 0 in aux_hidden_state_ids else {}
        for i in range(self.config.num_hidden_layers):
            h = self.layers[i](h, cos, sin, attn, kv_caches[i] if kv_caches is not None else None)
            if i + 1 in aux_hidden_state_ids:
                captured[i + 1] = h
        return self.norm(h), [captured[i] for i in aux_hidden_state_ids]

    def mtp_layer(self, index: int = 0) -> MTPLayer:
        return self.layers[self.config.num_hidden_layers + index]


class _HeadModel(nn.Module):
    def __init__(self, config: DeepseekV3Config) -> None:
        super().__init__()
        self.embed_tokens = embedding(config.vocab_size, config.hidden_size)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class TargetHead(nn.Module):
    """A target's embedding, final norm and lm_head under the target's own names (`model.embed_tokens`,
    `model.norm`, `lm_head`): all that training a draft reads of the target when its hidden states come from
    elsewhere (a dump, a server). A 671B target's are a few GB."""

    def __init__(self, config: DeepseekV3Config, model: DeepseekV3Model | _HeadModel | None = None) -> None:
        super().__init__()
        self.config = config
        self.model = model if model is not None else _HeadModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rows_head: nn.Linear | None = None  # set by pack()
        self.tie_weights()

    def pack(self) -> None:
        """For inference on CPU, where lm_head cannot feed the rows kernel as it is: a copy that can, so logits are
        float32 and each row's the same whatever rows run beside it (bfloat16 matmuls round a row by the row count).
        A tied lm_head (the embedding's matrix, whose rows an embedding reads) gets one in gemv_layout; with torch on
        several threads, where BLAS takes the logits instead of the kernel, a bfloat16 one gets a float32 copy. An
        untied lm_head on one thread is in the kernel's layout already (pack_for_inference)."""
        weight = self.lm_head.weight
        if self.rows_head is not None or weight.device.type != "cpu":
            return
        if weight.dtype == torch.bfloat16 and torch.get_num_threads() > 1:
            copy = weight.detach().float()
        elif not weight.t().is_contiguous():
            copy = weight.detach()
        else:
            return
        head = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        head.weight = nn.Parameter(gemv_layout(copy), requires_grad=False)
        vars(self)["rows_head"] = head  # not a submodule: state_dict stays the checkpoint's

    @property
    def tied_weights(self) -> tuple[str, ...]:
        """The state-dict names `tie_weights` fills from another weight: a checkpoint need not hold them."""
        return ("lm_head.weight",) if self.config.tie_word_embeddings else ()

    def tie_weights(self) -> None:
        """With tie_word_embeddings, lm_head's matrix is the embedding's tensor; a loader that assigned new tensors
        ties them again."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # on CPU the rows kernel: float32 logits, each row's the same whatever rows run beside it (bfloat16 matmuls
        # round a row by the row count), and a few rows 2x faster than BLAS (eyas.models.rows_matmul)
        head = self.rows_head if self.rows_head is not None else self.lm_head
        return linear_rows(hidden.to(head.weight.dtype), head)


class DeepseekV3ForCausalLM(TargetHead):
    """The whole target: the head (its lm_head, tie and compute_logits) with `model` the whole decoder, whose
    embed_tokens and norm are the head's."""

    def __init__(self, config: DeepseekV3Config) -> None:
        super().__init__(config, DeepseekV3Model(config))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits [batch, seq, vocab] for input_ids [batch, seq], no cache."""
        hidden, _ = self.model(input_ids)
        return self.compute_logits(hidden)

