"""Acceptance rules: given the target's processed distributions at the K+1 verify positions of a row and the K
draft tokens, how many drafts to keep and which token to add after them.

Every rule returns, per row, `num_accepted` in 0..num_drafts and one extra token: the correction at the first
rejection, or the bonus token when every draft was accepted. So a verify step commits 1..K+1 tokens.

Drafts are proposed greedily (argmax), so the draft distribution q is one-hot at the draft token d. Then
- greedy:   accept d while it equals the target's own choice (argmax for greedy requests, a sample from p
            otherwise). Lossless: every committed token is the target's choice given its prefix.
- residual: accept d with probability min(1, p(d) / q(d)) = p(d); on rejection draw from
            normalize(max(0, p - q)) = p with d removed. Lossless (Leviathan et al.), and accepts more than greedy
            for sampled requests; for greedy requests it is exactly the greedy rule.
- typical (typical-acceptance):  accept d when p(d) > min(epsilon, alpha * exp(-H(p))) (Medusa). Lossy: output is
            not p's.
- logit-comparison:  accept d while it is the target's top token (the draft's and the target's top tokens agree);
            the token after is the target's choice. Exact for greedy requests, lossy for sampled ones (it keeps
            only drafts that are the target's mode).
- relaxed (inside <think>...</think> only): accept d when it is among the target's top-k and
            log p(d) >= log p(top1) - delta. Lossy.
- synthetic: accept each position with a fixed probability, for measuring engine overhead. Lossy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eyas.config import SpeculativeConfig
from eyas.sampling_params import SamplingParams

TYPICAL_EPSILON = 0.3
TYPICAL_ALPHA = 0.09


@dataclass(slots=True)
class VerifyRows:
    """One batch of verify rows. logprobs: [rows, K+1, vocab] processed target log-probabilities;
    draft_tokens: [rows, K] (padded past num_drafts[r])."""

    logprobs: torch.Tensor
    draft_tokens: torch.Tensor
    num_drafts: list[int]
    params: list[SamplingParams]
    generators: list[torch.Generator | None]
    in_thinking: list[bool]


def _sample(logprobs: torch.Tensor, generator: torch.Generator | None) -> int:
    noise = torch.empty(logprobs.shape[-1]).exponential_(generator=generator)
    return int((logprobs - noise.to(logprobs.device).log()).argmax())


def _uniform(generator: torch.Generator | None) -> float:
    return float(torch.rand((), generator=generator))


def _target_choice(logprobs: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    return int(logprobs.argmax()) if params.greedy else _sample(logprobs, generator)


class AcceptanceRule:
    """Chosen once from the SpeculativeConfig; `__call__` applies it to every row of a verify batch."""

    def __init__(self, config: SpeculativeConfig, seed: int = 0) -> None:
        self.strategy = config.rejection_sampling_strategy
        self.synthetic_rate = config.synthetic_acceptance_rate
        self.relaxed = config.relaxed_thinking
        self.relaxed_topk = config.relaxed_thinking_topk
        self.relaxed_delta = config.relaxed_thinking_delta
        self.generator = torch.Generator().manual_seed(seed)  # for synthetic acceptance only
        self.row_rule = {"greedy": self._greedy_row, "residual": self._residual_row, "typical": self._typical_row,
                         "typical-acceptance": self._typical_row,
                         "logit-comparison": self._logit_comparison_row}[self.strategy]

    def __call__(self, rows: VerifyRows) -> tuple[list[int], list[int]]:
        num_accepted, extra = [], []
        for r in range(len(rows.num_drafts)):
            logprobs = rows.logprobs[r].float()  # [K+1, vocab]
            drafts = rows.draft_tokens[r, :rows.num_drafts[r]].tolist()
            params, generator = rows.params[r], rows.generators[r]
            if self.synthetic_rate is not None:
                a, x = self._synthetic_row(logprobs, drafts, params, generator)
            elif self.relaxed and rows.in_thinking[r]:
                a, x = self._relaxed_row(logprobs, drafts, params, generator)
            else:
                a, x = self.row_rule(logprobs, drafts, params, generator)
            num_accepted.append(a)
            extra.append(x)
        return num_accepted, extra

    def _greedy_row(self, logprobs, drafts, params, generator) -> tuple[int, int]:
        for j, d in enumerate(drafts):
            choice = _target_choice(logprobs[j], params, generator)
            if choice != d:
                return j, choice
        return len(drafts), _target_choice(logprobs[len(drafts)], params, generator)

    def _residual_row(self, logprobs, drafts, params, generator) -> tuple[int, int]:
        if params.greedy:
            return self._greedy_row(logprobs, drafts, params, generator)
        for j, d in enumerate(drafts):
            if _uniform(generator) < logprobs[j, d].exp().item():
                continue
            residual = logprobs[j].clone()
            residual[d] = float("-inf")  # p - onehot(d), clipped at 0 and renormalised by the sampler
            return j, _sample(residual, generator)
        return len(drafts), _sample(logprobs[len(drafts)], generator)

    def _typical_row(self, logprobs, drafts, params, generator) -> tuple[int, int]:
        if params.greedy:
            return self._greedy_row(logprobs, drafts, params, generator)
        for j, d in enumerate(drafts):
            probs = logprobs[j].exp()
            entropy = -(probs * logprobs[j].clamp(min=-1e9)).sum().item()
            threshold = min(TYPICAL_EPSILON, TYPICAL_ALPHA * torch.exp(torch.tensor(-entropy)).item())
            if probs[d].item() <= threshold:
                return j, _sample(logprobs[j], generator)
        return len(drafts), _sample(logprobs[len(drafts)], generator)

    def _logit_comparison_row(self, logprobs, drafts, params, generator) -> tuple[int, int]:
        for j, d in enumerate(drafts):
            if int(logprobs[j].argmax()) != d:
                return j, _target_choice(logprobs[j], params, generator)
        return len(drafts), _target_choice(logprobs[len(drafts)], params, generator)

    def _relaxed_row(self, logprobs, drafts, params, generator) -> tuple[int, int]:
        for j, d in enumerate(drafts):
            top = logprobs[j].topk(self.relaxed_topk)
            ok = (top.indices == d) & (top.values >= top.values[0] - self.relaxed_delta)
            if not bool(ok.any()):
                return j, _target_choice(logprobs[j], params, generator)
        return len(drafts), _target_choice(logprobs[len(drafts)], params, generator)

    def _synthetic_row(self, logprobs, drafts, params, generator) -> tuple[int, int]:
        accepted = self.synthetic_accepted(len(drafts))
        return accepted, _target_choice(logprobs[accepted], params, generator)

    def synthetic_accepted(self, num_drafts: int) -> int:
        """How many of a row's drafts the synthetic rule keeps: each in turn with probability synthetic_rate."""
        for j in range(num_drafts):
            if _uniform(self.generator) >= self.synthetic_rate:
                return j
        return num_drafts
