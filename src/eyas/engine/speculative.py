"""One speculative iteration over a scheduled batch, as its phases in order (chain drafting, K drafts):

  1. merge     each sequence's input = its uncomputed committed token(s) + the K drafts proposed last step
               (prefill rows: a prompt chunk, no drafts)
  2. verify    one target forward over the ragged batch -> hidden states and the draft's aux hidden states
  3. mask      per-row sampling processing of the target logits at the K+1 verify positions; a constrained
               sequence first gets its grammar mask on each row (row j assumes drafts d1..dj were accepted)
  4. accept    the acceptance rule -> num_accepted in 0..K and one extra token (correction or bonus)
  5. rollback  the target KV of rejected drafts is dropped: num_computed stops after the last accepted draft
  6. propose   draft step 0 over every position whose next token is now known, with the target's fused aux
               hidden states; steps 1..K-1 one token at a time on the draft's own pre-norm output
  7. pack      committed tokens out, next drafts stored on the sequence, metrics

Worked example, one decode row, K = 3: committed [.. t9] with t9 at position 9 not yet computed, drafts
[d10, d11, d12]. Verify computes positions 9..12; logits row j predicts position 10 + j. Say d10 is accepted and
d11 rejected: num_accepted = 1, extra = the target's token x11. Commit [d10, x11]; target KV is kept for positions
9..10 (t9, d10), so num_computed = 11 and x11 (position 11) is computed next step. Draft step 0 runs on pairs
(h9, d10) and (h10, x11) at positions 9 and 10; its last output proposes d12' for position 12; steps 1 and 2 run
at positions 11 and 12 and propose d13', d14'.

Structured output, same row: the matcher has accepted the committed tokens up to t9. Row j's mask is filled after
advancing it through d10..d(9+j); had the grammar rejected d11, rows 2 and 3 would get no mask and the acceptance
rule would see 1 usable draft (d11 cannot be accepted anyway). The matcher is rolled back to t9 and advanced by
the committed [d10, x11]. Proposals are masked too: the matcher advances over d12', d13' while they are drafted
and is rolled back to x11 afterwards, so every draft is grammatical. The greedy rule stays exact: each committed
token is the argmax of the masked target row, as in plain decoding.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from eyas.config import SpeculativeConfig
from eyas.engine.acceptance import AcceptanceRule, VerifyRows
from eyas.engine.adaptive_width import AdaptiveWidth
from eyas.engine.grammar import apply_bitmask
from eyas.engine.kv_cache import BlockAllocator
from eyas.engine.model_runner import ModelRunner
from eyas.engine.sampling import TokenLogprobs, process_logits, token_logprobs
from eyas.engine.scheduler import ScheduledBatch
from eyas.engine.sequence import Sequence


@dataclass(slots=True)
class SpeculativeMetrics:
    """Totals over every verify step (the counters vLLM exposes)."""

    num_verify_steps: int = 0
    num_drafted: int = 0
    num_accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    @property
    def acceptance_length(self) -> float:
        return 1.0 + self.num_accepted / self.num_verify_steps if self.num_verify_steps else 1.0

    def as_dict(self) -> dict:
        steps = self.num_verify_steps
        return {"num_verify_steps": steps, "num_drafted": self.num_drafted, "num_accepted": self.num_accepted,
                "acceptance_length": round(self.acceptance_length, 4),
                "accepted_per_position": [round(a / steps, 4) for a in self.accepted_per_position] if steps else []}


class SpeculativeDecoder:
    def __init__(self, runner: ModelRunner, draft: nn.Module, config: SpeculativeConfig, allocator: BlockAllocator,
                 max_model_len: int, think_token_ids: tuple[int, int] | None = None) -> None:
        self.runner = runner
        self.target = runner.model
        self.draft = draft
        self.config = config
        self.allocator = allocator
        self.max_model_len = max_model_len
        self.think_token_ids = think_token_ids
        self.accept = AcceptanceRule(config)
        self.metrics = SpeculativeMetrics()
        self.adaptive = AdaptiveWidth(config.num_speculative_tokens) if config.adaptive_width else None
        self.verified: list[tuple[int, int]] = []  # this step's (drafts verified, drafts accepted) per sequence
        num_slots = runner.num_blocks * runner.block_size
        # the draft's one-layer cache, addressed through the same block tables as the target's
        self.draft_cache = torch.zeros(num_slots, *draft.cache_entry_shape(), dtype=runner.dtype,
                                       device=runner.device)

    @torch.inference_mode()
    def step(self, batch: ScheduledBatch, num_running: int,
             prefill_next: bool = False) -> tuple[list[list[int]], list[list[TokenLogprobs] | None]]:
        """Run one iteration; return the tokens each sequence commits (empty while its prompt is prefilling) and,
        for sequences that asked for them, their log-probabilities (None otherwise). `prefill_next`: the next step
        will prefill prompts too (num_speculative_tokens_mixed_batch caps the drafts proposed for it)."""
        seqs = batch.seqs
        self.verified = []
        # 1-2. merge and verify
        hidden, aux, query_lens = self.runner.forward(batch, self.draft.aux_hidden_state_ids)
        starts = [0]
        for n in query_lens[:-1]:
            starts.append(starts[-1] + n)
        num_drafts = [len(s.draft_tokens) for s in seqs]
        caught_up = [s.num_computed + n - nd == len(s) for s, n, nd in zip(seqs, query_lens, num_drafts)]

        # 3. mask: target log-probs at the last num_drafts + 1 rows of every sequence that samples
        sampling = [i for i, ok in enumerate(caught_up) if ok]
        new_tokens: list[list[int]] = [[] for _ in seqs]
        new_logprobs: list[list[TokenLogprobs] | None] = [None for _ in seqs]
        num_accepted = [0] * len(seqs)
        if sampling:
            k_max = max(num_drafts[i] for i in sampling)
            rows = [starts[i] + query_lens[i] - num_drafts[i] - 1 + j for i in sampling
                    for j in range(num_drafts[i] + 1)]
            row_params = [seqs[i].params for i in sampling for _ in range(num_drafts[i] + 1)]
            logits = self.target.compute_logits(hidden[rows])  # [sum of (num_drafts + 1), vocab]
            masked, usable = self._grammar_mask(logits, [seqs[i] for i in sampling], [num_drafts[i] for i in sampling])
            flat = process_logits(masked, row_params)
            logprobs = flat.new_full((len(sampling), k_max + 1, flat.shape[-1]), float("-inf"))
            draft_tokens = torch.zeros(len(sampling), max(k_max, 1), dtype=torch.long)
            offset = 0
            for r, i in enumerate(sampling):
                n = usable[r]  # the drafts the grammar allows (all of them when unconstrained)
                logprobs[r, :n + 1] = flat[offset:offset + n + 1]
                draft_tokens[r, :n] = torch.tensor(seqs[i].draft_tokens[:n], dtype=torch.long)
                offset += num_drafts[i] + 1
                # 4. accept
            accepted, extra = self.accept(VerifyRows(
                logprobs=logprobs, draft_tokens=draft_tokens, num_drafts=usable,
                params=[seqs[i].params for i in sampling], generators=[seqs[i].generator for i in sampling],
                in_thinking=[self._in_thinking(seqs[i]) for i in sampling]))
            first_row = 0
            self.verified = [(num_drafts[i], accepted[r]) for r, i in enumerate(sampling)]
            for r, i in enumerate(sampling):
                num_accepted[i] = accepted[r]
                new_tokens[i] = seqs[i].draft_tokens[:accepted[r]] + [extra[r]]
                if seqs[i].grammar is not None:
                    seqs[i].grammar.advance(new_tokens[i])
                self._record(seqs[i], num_drafts[i], accepted[r])
                if seqs[i].params.logprobs is not None:  # committed token j was predicted by verify row j
                    n = len(new_tokens[i])
                    new_logprobs[i] = token_logprobs(logits[first_row:first_row + n], new_tokens[i],
                                                     [seqs[i].params.logprobs] * n)
                first_row += num_drafts[i] + 1

        # 5. rollback: keep the target KV of committed tokens and accepted drafts only
        step0_rows, step0_next, step0_lens = [], [], []
        for i, (seq, n) in enumerate(zip(seqs, query_lens)):
            first = seq.num_computed
            kept = n - num_drafts[i] + num_accepted[i]
            seq.num_computed = first + kept
            seq.draft_tokens = []
            tokens = seq.token_ids + new_tokens[i]
            self.allocator.shrink(seq.block_table, max(len(tokens), seq.num_computed))
            # rows for draft step 0: every kept position p, paired with token p + 1
            step0_rows.extend(range(starts[i], starts[i] + kept))
            step0_next.extend(tokens[first + 1:first + kept + 1])
            step0_lens.append(kept)

        # 6. propose
        self._propose(seqs, hidden, aux, step0_rows, step0_next, step0_lens, new_tokens, caught_up, num_running,
                      prefill_next)
        return new_tokens, new_logprobs

    def _propose(self, seqs: list[Sequence], hidden, aux, rows, next_tokens, lens, new_tokens, caught_up,
                 num_running: int, prefill_next: bool) -> None:
        k_target = self.width_for(num_running)
        if prefill_next and self.config.num_speculative_tokens_mixed_batch is not None:
            k_target = min(k_target, self.config.num_speculative_tokens_mixed_batch)
        if k_target == 0 and self.adaptive is None:  # drafting is off at this batch size: no draft work at all
            self.skip_drafting(seqs)
            return
        device = self.runner.device
        draft_in = self.draft.combine_hidden_states(hidden[rows], [a[rows] for a in aux])
        attn = self.runner.metadata(lens, [s.num_computed for s in seqs], [s.block_table for s in seqs],
                                    [s.draft_context_start for s in seqs])
        prenorm = self.draft(draft_in, torch.tensor(next_tokens, device=device), attn, self.draft_cache)
        if k_target == 0:  # the adaptive width is 0 for now: step 0 still fills the draft's cache, so that drafting
            return         # resumes with its whole context (a blind draft would accept less for the rest of the run)
        last_rows = torch.tensor(lens).cumsum(0) - 1
        # how many drafts each sequence gets: K, capped by its remaining budget, the context and free blocks
        budgets = []
        for seq, new, ok in zip(seqs, new_tokens, caught_up):
            length = len(seq) + len(new)
            k = min(k_target, seq.params.max_tokens - (seq.num_generated + len(new)) - 1,
                    self.max_model_len - length) if ok else 0
            while k > 0 and not self.allocator.can_grow(seq.block_table, length + k):
                k -= 1
            if k > 0:
                self.allocator.grow(seq.block_table, length + k)
            budgets.append(max(k, 0))
        active = [i for i, k in enumerate(budgets) if k > 0]
        if not active:
            return
        hidden_k = prenorm[last_rows[active]]
        tokens_k = self._append_drafts(hidden_k, active, seqs, budgets)
        positions = [seqs[i].num_computed - 1 for i in active]  # position of each active sequence's last step-0 row
        for k in range(1, max(budgets)):
            keep = [j for j, i in enumerate(active) if budgets[i] > k]
            if not keep:
                break
            active = [active[j] for j in keep]
            positions = [positions[j] + 1 for j in keep]
            attn = self.runner.metadata([1] * len(active), [p + 1 for p in positions],
                                        [seqs[i].block_table for i in active],
                                        [seqs[i].draft_context_start for i in active])
            hidden_k = self.draft(hidden_k[keep], tokens_k[keep], attn, self.draft_cache)
            tokens_k = self._append_drafts(hidden_k, active, seqs, budgets)
        for seq in seqs:  # back to the committed state: drafts are verified next step
            if seq.grammar is not None:
                seq.grammar.rollback(len(seq.draft_tokens))

    def is_plain_step(self, batch: ScheduledBatch, num_running: int) -> bool:
        """Drafting is off at this batch size (a fixed width of 0: the adaptive one keeps the draft's cache filled)
        and no sequence has drafts to verify: the step is a plain decoding step, and the engine runs it as one (then
        calls skip_drafting)."""
        return (self.adaptive is None or self.config.width_override(num_running) is not None) and \
            self.width_for(num_running) == 0 and not any(s.draft_tokens for s in batch.seqs)

    def width_for(self, num_running: int) -> int:
        """The drafts to propose for the next step: a configured override for this batch size, else the adaptive
        width, else K."""
        override = self.config.width_override(num_running)
        if override is not None or self.adaptive is None:
            return self.config.num_speculative_tokens if override is None else override
        return self.adaptive.width(num_running)

    def observe(self, batch: ScheduledBatch, num_running: int, seconds: float) -> None:
        """A step took `seconds`: the adaptive width learns from it when every sequence decoded at one width (each
        computed its committed token and its drafts; a step with prompt chunks costs what its prompts cost)."""
        verified, self.verified = self.verified, []
        if self.adaptive is None or self.config.width_override(num_running) is not None:
            return
        drafted = [d for d, _ in verified] if verified else [0] * len(batch.seqs)  # none verified: a plain step
        if len(drafted) != len(batch.seqs) or len(set(drafted)) != 1 or \
                any(n != 1 + d for n, d in zip(batch.num_new_tokens, drafted)):
            return
        self.adaptive.observe(num_running, drafted[0], seconds, verified)

    def skip_drafting(self, seqs: list[Sequence]) -> None:
        """After a step without draft work: the draft's cache misses the positions the target computed; it attends
        only after them when drafting resumes."""
        for seq in seqs:
            seq.draft_context_start = seq.num_computed

    def _grammar_mask(self, logits: torch.Tensor, seqs: list[Sequence],
                      num_drafts: list[int]) -> tuple[torch.Tensor, list[int]]:
        """Mask each constrained sequence's num_drafts + 1 consecutive verify rows of `logits` [rows, vocab]; return
        the masked logits and, per sequence, the usable drafts (those before the first the grammar rejects)."""
        usable = list(num_drafts)
        constrained = [r for r, s in enumerate(seqs) if s.grammar is not None]
        if not constrained:
            return logits, usable
        first_rows = [0]
        for n in num_drafts[:-1]:
            first_rows.append(first_rows[-1] + n + 1)
        bitmask = seqs[constrained[0]].grammar.cache.new_bitmask(logits.shape[0])  # all allowed
        for r in constrained:
            usable[r] = seqs[r].grammar.verify_masks(seqs[r].draft_tokens, bitmask, first_rows[r])
        return apply_bitmask(logits, bitmask), usable

    def _append_drafts(self, hidden_k: torch.Tensor, active: list[int], seqs: list[Sequence],
                       budgets: list[int]) -> torch.Tensor:
        """The draft's greedy proposals [len(active)] from its pre-norm outputs hidden_k, appended to each active
        sequence's drafts. A constrained sequence proposes the argmax over the tokens its grammar allows and its
        matcher accepts the proposal (rolled back when proposing ends); it stops drafting (its budget is cut) at
        the grammar's end or when the draft has no allowed token."""
        tokens = self.draft.greedy_tokens(hidden_k)
        constrained = [j for j, i in enumerate(active) if seqs[i].grammar is not None]
        if constrained:
            bitmask = seqs[active[constrained[0]]].grammar.cache.new_bitmask(len(constrained))
            for r, j in enumerate(constrained):
                seqs[active[j]].grammar.fill_mask(bitmask, r)
            logits = apply_bitmask(self.draft.compute_logits(hidden_k[constrained]), bitmask)
            tokens[constrained] = logits.argmax(-1)
        for i, t in zip(active, tokens.tolist()):
            seq = seqs[i]
            if seq.grammar is not None and not seq.grammar.accept(t):
                budgets[i] = len(seq.draft_tokens)
                continue
            seq.draft_tokens.append(t)
            if seq.grammar is not None and seq.grammar.is_terminated:
                budgets[i] = len(seq.draft_tokens)
        return tokens

    def _record(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        if num_drafts == 0:
            return
        for counts in (seq, self.metrics):
            counts.num_verify_steps += 1
            counts.num_drafted += num_drafts
            counts.num_accepted += num_accepted
            while len(counts.accepted_per_position) < num_drafts:
                counts.accepted_per_position.append(0)
            for j in range(num_accepted):
                counts.accepted_per_position[j] += 1

    def _in_thinking(self, seq: Sequence) -> bool:
        if not self.config.relaxed_thinking or self.think_token_ids is None:
            return False
        start, end = self.think_token_ids
        for t in reversed(seq.token_ids):
            if t == end:
                return False
            if t == start:
                return True
        return False
