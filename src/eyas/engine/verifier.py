"""The verify half of a step: from the target's hidden states at each sampling sequence's verify rows to the tokens
it commits, in phase order: logits -> grammar mask -> sampling processing -> acceptance rule -> committed tokens.

Row j of a sequence's verify rows predicts the token after its j-th draft (row 0: after its committed token), so
a sequence with no drafts is plain decoding: one row, one sampled token. Structured output: row j's mask is the
grammar's after drafts d1..dj; a draft the grammar rejects ends the usable drafts (it could not be accepted). The
greedy rule stays exact: each committed token is the argmax of the masked target row, as in plain decoding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eyas.config import SpeculativeConfig
from eyas.engine.acceptance import AcceptanceRule, VerifyRows
from eyas.engine.batch import VerifyLayout
from eyas.engine.grammar import apply_bitmask
from eyas.engine.sampling import TokenLogprobs, greedy_ids, process_logits, sample, token_logprobs
from eyas.engine.sequence import Sequence
from eyas.models.deepseek_v3 import DeepseekV3ForCausalLM


@dataclass(slots=True)
class Verified:
    """Per sequence of the batch (empty, 0 and None for those that do not sample this step)."""

    new_tokens: list[list[int]]  # the accepted drafts, then the correction or bonus token
    num_accepted: list[int]
    logprobs: list[list[TokenLogprobs] | None]


class Verifier:
    def __init__(self, target: DeepseekV3ForCausalLM, config: SpeculativeConfig | None,
                 think_token_ids: tuple[int, int] | None = None) -> None:
        self.target = target
        self.accept = AcceptanceRule(config) if config is not None else None
        self.relaxed_thinking = config is not None and config.relaxed_thinking and think_token_ids is not None
        self.think_token_ids = think_token_ids

    def __call__(self, seqs: list[Sequence], hidden: torch.Tensor, layout: VerifyLayout) -> Verified:
        out = Verified([[] for _ in seqs], [0] * len(seqs), [None] * len(seqs))
        if not layout.sampling:
            return out
        sampling = [seqs[i] for i in layout.sampling]
        num_drafts = [layout.num_drafts[i] for i in layout.sampling]
        # logits of every verify row, sampling sequence by sampling sequence
        logits = self.target.compute_logits(hidden[layout.verify_rows()])
        if self._plain_greedy(sampling):
            self._greedy(logits, layout, sampling, num_drafts, out)
            return out
        # grammar mask, then temperature and top-k/p/min-p per row
        masked, usable = self._grammar_mask(logits, sampling, num_drafts, layout.logit_offsets)
        row_params = [s.params for s, n in zip(sampling, num_drafts) for _ in range(n + 1)]
        processed = process_logits(masked, row_params)
        # acceptance: how many drafts each sequence keeps, and the token after them
        if not any(num_drafts):
            num_accepted = [0] * len(sampling)
            extra = sample(processed, row_params, [s.generator for s in sampling]).tolist()
        else:
            num_accepted, extra = self.accept(self._verify_rows(processed, sampling, num_drafts, usable,
                                                                layout.logit_offsets))
        for r, (i, seq) in enumerate(zip(layout.sampling, sampling)):
            tokens = seq.draft_tokens[:num_accepted[r]] + [extra[r]]
            out.new_tokens[i], out.num_accepted[i] = tokens, num_accepted[r]
            if seq.params.logprobs is not None:  # committed token j was predicted by verify row j
                first = layout.logit_offsets[r]
                out.logprobs[i] = token_logprobs(logits[first:first + len(tokens)], tokens,
                                                 [seq.params.logprobs] * len(tokens))
        return out

    def _plain_greedy(self, seqs: list[Sequence]) -> bool:
        """Every sequence greedy, unconstrained, without logprobs, under a rule that keeps a greedy row's drafts
        while they are its argmax (every rule but the relaxed-thinking one) or the synthetic rule (which keeps them
        by chance, then takes the argmax after them)."""
        return (all(s.params.greedy and s.grammar is None and s.params.logprobs is None for s in seqs)
                and not self.relaxed_thinking)

    def _greedy(self, logits: torch.Tensor, layout: VerifyLayout, seqs: list[Sequence], num_drafts: list[int],
                out: Verified) -> None:
        """The greedy rule on all rows at once: the same choices as the general path (process_logits gives a
        greedy row log_softmax(logits / 1.0), and every rule takes its argmax) without its per-row tensors, which
        at batch 1 cost more than the target's lm_head. The synthetic rule draws how many drafts to keep as the
        general path does (so it times the step a greedy run takes, not the general path's)."""
        choices = greedy_ids(logits.float().log_softmax(-1)).tolist()
        synthetic = self.accept is not None and self.accept.synthetic_rate is not None
        for r, (i, seq, n) in enumerate(zip(layout.sampling, seqs, num_drafts)):
            rows = choices[layout.logit_offsets[r]:layout.logit_offsets[r] + n + 1]
            if synthetic:
                accepted = self.accept.synthetic_accepted(n)
            else:
                accepted = 0
                while accepted < n and seq.draft_tokens[accepted] == rows[accepted]:
                    accepted += 1
            out.new_tokens[i] = seq.draft_tokens[:accepted] + [rows[accepted]]
            out.num_accepted[i] = accepted

    def _verify_rows(self, processed: torch.Tensor, seqs: list[Sequence], num_drafts: list[int], usable: list[int],
                     offsets: list[int]) -> VerifyRows:
        k_max = max(num_drafts)
        logprobs = processed.new_full((len(seqs), k_max + 1, processed.shape[-1]), float("-inf"))
        draft_tokens = torch.zeros(len(seqs), k_max, dtype=torch.long)
        for r, (seq, n) in enumerate(zip(seqs, usable)):  # n: the drafts the grammar allows (all when unconstrained)
            logprobs[r, :n + 1] = processed[offsets[r]:offsets[r] + n + 1]
            draft_tokens[r, :n] = torch.tensor(seq.draft_tokens[:n], dtype=torch.long)
        return VerifyRows(logprobs=logprobs, draft_tokens=draft_tokens, num_drafts=usable,
                          params=[s.params for s in seqs], generators=[s.generator for s in seqs],
                          in_thinking=[self._in_thinking(s) for s in seqs])

    def _grammar_mask(self, logits: torch.Tensor, seqs: list[Sequence], num_drafts: list[int],
                      offsets: list[int]) -> tuple[torch.Tensor, list[int]]:
        """Mask each constrained sequence's num_drafts + 1 verify rows of `logits` (starting at its offset); return
        the masked logits and, per sequence, the usable drafts (those before the first the grammar rejects)."""
        usable = list(num_drafts)
        constrained = [r for r, s in enumerate(seqs) if s.grammar is not None]
        if not constrained:
            return logits, usable
        bitmask = seqs[constrained[0]].grammar.cache.new_bitmask(logits.shape[0])  # all allowed
        for r in constrained:
            usable[r] = seqs[r].grammar.verify_masks(seqs[r].draft_tokens, bitmask, offsets[r])
        return apply_bitmask(logits, bitmask), usable

    def _in_thinking(self, seq: Sequence) -> bool:
        if not self.relaxed_thinking:
            return False
        start, end = self.think_token_ids
        for t in reversed(seq.token_ids):
            if t == end:
                return False
            if t == start:
                return True
        return False
