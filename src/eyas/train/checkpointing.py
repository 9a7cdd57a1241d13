"""A training run's directory and its checkpoints: every file a run writes is named once, by `RunDir`; a checkpoint
is written atomically and carries everything an exact `--resume` needs (the draft's own weights, the optimizer
state, the step, the settings the run must keep); the `Checkpointer` decides when one is due and writes it, whole
or gathered from FSDP shards."""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from eyas.models.dflash import DFlashDraft
from eyas.models.eagle3 import Eagle3Draft
from eyas.train.config import TrainConfig, comparable


@dataclass(frozen=True, slots=True)
class RunDir:
    """The files of a training run in OUT."""

    out: Path

    @property
    def draft(self) -> Path:  # the servable draft, eyas's layout
        return self.out / "draft"

    @property
    def checkpoint(self) -> Path:
        return self.out / "checkpoint"

    @property
    def state(self) -> Path:  # what --resume reads
        return self.checkpoint / "state.pt"

    @property
    def previous_state(self) -> Path:  # kept until a new state.pt is in place
        return self.checkpoint / "state.prev.pt"

    @property
    def log(self) -> Path:  # one JSON record per step
        return self.out / "train_log.jsonl"

    @property
    def curves(self) -> Path:
        return self.out / "train_curves.png"

    @property
    def recipe(self) -> Path:  # every setting, as `eyas train --config` reads it back
        return self.out / "train_config.yaml"

    @property
    def tensorboard(self) -> Path:  # event files, with --report-to tensorboard
        return self.out / "tensorboard"

    @property
    def wandb(self) -> Path:  # an offline wandb run, with --report-to wandb
        return self.out / "wandb"

    @property
    def lock(self) -> Path:
        return self.out / ".lock"


class RunLock:
    """OUT/.lock, flock'ed for as long as a run trains into OUT; the file holds the run's PID and is removed when
    the run ends."""

    def __init__(self, out: Path) -> None:
        self.out, self.path = out, RunDir(out).lock
        self.file = None

    def __enter__(self) -> RunLock:
        import fcntl

        for _ in range(10):
            try:
                self.out.mkdir(parents=True, exist_ok=True)
                self.file = open(self.path, "a+")
            except OSError as e:
                raise ValueError(f"cannot write the output directory {self.out}: {e.strerror or e}") from e
            try:
                fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError as e:
                self.file.seek(0)
                pid = self.file.read().strip() or "unknown"
                self.file.close()
                raise ValueError(f"{self.out} is in use by another training run (PID {pid}); wait for it to end, "
                                 "or train into another --out") from e
            # a run that just ended removed the file this one opened: lock the path's file, not a removed one
            if self.path.exists() and os.stat(self.path).st_ino == os.fstat(self.file.fileno()).st_ino:
                break
            self.file.close()
        else:
            raise ValueError(f"{self.path} keeps being replaced; is another run starting and stopping in {self.out}?")
        self.file.seek(0)
        self.file.truncate()
        self.file.write(f"{os.getpid()}\n")
        self.file.flush()
        return self

    def __exit__(self, *exc) -> None:
        import fcntl

        with contextlib.suppress(OSError):  # removed while still held, so no other run can hold a removed file
            self.path.unlink()
        fcntl.flock(self.file, fcntl.LOCK_UN)
        self.file.close()


def load_training_state(run_dir: RunDir, device: torch.device) -> dict | None:
    """The newest readable training state of the run: state.pt, else the one before it (a state.pt truncated or
    corrupted after it was written); None when there is neither."""
    for path in (run_dir.state, run_dir.previous_state):
        if not path.is_file():
            continue
        try:
            state = torch.load(path, weights_only=True, map_location=device)
        except pickle.UnpicklingError as e:  # torch's own text advises weights_only=False: never show it
            found = re.search(r"GLOBAL (\S+)", str(e))
            print(f"{path} holds objects other than tensors ({found.group(1) if found else 'not a training state'}): "
                  "refused; trying the checkpoint before it", file=sys.stderr)
            continue
        except (RuntimeError, EOFError, ValueError, OSError) as e:  # what torch.load raises for a cut file
            print(f"{path} cannot be read ({type(e).__name__}: {str(e)[:120]}); trying the checkpoint before it",
                  file=sys.stderr)
            continue
        if (isinstance(state, dict) and isinstance(state.get("step"), int) and
                all(isinstance(state.get(k), dict) for k in ("config", "draft", "optimizer"))):
            return state
        print(f"{path} is not a training state (expected a mapping of step, config, draft and optimizer); trying "
              "the checkpoint before it", file=sys.stderr)
    if run_dir.state.is_file():
        raise ValueError(f"{run_dir.checkpoint}: no readable training state ({run_dir.state.name} and "
                         f"{run_dir.previous_state.name} are damaged, refused or missing)")
    return None


def save_checkpoint(run_dir: RunDir, draft: Eagle3Draft | DFlashDraft, optimizer_state: dict, step: int,
                    cfg: TrainConfig) -> None:
    """Atomically: the training state (for --resume) and the draft itself, servable (eyas's layout; a DFlash
    draft in z-lab's)."""
    from eyas.export import save_dflash_draft, save_draft

    run_dir.checkpoint.mkdir(parents=True, exist_ok=True)
    own = {k: v for k, v in draft.state_dict().items() if k not in draft.shared_weights}
    tmp = run_dir.state.with_name(run_dir.state.name + ".tmp")
    torch.save({"draft": own, "optimizer": optimizer_state, "step": step, "config": comparable(cfg)}, tmp)
    if run_dir.state.is_file():  # kept until the new one is in place: a state.pt cut short falls back to it
        os.replace(run_dir.state, run_dir.previous_state)
    os.replace(tmp, run_dir.state)
    if isinstance(draft, DFlashDraft):
        save_dflash_draft(draft, run_dir.draft)  # z-lab's layout, which eyas, vLLM and SGLang load
    else:
        save_draft(draft, run_dir.draft, fmt="eyas")


def save_sharded_checkpoint(run_dir: RunDir, draft: Eagle3Draft | DFlashDraft, optimizer: torch.optim.Optimizer,
                            step: int, cfg: TrainConfig, names: tuple[str, ...], rank: int) -> None:
    """save_checkpoint for a sharded draft; every rank must call it. The shards are gathered to rank 0 as whole CPU
    tensors and written in exactly an unsharded run's form, so --resume works with or without --fsdp, at any world
    size, and OUT/draft is the whole draft."""
    from torch.distributed.checkpoint import state_dict as dcp

    from eyas.weights import assign_weights

    whole = dcp.StateDictOptions(full_state_dict=True, cpu_offload=True)  # rank 0 gets every tensor, the others none
    model_state = dcp.get_model_state_dict(draft, options=whole)
    optimizer_state = dcp.get_optimizer_state_dict(draft, optimizer, options=whole)
    if rank != 0:
        return
    # a plain draft to export: built on the meta device (no memory, no draw on the global RNG), then every tensor of
    # its own is assigned from the gathered state; the embedding stays the target's module
    block = isinstance(draft, DFlashDraft)
    with torch.device("meta"):
        plain = DFlashDraft(draft.config, draft.embed_tokens, draft.lm_head) if block else \
            Eagle3Draft(draft.config, draft.embed_tokens)
    own = {k: v for k, v in model_state.items() if k not in plain.shared_weights}
    assign_weights(plain, own, "the gathered draft", "cpu", shared=set(plain.shared_weights))
    save_checkpoint(run_dir, plain, _renumber(optimizer_state, {name: i for i, name in enumerate(names)}), step, cfg)


def load_sharded_state(draft: Eagle3Draft, optimizer: torch.optim.Optimizer, state: dict,
                       names: tuple[str, ...]) -> None:
    """Load a checkpoint's whole tensors into a sharded draft and its optimizer; each rank keeps its shards."""
    from torch.distributed.checkpoint import state_dict as dcp

    options = dcp.StateDictOptions(full_state_dict=True, strict=False)  # the embedding is not in the checkpoint
    dcp.set_model_state_dict(draft, state["draft"], options=options)
    dcp.set_optimizer_state_dict(draft, optimizer, _renumber(state["optimizer"], names), options=options)


def _renumber(optimizer_state: dict, key) -> dict:
    """optimizer.state_dict() numbers the parameters in order (0, 1, ...); torch.distributed.checkpoint names them
    ("fc.weight", ...). `key` maps one to the other: the names in order, or {name: number}."""
    return {"state": {key[k]: s for k, s in optimizer_state["state"].items()},
            "param_groups": [{**g, "params": [key[k] for k in g["params"]]} for g in optimizer_state["param_groups"]]}


class Checkpointer:
    """When a checkpoint is due (every `save_every` steps, at the last step, on a stop, or when `save_minutes` have
    passed since the last one) and writing it: whole from rank 0, or gathered from every rank's shards."""

    def __init__(self, run_dir: RunDir, cfg: TrainConfig) -> None:
        self.run_dir, self.cfg = run_dir, cfg
        self.last_save = time.monotonic()

    def overdue(self) -> bool:
        """Whether `save_minutes` have passed since the last save (each rank's own clock: agree on it first)."""
        return time.monotonic() - self.last_save >= self.cfg.save_minutes * 60

    def due(self, step: int, stop: bool, overdue: bool) -> bool:
        return step % self.cfg.save_every == 0 or step == self.cfg.max_steps or stop or overdue

    def save(self, draft: Eagle3Draft, optimizer: torch.optim.Optimizer, step: int, names: tuple[str, ...],
             rank: int, sharded: bool) -> None:
        if sharded:  # gathering the shards takes every rank
            save_sharded_checkpoint(self.run_dir, draft, optimizer, step, self.cfg, names, rank)
        elif rank == 0:
            save_checkpoint(self.run_dir, draft, optimizer.state_dict(), step, self.cfg)
        self.last_save = time.monotonic()
