"""The one owner of sequence state: which sequences run each step (`schedule`) and what the step changed
(`commit`). Plain Python; no torch.

Each step: every running sequence that has caught up decodes (1 token, or its pending tokens), then waiting and
partially-prefilled sequences fill the rest of the token budget with prompt chunks. When the cache runs out of
blocks for a decode, the most recently admitted sequence is preempted: its blocks are freed and it waits to be
recomputed from its tokens (its generated tokens are kept, so the output is unchanged). A sequence that will
sample also gets `num_lookahead_slots` more slots where blocks are free, for the tokens it may commit and the
drafts proposed after them (never preempting for them: with fewer slots it drafts fewer tokens).
"""

from __future__ import annotations

import time
from collections import deque

from eyas.engine.batch import ScheduledBatch, StepOutput
from eyas.engine.kv_cache import BlockAllocator
from eyas.engine.sequence import AcceptanceCounts, Sequence, Status
from eyas.engine.stop import StopChecker


class Scheduler:
    def __init__(self, allocator: BlockAllocator, max_num_seqs: int, max_num_batched_tokens: int,
                 stop: StopChecker | None = None, num_lookahead_slots: int = 0) -> None:
        self.allocator = allocator
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.stop = stop or StopChecker(set(), None, max_model_len=1 << 62)
        self.num_lookahead_slots = num_lookahead_slots
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.metrics = AcceptanceCounts()  # every sequence's, since start
        self.finished_early: list[Sequence] = []  # finished by schedule (out of cache), reported by the next commit

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
                if self.running == [seq]:  # alone, and the whole cache is too small: nothing to preempt
                    if seq.draft_tokens:  # drafts are optional
                        seq.draft_tokens = []
                        n = len(seq) - seq.num_computed
                        continue
                    self.finish(seq, "length")  # preempting itself would recompute it into the same wall
                    self.finished_early.append(seq)
                    break
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
        # 3. lookahead: a sequence that samples may commit up to len(drafts) + 1 tokens and then get drafts
        if self.num_lookahead_slots:
            for seq, n in zip(batch.seqs, batch.num_new_tokens):
                if seq.num_computed + n - len(seq.draft_tokens) == len(seq):
                    self._grow_best_effort(seq, seq.num_computed + n + self.num_lookahead_slots)
        batch.num_running = len(self.running)
        batch.prefill_next = bool(self.waiting) or any(
            s.num_computed + n < s.num_prompt_tokens for s, n in zip(batch.seqs, batch.num_new_tokens))
        return batch

    def commit(self, batch: ScheduledBatch, output: StepOutput) -> list[Sequence]:
        """Apply a step's output to its sequences; return those that finished (and any schedule finished)."""
        finished = self.take_finished()
        for i, seq in enumerate(batch.seqs):
            seq.num_computed = output.num_computed[i]
            seq.num_draft_computed = output.num_draft_computed[i]
            pending = output.pending_draft_inputs[i]
            if seq.num_draft_computed == seq.num_computed:
                seq.pending_draft_inputs = []
            elif pending is not None:
                seq.pending_draft_inputs.append(pending)
            seq.draft_tokens = list(output.draft_tokens[i])
            self._count(seq, output.num_verified[i], output.num_accepted[i])
            if seq.grammar is not None:
                seq.grammar.advance(output.new_tokens[i])
            logprobs = output.logprobs[i]
            if output.new_tokens[i]:
                seq.first_token_time = seq.first_token_time or time.perf_counter()
            for k, token in enumerate(output.new_tokens[i]):
                # one at a time: a stop inside an accepted run drops the tokens after it
                seq.token_ids.append(token)
                if logprobs is not None:
                    seq.logprobs.append(logprobs[k])
                reason = self.stop.reason(seq, token)
                if reason:
                    self.finish(seq, reason)
                    finished.append(seq)
                    break
            if not seq.is_finished:
                self.allocator.shrink(seq.block_table, max(len(seq) + len(seq.draft_tokens), seq.num_computed))
        return finished

    def take_finished(self) -> list[Sequence]:
        finished, self.finished_early = self.finished_early, []
        return finished

    def _count(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        seq.acceptance.add(num_drafts, num_accepted)
        self.metrics.add(num_drafts, num_accepted)

    def _grow_best_effort(self, seq: Sequence, num_tokens: int) -> None:
        have = len(seq.block_table)
        extra = min(self.allocator.blocks_for(num_tokens) - have, self.allocator.num_free)
        if extra > 0:
            self.allocator.grow(seq.block_table, (have + extra) * self.allocator.block_size)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.allocator.free(seq.block_table)
        seq.num_computed = 0
        seq.num_draft_computed = 0
        seq.pending_draft_inputs = []
        seq.draft_tokens = []
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        seq.finish_time = seq.finish_time or time.perf_counter()
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.allocator.free(seq.block_table)
        seq.pending_draft_inputs = []
