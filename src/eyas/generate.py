"""`eyas generate`: the target (with its draft, when it has one) on prompts from the command line or a file."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from eyas.engine_args import EngineArgs
from eyas.records import read_prompt_file


def cmd_generate(args: argparse.Namespace) -> int:
    from eyas.sampling_params import SamplingParams

    if args.prompt_file:
        prompts = read_prompt_file(args.prompt_file)
    else:
        prompts = list(args.prompt) if args.prompt is not None else ["def fibonacci(n):\n"]
        if args.chat:
            prompts = [[{"role": "user", "content": p}] for p in prompts]
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                            seed=args.seed, max_tokens=args.max_new_tokens, stop=args.stop or [],
                            ignore_eos=args.ignore_eos)
    engine = EngineArgs.from_cli_args(args)
    engine.max_num_seqs = min(engine.max_num_seqs, len(prompts))  # no KV cache for slots no prompt fills
    llm = engine.build_llm()
    outputs = llm.generate(prompts, params, use_tqdm=not args.json and len(prompts) > 1)
    for prompt, out in zip(prompts, outputs):
        if args.json:
            record = {"prompt": prompt, "text": out.text, "token_ids": out.token_ids,
                      "num_generated": out.num_generated, "finish_reason": out.finish_reason,
                      "time_to_first_token": round(out.time_to_first_token, 6),
                      "tokens_per_second": round(out.tokens_per_second, 2)}
            if llm.speculative is not None:
                record.update(acceptance_length=round(out.acceptance_length, 4), num_drafted=out.num_drafted,
                              num_accepted=out.num_accepted,
                              accepted_per_position=[round(a, 4) for a in out.accepted_per_position],
                              tokens_per_verify_step=round(out.tokens_per_verify_step, 4))
            print(json.dumps(record))
        else:
            shown = prompt if isinstance(prompt, str) else prompt[-1].get("content", "").rstrip("\n") + "\n"
            print(f"{shown}\033[1m{out.text}\033[0m" if sys.stdout.isatty() else shown + out.text)
            spec = acceptance_summary(out) if llm.speculative is not None else ""
            print(f"-- {out.num_generated} tokens, {out.tokens_per_second:.1f} tok/s, {out.finish_reason}{spec}",
                  file=sys.stderr)
    if llm.speculative is not None and args.speed_check and len(prompts) <= llm.scheduler.max_num_seqs:
        warn_if_slower_than_plain(llm, prompts, params, outputs)
    return 0


def acceptance_summary(out) -> str:
    """The draft's acceptance length, and what the verified widths delivered when a narrower width made it less."""
    text = f", acceptance length {out.acceptance_length:.2f}"
    if out.tokens_per_verify_step < out.acceptance_length - 0.005:
        text += f" ({out.tokens_per_verify_step:.2f} tokens per verify step at the widths verified)"
    return text


def warn_if_slower_than_plain(llm, prompts: list, params, outputs: list) -> None:
    """Decode the same prompts plain and speculative again (up to 32 tokens each) and warn when the speculative run
    decoded slower: a weak draft must not pass unnoticed. The user's own run is not the one timed: it paid the
    process's first calls. The speculative run verifies the configured width every step: the adaptive width's
    trials of each width, which a short output does not amortize, would make a draft's figure depend on where the
    policy stood (on the README's prompt in bfloat16, 0.92-0.98x plain against 1.53-1.58x at K=3).
    Decode speed excludes the prefill, so runs of different lengths compare."""
    from dataclasses import replace

    from eyas.engine.sequence import AcceptanceCounts
    from eyas.eval.acceptance import slower_than_plain_warning

    short = replace(params, max_tokens=min(params.max_tokens, 32))
    with llm.plain_decoding():
        plain = llm.generate(prompts, short)
    with llm.fixed_width():
        speculative = llm.generate(prompts, short)

    def rate(outs) -> float:
        rates = [o.decode_tokens_per_second for o in outs if o.num_generated > 1]
        return sum(rates) / len(rates) if rates else 0.0

    spec_rate, plain_rate = rate(speculative), rate(plain)
    if spec_rate and plain_rate:
        al = AcceptanceCounts.total(outputs).acceptance_length
        warning = slower_than_plain_warning(spec_rate / plain_rate, spec_rate, plain_rate, al)
        if warning:
            print(warning, file=sys.stderr)


def add_cli(subparsers: argparse._SubParsersAction) -> None:
    """`eyas generate`."""
    g = subparsers.add_parser(
        "generate", help="run the target on prompts (batched, paged KV cache)",
        description="Generate continuations. Prompts come from --prompt (repeatable) or --prompt-file (JSONL: "
        "{\"prompt\": ...}, {\"messages\": [...]} or {\"turns\": [...]} per line, chat rendered by the tokenizer's "
        "template). Greedy by default (--temperature 0).")
    EngineArgs.add_cli_args(g, without=("--max-model-len",))
    g.add_argument("--prompt", action="append", help="a text prompt; repeat for a batch")
    g.add_argument("--prompt-file", type=Path, help="JSONL file of prompts")
    g.add_argument("--chat", action="store_true", help="send each --prompt as a user message, rendered with the "
                   "tokenizer's chat template (as a chat endpoint would), instead of as raw text")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    g.add_argument("--top-k", type=int, default=0, help="0 is off")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed", type=int, help="per-request seed: same output whatever else is in the batch")
    g.add_argument("--stop", action="append", help="stop string (repeatable); not included in the text")
    g.add_argument("--ignore-eos", action="store_true", help="keep going past the end-of-sequence token")
    g.add_argument("--json", action="store_true", help="one JSON object per prompt: text, token_ids, "
                   "num_generated, finish_reason, time_to_first_token, tokens_per_second")
    g.add_argument("--no-speed-check", dest="speed_check", action="store_false", help="with a draft, skip the "
                   "short plain-decoding run that warns when speculation was slower than plain decoding")
    g.set_defaults(func=cmd_generate)
