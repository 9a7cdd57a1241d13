"""DFlash block drafts (arXiv 2602.06036), in the layout z-lab publishes and vLLM and SGLang load: N Qwen3-style
decoder layers that propose a whole block of tokens in one forward, where an EAGLE-3 draft takes K sequential steps.

    ctx   = hidden_norm(fc(cat(target hidden states at target_layer_ids)))     # [C, H], every committed position
    block = embed([anchor, MASK, ..., MASK])                                     # [B, H], B = block_size
    in each layer:  q from the block;  k = k_norm(k_proj(cat(ctx, block))),  v = v_proj(cat(ctx, block)),
                    rope at the context's and the block's positions; the block attends to all of its context and,
                    non-causally, to the whole block
    norm, then the target's lm_head at block rows 1..B-1: the B-1 drafts (or, with a compressed draft vocabulary,
    the draft's own head over draft_vocab_size ids, draft id i being target id i + d2t[i], as in EAGLE-3 drafts)

The context enters every layer only through that layer's k_proj/v_proj, so its keys and values can be computed once
per committed position and kept (`context_kv`), as a KV cache is; the block's own are recomputed each time.

An MLA-shaped layer (`dflash_config.attention_mode: mla`, SpecForge's name and fields, as Kimi-K3's DFlash2 drafts
are shaped) is DeepSeek-V3's attention in place of the Qwen3 one: the fused context enters through the layer's
kv_a_proj_with_mqa and kv_a_layernorm, so what a context position keeps is its latent and roped shared key
(kv_lora_rank + qk_rope_head_dim values per layer, against 2 x kv_heads x head_dim), expanded through kv_b_proj
beside the block's own latents; no q/k norms, partial rope, softmax scale as the target's.
`target_layer_ids` are 0-based decoder-layer outputs (hidden_states[id + 1]), z-lab's convention. The speculators
library's `dflash` format (vLLM reads it natively) holds the same draft; it is read and written at the end of the
config part below, with the sources of its facts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from eyas.config import ConfigError, DeepseekV3Config, RopeConfig, read_config_json
from eyas.models.deepseek_v3 import MLAttention
from eyas.models.eagle3 import (
    fill_vocab_maps,
    register_vocab_maps,
    target_ids_of,
    to_target_ids,
    to_target_vocab,
)
from eyas.models.layers import MLP, RMSNorm, Rotary, apply_rope
from eyas.models.rows_matmul import linear_rows

ARCHITECTURE = "DFlashDraftModel"
# dflash_config keys eyas runs as they are; any other is a switch eyas does not implement, so an error
DFLASH_CONFIG_KEYS = ("target_layer_ids", "mask_token_id", "attention_mode")
# dflash_config.attention_mode: Qwen3 attention (gqa: grouped KV heads, mha: one per query head) or DeepSeek's MLA
ATTENTION_MODES = ("gqa", "mha", "mla")
MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
SHARED_WEIGHTS = ("embed_tokens.weight", "lm_head.weight")  # the target's (a compressed vocabulary: the embedding)


def read_dflash_config(draft_dir: str | Path) -> dict | None:
    """A DFlash draft directory's config.json, as the file has it, in either layout eyas reads: z-lab's (it names
    DFlashDraftModel) or the speculators library's (`speculators_model_type: dflash`; `block_size` is at the top
    level in both). None for any other draft, or for none readable: loading the draft then says what is wrong."""
    try:
        raw = read_config_json(Path(draft_dir) / "config.json", "a draft checkpoint directory")
    except ValueError:
        return None
    names = raw.get("architectures")
    return raw if is_speculators_dflash(raw) or (isinstance(names, list) and ARCHITECTURE in names) else None


def _wrong(source: str, name: str, value: Any, expected: str) -> ConfigError:
    return ConfigError(f"{source}: field {name!r} is {value!r}; expected {expected}")


@dataclass(slots=True)
class DFlashConfig:
    """A DFlash draft as eyas runs it: full (non-sliding) attention, non-causal within the block."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    block_size: int
    target_layer_ids: tuple[int, ...]  # 0-based decoder-layer outputs of the target
    mask_token_id: int  # the embedding row the block's masked positions read
    vocab_size: int  # the target's
    num_target_layers: int
    rope: RopeConfig
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    attention_mode: str = "gqa"  # dflash_config.attention_mode; "mla": the fields below shape the attention
    q_lora_rank: int | None = None  # None: a full-rank q_proj
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    draft_vocab_size: int | None = None  # None: the target's vocabulary, through its lm_head
    source: str = "config.json"

    def __post_init__(self) -> None:
        src = self.source
        if self.attention_mode not in ATTENTION_MODES:
            raise _wrong(src, "dflash_config.attention_mode", self.attention_mode, " or ".join(ATTENTION_MODES))
        if self.attention_mode == "mla":
            self._check_mla()
        elif any(getattr(self, name) for name in MLA_FIELDS):
            raise ConfigError(f"{src}: {', '.join(n for n in MLA_FIELDS if getattr(self, n))} shape MLA attention, "
                              f"but dflash_config.attention_mode is {self.attention_mode!r} (a Qwen3-style draft); "
                              "set attention_mode to \"mla\" or remove them")
        if self.attention_mode == "mha" and self.num_key_value_heads != self.num_attention_heads:
            raise _wrong(src, "num_key_value_heads", self.num_key_value_heads, f"num_attention_heads "
                         f"({self.num_attention_heads}): dflash_config.attention_mode is \"mha\"")
        for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "intermediate_size", "vocab_size", "num_target_layers", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise _wrong(src, name, value, "a positive integer")
        if self.num_attention_heads % self.num_key_value_heads:
            raise _wrong(src, "num_key_value_heads", self.num_key_value_heads,
                         f"a divisor of num_attention_heads ({self.num_attention_heads})")
        if not isinstance(self.block_size, int) or not 2 <= self.block_size <= 64:
            raise _wrong(src, "block_size", self.block_size, "an integer in 2..64 (the anchor and its drafts)")
        ids = self.target_layer_ids
        if (not ids or len(set(ids)) != len(ids) or
                not all(isinstance(i, int) and 0 <= i < self.num_target_layers for i in ids)):
            raise _wrong(src, "dflash_config.target_layer_ids", list(ids),
                         f"distinct decoder-layer indices in 0..{self.num_target_layers - 1}")
        if not isinstance(self.mask_token_id, int) or not 0 <= self.mask_token_id < self.vocab_size:
            raise _wrong(src, "dflash_config.mask_token_id", self.mask_token_id,
                         f"a token id below vocab_size {self.vocab_size}")
        if self.draft_vocab_size is not None and (type(self.draft_vocab_size) is not int
                                                  or not 1 <= self.draft_vocab_size <= self.vocab_size):
            raise _wrong(src, "draft_vocab_size", self.draft_vocab_size, f"an integer in 1..vocab_size "
                         f"({self.vocab_size}), or absent for the target's whole vocabulary")
        if self.draft_vocab_size == self.vocab_size:
            self.draft_vocab_size = None

    @property
    def compressed_vocab(self) -> bool:
        """Whether the draft proposes from a vocabulary of its own (draft_vocab_size ids, its own lm_head and d2t)."""
        return self.draft_vocab_size is not None

    def _check_mla(self) -> None:
        src = self.source
        for name in ("kv_lora_rank", "qk_rope_head_dim", "v_head_dim"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise _wrong(src, name, value, "a positive integer (dflash_config.attention_mode is \"mla\")")
        if type(self.qk_nope_head_dim) is not int or self.qk_nope_head_dim < 0:
            raise _wrong(src, "qk_nope_head_dim", self.qk_nope_head_dim, "an integer >= 0")
        if self.qk_rope_head_dim % 2:
            raise _wrong(src, "qk_rope_head_dim", self.qk_rope_head_dim, "an even number (rope rotates pairs)")
        if self.q_lora_rank is not None and (type(self.q_lora_rank) is not int or self.q_lora_rank < 1):
            raise _wrong(src, "q_lora_rank", self.q_lora_rank, "a positive integer, or null for a full-rank q_proj")
        if self.rope.head_dim != self.qk_rope_head_dim:
            raise _wrong(src, "qk_rope_head_dim", self.qk_rope_head_dim, f"the rope's width {self.rope.head_dim}")

    def mla_layer_config(self) -> DeepseekV3Config:
        """An MLA-shaped layer's attention, as the target's layer config type describes it (eyas.models.deepseek_v3
        builds the projections from it); its MLP is the draft's own."""
        return DeepseekV3Config(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
            kv_lora_rank=self.kv_lora_rank, qk_nope_head_dim=self.qk_nope_head_dim,
            qk_rope_head_dim=self.qk_rope_head_dim, v_head_dim=self.v_head_dim, rope=self.rope,
            max_position_embeddings=self.max_position_embeddings, q_lora_rank=self.q_lora_rank,
            n_routed_experts=None, rms_norm_eps=self.rms_norm_eps, attention_bias=self.attention_bias,
            source=self.source)

    @property
    def latent_dim(self) -> int:
        """What an MLA-shaped layer keeps per context position: the latent and the roped shared key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @classmethod
    def from_hf(cls, raw: dict, target: DeepseekV3Config, source: str = "config.json") -> DFlashConfig:
        """The draft described by a DFlash config.json (z-lab's layout, or the speculators library's, read as
        z-lab's), checked against its `target`: every switch eyas does not run (sliding-window layers, causal
        blocks, MLA-shaped layers) is an error naming it."""
        if is_speculators_dflash(raw):
            raw = speculators_dflash_to_hf(raw, source)
        names = raw.get("architectures") or []
        if ARCHITECTURE not in names:
            raise _wrong(source, "architectures", names, f'["{ARCHITECTURE}"]')
        dflash = raw.get("dflash_config")
        if not isinstance(dflash, dict):
            raise _wrong(source, "dflash_config", dflash, "a mapping with target_layer_ids and mask_token_id")
        unknown = sorted(set(dflash) - set(DFLASH_CONFIG_KEYS) - {"causal"})
        if unknown:
            raise ConfigError(f"{source}: dflash_config sets {unknown}, which eyas does not run (it runs "
                              f"{', '.join(DFLASH_CONFIG_KEYS)} and causal: false)")
        mode = dflash.get("attention_mode", "gqa")
        mode = mode.lower() if isinstance(mode, str) else mode  # SpecForge reads it case-blind
        if dflash.get("causal", False) is not False:
            raise _wrong(source, "dflash_config.causal", dflash["causal"], "false (eyas runs non-causal blocks)")
        layer_types = raw.get("layer_types")
        if layer_types is not None and any(t != "full_attention" for t in layer_types):
            raise _wrong(source, "layer_types", layer_types, 'only "full_attention" (sliding-window DFlash layers '
                         "are not supported)")
        if raw.get("use_sliding_window"):
            raise _wrong(source, "use_sliding_window", raw["use_sliding_window"], "false")
        if raw.get("hidden_act", "silu") != "silu":
            raise _wrong(source, "hidden_act", raw["hidden_act"], '"silu"')
        if raw.get("hidden_size") != target.hidden_size:
            raise _wrong(source, "hidden_size", raw.get("hidden_size"), f"the target's hidden size "
                         f"{target.hidden_size} (the draft fuses its hidden states and shares its embedding)")
        if raw.get("vocab_size", target.vocab_size) != target.vocab_size:
            raise _wrong(source, "vocab_size", raw["vocab_size"], f"the target's {target.vocab_size}")
        heads = raw.get("num_attention_heads")
        head_dim = raw.get("head_dim") or (raw["hidden_size"] // heads if isinstance(heads, int) and heads else 0)
        max_positions = int(raw.get("max_position_embeddings", target.max_position_embeddings))
        mla = {name: raw.get(name) for name in MLA_FIELDS if raw.get(name) is not None}
        if mode == "mla":
            for name in MLA_FIELDS[1:]:
                if name not in mla:
                    raise _wrong(source, name, None, "an integer: dflash_config.attention_mode is \"mla\"")
            if type(mla["qk_nope_head_dim"]) is int and type(mla["qk_rope_head_dim"]) is int:
                head_dim = mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"]  # else _check_mla names the field
        rope = RopeConfig.from_hf(raw, mla["qk_rope_head_dim"] if mode == "mla" else head_dim, max_positions, source)
        # Qwen3 layers rotate halves, MLA ones consecutive pairs (DeepSeek's, SpecForge's default): unless it says
        rope.interleave = bool(raw.get("rope_interleave", mode == "mla"))
        num_target_layers = raw.get("num_target_layers", target.num_hidden_layers)
        if num_target_layers != target.num_hidden_layers:
            raise _wrong(source, "num_target_layers", num_target_layers,
                         f"the target's num_hidden_layers {target.num_hidden_layers}")
        return cls(hidden_size=raw["hidden_size"], num_hidden_layers=raw.get("num_hidden_layers"),
                   num_attention_heads=heads, num_key_value_heads=raw.get("num_key_value_heads", heads),
                   head_dim=head_dim, intermediate_size=raw.get("intermediate_size"),
                   block_size=raw.get("block_size"), target_layer_ids=tuple(dflash.get("target_layer_ids") or ()),
                   mask_token_id=dflash.get("mask_token_id"), vocab_size=target.vocab_size,
                   num_target_layers=num_target_layers, rope=rope, max_position_embeddings=max_positions,
                   rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                   attention_bias=bool(raw.get("attention_bias", False)), attention_mode=mode, **mla,
                   draft_vocab_size=raw.get("draft_vocab_size"), source=source)

    def to_hf(self) -> dict:
        """config.json in z-lab's layout (a Qwen3 config), as vLLM (`method: dflash`) and SGLang read it."""
        return {
            "architectures": [ARCHITECTURE], "model_type": "qwen3", "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size, "hidden_act": "silu", "rms_norm_eps": self.rms_norm_eps,
            "vocab_size": self.vocab_size, "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": self.attention_bias, "tie_word_embeddings": False, "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "layer_types": ["full_attention"] * self.num_hidden_layers,
            "dflash_config": {"target_layer_ids": list(self.target_layer_ids), "mask_token_id": self.mask_token_id,
                              **({"attention_mode": "mla"} if self.attention_mode == "mla" else {})},
            **({name: getattr(self, name) for name in MLA_FIELDS} if self.attention_mode == "mla" else {}),
            **self.rope.to_hf(), "rope_interleave": self.rope.interleave,
            # vLLM's DFlash reads it beside d2t (its qwen3_dflash.py); absent, the target's vocabulary
            **({"draft_vocab_size": self.draft_vocab_size} if self.compressed_vocab else {}),
        }


# ---- the speculators format ---------------------------------------------------------------------------------------
# The speculators library's `dflash` format, which vLLM reads natively. Facts (read 2026-12-05; no code copied):
# [S]  speculators 0.9.0, the PyPI wheel of 2026-10 (sha256 f0de7571...4481): speculators/models/dflash/config.py
#      (DFlashSpeculatorConfig), speculators/config.py (SpeculatorModelConfig, SpeculatorsConfig, VerifierConfig),
#      proposals/greedy.py, models/dflash/core.py, convert/dflash/converter.py. The DFlash fields are the same in
#      vllm-project/speculators v0.7.0 (1c2895f, 2026-07-29) and main at c05b95b (2026-08-20); v0.6.0 lacked
#      sample_from_anchor, v0.5.0 sliding_window_non_causal too (and had max_anchors).
# [V]  vllm-project/vllm: vllm/transformers_utils/configs/speculators/base.py @ 052316a and algos.py (update_dflash;
#      the index's copies carry no commit), vllm/model_executor/models/qwen3_dflash.py @ 036a00d.
# - config.json holds exactly SPECULATORS_DFLASH_FIELDS [S config.py]: architectures ["DFlashSpeculator"];
#   transformer_layer_config, the Qwen3 config of the draft's layers: z-lab's config.json less architectures,
#   auto_map, block_size, dflash_config and num_target_layers [S converter.py]; draft_vocab_size (the target's
#   vocabulary, or a compressed one with d2t and t2d tensors beside lm_head, as speculators' EAGLE-3 drafts keep
#   them; vLLM loads d2t as draft_id_to_target_id [V qwen3_dflash.py]); block_size; target_hidden_size;
#   aux_hidden_state_layer_ids = z-lab's
#   target_layer_ids + 1 [S converter.py; V algos.py maps them back with - 1]; mask_token_id;
#   sliding_window_non_causal (default false); sample_from_anchor (default false: the anchor is the token being
#   verified and block rows 1..B-1 the B - 1 drafts, as in z-lab's block and eyas's); speculators_version; and
#   speculators_config {algorithm "dflash", proposal_methods [{proposal_type "greedy", speculative_tokens B - 1,
#   verifier_accept_k 1, accept_tolerance 0.0}], default_proposal_method "greedy", verifier {name_or_path,
#   architectures}} [S converter.py, greedy.py]. vLLM takes speculative_tokens as num_speculative_tokens [V base.py].
# - sliding_window_non_causal is written true: vLLMs that read it set dflash_config.causal = not
#   sliding_window_non_causal (true when absent) [V algos.py], and dflash_config.causal decides every layer's
#   causality [V qwen3_dflash.py, _dflash_layer_causal], so false would run this non-causal draft causally there;
#   speculators keeps full-attention layers bidirectional whatever the field says [S config.py].
# - tensors: the body keeps z-lab's names (fc, hidden_norm, norm, layers.{i}.*) [S converter.py copies them as they
#   are]; embed_tokens.weight and lm_head.weight are the target's, which the converter fills in from the verifier;
#   verifier_lm_head and verifier_norm are never saved [S core.py]. speculators v0.7.0 saves both copies; 0.9.0
#   saves neither for a full-vocabulary draft and reloads them from the verifier on loading. eyas writes them, so
#   every version reads the file without the verifier at hand, and vLLM runs the draft on those copies
#   [V qwen3_dflash.py load_weights]; eyas's loader checks that they are the target's.
SPECULATORS_MODEL_TYPE = "dflash"
SPECULATORS_ARCHITECTURE = "DFlashSpeculator"
SPECULATORS_DFLASH_FIELDS = ("architectures", "speculators_model_type", "speculators_version", "speculators_config",
                             "transformer_layer_config", "draft_vocab_size", "block_size", "target_hidden_size",
                             "aux_hidden_state_layer_ids", "mask_token_id", "sliding_window_non_causal",
                             "sample_from_anchor")
# what transformers' save_pretrained adds to every config it writes (speculators' too): nothing about the draft
PRETRAINED_BOOKKEEPING = ("transformers_version", "torch_dtype", "dtype")
_SPECULATORS_CONFIG_KEYS = ("algorithm", "proposal_methods", "default_proposal_method", "verifier")
_NOT_LAYER_KEYS = ("architectures", "auto_map", "block_size", "dflash_config", "num_target_layers", "draft_vocab_size")


def is_speculators_dflash(raw: dict) -> bool:
    return raw.get("speculators_model_type") == SPECULATORS_MODEL_TYPE


def speculators_dflash_config(config: DFlashConfig, version: str, verifier: dict | None = None,
                              speculative_tokens: int | None = None, torch_dtype: str = "float32") -> dict:
    """config.json of `config` in the speculators `dflash` format (see the facts above); `verifier`
    ({"name_or_path", "architectures"}) names the target, `speculative_tokens` (default block_size - 1) is the K
    vLLM runs."""
    if config.attention_mode == "mla":
        raise ConfigError(f"{config.source}: an MLA-shaped DFlash draft (dflash_config.attention_mode \"mla\") has "
                          "no speculators format: speculators' dflash layers are Qwen3 attention only; z-lab's layout "
                          "(as eyas saves it) holds it")
    B = config.block_size
    tokens = B - 1 if speculative_tokens is None else speculative_tokens
    if not isinstance(tokens, int) or not 1 <= tokens <= B - 1:
        raise ConfigError(f"speculative_tokens is {tokens!r}; expected 1..{B - 1} (block_size {B} - 1: the anchor "
                          "and its drafts fill the block)")
    if config.rope.interleave:
        raise _wrong(config.source, "rope_interleave", True, "false: speculators' DFlash layers and vLLM's rotate "
                     "halves (Qwen3), and neither format field says otherwise")
    layer = {k: v for k, v in config.to_hf().items() if k not in (*_NOT_LAYER_KEYS, "rope_interleave")}
    layer["torch_dtype"] = torch_dtype
    verifier = verifier or {"name_or_path": None, "architectures": []}
    return {
        "architectures": [SPECULATORS_ARCHITECTURE],
        "speculators_model_type": SPECULATORS_MODEL_TYPE,
        "speculators_version": version,
        "speculators_config": {
            "algorithm": SPECULATORS_MODEL_TYPE,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": tokens, "verifier_accept_k": 1,
                                  "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier["name_or_path"], "architectures": list(verifier["architectures"])},
        },
        "transformer_layer_config": layer,
        "draft_vocab_size": config.draft_vocab_size or config.vocab_size,
        "block_size": B,
        "target_hidden_size": config.hidden_size,
        "aux_hidden_state_layer_ids": [i + 1 for i in config.target_layer_ids],
        "mask_token_id": config.mask_token_id,
        "sliding_window_non_causal": True,
        "sample_from_anchor": False,
    }


def speculators_dflash_to_hf(raw: dict, source: str) -> dict:
    """A speculators `dflash` config.json as z-lab's layout, which DFlashConfig.from_hf reads: the layers' config at
    the top, dflash_config.target_layer_ids = aux_hidden_state_layer_ids - 1. A key speculators' DFlash config does
    not declare, or a setting eyas does not run, is an error naming it."""
    unknown = sorted(set(raw) - set(SPECULATORS_DFLASH_FIELDS) - set(PRETRAINED_BOOKKEEPING))
    if unknown:
        raise ConfigError(f"{source}: the speculators dflash config sets {unknown}, which speculators' DFlash config "
                          f"does not declare (eyas reads {', '.join(SPECULATORS_DFLASH_FIELDS)})")
    layer = raw.get("transformer_layer_config")
    if not isinstance(layer, dict) or layer.get("model_type", "qwen3") != "qwen3":
        raise _wrong(source, "transformer_layer_config", layer, "the Qwen3 config (model_type qwen3) of the draft's "
                     "layers")
    if raw.get("sample_from_anchor", False) is not False:
        raise _wrong(source, "sample_from_anchor", raw["sample_from_anchor"], "false (eyas's block: the anchor, "
                     "then block_size - 1 drafts)")
    if not isinstance(raw.get("sliding_window_non_causal", False), bool):
        raise _wrong(source, "sliding_window_non_causal", raw["sliding_window_non_causal"], "true or false")
    if raw.get("target_hidden_size") not in (None, layer.get("hidden_size")):
        raise _wrong(source, "target_hidden_size", raw["target_hidden_size"], f"null or the hidden_size of its "
                     f"layers, {layer.get('hidden_size')}")
    ids, mask = raw.get("aux_hidden_state_layer_ids"), raw.get("mask_token_id")
    if not isinstance(ids, list) or not ids or not all(type(i) is int and i >= 1 for i in ids):
        raise _wrong(source, "aux_hidden_state_layer_ids", ids, "hidden_states indices from 1 (decoder-layer "
                     "outputs: z-lab's target_layer_ids + 1)")
    if type(mask) is not int:
        raise _wrong(source, "mask_token_id", mask, "a token id")
    _check_proposals(raw.get("speculators_config"), raw.get("block_size"), source)
    vocab = {"draft_vocab_size": raw["draft_vocab_size"]} if raw.get("draft_vocab_size") is not None else {}
    return {**layer, "architectures": [ARCHITECTURE], "block_size": raw.get("block_size"),
            "dflash_config": {"target_layer_ids": [i - 1 for i in ids], "mask_token_id": mask}, **vocab}


def _check_proposals(spec: Any, block_size: Any, source: str) -> None:
    """speculators_config: the dflash algorithm, whose first proposal method drafts 1..block_size - 1 tokens."""
    if not isinstance(spec, dict):
        raise _wrong(source, "speculators_config", spec, f"a mapping of {', '.join(_SPECULATORS_CONFIG_KEYS)}")
    unknown = sorted(set(spec) - set(_SPECULATORS_CONFIG_KEYS))
    if unknown:
        raise ConfigError(f"{source}: speculators_config sets {unknown}, which speculators does not declare (it "
                          f"holds {', '.join(_SPECULATORS_CONFIG_KEYS)})")
    if spec.get("algorithm") != SPECULATORS_MODEL_TYPE:
        raise _wrong(source, "speculators_config.algorithm", spec.get("algorithm"), f'"{SPECULATORS_MODEL_TYPE}"')
    methods = spec.get("proposal_methods")
    first = methods[0] if isinstance(methods, list) and methods and isinstance(methods[0], dict) else {}
    tokens = first.get("speculative_tokens")
    if type(block_size) is int and (type(tokens) is not int or not 1 <= tokens <= block_size - 1):
        raise _wrong(source, "speculators_config.proposal_methods[0].speculative_tokens", tokens,
                     f"1..{block_size - 1} (block_size - 1: the block's drafts)")


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """z-lab's choice: one id per draft layer, spread evenly from 1 to L - 3 (one layer: L // 2)."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    span = num_target_layers - 4
    return tuple(int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers))


class DFlashAttention(nn.Module):
    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        H, d, bias = config.hidden_size, config.head_dim, config.attention_bias
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        self.q_proj = nn.Linear(H, self.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(H, self.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(H, self.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * d, H, bias=bias)
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.rms_norm_eps)
        self.interleave = config.rope.interleave

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, H] (context states, or the block's normed rows) -> k, v [B, kv_heads, T, head_dim]."""
        B, T, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim))
        k = apply_rope(k, cos.unsqueeze(2), sin.unsqueeze(2), self.interleave)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        return k.transpose(1, 2), v.transpose(1, 2)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, context_k: torch.Tensor,
                context_v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """x [B, R, H] normed block rows; context_k/v [B, kv_heads, C, head_dim]; mask [B, 1, R, C + R] (True:
        attend) or None (every row sees everything) -> [B, R, H]."""
        B, R, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, R, self.num_heads, self.head_dim))
        q = apply_rope(q, cos.unsqueeze(2), sin.unsqueeze(2), self.interleave).transpose(1, 2)
        block_k, block_v = self.keys_values(x, cos, sin)
        k, v = torch.cat([context_k, block_k], dim=2), torch.cat([context_v, block_v], dim=2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.num_heads != self.num_kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(B, R, self.num_heads * self.head_dim))


class DFlashLatentAttention(MLAttention):
    """The MLA-shaped layer's attention: the target's MLA projections (weight names as DeepSeek-V3's), with the
    context entering through the latent path. Context and block run in the expanded form (per-head keys and values
    from the latents), as the target runs prompt chunks."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__(config.mla_layer_config())

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor]:
        """x [B, T, H] (context states) -> ([B, T, kv_lora_rank + rope_dim],): each position's normed latent and
        roped shared key, all that the blocks after it read of it."""
        kv, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        return (torch.cat([self.kv_a_layernorm(kv), apply_rope(k_rope, cos, sin, self.interleave)], dim=-1),)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, context_latents: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        """x [B, R, H] normed block rows; context_latents [B, C, kv_lora_rank + rope_dim]; mask as
        DFlashAttention's -> [B, R, H]."""
        q_nope, q_rope, kv, k_rope = self._project(x, cos, sin)  # [B, R, heads, ...], [B, R, kv_lora], [B, R, rope]
        latents = torch.cat([context_latents.to(kv.dtype), torch.cat([kv, k_rope], dim=-1)], dim=1)
        k_nope, v = self.kv_b_proj(latents[..., :self.kv_lora_rank]).unflatten(-1, (self.num_heads, -1)).split(
            [self.nope_dim, self.v_dim], dim=-1)  # [B, C + R, heads, nope], [..., v]
        k_rope = latents[..., None, self.kv_lora_rank:].expand(-1, -1, self.num_heads, -1)
        q = torch.cat([q_nope, q_rope], dim=-1).transpose(1, 2)
        k = torch.cat([k_nope, k_rope], dim=-1).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v.transpose(1, 2), attn_mask=mask, scale=self.scale)
        return self.o_proj(out.transpose(1, 2).flatten(-2))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DFlashLatentAttention(config) if config.attention_mode == "mla" else DFlashAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, context_kv: tuple[torch.Tensor, ...],
                mask: torch.Tensor | None) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, *context_kv, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDraft(nn.Module):
    """The draft's own weights (`fc`, `hidden_norm`, `layers`, `norm`) over the target's embedding and lm_head,
    which it shares (`shared_weights`: neither saved with the draft nor trained). With a compressed vocabulary the
    head is the draft's own (draft_vocab_size rows, saved and trained) with its d2t/t2d maps; `lm_head` is unused."""

    def __init__(self, config: DFlashConfig, embed_tokens: nn.Embedding, lm_head: nn.Linear) -> None:
        super().__init__()
        self.config = config
        H = config.hidden_size
        self.fc = nn.Linear(len(config.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(H, config.rms_norm_eps)
        self.embed_tokens = embed_tokens  # the target's, shared: their keys are not the draft's own weights
        self.shared_weights: tuple[str, ...] = SHARED_WEIGHTS
        if config.compressed_vocab:
            lm_head = nn.Linear(H, config.draft_vocab_size, bias=False)
            self.shared_weights = ("embed_tokens.weight",)
            register_vocab_maps(self, config.draft_vocab_size, config.vocab_size)
        self.lm_head = lm_head
        self.rotary = Rotary(config.rope, config.max_position_embeddings)

    def context_kv(self, target_hidden: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
        """target_hidden [B, C, n * H] (the target's states at target_layer_ids, concatenated in that order) at
        `positions` [B, C] -> per layer (k, v) [B, kv_heads, C, head_dim] (MLA-shaped: (latents [B, C,
        latent_dim],)): what a context position contributes to every block after it, computed once."""
        ctx = self.hidden_norm(self.fc(target_hidden))
        cos, sin = self.rotary(positions)
        return [layer.self_attn.keys_values(ctx, cos, sin) for layer in self.layers]

    def block_input_ids(self, anchors: torch.Tensor) -> torch.Tensor:
        """anchors [...] -> [..., block_size]: each anchor token followed by block_size - 1 mask tokens."""
        block = anchors.new_full((*anchors.shape, self.config.block_size), self.config.mask_token_id)
        block[..., 0] = anchors
        return block

    def forward(self, block_ids: torch.Tensor, block_positions: torch.Tensor,
                context_kv: list[tuple[torch.Tensor, ...]], mask: torch.Tensor | None = None) -> torch.Tensor:
        """block_ids, block_positions [B, R] (one or more blocks per row of the batch) over `context_kv` (from
        context_kv, C positions) -> [B, R, H], after the final norm; `mask` [B, 1, R, C + R] says which context
        positions and block rows each block row sees (None: all)."""
        x = self.embed_tokens(block_ids).to(self.fc.weight.dtype)
        cos, sin = self.rotary(block_positions)
        for layer, kv in zip(self.layers, context_kv):
            x = layer(x, cos, sin, kv, mask)
        return self.norm(x)

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the draft's vocabulary [..., draft_vocab_size] (the target's when not compressed)."""
        return linear_rows(hidden, self.lm_head)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the target's vocabulary [..., vocab]; ids outside a compressed draft vocabulary get -inf."""
        logits = self.draft_logits(hidden)
        return to_target_vocab(logits, self.d2t, self.config.vocab_size) if self.config.compressed_vocab else logits

    def greedy_proposals(self, hidden: torch.Tensor) -> torch.Tensor:
        """The draft's proposals as target ids: argmax over its own vocabulary, mapped through d2t (the head's
        matmul over draft_vocab_size rows only)."""
        draft_ids = self.draft_logits(hidden).argmax(-1)
        return to_target_ids(draft_ids, self.d2t) if self.config.compressed_vocab else draft_ids

    def draft_ids_of(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Target token ids -> draft ids, -1 where the draft vocabulary lacks the token (identity when not
        compressed)."""
        if not self.config.compressed_vocab:
            return token_ids
        draft_id = torch.full((self.config.vocab_size,), -1, dtype=torch.long, device=token_ids.device)
        draft_id[target_ids_of(self.d2t)] = torch.arange(self.config.draft_vocab_size, device=token_ids.device)
        return draft_id[token_ids]

    # -- what the engine's block proposer needs (eyas.engine.block_proposer.BlockDraft) --------------------------
    @property
    def aux_hidden_state_ids(self) -> tuple[int, ...]:
        """The target states the context reads, as the engine numbers them (HF hidden_states indices): decoder
        layer i's output is hidden_states[i + 1]."""
        return tuple(i + 1 for i in self.config.target_layer_ids)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def max_positions(self) -> int:
        return self.rotary.max_positions

    def combine_hidden_states(self, target_hidden: torch.Tensor, aux_hidden_states: list[torch.Tensor]
                              ) -> torch.Tensor:
        """The fused context hidden_norm(fc(cat(states at target_layer_ids))) [rows, H], what context_kv computes
        first; the target's final hidden state is not read."""
        return self.hidden_norm(self.fc(torch.cat(aux_hidden_states, dim=-1)))

    def cache_entries(self, fused: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """fused [rows, H] (combine_hidden_states) at positions [rows] -> what each position keeps in every layer,
        [rows, *cache_entry_shape()]: one paged-cache entry per position."""
        cos, sin = self.rotary(positions[None])
        if self.config.attention_mode == "mla":  # [rows, num_layers, latent_dim]
            return torch.stack([layer.self_attn.keys_values(fused[None], cos, sin)[0][0] for layer in self.layers],
                               dim=1)
        kv = [torch.stack(layer.self_attn.keys_values(fused[None], cos, sin), dim=1)  # [1, 2, kv, rows, d]
              for layer in self.layers]
        return torch.stack(kv, dim=1)[0].permute(3, 0, 1, 2, 4)

    def cache_entry_shape(self) -> tuple[int, ...]:
        """Per layer: the latent and roped shared key (MLA-shaped), else the keys and values of every KV head."""
        c = self.config
        if c.attention_mode == "mla":
            return (c.num_hidden_layers, c.latent_dim)
        return (c.num_hidden_layers, 2, c.num_key_value_heads, c.head_dim)

    def context_kv_of(self, entries: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
        """Cache entries [B, C, *cache_entry_shape()] -> the per-layer context_kv forward takes: (k, v) [B,
        kv_heads, C, head_dim], or (latents [B, C, latent_dim],) for an MLA-shaped draft."""
        if self.config.attention_mode == "mla":
            return [(entries[:, :, i],) for i in range(entries.shape[2])]
        return [(entries[:, :, i, 0].transpose(1, 2), entries[:, :, i, 1].transpose(1, 2))
                for i in range(entries.shape[2])]


def block_attention_mask(anchors: torch.Tensor, context_len: int, block_size: int,
                         context_valid: torch.Tensor | None = None) -> torch.Tensor:
    """The mask of many blocks over one shared context, as training runs them (one forward per sequence).

    anchors [B, A]: the position of each block's anchor (-1: no block); row (a, i) of the block part sees context
    position j when j < anchors[b, a] (and context_valid[b, j]), and every row of its own block, none of another's.
    Returns [B, 1, A * block_size, context_len + A * block_size] (True: attend).

    Example, block_size 2, context_len 4, anchors [[1, 3]]: block rows 0-1 see context 0 and themselves; rows 2-3
    see context 0-2 and themselves.
    """
    B, A = anchors.shape
    positions = torch.arange(context_len, device=anchors.device)
    sees_context = positions.view(1, 1, context_len) < anchors.unsqueeze(-1)  # [B, A, C]
    if context_valid is not None:
        sees_context &= context_valid.unsqueeze(1)
    sees_context = sees_context.repeat_interleave(block_size, dim=1)  # [B, A * bs, C]
    block_of = torch.arange(A * block_size, device=anchors.device) // block_size
    sees_block = (block_of.view(-1, 1) == block_of.view(1, -1)).expand(B, -1, -1)  # [B, A * bs, A * bs]
    real = (anchors >= 0).repeat_interleave(block_size, dim=1).unsqueeze(-1)  # rows of absent blocks see only
    return torch.cat([sees_context & real, sees_block], dim=-1).unsqueeze(1)  # their own block: never empty


def new_dflash_config(target: DeepseekV3Config, num_layers: int, block_size: int, target_layer_ids: tuple[int, ...],
                      mask_token_id: int, intermediate_size: int = 0, attention_mode: str = "mha",
                      kv_lora_rank: int = 0, draft_vocab_size: int | None = None) -> DFlashConfig:
    """A new draft shaped after `target`, with its dense MLP width unless `intermediate_size` says otherwise.
    attention_mode "mha": Qwen3-style layers of the target's width and head count (head_dim = hidden / heads, one KV
    head per query head), the target's rope rotating halves, as Qwen3 does. "mla": the target's own attention shape
    (its q_lora_rank, head dims and rope), with `kv_lora_rank` (0: the target's) as the latent's width.
    `draft_vocab_size`: a compressed draft vocabulary (None: the target's, through its lm_head)."""
    heads = target.num_attention_heads
    shape: dict[str, Any] = {}
    if attention_mode == "mla":
        shape = dict(q_lora_rank=target.q_lora_rank, kv_lora_rank=kv_lora_rank or target.kv_lora_rank,
                     qk_nope_head_dim=target.qk_nope_head_dim, qk_rope_head_dim=target.qk_rope_head_dim,
                     v_head_dim=target.v_head_dim)
        head_dim = target.qk_head_dim
        rope = dataclasses.replace(target.rope)
    elif attention_mode == "mha":
        if kv_lora_rank:
            raise ConfigError(f"kv_lora_rank {kv_lora_rank} shapes an MLA-shaped draft; the attention is mha")
        head_dim = target.hidden_size // heads
        rope = dataclasses.replace(target.rope, head_dim=head_dim, interleave=False)
    else:
        raise ConfigError(f"attention {attention_mode!r}: a new DFlash draft's is mha or mla")
    return DFlashConfig(hidden_size=target.hidden_size, num_hidden_layers=num_layers, num_attention_heads=heads,
                        num_key_value_heads=heads, head_dim=head_dim,
                        intermediate_size=intermediate_size or target.intermediate_size, block_size=block_size,
                        target_layer_ids=tuple(target_layer_ids), mask_token_id=mask_token_id,
                        vocab_size=target.vocab_size, num_target_layers=target.num_hidden_layers, rope=rope,
                        max_position_embeddings=target.max_position_embeddings, rms_norm_eps=target.rms_norm_eps,
                        attention_mode="mla" if attention_mode == "mla" else "gqa", **shape,
                        draft_vocab_size=draft_vocab_size, source="the new draft's settings")


def init_dflash_draft(target: nn.Module, config: DFlashConfig, seed: int = 0,
                      d2t: torch.Tensor | None = None) -> DFlashDraft:
    """Random projections (std 0.02) and unit norms, over the target's embedding and lm_head (shared, frozen); built
    on the CPU (the same numbers whatever the device), then moved next to the target, its own weights float32. A
    compressed vocabulary (`d2t`, its draft_vocab_size long) starts its own head from the target's lm_head rows of
    its tokens, trained from there, as an EAGLE-3 draft's."""
    torch.manual_seed(seed)
    draft = DFlashDraft(config, target.model.embed_tokens, target.lm_head)
    for name, p in draft.named_parameters():
        if name in draft.shared_weights:
            continue
        if p.dim() == 2:
            nn.init.normal_(p, std=0.02)
        else:
            nn.init.ones_(p)
    if config.compressed_vocab:
        rows = fill_vocab_maps(draft, d2t)
        with torch.no_grad():
            draft.lm_head.weight.copy_(target.lm_head.weight.detach().to("cpu", torch.float32)[rows])
    elif d2t is not None:
        raise ValueError("a d2t map was given for a draft over the target's whole vocabulary")
    return draft.to(device=target.lm_head.weight.device)
