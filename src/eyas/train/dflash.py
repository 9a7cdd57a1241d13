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
and the loss is sum(w * CE) / sum(w) over the rows whose label exists and is supervised (and, with a compressed
draft vocabulary, lies in it: the logits and soft labels are over the draft's ids).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from eyas.models.dflash import DFlashDraft, block_attention_mask
from eyas.models.eagle3 import target_ids_of
from eyas.train.ttt import read_positions

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
    terms = block_loss_terms(logits, labels, valid, loss, gamma, alpha)
    value = terms.weighted_sum / terms.weight_sum.clamp(min=1e-12)
    return value, {"acc_per_row": (terms.correct / terms.rows.clamp(min=1)).tolist(), "rows": int(terms.rows.sum())}


def block_loss_terms(logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor, loss: str = "ce",
                     gamma: float = 7.0, alpha: float = 0.5, soft_targets: torch.Tensor | None = None
                     ) -> BlockLossTerms:
    """block_loss as sums, so that ranks can add them up before dividing (the loss is weighted_sum / weight_sum
    over the global batch); per row 1..B-1 also the cross-entropy sum, the supervised rows and the top-1 hits.

    `soft_targets` [n, V]: the target's distribution for each supervised row (rows 1.. of `valid`, row-major);
    the cross-entropy is then against it instead of the label, and D-PACE's acceptance proxy q stays the draft's
    probability of the label (which the target's greedy answers make its argmax)."""
    if loss not in LOSSES:
        raise ValueError(f"loss {loss!r} is not one of {', '.join(LOSSES)}")
    bs = logits.shape[-2]
    logits, labels, valid = logits[..., 1:, :], labels[..., 1:], valid[..., 1:]
    hard = F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), reduction="none").view(labels.shape)
    hard = hard * valid
    ce = hard
    if soft_targets is not None:
        ce = torch.zeros_like(hard)
        log_q = F.log_softmax(logits[valid].float(), dim=-1)
        ce[valid] = -(soft_targets.float() * log_q).sum(-1)
    if loss == "ce":
        weight = torch.exp(-torch.arange(bs - 1, device=ce.device, dtype=ce.dtype) / gamma).expand_as(ce)
    else:
        with torch.no_grad():
            kept = ((1 - alpha) * torch.exp(-hard) + alpha).masked_fill(~valid, 1.0)
            reach = torch.cumprod(kept, dim=-1) * valid  # C_j, over the rows that count
            weight = reach.flip(-1).cumsum(-1).flip(-1)  # w_j = sum over m >= j of C_m
    weight = weight * valid
    with torch.no_grad():
        hits = (logits.argmax(-1) == labels) & valid
    rows = lambda t: t.flatten(0, -2).sum(0)  # noqa: E731  [..., B-1] -> [B-1]
    return BlockLossTerms((weight * ce).sum(), weight.sum().detach(), rows(ce).detach(), rows(valid.float()),
                          rows(hits.float()))


@dataclass(slots=True)
class BlockLossTerms:
    weighted_sum: torch.Tensor  # sum(w * CE), with its gradient
    weight_sum: torch.Tensor  # sum(w)
    ce_per_row: torch.Tensor  # [B-1] sums of CE
    rows: torch.Tensor  # [B-1] supervised rows
    correct: torch.Tensor  # [B-1] rows whose top-1 is the label


def choose_mask_token_id(vocab_size: int, tokenizer: Any, override: int | None = None) -> int:
    """The embedding row a block's masked rows read: `override`, else the first row past the tokenizer's ids
    (DeepSeek-V3 pads its embedding past them: a row no text ever reads), else the tokenizer's pad token (padding
    is never taught: it is outside every loss). A row the data also uses would tell the draft nothing at once."""
    if override is not None:
        if not 0 <= override < vocab_size:
            raise ValueError(f"--mask-token-id {override}: expected a row of the target's embedding, "
                             f"0..{vocab_size - 1}")
        return override
    if len(tokenizer) < vocab_size:
        return len(tokenizer)
    if tokenizer.pad_token_id is not None and tokenizer.pad_token_id not in (tokenizer.eos_token_id,
                                                                             tokenizer.bos_token_id):
        return tokenizer.pad_token_id
    raise ValueError(f"the tokenizer uses every one of the target's {vocab_size} embedding rows and has no pad token "
                     "of its own: choose the block's mask token with --mask-token-id (a token the data never holds)")


class BlockObjective(nn.Module):
    """The DFlash training objective of one batch: blocks at anchors drawn per sequence, every block of a sequence
    in one draft forward over the sequence's context (the target's states, computed once), the block loss's terms.
    A module around the draft, as TTTLoss is, so a wrapper (DDP, FSDP) sees one forward."""

    def __init__(self, draft: DFlashDraft, loss: str, gamma: float, alpha: float, num_anchors: int,
                 soft_labels: bool = False) -> None:
        super().__init__()
        self.draft, self.loss, self.gamma, self.alpha, self.num_anchors = draft, loss, gamma, alpha, num_anchors
        self.soft_labels = soft_labels  # taught the target's distribution (its logits at read_positions)

    def forward(self, input_ids: torch.Tensor, loss_mask: torch.Tensor, aux: torch.Tensor,
                generators: list[torch.Generator], target_logits: torch.Tensor | None = None) -> BlockLossTerms:
        """input_ids, loss_mask [B, T]; aux [B, T, n, H] (the target's states at the draft's target layers, in
        order); one generator per sequence, which draws its anchors; with soft labels, the target's logits at
        `read_positions(loss_mask)` [R, V] (row-major)."""
        draft, B, T = self.draft, *input_ids.shape
        bs = draft.block_size
        anchors = [sample_anchors(loss_mask[b].cpu(), self.num_anchors, generators[b]).to(input_ids.device)
                   for b in range(B)]
        blocks = make_blocks(input_ids, loss_mask, anchors, bs, draft.config.mask_token_id)
        positions = torch.arange(T, device=input_ids.device).expand(B, T)
        context = draft.context_kv(aux.flatten(2).to(draft.fc.weight.dtype), positions)
        mask = block_attention_mask(blocks.anchors, T, bs)
        hidden = draft(blocks.input_ids, blocks.positions, context, mask)
        A = blocks.anchors.shape[1]
        rows = blocks.valid.flatten(1)  # the head runs at the taught rows only: it is the widest matmul
        logits = hidden.new_zeros(B, A * bs, draft.lm_head.weight.shape[0])
        logits[rows] = draft.draft_logits(hidden[rows].to(draft.lm_head.weight.dtype)).to(logits.dtype)
        # in a compressed vocabulary's ids; a label outside it is a row the draft cannot propose: not taught, as
        # an EAGLE-3 draft's steps whose target token lies outside its vocabulary
        labels = draft.draft_ids_of(blocks.labels)
        valid = blocks.valid & (labels >= 0)
        soft = None
        if self.soft_labels:  # the distribution for the token at position p is the target's at p - 1
            read = read_positions(loss_mask)
            row_of = torch.zeros(B, T, dtype=torch.long, device=input_ids.device)
            row_of[read] = torch.arange(int(read.sum()), device=input_ids.device)
            before = (blocks.positions.view(B, A, bs)[..., 1:] - 1).clamp(0, T - 1)  # past the end: not taught
            taught = valid[..., 1:]
            rows_read = torch.gather(row_of, 1, before.flatten(1)).view(B, A, bs - 1)[taught]
            taught_logits = target_logits[rows_read]
            if draft.config.compressed_vocab:  # the target's distribution over the draft's ids, renormalised
                taught_logits = taught_logits.index_select(1, target_ids_of(draft.d2t))
            soft = F.softmax(taught_logits.float(), dim=-1)
        return block_loss_terms(logits.view(B, A, bs, -1), labels.clamp(min=0), valid, self.loss, self.gamma,
                                self.alpha, soft)
