"""`eyas train`: train an EAGLE-3 draft head for a target, with train-time test, online (target in process) or
offline (from `eyas dump-hidden-states` shards, or a vLLM serving the hidden states).

This module is the order of things; the parts are components: `config` (the settings and the resume rules),
`batches` (what each step reads), `ttt` (the loss), `checkpointing` (the run's files, when to save, exact resume),
`distributed` (torchrun, FSDP) and `report` (the log, the bar, TensorBoard, the curves). A step reads top to bottom:
learning rate, batch, target features, TTT loss, backward, gradient sum across ranks, clip, optimizer step; then
log, evaluate and save as due. Data parallel under `torchrun`: each rank takes its slice of the global batch and
normalises its loss by the global count of loss positions, so summed gradients are the single-process gradient of
the global batch. With --fsdp the draft's own weights, their gradients and the optimizer state are sharded across
the ranks (FSDP2); the maths is the same, and checkpoints hold whole tensors in the same form either way.
"""

from __future__ import annotations

import contextlib
import math
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from eyas.models.dflash import DFlashDraft, init_dflash_draft, new_dflash_config
from eyas.models.eagle3 import EAGLE31_SWITCHES, Eagle3Draft, init_draft, new_draft_config
from eyas.threads import configure_threads
from eyas.train.batches import Batches, TrainingData, load_training_data, target_features, target_hidden_states
from eyas.train.checkpointing import Checkpointer, RunDir, RunLock, load_sharded_state, load_training_state
from eyas.train.config import TrainConfig, check_resumable, write_recipe
from eyas.train.dflash import BlockObjective, choose_mask_token_id
from eyas.train.distributed import (
    agreed,
    all_reduce_sum,
    process_group,
    setup_distributed,
    shard_draft,
    sum_gradients,
    train_device,
)
from eyas.train.report import StepReport
from eyas.train.ttt import LossKind, TTTLoss
from eyas.train.vocab import training_vocab


def train(cfg: TrainConfig, resume: bool = False, on_step=None) -> dict:
    """Run training; returns the last log record. `on_step(step, record)` is called after each step. OUT is locked
    for the run (checked writable before the target loads): a second run on it refuses, naming the first's PID."""
    with process_group(cfg.device) as (rank, _), RunLock(Path(cfg.out)) if rank == 0 else contextlib.nullcontext():
        run = setup(cfg, resume)
        if run.step >= cfg.max_steps:
            if run.rank == 0:
                print(f"{run.dir.state} is at step {run.step}: nothing to train below --max-steps {cfg.max_steps} "
                      "(raise it to extend the run)", file=sys.stderr)
            return {"step": run.step}
        return train_loop(run, on_step)


@dataclass(slots=True)
class Run:
    """Everything the loop reads, as `setup` built it; the loop changes only `step`."""

    cfg: TrainConfig
    rank: int
    world: int
    device: torch.device
    dir: RunDir
    target: nn.Module  # the whole target (online) or only its head (states from a dump or a server)
    data: TrainingData
    batches: Batches
    draft: Eagle3Draft | DFlashDraft
    loss_fn: TTTLoss | BlockObjective
    fsdp: bool
    names: tuple[str, ...]  # the trained parameters' names, in the optimizer's order
    params: tuple[torch.Tensor, ...]
    optimizer: torch.optim.Optimizer
    report: StepReport
    checkpointer: Checkpointer
    step: int


# -- setup: target, data, draft, optimizer, the step resumed from --------------------------------------------------

def setup(cfg: TrainConfig, resume: bool) -> Run:
    """Everything a run trains with, resumed from OUT's checkpoint with `resume`; on rank 0, OUT prepared (the log
    cut back to the checkpoint's step, the recipe written)."""
    rank, world = setup_distributed(cfg.device)
    device = train_device(cfg.device)
    if cfg.eval_every and cfg.fsdp and world > 1:
        raise ValueError("--eval-every needs the whole draft on one rank; it does not run with --fsdp")
    run_dir = RunDir(Path(cfg.out))
    report = StepReport(run_dir, cfg, rank)
    target = _load_target(cfg, device)
    data = load_training_data(cfg, target)
    if len(data.examples) < cfg.batch_size:
        raise ValueError(f"{len(data.examples)} training examples are fewer than one batch of {cfg.batch_size}")
    if cfg.draft_arch == "dflash":
        draft = _new_block_draft(cfg, target, data, rank)
        loss_fn = BlockObjective(draft, cfg.block_loss, cfg.block_loss_gamma, cfg.block_loss_alpha, cfg.num_anchors,
                                 soft_labels=cfg.block_labels == "soft")
    else:
        draft = _new_draft(cfg, target, data, rank)
        loss_fn = TTTLoss(draft)
    fsdp = cfg.fsdp and world > 1  # one rank has nothing to shard across
    if fsdp:
        shard_draft(loss_fn, world)  # before the optimizer: it must hold the sharded parameters
    frozen = draft.shared_weights + (("lm_head.weight",) if cfg.freeze_lm_head else ())
    names, params = zip(*[(name, p) for name, p in draft.named_parameters() if name not in frozen])
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    run = Run(cfg, rank, world, device, run_dir, target, data, Batches(data, cfg, rank, world, device), draft,
              loss_fn, fsdp, names, params, optimizer, report, Checkpointer(run_dir, cfg), step=0)
    if resume:
        _resume(run)
    if rank == 0:
        run_dir.out.mkdir(parents=True, exist_ok=True)
        report.cut_log(run.step)
        write_recipe(run_dir.recipe, cfg)
        print(f"training a {cfg.draft_arch} draft for {cfg.target}: steps {run.step} -> {cfg.max_steps}, "
              f"{len(data.examples)} examples, batches of {cfg.batch_size} x up to {cfg.max_length} tokens, lr "
              f"{cfg.lr}; writing {run_dir.out} (Ctrl-C saves and stops)", file=sys.stderr)
    return run


def _new_draft(cfg: TrainConfig, target: nn.Module, data: TrainingData, rank: int) -> Eagle3Draft:
    """The draft at step 0, shaped after the target, its vocabulary chosen from the data."""
    d2t, draft_vocab = training_vocab(cfg.vocab_file, cfg.draft_vocab_size, data.examples, target.config.vocab_size,
                                      report=rank == 0)
    config = new_draft_config(target.config, cfg.draft_arch, data.aux_ids, draft_vocab, cfg.intermediate_size,
                              {name: getattr(cfg, name) for name in EAGLE31_SWITCHES})
    draft = init_draft(target, config, d2t, seed=cfg.seed)
    if cfg.freeze_lm_head:
        draft.lm_head.requires_grad_(False)
    return draft


def _new_block_draft(cfg: TrainConfig, target: nn.Module, data: TrainingData, rank: int) -> DFlashDraft:
    """A DFlash draft at step 0 over the data's target layers (aux ids are hidden_states indices: layer i's output
    is hidden_states[i + 1], z-lab's target_layer_ids are the layers), over the target's whole vocabulary unless
    --draft-vocab-size or --vocab-file compress it (z-lab's drafts and vLLM's default are the whole vocabulary)."""
    from eyas.engine.llm import load_tokenizer

    mask = choose_mask_token_id(target.config.vocab_size, load_tokenizer(cfg.target), cfg.mask_token_id)
    d2t, draft_vocab = training_vocab(cfg.vocab_file, cfg.draft_vocab_size or 0, data.examples,
                                      target.config.vocab_size, report=rank == 0)
    config = new_dflash_config(target.config, cfg.num_draft_layers, cfg.block_size,
                               tuple(i - 1 for i in data.aux_ids), mask, cfg.intermediate_size, cfg.block_attention,
                               cfg.block_kv_lora_rank, draft_vocab or None)
    return init_dflash_draft(target, config, seed=cfg.seed, d2t=d2t if config.compressed_vocab else None)


def _resume(run: Run) -> None:
    """The draft, the optimizer and the step from OUT's checkpoint, if it has one made with the same settings."""
    state = load_training_state(run.dir, run.device)
    if state is None:
        if run.rank == 0:
            print(f"no checkpoint in {run.dir.checkpoint}; starting from step 0", file=sys.stderr)
        return
    check_resumable(run.cfg, state["config"], run.dir.state)
    if run.fsdp:
        load_sharded_state(run.draft, run.optimizer, state, run.names)
    else:
        run.draft.load_state_dict(state["draft"], strict=False)
        run.optimizer.load_state_dict(state["optimizer"])
    run.step = state["step"]


def _load_target(cfg: TrainConfig, device: torch.device) -> nn.Module:
    """The frozen target; only its head when the hidden states come from elsewhere (a dump, a server)."""
    from eyas.checkpoint import load_model, load_target_head

    if cfg.hidden_states or cfg.hidden_states_server:
        target = load_target_head(cfg.target, dtype=cfg.target_dtype, device=device)
    else:
        target = load_model(cfg.target, dtype=cfg.target_dtype, device=device)
    target.requires_grad_(False)
    configure_threads(target, cfg.threads)
    return target


# -- the loop -------------------------------------------------------------------------------------------------------

def train_loop(run: Run, on_step: Callable[[int, dict], None] | None = None) -> dict:
    """Train from `run.step` to max_steps (or a Ctrl-C); returns the last log record. Each step: train_step, then
    evaluate, log and save as due."""
    cfg = run.cfg
    record: dict = {}
    tokens, start = 0, time.perf_counter()
    taught = False  # whether any step had a loss: a draft vocabulary holding none of the target's tokens has none
    # on any error too: streamed batches' fetches still in flight are cancelled, the bar leaves the terminal line
    with contextlib.ExitStack() as cleanup, StopOnInterrupt() as interrupt:
        run.report.start(run.step)
        cleanup.callback(run.report.close)
        cleanup.callback(run.batches.close)
        while run.step < cfg.max_steps:
            record = train_step(run)
            taught = taught or record.get("loss", 0.0) > 0
            tokens += record.pop("tokens")
            record["tokens_per_s"] = round(tokens * run.world / (time.perf_counter() - start), 1)
            if cfg.eval_every and run.rank == 0 and (run.step % cfg.eval_every == 0 or run.step == cfg.max_steps):
                record["eval_acceptance_length"] = _measure_acceptance(run)
            run.report.step(record)
            # every rank must take the same decision: a sharded save gathers from all of them
            stop, overdue = agreed(run.world, interrupt.requested, run.checkpointer.overdue())
            if run.checkpointer.due(run.step, stop, overdue):
                run.checkpointer.save(run.draft, run.optimizer, run.step, run.names, run.rank, run.fsdp)
            if on_step is not None:
                on_step(run.step, record)
            if stop:
                record["interrupted"] = True
                break
    if run.rank == 0:
        _finish(run, record, taught, time.perf_counter() - start)
    return record


def train_step(run: Run) -> dict:
    """One optimizer step on this rank's slice of the step's global batch; returns its log record (with the
    number of batch positions this rank read, as `tokens`)."""
    for group in run.optimizer.param_groups:
        group["lr"] = lr_at(run.cfg, run.step)
    batch = run.batches.at(run.step)
    return block_step(run, batch) if isinstance(run.loss_fn, BlockObjective) else ttt_step(run, batch)


def ttt_step(run: Run, batch: dict[str, torch.Tensor]) -> dict:
    """An EAGLE-3 draft's step: the train-time-test loss, each TTT position normalised by its global count."""
    cfg, step = run.cfg, run.step
    aux, target_logits = target_features(run.target, batch, run.data.aux_ids, run.data.last_hidden_post_norm)
    with cfg.autocast(run.device):
        result = run.loss_fn(batch["input_ids"], batch["loss_mask"], aux, target_logits, cfg.ttt_steps,
                             cfg.loss_decay, LossKind(cfg.loss, cfg.lk_lambda_scale, cfg.lk_lambda_decay))
    counts = all_reduce_sum(torch.stack(result.counts).detach(), run.world)
    loss = sum(cfg.loss_decay ** k * s / counts[k].clamp(min=1) for k, s in enumerate(result.loss_sums))
    grad_norm = _optimize(run, loss)
    stats = all_reduce_sum(torch.stack([torch.stack(result.loss_sums).detach(), torch.stack(result.correct)]),
                           run.world)
    per_step_loss = (stats[0] / counts.clamp(min=1)).tolist()
    return {"step": run.step, "loss": round(sum(cfg.loss_decay ** k * x for k, x in enumerate(per_step_loss)), 5),
            "lr": lr_at(cfg, step), "grad_norm": round(grad_norm, 4),
            "loss_per_step": [round(x, 5) for x in per_step_loss],
            "acc_per_step": [round(x, 5) for x in (stats[1] / counts.clamp(min=1)).tolist()],
            "tokens": int(batch["loss_mask"].numel())}


def block_step(run: Run, batch: dict[str, torch.Tensor]) -> dict:
    """A DFlash draft's step: blocks at each sequence's anchors, drawn from (seed, step, the example's index in the
    data), so that any split over ranks draws the anchors one process would; the loss is the global batch's
    weighted sum over its global weight."""
    cfg, step = run.cfg, run.step
    if cfg.block_labels == "soft":
        aux, target_logits = target_features(run.target, batch, run.data.aux_ids, run.data.last_hidden_post_norm)
    else:
        (aux, _), target_logits = target_hidden_states(run.target, batch, run.data.aux_ids), None
    generators = [torch.Generator().manual_seed(cfg.seed * 1_000_003 + step * 100_003 + i)
                  for i in run.batches.indices(step)]
    with cfg.autocast(run.device):
        terms = run.loss_fn(batch["input_ids"], batch["loss_mask"], aux, generators, target_logits)
    weight = all_reduce_sum(terms.weight_sum, run.world)
    grad_norm = _optimize(run, terms.weighted_sum / weight.clamp(min=1e-12))
    ce_per_row, rows, correct = all_reduce_sum(torch.stack([terms.ce_per_row, terms.rows, terms.correct]), run.world)
    loss = all_reduce_sum(terms.weighted_sum.detach().clone(), run.world) / weight.clamp(min=1e-12)
    return {"step": run.step, "loss": round(loss.item(), 5), "lr": lr_at(cfg, step), "grad_norm": round(grad_norm, 4),
            "loss_per_step": [round(x, 5) for x in (ce_per_row / rows.clamp(min=1)).tolist()],
            "acc_per_step": [round(x, 5) for x in (correct / rows.clamp(min=1)).tolist()],
            "tokens": int(batch["loss_mask"].numel())}


def _optimize(run: Run, loss: torch.Tensor) -> float:
    """Backward, the ranks' gradients summed, clipped, one optimizer step; returns the gradient norm."""
    run.optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if not run.fsdp:  # FSDP's backward has reduce-scattered them already
        sum_gradients(run.params, run.world)
    grad_norm = torch.nn.utils.clip_grad_norm_(run.params, run.cfg.grad_clip).item()
    run.optimizer.step()
    run.step += 1
    return grad_norm


def _measure_acceptance(run: Run) -> float:
    from eyas.eval.acceptance import measure_acceptance

    cfg = run.cfg
    return measure_acceptance(cfg.target, run.draft, str(run.device), cfg.eval_prompts, cfg.eval_num_prompts,
                              cfg.eval_max_new_tokens, cfg.threads)


def _finish(run: Run, record: dict, taught: bool, seconds: float) -> None:
    """The curves drawn, and what became of the run said (an error when nothing was taught)."""
    run.report.plot()
    how = "interrupted; continue with --resume" if record.get("interrupted") else "done"
    print(f"step {run.step} of {run.cfg.max_steps} ({how}) after {seconds / 60:.1f} min: draft in {run.dir.draft}, "
          f"checkpoint in {run.dir.state}", file=sys.stderr)
    if record and not taught:
        record["nothing_taught"] = True
        print("error: every step's loss was 0: no position was taught, so the draft learned nothing. The draft "
              "vocabulary holds none of the target's next tokens at the loss positions (too little data to "
              "choose one from?): train with --draft-vocab-size 0 (the whole vocabulary), or more data",
              file=sys.stderr)


class StopOnInterrupt:
    """Ctrl-C (SIGINT) during training: the first one asks the loop to finish the step in progress, save a
    checkpoint and stop; a second one interrupts at once, without saving."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = None

    def __enter__(self) -> StopOnInterrupt:
        if threading.current_thread() is threading.main_thread():  # signal handlers live on the main thread only
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print("\ninterrupted: saving a checkpoint after this step (Ctrl-C again to stop without saving)",
              file=sys.stderr)

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warmup, then a cosine down to min_lr_ratio x lr at max_steps; a run extended on resuming (a larger
    --max-steps) stretches the cosine from where it is."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
