"""Training DFlash block drafts: where the blocks go (anchors), what they are taught (labels), and the loss.

A training sequence of T tokens yields many blocks at once: each anchor position a (a supervised token whose next
token is supervised too) starts a block [x_a, MASK, ..., MASK] that sees the context before a and is taught
x_{a+1}, ..., x_{a+B-1} at its rows 1..B-1. All of a sequence's blocks run in one forward under one mask
(eyas.models.dflash.block_attention_mask); the target runs once per sequence.

Losses, per block row k = 1..B-1 with cross-entropy CE_k against x_{a+k}:
  ce     w_k = exp(-(k - 1) / gamma)                       (the DFlash paper's decay; SpecForge's gamma 7 at B 16)
  dpace  q_k = exp(-CE_k), q'_k = (1 - alpha) q_k + alpha, C_j = prod_{k<=j} q'_k, w_j = sum_{m>=j} C_m
         (no gradient through w): a row counts as much as the accepted runs that would reach it and go on
         (D-PACE, the default of speculators' and Model Optimizer's DFlash trainers, alpha 0.5)
and the loss is sum(w * CE) / sum(w) over the rows whose label exists and is supervised.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

LOSSES = ("ce", "dpace")


def sample_anchors(loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator | None = None
                   ) -> torch.Tensor:
    """Up to `num_anchors` anchor positions of one sequence, sorted: positions a >= 1 (a block needs context)
    where loss_mask[a] and loss_mask[a + 1] are both set, drawn without replacement; fewer when the sequence has
    fewer. loss_mask [T] -> [n] (int64)."""
    supervised = loss_mask.bool()
    eligible = torch.zeros_like(supervised)
    eligible[1:-1] = supervised[1:-1] & supervised[2:]
    candidates = eligible.nonzero().flatten()
    if candidates.numel() > num_anchors:
        candidates = candidates[torch.randperm(candidates.numel(), generator=generator)[:num_anchors]]
    return candidates.sort().values


@dataclass(slots=True)
class Blocks:
    """One batch's blocks, A slots per sequence (-1 anchors pad sequences with fewer)."""

    anchors: torch.Tensor  # [batch, A], -1 where a slot holds no block
    input_ids: torch.Tensor  # [batch, A * block_size]: each anchor's token, then mask tokens
    positions: torch.Tensor  # [batch, A * block_size]
    labels: torch.Tensor  # [batch, A, block_size]: x_{a+k} at row k (row 0: the anchor itself, never taught)
    valid: torch.Tensor  # [batch, A, block_size]: rows 1.. whose label exists and is supervised


def make_blocks(input_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: list[torch.Tensor], block_size: int,
                mask_token_id: int) -> Blocks:
    """input_ids, loss_mask [batch, T]; anchors: each sequence's anchor positions (sample_anchors)."""
    batch, T = input_ids.shape
    A = max(1, max(a.numel() for a in anchors))
    slots = torch.full((batch, A), -1, dtype=torch.long, device=input_ids.device)
    for b, a in enumerate(anchors):
        slots[b, :a.numel()] = a
    offsets = torch.arange(block_size, device=input_ids.device)
    at = slots.clamp(min=0).unsqueeze(-1) + offsets  # [batch, A, bs]: the positions each block row stands for
    inside = (at < T) & (slots >= 0).unsqueeze(-1)
    gathered = lambda t: torch.gather(t, 1, at.clamp(max=T - 1).flatten(1)).view(batch, A, block_size)  # noqa: E731
    labels = gathered(input_ids)
    valid = inside & gathered(loss_mask).bool()
    valid[..., 0] = False
    block_ids = torch.full_like(labels, mask_token_id)
    block_ids[..., 0] = labels[..., 0]
    return Blocks(slots, block_ids.flatten(1), at.flatten(1), labels, valid)


def block_loss(logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor, loss: str = "ce",
               gamma: float = 7.0, alpha: float = 0.5) -> tuple[torch.Tensor, dict]:
    """logits [..., block_size, V] of the block rows; labels, valid [..., block_size] (Blocks) -> (the loss,
    {"acc_per_row": accuracy of rows 1..B-1, "rows": supervised rows}). See the module docstring."""
    if loss not in LOSSES:
        raise ValueError(f"loss {loss!r} is not one of {', '.join(LOSSES)}")
    bs = logits.shape[-2]
    logits, labels, valid = logits[..., 1:, :], labels[..., 1:], valid[..., 1:]
    ce = F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), reduction="none").view(labels.shape)
    ce = ce * valid
    if loss == "ce":
        weight = torch.exp(-torch.arange(bs - 1, device=ce.device, dtype=ce.dtype) / gamma).expand_as(ce)
    else:
        with torch.no_grad():
            kept = ((1 - alpha) * torch.exp(-ce) + alpha).masked_fill(~valid, 1.0)
            reach = torch.cumprod(kept, dim=-1) * valid  # C_j, over the rows that count
            weight = reach.flip(-1).cumsum(-1).flip(-1)  # w_j = sum over m >= j of C_m
    weight = weight * valid
    total = weight.sum()
    value = (weight * ce).sum() / total.clamp(min=1e-12)
    with torch.no_grad():
        hits = (logits.argmax(-1) == labels) & valid
        acc = hits.flatten(0, -2).sum(0) / valid.flatten(0, -2).sum(0).clamp(min=1)
    return value, {"acc_per_row": acc.tolist(), "rows": int(valid.sum())}
