"""The target's hidden states for EAGLE-3 training: captured in memory (online training) or dumped to sharded
safetensors and read back lazily (offline training).

Every aux id here is a HF ``hidden_states`` index (eyas.aux_layers): id i is the input of decoder layer i, id L the
last layer's output before the final norm. ``last_hidden`` is id L, so the target's distribution at each position is
``target.compute_logits(target.model.norm(last_hidden))`` — stored pre-norm, as the draft's own outputs are.

Dump layout (``OUT_DIR``):
    manifest.json                  what was dumped from what; rewritten after every shard
    shard-00000.safetensors ...    examples [k * examples_per_shard, (k + 1) * examples_per_shard), concatenated:
        input_ids [N] int64, loss_mask [N] uint8, offsets [num_examples + 1] int64 (example j is rows
        offsets[j]:offsets[j + 1]), aux_hidden_states [N, n_aux, H], last_hidden [N, H]
A dump is resumable: shards are written to a temporary name and renamed, and the manifest lists only shards that
are complete, so a rerun after a crash writes the missing ones. `eyas import-hidden-states` (eyas.train.import_dumps)
writes the same layout from other tools' dumps through `write_shards`; a dump whose last hidden state is already
past the final norm says so in its manifest (``last_hidden_post_norm``), and the trainer then skips the norm.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from eyas.train.data import Example
from eyas.weights import shard_file

if TYPE_CHECKING:
    from eyas.config import DeepseekV3Config
    from eyas.models.deepseek_v3 import DeepseekV3ForCausalLM

log = logging.getLogger("eyas")

FORMAT = "eyas-hidden-states"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
MANIFEST_KEYS = ("target", "aux_hidden_state_ids", "hidden_size", "dtype", "examples_per_shard", "num_examples",
                 "num_shards", "shards", "complete")
SHARD_KEYS = ("input_ids", "loss_mask", "offsets", "aux_hidden_states", "last_hidden")


class HiddenStateError(ValueError):
    """A dump eyas cannot write or read, naming the file at fault."""


def capture_hidden_states(target: DeepseekV3ForCausalLM, input_ids: torch.Tensor,
                          aux_hidden_state_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(aux [B, T, n_aux, H] in the order of `aux_hidden_state_ids`, last_hidden [B, T, H] = hidden_states id L,
    before the final norm) for input_ids [B, T]. The target is only read: no gradients."""
    L = target.config.num_hidden_layers
    ids = tuple(int(i) for i in aux_hidden_state_ids)
    if not ids:
        raise ValueError("no aux hidden state ids given")
    bad = [i for i in ids if not 0 <= i <= L]
    if bad:
        raise ValueError(f"aux hidden state ids {bad} are outside a {L}-layer target (hidden_states indices run "
                         f"0..{L})")
    with torch.no_grad():
        _, captured = target.model(input_ids, aux_hidden_state_ids=ids + (L,))
    return torch.stack(captured[:-1], dim=-2), captured[-1]


# -- writing -----------------------------------------------------------------------------------------------------

def target_fingerprint(config: DeepseekV3Config, target_path: str | Path | None) -> str:
    """sha256 of the target's config.json; of its config as eyas writes it when no directory is known."""
    if target_path is not None and (Path(target_path) / "config.json").is_file():
        return "sha256:" + hashlib.sha256((Path(target_path) / "config.json").read_bytes()).hexdigest()
    canonical = json.dumps(config.to_hf(), sort_keys=True).encode()
    return "sha256-config:" + hashlib.sha256(canonical).hexdigest()


def data_fingerprint(examples: Sequence[Example]) -> str:
    """sha256 over every example's ids and mask: a resumed dump must continue the same data."""
    h = hashlib.sha256()
    for ex in examples:
        h.update(np.int64(len(ex.input_ids)).tobytes())
        h.update(np.asarray(ex.input_ids, dtype=np.int64).tobytes())
        h.update(np.asarray(ex.loss_mask, dtype=np.uint8).tobytes())
    return "sha256:" + h.hexdigest()


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    tmp.replace(path)


def rank_manifest_name(rank: int, world_size: int) -> str:
    """The manifest of one rank's part of a dump split over `world_size` processes (`--world-size/--rank`)."""
    return f"manifest.rank-{rank:05d}-of-{world_size:05d}.json"


def read_manifest(directory: str | Path, name: str = MANIFEST) -> dict:
    path = Path(directory) / name
    if not path.is_file():
        parts = sorted(p.name for p in Path(directory).glob("manifest.rank-*.json"))
        if name == MANIFEST and parts:
            raise HiddenStateError(f"{path}: no manifest yet: the dump is split over ranks and not every rank has "
                                   f"finished (written: {', '.join(parts)}); rerun the missing ranks")
        raise HiddenStateError(f"{path}: no manifest; is {directory} a directory written by dump-hidden-states?")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise HiddenStateError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise HiddenStateError(f"{path}: field 'format' is not {FORMAT!r}; not an eyas hidden-state dump")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise HiddenStateError(f"{path}: format_version {manifest.get('format_version')!r}; this eyas reads "
                               f"version {FORMAT_VERSION}")
    missing = [key for key in MANIFEST_KEYS if key not in manifest]
    if missing:
        raise HiddenStateError(f"{path}: missing fields {missing}")
    if not isinstance(manifest["shards"], list):
        raise HiddenStateError(f"{path}: field 'shards' is not a list")
    for i, shard in enumerate(manifest["shards"]):  # confined as a safetensors index's shard names are
        if not isinstance(shard, dict) or shard_file(path.parent, shard.get("file")) is None:
            name = shard.get("file") if isinstance(shard, dict) else shard
            raise HiddenStateError(f"{path}: shards[{i}] names {name!r}; expected the file name of a shard in "
                                   f"{path.parent}")
    return manifest


# fields a resumed dump must share with the one it continues: any difference would mix two datasets in one dump.
# `source` is what an imported dump was converted from (absent in dump-hidden-states' own).
RESUME_FIELDS = ("target_fingerprint", "aux_hidden_state_ids", "num_examples", "data_fingerprint", "dtype",
                 "examples_per_shard", "hidden_size", "last_hidden_post_norm", "source")
# what a manifest written before a field existed meant by leaving it out
FIELD_DEFAULTS = {"last_hidden_post_norm": False}


def _check_resumable(old: dict, new: dict, path: Path) -> None:
    def value(manifest: dict, key: str):
        if key == "target_fingerprint":
            return manifest["target"].get("fingerprint")
        return manifest.get(key, FIELD_DEFAULTS.get(key))

    for key in RESUME_FIELDS:
        old_value, new_value = value(old, key), value(new, key)
        if old_value != new_value:
            raise HiddenStateError(f"{path}: this directory holds a dump with {key} = {old_value!r}, this run has "
                                   f"{new_value!r}; refusing to mix them (use another OUT_DIR, or delete it)")


def _shard_tensors(target, examples: Sequence[Example], aux_ids: tuple[int, ...], dtype: torch.dtype,
                   batch_size: int, progress: tqdm) -> dict[str, torch.Tensor]:
    """The concatenated tensors of one shard. Examples run in batches of similar length, right-padded: attention
    is causal, so padding after a sequence never changes its real positions."""
    device = target.lm_head.weight.device
    aux_rows: list[torch.Tensor | None] = [None] * len(examples)
    last_rows: list[torch.Tensor | None] = [None] * len(examples)
    by_length = sorted(range(len(examples)), key=lambda j: (-len(examples[j].input_ids), j))
    for b in range(0, len(by_length), batch_size):
        batch = by_length[b:b + batch_size]
        T = len(examples[batch[0]].input_ids)
        ids = torch.zeros(len(batch), T, dtype=torch.int64)
        for row, j in enumerate(batch):
            ids[row, :len(examples[j].input_ids)] = torch.tensor(examples[j].input_ids, dtype=torch.int64)
        aux, last = capture_hidden_states(target, ids.to(device), aux_ids)  # [b, T, n_aux, H], [b, T, H]
        for row, j in enumerate(batch):
            n = len(examples[j].input_ids)
            aux_rows[j] = aux[row, :n].to(device="cpu", dtype=dtype)
            last_rows[j] = last[row, :n].to(device="cpu", dtype=dtype)
            progress.update(n)
    return pack_shard(examples, aux_rows, last_rows)


def pack_shard(examples: Sequence[Example], aux_rows: Sequence[torch.Tensor],
               last_rows: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    """One shard's tensors from its examples and each example's aux [T, n_aux, H] and last hidden [T, H] rows."""
    lengths = torch.tensor([len(ex.input_ids) for ex in examples], dtype=torch.int64)
    return {
        "input_ids": torch.tensor([t for ex in examples for t in ex.input_ids], dtype=torch.int64),
        "loss_mask": torch.tensor([m for ex in examples for m in ex.loss_mask], dtype=torch.uint8),
        "offsets": torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]),
        "aux_hidden_states": torch.cat(aux_rows).contiguous(),
        "last_hidden": torch.cat(last_rows).contiguous(),
    }


def dump_hidden_states(target: DeepseekV3ForCausalLM, examples: Sequence[Example], out_dir: str | Path,
                       aux_hidden_state_ids: Sequence[int], examples_per_shard: int = 128,
                       dtype: torch.dtype = torch.bfloat16, batch_size: int = 8,
                       target_path: str | Path | None = None, max_shards: int | None = None, rank: int = 0,
                       world_size: int = 1) -> dict:
    """Write the target's aux and last hidden states for `examples` as shards in `out_dir`; returns the manifest
    (with `world_size` > 1, this rank's share of the shards: see `write_shards`).

    Resumable: shards already listed complete in `out_dir`'s manifest are kept; a manifest from another target,
    other aux ids, other data or other shard settings is refused. `max_shards` stops after writing that many
    shards (to split a long dump over several runs). Aux ids are fused in ascending layer order, as every
    engine captures them.
    """
    config = target.config
    if batch_size < 1:
        raise ValueError(f"batch_size ({batch_size}) must be positive")
    aux_ids, dtype_name = check_dump(config, examples, aux_hidden_state_ids, examples_per_shard, dtype)
    manifest = new_manifest(config, target_path, examples, aux_ids, dtype_name, examples_per_shard)

    def shard(first: int, last: int, progress: tqdm) -> dict[str, torch.Tensor]:
        return _shard_tensors(target, examples[first:last], aux_ids, dtype, batch_size, progress)

    return write_shards(out_dir, manifest, shard, max_shards, rank, world_size)


def check_dump(config: DeepseekV3Config, examples: Sequence[Example], aux_hidden_state_ids: Sequence[int],
               examples_per_shard: int, dtype: torch.dtype) -> tuple[tuple[int, ...], str]:
    """(the aux ids ascending, the dtype's name) of a dump about to be written; a ValueError naming what is wrong."""
    aux_ids = tuple(sorted(int(i) for i in aux_hidden_state_ids))
    if len(set(aux_ids)) != len(aux_ids) or not aux_ids:
        raise ValueError(f"aux hidden state ids {list(aux_hidden_state_ids)} must be distinct and non-empty")
    if examples_per_shard < 1:
        raise ValueError(f"examples_per_shard ({examples_per_shard}) must be positive")
    dtype_name = next((name for name, d in DTYPES.items() if d == dtype), None)
    if dtype_name is None:
        raise ValueError(f"dtype {dtype} is not one of {sorted(DTYPES)}")
    if not examples:
        raise ValueError("no examples to dump")
    for n, ex in enumerate(examples):
        if not 0 < len(ex.input_ids) <= config.max_position_embeddings:
            raise ValueError(f"example {n} has {len(ex.input_ids)} tokens; the target takes 1.."
                             f"{config.max_position_embeddings} (max_position_embeddings)")
        if len(ex.loss_mask) != len(ex.input_ids):
            raise ValueError(f"example {n}: loss_mask has {len(ex.loss_mask)} entries for {len(ex.input_ids)} tokens")
    return aux_ids, dtype_name


def new_manifest(config: DeepseekV3Config, target_path: str | Path | None, examples: Sequence[Example],
                 aux_ids: tuple[int, ...], dtype_name: str, examples_per_shard: int,
                 last_hidden_post_norm: bool = False) -> dict:
    """The manifest of a dump of `examples` that has no shard yet."""
    L = config.num_hidden_layers
    note = ("the last layer's output after the final norm; logits = lm_head(last_hidden)" if last_hidden_post_norm
            else "pre-final-norm output of the last layer; logits = lm_head(norm(last_hidden))")
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION,
        "target": {"path": str(target_path) if target_path is not None else None,
                   "fingerprint": target_fingerprint(config, target_path)},
        "aux_hidden_state_ids": list(aux_ids), "aux_convention": "hidden_states",
        "last_hidden_state_id": L, "last_hidden_post_norm": last_hidden_post_norm, "last_hidden_note": note,
        "num_hidden_layers": L, "hidden_size": config.hidden_size, "vocab_size": config.vocab_size,
        "dtype": dtype_name, "examples_per_shard": examples_per_shard,
        "num_examples": len(examples), "total_tokens": sum(len(ex.input_ids) for ex in examples),
        "total_loss_tokens": sum(ex.num_loss_tokens for ex in examples),
        "data_fingerprint": data_fingerprint(examples),
        "num_shards": math.ceil(len(examples) / examples_per_shard),
        "shards": [], "complete": False,
    }


def write_shards(out_dir: str | Path, manifest: dict,
                 shard_tensors: Callable[[int, int, tqdm], dict[str, torch.Tensor]],
                 max_shards: int | None = None, rank: int = 0, world_size: int = 1) -> dict:
    """Write the shards `manifest` (from `new_manifest`, maybe with more fields) describes into `out_dir`; returns
    the manifest as written. Shard k holds examples [first, last) and is `shard_tensors(first, last, progress)`.

    Resumable: shards already listed complete in `out_dir`'s manifest are kept; a manifest that differs in a
    RESUME_FIELDS field is refused. `max_shards` stops after writing that many shards. Split over `world_size`
    processes (machines sharing `out_dir`), rank r writes the shards k with k % world_size == r and its own
    manifest (`rank_manifest_name`); whichever rank finds every part complete writes the dump's manifest."""
    out_dir = Path(out_dir)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in 0..{world_size - 1} (world size {world_size})")
    num_shards, per_shard, num_examples = (manifest["num_shards"], manifest["examples_per_shard"],
                                           manifest["num_examples"])
    manifest_path = out_dir / (MANIFEST if world_size == 1 else rank_manifest_name(rank, world_size))
    mine = [k for k in range(num_shards) if k % world_size == rank]
    done = _shards_done(out_dir, manifest_path, manifest, world_size)
    if done:
        log.warning("%s: resuming a dump, %d of %d shards already written", out_dir, len(done), len(mine))
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest["shards"] = sorted(done.values(), key=lambda s: s["first_example"])
    manifest["complete"] = len(done) == len(mine)
    _write_json(manifest_path, manifest)

    todo = [k for k in mine if shard_name(k) not in done][:max_shards]
    tokens_done = sum(s["num_tokens"] for s in done.values())
    tokens_mine = manifest["total_tokens"] * len(mine) // num_shards  # about, for the progress bar
    with tqdm(total=tokens_mine, initial=tokens_done, unit="tok", desc="hidden states") as progress:
        for k in todo:
            first, last = k * per_shard, min(num_examples, (k + 1) * per_shard)
            shard = _save_shard(out_dir / shard_name(k), shard_tensors(first, last, progress), first, last)
            manifest["shards"] = sorted([*manifest["shards"], shard], key=lambda s: s["first_example"])
            manifest["complete"] = len(manifest["shards"]) == len(mine)
            _write_json(manifest_path, manifest)
    if world_size > 1 and manifest["complete"]:
        return _merge_ranks(out_dir, manifest, world_size)
    return manifest


def shard_name(k: int) -> str:
    return f"shard-{k:05d}.safetensors"


def _shards_done(out_dir: Path, manifest_path: Path, manifest: dict, world_size: int) -> dict[str, dict]:
    """{file name: manifest entry} of the shards an earlier run of this same dump completed in `out_dir`; a
    directory holding another dump, or shards with no manifest, is refused."""
    if manifest_path.exists():
        old = read_manifest(out_dir, manifest_path.name)
        _check_resumable(old, manifest, manifest_path)
        # a shard counts when its file is there whole: a rename after the write, the size the manifest recorded
        return {s["file"]: s for s in old.get("shards", [])
                if (out_dir / s["file"]).is_file() and (out_dir / s["file"]).stat().st_size == s["bytes"]}
    if world_size == 1 and out_dir.is_dir() and any(out_dir.glob("shard-*.safetensors")):
        raise HiddenStateError(f"{out_dir}: holds shard files but no {MANIFEST}; refusing to overwrite them "
                               "(use another OUT_DIR, or delete it)")
    return {}


def _save_shard(path: Path, tensors: dict[str, torch.Tensor], first: int, last: int) -> dict:
    """Write one shard atomically (a temporary name, then a rename); returns its manifest entry."""
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.chmod(0o644)  # safetensors creates files owner-only
    tmp.replace(path)
    return {"file": path.name, "first_example": first, "num_examples": last - first,
            "num_tokens": int(tensors["input_ids"].shape[0]), "bytes": path.stat().st_size}


def _merge_ranks(out_dir: Path, manifest: dict, world_size: int) -> dict:
    """The dump's manifest from its ranks' parts once all are complete (else this rank's part, unchanged)."""
    parts = []
    for r in range(world_size):
        path = out_dir / rank_manifest_name(r, world_size)
        if not path.is_file():
            return manifest
        part = read_manifest(out_dir, path.name)
        _check_resumable(manifest, part, path)
        if not part["complete"]:
            return manifest
        parts.append(part)
    merged = {**manifest, "shards": sorted((s for p in parts for s in p["shards"]), key=lambda s: s["first_example"])}
    merged["complete"] = len(merged["shards"]) == manifest["num_shards"]
    _write_json(out_dir / MANIFEST, merged)
    return merged


# -- reading -----------------------------------------------------------------------------------------------------

class HiddenStateShards:
    """The examples of a dump, read lazily: a shard is opened (memory-mapped) when one of its examples is first
    asked for, and at most `max_open` shards stay open. Item i is a dict of input_ids LongTensor [T], loss_mask
    FloatTensor [T], aux_hidden_states [T, n_aux, H] and last_hidden [T, H] (in the dump's dtype).
    `last_hidden_post_norm` says whether last_hidden is already past the target's final norm (an imported dump
    whose tool stored it so) or before it (eyas's own dumps)."""

    def __init__(self, directory: str | Path, max_open: int = 2) -> None:
        self.directory = Path(directory)
        self.manifest = read_manifest(self.directory)
        m = self.manifest
        if not m.get("complete"):
            raise HiddenStateError(f"{self.directory / MANIFEST}: the dump is incomplete ({len(m['shards'])} of "
                                   f"{m['num_shards']} shards); rerun dump-hidden-states with the same arguments "
                                   "to finish it")
        self.shards = sorted(m["shards"], key=lambda s: s["first_example"])
        expected = 0
        for s in self.shards:  # the shards must tile 0..num_examples with no gap or overlap
            if s["first_example"] != expected:
                raise HiddenStateError(f"{self.directory / MANIFEST}: shard {s['file']} starts at example "
                                       f"{s['first_example']}, expected {expected}")
            expected += s["num_examples"]
        if expected != m["num_examples"]:
            raise HiddenStateError(f"{self.directory / MANIFEST}: shards hold {expected} examples, num_examples is "
                                   f"{m['num_examples']}")
        self.last_hidden_post_norm = m.get("last_hidden_post_norm", FIELD_DEFAULTS["last_hidden_post_norm"])
        if not isinstance(self.last_hidden_post_norm, bool):
            raise HiddenStateError(f"{self.directory / MANIFEST}: field 'last_hidden_post_norm' is "
                                   f"{self.last_hidden_post_norm!r}; expected true or false")
        self._starts = [s["first_example"] for s in self.shards]
        self.max_open = max(1, max_open)
        self._open: OrderedDict[int, tuple] = OrderedDict()  # shard index -> (safe_open handle, offsets list)

    def __len__(self) -> int:
        return self.manifest["num_examples"]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"example {i} out of range for a dump of {n} examples")
        k = bisect.bisect_right(self._starts, i) - 1
        f, offsets = self._shard(k)
        j = i - self.shards[k]["first_example"]
        a, b = offsets[j], offsets[j + 1]
        return {
            "input_ids": f.get_slice("input_ids")[a:b].long(),
            "loss_mask": f.get_slice("loss_mask")[a:b].float(),
            "aux_hidden_states": f.get_slice("aux_hidden_states")[a:b],
            "last_hidden": f.get_slice("last_hidden")[a:b],
        }

    def _shard(self, k: int) -> tuple:
        if k in self._open:
            self._open.move_to_end(k)
            return self._open[k]
        shard = self.shards[k]
        path = self.directory / shard["file"]
        if not path.is_file():
            raise HiddenStateError(f"{path}: shard listed in {MANIFEST} is missing; rerun dump-hidden-states")
        try:
            f = safe_open(str(path), framework="pt")
            keys = set(f.keys())
        except Exception as e:  # safetensors raises its own error types for truncated or corrupt files
            raise HiddenStateError(f"{path}: cannot read safetensors ({type(e).__name__}: {e}); the shard may be "
                                   "truncated or corrupt, delete it and rerun dump-hidden-states") from e
        missing = [key for key in SHARD_KEYS if key not in keys]
        if missing:
            raise HiddenStateError(f"{path}: missing tensors {missing}")
        offsets = f.get_tensor("offsets").tolist()
        m = self.manifest
        aux_shape = f.get_slice("aux_hidden_states").get_shape()
        expected = [shard["num_tokens"], len(m["aux_hidden_state_ids"]), m["hidden_size"]]
        if len(offsets) != shard["num_examples"] + 1 or offsets[-1] != shard["num_tokens"] or aux_shape != expected:
            raise HiddenStateError(f"{path}: holds {len(offsets) - 1} examples, {offsets[-1]} tokens, aux states "
                                   f"{aux_shape}; {MANIFEST} says {shard['num_examples']} examples, aux states "
                                   f"{expected}")
        self._open[k] = (f, offsets)
        if len(self._open) > self.max_open:
            self._open.popitem(last=False)
        return self._open[k]

    def token_examples(self) -> list[Example]:
        """Every example's token ids and loss mask, read shard by shard without the hidden states."""
        examples = []
        for k in range(len(self.shards)):
            f, offsets = self._shard(k)
            ids, mask = f.get_tensor("input_ids").tolist(), f.get_tensor("loss_mask").int().tolist()
            examples += [Example(ids[a:b], mask[a:b]) for a, b in zip(offsets, offsets[1:])]
        return examples

    def __getstate__(self) -> dict:
        # open safetensors handles cannot be pickled (DataLoader workers): each copy reopens what it reads
        state = self.__dict__.copy()
        state["_open"] = OrderedDict()
        return state
