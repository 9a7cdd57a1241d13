"""EAGLE-3 draft heads for DeepSeek-V3-family targets: a Llama-style (MHA) draft and an MLA draft.

One decoder layer over a 2H input (DESIGN.md §4):

    g        = fc(cat(aux_hidden_states))                       step 0 only: [T, n * Ht] -> [T, H]
    x        = cat(input_layernorm(embed(next token)), hidden_norm(g))                        [T, 2H]
    h        = g + self_attn(x)                                                               [T, H]
    prenorm  = h + mlp(post_attention_layernorm(h))      carried to step k + 1 as its g (fc skipped)
    logits   = lm_head(norm(prenorm))                    draft vocab, scattered to target ids via d2t

The module's own state dict is in the canonical (Model Optimizer / MAX) form: `fc.weight`, `layers.0.*`,
`norm.weight`, `lm_head.weight`, and the `d2t`/`t2d` buffers when the vocabulary is compressed.
`eyas.checkpoint.load_draft` reads every layout other engines write (SGLang/SpecForge `midlayer.`, vLLM
`model.layers.0.`, FP8 blocks, shared or own lm_head) with no conversion step, and records what it decided in
`draft.load_report`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from eyas.aux_layers import AuxConvention, default_aux_layer_ids, to_hidden_state_ids
from eyas.config import ConfigError, DeepseekV3Config, RopeConfig
from eyas.models.attention import AttentionMetadata, paged_attention
from eyas.models.deepseek_v3 import DeepseekV3ForCausalLM, MLAttention
from eyas.models.layers import MLP, RMSNorm, Rotary, apply_rope, pack_rows
from eyas.models.rows_matmul import linear_rows

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
        hidden, target_hidden, vocab = _widths_against_target(raw, target, arch, source)
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
            return cls(arch="mla", rope=rope, mla=_mla_layer_config(raw, vocab, max_pos, eps, rope, source), **common)
        head_dim = raw.get("head_dim") or hidden // heads
        rope = RopeConfig.from_hf(raw, head_dim, max_pos, source)
        rope.interleave = False  # Llama pairs dim i with i + head_dim/2 (rotate-half), whatever rope_interleave says
        return cls(arch="mha", rope=rope, num_key_value_heads=raw.get("num_key_value_heads") or heads,
                   head_dim=head_dim, **common)


def _widths_against_target(raw: dict, target: DeepseekV3Config, arch: str, source: str) -> tuple[int, int, int]:
    """A draft config's hidden_size, target_hidden_size and vocab_size, checked present and equal to the target's
    (the draft adds the target's own embeddings to its input, so its width is the target's)."""
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
    if hidden != target.hidden_size:
        _fail(source, "hidden_size", hidden, f"the target's hidden_size {target.hidden_size}")
    target_hidden = raw.get("target_hidden_size") or hidden
    if target_hidden != target.hidden_size:
        _fail(source, "target_hidden_size", target_hidden, f"the target's hidden_size {target.hidden_size}")
    vocab = raw.get("vocab_size") or target.vocab_size
    if vocab != target.vocab_size:
        _fail(source, "vocab_size", vocab, f"the target's vocab_size {target.vocab_size}")
    return hidden, target_hidden, vocab


def _mla_layer_config(raw: dict, vocab: int, max_pos: int, eps: float, rope: RopeConfig,
                      source: str) -> DeepseekV3Config:
    """The MLA draft's one decoder layer, as the target's layer config type (a dense MLP: no routed experts)."""
    return DeepseekV3Config(
        vocab_size=vocab, hidden_size=raw["hidden_size"], intermediate_size=raw["intermediate_size"],
        num_hidden_layers=1, num_attention_heads=raw["num_attention_heads"], kv_lora_rank=raw["kv_lora_rank"],
        qk_nope_head_dim=raw["qk_nope_head_dim"], qk_rope_head_dim=raw["qk_rope_head_dim"],
        v_head_dim=raw["v_head_dim"], rope=rope, max_position_embeddings=max_pos, q_lora_rank=raw.get("q_lora_rank"),
        n_routed_experts=None, rms_norm_eps=eps, attention_bias=bool(raw.get("attention_bias", False)),
        source=source)


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

    # the layer split around its attention over the cache, as the compiled step runs it (eyas.engine.compiled_step)

    def attention_inputs(self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Flat rows: (queries, each row's cache entry, the residual). MLA queries are in the latent space."""
        x, residual = self.attention_input(embeds, hidden)
        if isinstance(self.self_attn, MLAttention):
            q, entry = self.self_attn.absorbed_inputs(x, cos, sin)
        else:
            q, k, v = self.self_attn.expanded_qkv(x, cos, sin)
            entry = torch.stack([k, v], dim=1)
        return q, entry, residual

    def attend(self, q: torch.Tensor, entry: torch.Tensor, attn: AttentionMetadata, cache: torch.Tensor
               ) -> torch.Tensor:
        """Write the rows' cache entries, then attend over each sequence's context: [rows, heads, value width], in
        q's dtype."""
        a = self.self_attn
        if isinstance(a, MLAttention):
            return a.cached_attention(q, entry, attn, cache)
        cache[attn.slot_mapping] = entry.to(cache.dtype)
        return paged_attention(q.to(cache.dtype), cache, attn, a.scale).to(q.dtype)

    def after_attention(self, residual: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        a = self.self_attn
        h = residual + (a.absorbed_output(out) if isinstance(a, MLAttention) else a.o_proj(out.flatten(-2)))
        return h + self.mlp(self.post_attention_layernorm(h))


def target_ids_of(d2t: torch.Tensor) -> torch.Tensor:
    """The target id of every draft id: i + d2t[i]. Worked example: d2t = [0, 0, 3] puts draft ids 0, 1, 2 at
    target ids 0, 1, 5."""
    return torch.arange(d2t.shape[0], device=d2t.device) + d2t


# A compressed draft vocabulary, as EAGLE-3 and DFlash drafts keep it: buffers d2t [draft_vocab] (draft id i is target
# id i + d2t[i]) and t2d [vocab] (the target ids the draft can propose), the draft's head over its own ids.

def register_vocab_maps(draft: nn.Module, draft_vocab_size: int, vocab_size: int) -> None:
    """Empty d2t and t2d buffers on `draft`, filled by fill_vocab_maps or a checkpoint."""
    draft.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))
    draft.register_buffer("t2d", torch.zeros(vocab_size, dtype=torch.bool))


def fill_vocab_maps(draft: nn.Module, d2t: torch.Tensor | None) -> torch.Tensor:
    """`draft`'s d2t and t2d from `d2t`, which must be as long as its d2t buffer; returns the target ids [draft
    vocab], the rows of the target's lm_head the draft's head starts from."""
    if d2t is None or d2t.shape != draft.d2t.shape:
        raise ValueError(f"a draft vocabulary of {draft.d2t.shape[0]} needs a d2t map of that length")
    rows = target_ids_of(d2t.to(draft.d2t.device))
    draft.d2t.copy_(d2t)
    draft.t2d.zero_()
    draft.t2d[rows] = True
    return rows


def to_target_ids(draft_ids: torch.Tensor, d2t: torch.Tensor) -> torch.Tensor:
    """Draft ids -> the target's ids."""
    return draft_ids + d2t[draft_ids]


def to_target_vocab(logits: torch.Tensor, d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Logits over a draft vocabulary [..., draft_vocab] -> over the target's [..., vocab], -inf at the ids outside
    it."""
    out = logits.new_full((*logits.shape[:-1], vocab_size), float("-inf"))
    out[..., target_ids_of(d2t)] = logits
    return out


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
        # the target's weights it runs with (neither saved with the draft nor trained)
        self.shared_weights = ("embed_tokens.weight",) + (("lm_head.weight",) if lm_head is not None else ())
        if config.compressed_vocab:
            register_vocab_maps(self, config.draft_vocab_size, config.vocab_size)
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
        return linear_rows(carried if self.config.norm_output else self.norm(carried), self.lm_head)

    def embed(self, token_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The target's embedding of token_ids in the draft's compute dtype (the target's may be lower)."""
        return self.embed_tokens(token_ids).to(dtype)

    def compute_logits(self, prenorm: torch.Tensor) -> torch.Tensor:
        """Logits over the target vocabulary [..., vocab]; target ids outside the draft vocabulary get -inf."""
        logits = self.draft_logits(prenorm)  # [..., draft_vocab]
        return to_target_vocab(logits, self.d2t, self.config.vocab_size) if self.config.compressed_vocab else logits

    def greedy_tokens(self, prenorm: torch.Tensor) -> torch.Tensor:
        """The draft's proposals as target ids: argmax in the draft vocabulary, mapped through d2t."""
        draft_ids = self.draft_logits(prenorm).argmax(-1)
        return to_target_ids(draft_ids, self.d2t) if self.config.compressed_vocab else draft_ids

    def cache_entry_shape(self) -> tuple[int, ...]:
        """Per-token shape of the draft's one-layer paged cache."""
        c = self.config
        if c.arch == "mla":
            return (c.mla.kv_lora_rank + c.mla.qk_rope_head_dim,)
        return (2, c.num_key_value_heads, c.head_dim)


# ---- which draft a config.json describes -----------------------------------------------------------------------------

# -- a new draft, shaped after its target (what `eyas train` starts from) ------------------------------------

def new_draft_config(target: DeepseekV3Config, arch: str, aux_ids: tuple[int, ...], draft_vocab_size: int,
                     intermediate_size: int = 0, switches: dict[str, bool] | None = None) -> Eagle3Config:
    """A one-layer draft shaped after the target: its attention dims (MLA) or its head count (MHA), its rope;
    `switches` sets the EAGLE-3.1 ones (fc_norm, norm_before_fc, norm_output, norm_before_residual)."""
    H = target.hidden_size
    common = dict(**(switches or {}), hidden_size=H, target_hidden_size=H, vocab_size=target.vocab_size,
                  draft_vocab_size=draft_vocab_size or target.vocab_size, num_aux_hidden_states=len(aux_ids),
                  aux_hidden_state_ids=tuple(aux_ids), aux_convention_assumed="hidden_states (eyas train)",
                  intermediate_size=intermediate_size or target.intermediate_size, rms_norm_eps=target.rms_norm_eps,
                  max_position_embeddings=target.max_position_embeddings,
                  num_attention_heads=target.num_attention_heads, source="eyas train")
    if arch == "mla":
        mla = DeepseekV3Config(
            vocab_size=target.vocab_size, hidden_size=H, intermediate_size=common["intermediate_size"],
            num_hidden_layers=1, num_attention_heads=target.num_attention_heads, kv_lora_rank=target.kv_lora_rank,
            qk_nope_head_dim=target.qk_nope_head_dim, qk_rope_head_dim=target.qk_rope_head_dim,
            v_head_dim=target.v_head_dim, rope=target.rope, max_position_embeddings=target.max_position_embeddings,
            q_lora_rank=target.q_lora_rank, rms_norm_eps=target.rms_norm_eps, source="eyas train")
        return Eagle3Config(arch="mla", rope=target.rope, mla=mla, **common)
    head_dim = H // target.num_attention_heads
    r = target.rope
    rope = RopeConfig(head_dim=head_dim, theta=r.theta, type=r.type, factor=r.factor,
                      original_max_position_embeddings=r.original_max_position_embeddings, beta_fast=r.beta_fast,
                      beta_slow=r.beta_slow, mscale=r.mscale, mscale_all_dim=r.mscale_all_dim, interleave=False)
    return Eagle3Config(arch="mha", rope=rope, num_key_value_heads=target.num_attention_heads, head_dim=head_dim,
                        **common)


def init_draft(target: DeepseekV3ForCausalLM, config: Eagle3Config, d2t: torch.Tensor | None = None,
               seed: int = 0) -> Eagle3Draft:
    """Random projections (std 0.02), unit norms, the target's embedding (shared, frozen) and its lm_head rows for
    the draft vocabulary (copied, trained). The final norm starts as the target's: the head it feeds was trained on
    inputs with that gain (on 600-step runs against the shipped target this raised AL in 3 of 4 runs, tied 1)."""
    torch.manual_seed(seed)
    draft = Eagle3Draft(config, target.model.embed_tokens)
    for name, p in draft.named_parameters():
        if name.startswith("embed_tokens"):
            continue
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.02)
        else:
            torch.nn.init.ones_(p)
    rows = fill_vocab_maps(draft, d2t) if config.compressed_vocab else torch.arange(config.vocab_size)
    with torch.no_grad():
        draft.lm_head.weight.copy_(target.lm_head.weight[rows])
        draft.norm.weight.copy_(target.model.norm.weight)
    # initialised on the CPU (the same numbers whatever the device), then moved next to the target; the draft's own
    # weights stay float32 whatever the target's dtype (the shared embedding keeps the target's)
    return draft.to(device=target.lm_head.weight.device)


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
