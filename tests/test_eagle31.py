"""EAGLE-3.1 drafts: each switch computes what the engines define (checked against the forward written out here), in
both draft shapes, through the loader, the engine's paged chain and the TTT loss; all switches off is EAGLE-3 as
before; a file whose weights and switches disagree fails naming both; every export format round-trips them."""

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tiny import DV, H, V, mha_config, mha_weights, mla_config, mla_weights, rms

from eyas import LLM, SamplingParams
from eyas.checkpoint import CheckpointError, load_draft
from eyas.config import ConfigError
from eyas.export import ExportError, export_draft
from eyas.inspect import inspect_report
from eyas.models.attention import AttentionMetadata
from eyas.models.eagle3 import EAGLE31_SWITCHES, init_draft, new_draft_config
from eyas.train.ttt import draft_step

CASES = [{}, {"fc_norm": True}, {"norm_before_fc": True}, {"norm_output": True}, {"norm_before_residual": True},
         {"fc_norm": True, "norm_output": True, "norm_before_residual": True},
         {"norm_before_fc": True, "norm_output": True, "norm_before_residual": True}]


def case_id(switches):
    return "+".join(switches) or "eagle3"


def with_switches(kind, switches, seed=9):
    """A draft file's weights and config with the switches on and their norms far from 1."""
    weights, config = (mha_weights(), mha_config()) if kind == "mha" else (mla_weights(), mla_config())
    g = torch.Generator().manual_seed(seed)
    weights, config = dict(weights), dict(config, **switches)
    if switches.get("fc_norm"):
        for i in range(3):
            weights[f"fc_norm.{i}.weight"] = 1 + 0.5 * torch.randn(H, generator=g)
    if switches.get("norm_before_fc"):
        weights["input_norm.weight"] = 1 + 0.5 * torch.randn(3 * H, generator=g)
    return weights, config


def write(path, config, weights, prefix=""):
    """config.json + model.safetensors; `prefix` "model." writes vLLM-style model.fc / model.fc_norm / ... keys."""
    path.mkdir(parents=True, exist_ok=True)
    top = ("layers.", "fc.", "fc_norm.", "input_norm.", "norm.")
    save_file({(prefix + k if k.startswith(top) else k): v.contiguous() for k, v in weights.items()},
              str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    return path


# -- the forward, written out as vLLM's and speculators' EAGLE-3.1 code defines it --------------------------------

def reference_fuse(w, aux, switches):
    if switches.get("fc_norm"):
        aux = [rms(a, w[f"fc_norm.{i}.weight"]) for i, a in enumerate(aux)]
    x = torch.cat(aux, -1)
    if switches.get("norm_before_fc"):
        x = rms(x, w["input_norm.weight"])
    return x @ w["fc.weight"].T


def reference_mha_attention(w):
    """Llama attention over [T, 2H] rows at positions 0..T-1: 4 heads, 2 kv heads, head_dim 8, rotate-half rope."""
    p = "layers.0.self_attn."

    def attention(x):
        T = x.shape[0]
        q = (x @ w[p + "q_proj.weight"].T).view(T, 4, 8).transpose(0, 1)
        k = (x @ w[p + "k_proj.weight"].T).view(T, 2, 8).transpose(0, 1)
        v = (x @ w[p + "v_proj.weight"].T).view(T, 2, 8).transpose(0, 1)
        inv_freq = 1.0 / 10000.0 ** (torch.arange(0, 8, 2).float() / 8)
        freqs = torch.outer(torch.arange(T).float(), inv_freq)
        cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()

        def rotate_half(t):
            return torch.cat([-t[..., 4:], t[..., :4]], -1)

        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = k.repeat_interleave(2, dim=0), v.repeat_interleave(2, dim=0)
        scores = q @ k.transpose(-1, -2) / 8 ** 0.5 + torch.full((T, T), float("-inf")).triu(1)
        return (scores.softmax(-1) @ v).transpose(0, 1).reshape(T, 32) @ w[p + "o_proj.weight"].T

    return attention


def module_attention(draft):
    """The MLA draft's attention module, causal over positions 0..T-1 (the switches never reach inside it)."""
    def attention(x):
        cos, sin = draft.rotary(torch.arange(x.shape[0]))
        return draft.layers[0].self_attn(x[None], cos, sin)[0]

    return attention


def reference_layer(w, hidden, tokens, embed, switches, attention):
    """(the state carried to the next step, draft-vocab logits) of one draft step over rows 0..T-1."""
    normed = rms(hidden, w["layers.0.hidden_norm.weight"])
    x = torch.cat([rms(embed[tokens], w["layers.0.input_layernorm.weight"]), normed], -1)
    residual = normed if switches.get("norm_before_residual") else hidden
    h = residual + attention(x)
    m = rms(h, w["layers.0.post_attention_layernorm.weight"])
    pre = h + (F.silu(m @ w["layers.0.mlp.gate_proj.weight"].T) * (m @ w["layers.0.mlp.up_proj.weight"].T)
               ) @ w["layers.0.mlp.down_proj.weight"].T
    out = rms(pre, w["norm.weight"])
    return (out if switches.get("norm_output") else pre), out @ w["lm_head.weight"].T


@pytest.mark.parametrize("switches", CASES, ids=case_id)
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_each_switch_computes_the_reference(target, tmp_path, kind, switches):
    """Step 0 over 6 positions through the paged cache, then step 1 on the carried state: both steps' carried
    states and logits equal the reference. Step 1 of the reference is the same causal forward with one more row,
    whose hidden input is step 0's carried state at the last position."""
    w, config = with_switches(kind, switches)
    draft = load_draft(write(tmp_path / "d", config, w, prefix="model." if kind == "mha" else ""), target)
    assert draft.config.switches == {name: switches.get(name, False) for name in EAGLE31_SWITCHES}
    assert draft.load_report["switches"] == draft.config.switches
    T = 6
    ids = torch.randint(0, V, (T + 2,), generator=torch.Generator().manual_seed(4))
    kept = torch.arange(DV) + w["d2t"]
    with torch.no_grad():
        _, aux = target.model(ids[None, :T], aux_hidden_state_ids=draft.aux_hidden_state_ids)
        aux = [a[0] for a in aux]
        cache, blocks = torch.zeros(64, *draft.cache_entry_shape()), [0, 1, 2, 3]
        carried0 = draft(draft.combine_hidden_states(None, aux), ids[1:T + 1],
                         AttentionMetadata.build([T], [T], [blocks], 16), cache)
        carried1 = draft(carried0[-1:], ids[T + 1:T + 2], AttentionMetadata.build([1], [T + 1], [blocks], 16), cache)
        attention = reference_mha_attention(w) if kind == "mha" else module_attention(draft)
        embed = target.model.embed_tokens.weight
        g = reference_fuse(w, aux, switches)
        ref0, ref_logits0 = reference_layer(w, g, ids[1:T + 1], embed, switches, attention)
        ref1, ref_logits1 = reference_layer(w, torch.cat([g, ref0[-1:]]), ids[1:T + 2], embed, switches, attention)
        logits0, logits1 = draft.compute_logits(carried0), draft.compute_logits(carried1)
    assert (carried0 - ref0).abs().max() < 1e-5
    assert (logits0[:, kept] - ref_logits0).abs().max() < 1e-5
    assert (carried1[0] - ref1[-1]).abs().max() < 1e-5
    assert (logits1[0, kept] - ref_logits1[-1]).abs().max() < 1e-5
    if switches.get("norm_output"):  # the state handed on is the normed one, not the layer's output
        assert (carried1[0] - reference_layer(w, torch.cat([g, ref0[-1:]]), ids[1:T + 2], embed, {},
                                              attention)[0][-1]).abs().max() > 1e-3


def test_all_switches_off_is_the_eagle3_forward_bit_for_bit(target, tmp_path):
    """The default path computes exactly the EAGLE-3 formula (same ops, same order): torch.equal, not a tolerance."""
    draft = load_draft(write(tmp_path / "d", mha_config(), mha_weights()), target)
    layer = draft.layers[0]
    g = torch.Generator().manual_seed(1)
    aux = [torch.randn(5, H, generator=g) for _ in range(3)]
    tokens = torch.randint(0, V, (5,), generator=g)
    with torch.no_grad():
        hidden = draft.fc(torch.cat(aux, -1))
        cos, sin = draft.rotary(torch.arange(5))
        x = torch.cat([layer.input_layernorm(draft.embed_tokens(tokens)), layer.hidden_norm(hidden)], -1)
        h = hidden + layer.self_attn(x[None], cos, sin)[0]
        pre = h + layer.mlp(layer.post_attention_layernorm(h))
        expected = draft.lm_head(draft.norm(pre))
        assert torch.equal(draft.combine_hidden_states(None, aux), hidden)
        carried = draft(hidden[None], tokens[None])[0]
        assert torch.equal(carried, pre)
        assert torch.equal(draft.draft_logits(carried), expected)


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("kind,switches", [("mla", CASES[5]), ("mha", CASES[6]), ("mha", CASES[5])])
def test_greedy_speculation_with_every_switch_equals_plain(target_path, tmp_path, kind, switches, k):
    w, config = with_switches(kind, switches)
    draft_dir = write(tmp_path / "d", config, w)
    prompts, params = [[5, 6, 7], list(range(10, 30)), [17]], SamplingParams(temperature=0, max_tokens=10)
    plain = LLM(target_path, max_num_seqs=3, block_size=4).generate(prompts, params)
    llm = LLM(target_path, max_num_seqs=3, block_size=4, speculative_method="eagle", draft_model=draft_dir,
              num_speculative_tokens=k)
    assert llm.draft.config.switches == {name: switches.get(name, False) for name in EAGLE31_SWITCHES}
    assert [o.token_ids for o in llm.generate(prompts, params)] == [o.token_ids for o in plain]
    assert llm.scheduler.metrics.num_drafted > 0


@pytest.mark.parametrize("switches", CASES[1:], ids=case_id)
@pytest.mark.parametrize("arch", ["mla", "mha"])
def test_ttt_steps_equal_the_engines_chain_with_switches(target, arch, switches):
    """What training computes for steps 0..3 (draft_step, the extended mask) is what the engine's paged chain
    computes from every start position, with norm_output's normed state carried between steps."""
    draft = init_draft(target, new_draft_config(target.config, arch, (1, 2, 3), 0, switches=switches), seed=1)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name.startswith(("embed_tokens", "lm_head")):
                continue
            p.copy_(torch.randn(p.shape, generator=g) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
    T, steps = 12, 4
    ids = torch.randint(0, V, (1, T), generator=g)
    aux = torch.randn(1, T, 3, H, generator=g)
    with torch.no_grad():
        hidden, past, ttt = draft.fuse(aux), [], []
        for k in range(steps):
            hidden, kv = draft_step(draft, hidden, F.pad(ids[:, 1 + k:], (0, 1 + k)), torch.arange(T) + k, past)
            past.append(kv)
            ttt.append(hidden)
        for start in (0, 3, 7):
            cache, blocks = torch.zeros(64, *draft.cache_entry_shape()), [0, 1, 2, 3]
            attn = AttentionMetadata.build([start + 1], [start + 1], [blocks], 16)
            hidden = draft(draft.fuse(aux[0, :start + 1]), ids[0, 1:start + 2], attn, cache)[-1:]
            engine = [hidden[0]]
            for k in range(1, steps):
                attn = AttentionMetadata.build([1], [start + k + 1], [blocks], 16)
                hidden = draft(hidden, ids[0, start + 1 + k:start + 2 + k], attn, cache)
                engine.append(hidden[0])
            for k in range(steps):
                assert (ttt[k][0, start] - engine[k]).abs().max().item() < 1e-4, (start, k)


# -- files whose weights and switches disagree ---------------------------------------------------------------------

def test_unused_weights_and_missing_ones_fail_naming_them(target, target_path, tmp_path):
    w, config = with_switches("mha", {"fc_norm": True})
    unused = write(tmp_path / "unused", dict(config, fc_norm=False), w)
    with pytest.raises(CheckpointError, match=r"fc_norm\.0\.weight, fc_norm\.1\.weight, fc_norm\.2\.weight present "
                                              r"but fc_norm is false.*--allow-unused-draft-weights"):
        load_draft(unused, target)
    allowed = load_draft(unused, target, allow_unused_weights=True)
    assert not allowed.config.fc_norm and allowed.load_report["ignored_tensors"] == [f"fc_norm.{i}.weight"
                                                                                    for i in range(3)]
    report = inspect_report(str(target_path), unused)
    assert not report["ok"] and any("present but fc_norm is false" in p for p in report["problems"])
    assert report["draft"]["EAGLE-3.1 switches"].startswith("fc_norm false")
    stray = write(tmp_path / "stray", mha_config(), mha_weights() | {"medusa_head.weight": torch.zeros(2, 2)})
    with pytest.raises(CheckpointError, match="medusa_head.weight used by no part"):
        load_draft(stray, target)
    missing = write(tmp_path / "missing", dict(mha_config(), norm_before_fc=True), mha_weights())
    with pytest.raises(CheckpointError, match=r"input_norm\.weight.*norm_before_fc is true"):
        load_draft(missing, target)
    both = write(tmp_path / "both", dict(config, norm_before_fc=True), w)
    with pytest.raises(ConfigError, match="'fc_norm' and 'norm_before_fc' are both true"):
        load_draft(both, target)
    with pytest.raises(ConfigError, match="'norm_output' is 'yes'"):
        load_draft(write(tmp_path / "typed", dict(mha_config(), norm_output="yes"), mha_weights()), target)


# -- export ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_every_format_round_trips_the_switches_bit_for_bit(target, target_path, tmp_path, kind):
    switches = CASES[5] if kind == "mla" else CASES[6]
    w, config = with_switches(kind, switches)
    source = load_draft(write(tmp_path / "src", config, w), target)
    formats = ["eyas", "vllm", "sglang", "modelopt", "max"] + (["speculators"] if kind == "mha" else [])
    for fmt in formats:
        out = export_draft(tmp_path / "src", tmp_path / fmt, fmt, str(target_path))
        written = json.loads((out / "config.json").read_text())
        assert {name: written[name] for name in EAGLE31_SWITCHES} == source.config.switches, fmt
        back = load_draft(out, target)
        assert back.config.switches == source.config.switches, fmt
        theirs, ours = back.state_dict(), source.state_dict()
        assert theirs.keys() == ours.keys(), fmt
        for key in ours:
            assert torch.equal(theirs[key], ours[key]), (fmt, key)
    if kind == "mla":
        with pytest.raises(ExportError, match="no speculators form.*--format vllm"):
            export_draft(tmp_path / "src", tmp_path / "speculators", "speculators", str(target_path))


def test_speculators_layout(target, target_path, tmp_path):
    """The speculators config nests the Llama layer, names the verifier and K, and the weights keep eyas's names."""
    w, config = with_switches("mha", CASES[5])
    write(tmp_path / "src", config, w)
    out = export_draft(tmp_path / "src", tmp_path / "spec", "speculators", str(target_path),
                       num_speculative_tokens=5)
    written = json.loads((out / "config.json").read_text())
    assert written["architectures"] == ["Eagle3Speculator"] and written["speculators_model_type"] == "eagle3"
    spec = written["speculators_config"]
    assert spec["algorithm"] == "eagle3" and spec["default_proposal_method"] == "greedy"
    assert spec["proposal_methods"][0]["proposal_type"] == "greedy"
    assert spec["proposal_methods"][0]["speculative_tokens"] == 5
    assert spec["verifier"] == {"name_or_path": str(target_path), "architectures": ["DeepseekV3ForCausalLM"]}
    layer = written["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["num_key_value_heads"] == 2 and layer["head_dim"] == 8
    assert (written["draft_vocab_size"], written["target_hidden_size"]) == (DV, H)
    assert written["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    keys = set(load_file(out / "model.safetensors"))
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "fc_norm.0.weight"} <= keys
    assert all(k.startswith(("fc.", "fc_norm.", "layers.0.", "norm.", "lm_head.", "d2t", "t2d")) for k in keys)


def test_speculators_file_without_norm_before_residual_reads_as_vllm_does(target, target_path, tmp_path, caplog):
    """vLLM's speculators reader takes an absent norm_before_residual as true: eyas reads such a file the same way
    and says so (its own exports always write the switch)."""
    w, config = with_switches("mha", {})
    write(tmp_path / "src", config, w)
    out = export_draft(tmp_path / "src", tmp_path / "spec", "speculators", str(target_path))
    written = json.loads((out / "config.json").read_text())
    assert written["norm_before_residual"] is False and not load_draft(out, target).config.norm_before_residual
    del written["norm_before_residual"]
    (out / "config.json").write_text(json.dumps(written))
    with caplog.at_level("WARNING", logger="eyas"):
        assert load_draft(out, target).config.norm_before_residual
    assert "taking it as true, as vLLM does" in caplog.text


def test_export_warns_what_a_vllm_of_0_32_would_miss(target_path, tmp_path, capsys):
    from eyas.cli import main

    w, config = with_switches("mla", {"norm_before_fc": True})
    write(tmp_path / "src", config, w)
    assert main(["export", str(tmp_path / "src"), str(tmp_path / "vllm"), "--format", "vllm", "--target",
                 str(target_path)]) == 0
    assert "norm_before_fc; vLLM 0.32's MLA draft code" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "src"), str(tmp_path / "mo"), "--format", "modelopt", "--target",
                 str(target_path)]) == 0
    assert "vLLM, SGLang and MAX read them as hidden_states indices" in capsys.readouterr().err
