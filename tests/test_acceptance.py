"""Acceptance rules against exact distributions, with chi-square tests.

Threshold: a rule fails when the chi-square p-value is below 1e-3. Power: with 20,000 draws over 8 outcomes, moving
2% of the mass between two outcomes of probability ~0.12 gives a chi-square noncentrality of about 130, far beyond
the 1e-3 critical value (24.3 for 7 degrees of freedom); the naive rule below (resampling from p instead of the
residual) is caught this way, which shows the test can fail.
"""

import pytest
import torch
from tiny import (
    P_VALUE,
    add_mtp_weights,
    assert_the_first_tokens_follow_the_target,
    chi_square_p_value,
    make_hf_checkpoint,
    rig_bigram_target_and_copying_mtp,
)

from eyas import LLM, SamplingParams
from eyas.config import SpeculativeConfig
from eyas.engine.acceptance import AcceptanceRule, VerifyRows


def first_two_tokens(rule: AcceptanceRule, logprobs: torch.Tensor, drafts: list[int], n: int, seed: int = 0):
    """Run the rule n times on the same rows; return the first and second committed tokens."""
    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=1.0)
    first, second = [], []
    rows = VerifyRows(logprobs=logprobs[None], draft_tokens=torch.tensor([drafts]), num_drafts=[len(drafts)],
                      params=[params], generators=[g], in_thinking=[False])
    for _ in range(n):
        (a,), (x,) = rule(rows)
        committed = drafts[:a] + [x]
        first.append(committed[0])
        if len(committed) > 1:
            second.append(committed[1])
    return torch.tensor(first), torch.tensor(second)


def target_rows(vocab: int = 8, k: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return (torch.randn(k + 1, vocab, generator=g) * 1.2).log_softmax(-1)


@pytest.mark.parametrize("strategy", ["residual", "greedy"])
def test_lossless_rules_keep_the_target_distribution(strategy):
    logprobs = target_rows()
    probs = logprobs.exp()
    drafts = [int(probs[0].argmax()), int(probs[1].argmin())]  # a likely and an unlikely draft
    rule = AcceptanceRule(SpeculativeConfig(method="mtp", rejection_sampling_strategy=strategy))
    first, second = first_two_tokens(rule, logprobs, drafts, 20000)
    assert chi_square_p_value(torch.bincount(first, minlength=8).float(), probs[0]) > P_VALUE
    # the token after an accepted first draft is distributed as the target's next-position distribution
    assert chi_square_p_value(torch.bincount(second, minlength=8).float(), probs[1]) > P_VALUE


class NaiveResidual(AcceptanceRule):
    """Wrong on purpose: on rejection it resamples from p instead of the residual max(0, p - q)."""

    def _residual_row(self, logprobs, drafts, params, generator):
        for j, d in enumerate(drafts):
            if torch.rand((), generator=generator) < logprobs[j, d].exp():
                continue
            noise = torch.empty(logprobs.shape[-1]).exponential_(generator=generator)
            return j, int((logprobs[j] - noise.log()).argmax())
        return len(drafts), int(logprobs[len(drafts)].argmax())


def test_the_chi_square_test_catches_a_wrong_rule():
    logprobs = target_rows()
    probs = logprobs.exp()
    rule = NaiveResidual(SpeculativeConfig(method="mtp"))
    first, _ = first_two_tokens(rule, logprobs, [int(probs[0].argmax()), 0], 20000)
    assert chi_square_p_value(torch.bincount(first, minlength=8).float(), probs[0]) < P_VALUE


def test_typical_acceptance_is_lossy():
    logprobs = target_rows()
    probs = logprobs.exp()
    rule = AcceptanceRule(SpeculativeConfig(method="mtp", rejection_sampling_strategy="typical"))
    first, _ = first_two_tokens(rule, logprobs, [int(probs[0].argsort()[-2]), 0], 20000)
    assert chi_square_p_value(torch.bincount(first, minlength=8).float(), probs[0]) < P_VALUE


def test_relaxed_acceptance_only_inside_thinking():
    logprobs = torch.tensor([[0.0, -0.3, -5.0, -9.0]] * 2).log_softmax(-1)
    config = SpeculativeConfig(method="mtp", rejection_sampling_strategy="greedy", relaxed_thinking=True,
                               relaxed_thinking_topk=2, relaxed_thinking_delta=0.6)
    rule = AcceptanceRule(config)
    greedy = SamplingParams(temperature=0)

    def accepted(draft, thinking):
        rows = VerifyRows(logprobs=logprobs[None], draft_tokens=torch.tensor([[draft]]), num_drafts=[1],
                          params=[greedy], generators=[None], in_thinking=[thinking])
        return rule(rows)[0][0]

    assert accepted(1, thinking=True) == 1  # second best, within delta of the best
    assert accepted(1, thinking=False) == 0  # outside <think>: plain greedy
    assert accepted(2, thinking=True) == 0  # too far below the best


def test_synthetic_acceptance_rate():
    logprobs = target_rows(k=3)
    rule = AcceptanceRule(SpeculativeConfig(method="mtp", synthetic_acceptance_rate=0.8))
    rows = VerifyRows(logprobs=logprobs[None], draft_tokens=torch.tensor([[0, 0, 0]]), num_drafts=[3],
                      params=[SamplingParams(temperature=0)], generators=[None], in_thinking=[False])
    mean = sum(rule(rows)[0][0] for _ in range(4000)) / 4000
    assert abs(mean - (0.8 + 0.64 + 0.512)) < 0.05  # expected accepted drafts per verify step, K = 3


def test_greedy_requests_under_synthetic_acceptance_take_the_greedy_path_with_the_same_draws(tmp_path, monkeypatch):
    """Greedy requests under the synthetic rule take the verifier's greedy path, the one a greedy run takes (so the
    rule times the step a real run pays), and keep the drafts and commit the tokens that the general path, which a
    request for logprobs takes, gives them from the same draws."""
    from eyas.engine import verifier

    make_hf_checkpoint(tmp_path)
    add_mtp_weights(tmp_path)
    general = verifier.Verifier._verify_rows
    calls = []
    monkeypatch.setattr(verifier.Verifier, "_verify_rows", lambda self, *a: calls.append(1) or general(self, *a))
    outs = {}
    for logprobs in (None, 1):
        config = SpeculativeConfig(method="mtp", num_speculative_tokens=3, adaptive_width=False,
                                   synthetic_acceptance_rate=0.6)
        llm = LLM(tmp_path, speculative_config=config)
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=logprobs)
        outs[logprobs] = [(o.token_ids, o.num_accepted, o.num_drafted)
                          for o in llm.generate([[3, 9, 4], [5, 6, 7, 8]], params, use_tqdm=False)]
        assert bool(calls) == (logprobs is not None)
    assert outs[None] == outs[1]
    assert 0 < sum(a for _, a, _ in outs[None]) < sum(d for _, _, d in outs[None])


# -- through the engine ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("checkpoint", ["random", "copying"])
def test_residual_sampling_through_the_engine_keeps_the_distribution(tmp_path, checkpoint):
    vocab = 16
    make_hf_checkpoint(tmp_path, vocab_size=vocab)
    add_mtp_weights(tmp_path)
    if checkpoint == "copying":
        rig_bigram_target_and_copying_mtp(tmp_path)
    prompt = [3, 9, 4]
    torch.manual_seed(11)
    llm = LLM(tmp_path, max_num_seqs=512, speculative_method="mtp", num_speculative_tokens=2)
    outs = assert_the_first_tokens_follow_the_target(llm, prompt, vocab)
    accepted = sum(o.num_accepted for o in outs) / sum(o.num_drafted for o in outs)
    # measured 0.22 and 0.02: the copying draft proposes the target's mode, accepted with probability p(mode)
    assert accepted > 0.15 if checkpoint == "copying" else accepted < 0.1


def test_logit_comparison_is_greedy_exact_and_lossy_when_sampling():
    """MAX's logit-comparison: drafts kept while they are the target's top token. For greedy requests it commits what
    the greedy rule commits; sampled, it only ever keeps the mode, so its first token is not distributed as p."""
    logprobs = target_rows()
    probs = logprobs.exp()
    comparison = AcceptanceRule(SpeculativeConfig(method="mtp", rejection_sampling_strategy="logit-comparison"))
    greedy_rule = AcceptanceRule(SpeculativeConfig(method="mtp", rejection_sampling_strategy="greedy"))
    top = [int(logprobs[j].argmax()) for j in range(logprobs.shape[0])]
    for drafts in ([top[0], top[1]], [top[0], (top[1] + 1) % 8], [(top[0] + 1) % 8, top[1]]):
        rows = VerifyRows(logprobs=logprobs[None], draft_tokens=torch.tensor([drafts]), num_drafts=[2],
                          params=[SamplingParams(temperature=0)], generators=[None], in_thinking=[False])
        assert comparison(rows) == greedy_rule(rows), drafts
    first, _ = first_two_tokens(comparison, logprobs, [top[0], top[1]], 20000)
    assert chi_square_p_value(torch.bincount(first, minlength=8).float(), probs[0]) < P_VALUE
    assert SpeculativeConfig(method="mtp", rejection_sampling_strategy="typical-acceptance").lossless is False
