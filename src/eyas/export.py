"""Write EAGLE-3 drafts in the layouts other engines load, DFlash drafts in the speculators format, and FP8
weight-only drafts (DESIGN.md §4).

A draft is loaded with `load_draft` (any layout) and written back as one of:

| format   | MHA architecture       | MLA architecture (model_type)             | layer     | aux ids          |
|----------|------------------------|-------------------------------------------|-----------|------------------|
| eyas     | LlamaForCausalLMEagle3 | Eagle3DeepseekV2ForCausalLM (deepseek_v2) | layers.0. | hidden_states  T |
| vllm     | Eagle3LlamaForCausalLM | Eagle3DeepseekV2ForCausalLM (deepseek_v2) | layers.0. | hidden_states  T |
| sglang   | LlamaForCausalLMEagle3 | DeepseekV3ForCausalLMEagle3 (deepseek_v3) | midlayer. | hidden_states    |
| modelopt | LlamaForCausalLMEagle3 | Eagle3DeepseekV2ForCausalLM (kimi_k2)     | layers.0. | layer_output (-1)|
| max      | LlamaForCausalLMEagle3 | Eagle3DeepseekV2ForCausalLM (deepseek_v2) | layers.0. | hidden_states  T |
| speculators | Eagle3Speculator    | refused (vLLM takes Llama/Qwen3 layers)   | layers.0. | hidden_states  T |

(T: the ids also at the top level, which vLLM reads first; every other format writes them in `eagle_config`.)
The speculators format (vLLM loads it natively) nests the draft layer's Llama config in `transformer_layer_config`
and the proposal settings in `speculators_config`. Every format writes the four EAGLE-3.1 switches.

Every config names its aux-id convention (`eagle_aux_hidden_state_layer_ids_convention`), so no reader has to guess.
An EAGLE-3 export never writes the target's embedding (every engine shares the target's); `lm_head.weight` always
is, so a file is self-contained even when its head equals the target's.

A DFlash block draft exports in two layouts (`load_dflash_draft` reads both):

| format       | architecture     | layers     | target layers                                  | embedding, lm_head |
|--------------|------------------|------------|------------------------------------------------|--------------------|
| z-lab, as is | DFlashDraftModel | layers.{i} | dflash_config.target_layer_ids (layer outputs) | the target's       |
| speculators  | DFlashSpeculator | layers.{i} | aux_hidden_state_layer_ids (= those + 1)       | copies written     |

z-lab's layout is what `eyas train` saves and what vLLM (`method: dflash`), SGLang and eyas load, so there is
nothing to convert; `--format speculators` writes the speculators library's `dflash` format (vLLM loads it
natively, `speculators_model_type: dflash`; facts and sources in eyas.models.dflash). Other formats refuse a DFlash
draft.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from eyas.aux_layers import AuxConvention, from_hidden_state_ids
from eyas.checkpoint import load_dflash_draft, load_draft, load_target_head
from eyas.config import ConfigError, RopeConfig
from eyas.models.dflash import ARCHITECTURE as DFLASH_ARCHITECTURE
from eyas.models.dflash import DFlashDraft, read_dflash_config, speculators_dflash_config
from eyas.models.eagle3 import (
    AUX_CONVENTION_FIELD,
    AUX_IDS_FIELD,
    EAGLE31_SWITCHES,
    SPECULATORS_ARCHITECTURE,
    Eagle3Config,
    Eagle3Draft,
)
from eyas.paths import DEFAULT_MODEL
from eyas.weights import CheckpointError, checkpoint_files, dequantize_fp8

FP8_MAX = 448.0  # largest finite float8_e4m3fn
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
# the eagle_config keys Model Optimizer's export template writes; eyas's loader recognises a ModelOpt export by them
MODELOPT_EAGLE_CONFIG = {"use_aux_hidden_state": True, "use_input_layernorm_in_first_layer": True,
                         "use_last_layernorm": True, "use_mtp_layernorm": False, "next_layer_regular": True,
                         "parallel_draft_step": 1, "parallel_draft_heads_num_layers": 1}


class ExportError(ValueError):
    """A draft that cannot be written in the requested format, naming the field and what the format needs."""


@dataclass(frozen=True, slots=True)
class DraftFormat:
    """What one engine's draft checkpoint looks like."""

    name: str
    layer_prefix: str  # where the one decoder layer's keys live
    mha_architecture: str
    mla_architecture: str
    mla_model_type: str
    convention: AuxConvention  # how eagle_aux_hidden_state_layer_ids are numbered in the file
    top_level_ids: bool  # also write the ids at the top level (vLLM reads that field first)
    t2d: bool  # write t2d beside d2t (Model Optimizer's exporter rejects it; the rest skip or read it)
    engines: str


FORMATS = {
    "eyas": DraftFormat("eyas", "layers.0.", "LlamaForCausalLMEagle3", "Eagle3DeepseekV2ForCausalLM", "deepseek_v2",
                        AuxConvention.HIDDEN_STATES, True, True, "eyas (what `eyas train` saves)"),
    # deepseek_v2, not deepseek_v3: vLLM's config override turns a deepseek_v3 draft into an MTP model
    "vllm": DraftFormat("vllm", "layers.0.", "Eagle3LlamaForCausalLM", "Eagle3DeepseekV2ForCausalLM", "deepseek_v2",
                        AuxConvention.HIDDEN_STATES, True, True, "vLLM"),
    # SGLang/SpecForge name the layer `midlayer.`; SpecForge's MLA draft class is DeepseekV3ForCausalLMEagle3
    # (a DeepseekV3Config), which SGLang registers as an alias of DeepseekV2ForCausalLMEagle3
    "sglang": DraftFormat("sglang", "midlayer.", "LlamaForCausalLMEagle3", "DeepseekV3ForCausalLMEagle3",
                          "deepseek_v3", AuxConvention.HIDDEN_STATES, False, True, "SGLang, SpecForge"),
    # Model Optimizer's export templates: llama -> LlamaForCausalLMEagle3, kimik2 -> Eagle3DeepseekV2ForCausalLM
    # with model_type kimi_k2; its key check allows only d2t and lm_head beside the layer weights
    "modelopt": DraftFormat("modelopt", "layers.0.", "LlamaForCausalLMEagle3", "Eagle3DeepseekV2ForCausalLM",
                            "kimi_k2", AuxConvention.LAYER_OUTPUT, False, False, "NVIDIA Model Optimizer"),
    "max": DraftFormat("max", "layers.0.", "LlamaForCausalLMEagle3", "Eagle3DeepseekV2ForCausalLM", "deepseek_v2",
                       AuxConvention.HIDDEN_STATES, True, True, "Modular MAX"),
    "speculators": DraftFormat("speculators", "layers.0.", SPECULATORS_ARCHITECTURE, "", "",
                               AuxConvention.HIDDEN_STATES, True, True, "vLLM (speculators format), speculators"),
}
SPECULATORS_VERSION = "0.9.0"  # the speculators release whose eagle3 and dflash configs this writes
# what reads a --format modelopt export's aux ids wrongly: they are written as layer outputs, one lower than the
# hidden_states indices these engines read (measured on the bundled MLA draft in vLLM: AL -7.5%, no warning)
MODELOPT_MISREADERS = "vLLM, SGLang and MAX"


# ---- config ----------------------------------------------------------------------------------------------------

def _format(fmt: str) -> DraftFormat:
    if fmt not in FORMATS:
        raise ExportError(f"format {fmt!r} is not one of {sorted(FORMATS)}")
    return FORMATS[fmt]


def scaled_rope(rope: RopeConfig, rope_scaling: dict) -> RopeConfig:
    """`rope` with YaRN from `rope_scaling` ({"type": "yarn", "factor": F, "original_max_position_embeddings": N,
    optional beta_fast/beta_slow/mscale/mscale_all_dim}); fields not given keep the draft's yarn values if it has
    them, else the YaRN defaults."""
    kind = rope_scaling.get("rope_type", rope_scaling.get("type", "yarn"))
    if kind != "yarn":
        raise ExportError(f"rope_scaling.type is {kind!r}; expected 'yarn' (the only scaling eyas writes)")
    factor, original = rope_scaling.get("factor"), rope_scaling.get("original_max_position_embeddings")
    if not isinstance(factor, int | float) or not factor >= 1:
        raise ExportError(f"rope_scaling.factor is {factor!r}; expected a number >= 1")
    if not isinstance(original, int) or original <= 0:
        raise ExportError(f"rope_scaling.original_max_position_embeddings is {original!r}; expected a positive "
                          "integer (the context length the draft was trained at)")
    base = rope if rope.type == "yarn" else RopeConfig(head_dim=rope.head_dim, theta=rope.theta,
                                                       interleave=rope.interleave)
    extra = {k: float(rope_scaling[k]) for k in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim")
             if rope_scaling.get(k) is not None}
    return dataclasses.replace(base, type="yarn", factor=float(factor), original_max_position_embeddings=original,
                               **extra)


def draft_config_dict(draft: Eagle3Draft, fmt: str, dtype: torch.dtype | None = None,
                      rope_scaling: dict | None = None, verifier: dict | None = None,
                      num_speculative_tokens: int = 3) -> dict:
    """config.json for `draft` in format `fmt` (see FORMATS); `rope_scaling` injects YaRN for long contexts.
    `verifier` ({"name_or_path", "architectures"}: the target) and `num_speculative_tokens` fill the speculators
    format's proposal settings."""
    spec, c = _format(fmt), draft.config
    dtype = dtype or draft.fc.weight.dtype
    mla = c.arch == "mla"
    if fmt == "speculators":
        if mla:
            raise ExportError("an MLA draft has no speculators form: vLLM's speculators loader accepts only llama "
                              "or qwen3 layer configs (transformer_layer_config.model_type). Export it with "
                              "--format vllm (vLLM), sglang (SGLang, SpecForge), max (MAX), modelopt or eyas")
        return _speculators_config(draft_config_dict(draft, "eyas", dtype, rope_scaling), draft, verifier,
                                   num_speculative_tokens)
    _check_loadable(c, spec)
    rope, max_pos = c.rope, c.max_position_embeddings
    if rope_scaling:
        rope = scaled_rope(rope, rope_scaling)
        max_pos = max(max_pos, int(rope.factor * rope.original_max_position_embeddings))
    file_ids = from_hidden_state_ids(c.aux_hidden_state_ids, spec.convention)

    cfg: dict[str, Any] = {
        "architectures": [spec.mla_architecture if mla else spec.mha_architecture],
        "model_type": spec.mla_model_type if mla else "llama",
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": 1, "num_attention_heads": c.num_attention_heads,
        "hidden_act": "silu", "mlp_bias": False, "attention_bias": c.attention_bias, "rms_norm_eps": c.rms_norm_eps,
        "vocab_size": c.vocab_size, "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.target_hidden_size, "num_aux_hidden_states": c.num_aux_hidden_states,
        "max_position_embeddings": max_pos, "tie_word_embeddings": False,
        "torch_dtype": DTYPE_NAMES.get(dtype, "float32"),
    }
    cfg.update(_attention_fields(c, rope))

    eagle: dict[str, Any] = {AUX_IDS_FIELD: file_ids, AUX_CONVENTION_FIELD: spec.convention.value,
                             "use_aux_hidden_state": True}
    if fmt == "modelopt":
        eagle.update(MODELOPT_EAGLE_CONFIG)
    cfg["eagle_config"] = eagle
    if spec.top_level_ids:
        cfg[AUX_IDS_FIELD] = file_ids
        cfg[AUX_CONVENTION_FIELD] = spec.convention.value
    cfg.update(c.switches)
    return cfg


def _check_loadable(c: Eagle3Config, spec: DraftFormat) -> None:
    """Refuse a draft the engine reading format `spec` could not load as it is."""
    if c.arch == "mla" and spec.name == "vllm" and c.mla.q_lora_rank is None:
        raise ExportError("the draft's q_lora_rank is null (a q_proj draft); vLLM's MLA draft fuses q_a_proj with "
                          "kv_a_proj_with_mqa and needs q_lora_rank set. Export --format sglang or eyas instead")
    if spec.name == "sglang" and c.num_aux_hidden_states != 3:
        raise ExportError(f"the draft fuses {c.num_aux_hidden_states} aux hidden states; SGLang and SpecForge build "
                          "fc as 3 x target_hidden_size. Export --format vllm, max or eyas instead")
    if spec.convention is AuxConvention.LAYER_OUTPUT and 0 in c.aux_hidden_state_ids:
        raise ExportError(f"aux id 0 (the embeddings) in {list(c.aux_hidden_state_ids)} has no layer_output number; "
                          "Model Optimizer can only name decoder-layer outputs")


def _attention_fields(c: Eagle3Config, rope: RopeConfig) -> dict[str, Any]:
    """The attention and rope fields of the draft's layer: DeepSeek MLA dims, or Llama MHA heads."""
    if c.arch == "mla":
        m = c.mla
        # no n_routed_experts: the draft's one layer is dense (vLLM needs an integer or nothing here)
        return {"num_key_value_heads": c.num_attention_heads, "q_lora_rank": m.q_lora_rank,
                "kv_lora_rank": m.kv_lora_rank, "qk_nope_head_dim": m.qk_nope_head_dim,
                "qk_rope_head_dim": m.qk_rope_head_dim, "v_head_dim": m.v_head_dim, **rope.to_hf()}
    # Llama rope is rotate-half whatever rope_interleave says, so the field is left out
    return {"num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim,
            **{k: v for k, v in rope.to_hf().items() if k != "rope_interleave"}}


def _speculators_config(flat: dict, draft: Eagle3Draft, verifier: dict | None, num_speculative_tokens: int) -> dict:
    """The speculators eagle3 config.json from the draft's flat (eyas) config: the Llama layer nested, the EAGLE
    fields and the proposal settings at the top."""
    c = draft.config
    eagle_fields = ("architectures", "eagle_config", AUX_IDS_FIELD, AUX_CONVENTION_FIELD, "draft_vocab_size",
                    "target_hidden_size", "num_aux_hidden_states", "torch_dtype", *EAGLE31_SWITCHES)
    layer = {k: v for k, v in flat.items() if k not in eagle_fields}
    layer["architectures"] = ["LlamaForCausalLM"]
    verifier = verifier or {"name_or_path": None, "architectures": []}
    return {
        "architectures": [SPECULATORS_ARCHITECTURE],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": num_speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier["name_or_path"], "architectures": list(verifier["architectures"])},
        },
        "transformer_layer_config": layer,
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.target_hidden_size,
        AUX_IDS_FIELD: list(c.aux_hidden_state_ids),
        AUX_CONVENTION_FIELD: AuxConvention.HIDDEN_STATES.value,
        **c.switches,
        "embed_requires_grad": False,
        "torch_dtype": flat["torch_dtype"],
    }


# ---- tensors and files -----------------------------------------------------------------------------------------

def draft_tensors(draft: Eagle3Draft, fmt: str, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The draft's own tensors under `fmt`'s key names; floating tensors in `dtype` (default: as they are)."""
    spec = _format(fmt)
    out = {}
    for key, t in draft.state_dict().items():
        if key.startswith("embed_tokens."):
            continue  # the target's embedding: every engine shares it, and a copy in the file invites stale ones
        if key == "t2d" and not spec.t2d:
            continue
        if key.startswith("layers.0."):
            key = spec.layer_prefix + key[len("layers.0."):]
        if t.is_floating_point() and dtype is not None:
            t = t.to(dtype)
        # copies: the lm_head may be the target's own tensor, and safetensors refuses shared storage
        out[key] = t.detach().to("cpu", copy=True).contiguous()
    return out


def _write_checkpoint(path: Path, tensors: dict[str, torch.Tensor], config: dict) -> Path:
    """config.json + model.safetensors, each written to a temporary name and renamed, world-readable."""
    path.mkdir(parents=True, exist_ok=True)
    # readers load every *.safetensors (or the index) in a directory: leftovers would be merged into this draft
    stale = sorted(p.name for p in path.glob("*.safetensors") if p.name != "model.safetensors")
    stale += [p.name for p in path.glob("*.safetensors.index.json")]
    if stale:
        raise ExportError(f"{path}: already holds {', '.join(stale)}; readers would merge them with the exported "
                          "draft. Choose an empty directory")
    tmp = path / "model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.chmod(0o644)
    tmp.replace(path / "model.safetensors")
    tmp = path / "config.json.tmp"
    tmp.write_text(json.dumps(config, indent=2) + "\n")
    tmp.chmod(0o644)
    tmp.replace(path / "config.json")
    return path


def save_draft(draft: Eagle3Draft, path: str | Path, fmt: str = "eyas", dtype: torch.dtype | None = None,
               rope_scaling: dict | None = None, verifier: dict | None = None,
               num_speculative_tokens: int = 3) -> Path:
    """Write `draft` as config.json + model.safetensors in format `fmt`; `dtype` defaults to the draft's own."""
    dtype = dtype or draft.fc.weight.dtype
    config = draft_config_dict(draft, fmt, dtype, rope_scaling, verifier, num_speculative_tokens)
    return _write_checkpoint(Path(path), draft_tensors(draft, fmt, dtype), config)


def save_dflash_draft(draft: DFlashDraft, path: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Write a DFlash draft in z-lab's layout, which vLLM (`method: dflash`) and SGLang load: its own weights only
    (the target's embedding and lm_head are the engine's)."""
    dtype = dtype or draft.fc.weight.dtype
    tensors = _dflash_tensors(draft, dtype, with_shared=False)
    return _write_checkpoint(Path(path), tensors, {**draft.config.to_hf(), "torch_dtype": DTYPE_NAMES[dtype]})


def save_dflash_speculators(draft: DFlashDraft, path: str | Path, dtype: torch.dtype | None = None,
                            verifier: dict | None = None, num_speculative_tokens: int | None = None) -> Path:
    """Write a DFlash draft in the speculators library's `dflash` format, which vLLM loads natively: z-lab's weight
    names and copies of the target's embedding and lm_head (eyas.models.dflash says why). `verifier` names the
    target; `num_speculative_tokens` (default block_size - 1) is the K vLLM runs."""
    dtype = dtype or draft.fc.weight.dtype
    config = speculators_dflash_config(draft.config, SPECULATORS_VERSION, verifier, num_speculative_tokens,
                                       DTYPE_NAMES[dtype])
    return _write_checkpoint(Path(path), _dflash_tensors(draft, dtype, with_shared=True), config)


def _dflash_tensors(draft: DFlashDraft, dtype: torch.dtype, with_shared: bool) -> dict[str, torch.Tensor]:
    """The draft's weights in `dtype` (a compressed vocabulary's d2t/t2d keep theirs), each its own CPU copy (the
    shared embedding and lm_head are the target's tensors, tied ones a single one, which safetensors refuses); the
    shared ones only `with_shared`."""
    return {k: v.detach().to("cpu", dtype=dtype if v.is_floating_point() else v.dtype, copy=True).contiguous()
            for k, v in draft.state_dict().items() if with_shared or k not in draft.shared_weights}


def stored_dtype(path: str | Path) -> torch.dtype | None:
    """The dtype most of a checkpoint's non-FP8 floating-point values are stored in (read from the headers)."""
    counts: Counter[torch.dtype] = Counter()
    for file in checkpoint_files(Path(path)):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                if key.endswith("_scale_inv"):
                    continue
                tensor = f.get_slice(key)
                dtype = _SAFETENSORS_DTYPES.get(tensor.get_dtype())
                if dtype is not None:
                    counts[dtype] += math.prod(tensor.get_shape())
    return counts.most_common(1)[0][0] if counts else None


def checkpoint_keys(path: str | Path) -> list[str]:
    """Every tensor name in a checkpoint directory, from the safetensors headers only."""
    keys = []
    for file in checkpoint_files(Path(path)):
        try:
            with safe_open(str(file), framework="pt") as f:
                keys += list(f.keys())
        except Exception as e:  # safetensors raises its own types for a corrupt header
            raise CheckpointError(f"{file}: cannot read the safetensors header ({type(e).__name__}: {e})") from e
    return keys


def _resolve_target(target: nn.Module | str | Path, draft_dir: Path) -> nn.Module:
    if isinstance(target, nn.Module):
        return target
    # in the draft's own precision, so the draft's weights reach the writer unrounded
    return load_target_head(target, stored_dtype(draft_dir) or torch.float32)


def _verifier(target: nn.Module | str | Path) -> dict | None:
    """The speculators formats' verifier entry for a target checkpoint directory; None for a loaded model."""
    if isinstance(target, nn.Module):
        return None
    raw = json.loads((Path(target) / "config.json").read_text())
    return {"name_or_path": str(target), "architectures": raw.get("architectures") or []}


def _export_block_draft(src_dir: Path, out_dir: str | Path, fmt: str, target: nn.Module | str | Path,
                        dtype: torch.dtype | None, num_speculative_tokens: int | None, eagle_options: dict) -> Path:
    """A DFlash draft (either layout) written in the speculators format: z-lab's layout, which every engine that
    runs DFlash loads, is left as it is."""
    if fmt != "speculators":
        raise ExportError(f"{src_dir} is a DFlash block draft (z-lab's {DFLASH_ARCHITECTURE} or the speculators "
                          "dflash format); z-lab's layout is what vLLM (speculative method dflash), SGLang "
                          "(--speculative-algorithm DFLASH) and eyas load as it is, and eyas export converts EAGLE-3 "
                          f"drafts only to --format {fmt}. A DFlash draft exports with --format speculators (the "
                          "speculators library's dflash format, which vLLM also loads)")
    given = sorted(name for name, value in eagle_options.items() if value)
    if given:
        raise ExportError(f"{', '.join(given)} apply to EAGLE-3 drafts; {src_dir} is a DFlash block draft")
    draft = load_dflash_draft(src_dir, _resolve_target(target, src_dir))
    return save_dflash_speculators(draft, out_dir, dtype or stored_dtype(src_dir), _verifier(target),
                                   num_speculative_tokens)


def export_draft(src_dir: str | Path, out_dir: str | Path, fmt: str, target: nn.Module | str | Path,
                 rope_scaling: dict | None = None, dtype: torch.dtype | None = None,
                 aux_convention: str | None = None, allow_unused_weights: bool = False,
                 num_speculative_tokens: int | None = None) -> Path:
    """Load a draft from any layout (`load_draft`, or `load_dflash_draft` for a DFlash draft, which exports with
    `fmt` speculators only) and write it in `fmt`. `target` is a loaded target model or a target checkpoint
    directory (then only its config, embedding and lm_head are read); `dtype` defaults to the dtype the source file
    stores; `num_speculative_tokens` (the speculators formats' K) to 3, for a DFlash draft to block_size - 1."""
    src_dir = Path(src_dir)
    _format(fmt)
    if read_dflash_config(src_dir) is not None:
        options = {"rope_scaling": rope_scaling, "aux_convention": aux_convention,
                   "allow_unused_weights": allow_unused_weights}
        return _export_block_draft(src_dir, out_dir, fmt, target, dtype, num_speculative_tokens, options)
    draft = load_draft(src_dir, _resolve_target(target, src_dir), aux_convention, allow_unused_weights)
    return save_draft(draft, out_dir, fmt, dtype or stored_dtype(src_dir), rope_scaling, _verifier(target),
                      3 if num_speculative_tokens is None else num_speculative_tokens)


# ---- FP8 ---------------------------------------------------------------------------------------------------------

def quantize_fp8_blocks(weight: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's block FP8: float8_e4m3fn values [rows, cols] and float32 scales [ceil(rows/b), ceil(cols/b)]
    with weight ~= value x scale, scale = blockmax / 448 (0 for an all-zero block, whose values are 0)."""
    rows, cols = weight.shape
    br, bc = -(-rows // block), -(-cols // block)
    padded = F.pad(weight.float(), (0, bc * block - cols, 0, br * block - rows))
    blocks = padded.view(br, block, bc, block)
    scale = blocks.abs().amax(dim=(1, 3)) / FP8_MAX  # [br, bc]
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale))[:, None, :, None]
    values = (blocks / divisor).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return values.view(br * block, bc * block)[:rows, :cols].contiguous(), scale.contiguous()


def _is_projection(key: str, t: torch.Tensor, include_lm_head: bool) -> bool:
    # every 2-D weight of the draft is a projection (fc, attention, MLP, lm_head); norms and biases are 1-D
    if not (key.endswith(".weight") and t.dim() == 2 and t.is_floating_point()):
        return False
    return include_lm_head or key != "lm_head.weight"


def quantize_draft_fp8(src_dir: str | Path, out_dir: str | Path, target: nn.Module | str | Path, block: int = 128,
                       include_lm_head: bool = False, fmt: str = "eyas",
                       aux_convention: str | None = None) -> dict[str, Any]:
    """Weight-only FP8 draft: every projection (fc, attention, MLP; lm_head only with `include_lm_head`) stored
    as float8_e4m3fn with a float32 `weight_scale_inv` per block x block tile, DeepSeek's layout; norms, d2t/t2d
    and the kept lm_head stay in the source dtype. Returns what it did: keys, max abs weight error, file sizes."""
    if not isinstance(block, int) or block <= 0:
        raise ExportError(f"block size is {block!r}; expected a positive integer (DeepSeek uses 128)")
    src_dir, out_dir = Path(src_dir), Path(out_dir)
    draft = load_draft(src_dir, _resolve_target(target, src_dir), aux_convention)
    source_dtype = stored_dtype(src_dir) or draft.fc.weight.dtype
    tensors = draft_tensors(draft, fmt, source_dtype)
    quantized, worst, worst_key = [], 0.0, None
    for key in list(tensors):
        weight = tensors[key]
        if not _is_projection(key, weight, include_lm_head):
            continue
        if not torch.isfinite(weight).all():
            raise ExportError(f"{src_dir}: weight {key!r} has inf or NaN values; cannot scale it to FP8")
        values, scale = quantize_fp8_blocks(weight, block)
        # the error the loader will see: dequantized exactly as eyas.weights.dequantize_fp8 does it
        restored = dequantize_fp8({key: values, key + "_scale_inv": scale}, (block, block), torch.float32)[key]
        error = (restored - weight.float()).abs().max().item()
        if error >= worst:
            worst, worst_key = error, key
        tensors[key], tensors[key + "_scale_inv"] = values, scale
        quantized.append(key)
    config = draft_config_dict(draft, fmt, source_dtype)
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [block, block],
                                     "activation_scheme": "dynamic"}
    _write_checkpoint(out_dir, tensors, config)
    return {
        "path": str(out_dir), "format": fmt, "block_size": block, "source_dtype": DTYPE_NAMES.get(source_dtype),
        "quantized": quantized, "kept": sorted(k for k in tensors if k not in quantized and
                                               not k.endswith("_scale_inv")),
        "max_abs_error": worst, "max_abs_error_key": worst_key,
        "bytes_before": sum(f.stat().st_size for f in checkpoint_files(src_dir)),
        "bytes_after": (out_dir / "model.safetensors").stat().st_size,
    }


# ---- command line ------------------------------------------------------------------------------------------------

def _mb(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def _error(command: str, e: Exception) -> int:
    print(f"eyas {command}: error: {e}", file=sys.stderr)
    return 2


def cmd_export(args: argparse.Namespace) -> int:
    rope_scaling = None
    if (args.rope_scaling_factor is None) != (args.rope_original_max_position_embeddings is None):
        return _error("export", ValueError("--rope-scaling-factor and --rope-original-max-position-embeddings go "
                                           "together (YaRN needs the factor and the trained context length)"))
    if args.rope_scaling_factor is not None:
        rope_scaling = {"type": "yarn", "factor": args.rope_scaling_factor,
                        "original_max_position_embeddings": args.rope_original_max_position_embeddings}
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(args.dtype)
    try:
        out = export_draft(args.draft, args.out, args.format, args.target, rope_scaling, dtype,
                           args.aux_layer_convention, args.allow_unused_draft_weights, args.num_speculative_tokens)
    except (CheckpointError, ConfigError, ValueError, OSError) as e:
        return _error("export", e)
    config = json.loads((out / "config.json").read_text())
    if config.get("speculators_model_type") == "dflash":
        print(_block_export_summary(out, config))
        return 0
    layer = config.get("transformer_layer_config", config)  # speculators nests the layer's own config
    eagle = config.get("eagle_config", config)
    print(f"wrote {out}/config.json + model.safetensors ({_mb((out / 'model.safetensors').stat().st_size)}): "
          f"{args.format} layout ({FORMATS[args.format].engines}), {config['architectures'][0]} "
          f"(model_type {layer['model_type']}), {config['torch_dtype']}")
    print(f"  aux ids {eagle[AUX_IDS_FIELD]} ({eagle[AUX_CONVENTION_FIELD]} convention), fc fuses "
          f"{config.get('num_aux_hidden_states', len(eagle[AUX_IDS_FIELD]))} x {config['target_hidden_size']}, "
          f"draft vocab {config['draft_vocab_size']} of {layer['vocab_size']}")
    switches = [name for name in EAGLE31_SWITCHES if config.get(name)]
    print(f"  EAGLE-3.1 switches: {', '.join(switches) if switches else 'none (an EAGLE-3 draft)'}")
    if config.get("norm_before_fc") and "Deepseek" in config["architectures"][0] and args.format == "vllm":
        print("warning: this MLA draft sets norm_before_fc; vLLM 0.32's MLA draft code (deepseek_eagle3.py) has no "
              "such norm (its Llama draft does), so a vLLM of that age would not apply input_norm.weight. Check "
              "your vLLM's deepseek_eagle3.py, or train the draft with --fc-norm instead", file=sys.stderr)
    if args.format == "modelopt":
        print(f"warning: --format modelopt writes Model Optimizer's aux ids, 0-based decoder-layer outputs "
              f"{eagle[AUX_IDS_FIELD]}; {MODELOPT_MISREADERS} read them as hidden_states indices, one layer early, "
              "and say nothing (on the bundled MLA draft vLLM accepted 7.5% fewer tokens). For those engines export "
              "--format vllm, sglang or max", file=sys.stderr)
    if rope_scaling:
        print(f"  rope: yarn factor {args.rope_scaling_factor} from {args.rope_original_max_position_embeddings} "
              f"positions; max_position_embeddings {config['max_position_embeddings']}")
    return 0


def _block_export_summary(out: Path, config: dict) -> str:
    layer, spec = config["transformer_layer_config"], config["speculators_config"]
    ids = config["aux_hidden_state_layer_ids"]
    shared = "embedding" if config["draft_vocab_size"] != layer["vocab_size"] else "embedding and lm_head"
    return (f"wrote {out}/config.json + model.safetensors ({_mb((out / 'model.safetensors').stat().st_size)}): "
            f"speculators dflash layout (vLLM, speculators), {config['architectures'][0]} over "
            f"{layer['num_hidden_layers']} Qwen3 layers, {layer['torch_dtype']}\n"
            f"  aux ids {ids} (hidden_states; z-lab target_layer_ids {[i - 1 for i in ids]}), block "
            f"{config['block_size']}: {spec['proposal_methods'][0]['speculative_tokens']} speculative tokens, mask "
            f"token {config['mask_token_id']}; draft vocab {config['draft_vocab_size']} of {layer['vocab_size']}; "
            f"{shared} copied from the target ({spec['verifier']['name_or_path']})")


def cmd_quantize_draft(args: argparse.Namespace) -> int:
    try:
        report = quantize_draft_fp8(args.draft, args.out, args.target, args.block_size, args.include_lm_head,
                                    args.format, args.aux_layer_convention)
    except (CheckpointError, ConfigError, ValueError, OSError) as e:
        return _error("quantize-draft", e)
    print(f"wrote {report['path']} ({report['format']} layout): {len(report['quantized'])} weights in FP8 e4m3, "
          f"{report['block_size']}x{report['block_size']} blocks; kept in {report['source_dtype']}: "
          f"{', '.join(report['kept'])}")
    print(f"  max abs weight error {report['max_abs_error']:.3g} ({report['max_abs_error_key']}); "
          f"{_mb(report['bytes_before'])} -> {_mb(report['bytes_after'])}")
    return 0


_EXPORT_DESCRIPTION = (
    "Load an EAGLE-3 draft from any layout eyas reads and write config.json + model.safetensors in "
    "one engine's layout. eyas/vllm/max: layer under layers.0., aux ids as hidden_states indices (vLLM: "
    "Eagle3LlamaForCausalLM / Eagle3DeepseekV2ForCausalLM with model_type deepseek_v2). sglang: layer under "
    "midlayer., LlamaForCausalLMEagle3 / DeepseekV3ForCausalLMEagle3, 3 aux states. modelopt: Model "
    "Optimizer's layout, aux ids as 0-based layer outputs (one lower; vLLM and SGLang read them as "
    "hidden_states: export warns). speculators: vLLM's native format, an Eagle3Speculator config nesting the "
    "Llama layer's config (MHA drafts only). Every config names its aux-id convention and the EAGLE-3.1 "
    "switches. The target's embedding is never written; lm_head always is. A DFlash block draft stays in "
    "z-lab's layout, as is (vLLM, SGLang and eyas load it), or exports with --format speculators: a "
    "DFlashSpeculator config (aux ids = z-lab's target_layer_ids + 1) with copies of the target's embedding "
    "and lm_head. Reloading any export in eyas gives the same weights bit for bit.")


def add_cli(subparsers: argparse._SubParsersAction) -> None:
    """Register `eyas export` and `eyas quantize-draft`."""
    conventions = [c.value for c in AuxConvention]
    e = subparsers.add_parser(
        "export", help="write an EAGLE-3 draft in the layout vLLM, SGLang, Model Optimizer or MAX loads, or a "
        "DFlash draft in the speculators format",
        description=_EXPORT_DESCRIPTION)
    e.add_argument("draft", type=Path, metavar="DRAFT_DIR", help="the draft checkpoint directory to read")
    e.add_argument("out", type=Path, metavar="OUT_DIR", help="directory to write (created; must hold no other "
                   "*.safetensors)")
    e.add_argument("--format", required=True, choices=sorted(FORMATS), help="the engine layout to write; a DFlash "
                   "draft: speculators (its z-lab layout is what every engine loads, as is)")
    e.add_argument("--target", type=Path, default=DEFAULT_MODEL, metavar="DIR", help="the target checkpoint the "
                   "draft belongs to; only its config, embedding and lm_head are read (a DFlash export copies the "
                   "last two; default: the bundled tiny DeepSeek-V3)")
    e.add_argument("--rope-scaling-factor", type=float, metavar="F", help="write YaRN rope scaling with this factor "
                   "(a draft trained on short contexts served long); needs --rope-original-max-position-embeddings")
    e.add_argument("--rope-original-max-position-embeddings", type=int, metavar="N", help="the context length the "
                   "draft was trained at; max_position_embeddings becomes F x N")
    e.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="dtype of the written weights "
                   "(default: the dtype the source file stores)")
    e.add_argument("--aux-layer-convention", choices=conventions, help="how to read the SOURCE draft's aux ids "
                   "(default: detected from its config, else hidden_states)")
    e.add_argument("--num-speculative-tokens", type=int, help="--format speculators: the draft tokens per step "
                   "written as the proposal method's speculative_tokens (vLLM reads it as its K; default 3, for a "
                   "DFlash draft its block_size - 1)")
    e.add_argument("--allow-unused-draft-weights", action="store_true", help="read a source draft holding weights "
                   "its config does not use (they are dropped); without it that is an error naming them")
    e.set_defaults(func=cmd_export)

    q = subparsers.add_parser(
        "quantize-draft", help="write an FP8 (weight-only, block e4m3) copy of an EAGLE-3 draft",
        description="Store every projection of the draft (fc, attention, MLP) as float8_e4m3fn with a float32 "
        "weight_scale_inv per block (weight = value x scale, scale = blockmax / 448) and quantization_config "
        "{quant_method: fp8, fmt: e4m3, weight_block_size: [B, B], activation_scheme: dynamic}: the block FP8 "
        "layout DeepSeek-V3 ships, which eyas dequantizes on load. Norms, d2t/t2d and (by default) lm_head keep "
        "the source dtype. Prints the largest weight error and the file sizes.")
    q.add_argument("draft", type=Path, metavar="DRAFT_DIR", help="the draft checkpoint directory to read")
    q.add_argument("out", type=Path, metavar="OUT_DIR", help="directory to write")
    q.add_argument("--fp8", action="store_true", help="block FP8 e4m3 weights: the only scheme, so also what runs "
                   "without this flag")
    q.add_argument("--block-size", type=int, default=128, metavar="B", help="scale block B x B (default 128, as "
                   "DeepSeek-V3)")
    q.add_argument("--include-lm-head", action="store_true", help="quantize lm_head too (eyas loads it; vLLM and "
                   "SGLang keep lm_head unquantized and will not)")
    q.add_argument("--format", choices=sorted(FORMATS), default="eyas", help="key/config layout (default eyas)")
    q.add_argument("--target", type=Path, default=DEFAULT_MODEL, metavar="DIR", help="the target checkpoint the "
                   "draft belongs to (default: the bundled tiny DeepSeek-V3)")
    q.add_argument("--aux-layer-convention", choices=conventions, help="how to read the source draft's aux ids")
    q.set_defaults(func=cmd_quantize_draft)
