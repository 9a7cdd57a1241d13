"""`eyas train`: train an EAGLE-3 draft head for a target, with train-time test, online (target in process) or
offline (from `eyas dump-hidden-states` shards).

The loop reads top to bottom: learning-rate schedule, batch, target features, TTT loss, clip, step, log, checkpoint.
Checkpoints are atomic and carry everything needed for an exact `--resume`: draft and optimizer state, the step,
the config the run was made with. Batches are a pure function of (seed, step), so a resumed run sees the batches
the uninterrupted run would have seen. Data parallel under `torchrun` (gloo on CPU, nccl on GPU): each rank takes
its slice of the global batch, normalises its loss by the global count of loss positions, and the gradients are
summed across ranks, so every rank steps with exactly the single-process gradient of the global batch. With
--fsdp the draft's own weights, their gradients and the optimizer state are sharded across the ranks (FSDP2) for
drafts too large to replicate; the maths is the same, and checkpoints hold whole tensors in the same form either way.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import pickle
import re
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

from eyas.aux_layers import AuxConvention, default_aux_layer_ids, to_hidden_state_ids
from eyas.config import DeepseekV3Config, RopeConfig
from eyas.models.deepseek_v3 import DeepseekV3ForCausalLM
from eyas.models.eagle3 import EAGLE31_SWITCHES, Eagle3Config, Eagle3Draft, target_ids_of
from eyas.paths import DEFAULT_DATA, DEFAULT_EVAL_PROMPTS, DEFAULT_MODEL
from eyas.threads import THREADS_HELP, configure_threads
from eyas.train.ttt import LOSSES, LossKind, TTTOutput, read_positions, ttt_loss


@dataclass(slots=True)
class TrainConfig:
    target: str
    out: str
    data: str | None = None  # JSONL conversations or text (online)
    hidden_states: str | None = None  # a dump-hidden-states directory (offline)
    # a vLLM serving extract_hidden_states: the states of --data's records fetched as training reaches them
    hidden_states_server: str | None = None
    served_model_name: str | None = None
    api_key: str | None = None  # for the server; never written to the run's recipe
    # that server's shared_storage_path: the only directory whose files it names are read (and deleted once read)
    vllm_storage: str | None = None
    keep_server_files: bool = False
    draft_arch: str = "mla"
    # None: auto (auto_draft_vocab_size: the ids covering 95% of the loss tokens, if under half the vocabulary);
    # 0: the target's whole vocabulary; N: the N most frequent loss tokens
    draft_vocab_size: int | None = None
    vocab_file: str | None = None  # d2t/t2d from `eyas calibrate-vocab`
    aux_layer_ids: list[int] | None = None
    aux_layer_convention: str = "hidden_states"
    intermediate_size: int = 0  # 0: the target's dense intermediate size
    freeze_lm_head: bool = False  # keep the target's lm_head rows as they are (fewer trained weights, faster)
    # EAGLE-3.1 switches of the draft (see Eagle3Config), recorded in its config.json
    fc_norm: bool = False
    norm_before_fc: bool = False
    norm_output: bool = False
    norm_before_residual: bool = False
    ttt_steps: int = 3
    loss_decay: float = 0.9
    loss: str = "kl"  # kl (soft cross-entropy), lk-alpha or lk-lambda (acceptance-aware: see eyas.train.ttt)
    lk_lambda_scale: float = 1.0
    lk_lambda_decay: float = 1.0
    # 3e-3 was the best of 1e-3 / 3e-3 / 6e-3 for both eyas and Model Optimizer on the bundled target (600 steps of
    # 4 x 128, benchmarks/modelopt_compare.py); EAGLE's published recipes for 8B+ targets use 5e-5..1e-4
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    max_steps: int = 600
    batch_size: int = 4  # global, over all ranks
    max_length: int = 1024
    grad_clip: float = 0.5
    weight_decay: float = 0.0
    save_every: int = 100  # steps; a checkpoint is also written every save_minutes, at the end and on Ctrl-C
    save_minutes: float = 5.0
    log_every: int = 10
    eval_every: int = 0  # steps between acceptance measurements through the engine (0: none)
    eval_prompts: str | None = None  # JSONL prompts for them (default: the bundled held-out prompts)
    eval_num_prompts: int = 8
    eval_max_new_tokens: int = 64
    seed: int = 0
    threads: int | None = None  # torch CPU threads (None: the rule in eyas.threads)
    fsdp: bool = False  # shard the draft's trained weights, grads and optimizer state across torchrun ranks
    device: str = "cpu"  # "cuda": each torchrun rank uses cuda:LOCAL_RANK
    # the frozen target's dtype (auto: float32 on CPU, bfloat16 on accelerators)
    target_dtype: str = "auto"
    # the draft's forward and backward under bfloat16 autocast, its weights and optimizer state kept in float32
    # (auto: bf16 on accelerators, no on CPU)
    mixed_precision: str = "auto"

    def __post_init__(self) -> None:
        if (self.data is None) == (self.hidden_states is None):
            raise ValueError("give exactly one of --data (online training) or --hidden-states (offline)")
        if self.hidden_states_server and self.data is None:
            raise ValueError("--hidden-states-server needs --data: the records whose hidden states it serves")
        if self.hidden_states_server and not self.vllm_storage:
            raise ValueError("--hidden-states-server needs --vllm-storage DIR: the shared_storage_path that vLLM "
                             "was started with (only files inside it are read)")
        if self.draft_arch not in ("mla", "mha"):
            raise ValueError(f"--draft-arch is {self.draft_arch!r}; expected mla or mha")
        if self.ttt_steps < 1 or not 0 < self.loss_decay <= 1:
            raise ValueError("--ttt-steps must be >= 1 and --loss-decay in (0, 1]")
        if self.batch_size < 1 or self.max_steps < 1:
            raise ValueError("--batch-size and --max-steps must be positive")
        if self.mixed_precision not in ("auto", "no", "bf16"):
            raise ValueError(f"--mixed-precision is {self.mixed_precision!r}; expected auto, no or bf16")
        LossKind(self.loss, self.lk_lambda_scale, self.lk_lambda_decay)  # checks the name
        if self.fc_norm and self.norm_before_fc:
            raise ValueError("--fc-norm and --norm-before-fc exclude each other: the aux states are normed one way "
                             "(a norm per state, or one over their concatenation)")
        if self.save_every < 1 or self.save_minutes <= 0 or self.eval_every < 0 or self.eval_num_prompts < 1:
            raise ValueError("--save-every, --save-minutes and --eval-num-prompts must be positive and "
                             "--eval-every at least 0")

    def autocast(self, device: torch.device) -> torch.autocast:
        """The context the draft's loss runs in: bfloat16 matmuls (float32 weights) or plain float32."""
        enabled = self.mixed_precision == "bf16" or (self.mixed_precision == "auto" and device.type != "cpu")
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled)


# -- the draft at step 0 ----------------------------------------------------------------------------------------

def new_draft_config(target: DeepseekV3Config, arch: str, aux_ids: tuple[int, ...], draft_vocab_size: int,
                     intermediate_size: int = 0, switches: dict[str, bool] | None = None) -> Eagle3Config:
    """A one-layer draft shaped after the target: its attention dims (MLA) or its head count (MHA), its rope;
    `switches` sets the EAGLE-3.1 ones (fc_norm, norm_before_fc, norm_output, norm_before_residual)."""
    H = target.hidden_size
    common = dict(**(switches or {}), hidden_size=H, target_hidden_size=H, vocab_size=target.vocab_size,
                  draft_vocab_size=draft_vocab_size or target.vocab_size, num_aux_hidden_states=len(aux_ids),
                  aux_hidden_state_ids=tuple(aux_ids), aux_convention_assumed="hidden_states (eyas train)",
                  intermediate_size=intermediate_size or target.intermediate_size, rms_norm_eps=target.rms_norm_eps,
                  max_position_embeddings=target.max_position_embeddings,
                  num_attention_heads=target.num_attention_heads, source="eyas train")
    if arch == "mla":
        mla = DeepseekV3Config(
            vocab_size=target.vocab_size, hidden_size=H, intermediate_size=common["intermediate_size"],
            num_hidden_layers=1, num_attention_heads=target.num_attention_heads, kv_lora_rank=target.kv_lora_rank,
            qk_nope_head_dim=target.qk_nope_head_dim, qk_rope_head_dim=target.qk_rope_head_dim,
            v_head_dim=target.v_head_dim, rope=target.rope, max_position_embeddings=target.max_position_embeddings,
            q_lora_rank=target.q_lora_rank, rms_norm_eps=target.rms_norm_eps, source="eyas train")
        return Eagle3Config(arch="mla", rope=target.rope, mla=mla, **common)
    head_dim = H // target.num_attention_heads
    r = target.rope
    rope = RopeConfig(head_dim=head_dim, theta=r.theta, type=r.type, factor=r.factor,
                      original_max_position_embeddings=r.original_max_position_embeddings, beta_fast=r.beta_fast,
                      beta_slow=r.beta_slow, mscale=r.mscale, mscale_all_dim=r.mscale_all_dim, interleave=False)
    return Eagle3Config(arch="mha", rope=rope, num_key_value_heads=target.num_attention_heads, head_dim=head_dim,
                        **common)


def init_draft(target: DeepseekV3ForCausalLM, config: Eagle3Config, d2t: torch.Tensor | None = None,
               seed: int = 0) -> Eagle3Draft:
    """Random projections (std 0.02), unit norms, the target's embedding (shared, frozen) and its lm_head rows for
    the draft vocabulary (copied, trained). The final norm starts as the target's: the head it feeds was trained on
    inputs with that gain (on 600-step runs against the shipped target this raised AL in 3 of 4 runs, tied 1)."""
    torch.manual_seed(seed)
    draft = Eagle3Draft(config, target.model.embed_tokens)
    for name, p in draft.named_parameters():
        if name.startswith("embed_tokens"):
            continue
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.02)
        else:
            torch.nn.init.ones_(p)
    rows = torch.arange(config.vocab_size)
    if config.compressed_vocab:
        if d2t is None or d2t.shape[0] != config.draft_vocab_size:
            raise ValueError(f"a draft vocabulary of {config.draft_vocab_size} needs a d2t map of that length")
        draft.d2t.copy_(d2t)
        rows = target_ids_of(d2t)
        draft.t2d.zero_()
        draft.t2d[rows] = True
    with torch.no_grad():
        draft.lm_head.weight.copy_(target.lm_head.weight[rows])
        draft.norm.weight.copy_(target.model.norm.weight)
    # initialised on the CPU (the same numbers whatever the device), then moved next to the target; the draft's own
    # weights stay float32 whatever the target's dtype (the shared embedding keeps the target's)
    return draft.to(device=target.lm_head.weight.device)


# -- data ---------------------------------------------------------------------------------------------------------

def batch_indices(num_examples: int, step: int, batch_size: int, seed: int) -> list[int]:
    """The global batch for `step`: consecutive slices of one seeded permutation per epoch."""
    per_epoch = max(1, num_examples // batch_size)
    epoch, k = divmod(step, per_epoch)
    order = torch.randperm(num_examples, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
    return order[k * batch_size:(k + 1) * batch_size].tolist()


def collate(items: list[dict], max_length: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest item (padding is masked out of the loss and, being last, invisible to causal
    attention of the real tokens)."""
    T = min(max_length, max(len(item["input_ids"]) for item in items))
    out = {"input_ids": torch.zeros(len(items), T, dtype=torch.long), "loss_mask": torch.zeros(len(items), T)}
    extra = [k for k in ("aux_hidden_states", "last_hidden") if k in items[0]]
    for key in extra:
        out[key] = items[0][key].new_zeros((len(items), T, *items[0][key].shape[1:]))
    for b, item in enumerate(items):
        n = min(T, len(item["input_ids"]))
        out["input_ids"][b, :n] = torch.as_tensor(item["input_ids"][:n])
        out["loss_mask"][b, :n] = torch.as_tensor(item["loss_mask"][:n], dtype=torch.float32)
        for key in extra:
            out[key][b, :n] = item[key][:n]
    return out


@torch.no_grad()
def target_features(target: DeepseekV3ForCausalLM, batch: dict, aux_ids: tuple[int, ...],
                    last_hidden_post_norm: bool = False):
    """(aux [B, T, n_aux, H], target logits [R, vocab]) from a dumped batch or by running the target.

    Logits only at the R positions a loss reads (`read_positions`, row-major): in chat data the prompts and the
    padding are many positions, and the vocab-wide head is the target's largest matmul. A dump whose last hidden
    state is already past the final norm (`last_hidden_post_norm`, from its manifest: some tools store it so)
    goes straight to the head; normed twice, the teacher would be another distribution."""
    if "aux_hidden_states" in batch:
        aux = batch["aux_hidden_states"].to(target.lm_head.weight.dtype)
        last = batch["last_hidden"].to(target.lm_head.weight.dtype)
    else:
        from eyas.train.hidden_states import capture_hidden_states

        aux, last = capture_hidden_states(target, batch["input_ids"], aux_ids)
        last_hidden_post_norm = False  # captured here: before the norm
    read = read_positions(batch["loss_mask"].to(last.device))
    normed = last[read] if last_hidden_post_norm else target.model.norm(last[read])
    return aux, target.compute_logits(normed)


# -- the loop -----------------------------------------------------------------------------------------------------

def train(cfg: TrainConfig, resume: bool = False, on_step=None) -> dict:
    """Run training; returns the last log record. `on_step(step, record)` is called after each step. OUT is locked
    for the run (checked writable before the target loads): a second run on it refuses, naming the first's PID."""
    rank, _ = setup_distributed(cfg.device)
    with RunLock(Path(cfg.out)) if rank == 0 else contextlib.nullcontext():
        return _train(cfg, resume, on_step)


class RunLock:
    """OUT/.lock, flock'ed for as long as a run trains into OUT; the file holds the run's PID and is removed when
    the run ends."""

    def __init__(self, out: Path) -> None:
        self.out, self.path = out, out / ".lock"
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


@dataclass(slots=True)
class Run:
    """Everything the loop reads, as `setup` built it; the loop changes only `step`."""

    cfg: TrainConfig
    rank: int
    world: int
    device: torch.device
    out: Path
    target: nn.Module  # the whole target (online) or only its head (states from a dump or a server)
    examples: Any  # list of {"input_ids", "loss_mask"} (online), HiddenStateShards or StreamedHiddenStates
    streamed: Any  # the StreamedHiddenStates of --hidden-states-server, else None
    aux_ids: tuple[int, ...]
    last_hidden_post_norm: bool
    draft: Eagle3Draft
    loss_fn: TTTLoss
    fsdp: bool
    names: tuple[str, ...]  # the trained parameters' names, in the optimizer's order
    params: tuple[torch.Tensor, ...]
    optimizer: torch.optim.Optimizer
    step: int

    @property
    def log_path(self) -> Path:
        return self.out / "train_log.jsonl"

    @property
    def state_path(self) -> Path:
        return self.out / "checkpoint" / "state.pt"


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warmup, then a cosine down to min_lr_ratio x lr at max_steps; a run extended on resuming (a larger
    --max-steps) stretches the cosine from where it is."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def _train(cfg: TrainConfig, resume: bool, on_step) -> dict:
    run = setup(cfg, resume)
    if run.step >= cfg.max_steps:
        if run.rank == 0:
            print(f"{run.state_path} is at step {run.step}: nothing to train below --max-steps {cfg.max_steps} "
                  "(raise it to extend the run)", file=sys.stderr)
        return {"step": run.step}
    return train_loop(run, on_step)


# -- setup: target, data, draft, optimizer, the step resumed from --------------------------------------------------

def setup(cfg: TrainConfig, resume: bool) -> Run:
    """Everything a run trains with, resumed from OUT's checkpoint with `resume`; on rank 0, OUT prepared (the log
    cut back to the checkpoint's step, the recipe written)."""
    rank, world = setup_distributed(cfg.device)
    device = train_device(cfg.device)
    if cfg.eval_every and cfg.fsdp and world > 1:
        raise ValueError("--eval-every needs the whole draft on one rank; it does not run with --fsdp")
    target = _load_target(cfg, device)
    examples, streamed, aux_ids, last_hidden_post_norm = _training_data(cfg, target)
    if len(examples) < cfg.batch_size:
        raise ValueError(f"{len(examples)} training examples are fewer than one batch of {cfg.batch_size}")
    d2t, draft_vocab = _draft_vocabulary(cfg, examples, target.config.vocab_size, rank)
    draft_config = new_draft_config(target.config, cfg.draft_arch, aux_ids, draft_vocab, cfg.intermediate_size,
                                    {name: getattr(cfg, name) for name in EAGLE31_SWITCHES})
    draft = init_draft(target, draft_config, d2t, seed=cfg.seed)
    if cfg.freeze_lm_head:
        draft.lm_head.requires_grad_(False)
    loss_fn = TTTLoss(draft)
    fsdp = cfg.fsdp and world > 1  # one rank has nothing to shard across
    if fsdp:
        shard_draft(loss_fn, world)  # before the optimizer: it must hold the sharded parameters
    frozen = ("embed_tokens", "lm_head") if cfg.freeze_lm_head else ("embed_tokens",)
    names, params = zip(*[(name, p) for name, p in draft.named_parameters() if not name.startswith(frozen)])
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    run = Run(cfg, rank, world, device, Path(cfg.out), target, examples, streamed, aux_ids, last_hidden_post_norm,
              draft, loss_fn, fsdp, names, params, optimizer, step=0)
    state = load_training_state(run.out / "checkpoint", device) if resume else None
    if state is not None:
        check_resumable(cfg, state["config"], run.state_path)
        if fsdp:
            load_sharded_state(draft, optimizer, state, names)
        else:
            draft.load_state_dict(state["draft"], strict=False)
            optimizer.load_state_dict(state["optimizer"])
        run.step = state["step"]
    elif resume and rank == 0:
        print(f"no checkpoint in {run.state_path.parent}; starting from step 0", file=sys.stderr)
    if rank == 0:
        _prepare_out(run)
    return run


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


def _training_data(cfg: TrainConfig, target: nn.Module) -> tuple[Any, Any, tuple[int, ...], bool]:
    """(the examples, the server's stream of their states or None, the aux ids, whether last_hidden is past the
    final norm): a dump's, or --data's tokenized (with their states fetched from --hidden-states-server)."""
    L = target.config.num_hidden_layers
    if cfg.hidden_states:
        from eyas.train.hidden_states import HiddenStateShards

        data = HiddenStateShards(cfg.hidden_states)
        return data, None, tuple(data.manifest["aux_hidden_state_ids"]), data.last_hidden_post_norm
    from eyas.engine.llm import load_tokenizer
    from eyas.train.data import load_dataset

    aux_ids = to_hidden_state_ids(cfg.aux_layer_ids or list(default_aux_layer_ids(L)),
                                  AuxConvention(cfg.aux_layer_convention), L)
    loaded = load_dataset(cfg.data, load_tokenizer(cfg.target), cfg.max_length)
    if not cfg.hidden_states_server:
        return [{"input_ids": e.input_ids, "loss_mask": e.loss_mask} for e in loaded], None, aux_ids, False
    from eyas.client import ServerClient
    from eyas.train.hidden_states_server import ServerHiddenStates, StreamedHiddenStates

    client = ServerClient(cfg.hidden_states_server, cfg.served_model_name, cfg.api_key)
    states = ServerHiddenStates(client, aux_ids, L, target.config.hidden_size, cfg.vllm_storage,
                                keep_files=cfg.keep_server_files)
    streamed = StreamedHiddenStates(states, loaded, target.lm_head.weight.dtype)
    return streamed, streamed, aux_ids, False


def _draft_vocabulary(cfg: TrainConfig, examples, vocab_size: int, rank: int) -> tuple[torch.Tensor | None, int]:
    """(d2t or None, the draft's vocabulary size): from --vocab-file, the whole vocabulary, or the most frequent
    loss tokens of the training data (how many: --draft-vocab-size, or chosen by auto_draft_vocab_size)."""
    if cfg.vocab_file:
        from eyas.train.vocab import load_vocab

        d2t, _ = load_vocab(cfg.vocab_file)
        return d2t, d2t.shape[0]
    draft_vocab = cfg.draft_vocab_size
    if draft_vocab == 0:
        return None, 0
    from eyas.train.vocab import auto_draft_vocab_size, count_loss_tokens, coverage_stats, select_draft_vocab

    counts = count_loss_tokens(_examples_for_vocab(examples), vocab_size)
    if draft_vocab is None:
        draft_vocab = auto_draft_vocab_size(counts)
    d2t = t2d = None
    if draft_vocab != vocab_size:
        d2t, t2d = select_draft_vocab(counts, draft_vocab)
    if rank == 0:
        covered = coverage_stats(counts, t2d)["coverage"] if d2t is not None else 1.0
        chosen = "auto, " if cfg.draft_vocab_size is None else ""
        print(f"draft vocabulary: {draft_vocab} of {vocab_size} ids ({chosen}{covered:.1%} of the loss tokens)",
              file=sys.stderr)
    return d2t, draft_vocab


def _prepare_out(run: Run) -> None:
    cfg, out = run.cfg, run.out
    out.mkdir(parents=True, exist_ok=True)
    if run.log_path.exists():  # drop records past the checkpoint: the steps after it are about to be rerun
        kept = [r for r in read_log(run.log_path) if r["step"] <= run.step]
        run.log_path.write_text("".join(json.dumps(r) + "\n" for r in kept))
    write_recipe(out / RECIPE_NAME, cfg)
    print(f"training a {cfg.draft_arch} draft for {cfg.target}: steps {run.step} -> {cfg.max_steps}, "
          f"{len(run.examples)} examples, batches of {cfg.batch_size} x up to {cfg.max_length} tokens, lr {cfg.lr}; "
          f"writing {out} (Ctrl-C saves and stops)", file=sys.stderr)


# -- the loop -------------------------------------------------------------------------------------------------------

def train_loop(run: Run, on_step: Callable[[int, dict], None] | None = None) -> dict:
    """Train from `run.step` to max_steps (or a Ctrl-C); returns the last log record. Each step: the learning rate,
    the batch, the target's features, the TTT loss, backward, clip, step; then log, evaluate and save as due."""
    cfg = run.cfg
    bar = tqdm(total=cfg.max_steps, initial=run.step, desc="train", unit="step", disable=run.rank != 0)
    record: dict = {}
    tokens, start = 0, time.perf_counter()
    last_save = time.monotonic()
    taught = False  # whether any step had a loss: a draft vocabulary holding none of the target's tokens has none
    # on any error too: streamed batches' fetches still in flight are cancelled, the bar leaves the terminal line
    with contextlib.ExitStack() as cleanup, StopOnInterrupt() as interrupt:
        cleanup.callback(bar.close)
        if run.streamed is not None:
            cleanup.callback(run.streamed.close)
        while run.step < cfg.max_steps:
            record = train_step(run)
            taught = taught or record.get("loss", 0.0) > 0
            tokens += record.pop("tokens")
            record["tokens_per_s"] = round(tokens * run.world / (time.perf_counter() - start), 1)
            bar.update(1)
            if cfg.eval_every and run.rank == 0 and (run.step % cfg.eval_every == 0 or run.step == cfg.max_steps):
                record["eval_acceptance_length"] = measure_acceptance(cfg, run.draft, run.device)
            if run.rank == 0:
                _log(run, record, bar)
            # every rank must take the same decision: a sharded save gathers from all of them
            stop, overdue = _agreed(run.world, interrupt.requested,
                                    time.monotonic() - last_save >= cfg.save_minutes * 60)
            if run.step % cfg.save_every == 0 or run.step == cfg.max_steps or stop or overdue:
                _save(run)
                last_save = time.monotonic()
            if on_step is not None:
                on_step(run.step, record)
            if stop:
                record["interrupted"] = True
                break
    if run.rank == 0:
        plot_log(run.log_path, run.out / "train_curves.png",
                 title=f"{cfg.draft_arch} draft for {Path(cfg.target).name}")
        how = "interrupted; continue with --resume" if record.get("interrupted") else "done"
        print(f"step {run.step} of {cfg.max_steps} ({how}) after {(time.perf_counter() - start) / 60:.1f} min: "
              f"draft in {run.out / 'draft'}, checkpoint in {run.state_path}", file=sys.stderr)
        if record and not taught:
            record["nothing_taught"] = True
            print("error: every step's loss was 0: no position was taught, so the draft learned nothing. The draft "
                  "vocabulary holds none of the target's next tokens at the loss positions (too little data to "
                  "choose one from?): train with --draft-vocab-size 0 (the whole vocabulary), or more data",
                  file=sys.stderr)
    return record


def train_step(run: Run) -> dict:
    """One optimizer step on this rank's slice of the step's global batch; returns its log record (with the
    number of batch positions this rank read, as `tokens`)."""
    cfg, step = run.cfg, run.step
    for group in run.optimizer.param_groups:
        group["lr"] = lr_at(cfg, step)
    indices = batch_indices(len(run.examples), step, cfg.batch_size, cfg.seed)[run.rank::run.world]
    if run.streamed is not None:  # this step's batch waits on the server; the next steps' are fetched meanwhile
        for ahead in range(step + 1, min(step + 1 + PREFETCH_STEPS, cfg.max_steps)):
            run.streamed.prefetch(ahead, batch_indices(len(run.examples), ahead, cfg.batch_size,
                                                       cfg.seed)[run.rank::run.world])
        items = run.streamed.batch(step, indices)
    else:
        items = [run.examples[i] for i in indices]
    batch = {k: v.to(run.device) for k, v in collate(items, cfg.max_length).items()}
    aux, target_logits = target_features(run.target, batch, run.aux_ids, run.last_hidden_post_norm)
    with cfg.autocast(run.device):
        result = run.loss_fn(batch["input_ids"], batch["loss_mask"], aux, target_logits, cfg.ttt_steps,
                             cfg.loss_decay, LossKind(cfg.loss, cfg.lk_lambda_scale, cfg.lk_lambda_decay))
    counts = torch.stack(result.counts).detach()
    if run.world > 1:
        dist.all_reduce(counts)
    loss = sum(cfg.loss_decay ** k * s / counts[k].clamp(min=1) for k, s in enumerate(result.loss_sums))
    run.optimizer.zero_grad(set_to_none=True)
    loss.backward()
    # each rank's loss is its share of the global loss: summed gradients are the global gradient (under FSDP the
    # backward pass has already reduce-scattered them, summed, into each rank's shard)
    if run.world > 1 and not run.fsdp:
        for p in run.params:
            if p.grad is not None:
                dist.all_reduce(p.grad)
    grad_norm = torch.nn.utils.clip_grad_norm_(run.params, cfg.grad_clip).item()
    run.optimizer.step()
    run.step += 1
    stats = torch.stack([torch.stack(result.loss_sums).detach(), torch.stack(result.correct)])
    if run.world > 1:
        dist.all_reduce(stats)
    per_step_loss = (stats[0] / counts.clamp(min=1)).tolist()
    return {"step": run.step, "loss": round(sum(cfg.loss_decay ** k * x for k, x in enumerate(per_step_loss)), 5),
            "lr": lr_at(cfg, step), "grad_norm": round(grad_norm, 4),
            "loss_per_step": [round(x, 5) for x in per_step_loss],
            "acc_per_step": [round(x, 5) for x in (stats[1] / counts.clamp(min=1)).tolist()],
            "tokens": int(batch["loss_mask"].numel())}


def _log(run: Run, record: dict, bar: tqdm) -> None:
    with open(run.log_path, "a") as f:
        f.write(json.dumps(record) + "\n")
    if run.step % run.cfg.log_every == 0 or "eval_acceptance_length" in record:
        postfix = {"loss": record["loss"], "acc0": record["acc_per_step"][0]}
        if "eval_acceptance_length" in record:
            postfix["AL"] = record["eval_acceptance_length"]
        bar.set_postfix(postfix)


def _save(run: Run) -> None:
    if run.fsdp:  # gathering the shards takes every rank
        save_sharded_checkpoint(run.out, run.draft, run.optimizer, run.step, run.cfg, run.names, run.rank)
    elif run.rank == 0:
        save_checkpoint(run.out, run.draft, run.optimizer.state_dict(), run.step, run.cfg)


def _examples_for_vocab(examples):
    from eyas.train.data import Example

    if isinstance(examples, list):
        return [Example(input_ids=e["input_ids"], loss_mask=e["loss_mask"]) for e in examples]
    return examples.token_examples()  # a dump: its token ids and masks only, not the hidden states


# settings a resumed run may change: where and how often it saves, logs and evaluates, how it runs, and how long
_NOT_COMPARED = ("save_every", "save_minutes", "log_every", "out", "fsdp", "device", "threads", "max_steps",
                 "eval_every", "eval_prompts", "eval_num_prompts", "eval_max_new_tokens", "hidden_states_server",
                 "served_model_name", "api_key", "vllm_storage", "keep_server_files")


def _comparable(cfg: TrainConfig) -> dict:
    """The settings a resumed run must share with the run it continues."""
    d = asdict(cfg)
    for key in _NOT_COMPARED:
        d.pop(key)
    return d


def check_resumable(cfg: TrainConfig, saved: dict, state_path: Path) -> None:
    """Refuse to resume a checkpoint made with other settings, naming them. A setting added after the checkpoint
    was made counts as its default (the behaviour it had then); one the checkpoint records but no longer compared
    (such as max_steps, which a resumed run may raise) is ignored."""
    current = _comparable(cfg)
    defaults = {f.name: f.default for f in fields(TrainConfig) if f.default is not MISSING}
    changed = sorted(k for k in current if saved.get(k, defaults.get(k)) != current[k])
    if changed:
        was = ", ".join(f"{k}={saved.get(k, defaults.get(k))!r} (now {current[k]!r})" for k in changed)
        raise ValueError(f"{state_path} was made with other settings ({', '.join(changed)}): {was}; resume with "
                         "the same ones, or train into another --out")


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


def _agreed(world: int, *flags: bool) -> list[bool]:
    """The flags OR-ed over the ranks, so every rank saves and stops at the same step."""
    if world == 1:
        return list(flags)
    t = torch.tensor([float(f) for f in flags])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [bool(x) for x in t.tolist()]


def measure_acceptance(cfg: TrainConfig, draft: Eagle3Draft, device: torch.device) -> float:
    """The draft's acceptance length as it is now, through the engine: greedy, K=3, on `eval_num_prompts` of the
    eval prompts spread over the file (its categories come in blocks)."""
    import tempfile

    from eyas.config import SpeculativeConfig
    from eyas.engine.llm import LLM
    from eyas.eval.acceptance import evaluate, spread
    from eyas.export import save_draft
    from eyas.records import read_eval_prompts
    from eyas.sampling_params import SamplingParams

    records = spread(read_eval_prompts(Path(cfg.eval_prompts or DEFAULT_EVAL_PROMPTS)), cfg.eval_num_prompts)
    with tempfile.TemporaryDirectory(prefix="eyas-eval-draft-") as tmp:
        save_draft(draft, Path(tmp), fmt="eyas")
        llm = LLM(cfg.target, device=str(device), max_num_seqs=len(records), threads=cfg.threads,
                  speculative_config=SpeculativeConfig(method="eagle", draft_model=tmp))
        report = evaluate(llm, records, SamplingParams(temperature=0, max_tokens=cfg.eval_max_new_tokens))
    return report["overall"]["acceptance_length"]


def read_log(path: Path) -> list[dict]:
    """The records of a train_log.jsonl; a last line cut short by a kill is dropped."""
    records = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


RECIPE_NAME = "train_config.yaml"
PREFETCH_STEPS = 4  # with --hidden-states-server, the batches of this many next steps are fetched ahead


def write_recipe(path: Path, cfg: TrainConfig) -> None:
    """Every setting of the run but the API key, as a file `eyas train --config` reads back."""
    import yaml

    header = "# eyas train settings of this run; rerun with: eyas train --config <this file> [--resume]\n"
    settings = {k: v for k, v in asdict(cfg).items() if k != "api_key"}
    path.write_text(header + yaml.safe_dump(settings, sort_keys=False))


PREVIOUS_STATE = "state.prev.pt"


def load_training_state(ckpt: Path, device: torch.device) -> dict | None:
    """The newest readable training state in `ckpt`: state.pt, else the one before it (a state.pt truncated or
    corrupted after it was written); None when there is neither."""
    for name in ("state.pt", PREVIOUS_STATE):
        path = ckpt / name
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
    if (ckpt / "state.pt").is_file():
        raise ValueError(f"{ckpt}: no readable training state (state.pt and {PREVIOUS_STATE} are damaged, refused "
                         "or missing)")
    return None


def save_checkpoint(out: Path, draft: Eagle3Draft, optimizer_state: dict, step: int, cfg: TrainConfig) -> None:
    """Atomically: the training state (for --resume) and the draft itself in eyas's layout (for serving)."""
    from eyas.export import save_draft

    ckpt = out / "checkpoint"
    ckpt.mkdir(parents=True, exist_ok=True)
    own = {k: v for k, v in draft.state_dict().items() if not k.startswith("embed_tokens")}
    tmp = ckpt / "state.pt.tmp"
    torch.save({"draft": own, "optimizer": optimizer_state, "step": step, "config": _comparable(cfg)}, tmp)
    if (ckpt / "state.pt").is_file():  # kept until the new one is in place: a state.pt cut short falls back to it
        os.replace(ckpt / "state.pt", ckpt / PREVIOUS_STATE)
    os.replace(tmp, ckpt / "state.pt")
    save_draft(draft, out / "draft", fmt="eyas")


# -- sharding (--fsdp) -------------------------------------------------------------------------------------------

class TTTLoss(nn.Module):
    """`ttt_loss` as one module call. ttt_loss reaches into the draft's submodules and never calls draft.forward, so
    FSDP needs a module whose forward spans the whole loss: its hooks gather the shards before the forward and
    reduce-scatter the gradients after the backward."""

    def __init__(self, draft: Eagle3Draft) -> None:
        super().__init__()
        self.draft = draft

    def forward(self, input_ids: torch.Tensor, loss_mask: torch.Tensor, aux_hidden_states: torch.Tensor,
                target_logits: torch.Tensor, ttt_steps: int, decay: float, loss: LossKind | None = None) -> TTTOutput:
        return ttt_loss(self.draft, input_ids, loss_mask, aux_hidden_states, target_logits, ttt_steps, decay, loss)


def shard_draft(loss_fn: TTTLoss, world: int) -> None:
    """FSDP2 over the draft's own weights, in place. fc, the MLP and lm_head (the large matrices, each called
    through its forward) are units of their own, gathered around each call only; the rest of the layer (attention,
    norms) is gathered by the root unit for the whole step. The embedding is the target's own module, run by the
    target's forward too: it stays whole."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    draft = loss_fn.draft
    mesh = init_device_mesh(draft.fc.weight.device.type, (world,))
    units = [draft.fc, draft.layers[0].mlp, draft.lm_head]
    for module in units:
        fully_shard(module, mesh=mesh)
    fully_shard(loss_fn, mesh=mesh, ignored_params=set(draft.embed_tokens.parameters()))
    for module in [*units, loss_fn]:
        # each rank's loss is already its share of the global loss (normalised by the global count of loss
        # positions), so the ranks' gradients are summed, not averaged as FSDP does by default
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no PREMUL_SUM


def save_sharded_checkpoint(out: Path, draft: Eagle3Draft, optimizer: torch.optim.Optimizer, step: int,
                            cfg: TrainConfig, names: tuple[str, ...], rank: int) -> None:
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
    with torch.device("meta"):
        plain = Eagle3Draft(draft.config, draft.embed_tokens)
    own = {k: v for k, v in model_state.items() if not k.startswith("embed_tokens")}
    assign_weights(plain, own, "the gathered draft", "cpu", shared={"embed_tokens.weight"})
    save_checkpoint(out, plain, _renumber(optimizer_state, {name: i for i, name in enumerate(names)}), step, cfg)


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


def smoothed(values: list[float], span: int) -> list[float]:
    """Exponential moving average with the usual span (alpha = 2 / (span + 1)), started at the first value."""
    alpha, out = 2 / (span + 1), []
    for v in values:
        out.append(v if not out else out[-1] + alpha * (v - out[-1]))
    return out


def plot_log(log_path: Path, png: Path, title: str = "") -> None:
    """Loss and per-position accuracy (raw, faint, and smoothed) and, when the run measured it, the acceptance
    length through the engine."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_log(log_path)
    if not records:
        return
    steps = [r["step"] for r in records]
    evals = [(r["step"], r["eval_acceptance_length"]) for r in records if "eval_acceptance_length" in r]
    span = max(1, len(records) // 25)
    fig, axes = plt.subplots(1, 3 if evals else 2, figsize=(16 if evals else 11, 4))
    ax_loss, ax_acc = axes[0], axes[1]
    losses = [r["loss"] for r in records]
    ax_loss.plot(steps, losses, color="C0", alpha=0.25, linewidth=0.8)
    ax_loss.plot(steps, smoothed(losses, span), color="C0", label=f"moving average ({span} steps)")
    ax_loss.set(xlabel="step", ylabel="TTT loss (decay-weighted)", title="loss")
    ax_loss.legend(fontsize=8)
    for k in range(len(records[0]["acc_per_step"])):
        acc = [r["acc_per_step"][k] for r in records]
        ax_acc.plot(steps, acc, color=f"C{k}", alpha=0.2, linewidth=0.8)
        ax_acc.plot(steps, smoothed(acc, span), color=f"C{k}", label=f"TTT step {k}")
    ax_acc.set(xlabel="step", ylabel="top-1 agreement with the target", title="accuracy per TTT position")
    ax_acc.legend(fontsize=8)
    if evals:
        axes[2].plot(*zip(*evals), marker="o", color="C3")
        axes[2].set(xlabel="step", ylabel="tokens per verify step", title="acceptance length (greedy, K=3)")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def setup_distributed(device: str = "cpu") -> tuple[int, int]:
    """(rank, world size) under torchrun, else (0, 1). The backend follows where the tensors live: nccl for CUDA
    tensors, gloo for CPU ones (nccl cannot reduce CPU tensors, even on a machine with a GPU)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.device(device).type == "cuda" else "gloo")
    return (dist.get_rank(), world) if world > 1 else (0, 1)


def train_device(device: str) -> torch.device:
    """This process's device: under torchrun each rank takes its own GPU (LOCAL_RANK)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    return device


def add_cli(subparsers) -> None:
    d = {f.name: f.default for f in fields(TrainConfig) if f.default is not MISSING}
    p = subparsers.add_parser(
        "train", help="train an EAGLE-3 draft head (online or from dumped hidden states)",
        description="Train an EAGLE-3 draft for a target with train-time test. Online: --data JSONL "
        "(conversations in OpenAI messages or ShareGPT form, loss on assistant tokens; or {\"text\": ...}); "
        "offline: --hidden-states DIR from `eyas dump-hidden-states`. With neither, the bundled target trains on "
        f"the bundled conversations ({DEFAULT_DATA.relative_to(DEFAULT_MODEL.parents[1])}): a first draft in a few "
        "minutes on a CPU. Resumable (--resume, also with a larger --max-steps); Ctrl-C saves a checkpoint and "
        "stops; under torchrun it trains data parallel. Writes OUT/draft (servable), OUT/checkpoint/state.pt, "
        f"OUT/train_log.jsonl, OUT/train_curves.png and OUT/{RECIPE_NAME} (every setting, readable by --config).")
    p.add_argument("--config", type=Path, metavar="RECIPE.yaml", help="read settings from a YAML file: keys are "
                   "the options below (lr, max_steps or max-steps, ...); options given on the command line win")
    p.add_argument("--target", default=str(DEFAULT_MODEL), help="target checkpoint directory")
    p.add_argument("--data", help="training JSONL (online); default with the bundled target: the bundled "
                   "conversations")
    p.add_argument("--hidden-states", help="dumped hidden states directory (offline)")
    p.add_argument("--hidden-states-server", metavar="URL", help="with --data: fetch each batch's hidden states "
                   f"from this vLLM (started with the command `eyas dump-hidden-states --print-vllm-command` "
                   f"prints), {PREFETCH_STEPS} steps ahead, nothing kept on disk; only the target's embedding, "
                   "final norm and lm_head are loaded here")
    p.add_argument("--vllm-storage", metavar="DIR", help="required with --hidden-states-server: the "
                   "shared_storage_path that vLLM was started with, at the same path on this machine; only regular "
                   ".safetensors files inside it, reached without symlinks, are read (no default)")
    p.add_argument("--keep-server-files", action="store_true", help="with --hidden-states-server: leave each server "
                   "file in place once read (default: a file whose token ids match its request is deleted with its "
                   ".lock; any other file is never deleted)")
    p.add_argument("--served-model-name", help="the server's model name (default: the first of its /v1/models)")
    p.add_argument("--api-key", help="for --hidden-states-server: sent as 'Authorization: Bearer KEY' (not written "
                   f"to {RECIPE_NAME})")
    p.add_argument("--out", default="runs/draft", help="output directory")
    p.add_argument("--draft-arch", choices=["mla", "mha"], default=d["draft_arch"],
                   help="mla: DeepSeek-style attention draft; mha: Llama-style draft")
    p.add_argument("--draft-vocab-size", type=int, help="compress the draft vocabulary to the N most frequent "
                   "loss tokens of the data; 0: the target's whole vocabulary (default: auto, the fewest ids, in "
                   "multiples of 256, covering 95%% of the loss tokens, or the whole vocabulary when that is more "
                   "than half of it)")
    p.add_argument("--vocab-file", help="d2t/t2d from `eyas calibrate-vocab` (overrides --draft-vocab-size)")
    p.add_argument("--aux-layer-ids", type=int, nargs="+", help="target layers to fuse (default: the standard "
                   "early/middle/late rule (2, L//2, L-3) in hidden_states convention)")
    p.add_argument("--aux-layer-convention", choices=["hidden_states", "layer_output"],
                   default=d["aux_layer_convention"],
                   help="how --aux-layer-ids are numbered (layer_output: Model Optimizer's, one lower)")
    p.add_argument("--intermediate-size", type=int, default=d["intermediate_size"],
                   help="draft MLP width (0: the target's dense one)")
    p.add_argument("--freeze-lm-head", action="store_true", help="keep the lm_head at the target's rows (as Model "
                   "Optimizer does by default): fewer trained weights, faster steps")
    p.add_argument("--fc-norm", action="store_true", help="EAGLE-3.1: an RMSNorm on each aux hidden state before fc "
                   "(weights fc_norm.{i}.weight)")
    p.add_argument("--norm-before-fc", action="store_true", help="EAGLE-3.1: one RMSNorm over the concatenated aux "
                   "states before fc (input_norm.weight); excludes --fc-norm")
    p.add_argument("--norm-output", action="store_true", help="EAGLE-3.1: carry the final norm's output, not its "
                   "input, to the next draft step (and TTT step)")
    p.add_argument("--norm-before-residual", action="store_true", help="EAGLE-3.1: the layer's residual is "
                   "hidden_norm(g), not g")
    p.add_argument("--ttt-steps", type=int, default=d["ttt_steps"],
                   help="train-time-test steps (draft runs on its outputs)")
    p.add_argument("--loss-decay", type=float, default=d["loss_decay"], help="weight of TTT step k is decay^k")
    p.add_argument("--loss", choices=LOSSES, default=d["loss"], help="per-position loss: kl (soft cross-entropy "
                   "against the target's distribution); lk-alpha (-log of the expected acceptance alpha = "
                   "sum min(p, q)); lk-lambda (w KL + (1 - w)(1 - alpha), w = scale exp(-decay alpha))")
    p.add_argument("--lk-lambda-scale", type=float, default=d["lk_lambda_scale"], help="lk-lambda's scale")
    p.add_argument("--lk-lambda-decay", type=float, default=d["lk_lambda_decay"], help="lk-lambda's decay")
    p.add_argument("--lr", type=float, default=d["lr"], help="peak learning rate (AdamW); the best of 1e-3 / 3e-3 / "
                   "6e-3 on the bundled target; large targets' published recipes use 5e-5..1e-4")
    p.add_argument("--min-lr-ratio", type=float, default=d["min_lr_ratio"],
                   help="the cosine schedule ends at lr x this")
    p.add_argument("--warmup-steps", type=int, default=d["warmup_steps"], help="linear warm-up steps")
    p.add_argument("--max-steps", type=int, default=d["max_steps"], help="optimizer steps in all (with --resume: "
                   "a larger value extends the run)")
    p.add_argument("--batch-size", type=int, default=d["batch_size"],
                   help="global batch size (split over torchrun ranks)")
    p.add_argument("--max-length", type=int, default=d["max_length"], help="tokens per example; longer ones are "
                   "truncated")
    p.add_argument("--grad-clip", type=float, default=d["grad_clip"], help="gradient norm clip")
    p.add_argument("--weight-decay", type=float, default=d["weight_decay"], help="AdamW weight decay")
    p.add_argument("--save-every", type=int, default=d["save_every"], help="steps between checkpoints")
    p.add_argument("--save-minutes", type=float, default=d["save_minutes"], help="at most this many minutes "
                   "between checkpoints, whatever --save-every says")
    p.add_argument("--log-every", type=int, default=d["log_every"], help="steps between progress-bar updates of "
                   "loss and accuracy (every step is written to OUT/train_log.jsonl)")
    p.add_argument("--eval-every", type=int, default=d["eval_every"], help="measure the draft's acceptance length "
                   "through the engine every N steps and at the end, logged and plotted (0: never)")
    p.add_argument("--eval-prompts", help="JSONL prompts for --eval-every (default: the bundled held-out prompts)")
    p.add_argument("--eval-num-prompts", type=int, default=d["eval_num_prompts"],
                   help="prompts per --eval-every measurement")
    p.add_argument("--eval-max-new-tokens", type=int, default=d["eval_max_new_tokens"],
                   help="tokens generated per prompt in an --eval-every measurement")
    p.add_argument("--seed", type=int, default=d["seed"], help="initialisation and batch order")
    p.add_argument("--fsdp", action="store_true", help="under torchrun, shard the draft's trained parameters, "
                   "gradients and optimizer state across the ranks, for drafts too large to replicate (same maths "
                   "as plain data parallel; checkpoints hold whole tensors, so --resume works with or without it)")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint/state.pt")
    p.add_argument("--threads", type=int, help=THREADS_HELP)
    p.add_argument("--device", default=d["device"], help="cpu or cuda (under torchrun, each rank uses "
                   "cuda:LOCAL_RANK; nccl then, gloo on CPU)")
    p.add_argument("--target-dtype", default=d["target_dtype"], choices=["auto", "float32", "bfloat16"],
                   help="dtype the frozen target computes hidden states and logits in (auto: float32 on CPU, "
                   "bfloat16 on GPUs). On CPUs with AVX512-BF16 or AMX, bfloat16 runs the target faster")
    p.add_argument("--mixed-precision", default=d["mixed_precision"], choices=["auto", "no", "bf16"],
                   help="bf16: the draft's forward and backward run under bfloat16 autocast while its weights "
                   "and optimizer state stay float32; no: all float32 (auto: bf16 on GPUs, no on CPU). On CPUs "
                   "with AVX512-BF16 or AMX, bf16 matmuls run about twice as fast")
    p.set_defaults(func=_cmd_train)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The TrainConfig the command line describes: every field is the option of the same name. With neither
    --data nor --hidden-states, the bundled target trains on the bundled conversations."""
    values = {f.name: getattr(args, f.name) for f in fields(TrainConfig)}
    if values["data"] is None and values["hidden_states"] is None:
        if Path(values["target"]).resolve() != DEFAULT_MODEL.resolve():
            raise ValueError("give --data (conversations JSONL) or --hidden-states (a dump-hidden-states "
                             "directory): the bundled conversations are for the bundled target only")
        values["data"] = str(DEFAULT_DATA)
        print(f"no --data: training on the bundled conversations {DEFAULT_DATA}", file=sys.stderr)
    for key in ("target", "out", "data", "hidden_states", "hidden_states_server", "vllm_storage", "vocab_file",
                "eval_prompts"):
        if values[key] is not None:
            values[key] = str(values[key])
    return TrainConfig(**values)


def _cmd_train(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    state = Path(cfg.out) / "checkpoint" / "state.pt"
    if state.is_file() and not args.resume:
        raise ValueError(f"{cfg.out} already holds a training run ({state}); add --resume to continue it (a larger "
                         "--max-steps extends it), or train into another --out")
    record = train(cfg, resume=args.resume)
    if record and not record.get("nothing_taught"):
        acc = " / ".join(f"{a:.2f}" for a in record.get("acc_per_step", []))
        print(f"last step: loss {record['loss']:.4g}, draft accuracy per TTT step {acc}, "
              f"{record['tokens_per_s']:.0f} tokens/s (every step: {Path(cfg.out) / 'train_log.jsonl'})")
    return 130 if record.get("interrupted") else 1 if record.get("nothing_taught") else 0
