"""The propose half of a step: the draft chain over the positions whose next token is now known.

  step 0     one draft forward over every position p the target kept this step (and, after a pause, the positions
             computed while drafting was off, from their kept inputs), each paired with token p + 1 and the target's
             fused aux hidden states at p; the output at the last position proposes the first draft
  steps 1..  one token per sequence, on the draft's own pre-norm output, until each sequence has its width

Worked example, K = 3, committed [.. t9] with t9 at position 9 and drafts [d10, d11, d12]; d10 is accepted and
d11 rejected: the target's x11 is committed after d10, its KV is kept for positions 9..10. Step 0 runs on pairs
(h9, d10) and (h10, x11) at positions 9 and 10 and proposes d12' for position 12 (x11, at 11, is computed next
step with the drafts); steps 1 and 2 run at positions 11 and 12 and propose d13', d14'.

Drafting off (width 0: a large batch) runs no draft work at all, not even the fusing of the target's states: the
target's states at the positions it computed (its final hidden state and the aux states, unfused) are kept on the
sequence instead, and the first step that drafts again fuses them and runs them in the same step-0 pass, so the
draft never attends to a hole in its context. Structured output: a constrained sequence's proposals are the argmax
over the tokens its grammar allows; its matcher is advanced while drafting and rolled back after.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from eyas.config import SpeculativeConfig
from eyas.engine.adaptive_width import IDLE_SECONDS, AdaptiveWidth
from eyas.engine.batch import ScheduledBatch, VerifyLayout
from eyas.engine.grammar import apply_bitmask
from eyas.engine.sequence import Sequence
from eyas.models import latent_kernel
from eyas.models.attention import AttentionMetadata

# positions whose target states a sequence keeps while drafting is off, at most; then step 0 runs them (the draft
# cache stays full). At DeepSeek-V3's hidden size, with an EAGLE-3 draft's three aux states beside the final one,
# 29 MB per sequence in bfloat16; fewer would make a longer prompt run the draft while drafting is off
MAX_PENDING_ROWS = 512


@runtime_checkable
class DraftHead(Protocol):
    """What the engine needs of a draft; `Eagle3Draft` and `MTPDraft` implement it."""

    aux_hidden_state_ids: tuple[int, ...]  # the target layers whose outputs step 0 reads (HF hidden_states ids)

    def combine_hidden_states(self, target_hidden: torch.Tensor, aux_hidden_states: list[torch.Tensor]
                              ) -> torch.Tensor:
        """Step 0's hidden input [rows, H] from the target's final hidden state and its aux hidden states."""

    def __call__(self, hidden: torch.Tensor, next_token_ids: torch.Tensor, attn: AttentionMetadata,
                 cache: torch.Tensor) -> torch.Tensor:
        """One draft forward over a ragged batch: pre-norm outputs [rows, H]; writes its KV into `cache`."""

    def compute_logits(self, prenorm: torch.Tensor) -> torch.Tensor:
        """Logits over the target's vocabulary [rows, vocab]."""

    def greedy_tokens(self, prenorm: torch.Tensor) -> torch.Tensor:
        """argmax of compute_logits, in target token ids [rows]."""

    def cache_entry_shape(self) -> tuple[int, ...]:
        """The shape of one position's entry in the draft's cache."""


@dataclass(slots=True)
class Proposal:
    draft_tokens: list[list[int]]
    num_draft_computed: list[int]
    pending_draft_inputs: list[torch.Tensor | None]
    caught_up: bool  # step 0 also ran positions from a pause
    context: tuple[int, float] | None = None  # the draft's context work: (positions it ran over, seconds)


class Proposer:
    def __init__(self, draft: DraftHead, config: SpeculativeConfig, num_slots: int, block_size: int,
                 max_model_len: int, dtype: torch.dtype, device: torch.device,
                 lanes: tuple[int, int] = (0, 0)) -> None:
        self.draft = draft
        self.config = config
        self.block_size = block_size
        self.lanes = lanes  # the allocator's (number of lanes, blocks per lane)
        self.max_model_len = max_model_len
        self.device = device
        self.adaptive = AdaptiveWidth(config.num_speculative_tokens) if config.adaptive_width else None
        self.last_step_end: float | None = None  # when the last step the adaptive width saw ended (perf_counter)
        # the draft's cache (one entry per position), addressed through the same block tables as the target's
        self.draft_cache = torch.zeros(num_slots, *draft.cache_entry_shape(), dtype=dtype, device=device)
        # an MLA draft's latents, read by the latent kernel: a context read in place is padded, not attended alone
        self.free_padding = len(draft.cache_entry_shape()) == 1 and latent_kernel.reads(self.draft_cache)

    def width(self, batch: ScheduledBatch) -> int:
        """Drafts to propose in this step for the next: a configured override for this batch size, else the
        adaptive width, else K; capped by the mixed-batch width when prompts will still be prefilling."""
        override = self.config.width_override(batch.num_running)
        if override is not None:
            width = override
        elif self.adaptive is not None:
            catching_up = any(s.num_computed < len(s) - 1 for s in batch.seqs)  # prompt rows: not timed
            pause_rows = sum(s.num_computed - s.num_draft_computed for s in batch.seqs)
            width = self.adaptive.width(batch.num_running, catching_up, pause_rows)
        else:
            width = self.config.num_speculative_tokens
        if batch.prefill_next and self.config.num_speculative_tokens_mixed_batch is not None:
            width = min(width, self.config.num_speculative_tokens_mixed_batch)
        return width

    def observe(self, batch: ScheduledBatch, width: int, num_verified: list[int], num_accepted: list[int],
                seconds: float, proposal: Proposal) -> None:
        """A step took `seconds`: the adaptive width learns from it when every sequence decoded at one width, the
        width it also proposed at (each computed its committed token and its drafts; a step with prompt chunks costs
        what its prompts cost, one that changes width pays for two, and one that caught up after a pause for what
        the pause left)."""
        if self.adaptive is None:
            return
        end = time.perf_counter()  # the step ended as it was timed
        if self.last_step_end is not None and end - seconds - self.last_step_end >= IDLE_SECONDS:
            self.adaptive.after_idle()
        self.last_step_end = end
        if self.config.width_override(batch.num_running) is not None:
            return
        # what drafting costs outside the decode steps: the draft's work on prompt positions (adaptive_width.py)
        if proposal.context is not None:
            self.adaptive.observe_context(batch.num_running, *proposal.context)
        decoding = [(n, a) for n, v, a in zip(batch.num_new_tokens, num_verified, num_accepted) if n == 1 + v]
        self.adaptive.count_step(batch.num_running, width, sum(batch.num_new_tokens) - sum(n for n, _ in decoding),
                                 sum(1 + a for _, a in decoding), seconds)
        if proposal.caught_up:
            return
        if set(num_verified) != {width} or any(n != 1 + d for n, d in zip(batch.num_new_tokens, num_verified)):
            return
        self.adaptive.observe(batch.num_running, width, seconds, list(zip(num_verified, num_accepted)))

    def propose(self, batch: ScheduledBatch, layout: VerifyLayout, hidden: torch.Tensor, aux: list[torch.Tensor],
                new_tokens: list[list[int]], num_accepted: list[int], num_computed: list[int],
                width: int) -> Proposal:
        """`num_computed`: per sequence, the target's cached positions after this step's rollback."""
        seqs = batch.seqs
        per_seq = self._kept_states(layout, hidden, aux, num_accepted)
        if width == 0:
            return self._paused(seqs, per_seq, new_tokens, num_computed)

        # step 0 over each sequence's positions num_draft_computed..num_computed - 1
        caught_up = any(s.pending_draft_inputs for s in seqs)
        start = self._clock()
        prenorm, lens = self._step_0(seqs, per_seq, new_tokens, num_computed)
        context = (sum(lens), self._clock() - start)
        last_rows = torch.tensor(lens).cumsum(0) - 1

        drafts: list[list[int]] = [[] for _ in seqs]
        budgets, grammar_steps = self._budgets(seqs, layout, new_tokens, width)
        active = [i for i, k in enumerate(budgets) if k > 0]
        positions = [num_computed[i] - 1 for i in active]  # each active sequence's last step-0 position
        hidden_k = prenorm[last_rows[active]] if active else prenorm[:0]
        tokens_k = self._next_drafts(hidden_k, active, seqs, drafts, budgets)
        # steps 1..: one position per sequence that still wants drafts
        for k in range(1, max(budgets, default=0)):
            keep = [j for j, i in enumerate(active) if budgets[i] > k]
            if not keep:
                break
            active = [active[j] for j in keep]
            positions = [positions[j] + 1 for j in keep]
            attn = AttentionMetadata.build([1] * len(active), [p + 1 for p in positions],
                                           [seqs[i].block_table for i in active], self.block_size, self.device,
                                           lanes=self.lanes, free_padding=self.free_padding)
            hidden_k = self.draft(hidden_k[keep], tokens_k[keep], attn, self.draft_cache)
            tokens_k = self._next_drafts(hidden_k, active, seqs, drafts, budgets)
        self._rollback_grammars(seqs, grammar_steps, drafts)
        return Proposal(drafts, num_computed, [None] * len(seqs), caught_up, context)

    def _clock(self) -> float:
        """perf_counter once the device has run what was queued (the adaptive width times the draft's context
        work); only with an adaptive width, which is the only reader."""
        if self.adaptive is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    @staticmethod
    def _kept_states(layout: VerifyLayout, hidden: torch.Tensor, aux: list[torch.Tensor],
                     num_accepted: list[int]) -> list[torch.Tensor]:
        """Per sequence, the target's states [kept rows, 1 + len(aux), H] at the positions it kept this step: its
        final hidden state, then the aux states, as `_fused` reads them."""
        kept = [layout.kept_rows(i, a) for i, a in enumerate(num_accepted)]
        rows = [r for k in kept for r in k]
        states = torch.stack([hidden, *aux], dim=1)
        if len(rows) < states.shape[0]:  # rejected drafts and prompt rows that sample nothing are not kept
            states = states[rows]
        return list(states.split([len(k) for k in kept])) if len(kept) > 1 else [states]

    def _fused(self, states: torch.Tensor) -> torch.Tensor:
        """The draft's step-0 inputs [rows, H] from target states [rows, 1 + len(aux), H] (`_kept_states`)."""
        return self.draft.combine_hidden_states(states[:, 0], list(states[:, 1:].unbind(1)))

    def _step_0(self, seqs: list[Sequence], per_seq: list[torch.Tensor], new_tokens: list[list[int]],
                num_computed: list[int]) -> tuple[torch.Tensor, list[int]]:
        """One draft forward over each sequence's positions num_draft_computed..num_computed - 1 (its pending
        inputs, then this step's kept rows): pre-norm outputs [rows, H] and each sequence's rows."""
        inputs, next_tokens, lens = [], [], []
        for seq, new, x, end in zip(seqs, new_tokens, per_seq, num_computed):
            inputs.extend(seq.pending_draft_inputs)
            inputs.append(x)
            next_tokens.extend((seq.token_ids + new)[seq.num_draft_computed + 1:end + 1])
            lens.append(end - seq.num_draft_computed)
        attn = AttentionMetadata.build(lens, num_computed, [s.block_table for s in seqs], self.block_size,
                                       self.device, lanes=self.lanes, free_padding=self.free_padding)
        prenorm = self.draft(self._fused(torch.cat(inputs) if len(inputs) > 1 else inputs[0]),
                             torch.tensor(next_tokens, device=self.device), attn, self.draft_cache)
        return prenorm, lens

    def _write_context(self, seqs: list[Sequence], per_seq: list[torch.Tensor], new_tokens: list[list[int]],
                       num_computed: list[int]) -> int:
        """The draft's context up to num_computed for each of `seqs`, proposing nothing; how many positions."""
        return sum(self._step_0(seqs, per_seq, new_tokens, num_computed)[1])

    def _paused(self, seqs: list[Sequence], per_seq: list[torch.Tensor], new_tokens: list[list[int]],
                num_computed: list[int]) -> Proposal:
        """Width 0: no draft work, the target's states kept for when drafting resumes (copies: a view would keep
        every sequence's rows alive; a sequence alone holds a tensor of its own). A sequence that would keep more
        than MAX_PENDING_ROWS positions has them written into the draft's context instead, alone, so the memory a
        pause holds stays bounded and the others stay paused (32 sequences decoding 256 tokens of the eval prompts
        at width 0, where one prompt of 339 tokens passed the bound: 0.91-0.96x plain decoding when every sequence's
        pause went through the draft with it, 0.97-1.03x so)."""
        full = [i for i, (s, end) in enumerate(zip(seqs, num_computed))
                if end - s.num_draft_computed > MAX_PENDING_ROWS]
        context = None
        if full:
            start = self._clock()
            rows = self._write_context(*([xs[i] for i in full] for xs in (seqs, per_seq, new_tokens, num_computed)))
            context = (rows, self._clock() - start)
        written, alone = set(full), len(per_seq) == 1
        return Proposal([[] for _ in seqs],
                        [end if i in written else s.num_draft_computed
                         for i, (s, end) in enumerate(zip(seqs, num_computed))],
                        [None if i in written else x if alone else x.clone() for i, x in enumerate(per_seq)],
                        bool(full), context)

    def _budgets(self, seqs: list[Sequence], layout: VerifyLayout, new_tokens: list[list[int]],
                 width: int) -> tuple[list[int], list[int]]:
        """Each sequence's draft budget (sampling sequences only; see _budget) and, with its grammar advanced over
        the step's new tokens, how many steps that took (for _rollback_grammars)."""
        budgets = [self._budget(seq, len(new), width) if i in layout.sampling else 0
                   for i, (seq, new) in enumerate(zip(seqs, new_tokens))]
        grammar_steps = [seq.grammar.advance(new) if seq.grammar is not None else 0
                         for seq, new in zip(seqs, new_tokens)]
        return budgets, grammar_steps

    @staticmethod
    def _rollback_grammars(seqs: list[Sequence], grammar_steps: list[int], drafts: list[list[int]]) -> None:
        """Back to the committed state: the commit advances each matcher over what it keeps."""
        for seq, steps, d in zip(seqs, grammar_steps, drafts):
            if seq.grammar is not None:
                seq.grammar.rollback(steps + len(d))

    def _budget(self, seq: Sequence, num_new: int, width: int) -> int:
        """Drafts for `seq` once `num_new` tokens are committed: the width, capped by its remaining max_tokens, the
        context length and the slots its blocks hold (the scheduler's lookahead)."""
        length = len(seq) + num_new
        slots = len(seq.block_table) * self.block_size
        return max(0, min(width, seq.params.max_tokens - (seq.num_generated + num_new) - 1,
                          self.max_model_len - length, slots - length))

    def _next_drafts(self, hidden_k: torch.Tensor | None, active: list[int], seqs: list[Sequence],
                     drafts: list[list[int]], budgets: list[int], logits: torch.Tensor | None = None,
                     tokens: torch.Tensor | None = None) -> torch.Tensor:
        """The draft's greedy proposals [len(active)] from its pre-norm outputs, appended to each active sequence's
        drafts. A constrained sequence proposes the argmax over the tokens its grammar allows and its matcher
        accepts it; it stops drafting (its budget is cut) at the grammar's end or when no token is allowed.
        `logits` [len(active), vocab]: the draft's logits at these rows when computed already (a block draft's,
        from one forward), instead of `hidden_k`; `tokens`: its greedy proposals, when no active sequence has a
        grammar."""
        if tokens is None:
            tokens = self.draft.greedy_tokens(hidden_k) if logits is None else logits.argmax(-1)
        constrained = [j for j, i in enumerate(active) if seqs[i].grammar is not None]
        if constrained:
            bitmask = seqs[active[constrained[0]]].grammar.cache.new_bitmask(len(constrained))
            for r, j in enumerate(constrained):
                seqs[active[j]].grammar.fill_mask(bitmask, r)
            rows = self.draft.compute_logits(hidden_k[constrained]) if logits is None else logits[constrained]
            tokens[constrained] = apply_bitmask(rows, bitmask).argmax(-1)
        for i, t in zip(active, tokens.tolist()):
            grammar = seqs[i].grammar
            if grammar is not None and not grammar.accept(t):
                budgets[i] = len(drafts[i])
                continue
            drafts[i].append(t)
            if grammar is not None and grammar.is_terminated:
                budgets[i] = len(drafts[i])
        return tokens
