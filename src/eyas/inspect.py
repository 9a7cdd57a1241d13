"""`eyas inspect`: read a target and a draft and say whether they fit, and why not.

Everything `load_draft` rejects is a mismatch; so are aux ids that fuse the embeddings or the final layer, and aux
ids whose convention is only a guess: a file that names no convention but whose ids equal the *other*
convention's defaults for this depth is the field's top silent bug (DESIGN.md §4), an off-by-one that costs
acceptance without an error anywhere. The report shows both readings so a person can decide.
Only headers, configs, the embedding and the lm_head are read, never the target's decoder layers.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from pathlib import Path
from typing import Any

import torch

from eyas.aux_layers import AuxConvention, to_hidden_state_ids
from eyas.checkpoint import canonical_key, load_dflash_draft, load_draft, load_target_head
from eyas.config import ConfigError, DeepseekV3Config, RopeConfig, read_config_json
from eyas.export import DTYPE_NAMES, MODELOPT_MISREADERS, checkpoint_keys, stored_dtype
from eyas.models.dflash import ARCHITECTURE as DFLASH_ARCHITECTURE
from eyas.models.dflash import is_speculators_dflash, read_dflash_config
from eyas.models.eagle3 import (
    AUX_CONVENTION_FIELD,
    AUX_IDS_FIELD,
    EAGLE31_SWITCHES,
    MODELOPT_EAGLE_KEYS,
    SWITCH_WEIGHTS,
    Eagle3Draft,
    is_speculators_config,
)
from eyas.paths import DEFAULT_MODEL
from eyas.weights import CheckpointError

METHODS = ("eagle", "mtp", "dflash")


def _rope_text(rope: RopeConfig, max_positions: int) -> str:
    text = f"{rope.type}, theta {rope.theta:g}"
    if rope.type == "yarn":
        text += (f", factor {rope.factor:g}, original_max_position_embeddings "
                 f"{rope.original_max_position_embeddings}, mscale_all_dim {rope.mscale_all_dim:g}")
    return text + f"; max_position_embeddings {max_positions}"


# ---- target ------------------------------------------------------------------------------------------------------

def _mtp_state(config: DeepseekV3Config, keys: list[str]) -> tuple[bool, str]:
    L, n = config.num_hidden_layers, config.num_nextn_predict_layers
    prefix = f"model.layers.{L}."
    present = [k for k in keys if k.startswith(prefix)]
    if not n:
        return False, "none (num_nextn_predict_layers is 0)"
    # the head and embedding copies may be absent (load_model shares the main ones); these four may not
    required = [prefix + name for name in ("eh_proj.weight", "enorm.weight", "hnorm.weight",
                                           "shared_head.norm.weight")]
    missing = [k for k in required if k not in present]
    if missing:
        return False, (f"num_nextn_predict_layers is {n} but the weights are absent ({', '.join(missing)} "
                       "missing; transformers drops them on save)")
    return True, f"{n} NextN layer, weights present ({prefix}*: {len(present)} tensors)"


def _target_facts(path: Path, raw: dict, c: DeepseekV3Config, keys: list[str]) -> dict[str, Any]:
    if c.n_routed_experts is None:
        moe = "none (every layer dense)"
    else:
        moe = (f"{c.n_routed_experts} routed experts, top {c.num_experts_per_tok}, groups {c.n_group} (top "
               f"{c.topk_group}), {c.n_shared_experts} shared, expert width {c.moe_intermediate_size}, first "
               f"{c.first_k_dense_replace} layers dense")
    quant = raw.get("quantization_config")
    dtype = c.torch_dtype + (f", quantized {quant.get('quant_method')} {quant.get('fmt', '')} blocks "
                             f"{quant.get('weight_block_size')}" if quant else ", not quantized")
    return {
        "path": str(path),
        "architecture": f"{', '.join(raw.get('architectures') or ['?'])} (model_type {raw.get('model_type')})",
        "layers": c.num_hidden_layers, "hidden_size": c.hidden_size, "vocab_size": c.vocab_size,
        "mla": (f"{c.num_attention_heads} heads, q_lora_rank {c.q_lora_rank}, kv_lora_rank {c.kv_lora_rank}, "
                f"qk_nope {c.qk_nope_head_dim}, qk_rope {c.qk_rope_head_dim}, v {c.v_head_dim}"),
        "rope": _rope_text(c.rope, c.max_position_embeddings),
        "moe": moe,
        "mtp": _mtp_state(c, keys)[1],
        "dtype": dtype,
    }


# ---- draft -------------------------------------------------------------------------------------------------------

def _file_ids(raw: dict) -> tuple[str, list[int] | None]:
    """The aux-id field as load_draft picks it (vLLM's order: the top level before eagle_config)."""
    if raw.get(AUX_IDS_FIELD) is not None:
        return AUX_IDS_FIELD, raw[AUX_IDS_FIELD]
    return f"eagle_config.{AUX_IDS_FIELD}", (raw.get("eagle_config") or {}).get(AUX_IDS_FIELD)


def _reading(file_ids: list[int], convention: AuxConvention, num_layers: int) -> list[int] | str:
    try:
        return sorted(to_hidden_state_ids(file_ids, convention, num_layers))
    except (ValueError, TypeError) as e:
        return f"invalid ({e})"


class _Collect(logging.Handler):
    """Keeps the loader's warnings for the report instead of printing them beside it."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _load(draft_dir: Path, target, aux_convention: str | None, warnings: list[str]):
    log = logging.getLogger("eyas")
    handler, propagate = _Collect(), log.propagate
    log.addHandler(handler)
    log.propagate = False
    try:
        # unused weights are reported as a problem below, with the rest of the report
        return load_draft(draft_dir, target, aux_convention, allow_unused_weights=True)
    finally:
        log.removeHandler(handler)
        log.propagate = propagate
        warnings += handler.messages


def _convention_problems(raw: dict, file_ids: list[int] | None, assumed: str, num_layers: int,
                         aux_convention: str | None, readings: dict) -> tuple[list[str], list[str]]:
    """(problems, warnings) about which convention the file's ids are in."""
    eagle = raw.get("eagle_config") or {}
    named = eagle.get(AUX_CONVENTION_FIELD) or raw.get(AUX_CONVENTION_FIELD)
    if file_ids is None or aux_convention is not None or named is not None:
        return [], []
    L = num_layers
    ids = sorted(file_ids)
    standard, modelopt = [2, L // 2, L - 3], sorted({1, L // 2 - 1, L - 4})
    markers = [k for k in MODELOPT_EAGLE_KEYS if k in eagle]
    hs, lo = readings[AuxConvention.HIDDEN_STATES.value], readings[AuxConvention.LAYER_OUTPUT.value]
    hint = "pass --aux-layer-convention (or re-export with `eyas export`, which names the convention)"
    if ids == modelopt and ids != standard and not markers:
        return [f"aux ids {file_ids} equal Model Optimizer's layer_output defaults sorted({{1, L//2-1, L-4}}) for "
                f"L={L}, and the file names no convention: possibly layer_output convention; {hint}. As layer "
                f"outputs they are hidden_states {lo}; vLLM, SGLang and MAX read them as hidden_states {hs}"], []
    if ids == standard and ids != modelopt and assumed == AuxConvention.LAYER_OUTPUT.value:
        return [f"aux ids {file_ids} equal the standard hidden_states defaults (2, L//2, L-3) for L={L}, but the "
                f"file's Model Optimizer keys ({', '.join(markers)}) make them read as layer outputs {lo}: possibly "
                f"hidden_states convention; {hint}"], []
    if not markers:
        return [], [f"the file names no aux-id convention ({AUX_CONVENTION_FIELD}); read as hidden_states "
                    f"{hs}, as layer outputs they would be {lo}"]
    return [], []


def _draft_facts(draft_dir: Path, target_dir: Path, config: DeepseekV3Config, aux_convention: str | None,
                 problems: list[str], warnings: list[str]) -> dict[str, Any]:
    raw = read_config_json(draft_dir / "config.json", "a draft checkpoint directory")
    keys = {canonical_key(k) for k in checkpoint_keys(draft_dir)}  # an unreadable file is an input error
    problems += _switch_problems(raw, keys)
    L = config.num_hidden_layers
    field, file_ids = _file_ids(raw)
    readings = {}
    if isinstance(file_ids, list):
        readings = {c.value: _reading(file_ids, c, L) for c in AuxConvention}
    facts = _file_facts(draft_dir, raw, field, file_ids, readings)
    target = load_target_head(target_dir, stored_dtype(draft_dir) or torch.float32)
    try:
        draft = _load(draft_dir, target, aux_convention, warnings)
    except (ConfigError, CheckpointError) as e:
        problems.append(str(e))
        return facts
    facts.update(_loaded_facts(draft_dir, draft))
    more_problems, more_warnings = _aux_id_problems(draft, raw, file_ids, L, aux_convention, readings)
    problems += more_problems
    warnings += more_warnings
    c, t = draft.config, config.rope
    if (c.rope.type, c.rope.theta) != (t.type, t.theta):
        warnings.append(f"draft rope ({c.rope.type}, theta {c.rope.theta:g}) differs from the target's ({t.type}, "
                        f"theta {t.theta:g}); fine if the draft was trained so. A draft trained short and served long "
                        "can get YaRN with `eyas export --rope-scaling-factor`")
    return facts


def _block_draft_file_facts(raw: dict) -> tuple[str, str]:
    """(architecture, target layers) as a DFlash draft's config.json writes them, in z-lab's or speculators' layout."""
    if is_speculators_dflash(raw):
        layer = raw.get("transformer_layer_config") if isinstance(raw.get("transformer_layer_config"), dict) else {}
        return (f"{', '.join(map(str, raw.get('architectures') or ['?']))} (speculators dflash format, layers "
                f"model_type {layer.get('model_type')}): a DFlash block draft",
                f"aux_hidden_state_layer_ids = {raw.get('aux_hidden_state_layer_ids')} (hidden_states indices: "
                "z-lab's target_layer_ids + 1)")
    dflash = raw.get("dflash_config") if isinstance(raw.get("dflash_config"), dict) else {}
    return (f"{DFLASH_ARCHITECTURE} (model_type {raw.get('model_type')}): a DFlash block draft",
            f"dflash_config.target_layer_ids = {dflash.get('target_layer_ids')} (0-based layer outputs)")


def _block_draft_facts(draft_dir: Path, target_dir: Path, config: DeepseekV3Config,
                       problems: list[str]) -> dict[str, Any]:
    """A DFlash block draft (z-lab's layout or speculators'): what it is, loaded against the target as the engine
    loads it."""
    raw = read_config_json(draft_dir / "config.json", "a DFlash draft checkpoint directory")
    architecture, target_layers = _block_draft_file_facts(raw)
    facts: dict[str, Any] = {"path": str(draft_dir), "architecture in file": architecture,
                             "target layers in file": target_layers}
    try:
        draft = load_dflash_draft(draft_dir, load_target_head(target_dir, stored_dtype(draft_dir) or torch.float32))
    except (ConfigError, CheckpointError) as e:
        problems.append(str(e))
        return facts
    c = draft.config
    own = sum(p.numel() for name, p in draft.named_parameters() if name not in draft.shared_weights)
    facts.update({
        "read as hidden_states": list(draft.aux_hidden_state_ids),
        "block": f"{c.block_size} rows: the anchor and up to {c.block_size - 1} drafts per forward",
        "layers": (f"{c.num_hidden_layers} x MLA-shaped, {c.num_attention_heads} heads, q_lora {c.q_lora_rank}, "
                   f"kv_lora {c.kv_lora_rank}, qk_nope {c.qk_nope_head_dim}, qk_rope {c.qk_rope_head_dim}, v "
                   f"{c.v_head_dim}, MLP {c.intermediate_size}; the context enters through the latent; non-causal "
                   "within the block" if c.attention_mode == "mla" else
                   f"{c.num_hidden_layers} x Qwen3-style, {c.num_attention_heads} query / {c.num_key_value_heads} KV "
                   f"heads of {c.head_dim}, MLP {c.intermediate_size}; non-causal within the block"),
        "kept per context position": f"{math.prod(draft.cache_entry_shape())} values (all layers)",
        "fusion": f"fc {len(c.target_layer_ids)} x {c.hidden_size} -> {c.hidden_size}",
        "mask token": f"id {c.mask_token_id}",
        "vocab": (f"draft {c.draft_vocab_size} of {c.vocab_size} (its own lm_head; d2t maps them to the target's ids)"
                  if c.compressed_vocab else f"the target's {c.vocab_size}, through its lm_head"),
        "rope": _rope_text(c.rope, c.max_position_embeddings),
        "weights": (f"{own / 1e6:.2f}M own (embedding{'' if c.compressed_vocab else ' and lm_head'}: the "
                    "target's)"),
    })
    return facts


def _file_facts(draft_dir: Path, raw: dict, field: str, file_ids: Any, readings: dict) -> dict[str, Any]:
    """What the draft's config.json says, before anything is loaded."""
    model_type = raw.get("model_type") or (raw.get("transformer_layer_config") or {}).get("model_type")
    return {
        "path": str(draft_dir),
        "architecture in file": f"{', '.join(raw.get('architectures') or ['?'])} (model_type {model_type}"
                                f"{', speculators format' if is_speculators_config(raw) else ''})",
        "aux ids in file": f"{field} = {file_ids}" if file_ids is not None else "absent (engines use their defaults)",
        "EAGLE-3.1 switches": ", ".join(f"{name} {'true' if raw.get(name) else 'false'}"
                                        for name in EAGLE31_SWITCHES),
        **{f"read as {name}": value for name, value in readings.items()},
    }


def _loaded_facts(draft_dir: Path, draft: Eagle3Draft) -> dict[str, Any]:
    """What loading the draft found: its architecture, aux ids, vocab, rope, weights and dtype."""
    rep, c = draft.load_report, draft.config
    return {
        "architecture": f"{rep['architecture']} ({c.arch.upper()})",
        "layout": rep["layout"],
        "aux ids (hidden_states)": list(draft.aux_hidden_state_ids),
        "convention assumed": rep["aux_convention"],
        "fusion": f"fc input {draft.fc.in_features} = {c.num_aux_hidden_states} x {c.target_hidden_size}",
        "vocab": (f"draft {c.draft_vocab_size} of {c.vocab_size}; d2t {rep['d2t']}; covers "
                  f"{int(draft.t2d.sum()) if c.compressed_vocab else c.vocab_size} target ids"),
        "rope": _rope_text(c.rope, c.max_position_embeddings),
        "weights": (f"{len(rep['own_weights'])} own, shared with the target: {', '.join(rep['shared_weights'])}; "
                    f"lm_head {rep['lm_head']}"),
        "dtype": (f"{DTYPE_NAMES.get(stored_dtype(draft_dir), '?')} in the file"
                  + (", projections in FP8 blocks (dequantized on load)" if rep["fp8"] else ", not quantized")),
    }


def _aux_id_problems(draft: Eagle3Draft, raw: dict, file_ids: Any, num_layers: int, aux_convention: str | None,
                     readings: dict) -> tuple[list[str], list[str]]:
    """(problems, warnings) about the loaded draft's aux ids: the layers they fuse, and their convention."""
    L = num_layers
    problems, warnings = [], []
    for i in draft.aux_hidden_state_ids:
        if i == 0:
            problems.append("aux id hidden_states 0 fuses the embeddings, not a decoder layer's output")
        elif i == L:
            problems.append(f"aux id hidden_states {L} fuses the final decoder layer's output (the state the target's "
                            "own head reads); EAGLE-3 fuses early, middle and late layers below it")
    assumed = draft.load_report["aux_convention"].split(" ", 1)[0]
    more_problems, more_warnings = _convention_problems(raw, file_ids if isinstance(file_ids, list) else None,
                                                        assumed, L, aux_convention, readings)
    if assumed == AuxConvention.LAYER_OUTPUT.value and isinstance(file_ids, list):
        warnings.append(f"the aux ids {file_ids} are layer outputs (Model Optimizer's convention): "
                        f"{MODELOPT_MISREADERS} would read them as hidden_states {readings['hidden_states']}, one "
                        "layer early, with no warning and lower acceptance; give those engines an `eyas export "
                        "--format vllm|sglang|max` of this draft")
    return problems + more_problems, warnings + more_warnings


def _switch_problems(raw: dict, keys: set[str]) -> list[str]:
    """A switch set without its weights, or weights of a switch that is off: either way the draft would not run as
    it was trained. Speculators files keep the switches at the top level too."""
    problems = []
    for name, prefix in SWITCH_WEIGHTS.items():
        present = sorted(k for k in keys if k.startswith(prefix))
        if raw.get(name) and not present:
            problems.append(f"{name} is true in config.json but the file has no {prefix}* weights")
        elif present and not raw.get(name):
            problems.append(f"{', '.join(present)} present but {name} is false: engines would drop these norms "
                            "(eyas refuses the draft unless --allow-unused-draft-weights)")
    known = ("fc.", "fc_norm.", "input_norm.", "layers.", "norm.", "lm_head.", "embed_tokens.", "d2t", "t2d")
    other = sorted(k for k in keys if not k.startswith(known))
    if other:
        problems.append(f"{', '.join(other)}: weights no EAGLE-3 draft uses")
    if is_speculators_config(raw) and raw.get("speculators_model_type") != "eagle3":
        problems.append(f"speculators_model_type is {raw.get('speculators_model_type')!r}; eyas runs eagle3")
    return problems


# ---- report ------------------------------------------------------------------------------------------------------

def inspect_report(target_dir: str | Path, draft_dir: str | Path | None = None, method: str = "eagle",
                   aux_convention: str | None = None) -> dict[str, Any]:
    """The facts about a target (and draft) as a dict: target, draft, problems, warnings, ok. Raises
    ConfigError/CheckpointError when an input cannot be read at all."""
    if method not in METHODS:
        raise ValueError(f"speculative method {method!r} is not one of {list(METHODS)}")
    target_dir = Path(target_dir)
    raw = read_config_json(target_dir / "config.json", "a target checkpoint directory")
    config = DeepseekV3Config.from_dict(raw, source=str(target_dir / "config.json"))
    keys = checkpoint_keys(target_dir)
    problems: list[str] = []
    warnings: list[str] = []
    report: dict[str, Any] = {"method": method, "target": _target_facts(target_dir, raw, config, keys),
                              "draft": None}
    if method == "mtp":
        has_mtp, text = _mtp_state(config, keys)
        if not has_mtp:
            problems.append(f"speculative method 'mtp' needs the target's MTP layer: {text}; use "
                            "--speculative-method eagle with a draft")
        if draft_dir is not None:
            problems.append("speculative method 'mtp' drafts with the target's own NextN layer and takes no draft; "
                            "use --speculative-method eagle to check a draft")
    elif draft_dir is not None and (method == "dflash" or read_dflash_config(draft_dir) is not None):
        report["method"] = "dflash"
        report["draft"] = _block_draft_facts(Path(draft_dir), target_dir, config, problems)
    elif draft_dir is not None:
        report["draft"] = _draft_facts(Path(draft_dir), target_dir, config, aux_convention, problems, warnings)
    report.update(problems=problems, warnings=warnings, ok=not problems)
    return report


def format_report(report: dict[str, Any]) -> str:
    lines = []
    for part in ("target", "draft"):
        facts = report.get(part)
        if not facts:
            continue
        lines.append(f"{part}  {facts['path']}")
        lines += [f"  {name:<26} {value}" for name, value in facts.items() if name != "path"]
    for title in ("problems", "warnings"):
        if report[title]:
            lines.append(f"{title}:")
            lines += [f"  - {item}" for item in report[title]]
    if report["method"] == "mtp":
        verdict = "OK: the target's MTP layer can draft"
    else:
        verdict = "OK: the pair fits" if report["draft"] is not None else "OK: target readable (no draft given)"
    lines.append(verdict if report["ok"] else f"MISMATCH: {len(report['problems'])} problem(s)")
    return "\n".join(lines)


def inspect_pair(target_dir: str | Path, draft_dir: str | Path | None = None, method: str = "eagle",
                 aux_convention: str | None = None) -> tuple[str, bool]:
    """A readable report on a target + draft pair (or the target's MTP layer) and whether they fit."""
    report = inspect_report(target_dir, draft_dir, method, aux_convention)
    return format_report(report), report["ok"]


# ---- command line ------------------------------------------------------------------------------------------------

def cmd_inspect(args: argparse.Namespace) -> int:
    try:
        report = inspect_report(args.target, args.draft, args.speculative_method, args.aux_layer_convention)
    except (CheckpointError, ConfigError, ValueError, OSError) as e:
        print(f"eyas inspect: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0 if report["ok"] else 1


def add_cli(subparsers: argparse._SubParsersAction) -> None:
    """Register `eyas inspect`."""
    p = subparsers.add_parser(
        "inspect", help="say whether a target and a draft fit (aux ids, fusion width, vocab, rope, keys)",
        description="Read a target checkpoint (config, headers, embedding and lm_head only) and an EAGLE-3 draft, "
        "and report: the target's depth, widths, MLA dims, rope, MoE, MTP layer and dtype; the draft's "
        "architecture, key layout, aux ids as the file writes them and as hidden_states indices, the convention "
        "assumed and why, fusion width, vocab mapping, rope and own/shared weights. Flags aux ids whose "
        "convention is only a guess (an off-by-one between Model Optimizer's layer outputs and hidden_states). "
        "Exit 0 when the pair fits, 1 on a mismatch, 2 when an input cannot be read.")
    p.add_argument("target", nargs="?", type=Path, default=DEFAULT_MODEL, metavar="TARGET",
                   help="target checkpoint directory (default: the bundled tiny DeepSeek-V3)")
    p.add_argument("draft", nargs="?", type=Path, metavar="DRAFT", help="draft directory: EAGLE-3 (any layout) or "
                   "DFlash (z-lab's layout or the speculators format, detected from its config.json)")
    p.add_argument("--speculative-method", choices=list(METHODS), default="eagle",
                   help="eagle: check DRAFT against TARGET; mtp: check the target's own NextN layer; dflash: check "
                   "DRAFT as a DFlash block draft")
    p.add_argument("--aux-layer-convention", choices=[c.value for c in AuxConvention],
                   help="read the draft's aux ids as hidden_states (vLLM/SGLang/MAX) or layer_output (Model "
                   "Optimizer, one lower); default: detected from the draft's config")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_inspect)
