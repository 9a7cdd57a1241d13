"""What one engine step passes between its phases: the scheduler's `ScheduledBatch` (read-only to the runner), the
`VerifyLayout` that addresses its rows, and the runner's `StepOutput`, which `Scheduler.commit` alone applies."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eyas.engine.sampling import TokenLogprobs
from eyas.engine.sequence import Sequence


@dataclass(slots=True)
class ScheduledBatch:
    seqs: list[Sequence]
    num_new_tokens: list[int]  # tokens each sequence computes: (token_ids + draft_tokens)[num_computed:][:n]
    num_running: int = 0  # running sequences after scheduling (the batch size a verify width is chosen for)
    prefill_next: bool = False  # a prompt will still be prefilling next step (the mixed-batch width applies)

    def __bool__(self) -> bool:
        return bool(self.seqs)


@dataclass(slots=True)
class VerifyLayout:
    """Where each sequence's rows are in one step: the packed target input, its verify rows, and the gathered
    logits. Every index into the step's hidden states or logits goes through this.

    Worked example: sequence A decodes t9 (position 9) with drafts d10 d11; sequence B prefills the last 4 prompt
    tokens (positions 3..6); sequence C prefills positions 0..4 of a 9-token prompt.

        packed input   A: t9 d10 d11 | B: p3 p4 p5 p6 | C: q0 q1 q2 q3 q4
        token rows     A: 0..2       | B: 3..6        | C: 7..11         starts = [0, 3, 7], query_lens = [3, 4, 5]
        samples        A and B (C's prompt is not done): sampling = [0, 1]
        verify rows    A: 0 1 2 (num_drafts + 1 = 3 rows, first_verify_row 0); B: 6 (1 row, first_verify_row 6)
        logit rows     A: 0..2, B: 3                                        logit_offsets = [0, 3]

    Logit row logit_offsets[r] + j of sampling sequence r predicts the token after its j-th draft (j = 0: after its
    committed token). After acceptance, kept_rows(i, a) are the token rows whose target KV survives: the first
    query_lens[i] - num_drafts[i] + a rows of sequence i (A with one draft accepted: rows 0 and 1)."""

    starts: list[int]  # first packed row of each sequence
    query_lens: list[int]  # rows of each sequence
    num_drafts: list[int]  # drafts each sequence verifies (0 while prefilling or when drafting was off)
    sampling: list[int]  # sequences that sample this step: their computed tokens reach the end of token_ids
    first_verify_row: list[int]  # per sampling sequence, the packed row of its first verify row
    logit_offsets: list[int]  # per sampling sequence, its first row in the gathered logits

    @classmethod
    def of(cls, batch: ScheduledBatch) -> VerifyLayout:
        starts, row = [], 0
        for n in batch.num_new_tokens:
            starts.append(row)
            row += n
        num_drafts = [len(s.draft_tokens) for s in batch.seqs]
        sampling = [i for i, (s, n, d) in enumerate(zip(batch.seqs, batch.num_new_tokens, num_drafts))
                    if s.num_computed + n - d == len(s)]
        first_verify_row, logit_offsets, offset = [], [], 0
        for i in sampling:
            first_verify_row.append(starts[i] + batch.num_new_tokens[i] - num_drafts[i] - 1)
            logit_offsets.append(offset)
            offset += num_drafts[i] + 1
        return cls(starts, list(batch.num_new_tokens), num_drafts, sampling, first_verify_row, logit_offsets)

    @property
    def num_rows(self) -> int:
        return self.starts[-1] + self.query_lens[-1] if self.starts else 0

    def verify_rows(self) -> list[int]:
        """Packed rows to gather logits from, sampling sequence by sampling sequence."""
        return [first + j for first, i in zip(self.first_verify_row, self.sampling)
                for j in range(self.num_drafts[i] + 1)]

    def num_kept(self, i: int, num_accepted: int) -> int:
        """Rows of sequence i whose target KV is kept: its committed tokens and the accepted drafts."""
        return self.query_lens[i] - self.num_drafts[i] + num_accepted

    def kept_rows(self, i: int, num_accepted: int) -> range:
        return range(self.starts[i], self.starts[i] + self.num_kept(i, num_accepted))


@dataclass(slots=True)
class StepOutput:
    """Per sequence of the batch, what the step computed; `Scheduler.commit` applies it."""

    new_tokens: list[list[int]]  # to append in order, with stop checks (empty while a prompt is prefilling)
    num_computed: list[int]  # the target's KV holds positions < this (rejected drafts rolled back)
    draft_tokens: list[list[int]]  # proposed for the positions after new_tokens, verified next step
    num_draft_computed: list[int]  # the draft's cache holds positions < this
    pending_draft_inputs: list[torch.Tensor | None]  # the target's states (unfused step-0 inputs) at positions this
    # step computed that the draft did not (drafting was off): kept so that drafting resumes with the whole context
    logprobs: list[list[TokenLogprobs] | None]  # per new token, for sequences that asked for them
    num_verified: list[int]  # drafts verified this step
    num_accepted: list[int]  # of those, accepted
