"""Reading HF safetensors checkpoints: single file or sharded index, FP8 block-quantized weights. Never pickles."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eyas.config import ConfigError, DeepseekV3Config

log = logging.getLogger("eyas")

INDEX_NAME = "model.safetensors.index.json"


class CheckpointError(RuntimeError):
    """A checkpoint eyas cannot load, with the file and key at fault."""


def checkpoint_files(path: Path) -> list[Path]:
    if not path.exists():
        raise CheckpointError(f"{path}: no such directory")
    if not path.is_dir():
        raise CheckpointError(f"{path}: expected a checkpoint directory, got a file")
    index = path / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError, RecursionError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{index}: not a safetensors index (need a 'weight_map' object of key -> file "
                                  f"name): {type(e).__name__}") from e
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index}: 'weight_map' must map tensor names to shard file names")
        for name in set(weight_map.values()):
            # a shard is a file in this directory: nothing the index names may lie outside it
            if Path(name).is_absolute() or Path(name).name != name or name in (".", ".."):
                raise CheckpointError(f"{index}: shard file name {name!r} is not a file name in {path}; refusing "
                                      "to read outside the model directory")
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index} names shards that do not exist: {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
        hint = f" (found {', '.join(pickles)}: pickle files are never loaded; convert to safetensors)" if pickles \
            else ""
        raise CheckpointError(f"{path}: no *.safetensors files{hint}")
    return files


def read_safetensors(path: str | Path, only: set[str] | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory (or those named in `only`), as stored (FP8 stays FP8)."""
    tensors: dict[str, torch.Tensor] = {}
    for file in checkpoint_files(Path(path)):
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    if key in tensors:
                        raise CheckpointError(f"{file}: key {key!r} also appears in another shard")
                    if only is None or key in only:
                        tensors[key] = f.get_tensor(key)
        except CheckpointError:
            raise
        except Exception as e:  # safetensors raises its own error types for truncated or corrupt files
            raise CheckpointError(f"{file}: cannot read safetensors ({type(e).__name__}: {e}); "
                                  "the file may be truncated or corrupt") from e
    return tensors


def dequantize_fp8(tensors: dict[str, torch.Tensor], block_size: tuple[int, int], dtype: torch.dtype,
                   source: str = "checkpoint") -> dict[str, torch.Tensor]:
    """Replace each float8 `weight` and its `weight_scale_inv` (one float32 scale per block) by value x scale."""
    out = {}
    for key, t in tensors.items():
        if key.endswith(".weight_scale_inv"):
            continue
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            scale_key = key + "_scale_inv" if key.endswith(".weight") else key + ".weight_scale_inv"
            if scale_key not in tensors:
                raise CheckpointError(f"{source}: FP8 tensor {key!r} has no {scale_key!r}")
            scale = tensors[scale_key].float()
            rows, cols = t.shape
            br, bc = block_size
            expected = (-(-rows // br), -(-cols // bc))
            if tuple(scale.shape) != expected:
                raise CheckpointError(f"{source}: {scale_key!r} has shape {tuple(scale.shape)}; expected {expected} "
                                      f"for a {rows}x{cols} weight in {br}x{bc} blocks")
            full = scale.repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]
            t = (t.float() * full).to(dtype)
        elif t.is_floating_point():
            t = t.to(dtype)
        out[key] = t
    return out


def fp8_block_size(raw_config: dict) -> tuple[int, int] | None:
    q = raw_config.get("quantization_config")
    if not q:
        return None
    if q.get("quant_method") != "fp8":
        raise ConfigError(f"quantization_config.quant_method is {q.get('quant_method')!r}; expected 'fp8' "
                          "(block-quantized e4m3 as DeepSeek ships it) or no quantization_config")
    block = q.get("weight_block_size", [128, 128])
    return int(block[0]), int(block[1])


def load_weights(path: str | Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint in `dtype`, FP8 blocks dequantized."""
    path = Path(path)
    raw = json.loads((path / "config.json").read_text()) if (path / "config.json").is_file() else {}
    tensors = read_safetensors(path)
    block = fp8_block_size(raw) or (128, 128)
    return dequantize_fp8(tensors, block, dtype, source=str(path))


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """`auto` is float32 on CPU (fast and exact there) and bfloat16 on accelerators."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if dtype not in names:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(names)} or 'auto'")
    return names[dtype]


def load_model(path: str | Path, dtype: str | torch.dtype | None = "auto", device: str | torch.device = "cpu"):
    """Load a DeepSeek-V3-family target from a HF checkpoint directory."""
    from eyas.models.deepseek_v3 import DeepseekV3ForCausalLM
    from eyas.models.layers import Rotary

    path = Path(path)
    device = torch.device(device)
    dtype = resolve_dtype(dtype, device)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    config = DeepseekV3Config.from_json(path)
    tensors = load_weights(path, dtype)
    L = config.num_hidden_layers
    if config.num_nextn_predict_layers and not any(k.startswith(f"model.layers.{L}.") for k in tensors):
        # transformers writes num_nextn_predict_layers without saving the MTP weights
        log.warning("%s: config.json sets num_nextn_predict_layers=%d but there are no model.layers.%d.* weights; "
                    "loading without the MTP layer", path, config.num_nextn_predict_layers, L)
        config.num_nextn_predict_layers = 0
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(config)
    expected = set(model.state_dict().keys())
    # MTP layers share the main embedding and head (DeepSeek stores copies; some exports drop them)
    for i in range(config.num_nextn_predict_layers):
        for own, shared in ((f"model.layers.{L + i}.embed_tokens.weight", "model.embed_tokens.weight"),
                            (f"model.layers.{L + i}.shared_head.head.weight", "lm_head.weight")):
            if own not in tensors and shared in tensors:
                log.info("%s: %s absent, using %s", path, own, shared)
                tensors[own] = tensors[shared]
    if config.tie_word_embeddings:
        expected.discard("lm_head.weight")
    missing = sorted(expected - tensors.keys())
    if missing:
        raise CheckpointError(f"{path}: {len(missing)} weights missing, e.g. {', '.join(missing[:5])}")
    unexpected = sorted(tensors.keys() - expected)
    if unexpected:
        raise CheckpointError(f"{path}: {len(unexpected)} unexpected weights, e.g. {', '.join(unexpected[:5])} "
                              f"(does config.json match these weights?)")
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    for key in expected:
        if tuple(tensors[key].shape) != tuple(shapes[key]):
            raise CheckpointError(f"{path}: weight {key!r} has shape {tuple(tensors[key].shape)}; config.json "
                                  f"implies {tuple(shapes[key])}")
    # the router runs in float32, as in the reference
    for key in expected:
        if key.endswith("mlp.gate.weight") or key.endswith("e_score_correction_bias"):
            tensors[key] = tensors[key].float()
    # fresh allocations: tensors read from a file can sit at any byte offset, and CPU matmul kernels round
    # differently on unaligned data, so the same checkpoint would give different last bits per load
    model.load_state_dict({k: tensors[k].to(device=device, copy=True) for k in expected}, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
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


HEAD_WEIGHTS = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")


def load_target_head(path: str | Path, dtype: str | torch.dtype | None = "auto", device: str | torch.device = "cpu"):
    """A target's `TargetHead` (embedding, final norm, lm_head), no other weight read: for training on hidden
    states a dump or a server provides, on a machine that could not hold the target."""
    from eyas.models.deepseek_v3 import TargetHead

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
    shapes = {k: tuple(v.shape) for k, v in head.state_dict().items()}
    expected = [k for k in HEAD_WEIGHTS if not (config.tie_word_embeddings and k == "lm_head.weight")]
    for key in expected:
        if key not in tensors:
            raise CheckpointError(f"{path}: weight {key!r} is missing")
        if tuple(tensors[key].shape) != shapes[key]:
            raise CheckpointError(f"{path}: weight {key!r} has shape {tuple(tensors[key].shape)}; config.json "
                                  f"implies {shapes[key]}")
    head.load_state_dict({k: tensors[k].to(device=device, copy=True) for k in expected}, strict=False, assign=True)
    if config.tie_word_embeddings:
        head.lm_head.weight = head.model.embed_tokens.weight
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
