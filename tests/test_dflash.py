"""DFlash block drafts: the forward against a reference written out here from z-lab's dflash/model.py, the
context's keys and values computed once equal to recomputing them, many blocks under one mask equal to each block
alone, and config.json read back and refused where eyas would compute something else. The MLA-shaped layer
(dflash_config.attention_mode mla) against its own reference, written out from SpecForge's Qwen3DFlashMLAAttention."""

import math

import pytest
import torch
import torch.nn.functional as F
from tiny import H, V, dflash_mla_raw, dflash_raw, hf_config

from eyas.config import ConfigError, DeepseekV3Config
from eyas.models.dflash import DFlashConfig, DFlashDraft, block_attention_mask, default_target_layer_ids


def target_config() -> DeepseekV3Config:
    return DeepseekV3Config.from_dict(hf_config().to_dict(), "tiny target")


RAW = {"qwen3": dflash_raw, "mla": dflash_mla_raw}


def make_draft(seed: int = 0, attention: str = "qwen3") -> DFlashDraft:
    torch.manual_seed(seed)
    config = DFlashConfig.from_hf(RAW[attention](), target_config(), "test")
    embed, head = torch.nn.Embedding(V, H), torch.nn.Linear(H, V, bias=False)
    draft = DFlashDraft(config, embed, head)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)  # norms off 1, so a missing one shows
            elif p.dim() > 1:
                p.normal_(0, 0.2)
    return draft.eval()


def reference(draft: DFlashDraft, target_hidden: torch.Tensor, block_ids: torch.Tensor, start: int) -> torch.Tensor:
    """z-lab's forward for one sequence, written out: context positions 0..C-1, the block at start..start+B-1,
    rotate-half rope over the whole head, k_norm then rope, GQA by repeating kv heads, no mask."""
    c = draft.config
    d, nh, nkv = c.head_dim, c.num_attention_heads, c.num_key_value_heads

    def rms(x, w, eps=c.rms_norm_eps):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def rope(x, pos):  # x [T, heads, d]
        inv = 1.0 / (c.rope.theta ** (torch.arange(0, d, 2).float() / d))
        freqs = torch.outer(pos.float(), inv)
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin

    C, B = target_hidden.shape[0], block_ids.shape[0]
    ctx = rms(target_hidden @ draft.fc.weight.T, draft.hidden_norm.weight)
    x = draft.embed_tokens.weight[block_ids]
    ctx_pos, block_pos = torch.arange(C), torch.arange(start, start + B)
    for layer in draft.layers:
        a = layer.self_attn
        h = rms(x, layer.input_layernorm.weight)
        q = rms((h @ a.q_proj.weight.T).view(B, nh, d), a.q_norm.weight)
        k = torch.cat([(ctx @ a.k_proj.weight.T).view(C, nkv, d), (h @ a.k_proj.weight.T).view(B, nkv, d)])
        v = torch.cat([(ctx @ a.v_proj.weight.T).view(C, nkv, d), (h @ a.v_proj.weight.T).view(B, nkv, d)])
        k = rms(k, a.k_norm.weight)
        pos = torch.cat([ctx_pos, block_pos])
        q, k = rope(q, block_pos), rope(k, pos)
        k, v = k.repeat_interleave(nh // nkv, dim=1), v.repeat_interleave(nh // nkv, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / d ** 0.5
        out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(B, nh * d)
        x = x + out @ a.o_proj.weight.T
        m = layer.mlp
        h = rms(x, layer.post_attention_layernorm.weight)
        x = x + (F.silu(h @ m.gate_proj.weight.T) * (h @ m.up_proj.weight.T)) @ m.down_proj.weight.T
    return rms(x, draft.norm.weight)


def mla_reference(draft: DFlashDraft, target_hidden: torch.Tensor, block_ids: torch.Tensor, start: int
                  ) -> torch.Tensor:
    """SpecForge's MLA-shaped DFlash forward for one sequence, written out: low-rank queries, the context and the
    block each through kv_a_proj_with_mqa, kv_a_layernorm and kv_b_proj, consecutive pairs of the rope part rotated
    (cos and sin from the draft's YaRN rotary, tested against transformers' elsewhere), softmax scale
    qk_head_dim^-0.5 times YaRN's mscale squared, no mask."""
    c = draft.config
    nh, nope, rd, vd, lora = (c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim,
                              c.kv_lora_rank)
    scale = (nope + rd) ** -0.5 * (0.1 * c.rope.mscale_all_dim * math.log(c.rope.factor) + 1) ** 2

    def rms(x, w, eps=c.rms_norm_eps):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def rope_pairs(x, pos):  # x [T, ..., rd]: pair (2i, 2i+1) turned by position x the i-th frequency
        cos, sin = draft.rotary(pos)
        cos, sin = cos[:, :rd // 2], sin[:, :rd // 2]
        if x.dim() == 3:
            cos, sin = cos[:, None], sin[:, None]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)

    C, B = target_hidden.shape[0], block_ids.shape[0]
    ctx = rms(target_hidden @ draft.fc.weight.T, draft.hidden_norm.weight)
    x = draft.embed_tokens.weight[block_ids]
    ctx_pos, block_pos = torch.arange(C), torch.arange(start, start + B)
    for layer in draft.layers:
        a = layer.self_attn
        h = rms(x, layer.input_layernorm.weight)
        q = (rms(h @ a.q_a_proj.weight.T, a.q_a_layernorm.weight) @ a.q_b_proj.weight.T).view(B, nh, nope + rd)
        latent = torch.cat([ctx, h]) @ a.kv_a_proj_with_mqa.weight.T  # context rows, then block rows
        c_kv, k_rope = rms(latent[:, :lora], a.kv_a_layernorm.weight), latent[:, lora:]
        k_rope = rope_pairs(k_rope, torch.cat([ctx_pos, block_pos]))
        kv = (c_kv @ a.kv_b_proj.weight.T).view(C + B, nh, nope + vd)
        k_nope, v = kv[..., :nope], kv[..., nope:]
        q_nope, q_rope = q[..., :nope], rope_pairs(q[..., nope:], block_pos)
        scores = (torch.einsum("qhd,khd->hqk", q_nope, k_nope) + torch.einsum("qhd,kd->hqk", q_rope, k_rope)) * scale
        out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(B, nh * vd)
        x = x + out @ a.o_proj.weight.T
        m = layer.mlp
        h = rms(x, layer.post_attention_layernorm.weight)
        x = x + (F.silu(h @ m.gate_proj.weight.T) * (h @ m.up_proj.weight.T)) @ m.down_proj.weight.T
    return rms(x, draft.norm.weight)


@pytest.mark.parametrize("attention", ["qwen3", "mla"])
def test_the_forward_matches_the_reference(attention):
    draft = make_draft(attention=attention)
    torch.manual_seed(1)
    C = 11
    target_hidden = torch.randn(C, 2 * H)
    anchor = torch.tensor([7])
    block = draft.block_input_ids(anchor)[0]
    assert block.tolist() == [7, V - 1, V - 1, V - 1]
    with torch.no_grad():
        kv = draft.context_kv(target_hidden[None], torch.arange(C)[None])
        if attention == "mla":  # the latent and the roped key, per layer; no q/k norms
            assert [t.shape for (t,) in kv] == [(1, C, 20 + 8)] * 2
            assert not hasattr(draft.layers[0].self_attn, "k_norm")
        out = draft(block[None], torch.arange(C, C + 4)[None], kv)[0]
        expected = (reference if attention == "qwen3" else mla_reference)(draft, target_hidden, block, C)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert draft.compute_logits(out).shape == (4, V)


@pytest.mark.parametrize("attention", ["qwen3", "mla"])
def test_context_kv_computed_in_pieces_equals_it_computed_at_once(attention):
    """The engine keeps each committed position's keys and values and appends the next ones: per-position results
    do not depend on which other positions were computed with them."""
    draft = make_draft(attention=attention)
    torch.manual_seed(2)
    hidden, positions = torch.randn(1, 9, 2 * H), torch.arange(9)[None]
    dim = 2 if attention == "qwen3" else 1  # [B, kv_heads, C, head_dim], or latents [B, C, latent_dim]
    with torch.no_grad():
        whole = draft.context_kv(hidden, positions)
        parts = [draft.context_kv(hidden[:, a:b], positions[:, a:b]) for a, b in ((0, 4), (4, 5), (5, 9))]
    for layer, kept in enumerate(whole):
        for i, t in enumerate(kept):
            torch.testing.assert_close(torch.cat([p[layer][i] for p in parts], dim=dim), t, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("attention", ["qwen3", "mla"])
def test_many_blocks_under_one_mask_equal_each_block_alone(attention):
    """Training runs every anchor's block of a sequence in one forward over the whole sequence's context; each
    block must compute what it computes alone over the context before its anchor (inference)."""
    draft = make_draft(attention=attention)
    torch.manual_seed(3)
    T, bs = 12, draft.config.block_size
    hidden, tokens = torch.randn(1, T, 2 * H), torch.randint(0, V - 1, (1, T))
    anchors = torch.tensor([[2, 5, 9, -1]])  # the last slot holds no block
    valid = anchors[0] >= 0
    block_ids = draft.block_input_ids(tokens[0, anchors[0].clamp(min=0)]).reshape(1, -1)
    block_pos = (anchors[0].clamp(min=0)[:, None] + torch.arange(bs)).reshape(1, -1)
    mask = block_attention_mask(anchors, T, bs)
    assert mask.shape == (1, 1, 4 * bs, T + 4 * bs)
    with torch.no_grad():
        together = draft(block_ids, block_pos, draft.context_kv(hidden, torch.arange(T)[None]), mask)[0]
        for a, anchor in enumerate(anchors[0][valid].tolist()):
            alone = draft(block_ids[:, a * bs:(a + 1) * bs], block_pos[:, a * bs:(a + 1) * bs],
                          draft.context_kv(hidden[:, :anchor], torch.arange(anchor)[None]))[0]
            torch.testing.assert_close(together[a * bs:(a + 1) * bs], alone, rtol=1e-5, atol=1e-5)


def test_the_mask_of_the_docstring_example():
    mask = block_attention_mask(torch.tensor([[1, 3]]), 4, 2)[0, 0].int().tolist()
    assert mask == [[1, 0, 0, 0, 1, 1, 0, 0], [1, 0, 0, 0, 1, 1, 0, 0],
                    [1, 1, 1, 0, 0, 0, 1, 1], [1, 1, 1, 0, 0, 0, 1, 1]]


def test_config_round_trips_and_refuses_what_eyas_does_not_run():
    target = target_config()
    config = DFlashConfig.from_hf(dflash_raw(), target, "test")
    assert config.rope.interleave is False and config.target_layer_ids == (1, 2)
    assert DFlashConfig.from_hf(config.to_hf(), target, "test") == config
    for change, message in [({"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
                            ({"dflash_config": {"target_layer_ids": [1], "mask_token_id": 5, "causal": True}},
                             "dflash_config.causal"),
                            ({"dflash_config": {"target_layer_ids": [1], "mask_token_id": 5,
                                                "attention_mode": "mla"}}, "kv_lora_rank"),
                            ({"dflash_config": {"target_layer_ids": [1], "mask_token_id": 5,
                                                "attention_mode": "linear"}}, "attention_mode"),
                            ({"dflash_config": {"target_layer_ids": [1], "mask_token_id": 5,
                                                "attention_mode": "mha"}}, "num_key_value_heads"),
                            ({"kv_lora_rank": 16}, "kv_lora_rank.*attention_mode"),
                            ({"dflash_config": {"target_layer_ids": [1], "mask_token_id": 5,
                                                "mla_use_output_gate": True}}, "mla_use_output_gate"),
                            ({"dflash_config": {"target_layer_ids": [1, 4], "mask_token_id": 5}},
                             "target_layer_ids.*0..3"),
                            ({"dflash_config": {"target_layer_ids": [1], "mask_token_id": V}}, "mask_token_id"),
                            ({"hidden_size": 64}, "hidden_size"), ({"num_target_layers": 61}, "num_target_layers"),
                            ({"architectures": ["LlamaForCausalLMEagle3"]}, "architectures"),
                            ({"block_size": 1}, "block_size"), ({"num_key_value_heads": 3}, "num_key_value_heads")]:
        with pytest.raises(ConfigError, match=message):
            DFlashConfig.from_hf(dflash_raw(**change), target, "test")


def test_an_mla_shaped_config_round_trips_and_refuses_what_eyas_does_not_run():
    from eyas.models.dflash import speculators_dflash_config

    target = target_config()
    config = DFlashConfig.from_hf(dflash_mla_raw(), target, "test")
    assert (config.attention_mode, config.kv_lora_rank, config.rope.head_dim, config.rope.interleave) == \
        ("mla", 20, 8, True)
    assert config.to_hf()["dflash_config"]["attention_mode"] == "mla"
    assert DFlashConfig.from_hf(config.to_hf(), target, "test") == config
    assert DFlashConfig.from_hf(dflash_mla_raw(rope_interleave=False), target, "test").rope.interleave is False
    no_q_lora = DFlashConfig.from_hf(dflash_mla_raw(q_lora_rank=None), target, "test")
    assert hasattr(DFlashDraft(no_q_lora, torch.nn.Embedding(V, H), torch.nn.Linear(H, V)).layers[0].self_attn,
                   "q_proj")
    for change, message in [({"kv_lora_rank": None}, "kv_lora_rank"), ({"qk_rope_head_dim": 7}, "qk_rope_head_dim"),
                            ({"v_head_dim": 0}, "v_head_dim"), ({"q_lora_rank": 0}, "q_lora_rank"),
                            ({"qk_rope_head_dim": "8"}, "qk_rope_head_dim")]:
        raw = dflash_mla_raw(**change)
        with pytest.raises(ConfigError, match=message):
            DFlashConfig.from_hf({k: v for k, v in raw.items() if v is not None}, target, "test")
    with pytest.raises(ConfigError, match="no speculators format"):
        speculators_dflash_config(config, "0.9.0")


def test_default_target_layer_ids_follow_z_labs_spread():
    assert default_target_layer_ids(61, 6) == (1, 12, 24, 35, 47, 58)  # the Kimi-K2.5 DFlash draft's
    assert default_target_layer_ids(61, 1) == (30,)
    assert default_target_layer_ids(8, 2) == (1, 5)


@pytest.mark.parametrize("attention", ["qwen3", "mla"])
def test_saved_and_loaded_back_bit_exact_with_the_targets_embedding_and_head(tmp_path, attention):
    from safetensors.torch import load_file, save_file
    from tiny import make_hf_checkpoint

    from eyas import load_model
    from eyas.checkpoint import CheckpointError, load_dflash_draft
    from eyas.export import save_dflash_draft

    make_hf_checkpoint(tmp_path / "target")
    target = load_model(tmp_path / "target")
    draft = make_draft(attention=attention)
    draft.embed_tokens, draft.lm_head = target.model.embed_tokens, target.lm_head
    save_dflash_draft(draft, tmp_path / "draft")
    stored = load_file(tmp_path / "draft" / "model.safetensors")
    own = "k_norm" if attention == "qwen3" else "kv_b_proj"
    assert "fc.weight" in stored and f"layers.1.self_attn.{own}.weight" in stored
    assert not any(k.startswith(("embed_tokens", "lm_head")) for k in stored)  # the target's, not saved
    loaded = load_dflash_draft(tmp_path / "draft", target)
    for key, value in draft.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    assert loaded.embed_tokens is target.model.embed_tokens and loaded.lm_head is target.lm_head
    stored["layers.0.self_attn.extra.weight"] = torch.zeros(2)  # a weight it would not use: refused, named
    save_file(stored, tmp_path / "draft" / "model.safetensors")
    with pytest.raises(CheckpointError, match="layers.0.self_attn.extra.weight"):
        load_dflash_draft(tmp_path / "draft", target)


def test_a_compressed_vocabulary_round_trips_in_both_layouts_with_its_maps(tmp_path):
    """draft_vocab_size, the draft's own head and d2t/t2d: in z-lab's layout (draft_vocab_size beside the Qwen3
    config, as vLLM's DFlash reads it) and the speculators format, loaded back bit-exact; the logits are the head's
    at the target ids d2t names and -inf elsewhere; a file without d2t, or a head of the wrong size, is refused."""
    from safetensors.torch import load_file, save_file
    from tiny import make_hf_checkpoint

    from eyas import load_model
    from eyas.checkpoint import CheckpointError, load_dflash_draft
    from eyas.export import save_dflash_draft, save_dflash_speculators

    target_cfg = target_config()
    config = DFlashConfig.from_hf(dflash_raw(draft_vocab_size=40), target_cfg, "test")
    assert config.compressed_vocab and config.to_hf()["draft_vocab_size"] == 40
    assert DFlashConfig.from_hf(config.to_hf(), target_cfg, "test") == config
    assert not DFlashConfig.from_hf(dflash_raw(draft_vocab_size=V), target_cfg, "test").compressed_vocab
    assert "draft_vocab_size" not in DFlashConfig.from_hf(dflash_raw(), target_cfg, "test").to_hf()
    for bad in (0, V + 1, "40"):
        with pytest.raises(ConfigError, match="draft_vocab_size"):
            DFlashConfig.from_hf(dflash_raw(draft_vocab_size=bad), target_cfg, "test")

    make_hf_checkpoint(tmp_path / "target")
    target = load_model(tmp_path / "target")
    torch.manual_seed(0)
    draft = DFlashDraft(config, target.model.embed_tokens, target.lm_head)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name != "embed_tokens.weight":
                p.normal_(0, 0.2) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    ids = torch.randperm(V)[:40].sort().values
    draft.d2t.copy_(ids - torch.arange(40))
    draft.t2d[ids] = True
    assert draft.shared_weights == ("embed_tokens.weight",) and draft.lm_head is not target.lm_head

    hidden = torch.randn(3, H)
    logits = draft.compute_logits(hidden)
    assert torch.equal(logits[:, ids], hidden @ draft.lm_head.weight.t())
    assert torch.isinf(logits[:, ~draft.t2d]).all()
    assert draft.draft_ids_of(ids).tolist() == list(range(40)) and draft.draft_ids_of(torch.tensor([
        int((~draft.t2d).nonzero()[0])])).tolist() == [-1]

    save_dflash_draft(draft, tmp_path / "zlab")
    save_dflash_speculators(draft, tmp_path / "spec")
    stored = load_file(tmp_path / "zlab" / "model.safetensors")
    assert stored["lm_head.weight"].shape == (40, H) and stored["d2t"].dtype == torch.int64
    assert torch.equal(stored["t2d"], draft.t2d) and "embed_tokens.weight" not in stored
    assert "embed_tokens.weight" in load_file(tmp_path / "spec" / "model.safetensors")
    for layout in ("zlab", "spec"):
        loaded = load_dflash_draft(tmp_path / layout, target)
        assert loaded.config.draft_vocab_size == 40, layout
        for key, value in draft.state_dict().items():
            assert torch.equal(loaded.state_dict()[key], value), (layout, key)
        assert loaded.embed_tokens is target.model.embed_tokens

    for change, message in [(lambda t: t.pop("d2t"), "d2t"),
                            (lambda t: t.update({"lm_head.weight": torch.zeros(41, H)}), "lm_head.weight"),
                            (lambda t: t.update({"d2t": torch.full((40,), V)}), "d2t")]:
        tensors = dict(stored)
        change(tensors)
        save_file(tensors, tmp_path / "zlab" / "model.safetensors")
        with pytest.raises(CheckpointError, match=message):
            load_dflash_draft(tmp_path / "zlab", target)


# -- training: anchors, blocks, losses ------------------------------------------------------------------------------

def test_anchors_are_supervised_positions_with_a_supervised_next_token_and_context():
    from eyas.train.dflash import sample_anchors

    mask = torch.tensor([1, 1, 1, 0, 1, 1, 1, 1, 0, 0])
    assert sample_anchors(mask, 100).tolist() == [1, 4, 5, 6]  # 0 has no context; 2 and 7 lack a taught next
    g = torch.Generator().manual_seed(0)
    few = sample_anchors(mask, 2, g)
    assert few.numel() == 2 and set(few.tolist()) <= {1, 4, 5, 6} and few.tolist() == sorted(few.tolist())
    assert sample_anchors(torch.zeros(6), 4).numel() == 0


def test_blocks_of_a_worked_example():
    """Tokens 10..17, loss on positions 2..7, block size 3, anchors 2 and 6 (and none for the second sequence's
    second slot): rows stand for positions a, a+1, a+2; labels past the end are not taught."""
    from eyas.train.dflash import make_blocks

    ids = torch.arange(10, 18).repeat(2, 1)
    mask = torch.tensor([0, 0, 1, 1, 1, 1, 1, 1]).repeat(2, 1)
    blocks = make_blocks(ids, mask, [torch.tensor([2, 6]), torch.tensor([3])], 3, mask_token_id=99)
    assert blocks.anchors.tolist() == [[2, 6], [3, -1]]
    assert blocks.input_ids.tolist() == [[12, 99, 99, 16, 99, 99], [13, 99, 99, 10, 99, 99]]
    assert blocks.positions[0].tolist() == [2, 3, 4, 6, 7, 8]
    assert blocks.labels[0].tolist() == [[12, 13, 14], [16, 17, 17]]  # position 8 does not exist (clamped)
    assert blocks.valid.tolist() == [[[False, True, True], [False, True, False]],
                                     [[False, True, True], [False, False, False]]]


def reference_block_loss(logits, labels, valid, loss, gamma, alpha):
    """Block by block and row by row, as the formulas read."""
    import math

    num, den = 0.0, 0.0
    for b in range(logits.shape[0]):
        ces = []
        for k in range(1, logits.shape[1]):
            logp = logits[b, k].detach().double().log_softmax(-1)
            ces.append(-float(logp[labels[b, k]]) if valid[b, k] else None)
        reach, weights = 1.0, []
        if loss == "dpace":
            tail = []
            for ce in ces:
                if ce is not None:
                    reach *= (1 - alpha) * math.exp(-ce) + alpha
                tail.append(reach if ce is not None else 0.0)
            weights = [sum(tail[j:]) for j in range(len(tail))]
        else:
            weights = [math.exp(-k / gamma) for k in range(len(ces))]
        for ce, w in zip(ces, weights):
            if ce is not None:
                num += w * ce
                den += w
    return num / den


@pytest.mark.parametrize("loss", ["ce", "dpace"])
def test_block_loss_matches_the_reference_and_weights_carry_no_gradient(loss):
    from eyas.train.dflash import block_loss

    torch.manual_seed(4)
    logits = torch.randn(5, 4, 7, requires_grad=True)
    labels = torch.randint(0, 7, (5, 4))
    valid = torch.rand(5, 4) > 0.25
    valid[:, 0] = False
    value, stats = block_loss(logits, labels, valid, loss, gamma=3.0, alpha=0.3)
    assert value.item() == pytest.approx(reference_block_loss(logits, labels, valid, loss, 3.0, 0.3), rel=1e-5)
    assert stats["rows"] == int(valid.sum()) and len(stats["acc_per_row"]) == 3
    value.backward()
    # the weights are constants: the gradient is sum(w * dCE) / sum(w), with w from the formula
    grad = logits.grad.clone()
    logits.grad = None
    with torch.no_grad():
        ce = F.cross_entropy(logits[:, 1:].reshape(-1, 7), labels[:, 1:].reshape(-1), reduction="none").view(5, 3)
    if loss == "ce":
        w = torch.exp(-torch.arange(3.0) / 3.0).expand(5, 3) * valid[:, 1:]
    else:
        kept = ((0.7 * torch.exp(-ce) + 0.3).masked_fill(~valid[:, 1:], 1.0)).cumprod(-1) * valid[:, 1:]
        w = kept.flip(-1).cumsum(-1).flip(-1) * valid[:, 1:]
    surrogate = (w * F.cross_entropy(logits[:, 1:].reshape(-1, 7), labels[:, 1:].reshape(-1),
                                     reduction="none").view(5, 3)).sum() / w.sum()
    surrogate.backward()
    torch.testing.assert_close(grad, logits.grad)


@pytest.mark.parametrize("loss", ["ce", "dpace"])
def test_soft_labels_match_the_reference(loss):
    """Against the target's distribution: each row's cross-entropy is -sum p log q, D-PACE's acceptance proxy
    stays the draft's probability of the label; one-hot targets give the hard loss exactly."""
    import math

    from eyas.train.dflash import block_loss_terms

    torch.manual_seed(5)
    logits = torch.randn(5, 4, 7)
    labels = torch.randint(0, 7, (5, 4))
    valid = torch.rand(5, 4) > 0.25
    valid[:, 0] = False
    taught = valid[:, 1:]
    soft = torch.softmax(torch.randn(int(taught.sum()), 7), -1)
    terms = block_loss_terms(logits, labels, valid, loss, 3.0, 0.3, soft)
    num = den = 0.0
    it = iter(soft)
    for b in range(5):
        reach, rows = 1.0, []
        for k in range(1, 4):
            if not valid[b, k]:
                rows.append((None, 0.0))
                continue
            logq = logits[b, k].double().log_softmax(-1)
            reach *= 0.7 * math.exp(float(logq[labels[b, k]])) + 0.3
            rows.append((-float((next(it).double() * logq).sum()), reach))
        tails = [sum(r for _, r in rows[j:]) for j in range(3)]
        for j, (ce, _) in enumerate(rows):
            if ce is not None:
                w = tails[j] if loss == "dpace" else math.exp(-j / 3.0)
                num, den = num + w * ce, den + w
    assert (terms.weighted_sum / terms.weight_sum).item() == pytest.approx(num / den, rel=1e-5)
    one_hot = F.one_hot(labels[:, 1:][taught], 7).float()
    hard, as_soft = block_loss_terms(logits, labels, valid, loss), block_loss_terms(logits, labels, valid, loss,
                                                                                    soft_targets=one_hot)
    torch.testing.assert_close(as_soft.weighted_sum, hard.weighted_sum)


def test_soft_labels_read_the_targets_logits_at_the_position_before_each_row():
    """BlockObjective's soft targets come from the target's logits at read_positions, row-major: with the target
    sure of the data's next token everywhere, soft labels teach exactly what hard labels do (an off-by-one in the
    gather would teach another token and differ)."""
    from eyas.train.dflash import BlockObjective
    from eyas.train.ttt import read_positions

    draft = make_draft(2)
    torch.manual_seed(3)
    B, T = 2, 12
    input_ids = torch.randint(0, V, (B, T))
    loss_mask = torch.zeros(B, T)
    loss_mask[0, 3:] = 1
    loss_mask[1, 5:10] = 1
    n = len(draft.config.target_layer_ids)
    aux = torch.randn(B, T, n, H)
    read = read_positions(loss_mask)
    next_tokens = torch.roll(input_ids, -1, dims=1)[read]
    target_logits = 60.0 * F.one_hot(next_tokens, V).float()
    terms = {}
    for soft in (False, True):
        objective = BlockObjective(draft, "dpace", 7.0, 0.5, num_anchors=4, soft_labels=soft)
        generators = [torch.Generator().manual_seed(i) for i in range(B)]
        terms[soft] = objective(input_ids, loss_mask, aux, generators, target_logits if soft else None)
    torch.testing.assert_close(terms[True].weighted_sum, terms[False].weighted_sum, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(terms[True].ce_per_row, terms[False].ce_per_row, rtol=1e-5, atol=1e-5)
