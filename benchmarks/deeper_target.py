"""The bundled target with its decoder layers repeated until it is --layers deep, written as a checkpoint: a target
whose step costs more against the same draft's, as a real one's does (DeepSeek-V3 runs 61 layers beside an EAGLE-3
draft of one; the bundled target runs 8). What it generates means nothing, so measure the engine on it with
synthetic acceptance, where the draft's proposals do not matter:

    python benchmarks/deeper_target.py /tmp/deeper-32 --layers 32
    python benchmarks/speculative.py --model /tmp/deeper-32 --speculative-method eagle \
        --draft-model examples/tiny-deepseek-v3-eagle3-mla --synthetic-acceptance-rate 0.8 --batch-sizes 1

Layer i of the copy is the bundled layer i for the dense layers (first_k_dense_replace), then the MoE layers in turn;
the multi-token-prediction layer, stored after the decoder layers, moves to the new end. The first run compiles a
kernel for every layer (about 30 s a layer on 2 cores) and keeps them on disk like any other target's.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

from safetensors.torch import save_file

from eyas.paths import DEFAULT_MODEL
from eyas.weights import read_safetensors

LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.(.*)$")


def source_layer(i: int, num_layers: int, dense: int) -> int:
    """The bundled layer that layer i of the deeper copy repeats."""
    return i if i < dense else dense + (i - dense) % (num_layers - dense)


def deepen(source: Path, out: Path, layers: int) -> None:
    config = json.loads((source / "config.json").read_text())
    num_layers, dense = config["num_hidden_layers"], config.get("first_k_dense_replace", 0)
    if layers < num_layers:
        raise SystemExit(f"--layers {layers}: the target at {source} already has {num_layers}")
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"{out} is not empty; pass a new directory")
    tensors, by_layer = {}, {}
    for key, tensor in read_safetensors(source).items():
        match = LAYER_KEY.match(key)
        if match is None:
            tensors[key] = tensor
        else:
            by_layer.setdefault(int(match[1]), {})[match[2]] = tensor
    for i in range(layers):
        for name, tensor in by_layer[source_layer(i, num_layers, dense)].items():
            tensors[f"model.layers.{i}.{name}"] = tensor.clone()
    for j in range(num_layers, max(by_layer) + 1):  # the multi-token-prediction layers follow the decoder layers
        for name, tensor in by_layer[j].items():
            tensors[f"model.layers.{layers + j - num_layers}.{name}"] = tensor
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers}, indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (source / name).is_file():
            shutil.copy(source / name, out / name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, help="a new directory for the deeper checkpoint")
    ap.add_argument("--layers", type=int, default=32, help="decoder layers of the copy (default 32)")
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="the target to deepen (default: the bundled one)")
    args = ap.parse_args()
    deepen(args.model, args.out, args.layers)
    print(f"wrote {args.out}: {args.layers} decoder layers")


if __name__ == "__main__":
    main()
