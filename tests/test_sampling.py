"""Logit processing and the sampler against exact expectations."""

import torch

from eyas.engine.sampling import process_logits, sample
from eyas.sampling_params import SamplingParams


def kept(logits, **kw):
    return torch.isfinite(process_logits(logits[None], [SamplingParams(**kw)])[0]).nonzero().flatten().tolist()


def test_top_k_top_p_min_p():
    logits = torch.tensor([3.0, 1.0, 2.0, 0.0, -1.0]).log_softmax(-1)  # probs ~ .63 .09 .23 .03 .01
    assert kept(logits, top_k=2) == [0, 2]
    assert kept(logits, top_p=0.5) == [0]  # the top token alone already reaches 0.5
    assert kept(logits, top_p=0.8) == [0, 2]
    assert kept(logits, top_p=0.9) == [0, 1, 2]
    assert kept(logits, min_p=0.1) == [0, 1, 2]  # keeps p >= 0.1 * 0.63
    assert kept(logits, top_k=3, top_p=0.8, min_p=0.2) == [0, 2]


def test_temperature_and_renormalisation():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    out = process_logits(logits, [SamplingParams(temperature=0.5, top_k=2)])
    expected = torch.tensor([4.0, 2.0]).softmax(-1)
    assert torch.allclose(out[0, :2].exp(), expected) and out[0, 2] == float("-inf")


def test_sampler_matches_the_distribution_and_greedy_rows_take_the_argmax():
    logprobs = torch.tensor([0.5, 0.3, 0.2]).log()
    g = torch.Generator().manual_seed(0)
    params = [SamplingParams(temperature=1.0)]
    counts = torch.bincount(torch.tensor([int(sample(logprobs[None], params, [g])[0]) for _ in range(20000)]),
                            minlength=3).float()
    expected = torch.tensor([0.5, 0.3, 0.2]) * 20000
    stat = ((counts - expected) ** 2 / expected).sum()
    assert float(torch.special.gammaincc(torch.tensor(1.0), stat / 2)) > 1e-3
    assert sample(logprobs[None], [SamplingParams(temperature=0)], [None]).tolist() == [0]


def test_seeded_rows_are_reproducible():
    logprobs = torch.randn(4, 50).log_softmax(-1)
    params = [SamplingParams(temperature=1.0)] * 4

    def draw(seed):
        return sample(logprobs, params, [torch.Generator().manual_seed(seed) for _ in range(4)])

    assert torch.equal(draw(3), draw(3)) and not torch.equal(draw(3), draw(4))


def test_a_temperature_below_the_epsilon_is_greedy():
    """1e-40 divides logits to inf and NaN (the sampler then took token 0 every step): it is greedy instead."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=t, seed=1) for t in (0.0, 1e-40, 1e-6)]
    assert all(p.greedy for p in params) and not SamplingParams(temperature=1e-4).greedy
    processed = process_logits(logits, params)
    assert torch.isfinite(processed).all()
    tokens = sample(processed, params, [None, None, None])
    assert tokens.tolist() == logits.argmax(-1).tolist()
