"""Attention over a paged cache, for a ragged batch of tokens from several sequences.

The engine builds one `AttentionMetadata` per step; every layer reuses it. Tokens are flat: sequence b owns rows
query_start_loc[b]:query_start_loc[b+1] of every [num_tokens, ...] tensor. A worked example, two sequences, the
first decoding one token at position 6 and the second prefilling positions 0..2:

    positions       = [6, 0, 1, 2]            query_start_loc = [0, 1, 4]
    seq_lens        = [7, 3]                  (context length including this step's tokens)
    query_rows      = [[0, 0, 0], [1, 2, 3]]  (padded with row 0; query_valid masks the padding)
    kv_slots        = [[s0..s6], [t0, t1, t2, 0, 0, 0, 0]]
    attn_bias[1]    = causal over the sequence's own positions, -inf on padding
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    positions: torch.Tensor  # [num_tokens] absolute position of each token in its sequence
    slot_mapping: torch.Tensor  # [num_tokens] flat cache slot each new token is written to
    query_rows: torch.Tensor  # [batch, max_query_len] row of each query in the flat batch (padded)
    query_valid: torch.Tensor  # [batch, max_query_len] bool
    kv_slots: torch.Tensor  # [batch, max_seq_len] flat cache slot of each context position (padded)
    attn_bias: torch.Tensor  # [batch, 1, max_query_len, max_seq_len] 0 where visible, -inf elsewhere

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

    @classmethod
    def build(cls, query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]], block_size: int,
              device: torch.device | str = "cpu") -> AttentionMetadata:
        """Metadata for sequences whose last `query_lens[b]` of `seq_lens[b]` tokens are computed this step."""
        batch = len(query_lens)
        max_q, max_s = max(query_lens), max(seq_lens)
        positions, slot_mapping = [], []
        query_rows = torch.zeros(batch, max_q, dtype=torch.long)
        query_valid = torch.zeros(batch, max_q, dtype=torch.bool)
        kv_slots = torch.zeros(batch, max_s, dtype=torch.long)
        key_pos = torch.arange(max_s)
        attn_bias = torch.full((batch, 1, max_q, max_s), float("-inf"))
        row = 0
        for b, (q_len, s_len, blocks) in enumerate(zip(query_lens, seq_lens, block_tables)):
            if q_len < 1 or q_len > s_len:
                raise ValueError(f"sequence {b}: query length {q_len} must be in 1..seq_len={s_len}")
            if len(blocks) * block_size < s_len:
                raise ValueError(f"sequence {b}: {len(blocks)} blocks of {block_size} cannot hold {s_len} tokens")
            pos = torch.arange(s_len)
            slots = torch.tensor(blocks, dtype=torch.long)[pos // block_size] * block_size + pos % block_size
            kv_slots[b, :s_len] = slots
            q_pos = pos[s_len - q_len:]
            positions.append(q_pos)
            slot_mapping.append(slots[s_len - q_len:])
            query_rows[b, :q_len] = torch.arange(row, row + q_len)
            query_valid[b, :q_len] = True
            visible = key_pos[None, :] <= q_pos[:, None]  # [q_len, max_s]; also hides padding past s_len
            attn_bias[b, 0, :q_len].masked_fill_(visible, 0.0)
            row += q_len
        # padded query rows see key 0 so their softmax stays finite; their outputs are dropped
        attn_bias[:, 0, :, 0].masked_fill_(~query_valid, 0.0)
        return cls(
            positions=torch.cat(positions).to(device), slot_mapping=torch.cat(slot_mapping).to(device),
            query_rows=query_rows.to(device), query_valid=query_valid.to(device), kv_slots=kv_slots.to(device),
            attn_bias=attn_bias.to(device),
        )


def paged_latent_attention(q: torch.Tensor, latent_cache: torch.Tensor, attn: AttentionMetadata, value_dim: int,
                           scale: float) -> torch.Tensor:
    """Multi-query attention where one latent per token is both key (all of it) and value (its first value_dim).

    q: [num_tokens, heads, latent_dim]; latent_cache: [num_slots, latent_dim]. Returns [num_tokens, heads, value_dim].
    """
    num_tokens, heads, dim = q.shape
    batch, max_q = attn.query_rows.shape
    kv = latent_cache[attn.kv_slots]  # [batch, max_seq_len, latent_dim]
    q_padded = (q if batch == 1 else q[attn.query_rows]).reshape(batch, max_q * heads, dim)
    scores = torch.bmm(q_padded, kv.transpose(1, 2)).float() * scale  # [batch, max_q * heads, max_seq_len]
    scores = scores.view(batch, max_q, heads, -1) + attn.attn_bias.transpose(1, 2)
    probs = scores.softmax(dim=-1).to(kv.dtype).view(batch, max_q * heads, -1)
    out = torch.bmm(probs, kv[..., :value_dim]).view(batch, max_q, heads, value_dim)
    return out[0] if batch == 1 else out[attn.query_valid]  # [num_tokens, heads, value_dim], in flat order


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, attn: AttentionMetadata, scale: float) -> torch.Tensor:
    """Grouped-query attention over a paged cache of per-head keys and values (Llama-style EAGLE-3 drafts).

    q: [num_tokens, heads, head_dim]; kv_cache: [num_slots, 2, kv_heads, head_dim] (index 0 keys, 1 values).
    Query head h reads kv head h // (heads // kv_heads), as transformers' repeat_kv does. Returns
    [num_tokens, heads, head_dim].
    """
    num_tokens, heads, dim = q.shape
    batch, max_q = attn.query_rows.shape
    kv_heads = kv_cache.shape[2]
    group = heads // kv_heads
    kv = kv_cache[attn.kv_slots]  # [batch, max_seq_len, 2, kv_heads, head_dim]
    k = kv[:, :, 0].transpose(1, 2).reshape(batch * kv_heads, -1, dim)  # [batch * kv_heads, max_seq_len, head_dim]
    v = kv[:, :, 1].transpose(1, 2).reshape(batch * kv_heads, -1, dim)
    q_padded = (q if batch == 1 else q[attn.query_rows]).reshape(batch, max_q, kv_heads, group, dim)
    # each kv head serves its group of query heads for every query row: one [max_q * group, dim] block per kv head
    q_padded = q_padded.permute(0, 2, 1, 3, 4).reshape(batch * kv_heads, max_q * group, dim)
    scores = torch.bmm(q_padded, k.transpose(1, 2)).float() * scale  # [batch * kv_heads, max_q * group, max_seq]
    scores = scores.view(batch, kv_heads, max_q, group, -1) + attn.attn_bias.view(batch, 1, max_q, 1, -1)
    probs = scores.softmax(dim=-1).to(kv.dtype).view(batch * kv_heads, max_q * group, -1)
    out = torch.bmm(probs, v).view(batch, kv_heads, max_q, group, dim)
    out = out.permute(0, 2, 1, 3, 4).reshape(batch, max_q, heads, dim)
    return out[0] if batch == 1 else out[attn.query_valid]  # [num_tokens, heads, head_dim], in flat order
