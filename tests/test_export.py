"""Draft export, FP8 drafts and `eyas inspect`: every format loads back bit for bit, each file is in its engine's
layout, FP8 drafts stay within FP8's error and keep speculative greedy output exact, and inspect catches an
off-by-one aux-id convention."""

import argparse
import json
import re

import pytest
import torch
from safetensors import safe_open
from tiny import (
    DV,
    MODELOPT_EAGLE_CONFIG,
    H,
    V,
    assert_same_draft,
    make_hf_checkpoint,
    mha_config,
    mha_weights,
    mla_config,
    mla_weights,
    write_draft,
)

from eyas import LLM, SamplingParams
from eyas import export as export_mod
from eyas import inspect as inspect_mod
from eyas.checkpoint import load_draft
from eyas.export import FORMATS, ExportError, quantize_draft_fp8, save_draft
from eyas.inspect import inspect_pair
from eyas.models.eagle3 import AUX_CONVENTION_FIELD, AUX_IDS_FIELD

ARCHITECTURES = {  # format -> (MHA architecture, MLA architecture, MLA model_type), DESIGN.md §4
    "eyas": ("LlamaForCausalLMEagle3", "Eagle3DeepseekV2ForCausalLM", "deepseek_v2"),
    "vllm": ("Eagle3LlamaForCausalLM", "Eagle3DeepseekV2ForCausalLM", "deepseek_v2"),
    "sglang": ("LlamaForCausalLMEagle3", "DeepseekV3ForCausalLMEagle3", "deepseek_v3"),
    "modelopt": ("LlamaForCausalLMEagle3", "Eagle3DeepseekV2ForCausalLM", "kimi_k2"),
    "max": ("LlamaForCausalLMEagle3", "Eagle3DeepseekV2ForCausalLM", "deepseek_v2"),
}

# the formats whose config.json is one flat HF config (speculators nests the layer's: tests/test_eagle31.py)
FLAT_FORMATS = sorted(f for f in FORMATS if f != "speculators")


def uncompressed_mla():
    w = mla_weights()
    del w["d2t"], w["t2d"]
    w["lm_head.weight"] = torch.randn(V, H, generator=torch.Generator().manual_seed(3)) * 0.15
    return dict(mla_config(), draft_vocab_size=V), w


def q_proj_mla():
    """An MLA draft with q_lora_rank null (DeepSeek-V2-Lite style q_proj)."""
    cfg, w = dict(mla_config(), q_lora_rank=None), mla_weights()
    a = "layers.0.self_attn."
    del w[a + "q_a_proj.weight"], w[a + "q_a_layernorm.weight"], w[a + "q_b_proj.weight"]
    w[a + "q_proj.weight"] = torch.randn(4 * 16, 2 * H, generator=torch.Generator().manual_seed(4)) * 0.15
    return cfg, w


DRAFTS = {
    "mha": lambda: (mha_config(), mha_weights()),
    "mha-full-vocab": lambda: (mha_config(draft_vocab_size=V), mha_weights(compressed=False)),
    "mla": lambda: (mla_config(), mla_weights()),
    "mla-full-vocab": uncompressed_mla,
}


@pytest.fixture(scope="module")
def drafts(target, tmp_path_factory):
    root = tmp_path_factory.mktemp("drafts")
    return {name: load_draft(write_draft(root / name, *make()), target) for name, make in DRAFTS.items()}


def read(path):
    config = json.loads((path / "config.json").read_text())
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    return config, tensors


@pytest.mark.parametrize("fmt", FLAT_FORMATS)
@pytest.mark.parametrize("name", sorted(DRAFTS))
def test_export_loads_back_bit_exact(target, drafts, tmp_path, fmt, name):
    draft = drafts[name]
    again = load_draft(save_draft(draft, tmp_path / fmt, fmt), target)
    assert_same_draft([draft, again])  # state dicts and two steps of logits torch.equal, same aux ids
    assert again.aux_hidden_state_ids == draft.aux_hidden_state_ids == (1, 2, 3)
    assert again.config.rope == draft.config.rope
    assert again.load_report["lm_head"] == draft.load_report["lm_head"] == "own"


@pytest.mark.parametrize("fmt", FLAT_FORMATS)
@pytest.mark.parametrize("name", sorted(DRAFTS))
def test_files_are_in_each_engines_layout(drafts, tmp_path, fmt, name):
    draft, mla, compressed = drafts[name], name.startswith("mla"), "full" not in name
    config, tensors = read(save_draft(draft, tmp_path / fmt, fmt))
    mha_arch, mla_arch, mla_type = ARCHITECTURES[fmt]
    assert config["architectures"] == [mla_arch if mla else mha_arch]
    assert config["model_type"] == (mla_type if mla else "llama")
    prefix = "midlayer." if fmt == "sglang" else "layers.0."
    layer_keys = [k for k in tensors if k not in ("fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d")]
    assert layer_keys and all(k.startswith(prefix) for k in layer_keys)
    assert "lm_head.weight" in tensors and not any("embed_tokens" in k for k in tensors)
    assert ("d2t" in tensors) == compressed  # vLLM refuses a d2t when the draft vocab is the target's
    assert ("t2d" in tensors) == (compressed and fmt != "modelopt")  # Model Optimizer's key check rejects t2d
    assert config["draft_vocab_size"] == (DV if compressed else V)
    assert config["target_hidden_size"] == H and config["num_aux_hidden_states"] == 3
    eagle = config["eagle_config"]
    if fmt == "modelopt":  # layer outputs, one lower, with the keys Model Optimizer's template writes
        assert eagle[AUX_IDS_FIELD] == [0, 1, 2] and eagle[AUX_CONVENTION_FIELD] == "layer_output"
        assert MODELOPT_EAGLE_CONFIG.items() <= eagle.items() and AUX_IDS_FIELD not in config
    else:
        assert eagle[AUX_IDS_FIELD] == [1, 2, 3] and eagle[AUX_CONVENTION_FIELD] == "hidden_states"
    if fmt in ("eyas", "vllm", "max"):
        assert config[AUX_IDS_FIELD] == [1, 2, 3] and config[AUX_CONVENTION_FIELD] == "hidden_states"
    if mla:
        assert config["q_lora_rank"] == 16 and isinstance(config.get("n_routed_experts") or 0, int)
        assert config["rope_scaling"]["type"] == "yarn" and config["rope_interleave"] is True


def test_export_refuses_what_an_engine_cannot_load(target, tmp_path):
    draft = load_draft(write_draft(tmp_path / "src", *q_proj_mla()), target)
    with pytest.raises(ExportError, match="q_lora_rank is null.*vLLM"):
        save_draft(draft, tmp_path / "vllm", "vllm")
    # SGLang builds its own q_proj for such drafts; the export still loads back exactly
    assert_same_draft([draft, load_draft(save_draft(draft, tmp_path / "sglang", "sglang"), target)])
    (tmp_path / "stale").mkdir()
    (tmp_path / "stale" / "model-00001-of-00002.safetensors").write_bytes(b"")
    with pytest.raises(ExportError, match="model-00001-of-00002.safetensors"):
        save_draft(draft, tmp_path / "stale", "eyas")
    with pytest.raises(ExportError, match="format 'trtllm'"):
        save_draft(draft, tmp_path / "x", "trtllm")


def test_shared_lm_head_is_written_and_shared_again(target, tmp_path):
    w = mha_weights(compressed=False)
    del w["lm_head.weight"]
    draft = load_draft(write_draft(tmp_path / "src", mha_config(draft_vocab_size=V), w), target)
    assert draft.lm_head is target.lm_head
    out = save_draft(draft, tmp_path / "out", "vllm")
    assert torch.equal(read(out)[1]["lm_head.weight"], target.lm_head.weight)
    again = load_draft(out, target)
    assert again.lm_head is target.lm_head and "equals the target's" in again.load_report["lm_head"]
    assert_same_draft([draft, again])


def test_rope_scaling_injection(drafts, target, tmp_path):
    scaling = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
    config, _ = read(save_draft(drafts["mha"], tmp_path / "mha", "vllm", rope_scaling=scaling))
    assert config["rope_scaling"]["type"] == "yarn" and config["rope_scaling"]["factor"] == 4.0
    assert config["rope_scaling"]["original_max_position_embeddings"] == 128
    assert config["max_position_embeddings"] == 512 and "rope_interleave" not in config
    rope = load_draft(tmp_path / "mha", target).config.rope
    assert (rope.type, rope.factor, rope.original_max_position_embeddings, rope.interleave) == ("yarn", 4.0, 128,
                                                                                                False)
    assert load_draft(tmp_path / "mha", target).rotary.cos.shape[0] == 512
    # an MLA draft already on YaRN keeps its mscale settings, takes the new factor
    save_draft(drafts["mla"], tmp_path / "mla", "eyas", rope_scaling={"type": "yarn", "factor": 8.0,
                                                                      "original_max_position_embeddings": 64})
    rope = load_draft(tmp_path / "mla", target).config.rope
    assert (rope.factor, rope.original_max_position_embeddings, rope.mscale_all_dim) == (8.0, 64, 1.0)
    with pytest.raises(ExportError, match="rope_scaling.type is 'linear'"):
        save_draft(drafts["mha"], tmp_path / "bad", "eyas", rope_scaling={"type": "linear", "factor": 2.0})


def test_fp8_draft_is_within_fp8_error_and_keeps_greedy_output_exact(target_path, target, tmp_path):
    src = write_draft(tmp_path / "src", mha_config(), mha_weights())
    report = quantize_draft_fp8(src, tmp_path / "fp8", target, block=16)
    config, tensors = read(tmp_path / "fp8")
    assert config["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [16, 16],
                                             "activation_scheme": "dynamic"}
    assert len(report["quantized"]) == 8 and "lm_head.weight" not in report["quantized"]  # fc + 4 attn + 3 mlp
    for key in report["quantized"]:
        assert tensors[key].dtype == torch.float8_e4m3fn and tensors[key + "_scale_inv"].dtype == torch.float32
    assert tensors["lm_head.weight"].dtype == torch.float32 and tensors["norm.weight"].dtype == torch.float32
    assert tensors["fc.weight_scale_inv"].shape == (H // 16, 3 * H // 16)
    assert report["bytes_after"] < report["bytes_before"]

    original, fp8 = load_draft(src, target).state_dict(), load_draft(tmp_path / "fp8", target)
    assert fp8.load_report["fp8"]
    worst = 0.0
    for key, value in fp8.state_dict().items():
        if key not in report["quantized"]:
            assert torch.equal(value, original[key]), key
            continue
        # e4m3 keeps 3 mantissa bits: each value is within blockmax / 16 of the weight
        bound = tensors[key + "_scale_inv"].repeat_interleave(16, 0).repeat_interleave(16, 1) * 448 / 16
        error = (value - original[key]).abs()
        assert (error <= bound).all(), key
        worst = max(worst, error.max().item())
    assert 0 < worst == report["max_abs_error"]

    with_head = quantize_draft_fp8(src, tmp_path / "fp8-head", target, block=16, include_lm_head=True)
    assert "lm_head.weight" in with_head["quantized"]

    prompts, params = [[5, 6, 7], list(range(10, 30))], SamplingParams(temperature=0, max_tokens=8)
    plain = LLM(target_path, max_num_seqs=2, block_size=4).generate(prompts, params)
    spec = LLM(target_path, max_num_seqs=2, block_size=4, speculative_method="eagle", draft_model=tmp_path / "fp8",
               num_speculative_tokens=3).generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]


@pytest.fixture(scope="module")
def deep_target_path(tmp_path_factory):
    """8 layers, so the two conventions' defaults differ: hidden_states (2, 4, 5), Model Optimizer [1, 3, 4]."""
    path = tmp_path_factory.mktemp("deep")
    make_hf_checkpoint(path, num_hidden_layers=8)
    return path


def test_inspect_reports_a_good_pair(target_path, drafts, tmp_path):
    out = save_draft(drafts["mla"], tmp_path / "d", "modelopt")
    text, ok = inspect_pair(target_path, out)
    assert ok, text
    assert "Eagle3DeepseekV2ForCausalLM (MLA)" in text and "fc input 96 = 3 x 32" in text
    assert "eagle_config.eagle_aux_hidden_state_layer_ids = [0, 1, 2]" in text
    assert re.search(r"aux ids \(hidden_states\) +\[1, 2, 3\]", text) and "layer_output (the file names it" in text
    assert "draft 48 of 96; d2t present (t2d derived from d2t); covers 48 target ids" in text
    assert "OK: the pair fits" in text


def test_inspect_catches_an_off_by_one_convention(deep_target_path, tmp_path):
    # a Model Optimizer draft (layer-output ids, its defaults for 8 layers) whose config lost the ModelOpt keys
    draft = write_draft(tmp_path / "modelopt", mha_config(ids=(1, 3, 4)), mha_weights())
    text, ok = inspect_pair(deep_target_path, draft)
    assert not ok
    assert "possibly layer_output convention; pass --aux-layer-convention" in text
    assert re.search(r"read as hidden_states +\[1, 3, 4\]", text)
    assert re.search(r"read as layer_output +\[2, 4, 5\]", text)
    text, ok = inspect_pair(deep_target_path, draft, aux_convention="layer_output")
    assert ok, text
    # the other way: ModelOpt keys, but the ids are the standard hidden_states ones
    cfg = mha_config(ids=(2, 4, 5), eagle_config=MODELOPT_EAGLE_CONFIG)
    text, ok = inspect_pair(deep_target_path, write_draft(tmp_path / "mixed", cfg, mha_weights()))
    assert not ok and "possibly hidden_states convention" in text
    # an eyas export names its convention: nothing to guess
    text, ok = inspect_pair(deep_target_path, write_draft(tmp_path / "named", mha_config(
        ids=(1, 3, 4), eagle_config={AUX_CONVENTION_FIELD: "hidden_states"}), mha_weights()))
    assert ok, text


def test_inspect_flags_mismatches(target_path, tmp_path):
    text, ok = inspect_pair(target_path, write_draft(tmp_path / "final", mha_config(ids=(1, 2, 4)), mha_weights()))
    assert not ok and "fuses the final decoder layer's output" in text
    text, ok = inspect_pair(target_path, write_draft(tmp_path / "wide", mha_config(hidden_size=64), mha_weights()))
    assert not ok and "'hidden_size' is 64" in text
    text, ok = inspect_pair(target_path, write_draft(tmp_path / "ok", mha_config(), mha_weights()))
    assert ok and "draft rope" not in text  # same rope as the target
    text, ok = inspect_pair(target_path, method="mtp")  # transformers saves no MTP weights
    assert not ok and "needs the target's MTP layer" in text


def test_cli(target_path, tmp_path, capsys):
    parser = argparse.ArgumentParser(prog="eyas")
    sub = parser.add_subparsers(dest="command", required=True)
    export_mod.add_cli(sub)
    inspect_mod.add_cli(sub)

    def run(*argv):
        args = parser.parse_args([str(a) for a in argv])
        return args.func(args)

    src = write_draft(tmp_path / "src", mla_config(), mla_weights(), "midlayer.")
    assert run("export", src, tmp_path / "vllm", "--format", "vllm", "--target", target_path,
               "--rope-scaling-factor", 2, "--rope-original-max-position-embeddings", 256) == 0
    config, tensors = read(tmp_path / "vllm")
    assert config["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and "layers.0.hidden_norm.weight" in tensors
    assert config["rope_scaling"]["factor"] == 2.0 and config["max_position_embeddings"] == 512
    assert "wrote" in capsys.readouterr().out
    assert run("export", src, tmp_path / "x", "--format", "max", "--rope-scaling-factor", 2) == 2
    assert run("quantize-draft", src, tmp_path / "fp8", "--fp8", "--block-size", 16, "--target", target_path) == 0
    # block FP8 is the only scheme: the flag may be left out, and the same bytes come out
    assert run("quantize-draft", src, tmp_path / "fp8-default", "--block-size", 16, "--target", target_path) == 0
    assert ((tmp_path / "fp8-default" / "model.safetensors").read_bytes() ==
            (tmp_path / "fp8" / "model.safetensors").read_bytes())
    assert read(tmp_path / "fp8")[1]["fc.weight"].dtype == torch.float8_e4m3fn
    assert "max abs weight error" in capsys.readouterr().out

    assert run("inspect", target_path, tmp_path / "vllm") == 0
    assert "draft rope (yarn" in capsys.readouterr().out  # a warning, not a mismatch
    assert run("inspect", target_path, tmp_path / "fp8", "--json") == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["draft"]["aux ids (hidden_states)"] == [1, 2, 3]
    bad = write_draft(tmp_path / "bad", mha_config(ids=(1, 2, 4)), mha_weights())
    assert run("inspect", target_path, bad) == 1
    assert run("inspect", target_path, tmp_path / "missing") == 2
    assert run("inspect", tmp_path / "missing") == 2
    assert "eyas inspect: error" in capsys.readouterr().err
