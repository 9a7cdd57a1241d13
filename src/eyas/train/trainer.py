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
import json
import math
import os
import time
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

from eyas.aux_layers import AuxConvention, default_aux_layer_ids, to_hidden_state_ids
from eyas.config import DeepseekV3Config, RopeConfig
from eyas.models.deepseek_v3 import DeepseekV3ForCausalLM
from eyas.models.eagle3 import Eagle3Config, Eagle3Draft, target_ids_of
from eyas.train.ttt import TTTOutput, read_positions, ttt_loss


@dataclass(slots=True)
class TrainConfig:
    target: str
    out: str
    data: str | None = None  # JSONL conversations or text (online)
    hidden_states: str | None = None  # a dump-hidden-states directory (offline)
    draft_arch: str = "mla"
    draft_vocab_size: int = 0  # 0: the target's whole vocabulary
    vocab_file: str | None = None  # d2t/t2d from `eyas calibrate-vocab`
    aux_layer_ids: list[int] | None = None
    aux_layer_convention: str = "hidden_states"
    intermediate_size: int = 0  # 0: the target's dense intermediate size
    freeze_lm_head: bool = False  # keep the target's lm_head rows as they are (fewer trained weights, faster)
    ttt_steps: int = 3
    loss_decay: float = 0.9
    lr: float = 1e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    max_steps: int = 1000
    batch_size: int = 8  # global, over all ranks
    max_length: int = 1024
    grad_clip: float = 0.5
    weight_decay: float = 0.0
    save_every: int = 100
    log_every: int = 10
    seed: int = 0
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
        if self.draft_arch not in ("mla", "mha"):
            raise ValueError(f"--draft-arch is {self.draft_arch!r}; expected mla or mha")
        if self.ttt_steps < 1 or not 0 < self.loss_decay <= 1:
            raise ValueError("--ttt-steps must be >= 1 and --loss-decay in (0, 1]")
        if self.batch_size < 1 or self.max_steps < 1:
            raise ValueError("--batch-size and --max-steps must be positive")
        if self.mixed_precision not in ("auto", "no", "bf16"):
            raise ValueError(f"--mixed-precision is {self.mixed_precision!r}; expected auto, no or bf16")

    def autocast(self, device: torch.device) -> torch.autocast:
        """The context the draft's loss runs in: bfloat16 matmuls (float32 weights) or plain float32."""
        enabled = self.mixed_precision == "bf16" or (self.mixed_precision == "auto" and device.type != "cpu")
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled)


# -- the draft at step 0 ----------------------------------------------------------------------------------------

def new_draft_config(target: DeepseekV3Config, arch: str, aux_ids: tuple[int, ...], draft_vocab_size: int,
                     intermediate_size: int = 0) -> Eagle3Config:
    """A one-layer draft shaped after the target: its attention dims (MLA) or its head count (MHA), its rope."""
    H = target.hidden_size
    common = dict(hidden_size=H, target_hidden_size=H, vocab_size=target.vocab_size,
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
def target_features(target: DeepseekV3ForCausalLM, batch: dict, aux_ids: tuple[int, ...]):
    """(aux [B, T, n_aux, H], target logits [R, vocab]) from a dumped batch or by running the target.

    Logits only at the R positions a loss reads (`read_positions`, row-major): in chat data the prompts and the
    padding are many positions, and the vocab-wide head is the target's largest matmul."""
    if "aux_hidden_states" in batch:
        aux = batch["aux_hidden_states"].to(target.lm_head.weight.dtype)
        last = batch["last_hidden"].to(target.lm_head.weight.dtype)
    else:
        from eyas.train.hidden_states import capture_hidden_states

        aux, last = capture_hidden_states(target, batch["input_ids"], aux_ids)
    read = read_positions(batch["loss_mask"].to(last.device))
    return aux, target.compute_logits(target.model.norm(last[read]))


# -- the loop -----------------------------------------------------------------------------------------------------

def train(cfg: TrainConfig, resume: bool = False, on_step=None) -> dict:
    """Run training; returns the last log record. `on_step(step, record)` is called after each step."""
    from eyas.checkpoint import load_model
    from eyas.engine.llm import load_tokenizer

    rank, world = setup_distributed(cfg.device)
    device = train_device(cfg.device)
    out = Path(cfg.out)
    target = load_model(cfg.target, dtype=cfg.target_dtype, device=device)
    target.requires_grad_(False)
    L = target.config.num_hidden_layers

    if cfg.hidden_states:
        from eyas.train.hidden_states import HiddenStateShards

        data = HiddenStateShards(cfg.hidden_states)
        aux_ids = tuple(data.manifest["aux_hidden_state_ids"])
        examples = data
    else:
        from eyas.train.data import load_dataset

        tokenizer = load_tokenizer(cfg.target)
        raw_ids = cfg.aux_layer_ids or list(default_aux_layer_ids(L))
        aux_ids = to_hidden_state_ids(raw_ids, AuxConvention(cfg.aux_layer_convention), L)
        loaded = load_dataset(cfg.data, tokenizer, cfg.max_length)
        examples = [{"input_ids": e.input_ids, "loss_mask": e.loss_mask} for e in loaded]
    if len(examples) < cfg.batch_size:
        raise ValueError(f"{len(examples)} training examples are fewer than one batch of {cfg.batch_size}")

    d2t = None
    draft_vocab = cfg.draft_vocab_size
    if cfg.vocab_file:
        from eyas.train.vocab import load_vocab

        d2t, _ = load_vocab(cfg.vocab_file)
        draft_vocab = d2t.shape[0]
    elif draft_vocab and draft_vocab != target.config.vocab_size:
        from eyas.train.vocab import calibrate_vocab

        d2t, _ = calibrate_vocab(_examples_for_vocab(examples), target.config.vocab_size, draft_vocab)
    draft_config = new_draft_config(target.config, cfg.draft_arch, aux_ids, draft_vocab, cfg.intermediate_size)
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

    step = 0
    state_path = out / "checkpoint" / "state.pt"
    if resume and state_path.is_file():
        state = torch.load(state_path, weights_only=True, map_location=device)
        current = _comparable(cfg)
        # a setting added after the checkpoint was made is taken at its default (the behaviour it had then)
        defaults = {f.name: f.default for f in fields(TrainConfig) if f.default is not MISSING}
        saved = {**{k: defaults[k] for k in current if k in defaults}, **state["config"]}
        if saved != current:
            changed = sorted(k for k in current if saved.get(k) != current[k])
            raise ValueError(f"{state_path} was made with other settings ({', '.join(changed)}); resume with the "
                             f"same ones (saved: {state['config']})")
        if fsdp:
            load_sharded_state(draft, optimizer, state, names)
        else:
            draft.load_state_dict(state["draft"], strict=False)
            optimizer.load_state_dict(state["optimizer"])
        step = state["step"]
    elif resume and rank == 0:
        print(f"no checkpoint at {state_path}; starting from step 0")

    def lr_at(s: int) -> float:
        if s < cfg.warmup_steps:
            return cfg.lr * (s + 1) / cfg.warmup_steps
        progress = min(1.0, (s - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
        return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))

    log_path = out / "train_log.jsonl"
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        if log_path.exists():  # drop records past the checkpoint: the steps after it are about to be rerun
            kept = [line for line in log_path.read_text().splitlines()
                    if line.strip() and json.loads(line)["step"] <= step]
            log_path.write_text("".join(line + "\n" for line in kept))
    bar = tqdm(total=cfg.max_steps, initial=step, desc="train", unit="step", disable=rank != 0)
    record: dict = {}
    tokens, start = 0, time.perf_counter()
    while step < cfg.max_steps:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        indices = batch_indices(len(examples), step, cfg.batch_size, cfg.seed)[rank::world]
        batch = {k: v.to(device) for k, v in collate([examples[i] for i in indices], cfg.max_length).items()}
        aux, target_logits = target_features(target, batch, aux_ids)
        with cfg.autocast(device):
            result = loss_fn(batch["input_ids"], batch["loss_mask"], aux, target_logits, cfg.ttt_steps,
                             cfg.loss_decay)
        counts = torch.stack(result.counts).detach()
        if world > 1:
            dist.all_reduce(counts)
        loss = sum(cfg.loss_decay ** k * s / counts[k].clamp(min=1) for k, s in enumerate(result.loss_sums))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        # each rank's loss is its share of the global loss: summed gradients are the global gradient (under FSDP
        # the backward pass has already reduce-scattered them, summed, into each rank's shard)
        if world > 1 and not fsdp:
            for p in params:
                if p.grad is not None:
                    dist.all_reduce(p.grad)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip).item()
        optimizer.step()
        step += 1
        tokens += int(batch["loss_mask"].numel())
        stats = torch.stack([torch.stack(result.loss_sums).detach(), torch.stack(result.correct)])
        if world > 1:
            dist.all_reduce(stats)
        per_step_loss = (stats[0] / counts.clamp(min=1)).tolist()
        global_loss = sum(cfg.loss_decay ** k * x for k, x in enumerate(per_step_loss))
        record = {"step": step, "loss": round(global_loss, 5), "lr": lr_at(step - 1),
                  "grad_norm": round(grad_norm, 4),
                  "loss_per_step": [round(x, 5) for x in per_step_loss],
                  "acc_per_step": [round(x, 5) for x in (stats[1] / counts.clamp(min=1)).tolist()],
                  "tokens_per_s": round(tokens * world / (time.perf_counter() - start), 1)}
        bar.update(1)
        if rank == 0:
            with open(log_path, "a") as f:
                f.write(json.dumps(record) + "\n")
            if step % cfg.log_every == 0:
                bar.set_postfix(loss=record["loss"], acc0=record["acc_per_step"][0])
        if step % cfg.save_every == 0 or step == cfg.max_steps:
            if fsdp:  # gathering the shards takes every rank
                save_sharded_checkpoint(out, draft, optimizer, step, cfg, names, rank)
            elif rank == 0:
                save_checkpoint(out, draft, optimizer.state_dict(), step, cfg)
        if on_step is not None:
            on_step(step, record)
    bar.close()
    if rank == 0:
        plot_log(log_path, out / "train_curves.png")
    return record


def _examples_for_vocab(examples):
    if isinstance(examples, list):
        from eyas.train.data import Example

        return [Example(input_ids=e["input_ids"], loss_mask=e["loss_mask"]) for e in examples]
    from eyas.train.data import Example

    return [Example(input_ids=examples[i]["input_ids"].tolist(), loss_mask=examples[i]["loss_mask"].int().tolist())
            for i in range(len(examples))]


def _comparable(cfg: TrainConfig) -> dict:
    """The settings a resumed run must share with the run it continues (save cadence and logging may change)."""
    d = asdict(cfg)
    for key in ("save_every", "log_every", "out", "fsdp", "device"):
        d.pop(key)
    return d


def save_checkpoint(out: Path, draft: Eagle3Draft, optimizer_state: dict, step: int, cfg: TrainConfig) -> None:
    """Atomically: the training state (for --resume) and the draft itself in eyas's layout (for serving)."""
    from eyas.export import save_draft

    ckpt = out / "checkpoint"
    ckpt.mkdir(parents=True, exist_ok=True)
    own = {k: v for k, v in draft.state_dict().items() if not k.startswith("embed_tokens")}
    tmp = ckpt / "state.pt.tmp"
    torch.save({"draft": own, "optimizer": optimizer_state, "step": step, "config": _comparable(cfg)}, tmp)
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
                target_logits: torch.Tensor, ttt_steps: int, decay: float) -> TTTOutput:
        return ttt_loss(self.draft, input_ids, loss_mask, aux_hidden_states, target_logits, ttt_steps, decay)


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
    missing = plain.load_state_dict(own, strict=False, assign=True).missing_keys
    assert all(k.startswith("embed_tokens") for k in missing), missing
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


def plot_log(log_path: Path, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
    if not records:
        return
    steps = [r["step"] for r in records]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
    ax_loss.plot(steps, [r["loss"] for r in records])
    ax_loss.set(xlabel="step", ylabel="TTT loss (decay-weighted)", title="loss")
    for k in range(len(records[0]["acc_per_step"])):
        ax_acc.plot(steps, [r["acc_per_step"][k] for r in records], label=f"TTT step {k}")
    ax_acc.set(xlabel="step", ylabel="top-1 agreement with the target", title="accuracy per TTT position")
    ax_acc.legend()
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
    from eyas.engine.llm import DEFAULT_MODEL

    p = subparsers.add_parser(
        "train", help="train an EAGLE-3 draft head (online or from dumped hidden states)",
        description="Train an EAGLE-3 draft for a target with train-time test. Online: --data JSONL "
        "(conversations in OpenAI messages or ShareGPT form, loss on assistant tokens; or {\"text\": ...}); "
        "offline: --hidden-states DIR from `eyas dump-hidden-states`. Resumable (--resume); under torchrun "
        "it trains data parallel. Writes OUT/draft (servable), OUT/checkpoint/state.pt, OUT/train_log.jsonl "
        "and OUT/train_curves.png.")
    p.add_argument("--target", default=str(DEFAULT_MODEL), help="target checkpoint directory")
    p.add_argument("--data", help="training JSONL (online)")
    p.add_argument("--hidden-states", help="dumped hidden states directory (offline)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--draft-arch", choices=["mla", "mha"], default="mla",
                   help="mla: DeepSeek-style attention draft; mha: Llama-style draft")
    p.add_argument("--draft-vocab-size", type=int, default=0, help="compress the draft vocabulary to the N most "
                   "frequent loss tokens (0: the target's vocabulary)")
    p.add_argument("--vocab-file", help="d2t/t2d from `eyas calibrate-vocab` (overrides --draft-vocab-size)")
    p.add_argument("--aux-layer-ids", type=int, nargs="+", help="target layers to fuse (default: the standard "
                   "early/middle/late rule (2, L//2, L-3) in hidden_states convention)")
    p.add_argument("--aux-layer-convention", choices=["hidden_states", "layer_output"], default="hidden_states",
                   help="how --aux-layer-ids are numbered (layer_output: Model Optimizer's, one lower)")
    p.add_argument("--intermediate-size", type=int, default=0, help="draft MLP width (0: the target's dense one)")
    p.add_argument("--freeze-lm-head", action="store_true", help="keep the lm_head at the target's rows (as Model "
                   "Optimizer does by default): fewer trained weights, faster steps")
    p.add_argument("--ttt-steps", type=int, default=3, help="train-time-test steps (draft runs on its outputs)")
    p.add_argument("--loss-decay", type=float, default=0.9, help="weight of TTT step k is decay^k")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--warmup-steps", type=int, default=50)
    p.add_argument("--max-steps", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=8, help="global batch size (split over torchrun ranks)")
    p.add_argument("--max-length", type=int, default=1024)
    p.add_argument("--grad-clip", type=float, default=0.5)
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fsdp", action="store_true", help="under torchrun, shard the draft's trained parameters, "
                   "gradients and optimizer state across the ranks, for drafts too large to replicate (same maths "
                   "as plain data parallel; checkpoints hold whole tensors, so --resume works with or without it)")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint/state.pt")
    p.add_argument("--threads", type=int, help="torch CPU threads per process (default: torch's choice)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (under torchrun, each rank uses cuda:LOCAL_RANK; "
                   "nccl then, gloo on CPU)")
    p.add_argument("--target-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="dtype the frozen target computes hidden states and logits in (auto: float32 on CPU, "
                   "bfloat16 on GPUs). On CPUs with AVX512-BF16 or AMX, bfloat16 runs the target faster")
    p.add_argument("--mixed-precision", default="auto", choices=["auto", "no", "bf16"],
                   help="bf16: the draft's forward and backward run under bfloat16 autocast while its weights "
                   "and optimizer state stay float32; no: all float32 (auto: bf16 on GPUs, no on CPU). On CPUs "
                   "with AVX512-BF16 or AMX, bf16 matmuls run about twice as fast")
    p.set_defaults(func=_cmd_train)


def _cmd_train(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = TrainConfig(target=args.target, out=args.out, data=args.data, hidden_states=args.hidden_states,
                      draft_arch=args.draft_arch, draft_vocab_size=args.draft_vocab_size, vocab_file=args.vocab_file,
                      aux_layer_ids=args.aux_layer_ids, aux_layer_convention=args.aux_layer_convention,
                      intermediate_size=args.intermediate_size, freeze_lm_head=args.freeze_lm_head,
                      ttt_steps=args.ttt_steps,
                      loss_decay=args.loss_decay, lr=args.lr, warmup_steps=args.warmup_steps,
                      max_steps=args.max_steps, batch_size=args.batch_size, max_length=args.max_length,
                      grad_clip=args.grad_clip, save_every=args.save_every, seed=args.seed, fsdp=args.fsdp,
                      device=args.device, target_dtype=args.target_dtype,
                      mixed_precision=args.mixed_precision)
    record = train(cfg, resume=args.resume)
    print(json.dumps(record))
    return 0
