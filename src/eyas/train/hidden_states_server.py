"""The target's hidden states from a running vLLM, for targets that only run on a cluster.

vLLM serves them with its `extract_hidden_states` method and the `ExampleHiddenStatesConnector`: a completion
request of token ids with `max_tokens: 1` prefills them and answers with `kv_transfer_params.hidden_states_path`, a
safetensors file (on storage both machines see) holding `hidden_states [T, n_ids, H]` for the requested ids in the
order given and `token_ids [T]`, written after the answer (a `.lock` beside it is held until it is complete).

vLLM numbers the ids as eyas does (`eyas.aux_layers`, HF `hidden_states` indices): id i is the input of layer i, id
L the last layer's output before the final norm. eyas asks for the draft's aux ids and then L, the last hidden state
the trainer's teacher logits come from.
"""

from __future__ import annotations

import fcntl
import json
import shlex
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from eyas.client import ServerClient, ServerError
from eyas.config import DeepseekV3Config
from eyas.train.data import Example
from eyas.train.hidden_states import HiddenStateError, check_dump, new_manifest, pack_shard, write_shards
from eyas.train.import_dumps import load_vllm_file

CONNECTOR = "ExampleHiddenStatesConnector"
LOCK_TIMEOUT_S = 600.0  # how long a file's .lock may stay held before the write counts as lost


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


class ServerHiddenStates:
    """Fetches the hidden states of token ids from a vLLM serving `extract_hidden_states` (see `vllm_command`),
    checks them and deletes the server's file once read. Thread-safe: callers run several requests at once."""

    def __init__(self, client: ServerClient, aux_ids: Sequence[int], num_hidden_layers: int, hidden_size: int,
                 keep_files: bool = False, lock_timeout: float = LOCK_TIMEOUT_S) -> None:
        self.client = client
        self.ids = requested_ids(aux_ids, num_hidden_layers)
        self.hidden_size = hidden_size
        self.keep_files = keep_files
        self.lock_timeout = lock_timeout

    def fetch(self, token_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(aux [T, n_aux, H] in ascending id order, last hidden [T, H] before the final norm) for `token_ids`."""
        token_ids = [int(t) for t in token_ids]
        body = {"model": self.client.model, "prompt": token_ids, "max_tokens": 1, "temperature": 0.0}
        answer = self.client.request("POST", "/v1/completions", body)
        path = (answer.get("kv_transfer_params") or {}).get("hidden_states_path")
        if not path:
            raise ServerError(f"{self.client.url}/v1/completions: the answer has no kv_transfer_params."
                              "hidden_states_path; is it a vLLM started with the command "
                              "`eyas dump-hidden-states --print-vllm-command` prints?")
        path = Path(path)
        try:
            self._wait_written(path)
            tensors = load_vllm_file(path, with_states=True)
        finally:
            if not self.keep_files:
                path.unlink(missing_ok=True)
                path.with_name(path.name + ".lock").unlink(missing_ok=True)
        got = tensors["token_ids"].tolist()
        if got != token_ids:
            first = next((i for i, (a, b) in enumerate(zip(got, token_ids)) if a != b), min(len(got), len(token_ids)))
            raise HiddenStateError(f"{path}: token_ids differ from the {len(token_ids)} sent (it has {len(got)}; "
                                   f"first difference at position {first}); the server tokenized or truncated the "
                                   "prompt, or another request's file was read")
        states = tensors["hidden_states"]
        expected = (len(token_ids), len(self.ids), self.hidden_size)
        if tuple(states.shape) != expected:
            raise HiddenStateError(f"{path}: hidden_states has shape {list(states.shape)}; expected {list(expected)} "
                                   f"(tokens, ids {self.ids}, hidden size): was the server started with "
                                   f"eagle_aux_hidden_state_layer_ids {self.ids}?")
        return states[:, :-1], states[:, -1]

    def _wait_written(self, path: Path) -> None:
        """Block until the connector has released the file's lock (it writes after answering)."""
        lock = path.with_name(path.name + ".lock")
        deadline = time.monotonic() + self.lock_timeout
        while not path.exists() and not lock.exists():
            if time.monotonic() > deadline:
                raise HiddenStateError(f"{path}: the server named this file but it did not appear in "
                                       f"{self.lock_timeout:g} s; does this machine see the server's "
                                       "shared_storage_path at the same path?")
            time.sleep(0.01)
        if not lock.exists():
            return
        with open(lock) as f:
            while True:
                try:
                    fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    return
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise HiddenStateError(f"{path}: still locked by the server after {self.lock_timeout:g} s"
                                               ) from None
                    time.sleep(0.005)


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

    with ThreadPoolExecutor(concurrency, thread_name_prefix="eyas-fetch") as pool:
        def shard(first: int, last: int, progress) -> dict[str, torch.Tensor]:
            def one(example: Example) -> tuple[torch.Tensor, torch.Tensor]:
                aux, last_hidden = states.fetch(example.input_ids)
                progress.update(len(example.input_ids))
                return aux.to(dtype), last_hidden.to(dtype)

            rows = list(pool.map(one, examples[first:last]))
            return pack_shard(examples[first:last], [aux for aux, _ in rows], [last for _, last in rows])

        return write_shards(out_dir, manifest, shard, max_shards, rank, world_size)


class StreamedHiddenStates:
    """Training examples whose hidden states come from the server as the trainer reaches them, nothing kept on disk
    (Model Optimizer's third mode): the batches of the next steps are fetched ahead, at most `ahead` steps, by
    `workers` threads; each server file is deleted once read. The data order stays the trainer's (a function of
    the step), so a resumed run fetches exactly the batches it would have."""

    def __init__(self, states: ServerHiddenStates, examples: Sequence[Example], dtype: torch.dtype,
                 workers: int = 4) -> None:
        self.states, self.examples, self.dtype = states, examples, dtype
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="eyas-stream")
        self.pending: dict[tuple[int, int], Future] = {}  # (step, example index) -> its fetch

    def __len__(self) -> int:
        return len(self.examples)

    def token_examples(self) -> list[Example]:
        return list(self.examples)

    def prefetch(self, step: int, indices: Sequence[int]) -> None:
        for i in indices:
            if (step, i) not in self.pending:
                self.pending[step, i] = self.pool.submit(self._item, i)

    def batch(self, step: int, indices: Sequence[int]) -> list[dict[str, torch.Tensor]]:
        """The items of step `step` (fetched now if they were not prefetched); fetches of earlier steps dropped."""
        self.prefetch(step, indices)
        items = [self.pending.pop((step, i)).result() for i in indices]
        for key in [k for k in self.pending if k[0] <= step]:
            self.pending.pop(key).cancel()
        return items

    def _item(self, i: int) -> dict[str, torch.Tensor]:
        example = self.examples[i]
        aux, last = self.states.fetch(example.input_ids)
        return {"input_ids": torch.tensor(example.input_ids), "loss_mask": torch.tensor(example.loss_mask),
                "aux_hidden_states": aux.to(self.dtype), "last_hidden": last.to(self.dtype)}

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
