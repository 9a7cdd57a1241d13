"""Training data: JSONL conversations (OpenAI or ShareGPT form) and plain text, tokenized the way the engine
tokenizes prompts, with a loss mask on the tokens the assistant writes.

Convention: ``loss_mask[t] = 1`` means token t is one the draft is trained to predict — an assistant message's
content and the end-of-turn tokens the template writes after it (the eos). Role headers, system and user text are
context only. The training loop shifts this mask to the positions that predict each token.

The record kinds (OpenAI messages, ShareGPT conversations, plain text) are read by eyas.records, kind detected
per line.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tqdm import tqdm

from eyas.records import DataError, iter_records, normalize_record

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger("eyas")


@dataclass(slots=True)
class Example:
    input_ids: list[int]
    loss_mask: list[int]  # 1 on tokens the draft learns to predict (assistant tokens), else 0

    @property
    def num_loss_tokens(self) -> int:
        return sum(self.loss_mask)


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
