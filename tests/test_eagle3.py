"""EAGLE-3 drafts: every engine's layout loads to the same draft, the forward is EAGLE-3's, paged equals batched,
d2t scatters to the right target ids, and bad files fail naming what is wrong."""

import logging

import pytest
import torch
from tiny import (
    BASE,
    DV,
    MODELOPT_EAGLE_CONFIG,
    H,
    V,
    assert_same_draft,
    mha_config,
    mha_weights,
    mla_config,
    mla_weights,
    rms,
    write_draft,
)

from eyas import LLM, SamplingParams
from eyas.checkpoint import CheckpointError, canonical_key, load_draft
from eyas.config import ConfigError, DeepseekV3Config
from eyas.models.attention import AttentionMetadata
from eyas.models.deepseek_v3 import DeepseekV3ForCausalLM


def test_canonical_keys():
    assert canonical_key("midlayer.self_attn.q_proj.weight") == "layers.0.self_attn.q_proj.weight"
    assert canonical_key("model.layers.0.hidden_norm.weight") == "layers.0.hidden_norm.weight"
    assert canonical_key("model.fc.weight") == "fc.weight"
    assert canonical_key("model.embed_tokens.weight") == "embed_tokens.weight"
    assert canonical_key("layers.0.mlp.up_proj.weight") == "layers.0.mlp.up_proj.weight"
    assert canonical_key("lm_head.weight") == "lm_head.weight" and canonical_key("d2t") == "d2t"


def test_mha_layouts_of_vllm_sglang_and_modelopt_load_to_one_draft(target, tmp_path):
    w = mha_weights()
    vllm = load_draft(write_draft(tmp_path / "vllm", mha_config("Eagle3LlamaForCausalLM", where="top"),
                                  w | {"t2d": torch.zeros(V, dtype=torch.bool).index_fill_(
                                      0, torch.arange(DV) + w["d2t"], True)}, "model."), target)
    sglang = load_draft(write_draft(tmp_path / "sglang", mha_config(), w, "midlayer."), target)
    # Model Optimizer: layer-output ids, written one lower; d2t without t2d
    modelopt_config = mha_config(ids=(0, 1, 2), eagle_config=MODELOPT_EAGLE_CONFIG)
    modelopt = load_draft(write_draft(tmp_path / "modelopt", modelopt_config, w), target)
    assert_same_draft([vllm, sglang, modelopt])
    assert [d.aux_hidden_state_ids for d in (vllm, sglang, modelopt)] == [(1, 2, 3)] * 3
    assert vllm.load_report["layout"].startswith("model.layers.0.")
    assert sglang.load_report["layout"].startswith("midlayer.")
    assert modelopt.load_report["layout"].startswith("layers.0.")
    assert sglang.config.aux_convention_assumed.startswith("hidden_states")
    assert modelopt.config.aux_convention_assumed.startswith("layer_output")
    assert "use_input_layernorm_in_first_layer" in modelopt.config.aux_convention_assumed
    assert modelopt.load_report["d2t"] == "present (t2d derived from d2t)"
    assert set(sglang.state_dict()) >= {"fc.weight", "layers.0.hidden_norm.weight", "norm.weight", "lm_head.weight",
                                        "d2t", "t2d", "layers.0.self_attn.q_proj.weight"}
    assert sglang.embed_tokens is target.model.embed_tokens
    assert sglang.cache_entry_shape() == (2, 2, 8)


def test_mla_layouts_of_max_vllm_and_modelopt_load_to_one_draft(target, tmp_path):
    w = mla_weights()
    max_ = load_draft(write_draft(tmp_path / "max", mla_config(), w), target)
    vllm = load_draft(write_draft(tmp_path / "vllm", mla_config("Eagle3DeepseekV3ForCausalLM"), w, "midlayer."),
                      target)
    # Model Optimizer's MLA export: kimi_k2 fields, one layer, fc.weight; ids are layer outputs
    modelopt = load_draft(write_draft(tmp_path / "modelopt", mla_config("DeepseekV3ForCausalLM", "kimi_k2",
                                                                        ids=(0, 1, 2), **MODELOPT_EAGLE_CONFIG), w),
                          target)
    assert_same_draft([max_, vllm, modelopt])
    assert max_.aux_hidden_state_ids == modelopt.aux_hidden_state_ids == (1, 2, 3)
    assert "Model Optimizer MLA export" in modelopt.load_report["architecture"]
    assert max_.cache_entry_shape() == (24 + 8,)
    assert "layers.0.self_attn.kv_a_proj_with_mqa.weight" in max_.state_dict()


def reference_mha_draft(w, aux, tokens, embed):
    """EAGLE-3's Llama draft written out as transformers computes it (rotate-half rope, repeat_kv)."""
    B, T = tokens.shape
    g = torch.cat(aux, -1) @ w["fc.weight"].T
    x = torch.cat([rms(embed[tokens], w["layers.0.input_layernorm.weight"]),
                   rms(g, w["layers.0.hidden_norm.weight"])], -1)
    p = "layers.0.self_attn."
    q = (x @ w[p + "q_proj.weight"].T).view(B, T, 4, 8).transpose(1, 2)
    k = (x @ w[p + "k_proj.weight"].T).view(B, T, 2, 8).transpose(1, 2)
    v = (x @ w[p + "v_proj.weight"].T).view(B, T, 2, 8).transpose(1, 2)
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, 8, 2).float() / 8)
    freqs = torch.outer(torch.arange(T).float(), inv_freq)
    cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()

    def rotate_half(t):
        return torch.cat([-t[..., 4:], t[..., :4]], -1)

    q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    scores = q @ k.transpose(-1, -2) / 8 ** 0.5 + torch.full((T, T), float("-inf")).triu(1)
    attn = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, 32) @ w[p + "o_proj.weight"].T
    h = g + attn
    m = rms(h, w["layers.0.post_attention_layernorm.weight"])
    mlp = (torch.nn.functional.silu(m @ w["layers.0.mlp.gate_proj.weight"].T) * (m @ w["layers.0.mlp.up_proj.weight"].T)
           ) @ w["layers.0.mlp.down_proj.weight"].T
    pre = h + mlp
    draft_logits = rms(pre, w["norm.weight"]) @ w["lm_head.weight"].T
    logits = torch.full((B, T, V), float("-inf"))
    logits[..., torch.arange(DV) + w["d2t"]] = draft_logits
    return pre, logits


def test_mha_draft_forward_is_eagle3_on_the_targets_aux_states(target, tmp_path):
    w = mha_weights()
    draft = load_draft(write_draft(tmp_path / "d", mha_config(), w, "midlayer."), target)
    ids = torch.randint(0, V, (1, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        _, aux = target.model(ids, aux_hidden_state_ids=draft.aux_hidden_state_ids)
        pre = draft(draft.combine_hidden_states(None, aux), ids.roll(-1, -1))
        logits = draft.compute_logits(pre)
        ref_pre, ref_logits = reference_mha_draft(w, aux, ids.roll(-1, -1), target.model.embed_tokens.weight)
    assert [a.shape for a in aux] == [(1, 10, H)] * 3
    assert (pre - ref_pre).abs().max() < 1e-5
    finite = torch.isfinite(ref_logits)
    assert torch.equal(torch.isfinite(logits), finite)
    assert (logits[finite] - ref_logits[finite]).abs().max() < 1e-4


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_paged_path_equals_batched_path(target, tmp_path, kind):
    """Three sequences prefilled in uneven chunks, then decoded one token at a time, in ragged batches over a
    paged cache with non-contiguous blocks: every row equals the batched no-cache forward of its sequence."""
    w, cfg = (mha_weights(), mha_config()) if kind == "mha" else (mla_weights(), mla_config())
    draft = load_draft(write_draft(tmp_path / kind, cfg, w), target)
    schedule = [[4, 2, 3], [3, 2, 1], [1, 1, 1], [1, 0, 1]]  # tokens per sequence per step
    lengths = [sum(step[b] for step in schedule) for b in range(3)]  # 9, 5, 6
    tables, block_size = [[0, 3, 6], [1, 4], [2, 5]], 4
    g = torch.Generator().manual_seed(4)
    hidden = [torch.randn(1, n, H, generator=g) for n in lengths]
    tokens = [torch.randint(0, V, (1, n), generator=g) for n in lengths]
    cache = torch.zeros(7 * block_size, *draft.cache_entry_shape())
    done, worst = [0, 0, 0], 0.0
    with torch.no_grad():
        reference = [draft(hidden[b], tokens[b])[0] for b in range(3)]
        for step in schedule:
            rows = [b for b in range(3) if step[b]]
            attn = AttentionMetadata.build([step[b] for b in rows], [done[b] + step[b] for b in rows],
                                           [tables[b] for b in rows], block_size)
            out = draft(torch.cat([hidden[b][0, done[b]:done[b] + step[b]] for b in rows]),
                        torch.cat([tokens[b][0, done[b]:done[b] + step[b]] for b in rows]), attn, cache)
            start = 0
            for b in rows:
                ref = reference[b][done[b]:done[b] + step[b]]
                worst = max(worst, (out[start:start + step[b]] - ref).abs().max().item())
                start += step[b]
                done[b] += step[b]
    assert done == lengths
    assert worst < 1e-5, worst


def test_compute_logits_scatters_draft_ids_through_d2t(target, tmp_path):
    w = mha_weights()
    draft = load_draft(write_draft(tmp_path / "d", mha_config(), w), target)
    pre = torch.randn(3, H)
    with torch.no_grad():
        logits, draft_logits = draft.compute_logits(pre), draft.lm_head(draft.norm(pre))
    assert logits.shape == (3, V) and draft_logits.shape == (3, DV)
    d2t = w["d2t"]
    for i in range(DV):
        assert torch.equal(logits[:, i + d2t[i]], draft_logits[:, i])
    outside = torch.ones(V, dtype=torch.bool)
    outside[torch.arange(DV) + d2t] = False
    assert torch.isneginf(logits[:, outside]).all() and outside.sum() == V - DV
    assert torch.equal(draft.t2d, ~outside)


def test_uncompressed_draft_without_lm_head_shares_the_targets(target, tmp_path):
    w = mha_weights(compressed=False)
    del w["lm_head.weight"]
    draft = load_draft(write_draft(tmp_path / "d", mha_config(draft_vocab_size=V), w), target)
    assert draft.lm_head is target.lm_head and "lm_head.weight" in draft.load_report["shared_weights"]
    assert "d2t" not in draft.state_dict()
    pre = torch.randn(2, H)
    with torch.no_grad():
        assert torch.equal(draft.compute_logits(pre), target.lm_head(draft.norm(pre)))


def test_fp8_draft_weights_are_dequantized(target, tmp_path):
    w = mha_weights()
    stored, expected = dict(w), {}
    for key, t in w.items():
        if key.endswith("proj.weight"):  # block-quantize every projection in 16x16 blocks
            rows, cols = t.shape
            blocks = t.view(rows // 16, 16, cols // 16, 16)
            scale = blocks.abs().amax(dim=(1, 3)) / 448.0  # [rows/16, cols/16]
            q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).view(rows, cols)
            stored[key], stored[key + "_scale_inv"] = q, scale
            expected[key] = (q.float().view(rows // 16, 16, cols // 16, 16) * scale[:, None, :, None]).view(rows, cols)
    cfg = mha_config(quantization_config={"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [16, 16]})
    draft = load_draft(write_draft(tmp_path / "d", cfg, stored), target)
    state = draft.state_dict()
    assert draft.load_report["fp8"] and len(expected) == 7
    for key, value in expected.items():
        assert torch.equal(state[key], value), key


def test_override_reads_ids_as_layer_outputs(target, tmp_path):
    path = write_draft(tmp_path / "d", mha_config(), mha_weights())
    assert load_draft(path, target).aux_hidden_state_ids == (1, 2, 3)
    draft = load_draft(path, target, aux_convention="layer_output")
    assert draft.aux_hidden_state_ids == (2, 3, 4)
    assert draft.config.aux_convention_assumed == "layer_output (set by the aux_convention argument)"
    with pytest.raises(ConfigError, match="aux_convention"):
        load_draft(path, target, aux_convention="layer_outputs")


def test_convention_named_in_the_file_wins(target, tmp_path):
    cfg = mha_config(ids=(0, 1, 2), eagle_config={"eagle_aux_hidden_state_layer_ids_convention": "layer_output"})
    draft = load_draft(write_draft(tmp_path / "d", cfg, mha_weights()), target)
    assert draft.aux_hidden_state_ids == (1, 2, 3)
    assert "eagle_config.eagle_aux_hidden_state_layer_ids_convention" in draft.config.aux_convention_assumed


def test_modelopt_default_ids_and_missing_ids_on_a_deeper_target(tmp_path, caplog):
    """8 layers: Model Optimizer's default [1, 3, 4] is read as layer outputs, i.e. the standard (2, 4, 5);
    no ids at all means the standard ids, with a warning."""
    raw = dict(BASE, num_hidden_layers=8, n_routed_experts=None, architectures=["DeepseekV3ForCausalLM"])
    deep = DeepseekV3ForCausalLM(DeepseekV3Config.from_dict(raw))
    draft = load_draft(write_draft(tmp_path / "a", mha_config(ids=(1, 3, 4)), mha_weights()), deep)
    assert draft.aux_hidden_state_ids == (2, 4, 5)
    assert "Model Optimizer's default" in draft.config.aux_convention_assumed
    assert load_draft(write_draft(tmp_path / "b", mha_config(ids=(2, 4, 5)), mha_weights()),
                      deep).aux_hidden_state_ids == (2, 4, 5)
    with caplog.at_level(logging.WARNING, logger="eyas"):
        draft = load_draft(write_draft(tmp_path / "c", mha_config(ids=None), mha_weights()), deep)
    assert draft.aux_hidden_state_ids == (2, 4, 5) and "eagle_aux_hidden_state_layer_ids" in caplog.text


def test_errors_name_what_is_wrong(target, tmp_path):
    def load(name, cfg, w, **kw):
        return load_draft(write_draft(tmp_path / name, cfg, w), target, **kw)

    with pytest.raises(CheckpointError, match=r"'fc.weight' has shape \(32, 128\).*64 or 96"):
        load("width", mha_config(), mha_weights() | {"fc.weight": torch.zeros(H, 4 * H)})
    with pytest.raises(ConfigError, match="eagle_aux_hidden_state_layer_ids.*2 ids"):
        load("count", mha_config(), mha_weights(n_aux=2))
    with pytest.raises(ConfigError, match=r"\[1, 2, 5\].*outside a 4-layer target"):
        load("range", mha_config(ids=(1, 2, 5)), mha_weights())
    with pytest.raises(ConfigError, match=r"\[1, 1, 2\].*repeat"):
        load("repeat", mha_config(ids=(1, 1, 2)), mha_weights())
    with pytest.raises(ConfigError, match="'vocab_size' is 100; expected the target's vocab_size 96"):
        load("vocab", mha_config(vocab_size=100), mha_weights())
    with pytest.raises(ConfigError, match="'hidden_size' is 64"):
        load("hidden", mha_config(hidden_size=64), mha_weights())
    w = mha_weights()
    del w["layers.0.mlp.up_proj.weight"]
    with pytest.raises(CheckpointError, match="missing: layers.0.mlp.up_proj.weight"):
        load("missing", mha_config(), w)
    with pytest.raises(CheckpointError, match="'d2t' has shape \\(40,\\)"):
        load("d2t", mha_config(), mha_weights() | {"d2t": torch.zeros(40, dtype=torch.long)})
    with pytest.raises(CheckpointError, match="'lm_head.weight' has 96 rows; expected draft_vocab_size=48"):
        load("head", mha_config(), mha_weights() | {"lm_head.weight": torch.zeros(V, H)})
    w = mha_weights()
    del w["lm_head.weight"]
    with pytest.raises(CheckpointError, match="'lm_head.weight' is missing.*draft_vocab_size is 48"):
        load("nohead", mha_config(), w)
    with pytest.raises(ConfigError, match=r"\['LlamaForCausalLM'\].*\(eagle, LlamaForCausalLMEagle3\).*"
                                          r"\(eagle, Eagle3DeepseekV2ForCausalLM\)"):
        load("arch", mha_config("LlamaForCausalLM"), mha_weights())


def test_embed_tokens_in_the_file_is_ignored_and_a_different_one_warns(target, tmp_path, caplog):
    same = mha_weights() | {"embed_tokens.weight": target.model.embed_tokens.weight.detach().clone()}
    with caplog.at_level(logging.WARNING, logger="eyas"):
        draft = load_draft(write_draft(tmp_path / "same", mha_config(), same), target)
    assert "embed_tokens" not in caplog.text
    random = mha_weights() | {"model.embed_tokens.weight": torch.randn(V, H)}
    with caplog.at_level(logging.WARNING, logger="eyas"):
        draft = load_draft(write_draft(tmp_path / "random", mha_config(), random), target)
    assert "embed_tokens.weight differs from the target's" in caplog.text
    assert draft.embed_tokens is target.model.embed_tokens
    assert "embed_tokens.weight" in draft.load_report["shared_weights"]


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_speculative_greedy_with_an_eagle3_draft_equals_plain_greedy(target_path, tmp_path, kind):
    """Through the engine: a random draft (mostly rejected) over several ragged sequences changes no token."""
    w, cfg = (mha_weights(), mha_config()) if kind == "mha" else (mla_weights(), mla_config())
    draft_path = write_draft(tmp_path / kind, cfg, w)
    prompts, params = [[5, 6, 7], list(range(10, 30)), [17]], SamplingParams(temperature=0, max_tokens=8)
    plain = LLM(target_path, max_num_seqs=3, block_size=4, max_num_batched_tokens=11).generate(prompts, params)
    llm = LLM(target_path, max_num_seqs=3, block_size=4, max_num_batched_tokens=11, speculative_method="eagle",
              draft_model=draft_path, num_speculative_tokens=3)
    spec = llm.generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert llm.draft.aux_hidden_state_ids == (1, 2, 3)


def test_greedy_tokens_are_the_argmax_of_the_target_vocab_logits(target, tmp_path):
    draft = load_draft(write_draft(tmp_path / "d", mha_config(), mha_weights()), target)
    prenorm = torch.randn(5, H)
    with torch.no_grad():
        assert torch.equal(draft.greedy_tokens(prenorm), draft.compute_logits(prenorm).argmax(-1))
