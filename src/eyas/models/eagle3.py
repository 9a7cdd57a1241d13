"""EAGLE-3 draft heads for DeepSeek-V3-family targets: a Llama-style (MHA) draft and an MLA draft.

One decoder layer over a 2H input (DESIGN.md §4):

    g        = fc(cat(aux_hidden_states))                       step 0 only: [T, n * Ht] -> [T, H]
    x        = cat(input_layernorm(embed(next token)), hidden_norm(g))                        [T, 2H]
    h        = g + self_attn(x)                                                               [T, H]
    prenorm  = h + mlp(post_attention_layernorm(h))      carried to step k + 1 as its g (fc skipped)
    logits   = lm_head(norm(prenorm))                    draft vocab, scattered to target ids via d2t

The module's own state dict is in the canonical (Model Optimizer / MAX) form: `fc.weight`, `layers.0.*`,
`norm.weight`, `lm_head.weight`, and the `d2t`/`t2d` buffers when the vocabulary is compressed. `load_draft` reads
every layout other engines write (SGLang/SpecForge `midlayer.`, vLLM `model.layers.0.`, FP8 blocks, shared or own
lm_head) with no conversion step, and records what it decided in `draft.load_report`.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from eyas.aux_layers import AuxConvention, default_aux_layer_ids, to_hidden_state_ids
from eyas.checkpoint import CheckpointError, dequantize_fp8, fp8_block_size, read_safetensors
from eyas.config import ConfigError, DeepseekV3Config, RopeConfig, read_config_json
from eyas.models.attention import AttentionMetadata, paged_attention
from eyas.models.deepseek_v3 import DeepseekV3ForCausalLM, MLAttention
from eyas.models.layers import MLP, RMSNorm, Rotary, apply_rope, pack_rows

log = logging.getLogger("eyas")

MHA_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "Eagle3Speculator")
MLA_ARCHITECTURES = ("Eagle3DeepseekV2ForCausalLM", "Eagle3DeepseekV3ForCausalLM", "DeepseekV3ForCausalLMEagle3")
MLA_MODEL_TYPES = ("kimi_k2", "deepseek_v2", "deepseek_v3")
SUPPORTED = (
    ("eagle", "LlamaForCausalLMEagle3", "MHA draft; SGLang, MAX, Model Optimizer"),
    ("eagle", "Eagle3LlamaForCausalLM", "MHA draft; vLLM"),
    ("eagle", "Eagle3Speculator", "MHA draft; speculators format (vLLM)"),
    ("eagle", "Eagle3DeepseekV2ForCausalLM", "MLA draft; vLLM, MAX, Model Optimizer"),
    ("eagle", "Eagle3DeepseekV3ForCausalLM", "MLA draft; vLLM alias"),
    ("eagle", "DeepseekV3ForCausalLMEagle3", "MLA draft; SpecForge"),
    ("eagle", "model_type kimi_k2/deepseek_v2/deepseek_v3 with num_hidden_layers 1 and fc.weight",
     "MLA draft; Model Optimizer export"),
)

# EAGLE-3.1's config switches (vLLM 0.33, SGLang, speculators, SpecForge); see Eagle3Config
EAGLE31_SWITCHES = ("fc_norm", "norm_before_fc", "norm_output", "norm_before_residual")
# the weights each switch adds, by key prefix
SWITCH_WEIGHTS = {"fc_norm": "fc_norm.", "norm_before_fc": "input_norm."}

AUX_IDS_FIELD = "eagle_aux_hidden_state_layer_ids"
AUX_CONVENTION_FIELD = "eagle_aux_hidden_state_layer_ids_convention"  # what eyas's exporter writes
# eagle_config keys only Model Optimizer writes (its export template and its training config); their presence
# means the aux ids were exported as 0-based decoder-layer outputs (not `use_aux_hidden_state`: vLLM reads it too)
MODELOPT_EAGLE_KEYS = ("eagle_architecture_config", "eagle_decoder_type", "use_input_layernorm_in_first_layer",
                       "use_last_layernorm", "use_mtp_layernorm", "next_layer_regular", "parallel_draft_step",
                       "parallel_draft_heads_num_layers")


def _fail(source: str, name: str, value: Any, expected: str) -> None:
    raise ConfigError(f"{source}: field {name!r} is {value!r}; expected {expected}")


@dataclass(slots=True)
class Eagle3Config:
    """An EAGLE-3 draft as eyas runs it. `aux_hidden_state_ids` are always HF `hidden_states` indices here."""

    arch: str  # "mla" | "mha"
    hidden_size: int
    target_hidden_size: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    num_aux_hidden_states: int
    aux_hidden_state_ids: tuple[int, ...]
    aux_convention_assumed: str
    intermediate_size: int
    rope: RopeConfig
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    # MHA (Llama-style) attention
    num_attention_heads: int = 0
    num_key_value_heads: int = 0
    head_dim: int = 0
    attention_bias: bool = False
    # MLA attention: a one-layer dense DeepSeek config whose hidden_size is the draft's
    mla: DeepseekV3Config | None = None
    # EAGLE-3.1 switches (config.json booleans; all false is the EAGLE-3 draft as first published)
    fc_norm: bool = False  # an RMSNorm per aux hidden state (fc_norm.{i}.weight) before fc
    norm_before_fc: bool = False  # one RMSNorm over the concatenated aux states (input_norm.weight) before fc
    norm_output: bool = False  # the state carried to the next draft step is the final norm's output
    norm_before_residual: bool = False  # the layer's residual is hidden_norm(g), not g
    source: str = "config.json"

    def __post_init__(self) -> None:
        src = self.source
        if self.arch not in ("mla", "mha"):
            _fail(src, "arch", self.arch, '"mla" or "mha"')
        for name in ("hidden_size", "target_hidden_size", "vocab_size", "draft_vocab_size", "intermediate_size",
                     "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                _fail(src, name, value, "a positive integer")
        if self.draft_vocab_size > self.vocab_size:
            _fail(src, "draft_vocab_size", self.draft_vocab_size, f"at most vocab_size={self.vocab_size}")
        if self.num_aux_hidden_states not in (2, 3):
            _fail(src, "num_aux_hidden_states", self.num_aux_hidden_states, "2 or 3")
        if len(self.aux_hidden_state_ids) != self.num_aux_hidden_states:
            _fail(src, AUX_IDS_FIELD, list(self.aux_hidden_state_ids),
                  f"{self.num_aux_hidden_states} ids, one per fc input block")
        if self.arch == "mha":
            for name in ("num_attention_heads", "num_key_value_heads", "head_dim"):
                value = getattr(self, name)
                if not isinstance(value, int) or value <= 0:
                    _fail(src, name, value, "a positive integer")
            if self.num_attention_heads % self.num_key_value_heads:
                _fail(src, "num_key_value_heads", self.num_key_value_heads,
                      f"a divisor of num_attention_heads={self.num_attention_heads}")
            if self.head_dim % 2:
                _fail(src, "head_dim", self.head_dim, "an even number (rope rotates pairs)")
        elif self.mla is None:
            _fail(src, "mla", None, "a DeepseekV3Config for an MLA draft")
        for name in EAGLE31_SWITCHES:
            if not isinstance(getattr(self, name), bool):
                _fail(src, name, getattr(self, name), "true or false")
        if self.fc_norm and self.norm_before_fc:
            raise ConfigError(f"{src}: fields 'fc_norm' and 'norm_before_fc' are both true; a draft normalises its "
                              "aux states one way (a norm per state, or one over their concatenation), not both")

    @property
    def switches(self) -> dict[str, bool]:
        """The EAGLE-3.1 switches, as config.json writes them."""
        return {name: getattr(self, name) for name in EAGLE31_SWITCHES}

    @property
    def compressed_vocab(self) -> bool:
        return self.draft_vocab_size != self.vocab_size

    @classmethod
    def from_hf(cls, raw: dict, target: DeepseekV3Config, arch: str, num_aux_hidden_states: int | None = None,
                aux_convention: str | None = None, source: str = "config.json") -> Eagle3Config:
        """Read a draft's config.json dict against its target. `num_aux_hidden_states` comes from fc.weight's
        width when the weights are at hand; `aux_convention` overrides the convention the ids are read in."""
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            _fail(source, "hidden_act", act, '"silu"')
        if raw.get("mlp_bias"):
            _fail(source, "mlp_bias", raw["mlp_bias"], "false (EAGLE-3 drafts have no MLP biases)")
        required = ["hidden_size", "intermediate_size", "num_attention_heads"]
        if arch == "mla":
            required += ["kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"]
        for name in required:
            if raw.get(name) is None:
                raise ConfigError(f"{source}: required field {name!r} is missing")
        hidden = raw["hidden_size"]
        # the draft adds the target's own embeddings to its input, so its width is the target's
        if hidden != target.hidden_size:
            _fail(source, "hidden_size", hidden, f"the target's hidden_size {target.hidden_size}")
        target_hidden = raw.get("target_hidden_size") or hidden
        if target_hidden != target.hidden_size:
            _fail(source, "target_hidden_size", target_hidden, f"the target's hidden_size {target.hidden_size}")
        vocab = raw.get("vocab_size") or target.vocab_size
        if vocab != target.vocab_size:
            _fail(source, "vocab_size", vocab, f"the target's vocab_size {target.vocab_size}")
        draft_vocab = raw.get("draft_vocab_size") or vocab
        ids, assumed = resolve_aux_ids(raw, target.num_hidden_layers, aux_convention, source)
        if num_aux_hidden_states is None:
            num_aux_hidden_states = raw.get("num_aux_hidden_states") or len(ids)
        elif raw.get("num_aux_hidden_states") not in (None, num_aux_hidden_states):
            _fail(source, "num_aux_hidden_states", raw["num_aux_hidden_states"],
                  f"{num_aux_hidden_states}, the number of blocks fc.weight fuses")
        if len(ids) != num_aux_hidden_states:
            _fail(source, AUX_IDS_FIELD, list(ids), f"{num_aux_hidden_states} ids: fc.weight fuses "
                  f"{num_aux_hidden_states} hidden states of width {target.hidden_size}")
        max_pos = max(int(raw.get("max_position_embeddings") or 0), target.max_position_embeddings)
        eps = float(raw.get("rms_norm_eps", 1e-6))
        heads = raw["num_attention_heads"]
        switches = {}
        for name in EAGLE31_SWITCHES:
            value = raw.get(name, False)
            if not isinstance(value, bool):
                _fail(source, name, value, "true or false")
            switches[name] = value
        common = dict(**switches, hidden_size=hidden, target_hidden_size=target_hidden, vocab_size=vocab,
                      draft_vocab_size=draft_vocab, num_aux_hidden_states=num_aux_hidden_states,
                      aux_hidden_state_ids=ids, aux_convention_assumed=assumed,
                      intermediate_size=raw["intermediate_size"], rms_norm_eps=eps, max_position_embeddings=max_pos,
                      num_attention_heads=heads, attention_bias=bool(raw.get("attention_bias", False)),
                      source=source)
        if arch == "mla":
            rope = RopeConfig.from_hf(raw, raw["qk_rope_head_dim"], max_pos, source)
            mla = DeepseekV3Config(
                vocab_size=vocab, hidden_size=hidden, intermediate_size=raw["intermediate_size"], num_hidden_layers=1,
                num_attention_heads=heads, kv_lora_rank=raw["kv_lora_rank"],
                qk_nope_head_dim=raw["qk_nope_head_dim"], qk_rope_head_dim=raw["qk_rope_head_dim"],
                v_head_dim=raw["v_head_dim"], rope=rope, max_position_embeddings=max_pos,
                q_lora_rank=raw.get("q_lora_rank"), n_routed_experts=None, rms_norm_eps=eps,
                attention_bias=bool(raw.get("attention_bias", False)), source=source)
            return cls(arch="mla", rope=rope, mla=mla, **common)
        head_dim = raw.get("head_dim") or hidden // heads
        rope = RopeConfig.from_hf(raw, head_dim, max_pos, source)
        rope.interleave = False  # Llama pairs dim i with i + head_dim/2 (rotate-half), whatever rope_interleave says
        return cls(arch="mha", rope=rope, num_key_value_heads=raw.get("num_key_value_heads") or heads,
                   head_dim=head_dim, **common)


def resolve_aux_ids(raw: dict, num_layers: int, override: str | None, source: str) -> tuple[tuple[int, ...], str]:
    """The draft's aux ids as `hidden_states` indices (ascending), and which convention the file's ids were read
    in, with the reason. See eyas.aux_layers for the two conventions."""
    eagle = raw.get("eagle_config") or {}
    # vLLM's order: a top-level field wins over eagle_config's
    if raw.get(AUX_IDS_FIELD) is not None:
        field, file_ids = AUX_IDS_FIELD, raw[AUX_IDS_FIELD]
    else:
        field, file_ids = f"eagle_config.{AUX_IDS_FIELD}", eagle.get(AUX_IDS_FIELD)
    if file_ids is None:
        try:
            ids = default_aux_layer_ids(num_layers)
        except ValueError as e:
            raise ConfigError(f"{source}: field {AUX_IDS_FIELD!r} is missing and {e}") from e
        log.warning("%s: no %s; assuming the standard %s (hidden_states indices) for a %d-layer target",
                    source, AUX_IDS_FIELD, ids, num_layers)
        return ids, f"hidden_states (file names no aux ids; eyas default (2, L//2, L-3) = {ids})"
    if not isinstance(file_ids, list | tuple) or not all(isinstance(i, int) for i in file_ids):
        _fail(source, field, file_ids, "a list of integer layer ids")
    convention, reason = _aux_convention(raw, eagle, list(file_ids), num_layers, override, source)
    try:
        ids = to_hidden_state_ids(file_ids, convention, num_layers)
    except ValueError as e:
        raise ConfigError(f"{source}: field {field!r} is {list(file_ids)}: {e}") from e
    if list(ids) != sorted(ids):
        # every engine captures aux states walking the layers in order, so fc's blocks are in ascending layer order
        log.warning("%s: %s %s is not ascending; fusing in ascending layer order, as vLLM and SGLang do",
                    source, field, list(file_ids))
    return tuple(sorted(ids)), f"{convention.value} ({reason})"


def _aux_convention(raw: dict, eagle: dict, file_ids: list[int], num_layers: int, override: str | None,
                    source: str) -> tuple[AuxConvention, str]:
    valid = [c.value for c in AuxConvention]
    if override is not None:
        if override not in valid:
            raise ConfigError(f"aux_convention is {override!r}; expected one of {valid}")
        return AuxConvention(override), "set by the aux_convention argument"
    for where, table in ((f"eagle_config.{AUX_CONVENTION_FIELD}", eagle), (AUX_CONVENTION_FIELD, raw)):
        named = table.get(AUX_CONVENTION_FIELD)
        if named is not None:
            if named not in valid:
                _fail(source, where, named, f"one of {valid}")
            return AuxConvention(named), f"the file names it in {where}"
    modelopt_keys = sorted(k for k in MODELOPT_EAGLE_KEYS if k in eagle)
    if modelopt_keys:
        return AuxConvention.LAYER_OUTPUT, (f"Model Optimizer export: eagle_config has {', '.join(modelopt_keys)}; "
                                            "it writes 0-based decoder-layer outputs")
    modelopt_default = sorted({1, num_layers // 2 - 1, num_layers - 4})
    if sorted(file_ids) == modelopt_default and list(file_ids) != [2, num_layers // 2, num_layers - 3]:
        return AuxConvention.LAYER_OUTPUT, (f"ids equal Model Optimizer's default sorted({{1, L//2-1, L-4}}) = "
                                            f"{modelopt_default} for L={num_layers}")
    return AuxConvention.HIDDEN_STATES, "vLLM/SGLang/MAX ids; file gives no convention"


class LlamaAttention(nn.Module):
    """Grouped-query attention over the draft's 2H input, non-interleaved (rotate-half) rope, H out."""

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (config.num_attention_heads, config.num_key_value_heads,
                                                            config.head_dim)
        self.scale = self.head_dim ** -0.5
        bias = config.attention_bias
        self.q_proj = nn.Linear(2 * config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(2 * config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(2 * config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.qkv: torch.Tensor | None = None  # set by pack()

    def pack(self) -> None:
        """For inference: q, k and v projections as one matmul (see MLP.pack)."""
        if self.qkv is None and self.q_proj.bias is None:
            self.qkv = pack_rows(self.q_proj, self.k_proj, self.v_proj)

    def expanded_qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """q [..., heads, head_dim], k and v [..., kv_heads, head_dim], rope applied."""
        if self.qkv is not None:
            kv_width = self.num_kv_heads * self.head_dim
            q, k, v = F.linear(x, self.qkv).split([self.num_heads * self.head_dim, kv_width, kv_width], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.unflatten(-1, (self.num_heads, self.head_dim))
        k = k.unflatten(-1, (self.num_kv_heads, self.head_dim))
        v = v.unflatten(-1, (self.num_kv_heads, self.head_dim))
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
        return apply_rope(q, cos, sin, interleave=False), apply_rope(k, cos, sin, interleave=False), v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionMetadata | None = None,
                kv_cache: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = self.expanded_qkv(x, cos, sin)
        if attn is None:  # [batch, seq, ...], causal over the seq positions
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 is_causal=True, scale=self.scale, enable_gqa=True)
            return self.o_proj(out.transpose(1, 2).flatten(-2))
        # flat [num_tokens, ...]: write this step's keys and values, then attend over each sequence's context
        kv_cache[attn.slot_mapping] = torch.stack([k, v], dim=1).to(kv_cache.dtype)
        out = paged_attention(q.to(kv_cache.dtype), kv_cache, attn, self.scale)  # [num_tokens, heads, head_dim]
        return self.o_proj(out.to(x.dtype).flatten(-2))


class Eagle3DecoderLayer(nn.Module):
    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        H = config.hidden_size
        self.input_layernorm = RMSNorm(H, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(H, config.rms_norm_eps)
        self.self_attn = (MLAttention(config.mla, input_size=2 * H) if config.arch == "mla"
                          else LlamaAttention(config))
        self.post_attention_layernorm = RMSNorm(H, config.rms_norm_eps)
        self.mlp = MLP(H, config.intermediate_size)
        self.norm_before_residual = config.norm_before_residual

    def attention_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x [..., 2H], the residual [..., H]): the residual is the un-normed hidden input, or its norm with
        norm_before_residual (EAGLE-3.1)."""
        normed = self.hidden_norm(hidden)
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        return x, normed if self.norm_before_residual else hidden

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn: AttentionMetadata | None = None, cache: torch.Tensor | None = None) -> torch.Tensor:
        x, residual = self.attention_input(embeds, hidden)
        h = residual + self.self_attn(x, cos, sin, attn, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


def target_ids_of(d2t: torch.Tensor) -> torch.Tensor:
    """The target id of every draft id: i + d2t[i]. Worked example: d2t = [0, 0, 3] puts draft ids 0, 1, 2 at
    target ids 0, 1, 5."""
    return torch.arange(d2t.shape[0], device=d2t.device) + d2t


class Eagle3Draft(nn.Module):
    """An EAGLE-3 draft head. `embed_tokens` is the target's module (shared); `lm_head` is the draft's own, or the
    target's when the checkpoint has none (then draft vocab = target vocab)."""

    def __init__(self, config: Eagle3Config, embed_tokens: nn.Embedding, lm_head: nn.Linear | None = None) -> None:
        super().__init__()
        self.config = config
        self.aux_hidden_state_ids: tuple[int, ...] = config.aux_hidden_state_ids
        H, n, Ht = config.hidden_size, config.num_aux_hidden_states, config.target_hidden_size
        if config.fc_norm:
            self.fc_norm = nn.ModuleList([RMSNorm(Ht, config.rms_norm_eps) for _ in range(n)])
        if config.norm_before_fc:
            self.input_norm = RMSNorm(n * Ht, config.rms_norm_eps)
        self.fc = nn.Linear(n * Ht, H, bias=False)
        self.layers = nn.ModuleList([Eagle3DecoderLayer(config)])
        self.norm = RMSNorm(H, config.rms_norm_eps)
        self.embed_tokens = embed_tokens
        self.lm_head = lm_head if lm_head is not None else nn.Linear(H, config.draft_vocab_size, bias=False)
        if config.compressed_vocab:
            # draft id i is target id i + d2t[i]; t2d marks the target ids the draft can propose
            self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        self.rotary = Rotary(config.rope, config.max_position_embeddings)
        self.load_report: dict[str, Any] = {}

    def combine_hidden_states(self, target_hidden: torch.Tensor, aux_hidden_states: list[torch.Tensor]) -> torch.Tensor:
        """Step-0 hidden input: fc over the aux states [..., Ht] each, in `aux_hidden_state_ids` order -> [..., H].
        `target_hidden` (the target's final normed state) is part of the shared draft interface; EAGLE-3 ignores
        it."""
        if len(aux_hidden_states) != self.config.num_aux_hidden_states:
            raise ValueError(f"got {len(aux_hidden_states)} aux hidden states; this draft fuses "
                             f"{self.config.num_aux_hidden_states} (ids {self.aux_hidden_state_ids})")
        return self.fuse(torch.stack(aux_hidden_states, dim=-2))

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """aux [..., n_aux, Ht] -> g [..., H]: fc over the concatenated aux states, each normed first (fc_norm) or
        their concatenation normed (norm_before_fc) in EAGLE-3.1 drafts."""
        aux = aux.to(self.fc.weight.dtype)
        if self.config.fc_norm:
            aux = torch.stack([norm(aux[..., i, :]) for i, norm in enumerate(self.fc_norm)], dim=-2)
        aux = aux.flatten(-2)
        if self.config.norm_before_fc:
            aux = self.input_norm(aux)
        return self.fc(aux)

    def forward(self, hidden: torch.Tensor, next_token_ids: torch.Tensor, attn: AttentionMetadata | None = None,
                cache: torch.Tensor | None = None) -> torch.Tensor:
        """One draft step; returns the state carried to the next step as its `hidden` (`carried`: the pre-norm
        output, or with norm_output its norm), from which `compute_logits` reads the step's logits.

        Paged: hidden [num_tokens, H], next_token_ids [num_tokens], `attn` and `cache` [num_slots,
        *cache_entry_shape()]. Batched (training, tests): hidden [batch, seq, H], next_token_ids [batch, seq],
        positions 0..seq-1, causal, no cache.
        """
        positions = attn.positions if attn is not None else torch.arange(hidden.shape[-2], device=hidden.device)
        cos, sin = self.rotary(positions)
        return self.carried(self.layers[0](self.embed(next_token_ids, hidden.dtype), hidden, cos, sin, attn, cache))

    def carried(self, layer_output: torch.Tensor) -> torch.Tensor:
        """The state a step hands on: the layer's (pre-norm) output, or the final norm of it (norm_output)."""
        return self.norm(layer_output) if self.config.norm_output else layer_output

    def draft_logits(self, carried: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary [..., draft_vocab] from a step's carried state."""
        return self.lm_head(carried if self.config.norm_output else self.norm(carried))

    def embed(self, token_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The target's embedding of token_ids in the draft's compute dtype (the target's may be lower)."""
        return self.embed_tokens(token_ids).to(dtype)

    def compute_logits(self, prenorm: torch.Tensor) -> torch.Tensor:
        """Logits over the target vocabulary [..., vocab]; target ids outside the draft vocabulary get -inf."""
        logits = self.draft_logits(prenorm)  # [..., draft_vocab]
        if not self.config.compressed_vocab:
            return logits
        target_ids = target_ids_of(self.d2t)
        out = logits.new_full((*logits.shape[:-1], self.config.vocab_size), float("-inf"))
        out[..., target_ids] = logits
        return out

    def greedy_tokens(self, prenorm: torch.Tensor) -> torch.Tensor:
        """The draft's proposals as target ids: argmax in the draft vocabulary, mapped through d2t."""
        draft_ids = self.draft_logits(prenorm).argmax(-1)
        return draft_ids + self.d2t[draft_ids] if self.config.compressed_vocab else draft_ids

    def cache_entry_shape(self) -> tuple[int, ...]:
        """Per-token shape of the draft's one-layer paged cache."""
        c = self.config
        if c.arch == "mla":
            return (c.mla.kv_lora_rank + c.mla.qk_rope_head_dim,)
        return (2, c.num_key_value_heads, c.head_dim)


# ---- loading -------------------------------------------------------------------------------------------------

# every layout's names -> the canonical `layers.0.` form (first match wins)
_KEY_RULES = (
    (re.compile(r"^midlayer\.(\d+)\."), r"layers.\1."),  # multi-layer SGLang-style export
    (re.compile(r"^midlayer\."), "layers.0."),  # SGLang / SpecForge
    (re.compile(r"^model\.(layers\.\d+\.|fc\.|fc_norm\.|input_norm\.|norm\.|embed_tokens\.)"), r"\1"),  # vLLM-style
)
# labelled by every engine that writes each (eyas's own vllm, max and modelopt exports all write layers.0.)
_LAYOUTS = (("midlayer.", "midlayer. (SGLang, SpecForge)"), ("model.layers.", "model.layers.0. (some vLLM exports)"),
            ("layers.", "layers.0. (eyas, vLLM, MAX, Model Optimizer)"))


def canonical_key(key: str) -> str:
    """A draft checkpoint key in the canonical form: `midlayer.x` and `model.layers.0.x` -> `layers.0.x`,
    `model.fc.x` -> `fc.x` (also `norm`, `embed_tokens`)."""
    for pattern, replacement in _KEY_RULES:
        if pattern.match(key):
            return pattern.sub(replacement, key, count=1)
    return key


def detect_architecture(raw: dict, has_fc: bool, source: str) -> tuple[str, str]:
    """("mha" | "mla", the architecture as named in the report), or a ConfigError listing what is supported."""
    archs = raw.get("architectures") or []
    for name in archs:
        if name in MHA_ARCHITECTURES:
            return "mha", name
        if name in MLA_ARCHITECTURES:
            return "mla", name
    model_type = raw.get("model_type")
    if model_type in MLA_MODEL_TYPES and raw.get("num_hidden_layers") == 1 and has_fc and "kv_lora_rank" in raw:
        return "mla", f"model_type {model_type} with one layer and fc.weight (Model Optimizer MLA export)"
    pairs = "; ".join(f"({method}, {arch}) [{note}]" for method, arch, note in SUPPORTED)
    raise ConfigError(f"{source}: field 'architectures' is {archs!r} (model_type {model_type!r}); expected an "
                      f"EAGLE-3 draft. Supported (method, architecture) pairs: {pairs}")


def load_draft(path: str | Path, target: DeepseekV3ForCausalLM, aux_convention: str | None = None,
               allow_unused_weights: bool = False) -> Eagle3Draft:
    """Load an EAGLE-3 draft written by vLLM, SGLang/SpecForge, speculators, Model Optimizer, MAX or eyas, for
    `target`.

    The draft shares the target's embedding (and its lm_head when the file has none or an identical copy), takes
    the target's dtype and device, and reports what it found in `draft.load_report`. `aux_convention`
    ("hidden_states" or "layer_output") overrides how the file's aux-layer ids are read. A weight the draft does
    not use is an error naming it (and the config switch that would use it): a draft that loads but computes
    something else than it was trained as is the worst outcome; `allow_unused_weights` loads it anyway.
    """
    path = Path(path)
    source = str(path / "config.json")
    raw = read_config_json(path / "config.json", "an EAGLE-3 draft checkpoint directory")
    speculators = is_speculators_config(raw)
    if speculators:
        raw = speculators_to_hf(raw, source)
    weight = target.lm_head.weight
    dtype, device = weight.dtype, weight.device

    stored = read_safetensors(path)
    fp8 = any(t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) for t in stored.values())
    block = fp8_block_size(raw) or (128, 128)
    tensors: dict[str, torch.Tensor] = {}
    for key, t in dequantize_fp8(stored, block, dtype, source=str(path)).items():
        name = canonical_key(key)
        if name in tensors:
            raise CheckpointError(f"{path}: keys {key!r} and another both map to {name!r}")
        tensors[name] = t
    layouts = [label for prefix, label in _LAYOUTS if any(k.startswith(prefix) for k in stored)]
    extra_layers = sorted({k.split(".")[1] for k in tensors if k.startswith("layers.") and k.split(".")[1] != "0"})
    if extra_layers:
        raise CheckpointError(f"{path}: weights for decoder layers {extra_layers} beyond layer 0; eyas runs "
                              "one-layer EAGLE-3 drafts")

    kind, arch_name = detect_architecture(raw, "fc.weight" in tensors, source)
    num_aux = None
    if "fc.weight" in tensors:
        fc_in = tensors["fc.weight"].shape[-1]
        num_aux, rest = divmod(fc_in, target.config.hidden_size)
        if rest or num_aux not in (2, 3):
            raise CheckpointError(f"{path}: 'fc.weight' has shape {tuple(tensors['fc.weight'].shape)}; expected "
                                  f"input width 2 or 3 x the target's hidden_size {target.config.hidden_size} "
                                  f"({2 * target.config.hidden_size} or {3 * target.config.hidden_size})")
    config = Eagle3Config.from_hf(raw, target.config, kind, num_aux, aux_convention, source)

    # shared modules: the embedding always; the lm_head when the file has none or an exact copy of the target's
    embed = target.model.embed_tokens
    if "embed_tokens.weight" in tensors:
        own_embed = tensors.pop("embed_tokens.weight")
        reference = embed.weight.detach().float().cpu()
        # loose tolerance: a bf16 copy of the target's embedding is the same embedding
        if own_embed.shape != reference.shape or not torch.allclose(own_embed.float(), reference, rtol=1e-2, atol=1e-3):
            log.warning("%s: embed_tokens.weight differs from the target's embedding; using the target's (an "
                        "exported random embedding is a known exporter bug)", path)
    lm_head_note = "own"
    if "lm_head.weight" not in tensors:
        if config.draft_vocab_size != target.config.vocab_size:
            raise CheckpointError(f"{path}: 'lm_head.weight' is missing, so the target's lm_head "
                                  f"({target.config.vocab_size} rows) would be used, but draft_vocab_size is "
                                  f"{config.draft_vocab_size}; expected an lm_head of {config.draft_vocab_size} rows")
        lm_head_note = "shared (absent from the file)"
    elif (not config.compressed_vocab and tensors["lm_head.weight"].shape == weight.shape
          and torch.equal(tensors["lm_head.weight"], weight.detach().cpu())):
        del tensors["lm_head.weight"]
        lm_head_note = "shared (the file's copy equals the target's)"
    shared_lm_head = target.lm_head if lm_head_note != "own" else None

    d2t_note = _check_vocab_maps(tensors, config, path)
    with torch.device("meta"):
        draft = Eagle3Draft(config, embed, shared_lm_head)
    shared = {"embed_tokens.weight"} | ({"lm_head.weight"} if shared_lm_head is not None else set())
    shapes = {k: tuple(v.shape) for k, v in draft.state_dict().items() if k not in shared}
    missing = sorted(shapes.keys() - tensors.keys())
    if missing:
        switched = [f"{name} is true in config.json" for name, prefix in SWITCH_WEIGHTS.items()
                    if getattr(config, name) and any(k.startswith(prefix) for k in missing)]
        raise CheckpointError(f"{path}: {len(missing)} draft weights missing: {', '.join(missing)} "
                              f"(layout {', '.join(layouts) or 'unknown'}, architecture {arch_name}"
                              f"{'; ' + ', '.join(switched) if switched else ''})")
    unexpected = sorted(tensors.keys() - shapes.keys())
    if unexpected and not allow_unused_weights:
        raise CheckpointError(f"{path}: {unused_weights_message(unexpected, config)}; the draft would compute "
                              "something other than it was trained as. Set the switch in config.json, or load it "
                              "anyway with --allow-unused-draft-weights (the weights are then ignored)")
    if unexpected:
        log.warning("%s: ignoring %d unused tensors (allowed): %s", path, len(unexpected), ", ".join(unexpected))
    for key, shape in shapes.items():
        if tuple(tensors[key].shape) != shape:
            raise CheckpointError(f"{path}: weight {key!r} has shape {tuple(tensors[key].shape)}; config.json "
                                  f"implies {shape}")
    # fresh, aligned allocations (see load_model): the same file must give the same bits on every load
    draft.load_state_dict({k: tensors[k].to(device=device, copy=True) for k in shapes}, strict=False, assign=True)
    draft.rotary = Rotary(config.rope, config.max_position_embeddings).to(device)
    draft.load_report = {
        "path": str(path), "layout": ", ".join(layouts) or "unknown", "architecture": arch_name, "arch": kind,
        "aux_hidden_state_ids": list(config.aux_hidden_state_ids), "aux_convention": config.aux_convention_assumed,
        "num_aux_hidden_states": config.num_aux_hidden_states, "draft_vocab_size": config.draft_vocab_size,
        "vocab_size": config.vocab_size, "d2t": d2t_note, "lm_head": lm_head_note, "own_weights": sorted(shapes),
        "shared_weights": sorted(shared), "ignored_tensors": unexpected, "fp8": fp8, "dtype": str(dtype),
        "switches": config.switches, "speculators": speculators,
    }
    return draft.eval()


def unused_weights_message(unused: list[str], config: Eagle3Config) -> str:
    """Which weights a draft file holds that its config does not use, and the switch that would use each."""
    parts = []
    for name, prefix in SWITCH_WEIGHTS.items():
        keys = [k for k in unused if k.startswith(prefix)]
        if keys:
            parts.append(f"{', '.join(keys)} present but {name} is false")
    rest = [k for k in unused if not any(k.startswith(p) for p in SWITCH_WEIGHTS.values())]
    if rest:
        parts.append(f"{', '.join(rest)} used by no part of an EAGLE-3 draft eyas knows")
    return "; ".join(parts)


# ---- the speculators format (vLLM's `speculators` library; vLLM loads it natively) ------------------------------

SPECULATORS_ARCHITECTURE = "Eagle3Speculator"


def is_speculators_config(raw: dict) -> bool:
    return raw.get("speculators_model_type") is not None or SPECULATORS_ARCHITECTURE in (raw.get("architectures") or [])


def speculators_to_hf(raw: dict, source: str) -> dict:
    """A speculators eagle3 config.json as the flat HF draft config the rest of the loader reads: the nested
    `transformer_layer_config` holds the layer's dims, the top level the EAGLE fields."""
    kind = raw.get("speculators_model_type")
    if kind != "eagle3":
        _fail(source, "speculators_model_type", kind, '"eagle3" (the only speculators draft eyas runs)')
    layer = raw.get("transformer_layer_config")
    if not isinstance(layer, dict):
        _fail(source, "transformer_layer_config", layer, "an object: the HF config of the draft's decoder layer")
    if layer.get("model_type") not in ("llama", "qwen3"):
        _fail(source, "transformer_layer_config.model_type", layer.get("model_type"),
              '"llama" or "qwen3" (speculators eagle3 drafts are Llama-style)')
    flat = dict(layer)
    for key in ("draft_vocab_size", "target_hidden_size", AUX_IDS_FIELD, AUX_CONVENTION_FIELD, *EAGLE31_SWITCHES):
        if key in raw:
            flat[key] = raw[key]
    if "norm_before_residual" not in raw:
        # vLLM's speculators reader (0.32, configs/speculators/algos.py) takes an absent norm_before_residual as
        # true; read the file as the engine that serves this format does, and say so
        log.warning("%s: the speculators config has no norm_before_residual; taking it as true, as vLLM does",
                    source)
        flat["norm_before_residual"] = True
    flat["architectures"] = [SPECULATORS_ARCHITECTURE]
    return flat


def _check_vocab_maps(tensors: dict[str, torch.Tensor], config: Eagle3Config, path: Path) -> str:
    """Validate (and complete) d2t/t2d in place; returns a line for the load report."""
    d2t, t2d = tensors.get("d2t"), tensors.get("t2d")
    if not config.compressed_vocab:
        if d2t is not None and d2t.any():
            raise CheckpointError(f"{path}: 'd2t' maps a draft vocabulary as large as the target's "
                                  f"({config.vocab_size}) onto other ids; expected no d2t or all zeros (vLLM refuses "
                                  "such files too)")
        tensors.pop("d2t", None)
        tensors.pop("t2d", None)
        return "absent (draft vocab = target vocab)" if d2t is None else "identity (dropped)"
    if d2t is None:
        return "missing"  # reported as a missing weight with the rest
    if d2t.dim() != 1 or d2t.shape[0] != config.draft_vocab_size:
        raise CheckpointError(f"{path}: 'd2t' has shape {tuple(d2t.shape)}; expected ({config.draft_vocab_size},) "
                              "for draft_vocab_size")
    if "lm_head.weight" in tensors and tensors["lm_head.weight"].shape[0] != config.draft_vocab_size:
        raise CheckpointError(f"{path}: 'lm_head.weight' has {tensors['lm_head.weight'].shape[0]} rows; expected "
                              f"draft_vocab_size={config.draft_vocab_size}")
    d2t = d2t.long()
    target_ids = target_ids_of(d2t)
    if target_ids.min() < 0 or target_ids.max() >= config.vocab_size or target_ids.unique().numel() != d2t.numel():
        raise CheckpointError(f"{path}: 'd2t' maps draft ids to target ids outside 0..{config.vocab_size - 1} "
                              "or to one target id twice")
    derived = torch.zeros(config.vocab_size, dtype=torch.bool)
    derived[target_ids] = True
    if t2d is not None and (t2d.shape != derived.shape or not torch.equal(t2d.bool(), derived)):
        raise CheckpointError(f"{path}: 't2d' (shape {tuple(t2d.shape)}) does not mark exactly the target ids "
                              "d2t maps to")
    tensors["d2t"], tensors["t2d"] = d2t, derived
    return "present" if t2d is not None else "present (t2d derived from d2t)"
