"""Which sequences run this step and how many tokens each computes. Plain Python; no torch.

Each step: every running sequence that has caught up decodes (1 token, or its pending tokens), then waiting and
partially-prefilled sequences fill the rest of the token budget with prompt chunks. When the cache runs out of
blocks for a decode, the most recently admitted sequence is preempted: its blocks are freed and it waits to be
recomputed from its tokens (its generated tokens are kept, so the output is unchanged).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from eyas.engine.kv_cache import BlockAllocator
from eyas.engine.sequence import Sequence, Status


@dataclass(slots=True)
class ScheduledBatch:
    seqs: list[Sequence]
    num_new_tokens: list[int]  # tokens each sequence computes: (token_ids + draft_tokens)[num_computed:][:n]

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    def __init__(self, allocator: BlockAllocator, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.allocator = allocator
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        if self.allocator.blocks_for(len(seq) + 1) > self.allocator.num_blocks:
            raise ValueError(f"a sequence of {len(seq)} tokens cannot fit in a KV cache of "
                             f"{self.allocator.num_blocks} blocks of {self.allocator.block_size}")
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch([], [])
        budget = self.max_num_batched_tokens
        # 1. decodes of running sequences that have caught up with their tokens
        for seq in list(self.running):
            if seq.num_computed < seq.num_prompt_tokens or seq not in self.running:
                continue  # still prefilling (handled below), or preempted by an earlier iteration
            # the last committed token(s) plus the drafts proposed for them
            n = len(seq) - seq.num_computed + len(seq.draft_tokens)
            while not self.allocator.can_grow(seq.block_table, seq.num_computed + n):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is Status.RUNNING:
                self.allocator.grow(seq.block_table, seq.num_computed + n)
                batch.seqs.append(seq)
                batch.num_new_tokens.append(n)
                budget -= n
        # 2. prompt chunks: running sequences mid-prefill first, then new ones in arrival order
        candidates = [s for s in self.running if s.num_computed < s.num_prompt_tokens] + list(self.waiting)
        for seq in candidates:
            if budget <= 0:
                break
            if seq.status is Status.WAITING and len(self.running) >= self.max_num_seqs:
                break
            n = min(len(seq) - seq.num_computed, budget)
            if not self.allocator.can_grow(seq.block_table, seq.num_computed + n):
                break
            self.allocator.grow(seq.block_table, seq.num_computed + n)
            if seq.status is Status.WAITING:
                self.waiting.remove(seq)
                seq.status = Status.RUNNING
                self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
        return batch

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.allocator.free(seq.block_table)
        seq.num_computed = 0
        seq.draft_context_start = 0
        seq.draft_tokens = []
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.allocator.free(seq.block_table)
