"""Plain greedy decode throughput, eyas vs HF transformers, measured in one run with the same thread count.

    python benchmarks/decode.py                       # the shipped tiny target, batch 1 and 8
    python benchmarks/decode.py --threads 2 --new-tokens 256

Prints generated tokens per second for each engine and the eyas/transformers ratio. Both decode the same prompts
greedily with EOS ignored, so they generate the same number of tokens; the first batch of each is a warm-up.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from eyas import LLM, SamplingParams
from eyas.paths import DEFAULT_MODEL


def prompts_for(batch: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(batch)
    return [torch.randint(10, vocab, (length,), generator=g).tolist() for _ in range(batch)]


def time_eyas(llm: LLM, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    return time.perf_counter() - start, [o.token_ids for o in outs]


def time_hf(model, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    ids = torch.tensor(prompts)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=0)
    return time.perf_counter() - start, out[:, ids.shape[1]:].tolist()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per engine and batch size; best is kept")
    ap.add_argument("--enforce-eager", action="store_true", help="eyas op by op (default: the compiled step, as every "
                    "eyas command runs on CPU)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    llm = LLM(args.model, max_num_seqs=max(args.batch_sizes), compiled_step=not args.enforce_eager,
              dtype="float32", threads=args.threads)
    hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    # as eyas's ignore_eos: the end-of-sequence token is generated like any other and does not stop the sequence
    # (min_new_tokens instead masks it out until the length is reached, and stopping at it pads the rest: either
    # way transformers' tokens left eyas's wherever the greedy choice was that token, 4 of 8 prompts here)
    hf.generation_config.eos_token_id = None
    vocab = llm.model.config.vocab_size
    print(f"model {args.model.name}, threads {args.threads}, prompt {args.prompt_len} tokens, "
          f"{args.new_tokens} new tokens, float32, torch {torch.__version__}, eyas "
          f"{'eager' if args.enforce_eager else 'compiled step'}")
    print(f"{'batch':>5} {'eyas tok/s':>11} {'hf tok/s':>9} {'ratio':>6}  same tokens")
    for batch in args.batch_sizes:
        prompts = prompts_for(batch, args.prompt_len, vocab)
        time_eyas(llm, prompts, 8)  # warm-up
        time_hf(hf, prompts, 8)
        eyas_s, eyas_tokens = min(time_eyas(llm, prompts, args.new_tokens) for _ in range(args.repeats))
        hf_s, hf_tokens = min(time_hf(hf, prompts, args.new_tokens) for _ in range(args.repeats))
        total = batch * args.new_tokens
        print(f"{batch:>5} {total / eyas_s:>11.1f} {total / hf_s:>9.1f} {hf_s / eyas_s:>5.2f}x  "
              f"{eyas_tokens == hf_tokens}")


if __name__ == "__main__":
    main()
