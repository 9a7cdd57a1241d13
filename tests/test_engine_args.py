"""Each setting and each part of the target written once: the engine flags default to `EngineArgs`' fields (and the
speculative ones it passes on to `SpeculativeConfig`'s), and the whole target and `TargetHead` share one lm_head,
tie and `compute_logits`."""

import argparse
from dataclasses import MISSING, fields

import pytest
import torch
from tiny import hf_config, make_hf_checkpoint

from eyas.checkpoint import HEAD_WEIGHTS, load_model, load_target_head
from eyas.commands import HelpFormatter
from eyas.config import DEFAULT_NUM_SPECULATIVE_TOKENS, DeepseekV3Config, SpeculativeConfig
from eyas.engine_args import EngineArgs
from eyas.models.deepseek_v3 import DeepseekV3ForCausalLM, TargetHead

# the documented speculative flags, in their --help order
SPECULATIVE_FLAGS = [
    "--speculative-method", "--draft-model", "--num-speculative-tokens", "--num-speculative-tokens-per-batch-size",
    "--speculative-disable-batch-size", "--speculative-width", "--num-speculative-tokens-mixed-batch",
    "--rejection-sampling-strategy", "--synthetic-acceptance-rate", "--relaxed-thinking", "--relaxed-thinking-topk",
    "--relaxed-thinking-delta", "--allow-unused-draft-weights", "--aux-layer-convention",
]
# EngineArgs' settings that speculative_config() hands to SpeculativeConfig as they are
PASSED_ON = {"draft_model", "num_speculative_tokens", "num_speculative_tokens_mixed_batch",
             "rejection_sampling_strategy", "synthetic_acceptance_rate", "relaxed_thinking", "relaxed_thinking_topk",
             "relaxed_thinking_delta", "allow_unused_draft_weights", "aux_layer_convention"}


def engine_parser(**kwargs) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(formatter_class=HelpFormatter)
    EngineArgs.add_cli_args(parser, **kwargs)
    return parser


def flag_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and a.dest != "help"]


def test_every_flag_defaults_to_the_field_it_fills():
    defaults = {f.name: f.default for f in fields(EngineArgs)}
    actions = flag_actions(engine_parser())
    assert {a.dest for a in actions} == set(defaults)  # a flag for every field, a field for every flag
    for action in actions:
        assert action.option_strings == ["--" + action.dest.replace("_", "-")]
        assert action.default == defaults[action.dest], action.option_strings
        assert type(action.default) is type(defaults[action.dest]), action.option_strings
    (group,) = [g for g in engine_parser()._action_groups if g.title == "speculative decoding"]
    assert [a.option_strings[0] for a in group._group_actions] == SPECULATIVE_FLAGS


def test_the_speculative_settings_passed_on_default_as_speculative_config_does():
    speculative = {f.name: f.default for f in fields(SpeculativeConfig)}
    engine = {f.name: f.default for f in fields(EngineArgs)}
    # the per-batch-size rules share the name, not the form: the flag's JSON text, read into SpeculativeConfig's list
    assert set(engine) & set(speculative) == PASSED_ON | {"num_speculative_tokens_per_batch_size"}
    for name in PASSED_ON:
        assert speculative[name] is not MISSING
        assert engine[name] == speculative[name], name
    # the values, so a changed default is a decision this test records
    assert (engine["rejection_sampling_strategy"], engine["relaxed_thinking_topk"],
            engine["relaxed_thinking_delta"], engine["speculative_width"]) == ("residual", 10, 0.6, "adaptive")


def test_help_states_the_defaults_the_flags_have():
    text = " ".join(engine_parser().format_help().split())
    assert "(default: residual)" in text
    assert "(default: adaptive)" in text
    assert f"default {DEFAULT_NUM_SPECULATIVE_TOKENS}, and for dflash" in text
    assert SpeculativeConfig(method="mtp").num_speculative_tokens == DEFAULT_NUM_SPECULATIVE_TOKENS


def test_no_flags_give_the_dataclass_defaults():
    parser = engine_parser()
    assert EngineArgs.from_cli_args(parser.parse_args([])) == EngineArgs()
    mtp = EngineArgs.from_cli_args(parser.parse_args(["--speculative-method", "mtp"]))
    assert mtp == EngineArgs(speculative_method="mtp")
    # the command line's one departure from SpeculativeConfig's defaults: the adaptive width
    assert mtp.speculative_config() == SpeculativeConfig(method="mtp", adaptive_width=True)
    fixed = EngineArgs.from_cli_args(parser.parse_args(["--speculative-method", "mtp", "--speculative-width",
                                                        "fixed", "--device", "cuda"]))
    assert fixed.speculative_config() == SpeculativeConfig(method="mtp")


def test_a_command_without_some_flags_keeps_those_fields_defaults():
    parser = engine_parser(max_num_seqs=32, without=("--dtype", "--device"), speculative=False)
    assert {a.dest for a in flag_actions(parser)} == {"model", "max_num_seqs", "max_model_len", "kv_cache_memory",
                                                      "threads", "enforce_eager"}
    assert EngineArgs.from_cli_args(parser.parse_args([])) == EngineArgs(max_num_seqs=32)


# -- the target's head ----------------------------------------------------------------------------------------------

def tiny_config(**overrides) -> DeepseekV3Config:
    return DeepseekV3Config.from_dict(hf_config(**overrides).to_dict(), "tiny target")


@pytest.mark.parametrize("tie", [False, True])
def test_target_head_and_whole_target_give_the_same_logits(tie):
    config = tiny_config(tie_word_embeddings=tie)
    torch.manual_seed(0)
    target, head = DeepseekV3ForCausalLM(config), TargetHead(config)
    assert set(head.state_dict()) == set(HEAD_WEIGHTS)  # the names checkpoints are read by
    assert set(HEAD_WEIGHTS) <= set(target.state_dict())
    with torch.no_grad():
        for p in target.parameters():
            p.normal_(0, 0.5)
    head.load_state_dict({k: target.state_dict()[k] for k in HEAD_WEIGHTS})
    hidden = torch.randn(2, 5, config.hidden_size)
    with torch.no_grad():
        logits = target.compute_logits(hidden)
        assert logits.shape == (2, 5, config.vocab_size)
        assert torch.equal(head.compute_logits(hidden), logits)
        assert torch.allclose(logits, hidden @ target.lm_head.weight.T, atol=1e-5)
    for model in (target, head):
        shares = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
        assert shares is tie
        assert model.tied_weights == (("lm_head.weight",) if tie else ())
    if tie:  # tied: the head is the embedding matrix, one tensor
        assert target.lm_head.weight is target.model.embed_tokens.weight
        assert torch.equal(logits, hidden @ target.model.embed_tokens.weight.T)
    else:
        assert not torch.equal(target.lm_head.weight, target.model.embed_tokens.weight)


def test_loading_a_tied_checkpoint_ties_again(tmp_path):
    make_hf_checkpoint(tmp_path, tie_word_embeddings=True)  # transformers writes no lm_head.weight when tied
    target, head = load_model(tmp_path), load_target_head(tmp_path)
    for model in (target, head):
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert torch.equal(head.model.embed_tokens.weight, target.model.embed_tokens.weight)
    hidden = torch.randn(3, target.config.hidden_size)
    with torch.no_grad():
        assert torch.equal(head.compute_logits(hidden), target.compute_logits(hidden))


def test_the_default_cache_on_cpu_holds_as_many_positions_with_a_draft_as_without():
    """The default budget is 0.25 GiB of the target's cache, the draft's beside it (so a drafting engine's lanes are
    as long as a plain one's); a budget given holds both."""
    from types import SimpleNamespace

    from eyas.engine.llm import default_num_blocks

    config, weight = SimpleNamespace(num_hidden_layers=8, latent_dim=576), torch.empty(1)
    draft = SimpleNamespace(cache_entry_shape=lambda: (576,))
    target_block = 8 * 576 * 4 * 16  # bytes of 16 positions of the target's float32 latents
    plain = default_num_blocks(config, weight, 32, 2048, 16, None)
    assert plain == default_num_blocks(config, weight, 32, 2048, 16, None, draft) == 2**28 // target_block
    assert default_num_blocks(config, weight, 32, 2048, 16, 0.25, draft) == 2**28 // (target_block * 9 // 8)
