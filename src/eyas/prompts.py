"""Prompt files, as `eyas generate --prompt-file` and `eyas bench serve --dataset` read them."""

from __future__ import annotations

from pathlib import Path

from eyas.train.data import iter_records


def read_prompt_file(path: Path) -> list[str | list[dict]]:
    """JSONL, one object per line with a `prompt` string, chat `messages`, or MT-Bench-style `turns` (the first
    turn is sent as a user message; `eyas eval` files read as they are)."""
    prompts = []
    for lineno, record in iter_records(path):
        turns = record.get("turns")
        if isinstance(record.get("prompt"), str):
            prompts.append(record["prompt"])
        elif isinstance(record.get("messages"), list):
            prompts.append(record["messages"])
        elif isinstance(turns, list) and turns and isinstance(turns[0], str):
            prompts.append([{"role": "user", "content": turns[0]}])
        else:
            raise ValueError(f"{path}:{lineno}: expected an object with a 'prompt' string, a 'messages' list or a "
                             "'turns' list of strings")
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts
