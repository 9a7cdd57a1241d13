"""Our DeepSeek-V3 against transformers' on random tiny checkpoints that transformers itself saved."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny import YARN, make_hf_checkpoint

from eyas import load_model
from eyas.models.deepseek_v3 import FEW_TOKENS
from eyas.models.layers import FUSED_NORM_ROWS, RMSNorm, pack_for_inference

CONFIGS = {
    "qlora_yarn_groups": dict(rope_parameters=YARN),
    "qlora_null_plain_rope": dict(q_lora_rank=None, rope_parameters={"rope_type": "default", "rope_theta": 5000.0}),
    "one_group_all_moe": dict(n_group=1, topk_group=1, first_k_dense_replace=0, rope_parameters=YARN),
    "dense_only": dict(first_k_dense_replace=4,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "no_norm_topk_not_interleaved": dict(norm_topk_prob=False, rope_interleave=False, rope_parameters=YARN),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_and_aux_hidden_states_match_transformers(tmp_path, name):
    ref = make_hf_checkpoint(tmp_path, **CONFIGS[name])
    ours = load_model(tmp_path)
    ids = torch.randint(0, ref.config.vocab_size, (2, 33), generator=torch.Generator().manual_seed(1))
    L = ref.config.num_hidden_layers
    with torch.no_grad():
        expected = ref(ids, output_hidden_states=True)
        logits = ours(ids)
        _, aux = ours.model(ids, aux_hidden_state_ids=tuple(range(L)))
    assert (logits - expected.logits).abs().max().item() <= 1e-4
    # hidden_states index i = input of layer i; transformers' last entry (index L) is after the final norm
    for i in range(L):
        assert torch.equal(aux[i], expected.hidden_states[i]) or (aux[i] - expected.hidden_states[i]).abs().max() < 1e-5


def test_packed_rms_norm_matches_its_formula():
    """RMSNorm packed for CPU inference (layer_norm over [x, -x] up to FUSED_NORM_ROWS rows, F.rms_norm past them)
    against x / sqrt(mean(x^2) + eps) * w in float64 and against the unpacked module, on rows of very different
    scales and an all-zero row."""
    norm = RMSNorm(192, eps=1e-6)
    rows = torch.randn(5, 192, generator=torch.Generator().manual_seed(3)) * torch.tensor([[1e-3], [1.0], [1e3], [0.0],
                                                                                          [7.0]])
    with torch.no_grad():
        norm.weight.normal_()
    for x in (rows, rows.repeat(FUSED_NORM_ROWS, 1)):
        norm.weight_pair = None
        with torch.no_grad():
            unpacked = norm(x)
            norm.pack()
            assert norm.weight_pair is not None
            packed = norm(x)
        x64, w64 = x.double(), norm.weight.detach().double()
        expected = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * w64
        scale = expected.abs().max(-1, keepdim=True).values + 1e-30
        assert ((packed.double() - expected).abs() <= 1e-6 * scale).all()
        assert ((packed - unpacked).abs() <= 1e-6 * scale).all()


def test_moe_paths_match_transformers(tmp_path):
    """Few rows (decode, verify) run every chosen expert over all rows (packed: all experts in batched matmuls when
    the rows choose at least half of them); more rows are grouped by expert. All must give transformers' MoE output,
    row by row, and the batched form exactly what the per-expert loop gives."""
    ref = make_hf_checkpoint(tmp_path, rope_parameters=YARN)
    ours = load_model(tmp_path)
    x = torch.randn(3 * FEW_TOKENS, ref.config.hidden_size, generator=torch.Generator().manual_seed(2))
    moe = ours.model.layers[1].mlp
    with torch.no_grad():
        expected = ref.model.layers[1].mlp(x[None])[0]
        for rows in (1, 4, FEW_TOKENS, 3 * FEW_TOKENS):
            assert (moe(x[:rows]) - expected[:rows]).abs().max().item() <= 1e-5, rows
        pack_for_inference(ours)
        for rows in (1, 4, FEW_TOKENS, 3 * FEW_TOKENS):
            assert (moe(x[:rows]) - expected[:rows]).abs().max().item() <= 1e-5, rows
        for rows in (4, FEW_TOKENS):
            expert_ids, weights = moe.route(x[:rows])
            chosen = sorted(set(expert_ids.flatten().tolist()))
            assert 2 * len(chosen) >= len(moe.experts), rows  # so _few_tokens takes the batched form
            loop = torch.zeros_like(x[:rows])
            for e in chosen:
                loop += moe.experts[e](x[:rows]) * (expert_ids == e).mul(weights).sum(-1, keepdim=True)
            assert torch.equal(moe._few_tokens(x[:rows], expert_ids, weights), loop), rows


def test_bf16_checkpoint_matches_transformers_in_fp32(tmp_path):
    ref = make_hf_checkpoint(tmp_path, dtype=torch.bfloat16, rope_parameters=YARN)  # ref: bf16 weights, upcast
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    ours = load_model(tmp_path, dtype="float32")
    ids = torch.randint(0, 96, (1, 40))
    with torch.no_grad():
        assert (ours(ids) - ref(ids).logits).abs().max().item() <= 1e-4


def quantize_fp8(weight: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's layout: e4m3 values and one float32 scale_inv per block (value * scale_inv = weight)."""
    rows, cols = weight.shape
    scales = torch.empty(-(-rows // block), -(-cols // block))
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            tile = weight[i * block:(i + 1) * block, j * block:(j + 1) * block]
            scales[i, j] = tile.abs().max().clamp(min=1e-12) / 448.0
            q[i * block:(i + 1) * block, j * block:(j + 1) * block] = (tile / scales[i, j]).to(torch.float8_e4m3fn)
    return q, scales


def test_fp8_block_quantized_checkpoint(tmp_path):
    from transformers import DeepseekV3ForCausalLM

    fp8_dir, reference_dir = tmp_path / "fp8", tmp_path / "dequantized"
    make_hf_checkpoint(fp8_dir, rope_parameters=YARN)
    tensors = load_file(fp8_dir / "model.safetensors")
    block = 16
    quantized, dequantized = {}, {}
    for key, t in tensors.items():
        if key.endswith("proj.weight") and t.dim() == 2:  # attention and MLP projections, as DeepSeek quantizes
            q, s = quantize_fp8(t, block)
            quantized[key], quantized[key + "_scale_inv"] = q, s
            full = s.repeat_interleave(block, 0)[: t.shape[0]].repeat_interleave(block, 1)[:, : t.shape[1]]
            dequantized[key] = q.float() * full
        else:
            quantized[key] = dequantized[key] = t
    # several blocks in both directions, and partial edge blocks
    assert any(s.shape[0] > 1 and s.shape[1] > 1 for k, s in quantized.items() if k.endswith("_scale_inv"))
    assert quantized["model.layers.1.self_attn.kv_b_proj.weight"].dtype == torch.float8_e4m3fn
    config = json.loads((fp8_dir / "config.json").read_text())
    reference_dir.mkdir()
    (reference_dir / "config.json").write_text(json.dumps(config))
    save_file(dequantized, reference_dir / "model.safetensors")
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [block, block],
                                     "activation_scheme": "dynamic"}
    (fp8_dir / "config.json").write_text(json.dumps(config))
    save_file(quantized, fp8_dir / "model.safetensors")

    ref = DeepseekV3ForCausalLM.from_pretrained(reference_dir, dtype=torch.float32).eval()
    ours = load_model(fp8_dir)
    ids = torch.randint(0, 96, (2, 25))
    with torch.no_grad():
        assert (ours(ids) - ref(ids).logits).abs().max().item() <= 1e-4
