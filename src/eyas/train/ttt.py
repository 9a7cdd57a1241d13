"""The EAGLE-3 training-time-test (TTT) loss: the draft runs several steps on its own outputs, as it will when
serving, and every step is trained toward the target's distribution.

Indexing, for a sequence of T tokens (t indexes the position whose hidden state started the chain):

    step 0   hidden = fc(aux[t])            token = ids[t + 1]       position t       target = p(token t + 2)
    step k   hidden = carried_{k-1}[t]      token = ids[t + 1 + k]   position t + k   target = p(token t + 2 + k)

(carried: the step's pre-norm output, or its final norm for an EAGLE-3.1 draft with norm_output; fc is preceded by
the fc_norm / norm_before_fc norms of such drafts: Eagle3Draft.fuse.)

p(token j) is the target's softmax at position j - 1. The input tokens are the true ones (teacher forcing); the
hidden states are the draft's own, so errors compound as at inference. Positions t + k match the engine, which
runs draft step k at the last accepted position + k.

Attention (the "extended" mask): step k at t sees step 0's keys at positions <= t (causal) and the keys of steps
1..k at t only, exactly the draft cache an inference chain started at t has. Worked example, T = 3, k = 2, query t = 1:
step-0 keys [t=0, t=1], step-1 key [t=1], step-2 key [t=1] -> 4 visible keys; step-0 key t=2 is masked.

Loss per step: soft cross-entropy between the target's softmax and the draft's log-softmax over the draft vocabulary
(forward KL up to a constant), averaged over positions whose predicted token is loss-masked (assistant tokens) and
whose target top token lies in the draft vocabulary (a tie with an id outside it counts); steps weighted decay^k.

Acceptance-aware ("LK") losses replace the per-position soft cross-entropy (arXiv 2602.23881; SpecForge and
speculators ship them). With alpha = sum_v min(p(v), q(v)), the probability that residual rejection sampling
accepts the draft's token at that position:
    lk-alpha    -log alpha
    lk-lambda   w * KL(p || q) + (1 - w) * (1 - alpha),  w = scale * exp(-decay * alpha), w without gradient
(w per position, so data-parallel ranks need nothing beyond the summed gradients).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from eyas.models.eagle3 import Eagle3Draft, target_ids_of


@dataclass(slots=True)
class TTTOutput:
    loss: torch.Tensor  # scalar: sum_k decay^k * loss_sum_k / num_positions_k
    loss_sums: list[torch.Tensor]  # per step: summed soft CE over counted positions (for exact cross-rank sums)
    counts: list[torch.Tensor]  # per step: positions counted
    correct: list[torch.Tensor]  # per step: counted positions where the draft's argmax is the target's (ties count)


def read_positions(loss_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] bool: the positions whose target distribution some loss reads, p when token p + 1 is a loss token (every
    TTT step's target for a token is the target's distribution at the position before it)."""
    return F.pad(loss_mask[:, 1:] > 0, (0, 1))


def target_distribution(target_logits: torch.Tensor, loss_mask: torch.Tensor, draft: Eagle3Draft
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """From the target's logits at the positions some loss reads (`target_logits` [R, vocab], the rows of
    `read_positions(loss_mask)` in row-major order): its distribution over the draft vocabulary [R, draft_vocab], its
    argmax there (draft ids) [R], whether its own top token lies in the draft vocabulary [B, T] (False where not read),
    and the row of each position [B, T] (0 where not read: only rows a loss weighs by 0 look there).

    Rows, not a dense [B, T, vocab] tensor: on chat data many positions are prompt or padding, and at DeepSeek-V3's
    vocabulary (129,280) one dense fp32 tensor of 8 x 4096 positions is 16.9 GB."""
    read = read_positions(loss_mask)
    if target_logits.dim() != 2 or target_logits.shape[0] != int(read.sum()):
        raise ValueError(f"target_logits of shape {tuple(target_logits.shape)}: expected [{int(read.sum())}, vocab], "
                         "the target's logits at the positions the loss mask reads (read_positions(loss_mask))")
    row_of = torch.zeros(read.shape, dtype=torch.long, device=read.device)
    row_of[read] = torch.arange(target_logits.shape[0], device=read.device)
    in_vocab = torch.zeros(read.shape, dtype=torch.bool, device=read.device)
    rows = target_logits
    if draft.config.compressed_vocab:
        kept = rows.index_select(1, target_ids_of(draft.d2t))
        # the top token is a draft token when the draft vocabulary holds the row's maximum (a tie with an id outside
        # counts as inside). Compared by value: on CPU argmax over 270 rows x 8,192 bf16 logits takes 7 ms, amax 0.4
        in_vocab[read] = kept.amax(-1) >= rows.amax(-1)
        rows = kept
    else:
        in_vocab[read] = True
    probs = rows.float().softmax(-1)
    return probs, probs.argmax(-1), in_vocab, row_of


def extended_attention(q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor, diag_k: list[torch.Tensor],
                       diag_v: list[torch.Tensor], scale: float) -> torch.Tensor:
    """q [B, T, h, d]; k0/v0 [B, T, hk, d|dv] from step 0 (causal); diag_k/diag_v [B, T, hk, ...] from steps
    1..k, each visible only at its own position. Returns [B, T, h, dv]."""
    group = q.shape[2] // k0.shape[2]

    def heads(x):  # grouped-query: kv head j serves query heads j*group..(j+1)*group-1
        return x.repeat_interleave(group, dim=2) if group > 1 else x

    k0, v0 = heads(k0), heads(v0)
    T = q.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    # the einsums take q, k0, v0 as they are: under autocast they run in bfloat16 whatever their inputs' dtype
    scores0 = torch.einsum("bthd,bshd->bhts", q, k0).float() * scale  # [B, h, T, T]
    scores0 = scores0.masked_fill(~causal, float("-inf"))
    # a product and a sum, not einsum: einsum runs this row-wise dot as B*T*h one-element matmuls (9x slower on CPU)
    q32 = q.float()
    diag = [(q32 * heads(k).float()).sum(-1).transpose(1, 2) * scale for k in diag_k]  # [B, h, T] each
    probs = torch.cat([scores0] + [s.unsqueeze(-1) for s in diag], dim=-1).softmax(-1)
    out = torch.einsum("bhts,bshd->bthd", probs[..., :T], v0).float()
    for j, v in enumerate(diag_v):
        out = out + probs[..., T + j].transpose(1, 2).unsqueeze(-1) * heads(v).float()
    return out.to(q.dtype)


def draft_step(draft: Eagle3Draft, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
               past: list[tuple[torch.Tensor, torch.Tensor]], rows: torch.Tensor | None = None,
               keep: torch.Tensor | None = None) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """One TTT step. Dense: hidden [B, T, H], tokens [B, T], positions [T]; returns the state carried to the next
    step [B, T, H] (Eagle3Draft.carried: the pre-norm output, or its norm with norm_output) and
    this step's (k, v) [B, T, ...]. With `rows` [N], flat rows b * T + t, hidden [N, H], tokens [N] and
    positions [N] hold only those rows: their q, k, v are placed in the dense layout for attention (other rows stay
    zero; no query that is kept reads them, since a later step's key is visible at its own position only) and the
    output is [N, H]. With `keep` [N] (dense inputs), every row makes its key and value but only the flat rows
    `keep` go on through o_proj and the MLP: the output is [N, H]. `past` holds the dense (k, v) of the earlier
    steps, step 0 first."""
    layer = draft.layers[0]
    attn = layer.self_attn
    embeds = draft.embed(tokens, hidden.dtype)
    x, residual = layer.attention_input(embeds, hidden)
    cos, sin = draft.rotary(positions)
    q, k, v = attn.expanded_qkv(x, cos, sin)
    if rows is not None:
        batch, length = past[0][0].shape[:2]
        q, k, v = (_scatter_rows(t, rows, batch, length) for t in (q, k, v))
    if past:
        (k0, v0), later = past[0], past[1:]
        out = extended_attention(q, k0, v0, [kk for kk, _ in later] + [k], [vv for _, vv in later] + [v], attn.scale)
    else:
        out = extended_attention(q, k, v, [], [], attn.scale)
    if rows is not None:
        out = _gather_rows(out, rows)
    elif keep is not None:
        out, residual = _gather_rows(out, keep), _gather_rows(residual, keep)
    h = residual + attn.o_proj(out.flatten(-2))
    return draft.carried(h + layer.mlp(layer.post_attention_layernorm(h))), (k, v)


LOSSES = ("kl", "lk-alpha", "lk-lambda")


@dataclass(slots=True)
class LossKind:
    """Which per-position loss the TTT steps minimise (see the module docstring), and lk-lambda's weight curve."""

    name: str = "kl"
    lambda_scale: float = 1.0
    lambda_decay: float = 1.0

    def __post_init__(self) -> None:
        if self.name not in LOSSES:
            raise ValueError(f"loss {self.name!r} is not one of {', '.join(LOSSES)}")


def position_losses(target_probs: torch.Tensor, log_probs: torch.Tensor, kind: LossKind) -> torch.Tensor:
    """[N] losses of N positions from the target's distribution [N, V] and the draft's log-softmax [N, V]."""
    ce = soft_cross_entropy(target_probs, log_probs)
    if kind.name == "kl":
        return ce
    with torch.autocast(log_probs.device.type, enabled=False):
        p, log_q = target_probs.float(), log_probs.float()
        alpha = torch.minimum(p, log_q.exp()).sum(-1)  # the expected acceptance of the draft's token
        if kind.name == "lk-alpha":
            return -torch.log(alpha.clamp_min(1e-12))
        kl = ce - torch.special.entr(p).sum(-1)  # cross-entropy minus the target's entropy
        w = kind.lambda_scale * torch.exp(-kind.lambda_decay * alpha.detach())
        return w * kl + (1 - w) * (1 - alpha)


def soft_cross_entropy(target_probs: torch.Tensor, log_probs: torch.Tensor) -> torch.Tensor:
    """-sum_v p(v) log q(v) per row, in float32 even under autocast: CPU autocast runs vecdot in bfloat16, which
    moved rows of 2,048 entries by up to 0.06 (tests/test_ttt.py)."""
    with torch.autocast(log_probs.device.type, enabled=False):
        return -torch.linalg.vecdot(target_probs.float(), log_probs.float())


# rows move by index_select / index_copy on flat rows (b * length + t): on CPU they copy rows ~5x faster than
# advanced indexing with (b, t)

def _gather_rows(dense: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """[batch, length, ...] -> [N, ...] at flat rows."""
    return dense.flatten(0, 1).index_select(0, flat)


def _scatter_rows(values: torch.Tensor, flat: torch.Tensor, batch: int, length: int) -> torch.Tensor:
    """values [N, ...] placed at flat rows of a zero [batch, length, ...] tensor."""
    dense = values.new_zeros(batch * length, *values.shape[1:])
    return dense.index_copy(0, flat, values).view(batch, length, *values.shape[1:])


def ttt_loss(draft: Eagle3Draft, input_ids: torch.Tensor, loss_mask: torch.Tensor, aux_hidden_states: torch.Tensor,
             target_logits: torch.Tensor, ttt_steps: int = 3, decay: float = 0.9,
             loss: LossKind | None = None) -> TTTOutput:
    """input_ids, loss_mask [B, T]; aux_hidden_states [B, T, n_aux, H]; target_logits [R, vocab]: the target's logits
    at read_positions(loss_mask), in row-major order. `loss`: the per-position loss (default: soft cross-entropy).

    Only rows that some loss needs are computed past step 0's attention: step k keeps position t when a counted
    target exists at t for step k or a later one (a row's chain never looks at another row's later steps). Prompt and
    padding rows cost their step-0 keys and values (and a query in the dense step-0 attention) and nothing else; the
    loss is the same as computing every row."""
    B, T = input_ids.shape
    if T < ttt_steps + 2:
        raise ValueError(f"sequences of {T} tokens are too short for {ttt_steps} TTT steps (need >= {ttt_steps + 2})")
    target_probs, target_top, in_vocab, row_of = target_distribution(target_logits, loss_mask, draft)
    # weights[k][b, t]: position t's step-k prediction (token t + 2 + k) is counted
    weights = [F.pad(loss_mask[:, 2 + k:].float() * in_vocab[:, 1 + k:T - 1].float(), (0, 2 + k))
               for k in range(ttt_steps)]
    needed = [torch.stack(weights[k:]).sum(0) > 0 for k in range(ttt_steps)]  # [B, T] rows step k must compute
    base = torch.arange(T, device=input_ids.device)
    # step 0: every position's key and value are context for the later positions; only the needed rows go on
    # through o_proj and the MLP (the MLP is most of the layer's work)
    hidden = draft.fuse(aux_hidden_states)  # [B, T, H]
    b, t = needed[0].nonzero(as_tuple=True)
    prenorm, kv = draft_step(draft, hidden, F.pad(input_ids[:, 1:], (0, 1)), base, [], keep=b * T + t)  # [N_0, H]
    past = [kv]
    total = prenorm.new_zeros((), dtype=torch.float32)
    loss_sums, counts, correct = [], [], []
    for k in range(ttt_steps):
        if k > 0:  # the rows still needed, a subset of the last step's (in the same row-major order)
            prenorm = prenorm[needed[k][needed[k - 1]]]
            b, t = needed[k].nonzero(as_tuple=True)
            prenorm, kv = draft_step(draft, prenorm, input_ids[b, t + 1 + k], t + k, past, b * T + t)
            past.append(kv)
        logits = draft.draft_logits(prenorm).float().log_softmax(-1)  # [N_k, draft_vocab]
        weight = weights[k][b, t]  # [N_k]
        # the target's distribution at position t + 1 + k (<= T - 2 for a needed row)
        target_rows = row_of[b, t + 1 + k]
        target = target_probs.index_select(0, target_rows)  # [N_k, draft_vocab]
        loss_sum = (position_losses(target, logits, loss or LossKind()) * weight).sum()
        count = weight.sum()
        loss_sums.append(loss_sum)
        counts.append(count)
        # correct: the target's top token is the draft's most likely one. Compared by value: on CPU a max over the
        # draft vocab takes 0.1 ms where argmax takes 1.9 ms (270 rows x 8192)
        draft_logits = logits.detach()
        top_logit = draft_logits.gather(-1, target_top[target_rows, None]).squeeze(-1)
        correct.append(((top_logit >= draft_logits.amax(-1)).float() * weight).sum())
        total = total + decay ** k * loss_sum / count.clamp(min=1)
    return TTTOutput(loss=total, loss_sums=loss_sums, counts=counts, correct=correct)


class TTTLoss(nn.Module):
    """`ttt_loss` as one module call. ttt_loss reaches into the draft's submodules and never calls draft.forward, so
    FSDP needs a module whose forward spans the whole loss: its hooks gather the shards before the forward and
    reduce-scatter the gradients after the backward."""

    def __init__(self, draft: Eagle3Draft) -> None:
        super().__init__()
        self.draft = draft

    def forward(self, input_ids: torch.Tensor, loss_mask: torch.Tensor, aux_hidden_states: torch.Tensor,
                target_logits: torch.Tensor, ttt_steps: int, decay: float, loss: LossKind | None = None) -> TTTOutput:
        return ttt_loss(self.draft, input_ids, loss_mask, aux_hidden_states, target_logits, ttt_steps, decay, loss)
