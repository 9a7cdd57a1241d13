"""Speculative decoding is lossless: greedy output equals plain greedy output token for token, and sampled output
keeps the target's distribution. Checked with drafts that are mostly rejected and drafts that are mostly accepted."""

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_checkpoint import add_mtp_weights
from tiny import YARN, make_hf_checkpoint

from eyas import LLM, SamplingParams
from eyas.config import SpeculativeConfig


def rig_bigram_target_and_copying_mtp(path):
    """Zero every layer's writes to the residual stream: the target becomes a bigram model
    (next = argmax lm_head(norm(embed(token)))). The MTP layer is set to predict the same function of the token it
    is given, so it proposes exactly what the target will say: nearly every draft is accepted."""
    tensors = load_file(path / "model.safetensors")
    L = max(int(k.split(".")[2]) for k in tensors if k.startswith("model.layers."))
    H = tensors["model.embed_tokens.weight"].shape[1]
    for key in tensors:
        if key.endswith(("o_proj.weight", "down_proj.weight")):
            tensors[key] = torch.zeros_like(tensors[key])
    p = f"model.layers.{L}."
    tensors[p + "eh_proj.weight"] = torch.cat([torch.eye(H), torch.zeros(H, H)], dim=1)
    for name in ("enorm", "hnorm", "shared_head.norm", "input_layernorm", "post_attention_layernorm"):
        tensors[p + name + ".weight"] = torch.ones(H)
    tensors[p + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    tensors[p + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, path / "model.safetensors")


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
