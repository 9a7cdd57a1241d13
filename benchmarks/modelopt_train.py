"""Train an EAGLE-3 draft with NVIDIA Model Optimizer (the peer trainer of `benchmarks/modelopt_compare.py`).

Runs INSIDE a Model Optimizer virtualenv (not eyas's environment: Model Optimizer 0.47 wants transformers 5.14.1),
on CPU, in float32 or (--precision bf16) with the target in bfloat16 and the draft under bfloat16 autocast with
float32 weights, the counterpart of `eyas train --target-dtype bfloat16 --mixed-precision bf16`:

    /tmp/modelopt-venv/bin/python benchmarks/modelopt_train.py --target DIR --data JSONL --out DIR \
        --steps N --batch-size B --max-length T

What it does, matching `eyas train` wherever the comparison needs it:
  * the target is loaded with transformers (float32, or bfloat16 with --precision bf16; CPU) and converted with
    `mtsp.convert(model, [("eagle", config)])`: EAGLE-3 (Model Optimizer's default EAGLE-3 architecture config:
    aux hidden states on, last layernorm on, its default aux layers {1, L//2-1, L-4}), a one-layer llama-type
    draft, `eagle_ttt_steps` 3, loss decay 0.9, base model frozen. The draft's attention/MLP shape is set to that
    of eyas's MHA draft (the target's head count, head_dim = hidden / heads, the target's dense intermediate size
    and rms eps) instead of Model Optimizer's Llama-3-8B defaults, which do not fit a 192-wide target;
  * the conversations are tokenized with the target's chat template, loss mask on assistant content and the
    end-of-turn token after it (the same tokens `eyas train` trains on), in Model Optimizer's shifted convention
    (loss_mask[i] = 1 when token i + 1 is an assistant token);
  * batches: the same seeded per-epoch permutation and right padding to the longest sequence (capped at
    --max-length) as `eyas train`, so both trainers see the same tensors step for step;
  * optimizer: plain torch AdamW (betas 0.9/0.95, no weight decay), linear warmup then cosine to 0.1 x lr, grad
    clip 0.5 - eyas's defaults - over the draft's trainable parameters;
  * throughput: training tokens/s = batch x padded positions per step, summed over the steps after
    --measure-after warm-up steps, divided by their wall time (each loop iteration whole, as eyas's log times
    it: batch assembly, target forward, draft TTT forward/backward, optimizer step; loading, tokenizing and export
    excluded);
  * export: Model Optimizer's own deployment export (`export_speculative_decoding`, i.e. the EagleExporter behind
    `examples/speculative_decoding/scripts/export_hf_checkpoint.py`) to --out: model.safetensors + config.json.

Prints one JSON line: {"trainer": "modelopt", "steps", "tokens_per_s", "tokens_per_s_all_steps", ...}.

Offline/CPU workarounds (each marked WORKAROUND below):
  1. eagle_use_torch_compile=False: the default compiles `_eagle_forward` with mode="max-autotune" and
     dynamic=False; on CPU this spends minutes in inductor autotuning and recompiles for every new padded length.
     Eager runs the identical Python code (the compiled and eager functions compute the same loss).
  2. eagle_export_rope_scaling={}: by default the export writes a YaRN rope_scaling (factor 32) into config.json
     for long-context serving, although the draft was trained with plain rope; the evaluation here runs at short
     contexts, so the exported config must describe the rope the draft was trained with, or any loader that
     honours rope_scaling evaluates a different function than the one trained.
  3. The TTT attention-mask cache (`_cached_attn_blk_masks`) is keyed by TTT step only, not by sequence length:
     Model Optimizer's own data pipeline pads every batch to one fixed length. With eyas's pad-to-longest batches
     the cached mask would have the wrong shape when the length changes, so the cache is cleared when it does.
     The mask is a pure function of (length, step): clearing only recomputes what the cache would hold.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="target checkpoint directory (transformers-loadable)")
    p.add_argument("--data", required=True, help="JSONL conversations ({\"messages\": [...]}, OpenAI form)")
    p.add_argument("--out", required=True, help="export directory for the draft (Model Optimizer HF format)")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--warmup-steps", type=int, default=50)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=0.5)
    p.add_argument("--ttt-steps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--measure-after", type=int, default=5, help="warm-up steps excluded from tokens/s")
    p.add_argument("--log", help="per-step JSONL log (default OUT/train_log.jsonl)")
    p.add_argument("--vocab-file", help="a compressed draft vocabulary from `eyas calibrate-vocab` (safetensors, "
                   "'d2t'): the draft gets Model Optimizer's own compressed head (draft_vocab_size = len(d2t), its "
                   "own lm_head, the d2t buffer set as Model Optimizer's draft-vocab cache loader sets it)")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                   help="bf16: target weights in bfloat16, the draft's forward/backward under bfloat16 autocast, "
                   "its weights and optimizer state float32")
    return p.parse_args()


# -- data ---------------------------------------------------------------------------------------------------------

def render(tok, messages, add_generation_prompt):
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def encode(tok, text):
    # the chat template writes bos itself
    return list(tok(text, add_special_tokens=False)["input_ids"])


def tokenize(tok, messages, max_length):
    """(input_ids, assistant mask): mask 1 on each assistant message's content and the end-of-turn text after it,
    located by the token counts of rendered prefixes (header = the generation prompt)."""
    full = render(tok, messages, False)
    ids = encode(tok, full)
    mask = [0] * len(ids)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start_text = render(tok, messages[:i], True)
        end_text = render(tok, messages[:i + 1], False)
        assert full.startswith(start_text) and full.startswith(end_text), "template rewrites earlier turns"
        a, b = encode(tok, start_text), encode(tok, end_text)
        assert ids[:len(a)] == a and ids[:len(b)] == b, "prefix does not tokenize to a prefix"
        for j in range(len(a), len(b)):
            mask[j] = 1
    return ids[:max_length], mask[:max_length]


def load_examples(tok, path, max_length):
    examples = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            messages = [{"role": m["role"], "content": m["content"]} for m in json.loads(line)["messages"]]
            ids, mask = tokenize(tok, messages, max_length)
            if sum(mask):
                examples.append((ids, mask))
    return examples


def batch_indices(torch, num_examples, step, batch_size, seed):
    """Consecutive slices of one seeded permutation per epoch (the order `eyas train` uses)."""
    per_epoch = max(1, num_examples // batch_size)
    epoch, k = divmod(step, per_epoch)
    order = torch.randperm(num_examples, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
    return order[k * batch_size:(k + 1) * batch_size].tolist()


def collate(torch, items, max_length):
    """Right-pad to the longest item. loss_mask in Model Optimizer's convention: position i is trained when the
    token it leads to (i + 1) is an assistant token."""
    T = min(max_length, max(len(ids) for ids, _ in items))
    input_ids = torch.zeros(len(items), T, dtype=torch.long)
    loss_mask = torch.zeros(len(items), T)
    for b, (ids, mask) in enumerate(items):
        n = min(T, len(ids))
        input_ids[b, :n] = torch.tensor(ids[:n])
        shifted = mask[1:n] + [0]
        loss_mask[b, :n] = torch.tensor(shifted, dtype=torch.float32)
    return input_ids, loss_mask


# -- diagnostic: the function trained vs the function a vLLM/SGLang/eyas-style loader serves ---------------------

def served_vs_trained(torch, model, batches):
    """Model Optimizer 0.47's HF EAGLE-3 layer normalizes the fused hidden input twice while training:
    transformers' LlamaDecoderLayer applies `input_layernorm` to its input before calling self_attn, and Model
    Optimizer's attention pre-hook then applies `hidden_norm` to that, giving
    cat(input_layernorm(embeds), hidden_norm(input_layernorm(g))). The exported checkpoint is read by serving
    engines (and eyas) as cat(input_layernorm(embeds), hidden_norm(g)). The two agree exactly only while
    input_layernorm.weight is all ones. This measures, on held batches at TTT step 0, how often the served
    function's argmax equals the trained function's, and how far input_layernorm.weight moved from 1."""
    em = model.eagle_module
    layer = em.layers[0]
    norm = layer.input_layernorm

    class FirstCallIdentity(torch.nn.Module):  # identity for the decoder's call on g, the norm for the embeds
        def __init__(self):
            super().__init__()
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            return x if self.calls == 1 else norm(x)

    captured = {}
    h1 = em.register_forward_pre_hook(lambda mod, a, kw: captured.__setitem__("in", (a, kw)), with_kwargs=True)
    h2 = em.register_forward_hook(lambda mod, a, out: captured.__setitem__("out", out[0]))
    lm_head = em.lm_head if hasattr(em, "lm_head") else model._base_model_lm_head
    agree = total = 0
    was_training = model.training
    model.eval()  # one TTT step: the step-0 forward only
    try:
        with torch.no_grad():
            for input_ids, loss_mask in batches:
                model(input_ids=input_ids, loss_mask=loss_mask)
                trained = lm_head(captured["out"]).argmax(-1)
                a, kw = captured["in"]
                kw = dict(kw, past_key_values=None, use_cache=False)
                layer.input_layernorm = FirstCallIdentity()
                try:
                    em(*a, **kw)
                finally:
                    layer.input_layernorm = norm
                served = lm_head(captured["out"]).argmax(-1)
                valid = loss_mask.bool()
                agree += int(((trained == served) & valid).sum())
                total += int(valid.sum())
    finally:
        h1.remove()
        h2.remove()
        model.train(was_training)
    return {"input_layernorm_max_abs_dev_from_1": round(float((norm.weight - 1).abs().max()), 5),
            "served_vs_trained_step0_top1_agreement": round(agree / max(1, total), 4), "positions": total}


# -- main ---------------------------------------------------------------------------------------------------------

def main() -> int:
    args = parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch

    torch.set_num_threads(args.threads)
    import modelopt.torch.speculative as mtsp
    from modelopt.torch.export import export_speculative_decoding
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # the target's MTP layer (model.layers.N) is reported as unexpected; harmless

    tok = AutoTokenizer.from_pretrained(args.target)
    bf16 = args.precision == "bf16"
    model = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.bfloat16 if bf16 else torch.float32)
    cfg = model.config
    examples = load_examples(tok, args.data, args.max_length)
    if len(examples) < args.batch_size:
        raise SystemExit(f"{len(examples)} examples are fewer than one batch")

    heads = cfg.num_attention_heads
    arch = dict(mtsp.config.eagle3_default_config)  # Model Optimizer's EAGLE-3 defaults (aux states, last norm)
    arch.update({
        # shape the llama draft like eyas's MHA draft (Model Optimizer's defaults are Llama-3-8B sizes)
        "num_attention_heads": heads, "num_key_value_heads": heads, "head_dim": cfg.hidden_size // heads,
        "intermediate_size": cfg.intermediate_size, "rms_norm_eps": cfg.rms_norm_eps,
        "torch_dtype": "float32",
    })
    d2t = None
    if args.vocab_file:
        from safetensors.torch import load_file

        d2t = load_file(args.vocab_file)["d2t"].to(torch.int64)
        arch["draft_vocab_size"] = int(d2t.shape[0])
    eagle_cfg = {
        "eagle_decoder_type": "llama",
        "eagle_ttt_steps": args.ttt_steps,
        "eagle_loss_decay_factor": 0.9,
        "eagle_freeze_base_model": True,
        "eagle_use_torch_compile": False,  # WORKAROUND 1 (see module docstring)
        "eagle_export_rope_scaling": {},  # WORKAROUND 2
        "eagle_architecture_config": arch,
    }
    torch.manual_seed(args.seed)
    mtsp.convert(model, [("eagle", eagle_cfg)])
    if d2t is not None:  # what HFEagleModel.load_draft_vocab_cache does with its torch-saved d2t file
        model.eagle_module.d2t.copy_(d2t)
    # convert casts the draft to the target's dtype; mixed precision keeps the trained weights in float32
    model.eagle_module.float()
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)
    # train mode on the whole converted model: HFEagleModel runs its TTT steps only when `self.training` (in eval
    # mode it runs one step); the frozen target has no dropout (attention_dropout 0), so its outputs are unchanged
    model.train()
    aux_ids = list(model.eagle_config.eagle_aux_hidden_state_layer_ids)
    params = [p for p in model.parameters() if p.requires_grad]
    n_params = sum(p.numel() for p in params)
    optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)

    def lr_at(s):
        if s < args.warmup_steps:
            return args.lr * (s + 1) / args.warmup_steps
        progress = min(1.0, (s - args.warmup_steps) / max(1, args.steps - args.warmup_steps))
        return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log_path = Path(args.log) if args.log else out / "train_log.jsonl"
    log = log_path.open("w")
    measured_tokens, measured_time, all_tokens, all_time = 0, 0.0, 0, 0.0
    last_len = None
    for step in range(args.steps):
        t0 = time.perf_counter()  # the whole iteration, as eyas's log times it: batch assembly included
        for g in optimizer.param_groups:
            g["lr"] = lr_at(step)
        idx = batch_indices(torch, len(examples), step, args.batch_size, args.seed)
        input_ids, loss_mask = collate(torch, [examples[i] for i in idx], args.max_length)
        if input_ids.shape[1] != last_len:  # WORKAROUND 3: the TTT mask cache is keyed by step, not length
            model._cached_attn_blk_masks.clear()
            last_len = input_ids.shape[1]
        with autocast:
            output = model(input_ids=input_ids, loss_mask=loss_mask)
        loss = output.loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, args.grad_clip).item()
        optimizer.step()
        dt = time.perf_counter() - t0
        n_tok = input_ids.numel()
        all_tokens += n_tok
        all_time += dt
        if step >= args.measure_after:
            measured_tokens += n_tok
            measured_time += dt
        log.write(json.dumps({"step": step + 1, "loss": round(loss.item(), 5), "lr": lr_at(step),
                              "grad_norm": round(grad_norm, 4), "acc_per_step": [round(a, 4) for a in
                                                                                  output.train_acc[0]],
                              "tokens": n_tok, "seconds": round(dt, 4)}) + "\n")
        log.flush()
    log.close()

    check_batches = [collate(torch, [examples[i] for i in batch_indices(torch, len(examples), k, args.batch_size,
                                                                          args.seed + 1)], args.max_length)
                     for k in range(2)]
    model._cached_attn_blk_masks.clear()
    with autocast:
        diagnostic = served_vs_trained(torch, model, check_batches)
    model.eval()
    export_speculative_decoding(model, export_dir=out)
    result = {"trainer": "modelopt", "draft_arch": "mha (llama)", "steps": args.steps,
              "draft_vocab_size": model.eagle_config.draft_vocab_size,
              "batch_size": args.batch_size, "max_length": args.max_length, "lr": args.lr,
              "threads": torch.get_num_threads(), "precision": args.precision,
              "trainable_params": n_params, "aux_layer_ids": aux_ids,
              "tokens_per_s": round(measured_tokens / measured_time, 1) if measured_time else None,
              "tokens_per_s_all_steps": round(all_tokens / all_time, 1),
              "measured_steps": max(0, args.steps - args.measure_after), "final_loss": round(loss.item(), 5),
              "export_dir": str(out), **diagnostic}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
