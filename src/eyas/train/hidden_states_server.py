"""The target's hidden states from a running vLLM, for targets that only run on a cluster.

vLLM serves them with its `extract_hidden_states` method and the `ExampleHiddenStatesConnector`: a completion
request of token ids with `max_tokens: 1` prefills them and answers with `kv_transfer_params.hidden_states_path`, a
safetensors file (on storage both machines see) holding `hidden_states [T, n_ids, H]` for the requested ids in the
order given and `token_ids [T]`, written after the answer (a `.lock` beside it is held until it is complete).

vLLM numbers the ids as eyas does (`eyas.aux_layers`, HF `hidden_states` indices): id i is the input of layer i, id
L the last layer's output before the final norm. eyas asks for the draft's aux ids and then L, the last hidden state
the trainer's teacher logits come from.

The path comes from the server, so it is not trusted: eyas reads a file only if it is a regular `.safetensors` file
inside the storage directory the server was started with, reached without a symlink, and opened without blocking
(a FIFO would hang the open); it deletes the file (and its `.lock`) only once its token ids proved it the answer to
the request. Anything else stops the run with one line naming the server, the path and what was wrong.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shlex
import stat
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as load_safetensors

from eyas.client import ServerClient, ServerError
from eyas.config import DeepseekV3Config
from eyas.train.data import Example
from eyas.train.hidden_states import HiddenStateError, check_dump, new_manifest, pack_shard, write_shards

CONNECTOR = "ExampleHiddenStatesConnector"
LOCK_TIMEOUT_S = 600.0  # how long a file's .lock may stay held before the write counts as lost
POLL_S = 0.005  # between looks at a file not yet written; a stop is seen within this
HEADER_LIMIT = 1 << 20  # bytes; a connector file's header is a few hundred, a larger one is not such a file
# O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer, past any timeout
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def requested_ids(aux_ids: Sequence[int], num_hidden_layers: int) -> list[int]:
    """The ids to ask vLLM for: the aux ids ascending, then the last hidden state's id L."""
    return sorted(aux_ids) + [num_hidden_layers]


def vllm_command(target: str | Path, aux_ids: Sequence[int], num_hidden_layers: int, storage: str | Path,
                 port: int = 8000, served_model_name: str | None = None) -> str:
    """The command that serves `target` on vLLM so that `--server` can read its hidden states: extraction of the
    draft's aux ids and L, files under `storage`, and no prefix caching or chunked prefill (a cached or split
    prefill would leave positions out of the extracted states)."""
    speculative = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                   "draft_model_config": {"hf_config": {
                       "eagle_aux_hidden_state_layer_ids": requested_ids(aux_ids, num_hidden_layers)}}}
    transfer = {"kv_connector": CONNECTOR, "kv_role": "kv_producer",
                "kv_connector_extra_config": {"shared_storage_path": str(storage)}}
    words = ["vllm", "serve", str(target), "--port", str(port)]
    if served_model_name:
        words += ["--served-model-name", served_model_name]
    words += ["--speculative-config", json.dumps(speculative, separators=(",", ":")),
              "--kv-transfer-config", json.dumps(transfer, separators=(",", ":")),
              "--no-enable-prefix-caching", "--no-enable-chunked-prefill"]
    return " ".join(shlex.quote(w) for w in words)


class FetchStopped(HiddenStateError):
    """A fetch ended early because another one failed (or the run stopped); the other's error is the one to show."""


class ServerHiddenStates:
    """Fetches the hidden states of token ids from a vLLM serving `extract_hidden_states` (see `vllm_command`)
    with `storage` as its shared_storage_path, checks them and deletes the server's file once read. Thread-safe:
    callers run several requests at once."""

    def __init__(self, client: ServerClient, aux_ids: Sequence[int], num_hidden_layers: int, hidden_size: int,
                 storage: str | Path, keep_files: bool = False, lock_timeout: float = LOCK_TIMEOUT_S) -> None:
        if not os.path.isdir(storage):
            raise ValueError(f"--vllm-storage {storage}: not a directory; give the shared_storage_path the vLLM "
                             "was started with, as this machine sees it")
        self.client = client
        self.ids = requested_ids(aux_ids, num_hidden_layers)
        self.hidden_size = hidden_size
        # the server names paths under the directory as it was given to it, which may run through a symlink
        # (/shared -> /mnt/shared); below it, nothing may be one
        self.storage = os.path.abspath(storage)
        self.storage_real = os.path.realpath(storage)
        self.keep_files = keep_files
        self.lock_timeout = lock_timeout

    def fetch(self, token_ids: Sequence[int],
              stop: threading.Event | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(aux [T, n_aux, H] in ascending id order, last hidden [T, H] before the final norm) for `token_ids`.
        Setting `stop` ends a wait for the server's file at once, with FetchStopped."""
        if stop is None:
            stop = threading.Event()
        if stop.is_set():
            raise FetchStopped("stopped before the request was sent")
        token_ids = [int(t) for t in token_ids]
        body = {"model": self.client.model, "prompt": token_ids, "max_tokens": 1, "temperature": 0.0}
        answer = self.client.request("POST", "/v1/completions", body)
        params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        named = params.get("hidden_states_path") if isinstance(params, dict) else None
        if not named:
            raise ServerError(f"{self.client.url}/v1/completions: the answer has no kv_transfer_params."
                              "hidden_states_path; is it a vLLM started with the command "
                              "`eyas dump-hidden-states --print-vllm-command` prints?")
        states = self._load(named, token_ids, stop)
        expected = (len(token_ids), len(self.ids), self.hidden_size)
        if tuple(states.shape) != expected:
            raise HiddenStateError(f"{self.client.url}: hidden_states_path {named!r}: hidden_states has shape "
                                   f"{list(states.shape)}; expected {list(expected)} (tokens, ids {self.ids}, hidden "
                                   f"size): was the server started with eagle_aux_hidden_state_layer_ids {self.ids}?")
        return states[:, :-1], states[:, -1]

    def _refused(self, named: object, why: str) -> HiddenStateError:
        # repr keeps a path with a newline or odd bytes on the one line of the error
        return HiddenStateError(f"{self.client.url}: hidden_states_path {named!r} {why}; left in place")

    def _load(self, named: object, token_ids: list[int], stop: threading.Event) -> torch.Tensor:
        """The hidden_states [T, n_ids, H] of the file the server named for `token_ids`, deleted (with its .lock)
        once read and matched, unless keep_files."""
        parts = self._below_storage(named)
        path, lock = str(named), f"{named}.lock"
        deadline = time.monotonic() + self.lock_timeout
        while not os.path.lexists(path) and not os.path.lexists(lock):
            self._pause(stop, deadline, f"{self.client.url}: hidden_states_path {named!r} did not "
                        f"appear in {self.lock_timeout:g} s; does this machine see the server's "
                        "shared_storage_path at the same path?")
        resolved = os.path.realpath(path)
        if resolved != os.path.join(self.storage_real, *parts):
            raise self._refused(named, f"runs through a symlink (it resolves to {resolved})")
        directory = self._open_directory(named, parts[:-1])
        name = parts[-1]
        try:
            lock_fd = self._open_regular(named, directory, name + ".lock", "has a .lock that ")
            try:
                if lock_fd is not None:
                    self._wait_unlocked(lock_fd, named, stop, deadline)
            finally:
                if lock_fd is not None:
                    os.close(lock_fd)
            fd = self._open_regular(named, directory, name, "")
            if fd is None:
                raise self._refused(named, "is missing although its .lock was released")
            try:
                tensors = self._read(named, fd, len(token_ids))
                got = tensors["token_ids"].tolist()
                if got != token_ids:
                    raise self._refused(named, _differ(got, token_ids))
                if not self.keep_files:
                    _unlink_if_same(directory, name, os.fstat(fd))
                    _unlink_if_same(directory, name + ".lock", None)
            finally:
                os.close(fd)
        finally:
            os.close(directory)
        return tensors["hidden_states"]

    def _below_storage(self, named: object) -> list[str]:
        """The parts of `named` below the storage directory (the last one the file's name)."""
        if not isinstance(named, str):
            raise self._refused(named, "is not a path")
        if not os.path.isabs(named):
            raise self._refused(named, "is a relative path (start vLLM with an absolute shared_storage_path)")
        if {".", ".."} & set(named.split(os.sep)) or os.path.normpath(named) != named:
            raise self._refused(named, "is not a plain path ('.' or '..' components, doubled or trailing /)")
        for root in (self.storage, self.storage_real):
            prefix = root.rstrip(os.sep) + os.sep
            if named.startswith(prefix) and len(named) > len(prefix):
                break
        else:
            raise self._refused(named, f"is outside the storage directory {self.storage} (--vllm-storage)")
        if not named.endswith(".safetensors"):
            raise self._refused(named, "is not a .safetensors file")
        return named[len(prefix):].split(os.sep)

    def _open_directory(self, named: str, parts: list[str]) -> int:
        """The directory holding the file, opened one level at a time without following links: a check by name
        could be passed and then swapped for a link before the open."""
        fd = os.open(self.storage_real, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        for part in parts:
            try:
                below = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError as e:
                os.close(fd)
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise self._refused(named, f"runs through {part!r}, a symlink or not a directory") from None
                raise self._refused(named, f"cannot be reached ({part!r}: {e.strerror})") from None
            os.close(fd)
            fd = below
        return fd

    def _open_regular(self, named: str, directory: int, name: str, what: str) -> int | None:
        """`name` in `directory` opened for reading if it is a regular file; None if it does not exist."""
        try:
            kind = os.stat(name, dir_fd=directory, follow_symlinks=False).st_mode
        except FileNotFoundError:
            return None
        if stat.S_ISREG(kind):
            try:
                fd = os.open(name, _OPEN_FLAGS, dir_fd=directory)
            except OSError as e:  # replaced since the stat: ELOOP for a symlink, ENXIO for a socket
                raise self._refused(named, f"{what}cannot be opened as a regular file ({e.strerror})") from None
            kind = os.fstat(fd).st_mode
            if stat.S_ISREG(kind):
                return fd
            os.close(fd)
        raise self._refused(named, f"{what}is not a regular file but {_kind(kind)}")

    def _wait_unlocked(self, lock_fd: int, named: str, stop: threading.Event, deadline: float) -> None:
        """Wait until the connector has released the file's lock (it writes after answering)."""
        while True:
            try:
                fcntl.flock(lock_fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                self._pause(stop, deadline, f"{self.client.url}: hidden_states_path {named!r} still locked after "
                            f"{self.lock_timeout:g} s")

    def _read(self, named: str, fd: int, num_tokens: int) -> dict[str, torch.Tensor]:
        """token_ids and hidden_states of an open connector file. Its header is checked first, so that a large
        file of something else (a checkpoint shard) is refused before it is read."""
        size = os.fstat(fd).st_size
        head = os.pread(fd, 8, 0)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 2 <= length <= min(HEADER_LIMIT, size - 8):
            raise self._refused(named, "is not a safetensors file (no header)")
        try:
            header = json.loads(os.pread(fd, length, 8))
        except ValueError:
            header = None
        if not isinstance(header, dict):
            raise self._refused(named, "is not a safetensors file (its header is not a JSON object)")
        missing = [k for k in ("hidden_states", "token_ids") if k not in header]
        if missing:
            keys = sorted(k for k in header if k != "__metadata__")
            shown = ", ".join(map(repr, keys[:3])) + (f", ... ({len(keys)} in all)" if len(keys) > 3 else "")
            raise self._refused(named, f"has no {missing} (it holds {shown}); expected hidden_states [T, n_ids, H] "
                                f"and token_ids [T] as {CONNECTOR} writes")
        entry = header["token_ids"]
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if shape != [num_tokens]:
            raise self._refused(named, f"does not match its request: token_ids of shape {shape!r}, {num_tokens} "
                                "tokens sent")
        with open(fd, "rb", closefd=False) as f:
            data = f.read()
        try:
            return load_safetensors(data)
        except Exception as e:  # safetensors raises its own error types for truncated or corrupt files
            reason = " ".join(f"{type(e).__name__}: {e}".split())
            raise self._refused(named, f"cannot be read as safetensors ({reason})") from None

    def _pause(self, stop: threading.Event, deadline: float, late: str) -> None:
        if stop.wait(POLL_S):
            raise FetchStopped("stopped while waiting for the server's file")
        if time.monotonic() > deadline:
            raise HiddenStateError(late)


def _differ(got: list[int], sent: list[int]) -> str:
    first = next((i for i, (a, b) in enumerate(zip(got, sent)) if a != b), min(len(got), len(sent)))
    return (f"does not match its request: token_ids differ from the {len(sent)} sent (it has {len(got)}; first "
            f"difference at position {first}): the server tokenized or truncated the prompt, or named another "
            "request's file")


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symlink"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return f"of mode {mode:o}"


def _unlink_if_same(directory: int, name: str, read: os.stat_result | None) -> None:
    """Delete `name` in `directory` if it is still the regular file that was read (`read`; None: any regular
    file): an entry replaced since is not ours to delete."""
    try:
        now = os.stat(name, dir_fd=directory, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISREG(now.st_mode) or read is not None and (now.st_dev, now.st_ino) != (read.st_dev, read.st_ino):
        return
    os.unlink(name, dir_fd=directory)


class FetchPool:
    """Threads running fetches that all stop at the first failure: the waits in flight end at once (each fetch
    polls `stop`), the fetches not started are cancelled, and the error a caller sees is that first failure, not
    the stops it caused. Without it, a run that failed would wait for every file in flight, up to LOCK_TIMEOUT_S."""

    def __init__(self, workers: int, name: str) -> None:
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix=name)
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self._lock = threading.Lock()

    def submit(self, fetch: Callable[[Any, threading.Event], Any], item: Any) -> Future:
        """`fetch(item, stop)` on a worker thread."""
        def run() -> Any:
            try:
                return fetch(item, self.stop)
            except FetchStopped:
                raise
            except BaseException as e:
                with self._lock:
                    self.error = self.error or e
                self.stop.set()
                raise
        return self.pool.submit(run)

    def result(self, future: Future) -> Any:
        """The future's result; the pool's first failure if it was stopped because of one."""
        try:
            return future.result()
        except FetchStopped:
            if self.error is not None:
                raise self.error from None
            raise

    def close(self) -> None:
        self.stop.set()
        self.pool.shutdown(wait=False, cancel_futures=True)


def dump_from_server(states: ServerHiddenStates, examples: Sequence[Example], out_dir: str | Path,
                     config: DeepseekV3Config, target_path: str | Path | None, examples_per_shard: int = 128,
                     dtype: torch.dtype = torch.bfloat16, concurrency: int = 8, max_shards: int | None = None,
                     rank: int = 0, world_size: int = 1) -> dict:
    """`dump_hidden_states` with the states fetched from the server, `concurrency` requests at a time: the same
    shards and manifest (plus where they came from), resumable the same way."""
    if concurrency < 1:
        raise ValueError(f"concurrency ({concurrency}) must be positive")
    aux_ids, dtype_name = check_dump(config, examples, states.ids[:-1], examples_per_shard, dtype)
    manifest = new_manifest(config, target_path, examples, aux_ids, dtype_name, examples_per_shard)
    manifest["source"] = {"server": states.client.url, "hidden_state_ids_requested": states.ids}

    fetches = FetchPool(concurrency, "eyas-fetch")

    def shard(first: int, last: int, progress) -> dict[str, torch.Tensor]:
        def one(example: Example, stop: threading.Event) -> tuple[torch.Tensor, torch.Tensor]:
            aux, last_hidden = states.fetch(example.input_ids, stop)
            progress.update(len(example.input_ids))
            return aux.to(dtype), last_hidden.to(dtype)

        rows = [fetches.result(f) for f in [fetches.submit(one, e) for e in examples[first:last]]]
        return pack_shard(examples[first:last], [aux for aux, _ in rows], [last for _, last in rows])

    try:
        return write_shards(out_dir, manifest, shard, max_shards, rank, world_size)
    finally:
        fetches.close()


class StreamedHiddenStates:
    """Training examples whose hidden states come from the server as the trainer reaches them, nothing kept on disk
    (Model Optimizer's third mode): the batches of the next steps are fetched ahead, at most `ahead` steps, by
    `workers` threads; each server file is deleted once read. The data order stays the trainer's (a function of
    the step), so a resumed run fetches exactly the batches it would have. The first failed fetch stops them all
    (see FetchPool)."""

    def __init__(self, states: ServerHiddenStates, examples: Sequence[Example], dtype: torch.dtype,
                 workers: int = 4) -> None:
        self.states, self.examples, self.dtype = states, examples, dtype
        self.fetches = FetchPool(workers, "eyas-stream")
        self.pending: dict[tuple[int, int], Future] = {}  # (step, example index) -> its fetch

    def __len__(self) -> int:
        return len(self.examples)

    def token_examples(self) -> list[Example]:
        return list(self.examples)

    def prefetch(self, step: int, indices: Sequence[int]) -> None:
        for i in indices:
            if (step, i) not in self.pending:
                self.pending[step, i] = self.fetches.submit(self._item, i)

    def batch(self, step: int, indices: Sequence[int]) -> list[dict[str, torch.Tensor]]:
        """The items of step `step` (fetched now if they were not prefetched); fetches of earlier steps dropped.
        A failure stops every fetch in flight before it is raised: the run is about to end."""
        try:
            self.prefetch(step, indices)
            items = [self.fetches.result(self.pending.pop((step, i))) for i in indices]
        except BaseException:
            self.close()
            raise
        for key in [k for k in self.pending if k[0] <= step]:
            self.pending.pop(key).cancel()
        return items

    def _item(self, i: int, stop: threading.Event) -> dict[str, torch.Tensor]:
        example = self.examples[i]
        aux, last = self.states.fetch(example.input_ids, stop)
        return {"input_ids": torch.tensor(example.input_ids), "loss_mask": torch.tensor(example.loss_mask),
                "aux_hidden_states": aux.to(self.dtype), "last_hidden": last.to(self.dtype)}

    def close(self) -> None:
        self.fetches.close()
