"""Checkpoint reading: sharded indexes, pickles refused, key and shape errors, the MTP layer."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny import YARN, add_mtp_weights, hf_config, make_hf_checkpoint

from eyas import load_model
from eyas.checkpoint import CheckpointError
from eyas.models.attention import AttentionMetadata


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    return path, make_hf_checkpoint(path, rope_parameters=YARN)


def test_sharded_index_loads_like_single_file(checkpoint, tmp_path):
    path, ref = checkpoint
    ref.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 3
    ids = torch.randint(0, 96, (1, 10))
    with torch.no_grad():
        a, b = load_model(tmp_path)(ids), load_model(path)(ids)
        assert torch.equal(a, b), (a - b).abs().max()


def test_index_naming_a_missing_shard(checkpoint, tmp_path):
    path, ref = checkpoint
    ref.save_pretrained(tmp_path, max_shard_size="20KB")
    victim = sorted(tmp_path.glob("*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=victim.name):
        load_model(tmp_path)


def test_pickles_are_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dict(hf_config().to_dict(),
                                                          architectures=["DeepseekV3ForCausalLM"])))
    torch.save({"w": torch.zeros(1)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="pickle"):
        load_model(tmp_path)


def test_unexpected_key_and_wrong_shape(checkpoint, tmp_path):
    path, _ = checkpoint
    shutil.copytree(path, tmp_path / "a")
    tensors = load_file(tmp_path / "a" / "model.safetensors")
    tensors["model.layers.0.self_attn.extra.weight"] = torch.zeros(2)
    save_file(tensors, tmp_path / "a" / "model.safetensors")
    with pytest.raises(CheckpointError, match="unexpected.*model.layers.0.self_attn.extra.weight"):
        load_model(tmp_path / "a")
    del tensors["model.layers.0.self_attn.extra.weight"]
    tensors["model.layers.1.self_attn.kv_b_proj.weight"] = torch.zeros(3, 3)
    save_file(tensors, tmp_path / "a" / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"kv_b_proj.weight.*\(3, 3\)"):
        load_model(tmp_path / "a")


def test_config_errors_name_the_field(checkpoint, tmp_path):
    path, _ = checkpoint
    shutil.copytree(path, tmp_path / "a")
    config = json.loads((path / "config.json").read_text())
    for field, value, expected in [("scoring_func", "softmax", "scoring_func"), ("n_group", 3, "n_group"),
                                   ("rope_parameters", {"rope_type": "longrope", "rope_theta": 1.0}, "longrope")]:
        bad = dict(config, **{field: value})
        (tmp_path / "a" / "config.json").write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=expected):
            load_model(tmp_path / "a")


def test_mtp_layer_matches_a_transformers_decoder_layer(tmp_path):
    """The MTP layer = eh_proj(cat(enorm(emb(next)), hnorm(h))) through a full decoder layer; the decoder part is
    checked against transformers' DeepseekV3DecoderLayer loaded with the same weights."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RotaryEmbedding

    ref_model = make_hf_checkpoint(tmp_path, rope_parameters=YARN)
    tensors = add_mtp_weights(tmp_path)
    ours = load_model(tmp_path)
    assert ours.config.num_nextn_predict_layers == 1
    L = ours.config.num_hidden_layers
    p = f"model.layers.{L}."
    hf_layer = DeepseekV3DecoderLayer(ref_model.config, layer_idx=L).eval()
    state = {k[len(p):]: v for k, v in tensors.items() if k.startswith(p) and ".experts." not in k
             and not k[len(p):].startswith(("enorm", "hnorm", "eh_proj", "shared_head", "embed_tokens"))}
    E = ref_model.config.n_routed_experts
    state["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([tensors[f"{p}mlp.experts.{e}.gate_proj.weight"],
                                                                tensors[f"{p}mlp.experts.{e}.up_proj.weight"]])
                                                     for e in range(E)])
    state["mlp.experts.down_proj"] = torch.stack([tensors[f"{p}mlp.experts.{e}.down_proj.weight"] for e in range(E)])
    hf_layer.load_state_dict(state, strict=True)

    T = 9
    ids = torch.randint(0, 96, (1, T + 1))
    with torch.no_grad():
        hidden, _ = ours.model(ids[:, :-1])
        mtp = ours.model.mtp_layer(0)
        cos, sin = ours.model.rotary(torch.arange(T))
        out = mtp(ids[:, 1:], hidden, cos, sin)
        x = tensors[f"{p}eh_proj.weight"] @ torch.cat([
            mtp.enorm(tensors[f"{p}embed_tokens.weight"][ids[0, 1:]]), mtp.hnorm(hidden[0])], -1).T
        position_embeddings = DeepseekV3RotaryEmbedding(ref_model.config)(x.T[None], torch.arange(T)[None])
        mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
        expected = hf_layer(x.T[None], attention_mask=mask, position_embeddings=position_embeddings)
        assert (out - expected).abs().max().item() < 1e-5
        # and the paged path of the same layer agrees with the no-cache one
        cache = torch.zeros(16, ours.config.latent_dim)
        attn = AttentionMetadata.build([T], [T], [[0, 1, 2, 3]], 4)
        cos_p, sin_p = ours.model.rotary(attn.positions)
        paged = mtp(ids[0, 1:], hidden[0], cos_p, sin_p, attn, cache)
        assert (paged - out[0]).abs().max().item() < 1e-5
        assert mtp.compute_logits(out).shape == (1, T, 96)


def test_hostile_configs_and_indexes_are_refused_fast(checkpoint, tmp_path):
    """Each a one-line ConfigError/CheckpointError naming the field or file, before any module is built."""
    import time

    from eyas.config import ConfigError

    path, _ = checkpoint
    raw = json.loads((path / "config.json").read_text())
    cases = [({"num_hidden_layers": 10**9}, ConfigError, "'num_hidden_layers' is 1000000000; expected at most 1024"),
             ({"hidden_size": 2**30}, ConfigError, "'hidden_size'.*at most 65536"),
             ({"rms_norm_eps": float("nan")}, ConfigError, "'rms_norm_eps' is nan; expected a finite number"),
             ({"rope_parameters": {**YARN, "factor": float("inf")}}, ConfigError, "'rope_parameters.factor' is inf"),
             ({"rms_norm_eps": 5}, ConfigError, "'rms_norm_eps' is 5.0; expected a number in"),
             ]
    for change, error, message in cases:
        bad = tmp_path / f"bad-{len(list(tmp_path.iterdir()))}"
        shutil.copytree(path, bad)
        (bad / "config.json").write_text(json.dumps({**raw, **change}))
        start = time.perf_counter()
        with pytest.raises(error, match=message):
            load_model(bad)
        # refused from config.json alone: ms, where building such a model would take minutes or all memory
        assert time.perf_counter() - start < 5.0, change
    deep = tmp_path / "deep"
    shutil.copytree(path, deep)
    (deep / "config.json").write_text('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(ConfigError, match="nested too deeply"):
        load_model(deep)
    for weight_map, message in [({"x": "../model.safetensors"}, "not a file name in"),
                                ({"x": "/etc/passwd"}, "not a file name in"),
                                ([1, 2], "'weight_map' must map"), ({"x": 5}, "'weight_map' must map")]:
        sharded = tmp_path / f"index-{len(list(tmp_path.iterdir()))}"
        shutil.copytree(path, sharded)
        (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        with pytest.raises(CheckpointError, match=message):
            load_model(sharded)
    broken = tmp_path / "broken-index"
    shutil.copytree(path, broken)
    (broken / "model.safetensors.index.json").write_text('{"weight_map": ')
    with pytest.raises(CheckpointError, match="not a safetensors index"):
        load_model(broken)


def test_a_swapped_or_mismatched_directory_is_named_for_what_it_is(tmp_path):
    """A draft given as the target, a target given as the draft, and a draft made for a target of another hidden
    size each get an error saying what the directory is and what to pass, before any weight is compared."""
    from eyas.checkpoint import load_draft
    from eyas.paths import DEFAULT_DRAFT, DEFAULT_MODEL

    with pytest.raises(CheckpointError, match=r"is a draft \(Eagle3DeepseekV2ForCausalLM\), not a target model: "
                       r"pass it as --draft-model"):
        load_model(DEFAULT_DRAFT)
    target = load_model(DEFAULT_MODEL)
    with pytest.raises(CheckpointError, match=r"is a target model \(DeepseekV3ForCausalLM, \d+ layers\), not a draft: "
                       "pass it as --model"):
        load_draft(DEFAULT_MODEL, target)
    make_hf_checkpoint(tmp_path / "other", hidden_size=64)
    with pytest.raises(CheckpointError, match=r"made for another target: its config.json has target_hidden_size "
                       r"192, the target's hidden size is 64; .*eyas inspect"):
        load_draft(DEFAULT_DRAFT, load_model(tmp_path / "other"))


@pytest.mark.parametrize("amx", [False, True])
def test_the_engines_auto_dtype_is_a_bfloat16_checkpoints_own_on_a_cpu_with_amx_only_when_compiled(tmp_path,
                                                                                                   monkeypatch, amx):
    from eyas import checkpoint as ckpt

    monkeypatch.setattr(ckpt, "cpu_has_amx", lambda: amx)
    for stored in ("bfloat16", "float32"):
        (tmp_path / stored).mkdir()
        (tmp_path / stored / "config.json").write_text(json.dumps({"torch_dtype": stored}))
    want = torch.bfloat16 if amx else torch.float32
    assert ckpt.inference_dtype(tmp_path / "bfloat16", "auto", "cpu", compiled_step=True) == want
    # op by op, bfloat16 rounds a row by the row count: greedy speculative output could differ from plain
    assert ckpt.inference_dtype(tmp_path / "bfloat16", "auto", "cpu", compiled_step=False) == torch.float32
    assert ckpt.inference_dtype(tmp_path / "float32", "auto", "cpu", True) == torch.float32
    assert ckpt.inference_dtype(tmp_path / "bfloat16", "float32", "cpu", True) == torch.float32  # asked for, kept
    assert ckpt.inference_dtype(tmp_path / "float32", "bfloat16", "cpu", False) == torch.bfloat16
    assert ckpt.inference_dtype(tmp_path / "missing", "auto", "cpu", True) == torch.float32  # load_model says why
    (tmp_path / "deep").mkdir()
    (tmp_path / "deep" / "config.json").write_text("[" * 100000 + "]" * 100000)  # load_model refuses it, naming it
    assert ckpt.inference_dtype(tmp_path / "deep", "auto", "cpu", True) == torch.float32
    assert ckpt.inference_dtype(tmp_path / "float32", "auto", "cuda", False) == torch.bfloat16
    assert ckpt.resolve_dtype("auto", torch.device("cpu")) == torch.float32  # training's rule is unchanged
