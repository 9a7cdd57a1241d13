"""Safetensors weights in and out of modules: a checkpoint directory's files (one file or a sharded index), FP8
block-quantized tensors dequantized, and a state dict assigned onto a module built on the meta device with errors
naming every key that is missing, unknown or of the wrong shape. Never pickles. Below the models: the loaders in
eyas.checkpoint build each model and hand its tensors to `assign_weights`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from eyas.config import ConfigError

log = logging.getLogger("eyas")

INDEX_NAME = "model.safetensors.index.json"


class CheckpointError(RuntimeError):
    """A checkpoint eyas cannot load, with the file and key at fault."""


def shard_file(directory: Path, name: object) -> Path | None:
    """`directory / name` where `name` is a plain file name, as a safetensors index or an eyas dump's manifest names
    its shards; None for anything that could name a file outside `directory` (an absolute path, a subdirectory,
    `..`, not a string). Links are the caller's to judge: the HF cache links a model directory's files to blobs
    outside it."""
    if not isinstance(name, str) or name in ("", ".", "..") or Path(name).is_absolute() or Path(name).name != name:
        return None
    return directory / name


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
            if shard_file(path, name) is None:
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


def _names(keys: list[str], limit: int = 10) -> str:
    more = f", ... ({len(keys) - limit} more)" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


def _unknown(keys: list[str]) -> str:
    return f"{_names(keys)} (does config.json match these weights?)"


def assign_weights(module: nn.Module, tensors: dict[str, torch.Tensor], source: str | Path,
                   device: str | torch.device, *, shared: Iterable[str] = (), allow_unused: bool = False,
                   describe_missing: Callable[[list[str]], str] = _names,
                   describe_unused: Callable[[list[str]], str] = _unknown) -> list[str]:
    """Make `tensors` the parameters and buffers of `module` (built on the meta device), by state-dict name; returns
    the names of the tensors no part of the module takes (only with `allow_unused`).

    Every state-dict name but `shared` (tensors the caller ties to another module's afterwards) must be in `tensors`
    with the module's shape. A tensor the module does not take is an error naming it: a model that loads but
    computes something else than the file describes is the worst outcome. `allow_unused` loads it anyway, with a
    warning naming what is ignored. `describe_missing` / `describe_unused` turn the sorted key lists into the
    errors' text."""
    shared = set(shared)
    shapes = {k: tuple(v.shape) for k, v in module.state_dict().items() if k not in shared}
    missing = sorted(shapes.keys() - tensors.keys())
    if missing:
        raise CheckpointError(f"{source}: {len(missing)} weight{'s' * (len(missing) > 1)} missing: "
                              f"{describe_missing(missing)}")
    unused = sorted(tensors.keys() - shapes.keys())
    if unused and not allow_unused:
        raise CheckpointError(f"{source}: {len(unused)} unexpected weight{'s' * (len(unused) > 1)}: "
                              f"{describe_unused(unused)}")
    if unused:
        log.warning("%s: ignoring %d unused tensors (allowed): %s", source, len(unused), ", ".join(unused))
    for key, shape in shapes.items():
        if tuple(tensors[key].shape) != shape:
            raise CheckpointError(f"{source}: weight {key!r} has shape {tuple(tensors[key].shape)}; config.json "
                                  f"implies {shape}")
    # fresh allocations: tensors read from a file can sit at any byte offset, and CPU matmul kernels round
    # differently on unaligned data, so the same checkpoint would give different last bits per load
    module.load_state_dict({k: tensors[k].to(device=device, copy=True) for k in shapes}, strict=False, assign=True)
    return unused
