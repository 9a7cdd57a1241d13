"""Train-time test: what the draft sees in training is what it sees when the engine runs it."""

import pytest
import torch
from tiny import YARN, make_hf_checkpoint

from eyas import load_model
from eyas.models.attention import AttentionMetadata
from eyas.models.eagle3 import init_draft, new_draft_config
from eyas.train.ttt import draft_step, read_positions, soft_cross_entropy, ttt_loss


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("target")
    make_hf_checkpoint(path, rope_parameters=YARN)
    return load_model(path)


def make_draft(target, arch, draft_vocab=0):
    d2t = None
    if draft_vocab:
        kept = torch.randperm(target.config.vocab_size, generator=torch.Generator().manual_seed(0))[:draft_vocab]
        d2t = kept.sort().values - torch.arange(draft_vocab)
    config = new_draft_config(target.config, arch, (1, 2, 3), draft_vocab)
    draft = init_draft(target, config, d2t, seed=1)
    with torch.no_grad():  # larger weights than the init so attention is far from uniform
        for name, p in draft.named_parameters():
            if p.dim() == 2 and not name.startswith(("embed_tokens", "lm_head")):
                p.normal_(0, 0.2)
    return draft


def test_init_draft_starts_from_the_targets_head(target):
    """The draft's head is the target's (its rows of the draft vocabulary) after the target's final norm gain, so
    at step 0 its head sees inputs at the scale it was trained on; the embedding is the target's module."""
    saved = target.model.norm.weight.detach().clone()
    try:
        with torch.no_grad():
            target.model.norm.weight.uniform_(0.5, 3.0)
        kept = torch.arange(0, target.config.vocab_size, 3)
        d2t = kept - torch.arange(len(kept))
        draft = init_draft(target, new_draft_config(target.config, "mla", (1, 2, 3), len(kept)), d2t)
        assert torch.equal(draft.norm.weight, target.model.norm.weight)
        assert torch.equal(draft.lm_head.weight, target.lm_head.weight[kept])
        assert draft.embed_tokens is target.model.embed_tokens
    finally:
        with torch.no_grad():
            target.model.norm.weight.copy_(saved)


def chain_by_ttt(draft, aux, ids, steps):
    """prenorm of every TTT step, [steps][B, T, H], as ttt_loss computes them."""
    T = ids.shape[1]
    hidden = draft.fc(aux.flatten(-2))
    past, outs = [], []
    for k in range(steps):
        tokens = torch.nn.functional.pad(ids[:, 1 + k:], (0, 1 + k))
        hidden, kv = draft_step(draft, hidden, tokens, torch.arange(T) + k, past)
        past.append(kv)
        outs.append(hidden)
    return outs


def chain_by_engine(draft, aux, ids, start, steps):
    """The engine's way: draft step 0 over positions 0..start through the paged cache, then one token per step."""
    cache = torch.zeros(64, *draft.cache_entry_shape())
    blocks = [0, 1, 2, 3]
    attn = AttentionMetadata.build([start + 1], [start + 1], [blocks], 16)
    hidden = draft(draft.fc(aux[0, :start + 1].flatten(-2)), ids[0, 1:start + 2], attn, cache)[-1:]
    outs = [hidden[0]]
    for k in range(1, steps):
        attn = AttentionMetadata.build([1], [start + k + 1], [blocks], 16)
        hidden = draft(hidden, ids[0, start + 1 + k:start + 2 + k], attn, cache)
        outs.append(hidden[0])
    return outs


@pytest.mark.parametrize("arch", ["mla", "mha"])
def test_ttt_steps_equal_the_engines_draft_chain(target, arch):
    draft = make_draft(target, arch)
    g = torch.Generator().manual_seed(2)
    T, steps = 12, 4
    ids = torch.randint(0, 96, (1, T), generator=g)
    aux = torch.randn(1, T, 3, 32, generator=g)
    with torch.no_grad():
        ttt = chain_by_ttt(draft, aux, ids, steps)
        # step 0 is also the draft's own batched causal forward
        batched = draft(draft.fc(aux.flatten(-2)), torch.nn.functional.pad(ids[:, 1:], (0, 1)))
        assert (ttt[0] - batched).abs().max() < 1e-5
        for start in (0, 3, 7):
            engine = chain_by_engine(draft, aux, ids, start, steps)
            for k in range(steps):
                assert (ttt[k][0, start] - engine[k]).abs().max().item() < 1e-4, (start, k)


def loss_batch(B, T, seed=3):
    """Token ids, a loss mask whose second row starts with a 6-token prompt, aux states, and the generator that
    drew them (for more draws in the same order)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 96, (B, T), generator=g)
    mask = torch.ones(B, T)
    mask[1, :6] = 0
    return ids, mask, torch.randn(B, T, 3, 32, generator=g), g


@pytest.mark.parametrize("draft_vocab", [40, 3])
def test_loss_is_soft_cross_entropy_over_the_draft_vocab(target, draft_vocab):
    """Loss sums, counts and accuracy counts against a per-row loop. With 3 draft tokens, favoured by the target,
    the draft's argmax often matches: the accuracy count is tested on matches, not only on zeros."""
    draft = make_draft(target, "mha", draft_vocab=draft_vocab)
    B, T = 2, 10
    ids, mask, aux, g = loss_batch(B, T)
    kept = torch.arange(draft_vocab) + draft.d2t
    target_logits = torch.randn(B, T, 96, generator=g)
    if draft_vocab < 10:
        target_logits[..., kept] += 3.0
    with torch.no_grad():
        out = ttt_loss(draft, ids, mask, aux, target_logits[read_positions(mask)], ttt_steps=2, decay=0.5)
        prenorm = chain_by_ttt(draft, aux, ids, 2)
    for k in range(2):
        expected_sum, expected_count, expected_correct = 0.0, 0, 0
        for b in range(B):
            for t in range(T - 2 - k):
                target_row = target_logits[b, t + 1 + k]
                if mask[b, t + 2 + k] == 0 or not draft.t2d[target_row.argmax()]:
                    continue
                p = target_row[kept].softmax(-1)
                log_q = draft.lm_head(draft.norm(prenorm[k][b, t])).log_softmax(-1)
                expected_sum += -(p * log_q).sum().item()
                expected_count += 1
                expected_correct += int(log_q.argmax() == p.argmax())
        assert out.counts[k].item() == expected_count > 0
        assert out.correct[k].item() == expected_correct
        assert expected_correct > 0 or draft_vocab > 10
        assert abs(out.loss_sums[k].item() - expected_sum) < 1e-3
    total = sum(0.5 ** k * out.loss_sums[k] / out.counts[k] for k in range(2))
    assert abs(out.loss.item() - total.item()) < 1e-5


def test_soft_cross_entropy_stays_float32_under_bf16_autocast():
    """--mixed-precision bf16 runs the loss under autocast, which would run the row-wise dot in bfloat16."""
    g = torch.Generator().manual_seed(0)
    p = torch.randn(64, 2048, generator=g).mul(3).softmax(-1)
    log_q = torch.randn(64, 2048, generator=g).mul(3).log_softmax(-1)
    expected = -(p.double() * log_q.double()).sum(-1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ce = soft_cross_entropy(p, log_q)
    assert ce.dtype == torch.float32
    assert (ce.double() - expected).abs().max() < 1e-4


def dense_ttt_loss(draft, ids, mask, aux, target_logits, steps, decay):
    """The TTT loss with every row computed at every step (what ttt_loss prunes), written out plainly."""
    T = ids.shape[1]
    target_p = target_logits[..., torch.arange(draft.d2t.shape[0]) + draft.d2t].softmax(-1)
    in_vocab = draft.t2d[target_logits.argmax(-1)]
    hidden, past, total = draft.fc(aux.flatten(-2)), [], 0.0
    for k in range(steps):
        tokens = torch.nn.functional.pad(ids[:, 1 + k:], (0, 1 + k))
        hidden, kv = draft_step(draft, hidden, tokens, torch.arange(T) + k, past)
        past.append(kv)
        logits = draft.lm_head(draft.norm(hidden)).float().log_softmax(-1)[:, :T - 2 - k]
        weight = mask[:, 2 + k:] * in_vocab[:, 1 + k:T - 1]
        ce = -(target_p[:, 1 + k:T - 1] * logits).sum(-1)
        total = total + decay ** k * (ce * weight).sum() / weight.sum().clamp(min=1)
    return total


@pytest.mark.parametrize("arch", ["mla", "mha"])
def test_pruned_rows_give_the_dense_loss_and_gradients(target, arch):
    """ttt_loss computes only the rows some loss needs; loss and every gradient equal computing all rows, with
    prompt rows, right padding and a sequence with no loss rows at all in the batch."""
    draft = make_draft(target, arch, draft_vocab=40)
    g = torch.Generator().manual_seed(5)
    B, T = 3, 14
    ids = torch.randint(0, 96, (B, T), generator=g)
    aux = torch.randn(B, T, 3, 32, generator=g)
    target_logits = torch.randn(B, T, 96, generator=g)
    mask = torch.zeros(B, T)
    mask[0, 5:] = 1  # a prompt, then the answer
    mask[1, 3:9] = 1  # an answer, then padding
    # row 2: no loss at all
    losses, grads = [], []
    for fn in (lambda: ttt_loss(draft, ids, mask, aux, target_logits[read_positions(mask)], 3, 0.8).loss,
               lambda: dense_ttt_loss(draft, ids, mask, aux, target_logits, 3, 0.8)):
        draft.zero_grad()
        loss = fn()
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None})
    assert abs(losses[0] - losses[1]) < 1e-5 * abs(losses[1])
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 5
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-4, atol=1e-6, msg=name)
    empty = ttt_loss(draft, ids, torch.zeros(B, T), aux, target_logits.flatten(0, 1)[:0], 3, 0.8)
    assert empty.loss.item() == 0 and all(c.item() == 0 for c in empty.counts)
    with pytest.raises(ValueError, match=r"target_logits of shape \(3, 14, 96\): expected \[15, vocab\]"):
        ttt_loss(draft, ids, mask, aux, target_logits, 3, 0.8)


@pytest.mark.parametrize("kind", ["lk-alpha", "lk-lambda"])
def test_acceptance_aware_losses_against_a_per_row_loop(target, kind):
    """LK alpha (-log alpha) and LK lambda (w KL + (1 - w)(1 - alpha), w = scale exp(-decay alpha)), alpha =
    sum min(p, q): the loss sums equal a loop over rows written here, and their gradient reaches the draft."""
    from eyas.train.ttt import LossKind

    draft = make_draft(target, "mha", draft_vocab=40)
    B, T = 2, 10
    ids, mask, aux, g = loss_batch(B, T)
    kept = torch.arange(40) + draft.d2t
    target_logits = torch.randn(B, T, 96, generator=g) * 2
    loss = LossKind(kind, lambda_scale=0.8, lambda_decay=2.0)
    out = ttt_loss(draft, ids, mask, aux, target_logits[read_positions(mask)], ttt_steps=2, decay=0.5, loss=loss)
    out.loss.backward()
    assert draft.fc.weight.grad is not None and draft.fc.weight.grad.abs().sum() > 0
    with torch.no_grad():
        prenorm = chain_by_ttt(draft, aux, ids, 2)
    for k in range(2):
        expected, count = 0.0, 0
        for b in range(B):
            for t in range(T - 2 - k):
                target_row = target_logits[b, t + 1 + k]
                if mask[b, t + 2 + k] == 0 or not draft.t2d[target_row.argmax()]:
                    continue
                p = target_row[kept].softmax(-1).double()
                q = draft.lm_head(draft.norm(prenorm[k][b, t])).softmax(-1).double().detach()
                alpha = torch.minimum(p, q).sum()
                if kind == "lk-alpha":
                    expected += -torch.log(alpha).item()
                else:
                    kl = (p * (p.log() - q.log())).sum()
                    w = 0.8 * torch.exp(-2.0 * alpha)
                    expected += (w * kl + (1 - w) * (1 - alpha)).item()
                count += 1
        assert out.counts[k].item() == count > 0
        assert abs(out.loss_sums[k].item() - expected) < 1e-3 * max(1.0, abs(expected))


def test_an_unknown_loss_is_refused():
    from eyas.train.ttt import LossKind

    with pytest.raises(ValueError, match="'lk-beta' is not one of kl, lk-alpha, lk-lambda"):
        LossKind("lk-beta")
