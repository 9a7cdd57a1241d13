"""Loading models from HF checkpoint directories, each next to the others: the target (`load_model`), its head alone
(`load_target_head`) and an EAGLE-3 draft in any engine's layout (`load_draft`); and `save_model`. Each builds
its model on the meta device and assigns the file's tensors with `eyas.weights.assign_weights`, which names every
missing, unknown or misshapen weight.
"""

from __future__ import annotations

import json
import logging
import re
from functools import partial
from pathlib import Path

import torch
from safetensors.torch import save_file

from eyas.config import ConfigError, DeepseekV3Config, read_config_json
from eyas.models.deepseek_v3 import DeepseekV3ForCausalLM, TargetHead
from eyas.models.dflash import DFlashConfig, DFlashDraft
from eyas.models.eagle3 import (
    SWITCH_WEIGHTS,
    Eagle3Config,
    Eagle3Draft,
    detect_architecture,
    is_speculators_config,
    speculators_to_hf,
    target_ids_of,
)
from eyas.models.layers import Rotary
from eyas.weights import (
    CheckpointError,
    assign_weights,
    dequantize_fp8,
    fp8_block_size,
    load_weights,
    read_safetensors,
    resolve_dtype,
)

log = logging.getLogger("eyas")

# the router runs in float32, as in the reference
FLOAT32_WEIGHTS = ("mlp.gate.weight", "e_score_correction_bias")


# -- the target ---------------------------------------------------------------------------------------------------

def load_model(path: str | Path, dtype: str | torch.dtype | None = "auto",
               device: str | torch.device = "cpu") -> DeepseekV3ForCausalLM:
    """Load a DeepSeek-V3-family target from a HF checkpoint directory."""
    path = Path(path)
    device = torch.device(device)
    dtype = resolve_dtype(dtype, device)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    _refuse_a_draft_as_target(path)
    config = DeepseekV3Config.from_json(path)
    tensors = load_weights(path, dtype)
    L = config.num_hidden_layers
    if config.num_nextn_predict_layers and not any(k.startswith(f"model.layers.{L}.") for k in tensors):
        # transformers writes num_nextn_predict_layers without saving the MTP weights
        log.warning("%s: config.json sets num_nextn_predict_layers=%d but there are no model.layers.%d.* weights; "
                    "loading without the MTP layer", path, config.num_nextn_predict_layers, L)
        config.num_nextn_predict_layers = 0
    # MTP layers share the main embedding and head (DeepSeek stores copies; some exports drop them)
    for i in range(config.num_nextn_predict_layers):
        for own, shared in ((f"model.layers.{L + i}.embed_tokens.weight", "model.embed_tokens.weight"),
                            (f"model.layers.{L + i}.shared_head.head.weight", "lm_head.weight")):
            if own not in tensors and shared in tensors:
                log.info("%s: %s absent, using %s", path, own, shared)
                tensors[own] = tensors[shared]
    for key in tensors:
        if key.endswith(FLOAT32_WEIGHTS):
            tensors[key] = tensors[key].float()
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(config)
    assign_weights(model, tensors, path, device, shared=model.tied_weights)
    model.tie_weights()
    # DeepSeek's MTP layers share the main embedding and head; checkpoints store copies. Sharing the tensors
    # again halves their memory and keeps one head matrix hot in cache when the MTP layer drafts.
    for i in range(config.num_nextn_predict_layers):
        mtp = model.model.mtp_layer(i)
        if torch.equal(mtp.embed_tokens.weight, model.model.embed_tokens.weight):
            mtp.embed_tokens.weight = model.model.embed_tokens.weight
        if torch.equal(mtp.shared_head.head.weight, model.lm_head.weight):
            mtp.shared_head.head.weight = model.lm_head.weight
    model.model.rotary = Rotary(config.rope, config.max_position_embeddings).to(device)
    return model.eval()


def inference_dtype(path: str | Path, dtype: str | torch.dtype | None, device: str | torch.device,
                    compiled_step: bool) -> torch.dtype:
    """The dtype the engine runs the target at `path` (and its draft) in. `auto` is bfloat16 on accelerators and,
    for a checkpoint stored in bfloat16, on CPUs with AMX when the step is compiled: there its frozen bfloat16
    kernels are the faster and round a row alike whatever rows run beside it, where bfloat16 run op by op rounds
    a row by the row count (greedy speculative output could then differ from plain). Float32 otherwise on CPU, as
    for training (`resolve_dtype`)."""
    device = torch.device(device)
    if dtype in (None, "auto") and device.type == "cpu" and compiled_step and cpu_has_amx():
        try:
            raw = read_config_json(Path(path) / "config.json", "a DeepSeek-V3-family checkpoint")
        except ConfigError:
            raw = {}  # load_model says what is wrong with the checkpoint
        if (raw.get("torch_dtype") or raw.get("dtype")) == "bfloat16":
            return torch.bfloat16
    return resolve_dtype(dtype, device)


def cpu_has_amx() -> bool:
    """Whether this CPU has AMX tiles (Intel Xeon from Sapphire Rapids on)."""
    try:
        return bool(torch.cpu._is_amx_tile_supported())
    except (AttributeError, RuntimeError):
        return False


HEAD_WEIGHTS = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")


def load_target_head(path: str | Path, dtype: str | torch.dtype | None = "auto",
                     device: str | torch.device = "cpu") -> TargetHead:
    """A target's `TargetHead` (embedding, final norm, lm_head), no other weight read: for training on hidden
    states a dump or a server provides, on a machine that could not hold the target."""
    path = Path(path)
    device = torch.device(device)
    dtype = resolve_dtype(dtype, device)
    config = DeepseekV3Config.from_json(path)
    raw = json.loads((path / "config.json").read_text())
    names = {*HEAD_WEIGHTS, *(name.removesuffix("weight") + "weight_scale_inv" for name in HEAD_WEIGHTS)}
    tensors = dequantize_fp8(read_safetensors(path, only=names), fp8_block_size(raw) or (128, 128), dtype,
                             source=str(path))
    with torch.device("meta"):
        head = TargetHead(config)
    assign_weights(head, tensors, path, device, shared=head.tied_weights)
    head.tie_weights()
    return head.requires_grad_(False).eval()


def save_model(model, path: str | Path, dtype: torch.dtype = torch.bfloat16, extra_config: dict | None = None) -> None:
    """Write config.json + model.safetensors in the layout `load_model` and transformers read."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = model.config.to_hf()
    config["torch_dtype"] = {torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(dtype, "float32")
    config.update(extra_config or {})
    # copies: tensors shared in memory (MTP embedding and head) are stored once per key, as DeepSeek does
    tensors = {k: v.detach().to(torch.float32 if k.endswith(("mlp.gate.weight", "e_score_correction_bias"))
                                else dtype, copy=True).contiguous()
               for k, v in model.state_dict().items() if not (config["tie_word_embeddings"] and k == "lm_head.weight")}
    tmp = path / "model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.chmod(0o644)
    tmp.replace(path / "model.safetensors")
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")


# -- EAGLE-3 drafts -----------------------------------------------------------------------------------------------

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


def _draft_architecture(raw: dict) -> str | None:
    """The draft architecture a config.json names (EAGLE-3 in any engine's layout, speculators, DFlash), else None."""
    if "speculators_model_type" in raw:
        return f"speculators {raw['speculators_model_type']}"
    names = raw.get("architectures") if isinstance(raw.get("architectures"), list) else []
    return next((str(a) for a in names if re.search(r"eagle|speculator|dflash", str(a), re.IGNORECASE)), None)


def _refuse_a_draft_as_target(path: Path) -> None:
    """A draft directory given where a target belongs is named as such, instead of failing on its missing weights."""
    raw = read_config_json(path / "config.json", "a target checkpoint directory")
    arch = _draft_architecture(raw)
    if arch is not None:
        raise CheckpointError(f"{path} is a draft ({arch}), not a target model: pass it as --draft-model (with "
                              f"--speculative-method eagle) and the target it was trained for as --model; `eyas "
                              f"inspect TARGET {path}` says whether the two fit")


def _refuse_a_mismatched_draft(path: Path, raw: dict, target: DeepseekV3ForCausalLM) -> None:
    """A target given as the draft, or a draft made for another target, is named as such before its weights are
    compared shape by shape."""
    if _draft_architecture(raw) is None and raw.get("num_hidden_layers", 1) != 1:
        names = ", ".join(map(str, raw.get("architectures") or ["no architectures"]))
        raise CheckpointError(f"{path} is a target model ({names}, {raw.get('num_hidden_layers')} layers), not a "
                              "draft: pass it as --model; a draft directory holds one decoder layer (architectures "
                              "such as Eagle3DeepseekV2ForCausalLM or LlamaForCausalLMEagle3)")
    wanted = raw.get("target_hidden_size")  # absent in some exports: the fc shape check below still applies
    if isinstance(wanted, int) and wanted != target.config.hidden_size:
        raise CheckpointError(f"{path}: this draft was made for another target: its config.json has "
                              f"target_hidden_size {wanted}, the target's hidden size is {target.config.hidden_size}; "
                              f"pass the target it was trained for as --model, or `eyas inspect TARGET {path}` to "
                              "compare the two")


def load_dflash_draft(path: str | Path, target: DeepseekV3ForCausalLM) -> DFlashDraft:
    """Load a DFlash block draft for `target`, whose embedding and lm_head it shares: in z-lab's layout (config.json
    with `dflash_config`; weights `fc`, `hidden_norm`, `layers.{i}.*`, `norm`) or the speculators library's
    (`speculators_model_type: dflash`: the same weight names, and copies of the target's embedding and lm_head).
    A compressed vocabulary (`draft_vocab_size`) brings its own `lm_head` and `d2t` (`t2d` optional, derived from
    it), as EAGLE-3 drafts do. Its config is checked against the target; a copy of a shared weight must be the
    target's, and a weight the draft does not take is an error naming it."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such draft directory")
    raw = read_config_json(path / "config.json", "a DFlash draft checkpoint directory")
    config = DFlashConfig.from_hf(raw, target.config, str(path / "config.json"))
    weight = target.lm_head.weight
    stored = read_safetensors(path)
    with torch.device("meta"):
        draft = DFlashDraft(config, target.model.embed_tokens, target.lm_head)
    _drop_shared_copies(stored, target, path, draft.shared_weights)
    _check_vocab_maps(stored, config, path)
    tensors = dequantize_fp8(stored, fp8_block_size(raw) or (128, 128), weight.dtype, source=str(path))
    assign_weights(draft, tensors, path, weight.device, shared=draft.shared_weights)
    draft.rotary = Rotary(config.rope, config.max_position_embeddings).to(weight.device)
    return draft.eval()


def _drop_shared_copies(stored: dict[str, torch.Tensor], target: DeepseekV3ForCausalLM, path: Path,
                        shared: tuple[str, ...]) -> None:
    """Drop the file's copies of the target's weights the draft shares (the speculators format keeps them): each
    must be the target's tensor, up to rounding to the coarser of the two dtypes."""
    targets = {"embed_tokens.weight": target.model.embed_tokens.weight, "lm_head.weight": target.lm_head.weight}
    for key in [k for k in stored if k in shared]:
        copy, own = stored.pop(key), targets[key].detach().cpu()
        if copy.shape != own.shape or not (torch.equal(copy.to(own.dtype), own) or
                                           torch.equal(copy, own.to(copy.dtype))):
            raise CheckpointError(f"{path}: {key!r} differs from the target's; a DFlash draft uses the target's "
                                  "embedding and lm_head (pass the target the draft was made for)")


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
    _refuse_a_mismatched_draft(path, raw, target)
    weight = target.lm_head.weight
    tensors, layouts, fp8 = _draft_tensors(path, raw, weight.dtype)
    kind, arch_name = detect_architecture(raw, "fc.weight" in tensors, source)
    config = Eagle3Config.from_hf(raw, target.config, kind, _num_aux_hidden_states(tensors, target, path),
                                  aux_convention, source)
    _drop_embedding_copy(tensors, target, path)
    lm_head_note = _lm_head_source(tensors, config, target, path)
    d2t_note = _check_vocab_maps(tensors, config, path)
    shared_lm_head = target.lm_head if lm_head_note != "own" else None
    with torch.device("meta"):
        draft = Eagle3Draft(config, target.model.embed_tokens, shared_lm_head)
    shared = set(draft.shared_weights)
    layout = ", ".join(layouts) or "unknown"
    ignored = assign_weights(draft, tensors, path, weight.device, shared=shared, allow_unused=allow_unused_weights,
                             describe_missing=partial(_missing_draft_weights, config, layout, arch_name),
                             describe_unused=partial(_unused_draft_weights, config))
    draft.rotary = Rotary(config.rope, config.max_position_embeddings).to(weight.device)
    draft.load_report = {
        "path": str(path), "layout": layout, "architecture": arch_name, "arch": kind,
        "aux_hidden_state_ids": list(config.aux_hidden_state_ids), "aux_convention": config.aux_convention_assumed,
        "num_aux_hidden_states": config.num_aux_hidden_states, "draft_vocab_size": config.draft_vocab_size,
        "vocab_size": config.vocab_size, "d2t": d2t_note, "lm_head": lm_head_note,
        "own_weights": sorted(k for k in draft.state_dict() if k not in shared), "shared_weights": sorted(shared),
        "ignored_tensors": ignored, "fp8": fp8, "dtype": str(weight.dtype), "switches": config.switches,
        "speculators": speculators,
    }
    return draft.eval()


def _missing_draft_weights(config: Eagle3Config, layout: str, arch_name: str, keys: list[str]) -> str:
    """The missing keys, the layout and architecture the file was read as, and the switches that asked for them."""
    switched = [f"{name} is true in config.json" for name, prefix in SWITCH_WEIGHTS.items()
                if getattr(config, name) and any(k.startswith(prefix) for k in keys)]
    notes = "; ".join([f"layout {layout}, architecture {arch_name}", *switched])
    return f"{', '.join(keys)} ({notes})"


def _unused_draft_weights(config: Eagle3Config, keys: list[str]) -> str:
    return (f"{unused_weights_message(keys, config)}; the draft would compute something other than it was trained "
            "as. Set the switch in config.json, or load it anyway with --allow-unused-draft-weights (the weights are "
            "then ignored)")


def _draft_tensors(path: Path, raw: dict, dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], list[str], bool]:
    """(the file's tensors in `dtype` under canonical names, the layouts its names came in, whether it was FP8)."""
    stored = read_safetensors(path)
    fp8 = any(t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) for t in stored.values())
    tensors: dict[str, torch.Tensor] = {}
    for key, t in dequantize_fp8(stored, fp8_block_size(raw) or (128, 128), dtype, source=str(path)).items():
        name = canonical_key(key)
        if name in tensors:
            raise CheckpointError(f"{path}: keys {key!r} and another both map to {name!r}")
        tensors[name] = t
    layouts = [label for prefix, label in _LAYOUTS if any(k.startswith(prefix) for k in stored)]
    extra_layers = sorted({k.split(".")[1] for k in tensors if k.startswith("layers.") and k.split(".")[1] != "0"})
    if extra_layers:
        raise CheckpointError(f"{path}: weights for decoder layers {extra_layers} beyond layer 0; eyas runs "
                              "one-layer EAGLE-3 drafts")
    return tensors, layouts, fp8


def _num_aux_hidden_states(tensors: dict[str, torch.Tensor], target: DeepseekV3ForCausalLM, path: Path) -> int | None:
    """How many hidden states fc.weight fuses (its input width over the target's hidden size); None without fc."""
    if "fc.weight" not in tensors:
        return None
    H = target.config.hidden_size
    num_aux, rest = divmod(tensors["fc.weight"].shape[-1], H)
    if rest or num_aux not in (2, 3):
        raise CheckpointError(f"{path}: 'fc.weight' has shape {tuple(tensors['fc.weight'].shape)}; expected input "
                              f"width 2 or 3 x the target's hidden_size {H} ({2 * H} or {3 * H}): a draft made for "
                              f"another target? `eyas inspect TARGET {path}` compares the two")
    return num_aux


def _drop_embedding_copy(tensors: dict[str, torch.Tensor], target: DeepseekV3ForCausalLM, path: Path) -> None:
    """The draft always uses the target's embedding: a copy in the file is dropped, with a warning if it differs."""
    if "embed_tokens.weight" not in tensors:
        return
    own = tensors.pop("embed_tokens.weight")
    reference = target.model.embed_tokens.weight.detach().float().cpu()
    # loose tolerance: a bf16 copy of the target's embedding is the same embedding
    if own.shape != reference.shape or not torch.allclose(own.float(), reference, rtol=1e-2, atol=1e-3):
        log.warning("%s: embed_tokens.weight differs from the target's embedding; using the target's (an "
                    "exported random embedding is a known exporter bug)", path)


def _lm_head_source(tensors: dict[str, torch.Tensor], config: Eagle3Config, target: DeepseekV3ForCausalLM,
                    path: Path) -> str:
    """"own", or how the draft comes to share the target's lm_head: the file has none, or an exact copy (dropped)."""
    weight = target.lm_head.weight
    if "lm_head.weight" not in tensors:
        if config.draft_vocab_size != target.config.vocab_size:
            raise CheckpointError(f"{path}: 'lm_head.weight' is missing, so the target's lm_head "
                                  f"({target.config.vocab_size} rows) would be used, but draft_vocab_size is "
                                  f"{config.draft_vocab_size}; expected an lm_head of {config.draft_vocab_size} rows")
        return "shared (absent from the file)"
    if (not config.compressed_vocab and tensors["lm_head.weight"].shape == weight.shape
            and torch.equal(tensors["lm_head.weight"], weight.detach().cpu())):
        del tensors["lm_head.weight"]
        return "shared (the file's copy equals the target's)"
    return "own"


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


def _check_vocab_maps(tensors: dict[str, torch.Tensor], config: Eagle3Config | DFlashConfig, path: Path) -> str:
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
