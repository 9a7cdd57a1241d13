"""DFlash block drafts in the engine: lossless (greedy output equals plain greedy output token for token, sampled
output keeps the target's distribution) through continuous batching, preemption, narrower widths and pauses; the
drafts equal z-lab's dflash_generate recomputed from scratch (anchor, positions and context exactly), and the
draft's paged cache holds the keys and values of the whole context."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny import (
    YARN,
    assert_the_first_tokens_follow_the_target,
    dflash_mla_raw,
    dflash_raw,
    make_hf_checkpoint,
    make_served_checkpoint,
    mla_config,
    mla_weights,
    read_config,
    write_draft,
)

from eyas import LLM, SamplingParams
from eyas.config import DeepseekV3Config, SpeculativeConfig
from eyas.engine import proposer
from eyas.engine.sequence import check_invariants
from eyas.export import save_dflash_draft
from eyas.models.dflash import DFlashConfig, DFlashDraft

H = 32
PROMPTS = [[5, 6, 7], list(range(10, 40)), [3] * 9, [40, 41], [17]]
GREEDY = SamplingParams(temperature=0, max_tokens=23, ignore_eos=True)  # 23: lands mid-block for every width


def write_dflash(path, target_dir, seed: int = 0, weights: dict | None = None, mla: bool = False, **overrides):
    """A DFlash draft for the target at `target_dir`, saved in z-lab's layout: random (norms off 1, so a missing
    one shows) unless `weights` gives them; MLA-shaped layers if `mla`; with `draft_vocab_size` among the
    overrides, a compressed vocabulary of that many random target ids (its own head random too)."""
    target = DeepseekV3Config.from_dict(read_config(target_dir), "target")
    vocab = target.vocab_size
    dflash_config = {"target_layer_ids": [1, 2], "mask_token_id": vocab - 1}
    if mla:
        dflash_config["attention_mode"] = "mla"
    raw = (dflash_mla_raw if mla else dflash_raw)(vocab_size=vocab, dflash_config=dflash_config)
    config = DFlashConfig.from_hf(raw | overrides, target, "test")
    torch.manual_seed(seed)
    draft = DFlashDraft(config, torch.nn.Embedding(vocab, H), torch.nn.Linear(H, vocab, bias=False))
    own = {n for n, _ in draft.named_parameters()} - {"embed_tokens.weight", "lm_head.weight"}
    assert weights is None or set(weights) == own, own ^ set(weights)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if weights is not None:
                if name in weights:
                    p.copy_(weights[name])
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
            elif p.dim() > 1:
                p.normal_(0, 0.2)
        if config.compressed_vocab:
            ids = torch.randperm(vocab)[:config.draft_vocab_size].sort().values
            draft.d2t.copy_(ids - torch.arange(len(ids)))
            draft.t2d[ids] = True
    return save_dflash_draft(draft, path)


def rig_bigram_target_and_copying_dflash(target_dir, draft_dir):
    """A bigram target (every layer writes zero: next = argmax lm_head(norm(embed(token)))) whose embeddings have
    rms 1 and coordinate 0 equal to 1, and a one-layer DFlash draft whose block row 1 copies the anchor's embedding
    (its queries look one position back through rope; the context contributes nothing) and reads it out through the
    target's final norm and lm_head: its first draft is the target's next token, the later ones mostly wrong."""
    tensors = load_file(target_dir / "model.safetensors")
    for key in tensors:
        if key.endswith(("o_proj.weight", "down_proj.weight")):
            tensors[key] = torch.zeros_like(tensors[key])
    emb = tensors["model.embed_tokens.weight"]
    V = emb.shape[0]
    rest = emb[:, 1:] / emb[:, 1:].pow(2).sum(-1, keepdim=True).sqrt() * (H - 1) ** 0.5
    tensors["model.embed_tokens.weight"] = torch.cat([torch.ones(V, 1), rest], dim=1)
    save_file(tensors, target_dir / "model.safetensors")

    heads, kv_heads, d = 4, 2, 16
    q = torch.zeros(heads * d, H)  # every head: the constant coordinate, rotated back by one position's angle (1 rad)
    q[0::d, 0], q[d // 2::d, 0] = torch.cos(torch.tensor(1.0)), -torch.sin(torch.tensor(1.0))
    k = torch.zeros(kv_heads * d, H)
    k[0::d, 0] = 1.0
    o = torch.zeros(H, heads * d)  # heads 0 and 2 read kv heads 0 and 1: the two halves of the anchor's embedding
    o[:d, :d], o[d:, 2 * d:3 * d] = 50 * torch.eye(d), 50 * torch.eye(d)
    p = "layers.0."
    weights = {"fc.weight": torch.zeros(H, 2 * H), "hidden_norm.weight": torch.ones(H), "norm.weight":
               tensors["model.norm.weight"], p + "input_layernorm.weight": torch.ones(H),
               p + "post_attention_layernorm.weight": torch.ones(H), p + "self_attn.q_proj.weight": q,
               p + "self_attn.k_proj.weight": k, p + "self_attn.v_proj.weight": torch.eye(H),
               p + "self_attn.o_proj.weight": o, p + "self_attn.q_norm.weight": 5 * torch.ones(d),
               p + "self_attn.k_norm.weight": 5 * torch.ones(d)}
    weights |= {p + "mlp.gate_proj.weight": torch.zeros(48, H), p + "mlp.up_proj.weight": torch.zeros(48, H),
                p + "mlp.down_proj.weight": torch.zeros(H, 48)}
    return write_dflash(draft_dir, target_dir, weights=weights, num_hidden_layers=1)


@pytest.fixture(scope="module")
def random_pair(tmp_path_factory):
    """(target dir, its transformers model, a random DFlash draft of block 5)."""
    target = tmp_path_factory.mktemp("dflash_target")
    hf = make_hf_checkpoint(target, rope_parameters=YARN)
    return target, hf, write_dflash(tmp_path_factory.mktemp("dflash_draft"), target, block_size=5)


@pytest.fixture(scope="module")
def mla_pair(tmp_path_factory, random_pair):
    """random_pair's target with a random MLA-shaped DFlash draft of block 5."""
    target, hf, _ = random_pair
    return target, hf, write_dflash(tmp_path_factory.mktemp("dflash_mla_draft"), target, mla=True, block_size=5)


@pytest.fixture(scope="module")
def compressed_pair(tmp_path_factory, random_pair):
    """random_pair's target with a random DFlash draft of block 5 over a compressed vocabulary of 40 ids."""
    target, hf, _ = random_pair
    return target, hf, write_dflash(tmp_path_factory.mktemp("dflash_vocab_draft"), target, block_size=5,
                                    draft_vocab_size=40)


@pytest.fixture(scope="module")
def copying_pair(tmp_path_factory):
    target = tmp_path_factory.mktemp("rigged_target")
    make_hf_checkpoint(target)
    return target, None, rig_bigram_target_and_copying_dflash(target, tmp_path_factory.mktemp("copying_draft"))


def run(target, params, prompts=PROMPTS, **kw):
    llm = LLM(target, max_num_seqs=4, block_size=4, max_num_batched_tokens=11, **kw)
    outs = llm.generate(prompts, params)
    assert llm.allocator.num_used == 0  # every block came back
    return llm, outs


def reference_drafts(hf, draft: DFlashDraft, tokens: list[int], width: int) -> list[int]:
    """z-lab's dflash_generate for one sequence, from scratch: the anchor is the newest token (position p =
    len - 1), the context every position before it, read from transformers' hidden_states[id + 1]."""
    p = len(tokens) - 1
    with torch.no_grad():
        states = hf(torch.tensor([tokens[:p]]), output_hidden_states=True).hidden_states
        kv = draft.context_kv(torch.cat([states[i + 1] for i in draft.config.target_layer_ids], dim=-1),
                              torch.arange(p)[None])
        block = draft.block_input_ids(torch.tensor([tokens[p]]))
        rows = draft(block, torch.arange(p, p + draft.config.block_size)[None], kv)[0, 1:1 + width]
        if draft.config.compressed_vocab:  # argmax over the draft's own head, draft id i being target id i + d2t[i]
            ids = (rows @ draft.lm_head.weight.t()).argmax(-1)
            return (ids + draft.d2t[ids]).tolist()
        return draft.compute_logits(rows).argmax(-1).tolist()


def cached_and_recomputed(llm, hf, seq) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft cache's entries of `seq`'s positions 0..num_draft_computed-1, and the same computed afresh from
    transformers' hidden states."""
    draft, bs, n = llm.draft, llm.allocator.block_size, seq.num_draft_computed
    slots = [seq.block_table[j // bs] * bs + j % bs for j in range(n)]
    with torch.no_grad():
        states = hf(torch.tensor([seq.token_ids[:n]]), output_hidden_states=True).hidden_states
        fused = draft.combine_hidden_states(None, [states[i + 1][0] for i in draft.config.target_layer_ids])
        return llm.speculative.draft_cache[slots], draft.cache_entries(fused, torch.arange(n))


@pytest.mark.parametrize("pair", ["random_pair", "mla_pair"])
def test_cache_entries_are_the_context_kv_the_forward_takes(request, pair):
    """One cache entry per position, computed in pieces, gathered back: the forward's context keys and values (an
    MLA-shaped draft's: its latents and roped keys, kv_lora_rank + qk_rope_head_dim values per layer)."""
    target, _, draft_dir = request.getfixturevalue(pair)
    draft = LLM(target, speculative_method="dflash", draft_model=draft_dir).draft
    torch.manual_seed(0)
    states, positions = [torch.randn(9, H), torch.randn(9, H)], torch.arange(9)
    with torch.no_grad():
        fused = draft.combine_hidden_states(None, states)
        entries = torch.cat([draft.cache_entries(fused[a:b], positions[a:b]) for a, b in ((0, 4), (4, 9))])
        expected = draft.context_kv(torch.cat(states, dim=-1)[None], positions[None])
    assert entries.shape == (9, *draft.cache_entry_shape())
    if pair == "mla_pair":
        assert draft.cache_entry_shape() == (2, 20 + 8)
    for kept, kept_ref in zip(draft.context_kv_of(entries[None]), expected, strict=True):
        for t, t_ref in zip(kept, kept_ref, strict=True):
            torch.testing.assert_close(t, t_ref, rtol=1e-5, atol=1e-5)


# -- lossless ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("k", [None, 1, 2])
@pytest.mark.parametrize("pair", ["random_pair", "copying_pair", "mla_pair", "compressed_pair"])
def test_greedy_dflash_equals_plain_greedy(request, pair, k):
    """Five prompts, four running at once (the fifth joins when one finishes), prompts chunked: each output equals
    plain greedy's. The rig's first draft is the target's next token (nearly always accepted), a random draft's
    rarely; widths below B - 1 verify that many drafts."""
    target, _, draft = request.getfixturevalue(pair)
    _, plain = run(target, GREEDY)
    llm, spec = run(target, GREEDY, speculative_method="dflash", draft_model=draft, num_speculative_tokens=k)
    width = k or llm.draft.block_size - 1
    assert llm.speculative_config.num_speculative_tokens == width
    for a, b in zip(plain, spec):
        assert b.token_ids == a.token_ids and b.finish_reason == "length"
        assert len(b.accepted_per_position) == width
    first = sum(o.accepted_per_position[0] for o in spec) / len(spec)
    assert first > 0.9 if pair == "copying_pair" else first < 0.5
    assert all(o.num_drafted > 0 for o in spec)


@pytest.mark.parametrize("pair", ["random_pair", "copying_pair", "mla_pair"])
def test_batch_of_one_equals_plain(request, pair):
    target, _, draft = request.getfixturevalue(pair)
    for prompt in PROMPTS[:3]:
        plain = LLM(target, max_num_seqs=1).generate([prompt], GREEDY)[0]
        spec = LLM(target, max_num_seqs=1, speculative_method="dflash", draft_model=draft).generate([prompt], GREEDY)[0]
        assert spec.token_ids == plain.token_ids and spec.num_drafted > 0


@pytest.mark.parametrize("pair", ["random_pair", "mla_pair"])
def test_requests_arriving_mid_run_and_preemption(request, pair):
    """A cache too small for its requests (sequences preempted and recomputed, their draft context too) and requests
    added between steps: after every step the sequence invariants hold and each sequence's drafts are the
    reference's for its tokens (so the context rewritten after a preemption is the whole context); the output is
    plain greedy's."""
    target, hf, draft = request.getfixturevalue(pair)
    llm = LLM(target, max_num_seqs=3, block_size=4, num_blocks=16, max_num_batched_tokens=16,
              speculative_method="dflash", draft_model=draft)
    prompts = [[3 + i] * (6 + 3 * i) for i in range(5)]
    params = [SamplingParams(temperature=0, max_tokens=10 + 4 * i, ignore_eos=True) for i in range(5)]
    seqs = [llm.add_request(p, sp) for p, sp in zip(prompts[:2], params[:2])]
    preempted, preempt = set(), llm.scheduler._preempt
    llm.scheduler._preempt = lambda seq: preempted.add(seq.seq_id) or preempt(seq)
    steps, drafted_after_preemption = 0, 0
    while llm.scheduler.has_work() or len(seqs) < 5:
        if steps in (2, 5, 9) and len(seqs) < 5:
            seqs.append(llm.add_request(prompts[len(seqs)], params[len(seqs)]))
        llm.step()
        steps += 1
        for seq in seqs:
            check_invariants(seq, 4)
            if seq.draft_tokens:
                assert seq.draft_tokens == reference_drafts(hf, llm.draft, seq.token_ids, len(seq.draft_tokens))
                drafted_after_preemption += seq.seq_id in preempted
    assert llm.scheduler.num_preemptions > 0 and drafted_after_preemption > 0
    plain = LLM(target).generate(prompts, params)
    assert [s.generated_ids for s in seqs] == [o.token_ids for o in plain]
    assert llm.allocator.num_used == 0


@pytest.mark.parametrize("block_size", [2, 4, 8, 16])
def test_every_block_size_is_lossless_batched_alone_and_preempted(copying_pair, random_pair, tmp_path, block_size):
    """B in {2, 4, 8, 16}, for the copying rig (its first draft nearly always accepted, so accepted runs end inside
    the block), a random draft and a random MLA-shaped one: batched with chunked prompts, one request at a time, in
    a cache small enough that sequences are preempted and recomputed, and with drafting paused while three or more
    run; each output equals plain greedy's."""
    copying_target, _, copying = copying_pair
    random_target = random_pair[0]
    drafts = {"copying": (copying_target, write_dflash(tmp_path / "copying", copying_target, num_hidden_layers=1,
                                                       weights=load_file(copying / "model.safetensors"),
                                                       block_size=block_size)),
              "random": (random_target, write_dflash(tmp_path / "random", random_target, seed=block_size,
                                                     block_size=block_size)),
              "mla": (random_target, write_dflash(tmp_path / "mla", random_target, seed=block_size, mla=True,
                                                  block_size=block_size))}
    prompts = [[3 + i] * (6 + 3 * i) for i in range(5)]
    for name, (target, draft) in drafts.items():
        spec = {"speculative_method": "dflash", "draft_model": draft}
        _, plain = run(target, GREEDY)
        llm, batched = run(target, GREEDY, **spec)
        assert llm.speculative_config.num_speculative_tokens == block_size - 1
        assert [o.token_ids for o in batched] == [o.token_ids for o in plain], name
        assert all(o.num_drafted > 0 for o in batched), name
        alone = LLM(target, max_num_seqs=1, **spec)
        assert [alone.generate([p], GREEDY)[0].token_ids for p in PROMPTS[:3]] == [o.token_ids for o in plain[:3]]
        small = LLM(target, max_num_seqs=3, block_size=4, num_blocks=16, max_num_batched_tokens=16, **spec)
        preempted = small.generate(prompts, GREEDY)
        assert small.scheduler.num_preemptions > 0 and small.allocator.num_used == 0, name
        assert [o.token_ids for o in preempted] == [o.token_ids for o in LLM(target).generate(prompts, GREEDY)], name
        paused_config = SpeculativeConfig(method="dflash", draft_model=str(draft), disable_batch_size=3)
        llm, paused = run(target, GREEDY, speculative_config=paused_config)  # no drafts while 3 or more run
        assert [o.token_ids for o in paused] == [o.token_ids for o in plain], name
        assert 0 < sum(o.num_drafted for o in paused) < sum(o.num_drafted for o in batched), name
        if name == "copying":
            assert sum(o.num_accepted for o in batched) > sum(o.num_verify_steps for o in batched) / 2


# -- the drafts and the context, exactly -----------------------------------------------------------------------------

@pytest.mark.parametrize("k", [None, 2])
@pytest.mark.parametrize("pair", ["random_pair", "mla_pair", "compressed_pair"])
def test_drafts_are_dflash_generate_recomputed_from_scratch(request, pair, k):
    """After every step, each decoding sequence's drafts equal the reference's for its committed tokens (block
    anchored at the newest token, at position num_computed, over the whole context before it), and its draft cache
    holds every context position's keys and values. A block one position off, an anchor one token off or a context
    one position short proposes other tokens with this random draft."""
    target, hf, draft_dir = request.getfixturevalue(pair)
    llm = LLM(target, max_num_seqs=3, block_size=4, max_num_batched_tokens=9, speculative_method="dflash",
              draft_model=draft_dir, num_speculative_tokens=k)
    seqs = [llm.add_request(p, SamplingParams(temperature=0, max_tokens=14, ignore_eos=True))
            for p in ([5, 6, 7], list(range(10, 22)), [17])]
    checked = 0
    while llm.scheduler.has_work():
        llm.step()
        for seq in seqs:
            if seq.draft_tokens:
                assert seq.num_draft_computed == seq.num_computed == len(seq) - 1
                assert seq.draft_tokens == reference_drafts(hf, llm.draft, seq.token_ids, len(seq.draft_tokens))
                cached, fresh = cached_and_recomputed(llm, hf, seq)
                torch.testing.assert_close(cached, fresh, rtol=1e-5, atol=1e-5)
                checked += 1
    assert checked >= 12


def test_a_pause_leaves_no_hole_in_the_draft_context(random_pair):
    """Drafting off while three run (disable_batch_size 3): no draft work, the target's states at the context
    positions wait on each sequence; once one finishes, the others fuse and write them with their own step's and
    draft again. Their cache entries
    then equal the whole context recomputed, their first drafts equal the reference's, and the output is plain
    greedy's."""
    target, hf, draft_dir = random_pair
    config = SpeculativeConfig(method="dflash", draft_model=str(draft_dir), disable_batch_size=3)
    llm = LLM(target, speculative_config=config)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (6, 30, 30)]
    prompts = [[5, 6], [7, 8, 9, 10], [11]]
    seqs = [llm.add_request(p, sp) for p, sp in zip(prompts, params)]
    forwards = []
    forward = llm.draft.forward
    llm.draft.forward = lambda *args: forwards.append(1) or forward(*args)
    while not seqs[0].is_finished:
        llm.step()
        for s in seqs:
            check_invariants(s, llm.allocator.block_size)
    assert not forwards and all(s.num_draft_computed == 0 and s.pending_draft_inputs for s in seqs[1:])
    llm.step()  # two running: catch up, draft
    for seq in seqs[1:]:
        assert seq.num_draft_computed == seq.num_computed >= 7 and not seq.pending_draft_inputs
        cached, fresh = cached_and_recomputed(llm, hf, seq)
        torch.testing.assert_close(cached, fresh, rtol=1e-5, atol=1e-5)
        assert len(seq.draft_tokens) == 4
        assert seq.draft_tokens == reference_drafts(hf, llm.draft, seq.token_ids, 4)
    while llm.scheduler.has_work():
        llm.step()
    plain = LLM(target).generate(prompts, params)
    assert [s.generated_ids for s in seqs] == [o.token_ids for o in plain]
    assert seqs[0].acceptance.num_drafted == 0 and min(s.acceptance.num_drafted for s in seqs[1:]) > 0


def test_a_long_pause_keeps_at_most_max_pending_rows(random_pair, monkeypatch):
    """Drafting off for the whole run: once a sequence would keep more than MAX_PENDING_ROWS inputs they are written
    into the cache (no drafts), its alone, so a pause holds bounded memory; the cache then matches the context
    recomputed."""
    monkeypatch.setattr(proposer, "MAX_PENDING_ROWS", 8)
    target, hf, draft_dir = random_pair
    config = SpeculativeConfig(method="dflash", draft_model=str(draft_dir), disable_batch_size=3)
    llm = LLM(target, speculative_config=config)
    seqs = [llm.add_request(p, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
            for p in ([5, 6], [7, 8, 9], [10])]
    written = 0
    while llm.scheduler.has_work():
        before = [s.num_draft_computed for s in seqs]
        llm.step()
        for seq, start in zip(seqs, before):
            check_invariants(seq, llm.allocator.block_size)
            if not seq.is_finished:
                assert (seq.num_draft_computed != start) == (seq.num_computed - start > 8)
            assert sum(t.shape[0] for t in seq.pending_draft_inputs) <= 8 and not seq.draft_tokens
            if seq.num_draft_computed and not seq.is_finished and written < 3:
                cached, fresh = cached_and_recomputed(llm, hf, seq)
                torch.testing.assert_close(cached, fresh, rtol=1e-5, atol=1e-5)
                written += 1
    assert written == 3 and all(s.acceptance.num_drafted == 0 for s in seqs)


def test_the_adaptive_width_may_verify_fewer_drafts_or_none(copying_pair):
    """With the adaptive width the engine tries every width 0..B-1 (widest first) and settles on one; the output
    stays plain greedy's."""
    target, _, draft = copying_pair
    config = SpeculativeConfig(method="dflash", draft_model=str(draft), adaptive_width=True)
    llm = LLM(target, max_num_seqs=1, speculative_config=config)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    seq = llm.add_request([5, 6, 7], params)
    widths = set()
    while llm.scheduler.has_work():
        llm.step()
        widths.add(len(seq.draft_tokens))
    assert widths >= {0, 1, 2, 3}
    assert llm.output(seq).token_ids == LLM(target, max_num_seqs=1).generate([[5, 6, 7]], params)[0].token_ids


# -- structured output, sampling, the CLI and the settings ----------------------------------------------------------

@pytest.fixture(scope="module")
def served_pair(tmp_path_factory):
    """A random target with the shipped tokenizer, and a random DFlash draft for it."""
    target = make_served_checkpoint(tmp_path_factory.mktemp("dflash_served"))
    return target, write_dflash(tmp_path_factory.mktemp("dflash_served_draft"), target)


def test_greedy_constrained_dflash_equals_plain(served_pair):
    """JSON schemas and a regex: each constrained sequence proposes, row by row, the argmax over the tokens its
    grammar allows after its earlier drafts; the output equals constrained plain greedy's and validates."""
    pytest.importorskip("xgrammar")
    import jsonschema
    from tiny import REGEX, SCHEMAS, STRUCTURED_PROMPTS, spec

    from eyas.sampling_params import StructuredOutputParams

    target, draft = served_pair
    params = [SamplingParams(temperature=0, max_tokens=48, structured_output=spec(n)) for n in SCHEMAS]
    params.append(SamplingParams(temperature=0, max_tokens=48, structured_output=StructuredOutputParams(regex=REGEX)))
    prompts = STRUCTURED_PROMPTS[:len(params)]
    kw = dict(max_num_seqs=4, block_size=4, max_num_batched_tokens=11)
    plain = LLM(target, **kw).generate(prompts, params)
    llm = LLM(target, speculative_method="dflash", draft_model=draft, **kw)
    for a, b, p in zip(plain, llm.generate(prompts, params), params):
        assert b.token_ids == a.token_ids and b.finish_reason == a.finish_reason
        if p.structured_output.json_schema is not None and a.finish_reason == "stop":
            jsonschema.validate(json.loads(a.text), p.structured_output.json_schema)
    assert llm.scheduler.metrics.num_drafted > 0 and llm.allocator.num_used == 0


@pytest.mark.parametrize("pair", ["random", "copying"])
def test_residual_sampling_keeps_the_target_distribution(tmp_path, pair):
    """Tokens 1-3 of 8,000 sampled requests, two drafts verified per step, against the exact marginals of the
    processed target distribution (chi-square, p > 1e-3, as tests/test_acceptance.py)."""
    vocab = 16
    make_hf_checkpoint(tmp_path / "target", vocab_size=vocab)
    if pair == "copying":
        draft = rig_bigram_target_and_copying_dflash(tmp_path / "target", tmp_path / "draft")
    else:
        draft = write_dflash(tmp_path / "draft", tmp_path / "target")
    torch.manual_seed(11)
    llm = LLM(tmp_path / "target", max_num_seqs=512, speculative_method="dflash", draft_model=draft,
              num_speculative_tokens=2)
    outs = assert_the_first_tokens_follow_the_target(llm, [3, 9, 4], vocab)
    accepted = sum(o.num_accepted for o in outs) / sum(o.num_drafted for o in outs)
    assert accepted > 0.15 if pair == "copying" else accepted < 0.15


@pytest.mark.parametrize("strategy", ["typical", "typical-acceptance", "logit-comparison"])
def test_every_rule_exact_for_greedy_requests_verifies_dflash_drafts(copying_pair, strategy):
    """The rules that are exact for greedy requests keep DFlash's drafts while they are the target's argmax: the
    output equals plain greedy's, and the copying rig's first drafts are accepted."""
    target, _, draft = copying_pair
    config = SpeculativeConfig(method="dflash", draft_model=str(draft), rejection_sampling_strategy=strategy)
    _, plain = run(target, GREEDY)
    _, outs = run(target, GREEDY, speculative_config=config)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert sum(o.num_accepted for o in outs) > sum(o.num_verify_steps for o in outs) / 2


def test_synthetic_acceptance_keeps_every_dflash_draft_or_none(copying_pair):
    """Synthetic acceptance (engine overhead runs) at rate 1 commits every draft of the block, at rate 0 none."""
    target, _, draft = copying_pair
    for rate in (0.0, 1.0):
        config = SpeculativeConfig(method="dflash", draft_model=str(draft), synthetic_acceptance_rate=rate)
        _, outs = run(target, GREEDY, speculative_config=config)
        drafted, accepted = sum(o.num_drafted for o in outs), sum(o.num_accepted for o in outs)
        assert drafted > 0 and accepted == (drafted if rate else 0), rate



def test_relaxed_acceptance_applies_to_dflash_drafts_inside_thinking_only(served_pair):
    """Relaxed acceptance that takes any token (top-k over the whole vocabulary, unbounded delta): inside
    <think> every DFlash draft is kept, where the greedy rule keeps few of a random draft's; outside it the output
    is plain greedy's."""
    target, draft = served_pair
    think = 5  # the shipped tokenizer's <think>; its </think> is 6
    inside, outside = [[40, 41, think, 42]], [[40, 41, 42]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    kw = dict(max_num_seqs=1, block_size=4)
    relaxed = SpeculativeConfig(method="dflash", draft_model=str(draft), num_speculative_tokens=3,
                                relaxed_thinking=True, relaxed_thinking_topk=8192, relaxed_thinking_delta=1e9)
    strict = SpeculativeConfig(method="dflash", draft_model=str(draft), num_speculative_tokens=3)
    llm = LLM(target, speculative_config=relaxed, **kw)
    assert llm.runner.verifier.think_token_ids == (5, 6)
    kept = llm.generate(inside, params)[0]
    assert kept.num_drafted > 0 and kept.num_accepted == kept.num_drafted
    greedy = LLM(target, speculative_config=strict, **kw).generate(inside, params)[0]
    assert greedy.num_accepted < greedy.num_drafted / 2
    plain = LLM(target, **kw).generate(outside, params)[0]
    assert llm.generate(outside, params)[0].token_ids == plain.token_ids

def test_eyas_generate_runs_a_dflash_draft(served_pair, capsys):
    from eyas.cli import main as cli

    target, draft = served_pair
    # a fixed width: the adaptive one follows measured step times, so two runs could draft differently
    base = ["generate", "--model", str(target), "--prompt", "def add(a, b):", "--max-new-tokens", "12",
            "--ignore-eos", "--json", "--no-speed-check", "--speculative-width", "fixed"]
    assert cli(base + ["--speculative-method", "none"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert cli(base + ["--speculative-method", "dflash", "--draft-model", str(draft)]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["token_ids"] == plain["token_ids"] and spec["num_drafted"] > 0
    assert len(spec["accepted_per_position"]) == 3  # block 4: three drafts a step
    assert cli(base + ["--draft-model", str(draft)]) == 0  # the method read from the draft's config.json
    assert json.loads(capsys.readouterr().out)["num_drafted"] == spec["num_drafted"]


def test_settings(random_pair, tmp_path):
    import argparse

    from eyas.engine.block_proposer import BlockDraft, BlockProposer
    from eyas.engine.proposer import DraftHead
    from eyas.engine_args import EngineArgs

    target, _, draft = random_pair
    with pytest.raises(ValueError, match="'dflash' needs a draft model directory"):
        SpeculativeConfig(method="dflash")
    assert SpeculativeConfig(method="dflash", draft_model="d").num_speculative_tokens is None  # the block decides
    assert SpeculativeConfig(method="eagle", draft_model="d").num_speculative_tokens == 3
    with pytest.raises(ValueError, match="at most block_size - 1 = 4"):
        LLM(target, speculative_method="dflash", draft_model=draft, num_speculative_tokens=5)
    llm = LLM(target, speculative_method="dflash", draft_model=draft)
    assert llm.speculative_config.num_speculative_tokens == 4 and llm.scheduler.num_lookahead_slots == 5
    assert isinstance(llm.draft, BlockDraft) and not isinstance(llm.draft, DraftHead)
    assert type(llm.speculative) is BlockProposer
    assert llm.draft.aux_hidden_state_ids == (2, 3)  # layer outputs 1 and 2 are hidden_states 2 and 3
    eagle = LLM(target, speculative_method="eagle", draft_model=_eagle_draft(tmp_path)).draft
    assert isinstance(eagle, DraftHead) and not isinstance(eagle, BlockDraft)

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)

    def config(*argv):
        return EngineArgs.from_cli_args(parser.parse_args(["--model", str(target), *argv])).speculative_config()

    assert (config("--speculative-method", "dflash", "--draft-model", str(draft)).num_speculative_tokens) == 4
    assert config("--draft-model", str(draft)).method == "dflash"
    assert config("--speculative-method", "dflash", "--draft-model", str(draft),
                  "--num-speculative-tokens", "2").num_speculative_tokens == 2
    assert config("--speculative-method", "mtp").num_speculative_tokens == 3


def _eagle_draft(tmp_path):
    return write_draft(tmp_path / "mla", mla_config(), mla_weights())
