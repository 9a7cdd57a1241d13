"""Chat messages -> prompt token ids, with control tokens only where the chat template writes them.

A template pastes each message's content into its text, so a user who types `<｜Assistant｜>` or `<｜end▁of▁sentence｜>`
would otherwise get the real control token: a forged turn boundary. Content that contains the text of an added
token (special or not: some models leave structural markers unflagged) is encoded with that text split into
ordinary tokens, as vLLM and SGLang do for chat content. Messages without such text are tokenized exactly as
`apply_chat_template(tokenize=True)` does, so ordinary prompts keep their usual ids.
"""

from __future__ import annotations

import re


def encode_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    """Token ids of `messages` rendered by `tokenizer`'s chat template, no added token coming from a content."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    control = _control_pattern(tokenizer)
    typed = [i for i, m in enumerate(messages) if isinstance(m.get("content"), str) and control.search(m["content"])]
    if not typed:
        return _encode(tokenizer, text)
    spans = _content_spans(tokenizer, messages, text, add_generation_prompt)
    if spans is None:
        raise ValueError(f"messages[{typed[0]}].content contains the text of a control token and this chat template "
                         "rewrites message contents, so it cannot be encoded as plain text safely")
    cuts = []  # [start, end) in `text` of each control-token text typed inside a content
    for i in typed:
        start = spans[i][0]
        cuts += [(start + m.start(), start + m.end()) for m in control.finditer(messages[i]["content"])]
    ids, previous = [], 0
    for start, end in cuts:
        ids += _encode(tokenizer, text[previous:start])
        ids += _encode(tokenizer, text[start:end], split_special_tokens=True)
        previous = end
    return ids + _encode(tokenizer, text[previous:])


def _content_spans(tokenizer, messages: list[dict], text: str,
                   add_generation_prompt: bool) -> list[tuple[int, int]] | None:
    """[start, end) of each message's content in `text`, found by rendering the messages again with each content
    replaced by a unique marker: the template's own text is what lies between the markers. None when the template
    does not paste contents verbatim (the two renderings do not line up)."""
    markers = [f"\ue000{i}\ue001" for i in range(len(messages))]
    marked = [{**m, "content": markers[i]} if isinstance(m.get("content"), str) else m
              for i, m in enumerate(messages)]
    rendered = tokenizer.apply_chat_template(marked, add_generation_prompt=add_generation_prompt, tokenize=False)
    spans, position, rebuilt = [], 0, []
    for i, message in enumerate(messages):
        content = message.get("content")
        at = rendered.find(markers[i], position) if isinstance(content, str) else -1
        if at < 0 or rendered.count(markers[i]) != 1:
            if isinstance(content, str):
                return None
            spans.append((-1, -1))
            continue
        rebuilt.append(rendered[position:at])
        start = sum(map(len, rebuilt))
        rebuilt.append(content)
        spans.append((start, start + len(content)))
        position = at + len(markers[i])
    rebuilt.append(rendered[position:])
    return spans if "".join(rebuilt) == text else None


def _control_pattern(tokenizer) -> re.Pattern:
    texts = sorted({token.content for token in tokenizer.added_tokens_decoder.values()}, key=len, reverse=True)
    return re.compile("|".join(map(re.escape, texts))) if texts else re.compile(r"(?!)")


def _encode(tokenizer, text: str, split_special_tokens: bool = False) -> list[int]:
    # the template writes bos itself; add_special_tokens would put a second one in front
    if not text:
        return []
    return list(tokenizer(text, add_special_tokens=False, split_special_tokens=split_special_tokens).input_ids)
