"""Speculative decoding is lossless: greedy output equals plain greedy output token for token, and sampled output
keeps the target's distribution. Checked with drafts that are mostly rejected and drafts that are mostly accepted."""

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny import (
    YARN,
    add_mtp_weights,
    make_hf_checkpoint,
    mha_config,
    mha_weights,
    mla_config,
    mla_weights,
    rig_bigram_target_and_copying_mtp,
    write_draft,
)

from eyas import LLM, SamplingParams
from eyas.config import SpeculativeConfig
from eyas.engine.sequence import check_invariants


@pytest.fixture(scope="module")
def random_mtp(tmp_path_factory):
    path = tmp_path_factory.mktemp("random_mtp")
    make_hf_checkpoint(path, rope_parameters=YARN)
    add_mtp_weights(path)
    return path


@pytest.fixture(scope="module")
def copying_mtp(tmp_path_factory):
    path = tmp_path_factory.mktemp("copying_mtp")
    make_hf_checkpoint(path, rope_parameters=YARN)
    add_mtp_weights(path)
    rig_bigram_target_and_copying_mtp(path)
    return path


PROMPTS = [[5, 6, 7], list(range(10, 40)), [3] * 9, [40, 41], [17]]


def run(path, params, **spec):
    llm = LLM(path, max_num_seqs=4, block_size=4, max_num_batched_tokens=11, **spec)
    outs = llm.generate(PROMPTS, params)
    assert llm.allocator.num_used == 0  # every block came back, rejected drafts included
    return outs


@pytest.mark.parametrize("k", [1, 2, 3, 5])
@pytest.mark.parametrize("checkpoint", ["random_mtp", "copying_mtp"])
def test_greedy_mtp_equals_plain_greedy(request, checkpoint, k):
    path = request.getfixturevalue(checkpoint)
    params = SamplingParams(temperature=0, max_tokens=23, ignore_eos=True)  # 23: lands mid-run for every K
    plain = run(path, params)
    spec = run(path, params, speculative_method="mtp", num_speculative_tokens=k)
    for a, b in zip(plain, spec):
        assert b.token_ids == a.token_ids
        assert b.num_generated == 23 and b.finish_reason == "length"
    mean_al = sum(o.acceptance_length for o in spec) / len(spec)
    if checkpoint == "copying_mtp":
        assert mean_al > 1 + 0.8 * k  # the rig works: most drafts are accepted
    else:
        assert mean_al < 1.5


@pytest.mark.parametrize("k", [2, 5])
def test_eos_inside_an_accepted_run(copying_mtp, k):
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    plain = run(copying_mtp, params)
    # make a token from the middle of each plain output an end-of-sequence token
    stop_ids = [out.token_ids[7] for out in plain]
    params = SamplingParams(temperature=0, max_tokens=30, stop_token_ids=stop_ids)
    plain = run(copying_mtp, params)
    spec = run(copying_mtp, params, speculative_method="mtp", num_speculative_tokens=k)
    for a, b in zip(plain, spec):
        assert b.token_ids == a.token_ids and b.finish_reason == a.finish_reason == "stop"
        assert b.token_ids[-1] in stop_ids and not set(b.token_ids[:-1]) & set(stop_ids)


def test_speculative_config_validation():
    with pytest.raises(ValueError, match="draft model"):
        SpeculativeConfig(method="eagle")
    with pytest.raises(ValueError, match="rejection_sampling_strategy"):
        SpeculativeConfig(method="mtp", rejection_sampling_strategy="best")
    with pytest.raises(ValueError, match="num_tokens"):
        SpeculativeConfig(method="mtp", num_speculative_tokens_per_batch_size=[{"batch_start": 1}])
    config = SpeculativeConfig(method="mtp", num_speculative_tokens_per_batch_size=[
        {"batch_start": 1, "batch_end": 2, "num_tokens": 4}, {"batch_start": 3, "batch_end": 8, "num_tokens": 1}])
    assert [config.num_tokens_for_batch(b) for b in (1, 2, 3, 8, 9)] == [4, 4, 1, 1, 3]


def test_mtp_needs_an_mtp_layer(tmp_path):
    make_hf_checkpoint(tmp_path, rope_parameters=YARN)
    with pytest.raises(ValueError, match="num_nextn_predict_layers"):
        LLM(tmp_path, speculative_method="mtp")


def test_per_batch_size_draft_count(copying_mtp):
    config = SpeculativeConfig(method="mtp", num_speculative_tokens_per_batch_size=[
        {"batch_start": 1, "batch_end": 1, "num_tokens": 4}, {"batch_start": 2, "batch_end": 64, "num_tokens": 1}])
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    alone = LLM(copying_mtp, speculative_config=config).generate([[5, 6]], params)[0]
    batched = LLM(copying_mtp, speculative_config=config).generate([[5, 6], [7, 8], [9]], params)[0]
    assert len(alone.accepted_per_position) == 4 and len(batched.accepted_per_position) == 1
    assert alone.token_ids == batched.token_ids


def test_drafting_stops_at_the_disable_batch_size(copying_mtp):
    config = SpeculativeConfig(method="mtp", num_speculative_tokens=3, disable_batch_size=3)
    assert [config.num_tokens_for_batch(b) for b in (1, 2, 3, 50)] == [3, 3, 0, 0]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = [[5, 6], [7, 8], [9]]
    llm = LLM(copying_mtp, speculative_config=config)
    draft_work = []  # draft forwards, and the fusing of the target's states into step-0 inputs
    forward, combine = llm.draft.forward, llm.draft.combine_hidden_states
    llm.draft.forward = lambda *args: draft_work.append("forward") or forward(*args)
    llm.draft.combine_hidden_states = lambda *args: draft_work.append("combine") or combine(*args)
    crowded = llm.generate(prompts, params)
    assert all(o.num_drafted == 0 for o in crowded)  # three always running: never a draft
    assert not draft_work  # ... and every step is the plain one: no cost over plain decoding
    pair = LLM(copying_mtp, speculative_config=config).generate(prompts[:2], params)
    assert all(o.acceptance_length > 3 for o in pair)  # two running: full drafting, the rig accepts nearly all
    plain = LLM(copying_mtp).generate(prompts, params)
    assert [o.token_ids for o in crowded] == [o.token_ids for o in plain]
    assert [o.token_ids for o in pair] == [o.token_ids for o in plain[:2]]
    with pytest.raises(ValueError, match="disable_batch_size"):
        SpeculativeConfig(method="mtp", disable_batch_size=0)


@pytest.mark.parametrize("checkpoint", ["random_mtp", "copying_mtp"])
def test_drafting_resumes_when_the_batch_shrinks(request, checkpoint):
    """Three running: no draft work, and the target's states at every computed position are kept; once one
    finishes, the other two catch up in one draft pass and draft again over their whole context. Output equals
    plain greedy throughout, and the sequence invariants hold after every step."""
    path = request.getfixturevalue(checkpoint)
    config = SpeculativeConfig(method="mtp", num_speculative_tokens=3, disable_batch_size=3)
    prompts = [[5, 6], [7, 8, 9, 10], [11]]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (6, 40, 40)]
    llm = LLM(path, speculative_config=config)
    seqs = [llm.add_request(p, sp) for p, sp in zip(prompts, params)]
    paused, resumed = None, None
    while llm.scheduler.has_work():
        llm.step()
        for s in seqs:
            check_invariants(s, llm.allocator.block_size)
        if paused is None and seqs[0].is_finished:  # nothing drafted yet: every computed position is pending
            paused = [s.num_computed for s in seqs[1:]]
            assert [s.num_draft_computed for s in seqs[1:]] == [0, 0] and min(paused) >= 6
        elif paused is not None and resumed is None:  # the next step caught up
            resumed = [(s.num_draft_computed, s.num_computed, len(s.pending_draft_inputs)) for s in seqs[1:]]
    assert all(d == n and not pending for d, n, pending in resumed)
    spec = [llm.output(s) for s in seqs]
    plain = LLM(path).generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert spec[0].num_drafted == 0 and spec[1].num_drafted > 0 and spec[2].num_drafted > 0
    if checkpoint == "copying_mtp":
        assert min(spec[1].acceptance_length, spec[2].acceptance_length) > 3
    assert llm.allocator.num_used == 0


@pytest.mark.parametrize("kind", ["random_mtp", "mla", "mha"])
def test_drafts_after_a_pause_are_those_of_a_full_context(request, eagle_drafts, kind):
    """The first drafts proposed after drafting resumes equal those a fresh engine proposes after prefilling the
    same tokens as a prompt: the draft's context has no hole where drafting was off (a draft that attended only to
    the positions after the pause proposes different tokens with these context-dependent random drafts)."""
    if kind == "random_mtp":
        target, spec = request.getfixturevalue("random_mtp"), {"speculative_method": "mtp"}
    else:
        target, draft = eagle_drafts[kind]
        spec = {"speculative_method": "eagle", "draft_model": draft}
    config = SpeculativeConfig(num_speculative_tokens=3, disable_batch_size=3, **{
        "method": spec["speculative_method"], "draft_model": str(spec.get("draft_model") or "") or None})
    llm = LLM(target, speculative_config=config)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (12, 40, 40)]
    seqs = [llm.add_request(p, sp) for p, sp in zip([[5, 6], [7, 8, 9, 10, 11, 12], [13]], params)]
    while not seqs[0].is_finished:
        llm.step()
    assert not seqs[1].draft_tokens and seqs[1].num_draft_computed == 0
    llm.step()  # two running: catch up, draft
    tokens, drafts = list(seqs[1].token_ids), list(seqs[1].draft_tokens)
    assert len(drafts) == 3 and len(tokens) >= 18
    fresh = LLM(target, num_speculative_tokens=3, **spec)
    again = fresh.add_request(tokens[:-1], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    fresh.step()  # prefill: commits tokens[-1] (greedy), then drafts over the whole prompt
    assert again.token_ids == tokens and again.draft_tokens == drafts


@pytest.mark.parametrize("checkpoint", ["random_mtp", "copying_mtp"])
def test_logprobs_are_the_targets_own(request, checkpoint):
    """Each returned log-probability is the target's log-softmax at that position (a full forward over the
    output recomputes them), whether the token came from a plain step or from an accepted draft."""
    path = request.getfixturevalue(checkpoint)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    plain = run(path, params)
    spec = run(path, params, speculative_method="mtp", num_speculative_tokens=3)
    model = LLM(path).model
    for a, b in zip(plain, spec):
        assert b.token_ids == a.token_ids and len(a.logprobs) == len(b.logprobs) == 12
        ids = torch.tensor(a.prompt_token_ids + a.token_ids)
        with torch.no_grad():
            expected = model(ids[None])[0, len(a.prompt_token_ids) - 1:-1].float().log_softmax(-1)
        for out in (a, b):
            for j, (token, logprob, top) in enumerate(out.logprobs):
                assert token == out.token_ids[j] and abs(logprob - expected[j, token].item()) < 1e-4
                values, ids_top = expected[j].topk(3)
                assert [t for t, _ in top] == ids_top.tolist() and top[0][0] == token  # greedy: the argmax
                assert max(abs(lp - v) for (_, lp), v in zip(top, values.tolist())) < 1e-4
    none = run(path, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert all(o.logprobs is None for o in none)


# -- EAGLE-3 drafts ---------------------------------------------------------------------------------------------

def rig_bigram_target_and_first_step_eagle(target_dir, draft_dir):
    """A bigram target (every layer writes zero) whose embeddings all have rms 1 and coordinate 0 equal to 1, and
    an MHA EAGLE-3 draft whose attention looks only at its own position and copies the next token's embedding:
    its step-0 proposal is exactly the target's next token; later steps mix in their carried hidden state and
    are mostly wrong. So acceptance is high at draft position 1 and low after it."""
    tensors = load_file(target_dir / "model.safetensors")
    for key in tensors:
        if key.endswith(("o_proj.weight", "down_proj.weight")):
            tensors[key] = torch.zeros_like(tensors[key])
    emb = tensors["model.embed_tokens.weight"]
    V, H = emb.shape
    rest = emb[:, 1:] / emb[:, 1:].pow(2).sum(-1, keepdim=True).sqrt() * (H - 1) ** 0.5
    tensors["model.embed_tokens.weight"] = torch.cat([torch.ones(V, 1), rest], dim=1)
    save_file(tensors, target_dir / "model.safetensors")

    heads, head_dim, alpha = 2, H // 2, 100.0
    # q and k: alpha * u at every position (rope makes the score largest at distance 0)
    qk = torch.zeros(heads * head_dim, 2 * H)
    qk[:, 0] = alpha / head_dim ** 0.5
    value = torch.cat([torch.eye(H), torch.zeros(H, H)], dim=1)  # the normed next-token embedding
    w = {"fc.weight": torch.zeros(H, 3 * H), "layers.0.input_layernorm.weight": torch.ones(H),
         "layers.0.hidden_norm.weight": torch.ones(H), "layers.0.self_attn.q_proj.weight": qk,
         "layers.0.self_attn.k_proj.weight": qk.clone(), "layers.0.self_attn.v_proj.weight": value,
         "layers.0.self_attn.o_proj.weight": torch.eye(H), "layers.0.post_attention_layernorm.weight": torch.ones(H),
         "layers.0.mlp.gate_proj.weight": torch.zeros(64, H), "layers.0.mlp.up_proj.weight": torch.zeros(64, H),
         "layers.0.mlp.down_proj.weight": torch.zeros(H, 64), "norm.weight": torch.ones(H)}
    config = mha_config(num_attention_heads=heads, num_key_value_heads=heads, head_dim=head_dim,
                        draft_vocab_size=V)
    return write_draft(draft_dir, config, w)


@pytest.fixture(scope="module")
def eagle_drafts(tmp_path_factory):
    target = tmp_path_factory.mktemp("eagle_target")
    make_hf_checkpoint(target)
    base = tmp_path_factory.mktemp("drafts")
    rigged_target = tmp_path_factory.mktemp("rigged_target")
    make_hf_checkpoint(rigged_target)
    return {
        "mha": (target, write_draft(base / "mha", mha_config(), mha_weights())),
        "mla": (target, write_draft(base / "mla", mla_config(), mla_weights())),
        "first_step_mha": (rigged_target, rig_bigram_target_and_first_step_eagle(rigged_target, base / "rigged")),
    }


@pytest.mark.parametrize("k", [1, 2, 3, 5])
@pytest.mark.parametrize("kind", ["mha", "mla", "first_step_mha"])
def test_greedy_eagle3_equals_plain_greedy(eagle_drafts, kind, k):
    target, draft = eagle_drafts[kind]
    params = SamplingParams(temperature=0, max_tokens=23, ignore_eos=True)
    plain = run(target, params)
    spec = run(target, params, speculative_method="eagle", draft_model=draft, num_speculative_tokens=k)
    for a, b in zip(plain, spec):
        assert b.token_ids == a.token_ids
    first_position = sum(o.accepted_per_position[0] for o in spec) / len(spec)
    if kind == "first_step_mha":
        assert first_position > 0.9  # the rig works: the first draft is nearly always right
    else:
        assert first_position < 0.5


def test_eos_inside_an_accepted_eagle_run(eagle_drafts):
    target, draft = eagle_drafts["first_step_mha"]
    free = run(target, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    stop_ids = [out.token_ids[6] for out in free]
    params = SamplingParams(temperature=0, max_tokens=30, stop_token_ids=stop_ids)
    plain = run(target, params)
    spec = run(target, params, speculative_method="eagle", draft_model=draft, num_speculative_tokens=3)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert all(o.finish_reason == "stop" for o in spec)


def test_totals_add_up_the_requests(copying_mtp):
    llm = LLM(copying_mtp, speculative_method="mtp", num_speculative_tokens=3)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=17, ignore_eos=True))
    totals = llm.scheduler.metrics
    assert totals.num_drafted == sum(o.num_drafted for o in outs)
    assert totals.num_accepted == sum(o.num_accepted for o in outs)
    # each verify step commits its accepted drafts plus one token; the first token comes from the prefill
    assert sum(o.num_generated for o in outs) == len(outs) + totals.num_verify_steps + totals.num_accepted
    assert totals.as_dict()["acceptance_length"] > 3


def test_seeded_speculative_sampling_does_not_depend_on_the_batch(random_mtp):
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=16, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    alone = LLM(random_mtp, speculative_method="mtp").generate([[5, 6, 7]], seeded)[0]
    batched = LLM(random_mtp, speculative_method="mtp").generate([[9, 9], [5, 6, 7], [4]], [other, seeded, other])[1]
    assert alone.token_ids == batched.token_ids


def test_disable_batch_size_defaults_by_device():
    import argparse

    from eyas.engine_args import CPU_DISABLE_BATCH_SIZE, EngineArgs

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)

    def config(*argv):
        return EngineArgs.from_cli_args(parser.parse_args(["--speculative-method", "mtp", *argv])).speculative_config()

    assert config("--speculative-width", "fixed").disable_batch_size == CPU_DISABLE_BATCH_SIZE
    assert config("--speculative-width", "fixed", "--device", "cuda").disable_batch_size is None
    assert config("--speculative-width", "fixed", "--speculative-disable-batch-size", "0").disable_batch_size is None
    # the default: the width is measured, with no threshold unless one is given
    assert (config().adaptive_width, config().disable_batch_size) == (True, None)
    assert config("--speculative-disable-batch-size", "12").disable_batch_size == 12
    assert not config("--speculative-width", "fixed").adaptive_width
    assert config("--device", "cuda", "--speculative-disable-batch-size", "5").disable_batch_size == 5


def test_a_draft_given_with_plain_decoding_is_an_error_not_ignored():
    import argparse

    from eyas.engine_args import EngineArgs

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = parser.parse_args(["--speculative-method", "none", "--draft-model", "some/draft"])
    with pytest.raises(ValueError, match="--speculative-method none decodes without a draft, but --draft-model "
                       "some/draft is given"):
        EngineArgs.from_cli_args(args).speculative_config()
    assert EngineArgs.from_cli_args(parser.parse_args(["--speculative-method", "none"])).speculative_config() is None


def test_mixed_batch_width_caps_the_drafts_of_steps_that_prefill(copying_mtp):
    """With num_speculative_tokens_mixed_batch 1, a sequence decoding beside a prompt that is still being prefilled
    (chunks of 4 tokens) proposes at most one draft; once every prompt is in, K again. Output equals plain greedy."""
    config = SpeculativeConfig(method="mtp", num_speculative_tokens=3, num_speculative_tokens_mixed_batch=1)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm = LLM(copying_mtp, speculative_config=config, max_num_batched_tokens=6)
    first = llm.add_request([5, 6], params)
    while first.num_generated < 2:
        llm.step()
    second = llm.add_request(list(range(10, 30)), params)  # 20 prompt tokens: several chunked steps
    drafts_while_prefilling, drafts_after = [], []
    while llm.scheduler.has_work():
        llm.step()
        if not first.is_finished:
            prefilling = second.num_computed < second.num_prompt_tokens
            (drafts_while_prefilling if prefilling else drafts_after).append(len(first.draft_tokens))
    assert drafts_while_prefilling and max(drafts_while_prefilling) <= 1
    assert max(drafts_after) == 3
    plain = LLM(copying_mtp).generate([[5, 6], list(range(10, 30))], params)
    assert [llm.output(first).token_ids, llm.output(second).token_ids] == [o.token_ids for o in plain]
