"""How many CPU threads torch runs on: one rule, decided from the model and its device, for every command and `LLM`.

A small model on CPU runs fastest on one thread: its matmuls are too small to amortise the threads' synchronisation,
and a second thread competes with everything else on the machine (the tokenizer, an HTTP server, other processes).
Measured on a 2-core AMD EPYC, greedy decode, 1 thread against 2: the bundled 10.7M-parameter target 1.6x faster on
one thread; a 72M-parameter one (hidden 512) 1.4x faster at batch 1 and 1.16x slower at batch 8; a 249M-parameter one
(hidden 1024) 1.4x slower at batch 1. So below SMALL_MODEL_PARAMS one thread, above it (and on GPUs, where the host
threads only feed the device) torch's own choice: one per physical core.
"""

from __future__ import annotations

import torch
from torch import nn

SMALL_MODEL_PARAMS = 100_000_000

THREADS_HELP = (f"torch CPU threads (default: 1 on CPU for models under {SMALL_MODEL_PARAMS // 10**6}M parameters, "
                "where one thread is fastest; otherwise torch's choice, one per physical core)")

_TORCH_DEFAULT = torch.get_num_threads()  # torch's own choice, read before anything here changes it
_parallel_threads = 1  # see parallel_threads; set by configure_threads


def default_num_threads(num_params: int, device: torch.device | str) -> int:
    """The thread count the rule picks for a model of `num_params` parameters on `device`."""
    if torch.device(device).type == "cpu" and num_params < SMALL_MODEL_PARAMS:
        return 1
    return _TORCH_DEFAULT


def configure_threads(model: nn.Module, threads: int | None = None) -> int:
    """Set torch's thread count for running `model`: `threads` when given, else the rule. Returns the count set."""
    global _parallel_threads
    if threads is not None and threads < 1:
        raise ValueError(f"threads must be at least 1, got {threads}")
    _parallel_threads = threads if threads is not None else _TORCH_DEFAULT
    if threads is None:
        first = next(model.parameters(), None)
        device = first.device if first is not None else torch.device("cpu")
        threads = default_num_threads(sum(p.numel() for p in model.parameters()), device)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return threads


def parallel_threads() -> int:
    """The threads one large call may use where the rule above picked fewer: attention over the contexts of a
    large batch, which reads megabytes of cache per layer and splits evenly over its sequences. The --threads given,
    else torch's own choice (one per physical core). Measured on a 2-core AMD EPYC, batch 32 over 190-token
    contexts: a decode step of the bundled target 23.1 ms with attention on 2 threads, 30.1 ms on 1."""
    return _parallel_threads
