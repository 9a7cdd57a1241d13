"""Configs read from HF `config.json`, checked on load with messages that name the field."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch


class ConfigError(ValueError):
    """A config.json that eyas cannot run, with the field and the value at fault."""


def _fail(source: str, name: str, value: Any, expected: str) -> None:
    raise ConfigError(f"{source}: field {name!r} is {value!r}; expected {expected}")


@dataclass(slots=True)
class RopeConfig:
    """Rotary embedding settings, from `rope_scaling` + `rope_theta` (released checkpoints)
    or `rope_parameters` (transformers >= 5)."""

    head_dim: int
    theta: float = 10000.0
    type: str = "default"  # "default" | "yarn"
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    interleave: bool = True

    @classmethod
    def from_hf(cls, raw: dict, head_dim: int, max_position_embeddings: int, source: str) -> RopeConfig:
        params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in ("default", "yarn"):
            _fail(source, "rope_scaling.type", rope_type, '"yarn" or absent (plain rope)')
        rope = cls(head_dim=head_dim, theta=float(theta), type=rope_type,
                   interleave=bool(raw.get("rope_interleave", True)))
        if rope_type == "yarn":
            if params.get("factor") is None:
                _fail(source, "rope_scaling.factor", None, "a number >= 1 for yarn")
            rope.factor = float(params["factor"])
            rope.original_max_position_embeddings = int(
                params.get("original_max_position_embeddings", max_position_embeddings))
            rope.beta_fast = float(params.get("beta_fast") or 32.0)
            rope.beta_slow = float(params.get("beta_slow") or 1.0)
            rope.mscale = float(params.get("mscale") or 1.0)
            rope.mscale_all_dim = float(params.get("mscale_all_dim") or 0.0)
        return rope

    def to_hf(self) -> dict:
        """The released-checkpoint form (`rope_scaling`), which every engine reads."""
        out: dict[str, Any] = {"rope_theta": self.theta, "rope_interleave": self.interleave}
        if self.type == "yarn":
            out["rope_scaling"] = {
                "type": "yarn", "rope_type": "yarn", "factor": self.factor,
                "original_max_position_embeddings": self.original_max_position_embeddings,
                "beta_fast": self.beta_fast, "beta_slow": self.beta_slow,
                "mscale": self.mscale, "mscale_all_dim": self.mscale_all_dim,
            }
        return out

    def inv_freq_and_attention_factor(self) -> tuple[torch.Tensor, float]:
        """Inverse frequencies [head_dim // 2] and the factor YaRN multiplies into cos/sin."""
        dim, base = self.head_dim, self.theta
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        if self.type != "yarn":
            return inv_freq, 1.0

        def correction_dim(num_rotations: float) -> float:
            return dim * math.log(self.original_max_position_embeddings / (num_rotations * 2 * math.pi)) / (
                2 * math.log(base))

        low = max(math.floor(correction_dim(self.beta_fast)), 0)
        high = min(math.ceil(correction_dim(self.beta_slow)), dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        # ramp 0 keeps the original frequency (extrapolation), ramp 1 divides it by the factor (interpolation)
        inv_freq = inv_freq / self.factor * ramp + inv_freq * (1 - ramp)
        attention_factor = yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim) \
            if self.mscale and self.mscale_all_dim else yarn_mscale(self.factor, 1.0)
        return inv_freq, attention_factor

    def softmax_scale_multiplier(self) -> float:
        """YaRN also sharpens the softmax by mscale(factor, mscale_all_dim)^2 (DeepSeek's reference does this)."""
        if self.type == "yarn" and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale_all_dim) ** 2
        return 1.0


def read_config_json(file: Path, expected: str) -> dict:
    """A config.json as a dict; a missing or malformed file is a ConfigError naming it and what was expected, and
    so is a NaN or infinite number anywhere in it (json reads `NaN` and `Infinity`; a NaN rms_norm_eps loaded
    and emitted empty text) or nesting too deep to read."""
    if not file.is_file():
        raise ConfigError(f"{file}: no such file (expected {expected} with a config.json)")
    try:
        raw = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{file}: not valid JSON ({e})") from e
    except RecursionError as e:
        raise ConfigError(f"{file}: nested too deeply to be a model config") from e
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{file}: cannot read ({e})") from e
    if not isinstance(raw, dict):
        raise ConfigError(f"{file}: expected a JSON object, got {type(raw).__name__}")
    stack: list[tuple[str, Any]] = [(k, v) for k, v in raw.items()]
    while stack:  # without recursion: the file is not trusted
        where, value = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{file}: field {where!r} is {value}; expected a finite number")
        if isinstance(value, dict):
            stack += [(f"{where}.{k}", v) for k, v in value.items()]
        elif isinstance(value, list):
            stack += [(f"{where}[{i}]", v) for i, v in enumerate(value)]
    return raw


def yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


TARGET_ARCHITECTURES = ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM", "KimiK2ForCausalLM")
SIZE_BOUNDS = {"vocab_size": 2**22, "hidden_size": 65536, "intermediate_size": 2**20, "num_hidden_layers": 1024,
               "num_attention_heads": 1024, "kv_lora_rank": 65536, "qk_nope_head_dim": 4096,
               "qk_rope_head_dim": 4096, "v_head_dim": 4096, "max_position_embeddings": 2**24,
               "moe_intermediate_size": 2**20, "n_routed_experts": 65536, "n_shared_experts": 1024,
               "num_experts_per_tok": 1024, "num_nextn_predict_layers": 16}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class DeepseekV3Config:
    """A DeepSeek-V3-family target (DeepSeek-V3/R1, Kimi-K2, DeepSeek-V2-style q_lora null)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope: RopeConfig
    max_position_embeddings: int = 4096
    q_lora_rank: int | None = None
    moe_intermediate_size: int = 0
    n_routed_experts: int | None = None
    n_shared_experts: int = 0
    num_experts_per_tok: int = 1
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    rms_norm_eps: float = 1e-6
    num_nextn_predict_layers: int = 0
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    torch_dtype: str = "bfloat16"
    source: str = "config"

    def __post_init__(self) -> None:
        src = self.source
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "kv_lora_rank", "qk_rope_head_dim", "v_head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                _fail(src, name, value, "a positive integer")
        # sane bounds, checked before any module is built (num_hidden_layers 10**9 built until memory ran out):
        # each is far above every DeepSeek-V3-family model (61 layers, hidden 7168, 256 experts, 163,840 ids)
        for name, bound in SIZE_BOUNDS.items():
            value = getattr(self, name)
            if isinstance(value, int) and value > bound:
                _fail(src, name, value, f"at most {bound}")
        if not (isinstance(self.rms_norm_eps, int | float) and 0 < self.rms_norm_eps < 1):
            _fail(src, "rms_norm_eps", self.rms_norm_eps, "a number in (0, 1)")
        if self.qk_rope_head_dim % 2:
            _fail(src, "qk_rope_head_dim", self.qk_rope_head_dim, "an even number")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            _fail(src, "q_lora_rank", self.q_lora_rank, "a positive integer or null")
        if self.n_routed_experts is not None:
            if self.moe_intermediate_size <= 0:
                _fail(src, "moe_intermediate_size", self.moe_intermediate_size, "a positive integer with MoE layers")
            if not 1 <= self.num_experts_per_tok <= self.n_routed_experts:
                _fail(src, "num_experts_per_tok", self.num_experts_per_tok,
                      f"between 1 and n_routed_experts={self.n_routed_experts}")
            if self.n_group < 1 or self.n_routed_experts % self.n_group:
                _fail(src, "n_group", self.n_group, f"a divisor of n_routed_experts={self.n_routed_experts}")
            if not 1 <= self.topk_group <= self.n_group:
                _fail(src, "topk_group", self.topk_group, f"between 1 and n_group={self.n_group}")
            if self.n_group > 1 and self.n_routed_experts // self.n_group < 2:
                _fail(src, "n_group", self.n_group, "groups of at least 2 experts (groups rank by their top-2 sum)")
            if self.topk_group * (self.n_routed_experts // self.n_group) < self.num_experts_per_tok:
                _fail(src, "topk_group", self.topk_group, "enough groups to hold num_experts_per_tok experts")
        if self.moe_layer_freq < 1:
            _fail(src, "moe_layer_freq", self.moe_layer_freq, "a positive integer")
        if self.torch_dtype not in DTYPES:
            _fail(src, "torch_dtype", self.torch_dtype, f"one of {sorted(DTYPES)}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        return self.qk_head_dim ** -0.5 * self.rope.softmax_scale_multiplier()

    @property
    def latent_dim(self) -> int:
        """Values the paged cache stores per token per layer: the MLA latent and the shared rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def is_moe_layer(self, layer_idx: int) -> bool:
        return (self.n_routed_experts is not None and layer_idx >= self.first_k_dense_replace
                and layer_idx % self.moe_layer_freq == 0)

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> DeepseekV3Config:
        archs = raw.get("architectures") or []
        model_type = raw.get("model_type")
        if not (set(archs) & set(TARGET_ARCHITECTURES)) and model_type not in ("deepseek_v3", "deepseek_v2",
                                                                                 "kimi_k2"):
            _fail(source, "architectures", archs,
                  f"one of {list(TARGET_ARCHITECTURES)} (model_type deepseek_v3/deepseek_v2/kimi_k2)")
        scoring = raw.get("scoring_func", "sigmoid")
        if scoring != "sigmoid":
            _fail(source, "scoring_func", scoring, '"sigmoid" (DeepSeek-V3 routing)')
        topk_method = raw.get("topk_method", "noaux_tc")
        if topk_method != "noaux_tc":
            _fail(source, "topk_method", topk_method, '"noaux_tc" (DeepSeek-V3 routing)')
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            _fail(source, "hidden_act", act, '"silu"')
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        for name in required:
            if name not in raw:
                raise ConfigError(f"{source}: required field {name!r} is missing")
        max_pos = int(raw.get("max_position_embeddings", 4096))
        eos = raw.get("eos_token_id")
        eos_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        dtype = raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"
        n_routed = raw.get("n_routed_experts")
        return cls(
            vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"], num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=raw["num_attention_heads"], kv_lora_rank=raw["kv_lora_rank"],
            qk_nope_head_dim=raw["qk_nope_head_dim"], qk_rope_head_dim=raw["qk_rope_head_dim"],
            v_head_dim=raw["v_head_dim"],
            rope=RopeConfig.from_hf(raw, raw["qk_rope_head_dim"], max_pos, source),
            max_position_embeddings=max_pos, q_lora_rank=raw.get("q_lora_rank"),
            moe_intermediate_size=raw.get("moe_intermediate_size") or 0,
            n_routed_experts=n_routed, n_shared_experts=raw.get("n_shared_experts") or 0,
            num_experts_per_tok=raw.get("num_experts_per_tok") or 1, n_group=raw.get("n_group") or 1,
            topk_group=raw.get("topk_group") or 1,
            routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
            norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
            first_k_dense_replace=raw.get("first_k_dense_replace") or 0,
            moe_layer_freq=raw.get("moe_layer_freq") or 1, rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            num_nextn_predict_layers=raw.get("num_nextn_predict_layers") or 0,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
            bos_token_id=raw.get("bos_token_id"), eos_token_ids=eos_ids, torch_dtype=str(dtype), source=source,
        )

    @classmethod
    def from_json(cls, path: str | Path) -> DeepseekV3Config:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        return cls.from_dict(read_config_json(path, "a HF checkpoint directory"), source=str(path))

    def to_hf(self) -> dict:
        """config.json as DeepSeek-V3 ships it, readable by transformers and vLLM."""
        out = {
            "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "moe_intermediate_size": self.moe_intermediate_size,
            "num_hidden_layers": self.num_hidden_layers, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_attention_heads, "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank, "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim, "v_head_dim": self.v_head_dim,
            "n_routed_experts": self.n_routed_experts, "n_shared_experts": self.n_shared_experts,
            "num_experts_per_tok": self.num_experts_per_tok, "n_group": self.n_group,
            "topk_group": self.topk_group, "routed_scaling_factor": self.routed_scaling_factor,
            "norm_topk_prob": self.norm_topk_prob, "first_k_dense_replace": self.first_k_dense_replace,
            "moe_layer_freq": self.moe_layer_freq, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
            "hidden_act": "silu", "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "num_nextn_predict_layers": self.num_nextn_predict_layers,
            "tie_word_embeddings": self.tie_word_embeddings, "attention_bias": self.attention_bias,
            "attention_dropout": 0.0, "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else self.eos_token_ids,
            "torch_dtype": self.torch_dtype, "initializer_range": 0.02, "use_cache": True,
        }
        out.update(self.rope.to_hf())
        return out


SPECULATIVE_METHODS = ("eagle", "mtp", "dflash")
# drafts per step when num_speculative_tokens is not given, for the chain methods (a block draft's: block_size - 1)
DEFAULT_NUM_SPECULATIVE_TOKENS = 3
MAX_BLOCK_DRAFTS = 63  # DFlashConfig's largest block (64) less its anchor
# MAX's four names; "typical" is the short name of typical-acceptance
REJECTION_STRATEGIES = ("greedy", "residual", "typical", "typical-acceptance", "logit-comparison")


@dataclass(slots=True)
class SpeculativeConfig:
    """How the engine speculates (MAX's flags). `greedy` and `residual` keep the target's distribution exactly;
    `logit-comparison` does for greedy requests only; `typical`, relaxed acceptance in thinking blocks and
    `synthetic_acceptance_rate` do not."""

    method: str = "eagle"
    draft_model: str | None = None
    # None: DEFAULT_NUM_SPECULATIVE_TOKENS for eagle and mtp; for dflash, block_size - 1, set by for_block_size when
    # the draft is loaded (its block holds the anchor and that many drafts, so no width may exceed it)
    num_speculative_tokens: int | None = None
    # [{"batch_start": 1, "batch_end": 16, "num_tokens": 3}, ...]: K by running batch size (inclusive bounds)
    num_speculative_tokens_per_batch_size: list[dict] = field(default_factory=list)
    # no draft work while this many sequences or more are running: where verifying K + 1 rows costs more than the
    # accepted drafts save (compute-bound batches). Steps then cost what plain steps cost; when drafting resumes, the
    # draft attends only to the positions computed since (the target's hidden states still carry the context)
    disable_batch_size: int | None = None
    # the verify width chosen per batch size by measured step times and acceptance (eyas.engine.adaptive_width),
    # up to num_speculative_tokens; disable_batch_size and the per-batch-size rules still decide where they apply
    adaptive_width: bool = False
    # at most this many drafts for a step that will also prefill prompts (MAX's --num-speculative-tokens-mixed-batch):
    # such a step is compute-bound already, and its drafts' verify rows would share it with the prompt chunks
    num_speculative_tokens_mixed_batch: int | None = None
    rejection_sampling_strategy: str = "residual"
    synthetic_acceptance_rate: float | None = None
    relaxed_thinking: bool = False
    relaxed_thinking_topk: int = 10
    relaxed_thinking_delta: float = 0.6
    aux_layer_convention: str | None = None  # override for the draft's aux ids: hidden_states | layer_output
    # load a draft file holding weights its config does not use (dropped); otherwise that is an error
    allow_unused_draft_weights: bool = False

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method {self.method!r} is not one of {list(SPECULATIVE_METHODS)}")
        if self.method in ("eagle", "dflash") and not self.draft_model:
            raise ValueError(f"speculative method {self.method!r} needs a draft model directory (--draft-model)")
        if self.method == "mtp" and self.draft_model:
            raise ValueError("speculative method 'mtp' drafts with the target's own NextN layer and takes no "
                             "--draft-model; supported (method, draft) pairs: (eagle, an EAGLE-3 MLA or MHA draft "
                             "directory), (dflash, a DFlash draft directory), (mtp, none)")
        if self.num_speculative_tokens is None and self.method != "dflash":
            self.num_speculative_tokens = DEFAULT_NUM_SPECULATIVE_TOKENS
        most = MAX_BLOCK_DRAFTS if self.method == "dflash" else 16
        k = self.num_speculative_tokens
        if k is not None and not 1 <= k <= most:
            raise ValueError(f"num_speculative_tokens is {k}; expected 1..{most}")
        if self.rejection_sampling_strategy not in REJECTION_STRATEGIES:
            raise ValueError(f"rejection_sampling_strategy {self.rejection_sampling_strategy!r} is not one of "
                             f"{list(REJECTION_STRATEGIES)}")
        if self.synthetic_acceptance_rate is not None and not 0 <= self.synthetic_acceptance_rate <= 1:
            raise ValueError(f"synthetic_acceptance_rate is {self.synthetic_acceptance_rate}; expected 0..1")
        if self.relaxed_thinking_topk < 1 or self.relaxed_thinking_delta < 0:
            raise ValueError("relaxed_thinking_topk must be >= 1 and relaxed_thinking_delta >= 0")
        mixed = self.num_speculative_tokens_mixed_batch
        if mixed is not None and not 0 <= mixed <= 16:
            raise ValueError(f"num_speculative_tokens_mixed_batch is {mixed}; expected 0..16")
        if self.disable_batch_size is not None and self.disable_batch_size < 1:
            raise ValueError(f"disable_batch_size is {self.disable_batch_size}; expected a positive batch size")
        for i, rule in enumerate(self.num_speculative_tokens_per_batch_size):
            if not isinstance(rule, dict) or set(rule) != {"batch_start", "batch_end", "num_tokens"}:
                raise ValueError(f"num_speculative_tokens_per_batch_size[{i}] is {rule!r}; expected "
                                 "{'batch_start': int, 'batch_end': int, 'num_tokens': int}")
            if not 1 <= rule["batch_start"] <= rule["batch_end"] or not 0 <= rule["num_tokens"] <= 16:
                raise ValueError(f"num_speculative_tokens_per_batch_size[{i}] = {rule}: need "
                                 "1 <= batch_start <= batch_end and 0 <= num_tokens <= 16")

    @property
    def lossless(self) -> bool:
        return (self.rejection_sampling_strategy in ("greedy", "residual") and not self.relaxed_thinking
                and self.synthetic_acceptance_rate is None)

    @property
    def max_num_tokens(self) -> int:
        rules = self.num_speculative_tokens_per_batch_size
        return max([self.num_speculative_tokens] + [r["num_tokens"] for r in rules])

    def for_block_size(self, block_size: int) -> SpeculativeConfig:
        """This config for a draft whose one forward proposes block_size - 1 drafts after its anchor (DFlash):
        num_speculative_tokens defaults to block_size - 1, and no width may be wider."""
        most = block_size - 1
        config = replace(self, num_speculative_tokens=self.num_speculative_tokens or most)
        if config.max_num_tokens > most:
            raise ValueError(f"num_speculative_tokens {config.num_speculative_tokens} (widest per-batch-size rule "
                             f"included: {config.max_num_tokens}) is more drafts than the draft's block of "
                             f"{block_size} proposes; expected at most block_size - 1 = {most}")
        return config

    def num_tokens_for_batch(self, batch_size: int) -> int:
        override = self.width_override(batch_size)
        return self.num_speculative_tokens if override is None else override

    def width_override(self, batch_size: int) -> int | None:
        """K as disable_batch_size or a per-batch-size rule sets it for this batch size; None where neither does."""
        if self.disable_batch_size is not None and batch_size >= self.disable_batch_size:
            return 0
        for rule in self.num_speculative_tokens_per_batch_size:
            if rule["batch_start"] <= batch_size <= rule["batch_end"]:
                return rule["num_tokens"]
        return None
