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
               pending_draft_inputs holds the draft's step-0 inputs of the positions in between (one row each), so
               drafting that was paused resumes by running them first
"""

from __future__ import annotations

import itertools
import time
from enum import Enum
from typing import TYPE_CHECKING

import torch

from eyas.sampling_params import SamplingParams

if TYPE_CHECKING:
    from eyas.engine.grammar import SequenceGrammar
    from eyas.engine.sampling import TokenLogprobs

_ids = itertools.count()


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
        self.pending_draft_inputs: list[torch.Tensor] = []  # step-0 inputs of positions num_draft_computed.. on
        self.num_drafted = 0
        self.num_accepted = 0
        self.num_verify_steps = 0
        self.accepted_per_position: list[int] = []  # [k]: verify steps whose draft k was accepted
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
    def acceptance_length(self) -> float:
        """Tokens committed per verify step: 1 + accepted drafts / verify steps."""
        return 1.0 + self.num_accepted / self.num_verify_steps if self.num_verify_steps else 1.0

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
