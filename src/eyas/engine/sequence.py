"""A request's state as the engine sees it: tokens, how many are in the KV cache, its blocks.

Only `Scheduler` writes it (`schedule` admits, grows and preempts; `commit` applies a step's output). Between
steps every sequence satisfies these invariants (`check_invariants` asserts them):

  waiting      nothing cached: num_computed == num_draft_computed == 0, no blocks, no drafts, no pending inputs
  catching up  num_computed < len(token_ids) - 1 (a prompt being prefilled, or a preempted sequence's tokens being
               recomputed), no drafts
  decoding     num_computed == len(token_ids) - 1: exactly one committed token is not in the target's KV cache yet,
               and draft_tokens (0..K) follow it; they are computed and verified together next step (the last
               committed token is never cached: a step that computes it also samples after it)
  running      the blocks hold the cached positions (num_computed) and, with drafts, every position the next step
               writes (len(token_ids) + len(draft_tokens): the draft's cache already holds entries of its drafts)
  draft        num_draft_computed <= num_computed: the draft's cache holds positions below num_draft_computed, and
               pending_draft_inputs holds the target's states the draft's step 0 reads at the positions in between
               (one row each, unfused), so drafting that was paused resumes by running them first
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

import torch

from eyas.sampling_params import SamplingParams

if TYPE_CHECKING:
    from eyas.engine.grammar import SequenceGrammar
    from eyas.engine.sampling import TokenLogprobs

_ids = itertools.count()


@dataclass(slots=True)
class AcceptanceCounts:
    """What verify steps did with drafts: one sequence's, or every sequence's summed (the counters vLLM exposes, and
    how many steps reached each position). A step that verified no drafts is not a verify step.

    The draft is judged per position, over the steps that verified that position: an adaptive width (or a sequence's
    last tokens) that verifies fewer drafts leaves the later positions out instead of counting them as rejected, so
    the same draft reports the same acceptance whatever the width policy did."""

    num_verify_steps: int = 0
    num_drafted: int = 0
    num_accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [k]: steps that accepted drafts 0..k
    verified_per_position: list[int] = field(default_factory=list)  # [k]: steps that verified draft k

    def add(self, num_drafts: int, num_accepted: int) -> None:
        """One verify step that checked `num_drafts` drafts and accepted the first `num_accepted`."""
        if num_drafts == 0:
            return
        self.num_verify_steps += 1
        self.num_drafted += num_drafts
        self.num_accepted += num_accepted
        for counts in (self.accepted_per_position, self.verified_per_position):
            counts.extend([0] * (num_drafts - len(counts)))
        for k in range(num_drafts):
            self.verified_per_position[k] += 1
            self.accepted_per_position[k] += k < num_accepted

    @classmethod
    def total(cls, outputs: Iterable) -> AcceptanceCounts:
        """The counts of finished requests (`RequestOutput`s: their accepted_counts and verified_counts), summed."""
        totals = cls()
        for out in outputs:
            totals.num_verify_steps += out.num_verify_steps
            totals.num_drafted += out.num_drafted
            totals.num_accepted += out.num_accepted
            add_counts(totals.accepted_per_position, out.accepted_counts)
            add_counts(totals.verified_per_position, out.verified_counts)
        return totals

    @property
    def rates(self) -> list[float]:
        """The draft's acceptance at each position it was verified at: P(drafts 0..k accepted | draft k verified)."""
        return acceptance_rates(self.accepted_per_position, self.verified_per_position)

    @property
    def acceptance_length(self) -> float:
        """The draft's acceptance length at the widest width verified: 1 + the sum of the per-position rates (under a
        fixed width, tokens committed per verify step)."""
        return 1.0 + sum(self.rates)

    @property
    def tokens_per_verify_step(self) -> float:
        """What the verified widths delivered: 1 + accepted drafts / verify steps (the width policy's doing too)."""
        return 1.0 + self.num_accepted / self.num_verify_steps if self.num_verify_steps else 1.0

    def as_dict(self) -> dict:
        return {"num_verify_steps": self.num_verify_steps, "num_drafted": self.num_drafted,
                "num_accepted": self.num_accepted, "acceptance_length": round(self.acceptance_length, 4),
                "accepted_per_position": [round(r, 4) for r in self.rates],
                "tokens_per_verify_step": round(self.tokens_per_verify_step, 4)}


def add_counts(totals: list[int], counts: list[int]) -> None:
    """totals[k] += counts[k] for every position, growing totals to the longer of the two."""
    totals.extend([0] * (len(counts) - len(totals)))
    for k, n in enumerate(counts):
        totals[k] += n


def acceptance_rates(accepted: list[int], verified: list[int]) -> list[float]:
    """Per position k: accepted[k] / verified[k], for the positions some step verified."""
    return [a / v for a, v in zip(accepted, verified) if v]


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.seq_id = next(_ids)
        self.token_ids = list(prompt_token_ids)  # prompt, then generated tokens
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.num_computed = 0  # tokens whose KV entries are in the cache
        self.block_table: list[int] = []  # shared by the target's cache and the draft's
        self.draft_tokens: list[int] = []  # proposed last step, verified next step
        self.num_draft_computed = 0  # positions in the draft's cache
        self.pending_draft_inputs: list[torch.Tensor] = []  # target states of positions num_draft_computed.. on
        self.acceptance = AcceptanceCounts()
        self.logprobs: list[TokenLogprobs] = []  # per generated token, when params.logprobs is set
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.text: str | None = None  # set when a stop string ended the sequence: the text before it
        self.generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        self.grammar: SequenceGrammar | None = None  # set by the engine when params.structured_output is given
        self.arrival_time = time.perf_counter()
        self.first_token_time: float | None = None
        self.finish_time: float | None = None

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def generated_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED


def check_invariants(seq: Sequence, block_size: int) -> None:
    """Assert the invariants of the module docstring (tests call this between steps)."""
    pending = sum(t.shape[0] for t in seq.pending_draft_inputs)
    if seq.status is Status.WAITING:
        assert seq.num_computed == seq.num_draft_computed == pending == 0, "a waiting sequence has nothing cached"
        assert not seq.block_table and not seq.draft_tokens, "a waiting sequence holds no blocks and no drafts"
        return
    if seq.status is Status.FINISHED:
        assert not seq.block_table, "a finished sequence holds no blocks"
        return
    assert seq.num_computed <= len(seq) - 1, \
        f"the last committed token is never cached: num_computed {seq.num_computed}, {len(seq)} tokens"
    assert seq.num_computed == len(seq) - 1 or not seq.draft_tokens, \
        f"drafts follow the one uncomputed token: num_computed {seq.num_computed}, {len(seq)} tokens"
    needed = len(seq) + len(seq.draft_tokens) if seq.draft_tokens else seq.num_computed
    assert len(seq.block_table) * block_size >= needed, f"blocks for {needed} positions"
    assert seq.num_draft_computed + pending == seq.num_computed, \
        f"draft cache {seq.num_draft_computed} + pending {pending} != num_computed {seq.num_computed}"
