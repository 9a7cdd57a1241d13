"""JSONL record files, the one reader of them: training conversations and text, prompt files, eval prompts.

One JSON object per non-blank line; an error names the file, the line and the key at fault. What each command
reads:

    training data (train, dump-hidden-states, calibrate-vocab, regenerate), one of per line:
        {"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}   OpenAI
        {"conversations": [{"from": "human", "value": "..."}, {"from": "gpt", "value": "..."}]}         ShareGPT
        {"text": "..."}                                                                                plain text
    prompts (generate --prompt-file, bench serve --dataset):
        {"prompt": "raw text"}, {"messages": [...]} or {"turns": ["first user turn", ...]} (the first turn only)
    eval prompts (eval, train --eval-every):
        {"category": ..., "turns": ["first user turn", ...]} (MT-Bench style) or {"category": ..., "prompt": "..."}
"""

from __future__ import annotations

import json
import reprlib
from collections.abc import Iterator
from pathlib import Path

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system"}


class DataError(ValueError):
    """A record file eyas cannot use, with the file, line and key at fault."""


def iter_records(path: str | Path) -> Iterator[tuple[int, dict]]:
    """(line number, object) for each non-blank line of a JSONL file."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such data file")
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path}:{lineno}: not UTF-8 ({e})") from e
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg}; column {e.colno})") from e
            if not isinstance(record, dict):
                raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}")
            yield lineno, record


def read_records(path: str | Path) -> list[dict]:
    """Every object of a JSONL file; errors name the file and line."""
    return [record for _, record in iter_records(path)]


# -- training data -----------------------------------------------------------------------------------------------

def normalize_record(record: dict, where: str = "record") -> list[dict[str, str]] | str:
    """A record's conversation as OpenAI-style messages [{"role", "content"}], or its plain text."""
    if "messages" in record:
        return _openai_messages(record["messages"], where)
    if "conversations" in record:
        return _sharegpt_messages(record["conversations"], where)
    if "text" in record:
        if not isinstance(record["text"], str):
            raise DataError(f"{where}: field 'text' must be a string, got {type(record['text']).__name__}")
        return record["text"]
    raise DataError(f"{where}: expected a 'messages' (OpenAI), 'conversations' (ShareGPT) or 'text' field; "
                    f"found fields {sorted(record)}")


def _openai_messages(messages, where: str) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: field 'messages' must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        field = f"messages[{i}]"
        if not isinstance(m, dict):
            raise DataError(f"{where}: {field} must be an object with 'role' and 'content'")
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str):
            raise DataError(f"{where}: {field}.role must be a string, got {role!r}")
        if isinstance(content, list):  # OpenAI content parts: only text parts carry training text
            parts = [p.get("text") if isinstance(p, dict) and p.get("type") == "text" else None for p in content]
            if any(not isinstance(p, str) for p in parts):
                raise DataError(f"{where}: {field}.content is a list with non-text parts; only "
                                "{\"type\": \"text\", \"text\": ...} parts are supported")
            content = "".join(parts)
        if not isinstance(content, str):
            raise DataError(f"{where}: {field}.content must be a string, got {type(content).__name__}")
        out.append({"role": role, "content": content})
    return out


def _sharegpt_messages(turns, where: str) -> list[dict[str, str]]:
    if not isinstance(turns, list) or not turns:
        raise DataError(f"{where}: field 'conversations' must be a non-empty list")
    out = []
    for i, turn in enumerate(turns):
        field = f"conversations[{i}]"
        if not isinstance(turn, dict):
            raise DataError(f"{where}: {field} must be an object with 'from' and 'value'")
        speaker, value = turn.get("from"), turn.get("value")
        if speaker not in SHAREGPT_ROLES:
            raise DataError(f"{where}: {field}.from is {speaker!r}; expected one of {sorted(SHAREGPT_ROLES)}")
        if not isinstance(value, str):
            raise DataError(f"{where}: {field}.value must be a string, got {type(value).__name__}")
        out.append({"role": SHAREGPT_ROLES[speaker], "content": value})
    return out


# -- prompts -----------------------------------------------------------------------------------------------------

def read_prompt_file(path: str | Path) -> list[str | list[dict]]:
    """One prompt per record: a `prompt` string, chat `messages`, or MT-Bench-style `turns` (the first turn is sent
    as a user message; `eyas eval` files read as they are)."""
    prompts: list[str | list[dict]] = []
    for lineno, record in iter_records(path):
        turns = record.get("turns")
        if isinstance(record.get("prompt"), str):
            prompts.append(record["prompt"])
        elif isinstance(record.get("messages"), list):
            prompts.append(record["messages"])
        elif isinstance(turns, list) and turns and isinstance(turns[0], str):
            prompts.append([{"role": "user", "content": turns[0]}])
        else:
            raise DataError(f"{path}:{lineno}: expected an object with a 'prompt' string, a 'messages' list or a "
                            f"'turns' list of strings; found keys {sorted(record)}")
    if not prompts:
        raise DataError(f"{path}: no prompts")
    return prompts


def read_eval_prompts(path: str | Path) -> list[dict]:
    """{"category", "turns" (a list of strings, or None), "prompt" (a string, or None)} per record; a record needs
    `turns` or `prompt`, and `category` defaults to "all"."""
    records = []
    for lineno, record in iter_records(path):
        turns, prompt = record.get("turns") or None, record.get("prompt")
        if turns is not None and not (isinstance(turns, list) and all(isinstance(t, str) for t in turns)):
            raise DataError(f"{path}:{lineno}: key 'turns' must be a list of strings, got {reprlib.repr(turns)}")
        if turns is None and not isinstance(prompt, str):
            raise DataError(f"{path}:{lineno}: expected {{\"category\": ..., \"turns\": [strings]}} or "
                            f"{{\"category\": ..., \"prompt\": string}}; found keys {sorted(record)}")
        records.append({"category": str(record.get("category", "all")), "turns": turns,
                        "prompt": prompt if isinstance(prompt, str) else None})
    if not records:
        raise DataError(f"{path}: no prompts")
    return records
