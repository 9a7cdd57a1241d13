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

from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from eyas.models import latent_kernel
from eyas.threads import parallel_threads

SHORT_QUERY = 16  # sequences with at most this many new tokens (decode, verify) are padded into one batch
# a batched call over at least this many (query row, context position) pairs runs on parallel_threads(): at batch 4
# over 190-token contexts (760 pairs), 2 threads took the call from 169 to 106 us; at batch 1 they cost more
PARALLEL_PAIRS = 512
# the same for the C latent kernel, whose split among threads costs more (a thread pool's hand-off, about 90 us):
# at batch 4 over 200 positions (800 pairs) 2 threads took 275 us against 185 on one, at 4 rows each (3,200) 443
# against 518, at batch 16 over 300 positions 872 against 1,397
KERNEL_PARALLEL_PAIRS = 2048


@dataclass(slots=True)
class AttentionGroup:
    """Sequences attended as one padded batch. Decode and verify rows share one group; a longer prompt chunk gets a
    group of its own, so a 512-token chunk never pads 31 one-token decode rows to 512 queries each.

    The context is gathered from the cache by `kv_slots`, or, when every sequence's blocks are one contiguous run
    (`kv_view`), read in place: batch row g's context starts at slot first + g * stride. That is a sequence alone
    (batch 1), or sequences that each own a lane of the cache (kv_cache.BlockAllocator), one batch row per lane from
    the lowest to the highest lane; a lane no member owns is a padding row with no valid query."""

    rows: torch.Tensor  # [group_tokens] flat rows of this group's tokens, in batch-row order
    query_rows: torch.Tensor  # [group_batch, max_query_len] flat row of each query (padded)
    query_valid: torch.Tensor  # [group_batch, max_query_len] bool
    kv_slots: torch.Tensor | None  # [group_batch, max_seq_len] flat cache slot of each context position (padded)
    kv_view: tuple[int, int] | None  # (first slot, slots between batch rows), instead of kv_slots
    attn_bias: torch.Tensor  # [group_batch, 1, max_query_len, max_seq_len] 0 where visible, -inf elsewhere
    first_row: int  # flat row of the group's first query (a one-sequence group's queries are a slice from it)
    in_flat_order: bool = True  # rows are first_row, first_row + 1, ... (lanes can put sequences out of order)
    # attn_bias with each query position's row repeated per head, [group_batch, 1, max_query_len * heads, max_seq_len]
    # in the cache's dtype (one position: attn_bias itself): built by the first layer that attends, reused by the rest
    head_bias: torch.Tensor | None = None
    # a sequence alone over one run of the cache: its bias [max_query_len, max_seq_len] as the latent kernel reads
    # it, when the kernel takes the group's calls (set by the first layer that attends, see _alone); False: it does not
    alone_bias: torch.Tensor | bool | None = None
    # every batch row holds max_query_len valid queries and the rows run first_row, first_row + 1, ...: the padded
    # queries are a view of q and the output rows need no gather (a decode or verify step of sequences in lanes)
    packed: bool = False


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
              device: torch.device | str = "cpu", kv_starts: list[int] | None = None,
              lanes: tuple[int, int] = (0, 0), free_padding: bool = False) -> AttentionMetadata:
        """Metadata for sequences whose last `query_lens[b]` of `seq_lens[b]` tokens are computed this step.
        With `kv_starts`, sequence b attends only to positions from kv_starts[b] on (its queries must lie there).
        `lanes`: the allocator's (number of lanes, blocks per lane); (0, 0) for none. `free_padding`: the attention
        that reads this metadata reads only the positions each row sees (the latent kernel), so a sequence read in
        place from its lane costs nothing more beside a longer context, and none is attended alone for its length
        (see _long_contexts).
        Built with a few whole-batch array ops (per-sequence Python here cost a millisecond a step at batch 32), in
        numpy: torch's calls on tensors this small cost 3-5 times as much (0.46 ms at 4 sequences against 0.15, 0.70
        against 0.26 at 32), and a speculative step builds this for the target and for each draft step."""
        kv_starts = kv_starts or [0] * len(query_lens)
        for b, (q_len, s_len, blocks) in enumerate(zip(query_lens, seq_lens, block_tables)):
            if q_len < 1 or q_len > s_len:
                raise ValueError(f"sequence {b}: query length {q_len} must be in 1..seq_len={s_len}")
            if len(blocks) * block_size < s_len:
                raise ValueError(f"sequence {b}: {len(blocks)} blocks of {block_size} cannot hold {s_len} tokens")
            if not 0 <= kv_starts[b] <= s_len - q_len:
                raise ValueError(f"sequence {b}: keys start at {kv_starts[b]}, after its first query {s_len - q_len}")
        num_used = [-(-s // block_size) for s in seq_lens]
        # the first block of each sequence whose used blocks are one ascending run, else -1
        runs = [blocks[0] if blocks[n - 1] - blocks[0] == n - 1 and blocks[:n] == list(range(blocks[0], blocks[0] + n))
                else -1 for blocks, n in zip(block_tables, num_used)]
        geometry = (block_size, *lanes, runs)
        # [sequences, most used blocks]: each sequence's used blocks, padded with block 0 (not needed by a sequence
        # alone in one run of the cache, whose slots are first, first + 1, ...)
        width = max(num_used)
        table = None if len(query_lens) == 1 and runs[0] >= 0 else np.array(
            [blocks[:n] + [0] * (width - n) for blocks, n in zip(block_tables, num_used)], dtype=np.int64)
        if len(query_lens) == 1:  # a sequence alone (batch-1 decode, each draft step): a third of the ops
            q_len, s_len = query_lens[0], seq_lens[0]
            positions = np.arange(s_len - q_len, s_len)
            slot_mapping = positions + runs[0] * block_size if table is None \
                else _slots(table[0], positions, block_size)
            group = _group([0], query_lens, seq_lens, kv_starts, table, [0], geometry, device)
            return cls(positions=_tensor(positions, device), slot_mapping=_tensor(slot_mapping, device), groups=[group])
        q_lens, s_lens = np.array(query_lens), np.array(seq_lens)
        seq_of_row = np.repeat(np.arange(len(query_lens)), q_lens)
        starts = np.cumsum(q_lens) - q_lens  # flat row of each sequence's first query
        positions = (s_lens - q_lens)[seq_of_row] + np.arange(len(seq_of_row)) - starts[seq_of_row]
        slot_mapping = table[seq_of_row, positions // block_size] * block_size + positions % block_size
        short = [b for b, q in enumerate(query_lens) if q <= SHORT_QUERY]
        tails = _long_tails(short, query_lens)
        # the short sequences whose padding the attention would read (all of them, unless free_padding)
        padding_read = [b for b in short if b not in tails and not (free_padding and _in_lane(b, seq_lens, geometry))]
        alone = tails | _long_contexts(padding_read, seq_lens)
        members = (_split_at_lanes([b for b in short if b not in alone], seq_lens, geometry)
                   + [[b] for b in sorted(alone)] + [[b] for b, q in enumerate(query_lens) if q > SHORT_QUERY])
        starts_list = starts.tolist()
        groups = [_group(m, query_lens, seq_lens, kv_starts, table, starts_list, geometry, device) for m in members]
        return cls(positions=_tensor(positions, device), slot_mapping=_tensor(slot_mapping, device), groups=groups)


def _tensor(array: np.ndarray, device) -> torch.Tensor:
    """A torch tensor of `array` on `device` (on CPU it shares the array's memory)."""
    return torch.from_numpy(array).to(device)


def _slots(blocks: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    """The flat cache slot of each of `positions` (any shape) of a sequence whose blocks are `blocks`."""
    return blocks[..., positions // block_size] * block_size + positions % block_size


MAX_EMPTY_LANES = 1.0  # a lane view may hold up to this many padding rows per member; sparser groups gather


def _long_tails(short: list[int], query_lens: list[int]) -> set[int]:
    """The short sequences whose queries are far longer than most (a prompt's last chunk of up to SHORT_QUERY rows
    beside one- to four-row decode and verify rows): each attends alone, so it does not pad every other sequence
    of the batch to its length. At 28 sequences verifying 2 rows beside a 16-row tail, padding made the batched
    attention 8 times the rows."""
    if len(short) < 3:
        return set()
    typical = sorted(query_lens[b] for b in short)[len(short) // 2]
    return {b for b in short if query_lens[b] > 2 * typical + 2}


# one more attention call costs about what this many (query row, context position) pairs of the batched call cost:
# SDPA over 4 heads' rows and 576-wide latents here, 10 us a call and 0.2-0.4 us a pair, plus the group's bookkeeping
CALL_COST_PAIRS = 128


def _long_contexts(short: list[int], seq_lens: list[int]) -> set[int]:
    """The short sequences whose contexts are far longer than the rest's, each attended alone (in place, its
    exact length) so the batched call does not pad every other context to theirs. Of "the j longest alone" for
    every j, the cheapest: j calls more, the j contexts once each, and every other sequence padded to the longest
    left. At 32 sequences of the eval prompts (27 to 339 tokens), one padded SDPA call read 2.7 times the contexts.
    The latent kernel reads only the positions a row sees, and there padding a context read in place costs nothing
    while a call more per layer does: the bundled target decoding 96 tokens of the eval prompts (bfloat16, compiled
    step) ran 1.34x faster at 32 sequences and 1.17x at 16 with no sequence alone than with this split (greedy
    tokens equal), so `AttentionMetadata.build` leaves those sequences out (`free_padding`)."""
    if len(short) < 3:
        return set()
    order = sorted(short, key=lambda b: -seq_lens[b])
    lens = [seq_lens[b] for b in order]
    best, best_cost, alone_cost = 0, len(lens) * lens[0], 0
    for j in range(1, len(lens) - 1):
        alone_cost += CALL_COST_PAIRS + lens[j - 1]
        cost = alone_cost + (len(lens) - j) * lens[j]
        if cost < best_cost:
            best, best_cost = j, cost
    return set(order[:best])


def _in_lane(b: int, seq_lens: list[int], geometry: tuple) -> bool:
    """Sequence b's used blocks are one run from the start of a lane and stay inside it."""
    block_size, num_lanes, lane_blocks, runs = geometry
    return (0 <= runs[b] < num_lanes * lane_blocks and runs[b] % lane_blocks == 0
            and seq_lens[b] <= lane_blocks * block_size)


def _split_at_lanes(short: list[int], seq_lens: list[int], geometry: tuple) -> list[list[int]]:
    """The short sequences as one group, or as two when some read their context in place from their lanes and
    others (grown past their lane, or given none) are gathered: one sequence past its lane then costs a gather of
    its own context, not of the whole batch's (at batch 16, a gather of every context was 5% of a step)."""
    in_lane = [b for b in short if _in_lane(b, seq_lens, geometry)]
    if len(in_lane) < 2 or len(in_lane) == len(short):
        return [short] if short else []
    lane_members = set(in_lane)
    return [in_lane, [b for b in short if b not in lane_members]]


def _group(members: list[int], query_lens: list[int], seq_lens: list[int], kv_starts: list[int],
           table: np.ndarray | None, starts: list[int], geometry: tuple, device) -> AttentionGroup:
    """`table` [sequences, blocks]: each sequence's used blocks (padded; None for a sequence alone in one run).
    In numpy, as `AttentionMetadata.build`."""
    block_size, num_lanes, lane_blocks, runs = geometry
    if len(members) == 1:  # one sequence, nothing to pad: the same fields in a third of the ops
        return _one_sequence_group(members[0], query_lens, seq_lens, kv_starts, table, starts, geometry, device)
    lanes = None
    # in lanes: each run starts a lane and stays inside it, so every batch row's view lies in the lanes lo..hi
    if num_lanes and all(_in_lane(b, seq_lens, geometry) for b in members):
        lanes = [runs[b] // lane_blocks for b in members]
        lo, hi = min(lanes), max(lanes)
        if hi - lo + 1 - len(members) > MAX_EMPTY_LANES * len(members):
            lanes = None
    if lanes is None:
        batch_rows, member_row = len(members), np.arange(len(members))
    else:  # batch row = lane - lo; rows of lanes no member owns stay empty
        batch_rows, member_row = hi - lo + 1, np.array(lanes) - lo
    q_lens, s_lens, kv_start, first = np.zeros((4, batch_rows), dtype=np.int64)
    q_lens[member_row] = [query_lens[b] for b in members]
    s_lens[member_row] = [seq_lens[b] for b in members]
    kv_start[member_row] = [kv_starts[b] for b in members]
    first[member_row] = [starts[b] for b in members]
    max_q, max_s = max(query_lens[b] for b in members), max(seq_lens[b] for b in members)
    offsets = np.arange(max_q)
    query_valid = offsets < q_lens[:, None]  # [batch_rows, max_q]
    # padded query rows read a row of the group's own (one its caller computes: a caller that fills only some
    # groups' rows, as MLA's absorbed attention beside prompt chunks does, never feeds unset memory to the kernel)
    query_rows = np.where(query_valid, first[:, None] + offsets, starts[members[0]])
    q_pos = (s_lens - q_lens)[:, None] + offsets  # [batch_rows, max_q]
    key_pos = np.arange(max_s)
    # causal, from the sequence's kv start; this also hides the padding past seq_lens[b]
    visible = (key_pos <= q_pos[..., None]) & (key_pos >= kv_start[:, None, None])
    visible &= query_valid[..., None]
    visible[..., 0] |= ~query_valid  # padded query rows see key 0 so their softmax stays finite; dropped after
    attn_bias = np.where(visible, np.float32(0), np.float32(-np.inf))[:, None]
    if lanes is None:
        kv_slots, kv_view, in_order = _tensor(_slots(table[members], key_pos, block_size), device), None, True
    else:
        kv_slots, kv_view = None, (lo * lane_blocks * block_size, lane_blocks * block_size)
        in_order = lanes == sorted(lanes)
    flat = query_rows.ravel()
    packed = bool(query_valid.all()) and bool((flat == np.arange(flat[0], flat[0] + flat.size)).all())
    return AttentionGroup(rows=_tensor(query_rows[query_valid], device), query_rows=_tensor(query_rows, device),
                          query_valid=_tensor(query_valid, device), kv_slots=kv_slots, kv_view=kv_view,
                          attn_bias=_tensor(attn_bias, device), first_row=starts[members[0]], in_flat_order=in_order,
                          packed=packed)


def _one_sequence_group(b: int, query_lens: list[int], seq_lens: list[int], kv_starts: list[int],
                        table: np.ndarray | None, starts: list[int], geometry: tuple, device) -> AttentionGroup:
    """_group for sequence b alone."""
    block_size, _, _, runs = geometry
    q_len, s_len = query_lens[b], seq_lens[b]
    rows = np.arange(starts[b], starts[b] + q_len)
    attn_bias = np.zeros((1, 1, q_len, s_len), dtype=np.float32)
    if q_len > 1:
        attn_bias[0, 0, :, s_len - q_len:] = np.triu(np.full((q_len, q_len), -np.inf, dtype=np.float32), 1)
    if kv_starts[b]:
        attn_bias[..., :kv_starts[b]] = -np.inf
    contiguous = runs[b] >= 0
    kv_slots = None if contiguous else _tensor(_slots(table[b], np.arange(s_len), block_size)[None], device)
    return AttentionGroup(rows=_tensor(rows, device), query_rows=_tensor(rows[None], device),
                          query_valid=torch.ones(1, q_len, dtype=torch.bool, device=device),
                          kv_slots=kv_slots, kv_view=(runs[b] * block_size, 0) if contiguous else None,
                          attn_bias=_tensor(attn_bias, device), first_row=starts[b])


def paged_latent_attention(q: torch.Tensor, latent_cache: torch.Tensor, attn: AttentionMetadata, value_dim: int,
                           scale: float, groups: list[AttentionGroup] | None = None) -> torch.Tensor:
    """Multi-query attention where one latent per token is both key (all of it) and value (its first value_dim).

    q: [num_tokens, heads, latent_dim]; latent_cache: [num_slots, latent_dim]. Returns [num_tokens, heads, value_dim],
    in q's dtype where the C kernel reads the cache (float32 or bfloat16 on CPU; q float32 or bfloat16), else in the
    cache's dtype. With `groups` (some of attn.groups), only their rows are computed; the others are left unset.
    """
    heads = q.shape[1]
    if not (latent_kernel.reads(latent_cache) and q.dtype in latent_kernel.LATENT_DTYPES):
        q = q.to(latent_cache.dtype)
    if groups is None and len(attn.groups) == 1:
        out = _alone(q, latent_cache, attn.groups[0], value_dim, scale)
        if out is not None:
            return out

    def attend(group: AttentionGroup, into: torch.Tensor | None = None) -> torch.Tensor:
        """The group's rows [group_tokens, heads, value_dim], written to `into` when given."""
        batch, max_q = group.query_rows.shape
        kv = _context(latent_cache, group)  # [batch, max_seq_len, latent_dim]: the one key head
        queries = _queries(q, group).reshape(batch, max_q * heads, -1)  # position-major, then heads
        pairs = batch * max_q * kv.shape[1]
        if latent_kernel.takes(queries, kv, value_dim):
            threads = parallel_threads() if _wants_threads(pairs, KERNEL_PARALLEL_PAIRS) else 1
            out = latent_kernel.latent_attention(queries, kv, group.attn_bias[:, 0], scale, value_dim, threads,
                                                 None if into is None else into.view(batch, max_q * heads, -1))
            if into is not None:
                return into
        else:
            # every query of a sequence (its positions x heads) is a row of one SDPA head over the one key head, so
            # the kernel reads each latent once per sequence however many positions verify: at batch 16 and
            # 300-token contexts, 4 positions 1.3x faster than with the positions as SDPA heads (each reading the
            # context again). The fused kernel reads each latent once where two bmms (scores, then values) read it
            # twice: at batch 32 and 192-token contexts 1.2x faster, at 1,000 tokens 2.2x
            if group.head_bias is None or (max_q > 1 and group.head_bias.shape[2] != max_q * heads):
                bias = group.attn_bias.to(kv.dtype)  # one position: its heads share its row, broadcast (no copy)
                group.head_bias = bias if max_q == 1 else bias.repeat_interleave(heads, dim=2)
            with _parallel(pairs):
                # (q may be in the kernel's dtypes where the kernel does not take this call: SDPA wants kv's)
                out = F.scaled_dot_product_attention(queries.to(kv.dtype).unsqueeze(1), kv.unsqueeze(1),
                                                     kv.unsqueeze(1), attn_mask=group.head_bias,
                                                     scale=scale)[:, 0, :, :value_dim]
        out = out.view(batch, max_q, heads, value_dim)
        if batch == 1 or group.packed:
            out = out.reshape(-1, heads, value_dim)  # [group_tokens, heads, value_dim]
        else:
            out = out[group.query_valid]
        return out if into is None else into.copy_(out)

    groups = attn.groups if groups is None else groups
    if len(groups) == 1 and groups[0].in_flat_order and groups[0].rows.shape[0] == q.shape[0]:
        return attend(groups[0])
    # a group whose rows are one run of the output (a prompt chunk, a packed decode step) is written in place
    out = q.new_empty(q.shape[0], heads, value_dim)
    for group in groups:
        if group.in_flat_order and (group.query_rows.shape[0] == 1 or group.packed):
            attend(group, out[group.first_row:group.first_row + group.rows.shape[0]])
        else:
            out[group.rows] = attend(group)
    return out


def _alone(q: torch.Tensor, cache: torch.Tensor, group: AttentionGroup, value_dim: int, scale: float
           ) -> torch.Tensor | None:
    """paged_latent_attention for a group of one sequence that holds every row of q and reads its context in place
    (batch-1 decode and verify, every draft step at batch 1): the latent kernel called straight, what every layer's
    call shares worked out by the first (at batch 1 the general path's tensor ops cost a 4-row verify step about as
    much as the kernel itself). None where the general path runs."""
    if group.alone_bias is False or not q.is_contiguous():
        return None
    if group.alone_bias is None:
        max_q, max_s = group.attn_bias.shape[2:]
        kv = _context(cache, group) if group.kv_view is not None else None
        fits = (kv is not None and group.query_rows.shape[0] == 1 and group.in_flat_order
                and group.rows.shape[0] == q.shape[0] == max_q
                and not _wants_threads(max_q * max_s, KERNEL_PARALLEL_PAIRS)
                and latent_kernel.takes(q.unsqueeze(0), kv, value_dim))
        group.alone_bias = group.attn_bias[0, 0].to(torch.float32).contiguous() if fits else False
        if not fits:
            return None
    first_slot = group.kv_view[0]
    return latent_kernel.latent_attention_alone(q, cache, first_slot, group.alone_bias.shape[1], group.alone_bias,
                                                scale, value_dim)


def _wants_threads(pairs: int, least: int = PARALLEL_PAIRS) -> bool:
    """Whether a call this large (query positions x context positions) runs on more threads than it has
    (parallel_threads(), from `least` pairs on)."""
    return pairs >= least and parallel_threads() > torch.get_num_threads()


@contextmanager
def _parallel(pairs: int):
    """Run the block on parallel_threads() when the call is large enough (PARALLEL_PAIRS). Each sequence's rows are
    computed by one thread either way, so the result does not depend on the thread count."""
    if not _wants_threads(pairs):
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(parallel_threads())
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def sequence_context(cache: torch.Tensor, group: AttentionGroup) -> torch.Tensor:
    """A one-sequence group's whole context [seq_len, ...] (a view when its blocks are one run)."""
    return _context(cache, group)[0]


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, attn: AttentionMetadata, scale: float) -> torch.Tensor:
    """Grouped-query attention over a paged cache of per-head keys and values (Llama-style EAGLE-3 drafts).

    q: [num_tokens, heads, head_dim]; kv_cache: [num_slots, 2, kv_heads, head_dim] (index 0 keys, 1 values).
    Query head h reads kv head h // (heads // kv_heads), as transformers' repeat_kv does. Returns
    [num_tokens, heads, head_dim].
    """
    def attend(group: AttentionGroup) -> torch.Tensor:
        batch = group.query_rows.shape[0]
        kv = _context(kv_cache, group)  # [batch, max_seq_len, 2, kv_heads, head_dim]
        k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)  # [batch, kv_heads, max_seq_len, head_dim]
        with _parallel(batch * group.query_rows.shape[1] * k.shape[2]):
            out = F.scaled_dot_product_attention(_queries(q, group).transpose(1, 2), k, v,
                                                 attn_mask=group.attn_bias.to(kv.dtype), scale=scale, enable_gqa=True)
        out = out.transpose(1, 2)  # [batch, max_q, heads, head_dim]
        return out[0] if batch == 1 else out[group.query_valid]  # [group_tokens, heads, head_dim]

    return _gather(attend, attn.groups, q.shape[0])


def _context(cache: torch.Tensor, group: AttentionGroup) -> torch.Tensor:
    """The group's context [batch, max_seq_len, ...]: a strided view of the cache when its runs are contiguous
    (no copy: at batch 32 the gather was a quarter of a decode step), else the rows at kv_slots. index_select on
    the flat slots: on CPU it copies whole rows 3-5x faster than advanced indexing with a 2-D index."""
    if group.kv_view is not None:
        first, stride = group.kv_view
        batch, _, _, max_seq_len = group.attn_bias.shape
        return cache.as_strided((batch, max_seq_len, *cache.shape[1:]), (stride * cache.stride(0), *cache.stride()),
                                cache.storage_offset() + first * cache.stride(0))
    return cache.index_select(0, group.kv_slots.flatten()).view(*group.kv_slots.shape, *cache.shape[1:])


def _queries(q: torch.Tensor, group: AttentionGroup) -> torch.Tensor:
    """The group's queries padded to [batch, max_q, ...]; a one-sequence group is a slice of q, not a gather."""
    if group.query_rows.shape[0] == 1:
        return q[group.first_row:group.first_row + group.query_rows.shape[1]].unsqueeze(0)
    if group.packed:
        return q[group.first_row:group.first_row + group.query_rows.numel()].view(*group.query_rows.shape, *q.shape[1:])
    return q[group.query_rows]


def _gather(attend, groups: list[AttentionGroup], num_tokens: int) -> torch.Tensor:
    """Run `attend` on each group and place its rows in flat order (no copy when one group holds them all)."""
    if len(groups) == 1 and groups[0].in_flat_order and groups[0].rows.shape[0] == num_tokens:
        return attend(groups[0])
    out = None
    for group in groups:
        part = attend(group)
        if out is None:
            out = part.new_empty(num_tokens, *part.shape[1:])
        out[group.rows] = part
    return out
