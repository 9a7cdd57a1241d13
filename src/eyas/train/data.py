"""Training data: JSONL conversations (OpenAI or ShareGPT form) and plain text, tokenized the way the engine
tokenizes prompts, with a loss mask on the tokens the assistant writes.

Convention: ``loss_mask[t] = 1`` means token t is one the draft is trained to predict — an assistant message's
content and the end-of-turn tokens the template writes after it (the eos). Role headers, system and user text are
context only. The training loop shifts this mask to the positions that predict each token.

Record kinds, detected per line:
    {"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}      OpenAI
    {"conversations": [{"from": "human", "value": "..."}, {"from": "gpt", "value": "..."}]}            ShareGPT
    {"text": "..."}                                                                                   plain text
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tqdm import tqdm

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger("eyas")

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system"}


class DataError(ValueError):
    """Training data eyas cannot use, with the file, line and field at fault."""


@dataclass(slots=True)
class Example:
    input_ids: list[int]
    loss_mask: list[int]  # 1 on tokens the draft learns to predict (assistant tokens), else 0

    @property
    def num_loss_tokens(self) -> int:
        return sum(self.loss_mask)


# -- reading records ---------------------------------------------------------------------------------------------

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
                raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno})") from e
            if not isinstance(record, dict):
                raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}")
            yield lineno, record


def read_records(path: str | Path) -> list[dict]:
    """Every object of a JSONL file; errors name the file and line."""
    return [record for _, record in iter_records(path)]


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


# -- tokenizing --------------------------------------------------------------------------------------------------

def _encode(tokenizer, text: str) -> list[int]:
    # the chat template already writes bos; letting the tokenizer add special tokens would put it there twice
    return list(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])


def _render(tokenizer, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as e:  # jinja raises its own types (TemplateError, raise_exception in the template)
        raise DataError(f"the chat template failed ({type(e).__name__}: {e})") from e


def assistant_char_spans(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]],
                         full: str) -> list[tuple[int, int]]:
    """[start, end) character spans in `full` (the rendered conversation) of each assistant turn: its content
    and the end-of-turn text after it, found by rendering the conversation up to each message."""
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        upto = _render(tokenizer, messages[:i + 1], add_generation_prompt=False)
        if not full.startswith(upto):
            raise DataError(f"messages[{i}]: the chat template renders the conversation up to this message "
                            "differently from the whole conversation (it rewrites earlier turns), so the "
                            "assistant tokens cannot be located exactly; split the conversation at this turn")
        prompt = _render(tokenizer, messages[:i], add_generation_prompt=True)
        if upto.startswith(prompt):
            start = len(prompt)
        else:
            # the generation prompt differs from a finished turn's header (e.g. it opens a <think> block):
            # find the content after the previous turns instead
            head = _render(tokenizer, messages[:i], add_generation_prompt=False)
            start = upto.find(m["content"], len(head)) if upto.startswith(head) else -1
            if start < 0:
                raise DataError(f"messages[{i}]: cannot find this assistant message's content in the rendered "
                                "chat template output")
        spans.append((start, len(upto)))
    return spans


def _mask_by_token_counts(tokenizer, full: str, ids: list[int], spans: list[tuple[int, int]]) -> list[int] | None:
    """Loss mask from the token counts of rendered prefixes, or None when a prefix does not tokenize to a prefix
    of the full token ids (a token merged across a span boundary)."""
    mask = [0] * len(ids)
    for start, end in spans:
        bounds = []
        for cut in (start, end):
            prefix = _encode(tokenizer, full[:cut])
            if prefix != ids[:len(prefix)]:
                return None
            bounds.append(len(prefix))
        mask[bounds[0]:bounds[1]] = [1] * (bounds[1] - bounds[0])
    return mask


def _mask_by_offsets(tokenizer, full: str, ids: list[int], spans: list[tuple[int, int]]) -> list[int]:
    """Loss mask from character offsets: a token is masked when its text overlaps an assistant span."""
    try:
        enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    except NotImplementedError as e:  # slow tokenizers have no offsets
        raise DataError("the chat template's prefixes do not tokenize to prefixes of the conversation and this "
                        "tokenizer gives no character offsets (use a fast tokenizer)") from e
    if list(enc["input_ids"]) != ids:
        raise DataError("tokenizing with offsets gave different token ids than without")
    mask = []
    for a, b in enc["offset_mapping"]:
        inside = any((a < e and b > s) or (a == b and s <= a < e) for s, e in spans)
        mask.append(int(inside))
    return mask


def tokenize_conversation(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]],
                          max_length: int) -> Example:
    """Token ids of `messages` rendered with the tokenizer's chat template (as the engine renders prompts) and a
    loss mask that is 1 exactly on assistant content and the end-of-turn tokens after it; truncated to
    `max_length` tokens."""
    if max_length < 1:
        raise ValueError(f"max_length must be positive, got {max_length}")
    if not getattr(tokenizer, "chat_template", None):
        raise DataError("the tokenizer has no chat_template; give conversations to a tokenizer with one, or use "
                        "{\"text\": ...} records")
    full = _render(tokenizer, messages, add_generation_prompt=False)
    ids = _encode(tokenizer, full)
    spans = assistant_char_spans(tokenizer, messages, full)
    mask = _mask_by_token_counts(tokenizer, full, ids, spans)
    if mask is None:
        mask = _mask_by_offsets(tokenizer, full, ids, spans)
    return Example(ids[:max_length], mask[:max_length])


def tokenize_text(tokenizer: PreTrainedTokenizerBase, text: str, max_length: int) -> Example:
    """bos + text + eos, the loss mask on the text and the eos; truncated to `max_length` tokens."""
    if max_length < 1:
        raise ValueError(f"max_length must be positive, got {max_length}")
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    body = _encode(tokenizer, text) + eos
    return Example((bos + body)[:max_length], ([0] * len(bos) + [1] * len(body))[:max_length])


def load_dataset(path: str | Path, tokenizer: PreTrainedTokenizerBase, max_length: int) -> list[Example]:
    """Tokenize every record of a JSONL file (kind detected per line); records with no loss tokens are skipped
    and counted."""
    path = Path(path)
    records = list(iter_records(path))
    examples, skipped = [], 0
    for lineno, record in tqdm(records, desc=f"tokenizing {path.name}", unit="record"):
        where = f"{path}:{lineno}"
        conversation = normalize_record(record, where)
        try:
            if isinstance(conversation, str):
                example = tokenize_text(tokenizer, conversation, max_length)
            else:
                example = tokenize_conversation(tokenizer, conversation, max_length)
        except DataError as e:
            raise DataError(f"{where}: {e}") from e
        if example.num_loss_tokens == 0:
            skipped += 1
            continue
        examples.append(example)
    if skipped:
        log.warning("%s: skipped %d of %d records with no loss tokens (no assistant message, or every assistant "
                    "token past max_length=%d)", path, skipped, len(records), max_length)
    if not examples:
        raise DataError(f"{path}: no record has loss tokens ({len(records)} records)")
    return examples
