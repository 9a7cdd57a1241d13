"""`eyas regenerate`: rewrite the assistant turns of a conversation file with the target's own answers.

Drafts trained on what the target itself says accept more than drafts trained on someone else's answers. Each
conversation keeps its system and user turns; every assistant turn is replaced by the target's generation given
the conversation so far (earlier turns already regenerated). Conversations are processed in chunks, all of a chunk
batched through the engine turn by turn; each finished chunk is appended to the output, so an interrupted run
resumes after the last complete chunk.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from tqdm import tqdm

from eyas.config import SamplingParams
from eyas.threads import THREADS_HELP
from eyas.train.data import iter_records, normalize_record


def normalise(record: dict, where: str) -> list[dict]:
    """OpenAI `messages` or ShareGPT `conversations` -> messages (plain-text records have no turns to rewrite)."""
    messages = normalize_record(record, where)
    if isinstance(messages, str):
        raise ValueError(f"{where}: a plain-text record has no assistant turns to regenerate")
    return messages


def regenerate(llm, conversations: list[list[dict]], params: SamplingParams, first_index: int = 0,
               on_answer: Callable[[], None] | None = None) -> list[list[dict]]:
    """The conversations with every assistant turn replaced by the target's answer, batched turn by turn;
    `on_answer()` is called as each answer is done.

    With sampling and a seed, conversation i's turn j is seeded from (seed, first_index + i, j): the output does
    not depend on chunking or batching."""
    out: list[list[dict]] = [[] for _ in conversations]
    position = [0] * len(conversations)
    turn = 0
    while True:
        # advance each conversation to its next assistant turn, copying the other turns
        waiting = []
        for i, conv in enumerate(conversations):
            while position[i] < len(conv) and conv[position[i]]["role"] != "assistant":
                out[i].append(dict(conv[position[i]]))
                position[i] += 1
            if position[i] < len(conv):
                waiting.append(i)
        if not waiting:
            return out
        per_request = [params if params.seed is None or params.greedy else
                       replace(params, seed=hash((params.seed, first_index + i, turn)) % 2**63) for i in waiting]
        answers = llm.generate([list(out[i]) for i in waiting], per_request,
                               on_finish=None if on_answer is None else lambda _: on_answer())
        for i, answer in zip(waiting, answers):
            out[i].append({"role": "assistant", "content": answer.text})
            position[i] += 1
        turn += 1


def add_cli(subparsers) -> None:
    from eyas.engine.llm import DEFAULT_MODEL

    p = subparsers.add_parser("regenerate", help="rewrite assistant turns with the target's own answers",
                              description=__doc__)
    p.add_argument("data", type=Path, help="JSONL conversations (OpenAI messages or ShareGPT conversations)")
    p.add_argument("out", type=Path, help="output JSONL (messages form); appended to, so reruns resume")
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="target checkpoint directory")
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chunk-size", type=int, default=64, help="conversations per saved chunk")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--kv-cache-memory", type=float, metavar="GIB",
                   help="KV cache budget (default: 0.25 GiB on CPU); too small for max-num-seqs long conversations "
                   "means preemption and recomputation")
    p.add_argument("--limit", type=int, help="only the first N conversations")
    p.add_argument("--threads", type=int, help=THREADS_HELP)
    p.set_defaults(func=_cmd_regenerate)


def _cmd_regenerate(args: argparse.Namespace) -> int:
    from eyas.engine.llm import LLM

    conversations = [normalise(record, f"{args.data}:{lineno}") for lineno, record in iter_records(args.data)]
    conversations = conversations[:args.limit] if args.limit else conversations
    done = 0
    if args.out.is_file():
        text = args.out.read_text()
        if text and not text.endswith("\n"):  # a write cut short: drop the partial last line
            text = text[:text.rfind("\n") + 1]
            args.out.write_text(text)
        done = len(text.splitlines())
    if done > len(conversations):
        raise ValueError(f"{args.out} has {done} lines but {args.data} only {len(conversations)} conversations; "
                         "is it the output of another file?")
    llm = LLM(args.model, max_num_seqs=args.max_num_seqs, kv_cache_memory_gb=args.kv_cache_memory,
              threads=args.threads)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    # the bar counts answers, each as it is done; conversations are saved a chunk at a time
    def answers(convs: list[list[dict]]) -> int:
        return sum(m["role"] == "assistant" for conv in convs for m in conv)

    bar = tqdm(total=answers(conversations), initial=answers(conversations[:done]), desc="regenerate",
               unit="answer")
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_new_tokens, seed=args.seed)
    for start in range(done, len(conversations), args.chunk_size):
        chunk = conversations[start:start + args.chunk_size]
        rewritten = regenerate(llm, chunk, params, first_index=start, on_answer=lambda: bar.update(1))
        with open(args.out, "a") as f:  # whole chunks, appended once done
            f.write("".join(json.dumps({"messages": m}, ensure_ascii=False) + "\n" for m in rewritten))
    bar.close()
    print(f"{args.out}: {len(conversations)} conversations ({len(conversations) - done} regenerated now)")
    return 0
