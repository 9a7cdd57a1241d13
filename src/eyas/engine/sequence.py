"""A request's state as the engine sees it: tokens, how many are in the KV cache, its blocks."""

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
        # the draft's cache holds this sequence's positions from here on; those before were computed while
        # drafting was off (SpeculativeConfig.disable_batch_size), and the draft does not attend to them
        self.draft_context_start = 0
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
