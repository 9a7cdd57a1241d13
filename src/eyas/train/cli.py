"""`eyas train`'s command line: the options (one per `TrainConfig` field, its default read from the field) and
the command, which turns them into a `TrainConfig` and trains."""

from __future__ import annotations

import argparse
import sys
from dataclasses import MISSING, fields
from pathlib import Path

from eyas.paths import DEFAULT_DATA, DEFAULT_MODEL
from eyas.threads import THREADS_HELP
from eyas.train.batches import PREFETCH_STEPS
from eyas.train.checkpointing import RunDir
from eyas.train.config import BLOCK_ATTENTIONS, BLOCK_LABELS, BLOCK_LOSSES, DRAFT_ARCHS, REPORTERS, TrainConfig
from eyas.train.ttt import LOSSES


def add_cli(subparsers) -> None:
    d = {f.name: f.default for f in fields(TrainConfig) if f.default is not MISSING}
    layout = RunDir(Path("OUT"))
    p = subparsers.add_parser(
        "train", help="train an EAGLE-3 draft head or a DFlash block draft (online or from dumped hidden states)",
        description="Train an EAGLE-3 draft for a target with train-time test, or a DFlash block draft "
        "(--draft-arch dflash: many blocks per sequence, each taught the tokens after its anchor). Online: --data "
        "JSONL "
        "(conversations in OpenAI messages or ShareGPT form, loss on assistant tokens; or {\"text\": ...}); "
        "offline: --hidden-states DIR from `eyas dump-hidden-states`. With neither, the bundled target trains on "
        f"the bundled conversations ({DEFAULT_DATA.relative_to(DEFAULT_MODEL.parents[1])}): a first draft in a few "
        "minutes on a CPU. Resumable (--resume, also with a larger --max-steps); Ctrl-C saves a checkpoint and "
        f"stops; under torchrun it trains data parallel. Writes {layout.draft} (servable), {layout.state}, "
        f"{layout.log}, {layout.curves} and {layout.recipe} (every setting, readable by --config).")
    _add_data_args(p, layout)
    _add_draft_args(p, d)
    _add_block_draft_args(p, d)
    _add_optimizer_args(p, d)
    _add_run_args(p, d, layout)
    p.set_defaults(func=_cmd_train)


def _add_data_args(p: argparse.ArgumentParser, layout: RunDir) -> None:
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
                   f"to {layout.recipe.name})")
    p.add_argument("--out", default="runs/draft", help="output directory")


def _add_draft_args(p: argparse.ArgumentParser, d: dict) -> None:
    p.add_argument("--draft-arch", choices=DRAFT_ARCHS, default=d["draft_arch"],
                   help="mla: DeepSeek-style attention EAGLE-3 draft; mha: Llama-style EAGLE-3 draft; dflash: a "
                   "DFlash block draft (Qwen3-style layers, z-lab's layout; the options below this group's EAGLE-3 "
                   "ones)")
    p.add_argument("--draft-vocab-size", type=int, help="compress the draft vocabulary to the N most frequent "
                   "loss tokens of the data; 0: the target's whole vocabulary (default: auto, the fewest ids, in "
                   "multiples of 256, covering 95%% of the loss tokens, or the whole vocabulary when that is more "
                   "than half of it; a DFlash draft: the whole vocabulary, through the target's lm_head)")
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
    p.add_argument("--loss", choices=LOSSES, default=d["loss"], help="an EAGLE-3 draft's per-position loss (a "
                   "DFlash draft's is --block-loss: dpace or ce): kl (soft cross-entropy against the target's "
                   "distribution); lk-alpha (-log of the expected acceptance alpha = sum min(p, q)); lk-lambda "
                   "(w KL + (1 - w)(1 - alpha), w = scale exp(-decay alpha))")
    p.add_argument("--lk-lambda-scale", type=float, default=d["lk_lambda_scale"], help="lk-lambda's scale")
    p.add_argument("--lk-lambda-decay", type=float, default=d["lk_lambda_decay"], help="lk-lambda's decay")


def _add_block_draft_args(p: argparse.ArgumentParser, d: dict) -> None:
    g = p.add_argument_group("DFlash block drafts (--draft-arch dflash)")
    g.add_argument("--num-draft-layers", type=int, default=d["num_draft_layers"], help="decoder layers; the "
                   "target layers the context fuses default to one per draft layer, spread from 1 to L-3 (z-lab's "
                   "rule; --aux-layer-ids chooses others)")
    g.add_argument("--block-size", type=int, default=d["block_size"],
                   help="block rows: the anchor and the block_size - 1 tokens drafted after it in one forward")
    g.add_argument("--num-anchors", type=int, default=d["num_anchors"],
                   help="blocks taught per sequence and step, at anchors drawn from its supervised positions")
    g.add_argument("--block-loss", choices=BLOCK_LOSSES, default=d["block_loss"], help="dpace: rows weighted by "
                   "the accepted runs that would reach them (speculators' and Model Optimizer's default); ce: "
                   "cross-entropy with weight exp(-(k-1)/gamma) at row k (the DFlash paper's)")
    g.add_argument("--block-labels", choices=BLOCK_LABELS, default=d["block_labels"], help="hard: each row is "
                   "taught the data's token; soft: the target's distribution for it (its logits at the position "
                   "before, as EAGLE-3's loss reads them)")
    g.add_argument("--block-loss-gamma", type=float, default=d["block_loss_gamma"], help="ce's decay gamma")
    g.add_argument("--block-loss-alpha", type=float, default=d["block_loss_alpha"], help="dpace's floor alpha")
    g.add_argument("--mask-token-id", type=int, help="the embedding row the block's masked rows read (default: "
                   "the first row past the tokenizer's ids, else the tokenizer's pad token)")
    g.add_argument("--block-attention", choices=BLOCK_ATTENTIONS, default=d["block_attention"], help="mha: "
                   "Qwen3-style attention, z-lab's layout, which vLLM and SGLang run; mla: the target's MLA shape, "
                   "the context entering each layer through its latent (dflash_config.attention_mode mla, "
                   "SpecForge's fields; its cache keeps kv_lora_rank + qk_rope_head_dim values per position and "
                   "layer)")
    g.add_argument("--block-kv-lora-rank", type=int, default=d["block_kv_lora_rank"], help="with --block-attention "
                   "mla: the latent's width (0: the target's kv_lora_rank)")


def _add_optimizer_args(p: argparse.ArgumentParser, d: dict) -> None:
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


def _add_run_args(p: argparse.ArgumentParser, d: dict, layout: RunDir) -> None:
    p.add_argument("--save-every", type=int, default=d["save_every"], help="steps between checkpoints")
    p.add_argument("--save-minutes", type=float, default=d["save_minutes"], help="at most this many minutes "
                   "between checkpoints, whatever --save-every says")
    p.add_argument("--log-every", type=int, default=d["log_every"], help="steps between progress-bar updates of "
                   f"loss and accuracy (every step is written to {layout.log})")
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
    p.add_argument("--resume", action="store_true", help=f"continue from {layout.state}")
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
    p.add_argument("--report-to", nargs="+", choices=REPORTERS, default=[], metavar="LOGGER",
                   help="also send the step metrics to: tensorboard (event files in "
                   f"{layout.tensorboard}; needs the tensorboard package), wandb (an offline run in {layout.wandb}; "
                   f"needs wandb). {layout.log} and {layout.curves} are written either way")


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
    from eyas.train.trainer import train

    run_dir = RunDir(Path(cfg.out))
    state = run_dir.state
    if state.is_file() and not args.resume:
        raise ValueError(f"{cfg.out} already holds a training run ({state}); add --resume to continue it (a larger "
                         "--max-steps extends it), or train into another --out")
    record = train(cfg, resume=args.resume)
    if record and not record.get("nothing_taught"):
        acc = " / ".join(f"{a:.2f}" for a in record.get("acc_per_step", []))
        per = "block row 1.." if cfg.draft_arch == "dflash" else "TTT step"
        print(f"last step: loss {record['loss']:.4g}, draft accuracy per {per} {acc}, "
              f"{record['tokens_per_s']:.0f} tokens/s (every step: {run_dir.log})")
    return 130 if record.get("interrupted") else 1 if record.get("nothing_taught") else 0
