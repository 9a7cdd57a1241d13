"""Attention over a paged cache, for a ragged batch of tokens from several sequences.

The engine builds one `AttentionMetadata` per step; every layer reuses it. Tokens are flat: sequence b owns rows
query_start_loc[b]:query_start_loc[b+1] of every [num_tokens, ...] tensor. A worked example, two sequences, the
first decoding one token at position 6 and the second prefilling positions 0..2:

    positions       = [6, 0, 1, 2]            query_start_loc = [0, 1, 4]
    seq_lens        = [7, 3]                  (context length including this step's tokens)
    query_rows      = [[0, 0, 0], [1, 2, 3]]  (padded with row 0; query_valid masks the padding)
    kv_slots        = [[s0..s6], [t0, t1, t2, 0, 0, 0, 0]]
    attn_bias[1]    = causal over the sequence's own positions, -inf on padding

Sequences are padded to the longest query of their group: all short queries (decode, verify: up to SHORT_QUERY
tokens) form one group, and each longer prompt chunk is a group of its own, so padding never multiplies the work of
a mixed prefill + decode step by the chunk length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SHORT_QUERY = 16  # sequences with at most this many new tokens (decode, verify) are padded into one batch


@dataclass(slots=True)
class AttentionGroup:
    """Sequences attended as one padded batch. Decode and verify rows share one group; a longer prompt chunk gets a
    group of its own, so a 512-token chunk never pads 31 one-token decode rows to 512 queries each."""

    rows: torch.Tensor  # [group_tokens] flat rows of this group's tokens, sequence by sequence
    query_rows: torch.Tensor  # [group_batch, max_query_len] flat row of each query (padded)
    query_valid: torch.Tensor  # [group_batch, max_query_len] bool
    kv_slots: torch.Tensor  # [group_batch, max_seq_len] flat cache slot of each context position (padded)
    attn_bias: torch.Tensor  # [group_batch, 1, max_query_len, max_seq_len] 0 where visible, -inf elsewhere
    first_row: int  # flat row of the group's first query (a one-sequence group's queries are a slice from it)


@dataclass(slots=True)
class AttentionMetadata:
    positions: torch.Tensor  # [num_tokens] absolute position of each token in its sequence
    slot_mapping: torch.Tensor  # [num_tokens] flat cache slot each new token is written to
    groups: list[AttentionGroup]

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

    @classmethod
    def build(cls, query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]], block_size: int,
              device: torch.device | str = "cpu", kv_starts: list[int] | None = None) -> AttentionMetadata:
        """Metadata for sequences whose last `query_lens[b]` of `seq_lens[b]` tokens are computed this step.
        With `kv_starts`, sequence b attends only to positions from kv_starts[b] on (its queries must lie there)."""
        kv_starts = kv_starts or [0] * len(query_lens)
        positions, slot_mapping, seq_slots, starts = [], [], [], []
        row = 0
        for b, (q_len, s_len, blocks) in enumerate(zip(query_lens, seq_lens, block_tables)):
            if q_len < 1 or q_len > s_len:
                raise ValueError(f"sequence {b}: query length {q_len} must be in 1..seq_len={s_len}")
            if len(blocks) * block_size < s_len:
                raise ValueError(f"sequence {b}: {len(blocks)} blocks of {block_size} cannot hold {s_len} tokens")
            if not 0 <= kv_starts[b] <= s_len - q_len:
                raise ValueError(f"sequence {b}: keys start at {kv_starts[b]}, after its first query {s_len - q_len}")
            used = -(-s_len // block_size)
            slots = (torch.tensor(blocks[:used]).unsqueeze(1) * block_size + torch.arange(block_size)).view(-1)[:s_len]
            seq_slots.append(slots)
            positions.append(torch.arange(s_len - q_len, s_len))
            slot_mapping.append(slots[s_len - q_len:])
            starts.append(row)
            row += q_len
        short = [b for b, q in enumerate(query_lens) if q <= SHORT_QUERY]
        members = ([short] if short else []) + [[b] for b, q in enumerate(query_lens) if q > SHORT_QUERY]
        groups = [_group(m, query_lens, seq_lens, kv_starts, seq_slots, starts, device) for m in members]
        return cls(positions=torch.cat(positions).to(device), slot_mapping=torch.cat(slot_mapping).to(device),
                   groups=groups)


def _group(members: list[int], query_lens: list[int], seq_lens: list[int], kv_starts: list[int],
           seq_slots: list[torch.Tensor], starts: list[int], device) -> AttentionGroup:
    batch = len(members)
    if batch == 1:  # one sequence, nothing to pad: the same fields in a third of the ops (a decode step builds 4)
        b = members[0]
        q_len, s_len = query_lens[b], seq_lens[b]
        rows = torch.arange(starts[b], starts[b] + q_len)
        attn_bias = torch.zeros(1, 1, q_len, s_len)
        if q_len > 1:
            attn_bias[0, 0, :, s_len - q_len:] = torch.full((q_len, q_len), float("-inf")).triu_(1)
        if kv_starts[b]:
            attn_bias[..., :kv_starts[b]] = float("-inf")
        return AttentionGroup(rows=rows.to(device), query_rows=rows.unsqueeze(0).to(device),
                              query_valid=torch.ones(1, q_len, dtype=torch.bool, device=device),
                              kv_slots=seq_slots[b].unsqueeze(0).to(device), attn_bias=attn_bias.to(device),
                              first_row=starts[b])
    max_q, max_s = max(query_lens[b] for b in members), max(seq_lens[b] for b in members)
    query_rows = torch.zeros(batch, max_q, dtype=torch.long)
    query_valid = torch.zeros(batch, max_q, dtype=torch.bool)
    kv_slots = torch.zeros(batch, max_s, dtype=torch.long)
    attn_bias = torch.full((batch, 1, max_q, max_s), float("-inf"))
    key_pos = torch.arange(max_s)
    rows = []
    for g, b in enumerate(members):
        q_len, s_len = query_lens[b], seq_lens[b]
        kv_slots[g, :s_len] = seq_slots[b]
        query_rows[g, :q_len] = torch.arange(starts[b], starts[b] + q_len)
        query_valid[g, :q_len] = True
        q_pos = torch.arange(s_len - q_len, s_len)
        # [q_len, max_s]; also hides padding past s_len
        visible = (key_pos[None, :] <= q_pos[:, None]) & (key_pos[None, :] >= kv_starts[b])
        attn_bias[g, 0, :q_len].masked_fill_(visible, 0.0)
        rows.append(query_rows[g, :q_len])
    # padded query rows see key 0 so their softmax stays finite; their outputs are dropped
    attn_bias[:, 0, :, 0].masked_fill_(~query_valid, 0.0)
    return AttentionGroup(rows=torch.cat(rows).to(device), query_rows=query_rows.to(device),
                          query_valid=query_valid.to(device), kv_slots=kv_slots.to(device),
                          attn_bias=attn_bias.to(device), first_row=starts[members[0]])


def paged_latent_attention(q: torch.Tensor, latent_cache: torch.Tensor, attn: AttentionMetadata, value_dim: int,
                           scale: float) -> torch.Tensor:
    """Multi-query attention where one latent per token is both key (all of it) and value (its first value_dim).

    q: [num_tokens, heads, latent_dim]; latent_cache: [num_slots, latent_dim]. Returns [num_tokens, heads, value_dim].
    """
    def attend(group: AttentionGroup) -> torch.Tensor:
        batch, max_q = group.query_rows.shape
        heads, dim = q.shape[1:]
        kv = _gather_slots(latent_cache, group.kv_slots)  # [batch, max_seq_len, latent_dim]
        q_padded = _queries(q, group).reshape(batch, max_q * heads, dim)
        scores = torch.bmm(q_padded, kv.transpose(1, 2)).float().mul_(scale)  # [batch, max_q * heads, max_seq_len]
        scores = scores.view(batch, max_q, heads, -1).add_(group.attn_bias.transpose(1, 2))
        probs = scores.softmax(dim=-1).to(kv.dtype).view(batch, max_q * heads, -1)
        out = torch.bmm(probs, kv[..., :value_dim]).view(batch, max_q, heads, value_dim)
        return out[0] if batch == 1 else out[group.query_valid]  # [group_tokens, heads, value_dim]

    return _gather(attend, attn, q.shape[0])


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, attn: AttentionMetadata, scale: float) -> torch.Tensor:
    """Grouped-query attention over a paged cache of per-head keys and values (Llama-style EAGLE-3 drafts).

    q: [num_tokens, heads, head_dim]; kv_cache: [num_slots, 2, kv_heads, head_dim] (index 0 keys, 1 values).
    Query head h reads kv head h // (heads // kv_heads), as transformers' repeat_kv does. Returns
    [num_tokens, heads, head_dim].
    """
    def attend(group: AttentionGroup) -> torch.Tensor:
        batch, max_q = group.query_rows.shape
        heads, dim = q.shape[1:]
        kv_heads = kv_cache.shape[2]
        per_kv = heads // kv_heads
        kv = _gather_slots(kv_cache, group.kv_slots)  # [batch, max_seq_len, 2, kv_heads, head_dim]
        k = kv[:, :, 0].transpose(1, 2).reshape(batch * kv_heads, -1, dim)  # [batch * kv_heads, max_seq, head_dim]
        v = kv[:, :, 1].transpose(1, 2).reshape(batch * kv_heads, -1, dim)
        q_padded = _queries(q, group).reshape(batch, max_q, kv_heads, per_kv, dim)
        # each kv head serves its query heads for every query row: one [max_q * per_kv, dim] block per kv head
        q_padded = q_padded.permute(0, 2, 1, 3, 4).reshape(batch * kv_heads, max_q * per_kv, dim)
        scores = torch.bmm(q_padded, k.transpose(1, 2)).float().mul_(scale)  # [batch * kv_heads, max_q * per_kv, seq]
        scores = scores.view(batch, kv_heads, max_q, per_kv, -1).add_(group.attn_bias.view(batch, 1, max_q, 1, -1))
        probs = scores.softmax(dim=-1).to(kv.dtype).view(batch * kv_heads, max_q * per_kv, -1)
        out = torch.bmm(probs, v).view(batch, kv_heads, max_q, per_kv, dim)
        out = out.permute(0, 2, 1, 3, 4).reshape(batch, max_q, heads, dim)
        return out[0] if batch == 1 else out[group.query_valid]  # [group_tokens, heads, head_dim]

    return _gather(attend, attn, q.shape[0])


def _gather_slots(cache: torch.Tensor, kv_slots: torch.Tensor) -> torch.Tensor:
    """cache rows at kv_slots [batch, max_seq_len] -> [batch, max_seq_len, ...]. index_select on the flat slots:
    on CPU it copies whole rows 3-5x faster than advanced indexing with a 2-D index."""
    return cache.index_select(0, kv_slots.flatten()).view(*kv_slots.shape, *cache.shape[1:])


def _queries(q: torch.Tensor, group: AttentionGroup) -> torch.Tensor:
    """The group's queries padded to [batch, max_q, ...]; a one-sequence group is a slice of q, not a gather."""
    if group.query_rows.shape[0] == 1:
        return q[group.first_row:group.first_row + group.query_rows.shape[1]].unsqueeze(0)
    return q[group.query_rows]


def _gather(attend, attn: AttentionMetadata, num_tokens: int) -> torch.Tensor:
    """Run `attend` on each group and place its rows in flat order (no copy when one group holds them all)."""
    groups = attn.groups
    if len(groups) == 1:
        return attend(groups[0])
    out = None
    for group in groups:
        part = attend(group)
        if out is None:
            out = part.new_empty(num_tokens, *part.shape[1:])
        out[group.rows] = part
    return out
