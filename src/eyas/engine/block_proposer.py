"""The propose half of a step for a block draft (DFlash): one draft forward proposes all of a sequence's drafts.

  context  every position the target kept this step (and, after a pause, those computed while drafting was off,
           from their kept inputs) gets its keys and values in every draft layer, computed once from the target's
           fused hidden states there and written into the draft's paged cache at that position's slot
  block    per sequence that drafts, one block [anchor, MASK x (B - 1)] at positions p..p+B-1: the anchor is the
           newest committed token, at p = num_computed (the target runs it next step); the block attends to the
           cached context 0..p-1 and, non-causally, to its own B rows; rows 1..w are the w drafts (w <= B - 1:
           this step's width, cut by the sequence's budget and its grammar)

Worked example, B = 4, width 3, committed [.. t9] with t9 at position 9 and drafts [d10, d11, d12]; d10 is accepted
and d11 rejected: the target's x11 is committed after d10, and its KV is kept for positions 9..10 (num_computed 11).
Context: the target's states at the rows of t9 and d10 become the draft's cache entries of positions 9 and 10 (0..8
came from earlier steps). Block: [x11, M, M, M] at positions 11..14 over context 0..10; rows 1..3 propose d12', d13',
d14' for positions 12..14, verified next step with x11. The block's own keys and values are not kept: position 11
gets its entry once the target has computed it. Only kept positions are written, so no entry ever holds a rejected
draft, and nothing past num_draft_computed is read: a slot there is rewritten when its position is computed (after a
preemption too). That is the whole rollback.

Drafting off (width 0) runs no draft work: the target's states at the kept positions wait on the sequence, unfused
(`pending_draft_inputs`, at most MAX_PENDING_ROWS each), and the first step that drafts again fuses and writes them
with its own, so the context never has a hole. With num_draft_computed 20 and three plain steps (positions 20, 21,
22 waiting), the step that computes 23 writes 20..23 and anchors its block at 24. The width policy, the budgets and
the handling of structured output are `Proposer`'s: a constrained sequence's draft k is the argmax of block row k
over the tokens its grammar allows after drafts 1..k-1.

The block reads its context by gathering the entries of the A drafting sequences from the paged cache into one
padded [A, C_max, ...] tensor, a mask hiding each shorter context's padding: the model's forward takes the context's
keys and values as tensors, and the block's own never touch the cache. That copies every context position of every
layer once a step (and the forward's concatenation with the block's keys once more), where a paged kernel would read
the cache in place: small next to the target's work at short contexts, it grows with the context (at DeepSeek-V3 size
with 8 KV heads of 128 in 6 layers, 24 KiB a position in bfloat16: 400 MB a step for a 16k context).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from eyas.config import SpeculativeConfig
from eyas.engine.batch import ScheduledBatch, VerifyLayout
from eyas.engine.proposer import Proposal, Proposer
from eyas.engine.sequence import Sequence


@runtime_checkable
class BlockDraft(Protocol):
    """What the engine needs of a draft whose one forward proposes a block; `DFlashDraft` implements it."""

    aux_hidden_state_ids: tuple[int, ...]  # the target states the context reads (HF hidden_states ids)
    block_size: int  # rows per block: the anchor and block_size - 1 drafts
    max_positions: int  # positions its rope covers

    def combine_hidden_states(self, target_hidden: torch.Tensor, aux_hidden_states: list[torch.Tensor]
                              ) -> torch.Tensor:
        """The fused context input [rows, H] of positions from the target's hidden states there."""

    def cache_entries(self, fused: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Each position's cache entry [rows, *cache_entry_shape()]: its keys and values in every layer."""

    def cache_entry_shape(self) -> tuple[int, ...]:
        """The shape of one position's entry in the draft's cache."""

    def context_kv_of(self, entries: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
        """Gathered entries [B, C, *cache_entry_shape()] -> the context_kv the forward takes."""

    def block_input_ids(self, anchors: torch.Tensor) -> torch.Tensor:
        """anchors [B] -> [B, block_size]: each anchor, then mask tokens."""

    def __call__(self, block_ids: torch.Tensor, block_positions: torch.Tensor,
                 context_kv: list[tuple[torch.Tensor, ...]], mask: torch.Tensor | None) -> torch.Tensor:
        """One forward over blocks [B, R] -> normed outputs [B, R, H]."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the target's vocabulary."""

    def greedy_proposals(self, hidden: torch.Tensor) -> torch.Tensor:
        """argmax of compute_logits, in target token ids."""


class BlockProposer(Proposer):
    """`Proposer`'s width policy, budgets and grammar handling, with one block forward in place of the chain."""

    def __init__(self, draft: BlockDraft, config: SpeculativeConfig, num_slots: int, block_size: int,
                 max_model_len: int, dtype: torch.dtype, device: torch.device,
                 lanes: tuple[int, int] = (0, 0)) -> None:
        config = config.for_block_size(draft.block_size)  # K defaults to B - 1 and may not exceed it
        if draft.max_positions < max_model_len:
            raise ValueError(f"the draft's rope covers {draft.max_positions} positions, less than the context "
                             f"length {max_model_len}; lower max_model_len to {draft.max_positions}")
        super().__init__(draft, config, num_slots, block_size, max_model_len, dtype, device, lanes)

    def propose(self, batch: ScheduledBatch, layout: VerifyLayout, hidden: torch.Tensor, aux: list[torch.Tensor],
                new_tokens: list[list[int]], num_accepted: list[int], num_computed: list[int],
                width: int) -> Proposal:
        """`num_computed`: per sequence, the target's cached positions after this step's rollback."""
        seqs = batch.seqs
        per_seq = self._kept_states(layout, hidden, aux, num_accepted)  # the target states kept this step
        if width == 0:
            return self._paused(seqs, per_seq, new_tokens, num_computed)

        # context: positions num_draft_computed..num_computed - 1 of every sequence into the draft's cache
        caught_up = any(s.pending_draft_inputs for s in seqs)
        start = self._clock()
        rows = self._write_context(seqs, per_seq, new_tokens, num_computed)
        context = (rows, self._clock() - start)

        # budgets: the width, cut by max_tokens, the context length and the slots (sampling sequences only)
        drafts: list[list[int]] = [[] for _ in seqs]
        budgets, grammar_steps = self._budgets(seqs, layout, new_tokens, width)
        active = [i for i, k in enumerate(budgets) if k > 0]
        if active:
            # block: one forward for every drafting sequence, anchored at its newest token (position num_computed)
            out = self._block(seqs, active, [new_tokens[i][-1] for i in active], [num_computed[i] for i in active])
            rows = out[:, 1:1 + max(budgets)]
            # the greedy proposals of every row in one call of the draft's head; logits over the whole target
            # vocabulary only where a grammar masks them
            constrained = any(seqs[i].grammar is not None for i in active)
            logits = self.draft.compute_logits(rows) if constrained else None  # [len(active), w, vocab]
            greedy = None if constrained else self.draft.greedy_proposals(rows)  # [len(active), w]
            block_row = {i: r for r, i in enumerate(active)}
            for k in range(max(budgets)):  # drafts: row k + 1 of each block; a grammar has seen drafts 1..k
                active = [i for i in active if budgets[i] > k]
                if not active:
                    break
                at = [block_row[i] for i in active]
                self._next_drafts(None, active, seqs, drafts, budgets, logits=logits[at, k] if constrained else None,
                                  tokens=None if constrained else greedy[at, k])
        self._rollback_grammars(seqs, grammar_steps, drafts)
        return Proposal(drafts, num_computed, [None] * len(seqs), caught_up, context)

    def _write_context(self, seqs: list[Sequence], per_seq: list[torch.Tensor], new_tokens: list[list[int]],
                       num_computed: list[int]) -> int:
        """Cache entries of positions num_draft_computed..num_computed - 1 of each sequence: its pending target
        states, then this step's kept rows, one per position, fused (a block draft's context needs no tokens).
        Returns how many positions."""
        inputs, starts = [], []
        for seq, x in zip(seqs, per_seq):
            inputs.extend(seq.pending_draft_inputs)
            inputs.append(x)
            starts.append(seq.num_draft_computed)
        positions, slots = self._slots(seqs, starts, num_computed)
        fused = self._fused(torch.cat(inputs) if len(inputs) > 1 else inputs[0])  # [positions, H]
        assert fused.shape[0] == positions.shape[0], "one fused input per new context position"
        self.draft_cache.index_copy_(0, slots, self.draft.cache_entries(fused, positions).to(self.draft_cache.dtype))
        return positions.shape[0]

    def _block(self, seqs: list[Sequence], active: list[int], anchors: list[int], ends: list[int]) -> torch.Tensor:
        """The blocks of the `active` sequences, anchored at positions `ends` (each one's num_computed) over its
        cached context 0..end-1 -> normed outputs [len(active), B, H]."""
        B, device = self.draft.block_size, self.device
        ids = self.draft.block_input_ids(torch.tensor(anchors, device=device))  # [A, B]
        p = torch.tensor(ends, device=device)
        # rows past the rope's last position (the block's tail near the end of the context) never become tokens
        positions = (p[:, None] + torch.arange(B, device=device)).clamp(max=self.draft.max_positions - 1)
        context = max(ends)
        _, slots = self._slots([seqs[i] for i in active], [0] * len(active), [context] * len(active))
        entries = self.draft_cache.index_select(0, slots).view(len(active), context, *self.draft_cache.shape[1:])
        mask = None  # every row sees the whole context when no sequence's is shorter than the longest
        if min(ends) < context:
            sees_context = torch.arange(context, device=device) < p[:, None]  # [A, C]
            mask = torch.cat([sees_context[:, None, :].expand(-1, B, -1),
                              torch.ones(len(active), B, B, dtype=torch.bool, device=device)], dim=-1)[:, None]
        return self.draft(ids, positions, self.draft.context_kv_of(entries), mask)

    def _slots(self, seqs: list[Sequence], starts: list[int], ends: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions start..end-1 of each sequence, flat [rows], and their cache slots [rows] through its block
        table (a position past the table's blocks, the padding of a shorter context, reads block 0: masked)."""
        bs = self.block_size
        lens = torch.tensor(ends) - torch.tensor(starts)
        width = max(-(-e // bs) for e in ends)
        table = torch.tensor([s.block_table[:width] + [0] * (width - len(s.block_table[:width])) for s in seqs])
        seq_of_row = torch.repeat_interleave(torch.arange(len(seqs)), lens)
        first = torch.cumsum(lens, 0) - lens
        positions = torch.tensor(starts)[seq_of_row] + torch.arange(len(seq_of_row)) - first[seq_of_row]
        slots = table[seq_of_row, positions // bs] * bs + positions % bs
        return positions.to(self.device), slots.to(self.device)
