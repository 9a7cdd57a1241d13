"""`eyas train`'s settings: `TrainConfig` (one field per command-line option, checked on creation), which of them a
resumed run must share with the run it continues, and the recipe file every run writes of them."""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path

import torch

from eyas.train.ttt import LossKind

REPORTERS = ("tensorboard", "wandb")
DRAFT_ARCHS = ("mla", "mha", "dflash")  # EAGLE-3 drafts (MLA- or Llama-shaped) and DFlash block drafts
BLOCK_LOSSES = ("dpace", "ce")  # eyas.train.dflash
BLOCK_LABELS = ("hard", "soft")
BLOCK_ATTENTIONS = ("mha", "mla")  # eyas.models.dflash.new_dflash_config
# the EAGLE-3 settings a DFlash run does not read, and the DFlash ones an EAGLE-3 run does not: set to anything but
# their default, they are an error
EAGLE_ONLY = ("fc_norm", "norm_before_fc", "norm_output", "norm_before_residual", "freeze_lm_head")
DFLASH_ONLY = ("num_draft_layers", "block_size", "num_anchors", "block_loss", "block_labels", "block_loss_gamma",
               "block_loss_alpha", "mask_token_id", "block_attention", "block_kv_lora_rank")


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
    # None: auto (auto_draft_vocab_size: the ids covering 95% of the loss tokens, if under half the vocabulary;
    # a DFlash draft: the whole vocabulary); 0: the target's whole vocabulary; N: the N most frequent loss tokens
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
    # DFlash block drafts (--draft-arch dflash): layers, block size (the anchor and its drafts), blocks taught per
    # sequence and step, the loss (see eyas.train.dflash), and the mask token (None: the first embedding row past
    # the tokenizer's ids, else its pad token)
    num_draft_layers: int = 1
    block_size: int = 8
    num_anchors: int = 32
    block_loss: str = "dpace"
    block_labels: str = "hard"  # hard: the data's next tokens; soft: the target's distribution over them
    block_loss_gamma: float = 7.0
    block_loss_alpha: float = 0.5
    mask_token_id: int | None = None
    # the layers' attention: mha (Qwen3-style, z-lab's) or mla (the target's MLA shape, the context entering through
    # the latent), whose latent is block_kv_lora_rank wide (0: the target's kv_lora_rank)
    block_attention: str = "mha"
    block_kv_lora_rank: int = 0
    # where the step metrics also go, besides OUT/train_log.jsonl and the PNG: tensorboard (event files under
    # OUT/tensorboard), wandb (an offline run under OUT/wandb; needs wandb installed)
    report_to: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if (self.data is None) == (self.hidden_states is None):
            raise ValueError("give exactly one of --data (online training) or --hidden-states (offline)")
        if self.hidden_states_server and self.data is None:
            raise ValueError("--hidden-states-server needs --data: the records whose hidden states it serves")
        if self.hidden_states_server and not self.vllm_storage:
            raise ValueError("--hidden-states-server needs --vllm-storage DIR: the shared_storage_path that vLLM "
                             "was started with (only files inside it are read)")
        if self.draft_arch not in DRAFT_ARCHS:
            raise ValueError(f"--draft-arch is {self.draft_arch!r}; expected one of {', '.join(DRAFT_ARCHS)}")
        if self.draft_arch == "dflash":
            self._check_dflash()
        else:
            defaults = {f.name: f.default for f in fields(TrainConfig)}
            given = [name for name in DFLASH_ONLY if getattr(self, name) != defaults[name]]
            if given:
                raise ValueError(f"{', '.join('--' + name.replace('_', '-') for name in given)}: DFlash settings, "
                                 f"which an EAGLE-3 draft (--draft-arch {self.draft_arch}) does not have")
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
        unknown = sorted(set(self.report_to) - set(REPORTERS))
        if unknown:
            raise ValueError(f"--report-to {' '.join(unknown)}: expected any of {', '.join(REPORTERS)}")
        if self.save_every < 1 or self.save_minutes <= 0 or self.eval_every < 0 or self.eval_num_prompts < 1:
            raise ValueError("--save-every, --save-minutes and --eval-num-prompts must be positive and "
                             "--eval-every at least 0")

    def _check_dflash(self) -> None:
        """A DFlash run: its own settings in range, and no EAGLE-3 setting it would silently ignore."""
        if self.block_loss not in BLOCK_LOSSES:
            raise ValueError(f"--block-loss is {self.block_loss!r}; expected one of {', '.join(BLOCK_LOSSES)}")
        if self.block_labels not in BLOCK_LABELS:
            raise ValueError(f"--block-labels is {self.block_labels!r}; expected one of {', '.join(BLOCK_LABELS)}")
        if not 2 <= self.block_size <= 64 or self.num_draft_layers < 1 or self.num_anchors < 1:
            raise ValueError("--block-size must be in 2..64, --num-draft-layers and --num-anchors positive")
        if self.block_loss_gamma <= 0 or not 0 <= self.block_loss_alpha <= 1:
            raise ValueError("--block-loss-gamma must be positive and --block-loss-alpha in [0, 1]")
        if self.block_attention not in BLOCK_ATTENTIONS:
            raise ValueError(f"--block-attention is {self.block_attention!r}; expected one of "
                             f"{', '.join(BLOCK_ATTENTIONS)}")
        if self.block_kv_lora_rank < 0 or (self.block_kv_lora_rank and self.block_attention != "mla"):
            raise ValueError(f"--block-kv-lora-rank {self.block_kv_lora_rank}: the latent width of MLA-shaped layers "
                             "(--block-attention mla), at least 1 (0: the target's kv_lora_rank)")
        defaults = {f.name: f.default for f in fields(TrainConfig)}
        ignored = [name for name in EAGLE_ONLY if getattr(self, name) != defaults[name]]
        ignored += [name for name in ("ttt_steps", "loss_decay", "loss") if getattr(self, name) != defaults[name]]
        if ignored:
            flags = ", ".join("--" + name.replace("_", "-") for name in ignored)
            raise ValueError(f"{flags}: EAGLE-3 settings, which a DFlash draft does not have (it drafts one block "
                             "per forward, with no train-time test steps)")

    def autocast(self, device: torch.device) -> torch.autocast:
        """The context the draft's loss runs in: bfloat16 matmuls (float32 weights) or plain float32."""
        enabled = self.mixed_precision == "bf16" or (self.mixed_precision == "auto" and device.type != "cpu")
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled)


# settings a resumed run may change: where and how often it saves, logs and evaluates, how it runs, and how long
NOT_COMPARED = ("save_every", "save_minutes", "log_every", "out", "fsdp", "device", "threads", "max_steps",
                 "eval_every", "eval_prompts", "eval_num_prompts", "eval_max_new_tokens", "hidden_states_server",
                 "served_model_name", "api_key", "vllm_storage", "keep_server_files", "report_to")


def comparable(cfg: TrainConfig) -> dict:
    """The settings a resumed run must share with the run it continues."""
    d = asdict(cfg)
    for key in NOT_COMPARED:
        d.pop(key)
    return d


def check_resumable(cfg: TrainConfig, saved: dict, state_path: Path) -> None:
    """Refuse to resume a checkpoint made with other settings, naming them. A setting added after the checkpoint
    was made counts as its default (the behaviour it had then); one the checkpoint records but no longer compared
    (such as max_steps, which a resumed run may raise) is ignored."""
    current = comparable(cfg)
    defaults = {f.name: f.default for f in fields(TrainConfig) if f.default is not MISSING}
    changed = sorted(k for k in current if saved.get(k, defaults.get(k)) != current[k])
    if changed:
        was = ", ".join(f"{k}={saved.get(k, defaults.get(k))!r} (now {current[k]!r})" for k in changed)
        raise ValueError(f"{state_path} was made with other settings ({', '.join(changed)}): {was}; resume with "
                         "the same ones, or train into another --out")


def write_recipe(path: Path, cfg: TrainConfig) -> None:
    """Every setting of the run but the API key, as a file `eyas train --config` reads back."""
    import yaml

    header = "# eyas train settings of this run; rerun with: eyas train --config <this file> [--resume]\n"
    path.write_text(header + yaml.safe_dump(recipe_settings(cfg), sort_keys=False))


def recipe_settings(cfg: TrainConfig) -> dict:
    """Every setting of the run but the API key."""
    return {k: v for k, v in asdict(cfg).items() if k != "api_key"}
