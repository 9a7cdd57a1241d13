"""`eyas import-hidden-states`: hidden-state dumps other tools already wrote, converted into eyas's own dump (the
shards and manifest.json of eyas.train.hidden_states), so `eyas train --hidden-states` trains on them unchanged.

What each tool writes, one file per sequence (read from their sources; T tokens, hidden size H, n aux states):

  vllm       vLLM's `extract_hidden_states` method with ExampleHiddenStatesConnector: <request id>.safetensors with
             hidden_states [T, n_ids, H] (one slot per id of eagle_aux_hidden_state_layer_ids, in the order given;
             id L is the last layer's output before the final norm) and token_ids [T]. There is no loss mask and
             nothing naming the record: each file is matched to a record of --data by its token ids and takes
             that record's loss mask.
  modelopt   Model Optimizer's collect_hidden_states: <conversation id>.pt, a torch.save of {input_ids [T],
             hidden_states [T, H], aux_hidden_states [T, n*H], loss_mask [T], conversation_id}. Its HF dumper
             stores HF's hidden_states[-1], which is after the final norm (so does its TRT-LLM one, by its own
             account); its vLLM dumper stores vLLM's id L, before it. The files do not say which: --last-hidden
             does. Its ids are 0-based layer outputs, but its HF dumpers index HF hidden_states with them (older
             ones) or with them + 1 (newer), and its vLLM dumper hands them to vLLM as they are, so the convention
             is asked for too.
  specforge  SpecForge's prepare_hidden_states: rows_a-b/data_{i}.ckpt (or .ckpt.gz), a torch.save of {input_ids
             [T'], loss_mask [T'], hidden_state [1, T, H], aux_hidden_state [1, T, n*H]}. hidden_state is what
             SGLang (or HF) hands the lm_head, after the final norm (SpecForge's offline trainer applies lm_head
             alone to it). Its aux ids are layer outputs (SGLang and its HF backend both capture id + 1). Its
             batched dumper saves input_ids and loss_mask padded to the batch's longest row, so T' >= T.

Both torch formats concatenate the aux states in ascending layer order, as SGLang, HF and vLLM capture them.
eyas stores the aux states in ascending hidden_states ids whatever order a file holds them in. A last hidden state
after the final norm is stored as it is and the manifest says so (`last_hidden_post_norm`): a norm cannot be undone,
and the trainer then feeds it to the head without norming it again. Every file is checked against that claim: a
normed state divided by the norm's weight has an RMS of 1 in every row, one before the norm does not.

Pickles are loaded only with torch.load(weights_only=True): a file holding anything but tensors (and the few
metadata strings or numbers its tool writes) is refused. A first pass reads every file's token ids, loss mask and
shapes (memory-mapped: the states are not read), so a bad file is named before any shard is written; .ckpt.gz files
are decompressed in both passes.

The files may come from anywhere, so nothing in one is trusted to be small: a file (or a .gz stream, as it
decompresses) larger than `max_file_bytes` of the target is refused unread, as is a zip record declaring more, or
compressed; a tensor that claims more elements than its storage holds (a stride-0 or overlapping view) is refused
before anything copies it; and only files inside SRC are read (no link leading out).
"""

from __future__ import annotations

import argparse
import fcntl
import gzip
import hashlib
import io
import logging
import math
import pickle
import re
import struct
import warnings
import zipfile
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import torch
from safetensors import safe_open
from tqdm import tqdm

from eyas.aux_layers import AuxConvention, to_hidden_state_ids
from eyas.paths import DEFAULT_MODEL
from eyas.train.data import Example
from eyas.train.hidden_states import (
    DTYPES,
    MANIFEST,
    HiddenStateError,
    new_manifest,
    pack_shard,
    read_manifest,
    write_shards,
)
from eyas.weights import shard_file

if TYPE_CHECKING:
    from eyas.config import DeepseekV3Config

log = logging.getLogger("eyas")


@dataclass(frozen=True, slots=True)
class SourceFormat:
    name: str
    patterns: tuple[str, ...]  # file names, searched under SRC at any depth
    aux_convention: str | None  # how its own tool numbers aux layers; None: its dumpers disagree, the user says
    last_hidden: str | None  # "pre-norm" or "post-norm"; None: its dumpers disagree, the user says
    metadata_keys: frozenset[str] = frozenset()  # non-tensor values its files carry (a string or a number)


SOURCE_FORMATS = {
    "vllm": SourceFormat("vllm", ("*.safetensors",), "hidden_states", "pre-norm"),
    "modelopt": SourceFormat("modelopt", ("*.pt",), None, None, frozenset({"conversation_id"})),
    "specforge": SourceFormat("specforge", ("*.ckpt", "*.ckpt.gz"), "layer_output", "post-norm"),
}
LAST_HIDDEN = ("pre-norm", "post-norm")
SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
# a normed row divided by the norm's weight has an RMS of 1; bfloat16 storage moves it by well under 1%
UNIT_RMS_TOLERANCE = 0.02
# the widest elements a file may store: float32 states (the widest of DTYPES), int64 token ids and loss mask
STATE_BYTES, ID_BYTES = 4, 8
# a file's bytes besides its tensors': the pickle, zip headers and 64-byte record alignment, a conversation id
# (a few KB in the tools' files)
FILE_OVERHEAD_BYTES = 4 << 20
GZIP_CHUNK_BYTES = 1 << 20
MAX_FILE_BYTES = 64 << 30  # load_pickle's limit where no target is given: generous, yet a bound on a .gz stream
# torch.save writes six records besides one per storage, each ~100 bytes of central directory; thousands are no
# torch file, and Python's zipfile holds ~10x the directory's size in memory while reading it
MAX_ZIP_RECORDS = 1024


@dataclass(frozen=True, slots=True)
class Layout:
    """What the files of one import hold, in eyas's terms, resolved from the command line and the target."""
    fmt: SourceFormat
    file_ids: tuple[int, ...]  # hidden_states ids of the states a file holds, in the file's order
    aux_ids: tuple[int, ...]  # the aux ids eyas stores: ascending
    aux_order: tuple[int, ...]  # indices into a file's state axis giving aux_ids' order
    last_slot: int | None  # vllm: the slot holding id L
    post_norm: bool  # the last hidden state is past the final norm
    hidden_size: int
    vocab_size: int
    max_tokens: int


@dataclass(slots=True)
class DumpedSequence:
    """One file's sequence, validated; the states are views into the file (not read until used)."""
    input_ids: torch.Tensor  # [T] integer
    loss_mask: torch.Tensor | None  # [T]; None for vllm (the matched record's)
    states: torch.Tensor  # [T, n_slots, H]: every state the file holds, in its order
    last: torch.Tensor  # [T, H]


def resolve_layout(fmt: SourceFormat, given_ids: Sequence[int], convention: str | None, last_hidden: str | None,
                   num_layers: int, hidden_size: int, vocab_size: int, max_tokens: int) -> Layout:
    """The ids the files hold (as the user gave them, converted to hidden_states ids) and the last hidden
    state's side of the final norm; errors say which flag is missing or wrong."""
    L = num_layers
    convention = convention or fmt.aux_convention
    if convention is None:
        raise ValueError(f"--format {fmt.name}: give --aux-layer-convention (hidden_states or layer_output): "
                         f"{fmt.name}'s dumpers number the aux layers differently and its files do not say how")
    if fmt.name == "vllm" and convention != "hidden_states":
        raise ValueError("--format vllm: vLLM's eagle_aux_hidden_state_layer_ids are hidden_states ids (id i = input "
                         "of layer i, id L = the last layer's output); give them as they were given to vLLM")
    last_hidden = last_hidden or fmt.last_hidden
    if last_hidden is None:
        raise ValueError(f"--format {fmt.name}: give --last-hidden: {fmt.name}'s HF and TRT-LLM dumpers store the "
                         "last hidden state after the final norm (post-norm), its vLLM dumper before it (pre-norm), "
                         "and its files do not say which")
    if fmt.name == "vllm" and last_hidden != "pre-norm":
        raise ValueError("--format vllm: vLLM's id L is the last layer's output before the final norm (pre-norm)")
    if not given_ids:
        raise ValueError("give --aux-layer-ids: the layer ids of the states the files hold")
    try:
        file_ids = to_hidden_state_ids(list(given_ids), AuxConvention(convention), L)
    except ValueError as e:
        raise ValueError(f"--aux-layer-ids: {e}") from e
    last_slot = None
    slots = list(range(len(file_ids)))
    if fmt.name == "vllm":
        if L not in file_ids:
            raise ValueError(f"--aux-layer-ids {list(given_ids)} holds no id {L} (the last hidden state of this "
                             f"{L}-layer target): the offline trainer needs it for the target's distribution. "
                             f"Extract again with {L} added to eagle_aux_hidden_state_layer_ids (the same forward "
                             "pass computes it)")
        last_slot = file_ids.index(L)
        slots.remove(last_slot)
        if not slots:
            raise ValueError(f"--aux-layer-ids {list(given_ids)}: besides the last hidden state (id {L}) the files "
                             "hold no aux state")
    aux_order = tuple(sorted(slots, key=lambda s: file_ids[s]))
    return Layout(fmt=fmt, file_ids=file_ids, aux_ids=tuple(file_ids[s] for s in aux_order), aux_order=aux_order,
                  last_slot=last_slot, post_norm=last_hidden == "post-norm", hidden_size=hidden_size,
                  vocab_size=vocab_size, max_tokens=max_tokens)


def max_file_bytes(layout: Layout) -> int:
    """The most bytes one file of `layout` can hold: max_tokens rows of every state it holds (float32, the widest
    stored), of token ids and of loss mask (int64), and the pickle's own. A file or .gz stream larger is refused
    unread: memory for a file stays within what a real one of this target needs, whatever the file claims."""
    states = len(layout.file_ids) + (layout.fmt.name != "vllm")  # the pickles hold the last hidden state apart
    return layout.max_tokens * (states * layout.hidden_size * STATE_BYTES + 2 * ID_BYTES) + FILE_OVERHEAD_BYTES


# -- finding and opening files -----------------------------------------------------------------------------------

def _natural_key(path: Path) -> list:
    # data_9 before data_10, rows_5000-10000 after rows_0-5000
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path.as_posix())]


def _leads_outside(path: Path, root: Path) -> bool:
    """Whether `path`, its links followed, lies outside `root` (resolved)."""
    return not path.resolve().is_relative_to(root)


def list_source_files(src: Path, fmt: SourceFormat) -> list[Path]:
    """The dump's files under `src`, in natural order of their paths relative to it (deterministic). A link to a
    file outside `src` is refused: a dump from elsewhere must not make the import read (and copy into OUT) any
    other file of this machine. rglob follows no directory link, so only file links can lead out."""
    if not src.is_dir():
        raise HiddenStateError(f"{src}: no such directory")
    files = {p for pattern in fmt.patterns for p in src.rglob(pattern) if p.is_file()}
    if not files:
        raise HiddenStateError(f"{src}: no {' or '.join(fmt.patterns)} files; is it a {fmt.name} dump?")
    root = src.resolve()
    for path in files:
        if _leads_outside(path, root):
            raise HiddenStateError(f"{path}: links to {path.resolve()}, outside {src}: refused (the import reads "
                                   "only files inside the dump directory)")
    return sorted(files, key=lambda p: _natural_key(p.relative_to(src)))


def _check_size(path: Path, size: int, limit: int, what: str) -> None:
    if size > limit:
        raise HiddenStateError(f"{path}: {what} {size} bytes, more than a file of this target can hold ({limit} "
                               "bytes: the longest sequence it takes, its states in float32): refused")


def _gunzip(path: Path, limit: int) -> io.BytesIO:
    """The decompressed stream of `path`, read a chunk at a time and refused once past `limit`: a gzip bomb
    (1000:1 for zeros) costs at most `limit` bytes, not its expanded size. One buffer, handed to torch.load."""
    out = io.BytesIO()
    with gzip.open(path, "rb") as f:
        while chunk := f.read(GZIP_CHUNK_BYTES):
            _check_size(path, out.tell() + len(chunk), limit, "decompresses to more than")
            out.write(chunk)
    out.seek(0)
    return out


def _check_zip_records(path: Path, f: BinaryIO, limit: int) -> None:
    """Refuse a torch.save zip whose records declare more than `limit` bytes in all, or are compressed (torch
    stores them as they are; torch.load would inflate one to whatever size it declares), reading only its end
    record and central directory. A file torch.load reads as no zip (the pre-1.6 format) has its storages read
    as stored, within the file's size."""
    if f.read(4) != b"PK\x03\x04":  # torch.load's own test for its zip format
        f.seek(0)
        return
    if f.seek(0, io.SEEK_END) < 22:
        raise HiddenStateError(f"{path}: a zip too short to hold its end record: refused")
    f.seek(-22, io.SEEK_END)
    end = f.read(22)  # torch.save's zip ends in its end-of-central-directory record, with no comment after it
    if end[:4] != b"PK\x05\x06":
        raise HiddenStateError(f"{path}: a zip cut short, or with a comment after its end record (torch.save "
                               "writes none): refused")
    records, directory_bytes = struct.unpack("<HI", end[10:16])
    if records > MAX_ZIP_RECORDS or directory_bytes > MAX_ZIP_RECORDS * 1024:
        raise HiddenStateError(f"{path}: a zip of {records} records ({directory_bytes} bytes of central "
                               f"directory); a torch.save file has a few: refused")
    f.seek(0)
    with zipfile.ZipFile(f) as z:
        infos = z.infolist()
    f.seek(0)
    _check_size(path, sum(i.file_size for i in infos), limit, "its zip records declare")
    packed = [i.filename for i in infos if i.compress_type != zipfile.ZIP_STORED]
    if packed:
        raise HiddenStateError(f"{path}: zip records {packed[:3]} are compressed; torch.save stores every record "
                               "as it is: refused")


def _check_stored(path: Path, key: str, t: torch.Tensor) -> None:
    """Refuse a tensor that is not plain stored data: a pickle may declare a view with stride 0 (or overlapping
    strides) over a tiny storage, which any copy (.contiguous(), .to(), a concatenation) expands to its full
    size. Checked on the declared shape, strides and storage before anything reads the tensor."""
    kind = ("quantized" if t.is_quantized else "nested" if t.is_nested else str(t.layout)
            if t.layout != torch.strided else None if t.device.type == "cpu" else t.device.type)
    if kind is not None:
        raise HiddenStateError(f"{path}: {key!r} is a {kind} tensor; expected a dense CPU tensor: refused")
    shape, strides = list(t.shape), list(t.stride())
    if any(stride == 0 and size > 1 for size, stride in zip(shape, strides)):
        raise HiddenStateError(f"{path}: {key!r} is {shape} with strides {strides}: a stride-0 view repeating "
                               "its stored elements, not stored data: refused")
    held = t.untyped_storage().nbytes() // t.element_size() - t.storage_offset()
    if math.prod(shape) > held:
        raise HiddenStateError(f"{path}: {key!r} is {shape} with strides {strides}: {math.prod(shape)} elements "
                               f"over a storage holding {held}, an overlapping view, not stored data: refused")


def _load_error(e: Exception) -> str:
    """Why torch.load failed, in one line of our own: never torch's advice to load with weights_only=False."""
    if isinstance(e, pickle.UnpicklingError):
        # torch replaces its unpickler's message with advice; the message itself is the exception replaced
        message = str(e.__context__ or e)
        found = (re.search(r"GLOBAL (\S+) (?:was not an allowed global|whose module)", message)
                 or re.search(r"but got (.+)$", message))
        detail = found.group(1) if found else message.splitlines()[0][:200] if message else ""
        if not detail or "weights_only" in detail:
            detail = "a pickle instruction torch.load(weights_only=True) does not run"
        return f"holds objects other than tensors ({detail}): refused"
    first = str(e).splitlines()[0][:200] if str(e) else ""
    said = "" if not first or "weights_only" in first else f": {first}"
    return f"cannot be read as a torch.save file of tensors ({type(e).__name__}{said})"


def load_pickle(path: Path, metadata_keys: frozenset[str] = frozenset(),
                max_bytes: int = MAX_FILE_BYTES) -> dict[str, torch.Tensor]:
    """A torch.save'd dict of tensors, loaded with weights_only=True (memory-mapped when the file allows);
    `metadata_keys` may hold a string or a number, every other key a tensor. A file or .gz stream larger than
    `max_bytes`, zip records declaring more, and tensors claiming more than their storage holds are refused
    before they are read; every refusal is one line naming the file."""
    gzipped = path.name.endswith(".gz")
    _check_size(path, path.stat().st_size, max_bytes, "holds")
    try:
        with warnings.catch_warnings():  # torch warns of pickle protocols and storages: the error says what counts
            warnings.simplefilter("ignore")
            if gzipped:
                buffer = _gunzip(path, max_bytes)
                _check_zip_records(path, buffer, max_bytes)
                obj = torch.load(buffer, weights_only=True, map_location="cpu")
            else:
                with open(path, "rb") as f:
                    _check_zip_records(path, f, max_bytes)
                try:
                    obj = torch.load(path, weights_only=True, map_location="cpu", mmap=True)
                except RuntimeError as e:
                    if "mmap" not in str(e):
                        raise
                    obj = torch.load(path, weights_only=True, map_location="cpu")  # the pre-1.6 format has no mmap
    except HiddenStateError:
        raise
    except Exception as e:  # torch.load raises UnpicklingError, RuntimeError, EOFError, gzip errors...
        raise HiddenStateError(f"{path}: {_load_error(e)}") from e
    if not isinstance(obj, dict):
        raise HiddenStateError(f"{path}: holds a {type(obj).__name__}; expected a dict of tensors")
    tensors = {}
    for key, value in obj.items():
        if isinstance(value, torch.Tensor) and isinstance(key, str):
            _check_stored(path, key, value)
            tensors[key] = value
        elif not (key in metadata_keys and isinstance(value, (str, int))):
            raise HiddenStateError(f"{path}: key {key!r} holds a {type(value).__name__}; expected a tensor")
    return tensors


def load_vllm_file(path: Path, with_states: bool, max_bytes: int | None = None) -> dict[str, torch.Tensor]:
    """token_ids and hidden_states of a connector file; without `with_states`, hidden_states is a meta tensor
    of its shape and dtype (nothing read). A file larger than `max_bytes` is refused unread (safetensors checks
    that its header's shapes fit the file, and stores no views)."""
    if max_bytes is not None:
        _check_size(path, path.stat().st_size, max_bytes, "holds")
    lock = path.with_name(path.name + ".lock")
    if lock.exists():  # the connector holds an exclusive flock on it until the file is written
        with open(lock) as f:
            try:
                fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError as e:
                raise HiddenStateError(f"{path}: vLLM is still writing it (its .lock is held); import once the "
                                       "extraction has finished") from e
    try:
        with safe_open(str(path), framework="pt") as f:
            keys = set(f.keys())
            missing = [k for k in ("hidden_states", "token_ids") if k not in keys]
            if missing:
                raise HiddenStateError(f"{path}: no {missing} (keys: {sorted(keys)}); expected hidden_states "
                                       "[T, n_ids, H] and token_ids [T] as ExampleHiddenStatesConnector writes")
            tensors = {"token_ids": f.get_tensor("token_ids")}
            if with_states:
                tensors["hidden_states"] = f.get_tensor("hidden_states")
            else:
                sliced = f.get_slice("hidden_states")
                dtype = SAFETENSORS_DTYPES.get(sliced.get_dtype())
                if dtype is None:
                    raise HiddenStateError(f"{path}: 'hidden_states' is {sliced.get_dtype()}; expected one of "
                                           f"{sorted(SAFETENSORS_DTYPES)}")
                tensors["hidden_states"] = torch.empty(sliced.get_shape(), dtype=dtype, device="meta")
    except HiddenStateError:
        raise
    except Exception as e:  # safetensors raises its own error types for truncated or corrupt files
        raise HiddenStateError(f"{path}: cannot read safetensors ({type(e).__name__}: {e})") from e
    return tensors


# -- one file's sequence -----------------------------------------------------------------------------------------

def _tensor(path: Path, tensors: dict[str, torch.Tensor], key: str, ndim: int, expected: str) -> torch.Tensor:
    if key not in tensors:
        raise HiddenStateError(f"{path}: no {key!r} (keys: {sorted(tensors)}); expected {key} {expected}")
    t = tensors[key]
    if t.dim() == ndim + 1 and t.shape[0] == 1:  # a batch of one (SpecForge writes one on its states)
        t = t[0]
    if t.dim() != ndim:
        raise HiddenStateError(f"{path}: {key!r} is {list(t.shape)}; expected {expected}")
    return t


def read_sequence(path: Path, layout: Layout, with_states: bool = True) -> DumpedSequence:
    """A file's token ids, loss mask and states, checked against `layout`: every error names the file, the key
    and what was expected."""
    fmt = layout.fmt
    if fmt.name == "vllm":
        ids, mask, states, last = _vllm_sequence(path, layout, with_states)
        ids_key = "token_ids"
    else:
        ids, mask, states, last = _pickled_sequence(path, layout)
        ids_key = "input_ids"
    T = states.shape[0]
    if not 1 <= T <= layout.max_tokens:
        raise HiddenStateError(f"{path}: holds {T} tokens; the target takes 1..{layout.max_tokens} "
                               "(max_position_embeddings)")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise HiddenStateError(f"{path}: {ids_key!r} is {ids.dtype}; expected integer token ids")
    for key, t in ((ids_key, ids), ("loss_mask", mask)):
        if t is not None and t.shape[0] < T:
            raise HiddenStateError(f"{path}: {key!r} has {t.shape[0]} entries for {T} rows of hidden states; "
                                   "expected one per row")
    if mask is not None and mask.shape[0] != ids.shape[0]:
        raise HiddenStateError(f"{path}: 'loss_mask' has {mask.shape[0]} entries, {ids_key!r} {ids.shape[0]}; "
                               "expected one per token")
    if ids.shape[0] > T:
        # SpecForge's batched dumper pads ids and mask to the batch's longest row; the states stop at the real
        # ones. Cutting the padding off changes no loss position, provided the padding carries no loss.
        if fmt.name != "specforge" or mask[T:].any():
            raise HiddenStateError(f"{path}: {ids_key!r} has {ids.shape[0]} entries for {T} rows of hidden "
                                   "states; expected one per row")
        ids, mask = ids[:T], mask[:T]
    for t in (states, last):
        if t.dtype not in DTYPES.values():
            raise HiddenStateError(f"{path}: holds {t.dtype} hidden states; expected one of {sorted(DTYPES)}")
    if int(ids.min()) < 0 or int(ids.max()) >= layout.vocab_size:
        raise HiddenStateError(f"{path}: {ids_key!r} holds ids outside the target's vocabulary of "
                               f"{layout.vocab_size} ({int(ids.min())}..{int(ids.max())})")
    if mask is not None and not ((mask == 0) | (mask == 1)).all():
        raise HiddenStateError(f"{path}: 'loss_mask' holds values other than 0 and 1")
    return DumpedSequence(ids, mask, states, last)


def _vllm_sequence(path: Path, layout: Layout,
                   with_states: bool) -> tuple[torch.Tensor, None, torch.Tensor, torch.Tensor]:
    """(token_ids, no mask, hidden_states [T, n, H], last [T, H]) of a vLLM connector file, its shapes checked: the
    last hidden state is one of the stored slots."""
    H, n = layout.hidden_size, len(layout.file_ids)
    tensors = load_vllm_file(path, with_states, max_file_bytes(layout))
    ids = _tensor(path, tensors, "token_ids", 1, "[T]")
    states = _tensor(path, tensors, "hidden_states", 3, f"[T, {n}, {H}]")
    if tuple(states.shape[1:]) != (n, H):
        raise HiddenStateError(f"{path}: 'hidden_states' is {list(states.shape)}; expected [T, {n}, {H}] "
                               f"(--aux-layer-ids gives {n} ids; the target's hidden size is {H})")
    return ids, None, states, states[:, layout.last_slot]


def _pickled_sequence(path: Path, layout: Layout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, loss_mask, aux states [T, n, H], last [T, H]) of a Model Optimizer or SpecForge file, its shapes
    checked: the aux states are stored flat, [T, n * H]."""
    fmt, H, n = layout.fmt, layout.hidden_size, len(layout.file_ids)
    tensors = load_pickle(path, fmt.metadata_keys, max_file_bytes(layout))
    last_key, aux_key = ("hidden_states", "aux_hidden_states") if fmt.name == "modelopt" else \
        ("hidden_state", "aux_hidden_state")
    ids = _tensor(path, tensors, "input_ids", 1, "[T]")
    mask = _tensor(path, tensors, "loss_mask", 1, "[T]")
    last = _tensor(path, tensors, last_key, 2, f"[T, {H}]")
    flat = _tensor(path, tensors, aux_key, 2, f"[T, {n} * {H}]")
    if last.shape[1] != H:
        raise HiddenStateError(f"{path}: {last_key!r} is {list(last.shape)}; expected [T, {H}] (the target's "
                               "hidden size)")
    if flat.shape[1] != n * H:
        raise HiddenStateError(f"{path}: {aux_key!r} is {list(flat.shape)}; expected [T, {n * H}]: {n} aux "
                               f"states (--aux-layer-ids) of the target's hidden size {H}")
    if flat.shape[0] != last.shape[0]:
        raise HiddenStateError(f"{path}: {last_key!r} has {last.shape[0]} rows, {aux_key!r} {flat.shape[0]}; "
                               "expected one per token in both")
    # a view of a contiguous file's states; a copy of no more than the file holds (load_pickle saw to it)
    return ids, mask, flat.reshape(flat.shape[0], n, H), last


def check_norm_side(path: Path, last: torch.Tensor, norm_weight: torch.Tensor, post_norm: bool) -> None:
    """Refuse a last hidden state on the other side of the final norm than claimed. RMSNorm's output divided by
    its weight is x / rms(x): RMS 1 in every row. A state before the norm has whatever RMS the residual stream
    grew to."""
    if (norm_weight == 0).any():  # a zero weight erases a column: no row can be checked
        return
    rms = (last.float() / norm_weight).pow(2).mean(-1).sqrt()  # [T]
    unit = (rms - 1).abs() < UNIT_RMS_TOLERANCE
    if post_norm and not unit.all():
        row = int((~unit).nonzero()[0])
        raise HiddenStateError(f"{path}: the last hidden state is not past the final norm: row {row} has RMS "
                               f"{float(rms[row]):.4f} once divided by the target's norm weight, where a normed "
                               "row has 1; is it pre-norm (--last-hidden pre-norm), or from another target "
                               "than --model?")
    if not post_norm and unit.all():
        raise HiddenStateError(f"{path}: the last hidden state looks past the final norm: every row has RMS 1 "
                               "once divided by the target's norm weight; is it post-norm (--last-hidden "
                               "post-norm)?")


# -- the import --------------------------------------------------------------------------------------------------

def index_files(files: Sequence[Path], layout: Layout, records: Sequence[Example] | None,
                norm_weight: torch.Tensor, dtype: torch.dtype | None) -> tuple[list[Example], torch.dtype]:
    """Every file's example (token ids and loss mask; for vllm the mask of the record its ids match) and the
    dtype to store (`dtype`, else the files' own, which must then agree), reading no states but the first file's
    last hidden state (to check --last-hidden before anything is written)."""
    by_tokens: dict[tuple[int, ...], deque[int]] = {}
    first_file: dict[tuple[int, ...], Path] = {}
    for j, record in enumerate(records or []):
        by_tokens.setdefault(tuple(record.input_ids), deque()).append(j)
    examples, convert = [], dtype is not None
    for k, path in enumerate(tqdm(files, desc="indexing", unit="file")):
        seq = read_sequence(path, layout, with_states=k == 0)
        if k == 0:
            check_norm_side(path, seq.last, norm_weight, layout.post_norm)
        if dtype is None:
            dtype = seq.states.dtype
        for t in (seq.states, seq.last):
            if t.dtype != dtype and not convert:
                raise HiddenStateError(f"{path}: holds {t.dtype} states where {files[0]} holds {dtype}; give "
                                       "--dtype to store them all in one")
        ids = tuple(seq.input_ids.tolist())
        if records is None:
            examples.append(Example(list(ids), seq.loss_mask.int().tolist()))
            continue
        left = by_tokens.get(ids)
        if not left:
            if ids in first_file:
                raise HiddenStateError(f"{path}: holds the same {len(ids)} tokens as {first_file[ids]}, and --data "
                                       "holds that record fewer times than the files do; refusing to train on one "
                                       "record twice")
            raise HiddenStateError(f"{path}: its {len(ids)} token ids (starting {list(ids[:8])}) match no record "
                                   "of --data as this target's tokenizer renders it (a record whose tokens were "
                                   "sent to vLLM differently, or one with no loss tokens, matches nothing)")
        first_file.setdefault(ids, path)
        examples.append(Example(list(ids), list(records[left.popleft()].loss_mask)))
    return examples, dtype


def files_fingerprint(src: Path, files: Sequence[Path]) -> str:
    """sha256 over each file's path under `src` and size: a resumed import must read the same files."""
    h = hashlib.sha256()
    for path in files:
        h.update(f"{path.relative_to(src).as_posix()}\0{path.stat().st_size}\n".encode())
    return "sha256:" + h.hexdigest()


def _check_listed_shards(out: Path) -> None:
    """Refuse an earlier run's manifest in `out` that lists a shard anywhere but a plain file in `out`, as a
    safetensors index must name its shards: a resumed import keeps every shard its manifest lists, and training
    then reads them, so a name that is absolute, holds `..`, or is a link leading out would make either read
    another file of this machine."""
    if not (out / MANIFEST).is_file():
        return
    shards = read_manifest(out).get("shards", [])
    for entry in shards if isinstance(shards, list) else [shards]:
        name = entry.get("file") if isinstance(entry, dict) else entry
        path = shard_file(out, name)
        if path is None or _leads_outside(path, out.resolve()):
            raise HiddenStateError(f"{out / MANIFEST}: lists shard {name!r}, which is not a file in {out}: "
                                   "refused (a dump's shards are plain files in its directory)")


def import_hidden_states(src: str | Path, out_dir: str | Path, layout: Layout, config: DeepseekV3Config,
                         target_path: str | Path, norm_weight: torch.Tensor,
                         records: Sequence[Example] | None = None, dtype: torch.dtype | None = None,
                         examples_per_shard: int = 128, given: dict | None = None,
                         max_shards: int | None = None) -> dict:
    """Convert the dump in `src` into eyas's shards in `out_dir`; returns the manifest. `records` (vllm) are the
    examples the files are matched to; `dtype` None keeps the files' own; `given` records the flags as given.
    Resumable as dump_hidden_states is: complete shards are kept, another source or other settings refused."""
    src = Path(src)
    if examples_per_shard < 1:
        raise ValueError(f"--examples-per-shard must be positive, got {examples_per_shard}")
    out = Path(out_dir).resolve()
    # an OUT inside SRC: its own shards are no source files (they are *.safetensors, as vLLM's are)
    files = [f for f in list_source_files(src, layout.fmt) if out not in f.resolve().parents]
    if not files:
        raise HiddenStateError(f"{src}: no {layout.fmt.name} files outside {out_dir}")
    _check_listed_shards(out)
    examples, dtype = index_files(files, layout, records, norm_weight, dtype)
    dtype_name = next(name for name, d in DTYPES.items() if d == dtype)
    manifest = new_manifest(config, target_path, examples, layout.aux_ids, dtype_name, examples_per_shard,
                            last_hidden_post_norm=layout.post_norm)
    manifest["source"] = {"format": layout.fmt.name, "num_files": len(files),
                          "files_fingerprint": files_fingerprint(src, files), **(given or {})}
    manifest["source_path"] = str(src.resolve())  # where it came from; not compared on resuming (it may move)

    def shard(first: int, last: int, progress: tqdm) -> dict[str, torch.Tensor]:
        aux_rows, last_rows = [], []
        for path, ex in zip(files[first:last], examples[first:last]):
            seq = read_sequence(path, layout)
            if seq.input_ids.tolist() != ex.input_ids:
                raise HiddenStateError(f"{path}: its token ids changed since this import indexed it")
            check_norm_side(path, seq.last, norm_weight, layout.post_norm)
            aux_rows.append(seq.states[:, list(layout.aux_order)].to(dtype))  # [T, n_aux, H], ascending ids
            last_rows.append(seq.last.to(dtype))
            progress.update(len(ex.input_ids))
        return pack_shard(examples[first:last], aux_rows, last_rows)

    return write_shards(out_dir, manifest, shard, max_shards)


# -- CLI ---------------------------------------------------------------------------------------------------------

def final_norm_weight(model_dir: Path) -> torch.Tensor:
    """model.norm.weight of a checkpoint directory, float32, read alone."""
    from eyas.weights import CheckpointError, checkpoint_files

    for file in checkpoint_files(model_dir):
        with safe_open(str(file), framework="pt") as f:
            if "model.norm.weight" in f.keys():
                return f.get_tensor("model.norm.weight").float()
    raise CheckpointError(f"{model_dir}: no model.norm.weight in its safetensors")


def cmd_import_hidden_states(args: argparse.Namespace) -> int:
    from eyas.config import DeepseekV3Config

    fmt = SOURCE_FORMATS[args.format]
    config = DeepseekV3Config.from_json(args.model)
    L = config.num_hidden_layers
    layout = resolve_layout(fmt, args.aux_layer_ids or [], args.aux_layer_convention, args.last_hidden, L,
                            config.hidden_size, config.vocab_size, config.max_position_embeddings)
    records = None
    if fmt.name == "vllm":
        if args.data is None:
            raise ValueError("--format vllm: give --data, the records the requests were made from: vLLM's files "
                             "hold no loss mask, and each is matched to its record by its token ids")
        from eyas.engine.llm import load_tokenizer
        from eyas.train.data import load_dataset

        tokenizer = load_tokenizer(args.model)
        if tokenizer is None:
            raise ValueError(f"{args.model}: no tokenizer (tokenizer.json / tokenizer_config.json) to read --data")
        # untruncated (up to what the target takes): a record cut short would match no file
        records = load_dataset(args.data, tokenizer, config.max_position_embeddings)
    elif args.data is not None:
        raise ValueError(f"--data is for --format vllm; {fmt.name}'s files carry their own loss masks")
    convention = args.aux_layer_convention or fmt.aux_convention
    given = {"aux_layer_ids": list(args.aux_layer_ids), "aux_layer_convention": convention,
             "last_hidden": "post-norm" if layout.post_norm else "pre-norm"}
    manifest = import_hidden_states(args.src, args.out, layout, config, args.model, final_norm_weight(args.model),
                                    records, None if args.dtype == "auto" else DTYPES[args.dtype],
                                    args.examples_per_shard, given)
    matched = f", matched to {manifest['num_examples']} of {len(records)} records of {args.data}" if records else ""
    print(f"imported {manifest['num_examples']} {fmt.name} files from {args.src}{matched}: "
          f"{manifest['total_tokens']} tokens, {manifest['total_loss_tokens']} loss tokens, in "
          f"{manifest['num_shards']} shards in {args.out}")
    as_given = f" (the files hold {convention} ids {list(args.aux_layer_ids)}, in that order)"
    side = ("after the final norm: the trainer applies no norm to it" if layout.post_norm
            else "before the final norm")
    print(f"aux hidden states at hidden_states ids {manifest['aux_hidden_state_ids']}{as_given}; the last hidden "
          f"state (id {L}) {side}; {manifest['dtype']}, hidden size {manifest['hidden_size']}")
    print(f"train on it with: eyas train --target {args.model} --hidden-states {args.out}")
    return 0


def add_cli(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """`eyas import-hidden-states`."""
    p = subparsers.add_parser(
        "import-hidden-states", help="convert hidden states vLLM, Model Optimizer or SpecForge dumped into an "
        "eyas dump for offline training",
        description="Convert a hidden-state dump another tool wrote into eyas's shards and manifest.json, so "
        "`eyas train --hidden-states OUT` trains on it without recomputing anything.\n"
        "vllm: the <request id>.safetensors files of vLLM's extract_hidden_states method with "
        "ExampleHiddenStatesConnector; --data gives the records the requests were made from (each file is "
        "matched to its record by token ids, for its loss mask).\n"
        "modelopt: the <conversation id>.pt files of Model Optimizer's collect_hidden_states scripts.\n"
        "specforge: the rows_*/data_{i}.ckpt(.gz) files of SpecForge's prepare_hidden_states.\n"
        "Rerunning with the same arguments resumes an interrupted import.")
    p.add_argument("src", type=Path, metavar="SRC", help="the dump's directory (searched at any depth)")
    p.add_argument("--format", required=True, choices=sorted(SOURCE_FORMATS), help="which tool wrote SRC")
    p.add_argument("--out", required=True, type=Path, metavar="DIR", help="the eyas dump to write")
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="the target the states are of: its config, "
                   "final norm weight and (for --data) tokenizer (default: the bundled tiny DeepSeek-V3)")
    p.add_argument("--aux-layer-ids", type=int, nargs="+", required=True, metavar="ID",
                   help="the layer ids of the states each file holds, in the order it holds them. vllm: the "
                   "eagle_aux_hidden_state_layer_ids given to vLLM, with L (the target's layer count) for the last "
                   "hidden state, e.g. 2 30 58 61; modelopt and specforge: their aux layers, ascending (the order "
                   "both capture them in), e.g. SpecForge's default 1 29 57 for a 61-layer target")
    p.add_argument("--aux-layer-convention", choices=[c.value for c in AuxConvention],
                   help="how --aux-layer-ids count: hidden_states (id i = input of layer i) or layer_output (id i = "
                   "output of layer i, one lower). Default: hidden_states for vllm (vLLM's own), layer_output for "
                   "specforge (its --aux-hidden-states-layers); required for modelopt, whose dumpers differ: its "
                   "vLLM dumper passes its ids to vLLM as they are (hidden_states), its newer HF dumper reads HF "
                   "hidden_states[id + 1] (layer_output), its older HF dumper hidden_states[id] (hidden_states)")
    p.add_argument("--last-hidden", choices=LAST_HIDDEN, help="which side of the target's final norm the files' "
                   "last hidden state is. Default: pre-norm for vllm (id L), post-norm for specforge (what its "
                   "lm_head reads); required for modelopt: post-norm from its HF and TRT-LLM dumpers, pre-norm from "
                   "its vLLM dumper. Checked on every file")
    p.add_argument("--data", type=Path, metavar="DATA.jsonl", help="vllm only: the conversations or text records "
                   "the requests were made from, as `eyas dump-hidden-states` takes them")
    p.add_argument("--examples-per-shard", type=int, default=128)
    p.add_argument("--dtype", choices=["auto", *sorted(DTYPES)], default="auto", help="dtype of the stored "
                   "states; auto keeps the files' own")
    p.set_defaults(func=cmd_import_hidden_states)
    return p
