"""`eyas regenerate`: rewrite the assistant turns of a conversation file with the target's own answers.

Drafts trained on what the target itself says accept more than drafts trained on someone else's answers. Each
conversation keeps its system and user turns; every assistant turn is replaced by the target's generation given
the conversation so far (earlier turns already regenerated). Conversations are processed in chunks, all of a chunk
batched through the engine turn by turn; each finished chunk is appended to the output, so an interrupted run
resumes after the last complete chunk.

With --server URL the target is a running OpenAI-compatible server (vLLM, SGLang, MAX, `eyas serve`), which applies
the chat template itself: --concurrency conversations are in flight at once, each record is appended as soon as it
and every record before it are done (a rerun resumes after them), and a failed request is retried with backoff
before the run stops, naming the URL and the HTTP status.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from tqdm import tqdm

from eyas.client import add_server_args
from eyas.engine_args import EngineArgs
from eyas.records import iter_records, normalize_record
from eyas.sampling_params import SamplingParams


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
        per_request = [params if seed_of(params, first_index + i, turn) is None else
                       replace(params, seed=seed_of(params, first_index + i, turn)) for i in waiting]
        answers = llm.generate([list(out[i]) for i in waiting], per_request,
                               on_finish=None if on_answer is None else lambda _: on_answer())
        for i, answer in zip(waiting, answers):
            out[i].append({"role": "assistant", "content": answer.text})
            position[i] += 1
        turn += 1


def seed_of(params: SamplingParams, index: int, turn: int) -> int | None:
    """Conversation `index`'s turn `turn` seed: from (seed, index, turn), so it depends on neither chunking nor
    batching; None when greedy or unseeded."""
    return None if params.seed is None or params.greedy else hash((params.seed, index, turn)) % 2**63


def regenerate_by_server(client, conversation: list[dict], params: SamplingParams, index: int,
                         on_answer: Callable[[], None] | None = None) -> list[dict]:
    """One conversation with its assistant turns answered, one after another, by a running server."""
    out: list[dict] = []
    turn = 0
    for message in conversation:
        if message["role"] != "assistant":
            out.append(dict(message))
            continue
        answer = client.chat(out, params.max_tokens, params.temperature, seed_of(params, index, turn))
        out.append({"role": "assistant", "content": answer.text})
        turn += 1
        if on_answer is not None:
            on_answer()
    return out


def add_cli(subparsers) -> None:
    p = subparsers.add_parser("regenerate", help="rewrite assistant turns with the target's own answers",
                              description=__doc__)
    p.add_argument("data", type=Path, help="JSONL conversations (OpenAI messages or ShareGPT conversations)")
    p.add_argument("out", type=Path, help="output JSONL (messages form); appended to, so reruns resume")
    EngineArgs.add_cli_args(p, max_num_seqs=32, without=("--device", "--max-model-len"), speculative=False)
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chunk-size", type=int, default=64, help="conversations per saved chunk")
    p.add_argument("--limit", type=int, help="only the first N conversations")
    p.add_argument("--server", metavar="URL", help="answer through this running OpenAI-compatible server (vLLM, "
                   "SGLang, MAX, eyas serve; e.g. http://127.0.0.1:8000) instead of loading --model here")
    add_server_args(p, 8, "conversations in flight at once")
    p.set_defaults(func=_cmd_regenerate)


def _cmd_regenerate(args: argparse.Namespace) -> int:
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
    args.out.parent.mkdir(parents=True, exist_ok=True)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_new_tokens, seed=args.seed)
    if args.server:
        return _regenerate_by_server(args, conversations, done, params)
    engine = EngineArgs.from_cli_args(args)
    engine.speculative_method = "none"  # the answers are the target's plain decoding; this command has no draft flags
    llm = engine.build_llm()
    # the bar counts answers, each as it is done; conversations are saved a chunk at a time
    bar = tqdm(total=_answers(conversations), initial=_answers(conversations[:done]), desc="regenerate",
               unit="answer")
    for start in range(done, len(conversations), args.chunk_size):
        chunk = conversations[start:start + args.chunk_size]
        rewritten = regenerate(llm, chunk, params, first_index=start, on_answer=lambda: bar.update(1))
        with open(args.out, "a") as f:  # whole chunks, appended once done
            f.write("".join(json.dumps({"messages": m}, ensure_ascii=False) + "\n" for m in rewritten))
    bar.close()
    print(f"{args.out}: {len(conversations)} conversations ({len(conversations) - done} regenerated now)")
    return 0


def _answers(conversations: list[list[dict]]) -> int:
    return sum(m["role"] == "assistant" for conv in conversations for m in conv)


def _regenerate_by_server(args: argparse.Namespace, conversations: list[list[dict]], done: int,
                          params: SamplingParams) -> int:
    from concurrent.futures import ThreadPoolExecutor

    from eyas.client import client_from_args

    client = client_from_args(args)
    bar = tqdm(total=_answers(conversations), initial=_answers(conversations[:done]), desc="regenerate",
               unit="answer")
    todo = range(done, len(conversations))
    written = 0
    pool = ThreadPoolExecutor(args.concurrency)
    try:
        with open(args.out, "a") as f:
            # map yields in order: a record is written once it and every one before it are done
            for record in pool.map(lambda i: regenerate_by_server(client, conversations[i], params, i,
                                                                  lambda: bar.update(1)), todo):
                f.write(json.dumps({"messages": record}, ensure_ascii=False) + "\n")
                f.flush()
                written += 1
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # on a failure: the requests in flight end, no new ones
        bar.close()
        client.close()
        if written < len(todo):
            print(f"{args.out}: {done + written} of {len(conversations)} conversations done; rerun to resume",
                  file=sys.stderr)
    print(f"{args.out}: {len(conversations)} conversations ({written} regenerated now through {args.server})")
    return 0
