"""Pretrain the tiny DeepSeek-V3 that eyas ships (examples/tiny-deepseek-v3), with its MTP layer.

Resumable: every --ckpt-every steps the full state (weights, optimizer, step, router biases) is written atomically
to WORK/ckpt.pt, and the shippable bf16 checkpoint is exported to OUT. Rerunning the same command continues.
Batches are a pure function of (seed, step), so a resumed run sees exactly the batches it would have seen.
--init-from starts a new run (its own schedule, fresh optimizer) from a shipped checkpoint, which is how training
continues on a machine that has only the committed model: the bundled target is its own resume point.

    python scripts/tiny_target/build_data.py      # corpus, tokenizer, token arrays (a minute)
    python scripts/tiny_target/train.py --max-steps 3000
    python scripts/tiny_target/train.py --init-from examples/tiny-deepseek-v3 --lr 1e-3 --max-steps 1600
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from unlikelihood import (
    PromptSource,
    answer_quality,
    generate,
    penalised_continuations,
    repetitive_share,
    unlikelihood_loss,
)

from eyas.checkpoint import load_model, save_model
from eyas.config import DeepseekV3Config, RopeConfig
from eyas.engine.llm import load_tokenizer
from eyas.models.deepseek_v3 import DeepseekV3ForCausalLM, MoE

ROOT = Path(__file__).resolve().parents[2]


def tiny_config(vocab_size: int, bos: int, eos: int) -> DeepseekV3Config:
    """A DeepSeek-V3 in miniature: 8 layers (1 dense, 7 MoE with 8 routed experts in 4 groups, top-2, 1 shared),
    MLA with kv_lora_rank + qk_rope_head_dim = 512 + 64 (the size vLLM's CPU MLA kernel runs), YaRN, one MTP layer."""
    rope = RopeConfig(head_dim=64, theta=10000.0, type="yarn", factor=4.0, original_max_position_embeddings=512,
                      beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0, interleave=True)
    return DeepseekV3Config(
        vocab_size=vocab_size, hidden_size=192, intermediate_size=768, num_hidden_layers=8, num_attention_heads=4,
        kv_lora_rank=512, qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32, rope=rope,
        max_position_embeddings=2048, q_lora_rank=128, moe_intermediate_size=96, n_routed_experts=8,
        n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2, routed_scaling_factor=2.5,
        norm_topk_prob=True, first_k_dense_replace=1, moe_layer_freq=1, num_nextn_predict_layers=1,
        bos_token_id=bos, eos_token_ids=[eos], torch_dtype="bfloat16", source="tiny_config")


def init_weights(model: DeepseekV3ForCausalLM, std: float = 0.02) -> None:
    for name, p in model.named_parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=std)
            if name.endswith(("o_proj.weight", "down_proj.weight")):  # GPT-2 style depth scaling of residual writes
                p.data /= math.sqrt(2 * model.config.num_hidden_layers)
    mtp = model.model.mtp_layer(0)  # the MTP layer starts from the main embedding and head, as DeepSeek shares them
    mtp.embed_tokens.weight = model.model.embed_tokens.weight
    mtp.shared_head.head.weight = model.lm_head.weight


def batch(arrays: dict, step: int, seed: int, batch_size: int, seq_len: int, chat_fraction: float,
          package_fraction: float = 0.0):
    """(tokens [B, T+1], loss mask [B, T+1]) drawn from the source files (the standard library's, then with
    `package_fraction` of the text rows the installed packages') and the chat conversations."""
    rng = np.random.default_rng([seed, step])
    tokens = np.empty((batch_size, seq_len + 1), dtype=np.int64)
    mask = np.ones((batch_size, seq_len + 1), dtype=np.float32)
    for b in range(batch_size):
        if rng.random() < chat_fraction:
            data, chat_mask = arrays["chat"], arrays["chat_mask"]
            start = int(rng.integers(0, len(data) - seq_len - 1))
            tokens[b] = data[start:start + seq_len + 1]
            # full loss on chat text too, with assistant turns weighted up: they are what chat users see
            mask[b] = 1.0 + chat_mask[start:start + seq_len + 1]
        else:
            # no draw at fraction 0: runs without the packages see the batches they always saw
            data = arrays["packages_train" if package_fraction and rng.random() < package_fraction else "train"]
            start = int(rng.integers(0, len(data) - seq_len - 1))
            tokens[b] = data[start:start + seq_len + 1]
    return torch.from_numpy(tokens), torch.from_numpy(mask)


def losses(model: DeepseekV3ForCausalLM, tokens: torch.Tensor, mask: torch.Tensor):
    """Next-token loss of the main model and the MTP loss (token t+2 from hidden t and token t+1)."""
    inputs = tokens[:, :-1]
    hidden, _ = model.model(inputs)
    logits = model.compute_logits(hidden)
    w = mask[:, 1:]
    main = (F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten(), reduction="none") * w.flatten()).sum() \
        / w.sum()
    mtp = model.model.mtp_layer(0)
    cos, sin = model.model.rotary(torch.arange(inputs.shape[1] - 1))
    mtp_hidden = mtp(inputs[:, 1:], hidden[:, :-1], cos, sin)
    mtp_logits = mtp.compute_logits(mtp_hidden)
    w2 = mask[:, 2:]
    mtp_loss = (F.cross_entropy(mtp_logits.flatten(0, 1), tokens[:, 2:].flatten(), reduction="none")
                * w2.flatten()).sum() / w2.sum()
    return main, mtp_loss


def update_router_biases(model: DeepseekV3ForCausalLM, counts: dict, rate: float) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing: nudge each expert's selection bias toward the mean load."""
    for name, moe in model.named_modules():
        if isinstance(moe, MoE) and name in counts:
            load = counts[name]
            moe.gate.e_score_correction_bias += rate * torch.sign(load.mean() - load)


@torch.no_grad()
def evaluate_bpb(model: DeepseekV3ForCausalLM, val: np.ndarray, num_bytes: int, seq_len: int,
                 max_tokens: int | None = None) -> float:
    """Bits per byte of the held-out files: summed next-token NLL over non-overlapping windows / bytes."""
    model.eval()
    data = torch.from_numpy(val[: max_tokens or len(val)].astype(np.int64))
    nats, counted = 0.0, 0
    for start in range(0, len(data) - 1, seq_len):
        window = data[start:start + seq_len + 1]
        logits = model(window[None, :-1])
        nats += F.cross_entropy(logits[0], window[1:], reduction="sum").item()
        counted += len(window) - 1
    model.train()
    return nats / math.log(2) / (num_bytes * counted / (len(val) - 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=ROOT / "work" / "tiny_target", help="data arrays and ckpt.pt")
    ap.add_argument("--out", type=Path, default=ROOT / "examples" / "tiny-deepseek-v3", help="shipped checkpoint")
    ap.add_argument("--max-steps", type=int, default=6000)
    ap.add_argument("--stop-at", type=int, help="end the run at this step (the schedule still spans --max-steps)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr", type=float, default=1e-4)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--mtp-weight", type=float, default=0.3, help="DeepSeek-V3 uses 0.3, then 0.1")
    ap.add_argument("--chat-fraction", type=float, default=0.2)
    ap.add_argument("--package-fraction", type=float, default=0.0,
                    help="share of the text rows drawn from the packages' sources instead of the standard library")
    ap.add_argument("--init-from", type=Path, help="a shipped checkpoint to start this run from (ignored on resume)")
    ap.add_argument("--bias-rate", type=float, default=1e-3, help="router bias update speed (gamma)")
    ap.add_argument("--unlikelihood-weight", type=float, default=0.0,
                    help="weight of the sequence-level unlikelihood loss on the model's own repetitive greedy "
                         "continuations (unlikelihood.py; 0: off)")
    ap.add_argument("--ul-round-steps", type=int, default=6, help="steps between regenerations of the continuations")
    ap.add_argument("--ul-prompts", type=int, default=48, help="training prompts continued per round")
    ap.add_argument("--ul-batch-size", type=int, default=4, help="penalised continuations per step")
    ap.add_argument("--ul-max-tokens", type=int, default=160)
    ap.add_argument("--ul-continuation-share", type=float, default=0.35,
                    help="share of the prompts that are raw file text to continue (the rest: function requests)")
    ap.add_argument("--ul-min-share", type=float, default=0.4,
                    help="continuations with more of their tokens inside a repeated 4-gram are penalised")
    ap.add_argument("--state", type=Path, help="ckpt.pt and train_log.jsonl go here (default: --work)")
    ap.add_argument("--ckpt-every", type=int, default=100)
    ap.add_argument("--snapshot-every", type=int, default=0,
                    help="also keep the shippable checkpoint of every Nth step in STATE/model-stepN (0: never)")
    ap.add_argument("--eval-every", type=int, default=500)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    meta = json.loads((args.work / "meta.json").read_text())
    arrays = {name: np.memmap(args.work / f"{name}.bin", dtype=np.uint16, mode="r")
              for name in ("train", "val", "packages_train", "packages_val")}
    arrays["chat"] = np.memmap(args.work / "chat_train.bin", dtype=np.uint16, mode="r")
    arrays["chat_mask"] = np.memmap(args.work / "chat_train_mask.bin", dtype=np.uint8, mode="r")
    val_bytes = meta["splits"]["heldout"]["bytes"]
    package_val_bytes = meta["package_splits"]["heldout"]["bytes"]

    torch.manual_seed(args.seed)
    config = tiny_config(meta["vocab_size"], bos=0, eos=1)
    model = DeepseekV3ForCausalLM(config)
    init_weights(model)
    if args.init_from is not None:
        # strict: every weight comes from the file; the tied MTP embedding and head stay tied (init_weights tied
        # them, and the file stores them as equal copies)
        model.load_state_dict(load_model(args.init_from, dtype=torch.float32).state_dict())
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    state_dir = args.state or args.work
    state_dir.mkdir(parents=True, exist_ok=True)
    ckpt_path, log_path = state_dir / "ckpt.pt", state_dir / "train_log.jsonl"
    step = 0
    if ckpt_path.exists():
        state = torch.load(ckpt_path, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step = state["step"]
        print(f"resumed from {ckpt_path} at step {step}")

    def lr_at(s: int) -> float:
        if s < args.warmup:
            return args.lr * (s + 1) / args.warmup
        progress = min(1.0, (s - args.warmup) / max(1, args.max_steps - args.warmup))
        return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * progress))

    # count expert selections per MoE layer, for the balancing update
    counts: dict[str, torch.Tensor] = {}

    def count_hook(name):
        def hook(module, inputs, output):
            ids, _ = module.route(inputs[0].detach().reshape(-1, inputs[0].shape[-1]))
            counts[name] = torch.bincount(ids.flatten(), minlength=module.config.n_routed_experts).float()
        return hook

    for name, m in model.named_modules():
        if isinstance(m, MoE):
            m.register_forward_hook(count_hook(name))

    def save(step: int) -> None:
        tmp = ckpt_path.with_suffix(".tmp")
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, tmp)
        os.replace(tmp, ckpt_path)
        save_model(model, args.out, dtype=torch.bfloat16)

    tokenizer_dir = ROOT / "examples" / "tiny-deepseek-v3"
    if args.unlikelihood_weight:
        prompt_source = PromptSource(args.work, arrays, load_tokenizer(tokenizer_dir), args.ul_continuation_share)
        # held-out function requests past the ones evaluate.py and eval.jsonl draw: the repetition to watch
        heldout = [json.loads(line)["messages"][:1]
                   for line in (args.work / "conversations_heldout.jsonl").read_text().splitlines() if line]
        heldout = heldout[len(heldout) // 2:][:32]
    pool, pool_round = [], None

    model.train()
    t0, tokens_seen = time.time(), 0
    last_step = min(args.max_steps, args.stop_at or args.max_steps)
    while step < last_step:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        ul_loss = torch.zeros(())
        if args.unlikelihood_weight:
            round_ = step // args.ul_round_steps
            if round_ != pool_round:
                prompts, two_turn = prompt_source.prompts(args.seed, round_, args.ul_prompts)
                outputs = generate(model, tokenizer_dir, prompts, two_turn, args.ul_max_tokens, args.threads, round_)
                pool, pool_round = penalised_continuations(outputs, args.ul_min_share), round_
                pool_repetitive = repetitive_share(outputs)
            take = [pool[(step % args.ul_round_steps * args.ul_batch_size + i) % len(pool)]
                    for i in range(min(args.ul_batch_size, len(pool)))]
            if take:
                ul_loss = unlikelihood_loss(model, take)
        tokens, mask = batch(arrays, step, args.seed, args.batch_size, args.seq_len, args.chat_fraction,
                             args.package_fraction)
        main_loss, mtp_loss = losses(model, tokens, mask)  # last forward: its expert counts steer the biases
        loss = main_loss + args.mtp_weight * mtp_loss + args.unlikelihood_weight * ul_loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item()
        optimizer.step()
        with torch.no_grad():
            update_router_biases(model, counts, args.bias_rate)
        step += 1
        tokens_seen += tokens.shape[0] * (tokens.shape[1] - 1)
        record = {"step": step, "loss": round(main_loss.item(), 4), "mtp_loss": round(mtp_loss.item(), 4),
                  "lr": lr_at(step - 1), "grad_norm": round(grad_norm, 3),
                  "tokens_per_s": round(tokens_seen / (time.time() - t0), 1)}
        if args.unlikelihood_weight:
            record.update(ul_loss=round(ul_loss.item(), 4), ul_penalised=len(pool),
                          train_prompts_repetitive=round(pool_repetitive, 3))
        if step % args.eval_every == 0 or step == last_step:
            record["val_bpb_32k"] = round(evaluate_bpb(model, arrays["val"], val_bytes, args.seq_len, 32768), 4)
            record["packages_val_bpb_32k"] = round(evaluate_bpb(
                model, arrays["packages_val"], package_val_bytes, args.seq_len, 32768), 4)
            if args.unlikelihood_weight:
                outputs = generate(model, tokenizer_dir, heldout, [], 256, args.threads, 0)
                record.update(answer_quality(heldout, outputs))
        with open(log_path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if step % 10 == 0 or "val_bpb_32k" in record:
            print(json.dumps(record), flush=True)
        if step % args.ckpt_every == 0 or step == last_step:
            save(step)
        if args.snapshot_every and step % args.snapshot_every == 0:
            save_model(model, state_dir / f"model-step{step}", dtype=torch.bfloat16)


if __name__ == "__main__":
    main()
