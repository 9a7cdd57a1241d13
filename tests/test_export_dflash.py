"""`eyas export --format speculators` of a DFlash block draft: the speculators library's `dflash` format (vLLM loads it
natively), read back by eyas's DFlash loader bit for bit; greedy decoding with the reloaded draft equals plain greedy
decoding token for token; the config holds exactly the fields speculators' DFlash config declares (aux ids = z-lab's
target_layer_ids + 1, speculative_tokens = block_size - 1); an unknown config key or tensor is an error naming it."""

import dataclasses
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny import read_config

from eyas import LLM, SamplingParams, load_model
from eyas.checkpoint import load_dflash_draft
from eyas.config import ConfigError
from eyas.export import ExportError, export_draft, save_dflash_draft
from eyas.inspect import inspect_report
from eyas.models.dflash import SHARED_WEIGHTS, init_dflash_draft, new_dflash_config
from eyas.weights import CheckpointError

# speculators 0.9.0's DFlashSpeculatorConfig fields with those of its base, SpeculatorModelConfig (written out here,
# not imported, so that a change to what eyas writes shows)
SPECULATORS_DFLASH_FIELDS = {"architectures", "speculators_model_type", "speculators_version", "speculators_config",
                             "transformer_layer_config", "draft_vocab_size", "block_size", "target_hidden_size",
                             "aux_hidden_state_layer_ids", "mask_token_id", "sliding_window_non_causal",
                             "sample_from_anchor"}
IDS, BLOCK = (0, 2), 4  # z-lab target_layer_ids (layer outputs) and the block: three drafts per forward
GREEDY = SamplingParams(temperature=0, max_tokens=15, ignore_eos=True)


@pytest.fixture(scope="module")
def served(checkpoint):
    """The served tiny target (vocab 8,192, the shipped tokenizer), loaded."""
    return load_model(checkpoint)


@pytest.fixture(scope="module")
def drafts(checkpoint, served, tmp_path_factory):
    """(a random two-layer DFlash draft in z-lab's layout, the same exported with `eyas export --format
    speculators`); its norms are off 1 and differ, so a norm read into the wrong place shows."""
    from eyas.cli import main as cli

    V = served.config.vocab_size
    draft = init_dflash_draft(served, new_dflash_config(served.config, 2, BLOCK, IDS, V - 1), seed=1)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    zlab = save_dflash_draft(draft, tmp_path_factory.mktemp("zlab") / "draft")
    spec = tmp_path_factory.mktemp("speculators") / "draft"
    assert cli(["export", str(zlab), str(spec), "--format", "speculators", "--target", str(checkpoint)]) == 0
    return zlab, spec


def test_the_export_loads_back_bit_for_bit(checkpoint, served, drafts, tmp_path):
    zlab, spec = drafts
    a, b = load_dflash_draft(zlab, served), load_dflash_draft(spec, served)
    assert dataclasses.replace(b.config, source=a.config.source) == a.config
    assert (b.config.target_layer_ids, b.config.block_size, b.config.mask_token_id) == (IDS, BLOCK, 8191)
    own_a = {k: v for k, v in a.state_dict().items() if k not in SHARED_WEIGHTS}
    own_b = {k: v for k, v in b.state_dict().items() if k not in SHARED_WEIGHTS}
    assert own_a.keys() == own_b.keys()
    for key, value in own_a.items():
        assert own_b[key].dtype == value.dtype and torch.equal(own_b[key], value), key
    assert b.embed_tokens is served.model.embed_tokens and b.lm_head is served.lm_head
    # z-lab's names, and the target's embedding and lm_head copied in
    stored = load_file(spec / "model.safetensors")
    assert stored.keys() == load_file(zlab / "model.safetensors").keys() | set(SHARED_WEIGHTS)
    assert torch.equal(stored["embed_tokens.weight"], served.model.embed_tokens.weight)
    assert torch.equal(stored["lm_head.weight"], served.lm_head.weight)
    # a speculators draft exports again to the same bytes; inspect reads it as the engine does
    export_draft(spec, tmp_path / "again", "speculators", checkpoint)
    for name in ("config.json", "model.safetensors"):
        assert (tmp_path / "again" / name).read_bytes() == (spec / name).read_bytes(), name
    report = inspect_report(checkpoint, spec)
    assert report["ok"] and report["method"] == "dflash", report["problems"]
    assert report["draft"]["read as hidden_states"] == [1, 3]
    assert report["draft"]["target layers in file"].startswith("aux_hidden_state_layer_ids = [1, 3]")


def test_greedy_with_the_reloaded_draft_equals_plain_greedy(checkpoint, drafts, capsys):
    from eyas.cli import main as cli

    zlab, spec = drafts
    prompts = [[5, 6, 7], list(range(10, 40)), [3] * 9]
    plain = LLM(checkpoint, max_num_seqs=4).generate(prompts, GREEDY)
    by_layout = {d: LLM(checkpoint, max_num_seqs=4, speculative_method="dflash", draft_model=d)
                 .generate(prompts, GREEDY) for d in (zlab, spec)}
    for p, z, s in zip(plain, by_layout[zlab], by_layout[spec], strict=True):
        assert s.token_ids == p.token_ids and s.num_drafted > 0
        assert (s.num_drafted, s.accepted_per_position) == (z.num_drafted, z.accepted_per_position)
    base = ["generate", "--model", str(checkpoint), "--prompt", "def add(a, b):", "--max-new-tokens", "12",
            "--ignore-eos", "--json", "--no-speed-check", "--speculative-width", "fixed"]
    assert cli(base + ["--speculative-method", "none"]) == 0
    expected = json.loads(capsys.readouterr().out)["token_ids"]
    for method in (["--speculative-method", "dflash"], []):  # [] : the method read from the draft's config.json
        assert cli(base + method + ["--draft-model", str(spec)]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["token_ids"] == expected and out["num_drafted"] > 0
        assert len(out["accepted_per_position"]) == BLOCK - 1


def test_the_config_has_exactly_the_fields_speculators_declares(checkpoint, drafts, tmp_path):
    zlab, spec = drafts
    raw, source = read_config(spec), read_config(zlab)
    assert set(raw) == SPECULATORS_DFLASH_FIELDS
    assert (raw["architectures"], raw["speculators_model_type"]) == (["DFlashSpeculator"], "dflash")
    assert raw["aux_hidden_state_layer_ids"] == [i + 1 for i in source["dflash_config"]["target_layer_ids"]] == [1, 3]
    assert raw["mask_token_id"] == source["dflash_config"]["mask_token_id"] == 8191
    assert (raw["block_size"], raw["draft_vocab_size"], raw["target_hidden_size"]) == (BLOCK, 8192, 32)
    # true: the vLLMs that read it run every layer causally when it is false
    assert raw["sliding_window_non_causal"] is True and raw["sample_from_anchor"] is False
    assert raw["speculators_config"] == {
        "algorithm": "dflash",
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": BLOCK - 1, "verifier_accept_k": 1,
                              "accept_tolerance": 0.0}],
        "default_proposal_method": "greedy",
        "verifier": {"name_or_path": str(checkpoint), "architectures": ["DeepseekV3ForCausalLM"]}}
    # the layers' Qwen3 config: z-lab's config.json less what speculators keeps at the top or drops
    assert raw["transformer_layer_config"] == {k: v for k, v in source.items() if k not in
                                               ("architectures", "block_size", "dflash_config", "num_target_layers",
                                                "rope_interleave")}
    assert raw["transformer_layer_config"]["rope_scaling"]["rope_type"] == "yarn"  # the target's rope
    export_draft(zlab, tmp_path / "k2", "speculators", checkpoint, num_speculative_tokens=2)
    assert read_config(tmp_path / "k2")["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 2
    with pytest.raises(ConfigError, match="speculative_tokens is 4; expected 1..3"):
        export_draft(zlab, tmp_path / "k4", "speculators", checkpoint, num_speculative_tokens=4)
    with pytest.raises(ExportError, match="rope_scaling apply to EAGLE-3 drafts"):
        export_draft(zlab, tmp_path / "yarn", "speculators", checkpoint, rope_scaling={"factor": 2.0})


def _edited(spec, tmp_path, config=None, tensors=None):
    """A copy of the exported draft with `config(raw)` / `tensors(dict)` applied to its files."""
    out = tmp_path / f"edited{len(list(tmp_path.iterdir()))}"
    shutil.copytree(spec, out)
    if config is not None:
        raw = read_config(out)
        config(raw)
        (out / "config.json").write_text(json.dumps(raw))
    if tensors is not None:
        weights = load_file(out / "model.safetensors")
        tensors(weights)
        save_file(weights, out / "model.safetensors")
    return out


def test_unknown_keys_and_tensors_are_errors_naming_them(served, drafts, tmp_path):
    _, spec = drafts
    config_errors = {
        "projector_type": lambda raw: raw.update(projector_type="domino"),  # a key of a speculators branch
        "speculators_config sets \\['ensemble'\\]": lambda raw: raw["speculators_config"].update(ensemble=2),
        "sample_from_anchor": lambda raw: raw.update(sample_from_anchor=True),
        "aux_hidden_state_layer_ids": lambda raw: raw.update(aux_hidden_state_layer_ids=[0, 3]),
    }
    for name, edit in config_errors.items():
        with pytest.raises(ConfigError, match=name):
            load_dflash_draft(_edited(spec, tmp_path, config=edit), served)
    tensor_errors = {
        "unexpected weight: verifier_lm_head.weight": lambda w: w.update({"verifier_lm_head.weight":
                                                                          w["lm_head.weight"].clone()}),
        "'lm_head.weight' differs from the target's": lambda w: w["lm_head.weight"].mul_(2),
    }
    for name, edit in tensor_errors.items():
        with pytest.raises(CheckpointError, match=name):
            load_dflash_draft(_edited(spec, tmp_path, tensors=edit), served)
    # a compressed vocabulary needs its map: the config's claim alone is refused, naming what is missing
    with pytest.raises(CheckpointError, match="missing: d2t"):
        load_dflash_draft(_edited(spec, tmp_path, config=lambda raw: raw.update(draft_vocab_size=4096)), served)
    # what transformers' save_pretrained adds to speculators' own files is no draft setting
    bookkeeping = _edited(spec, tmp_path, config=lambda raw: raw.update(transformers_version="5.3.0", dtype="float32"))
    assert load_dflash_draft(bookkeeping, served).config.target_layer_ids == IDS
