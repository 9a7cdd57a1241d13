"""Turning logits into tokens: per-row temperature, top-k, top-p, min-p, and per-request seeds.

Each seeded request draws its randomness from its own torch.Generator, so its output does not depend on which
other requests share the batch. Sampling uses the exponential race (argmax of p / E with E ~ Exp(1)), which draws
exactly from p and needs one noise vector per row.
"""

from __future__ import annotations

import torch

from eyas.sampling_params import SamplingParams

# one generated token's log-probabilities: (its id, its log-prob, [(token id, log-prob)] of the most likely, best first)
TokenLogprobs = tuple[int, float, list[tuple[int, float]]]


def process_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Log-probabilities after temperature, top-k, top-p and min-p, per row; rows are [num_rows, vocab].

    Greedy rows are returned as plain log-softmax (their argmax is all that is used)."""
    logits = logits.float()
    temperature = torch.tensor([1.0 if p.greedy else p.temperature for p in params])
    logits = logits / temperature.to(logits.device)[:, None]
    for row, p in enumerate(params):
        if p.greedy:
            continue
        if p.top_k > 0 and p.top_k < logits.shape[-1]:
            kth = logits[row].topk(p.top_k).values[-1]
            logits[row] = logits[row].masked_fill(logits[row] < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = logits[row].sort(descending=True)
            probs = sorted_logits.softmax(-1)
            # drop a token when the mass before it already reaches top_p; the top token always stays
            drop = probs.cumsum(-1) - probs >= p.top_p
            logits[row, order[drop]] = float("-inf")
        if p.min_p > 0:
            probs = logits[row].softmax(-1)
            logits[row] = logits[row].masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    return logits.log_softmax(-1)


def greedy_ids(scores: torch.Tensor) -> torch.Tensor:
    """The argmax of each row of scores [rows, vocab]: the first maximal index, as argmax gives it. max's indices
    run about 3x faster on CPU (32 rows of 8192: 121 us against 380 us, one thread)."""
    return scores.max(-1).indices


def sample(logprobs: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row of processed log-probabilities [num_rows, vocab] -> [num_rows]."""
    out = greedy_ids(logprobs)
    for row, p in enumerate(params):
        if p.greedy:
            continue
        noise = torch.empty(logprobs.shape[-1]).exponential_(generator=generators[row])
        out[row] = (logprobs[row] - noise.to(logprobs.device).log()).argmax()
    return out


def token_logprobs(logits: torch.Tensor, tokens: list[int], num_top: list[int]) -> list[TokenLogprobs]:
    """For row r of raw target logits [rows, vocab]: the log-probability of tokens[r] and the num_top[r] most likely
    tokens, under the target's own distribution (before temperature, top-k/p and grammar masks, as vLLM reports)."""
    logprobs = logits.float().log_softmax(-1)
    chosen = logprobs.gather(1, torch.tensor(tokens, device=logprobs.device)[:, None])[:, 0].tolist()
    k = max(num_top, default=0)
    top_values, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    return [(tokens[r], chosen[r], list(zip(top_ids[r][:n], top_values[r][:n]))) for r, n in enumerate(num_top)]
