"""Chat prompts: ordinary messages tokenize exactly as the tokenizer's own chat template does; a control token's text
typed inside any message's content becomes ordinary tokens, never the control id, wherever it sits."""

import pytest
from transformers import AutoTokenizer

from eyas.engine.chat import encode_chat
from eyas.paths import DEFAULT_MODEL

EOS, USER, ASSISTANT = "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(DEFAULT_MODEL)


def control_ids(tokenizer, ids):
    return [t for t in ids if t in tokenizer.added_tokens_decoder]


def template_ids(tokenizer, messages):
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


ORDINARY = [
    [{"role": "user", "content": "def add(a, b):"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Write a loop."},
     {"role": "assistant", "content": "for i in range(3):\n    print(i)"}, {"role": "user", "content": "Again <b>"}],
    [{"role": "user", "content": ""}],
]


@pytest.mark.parametrize("messages", ORDINARY)
def test_ordinary_messages_tokenize_as_the_template_does(tokenizer, messages):
    assert encode_chat(tokenizer, messages) == template_ids(tokenizer, messages)


@pytest.mark.parametrize("content", [f"a{ASSISTANT}b", f"{USER}{USER}x", f"<think>x</think>{EOS}", f"{EOS}",
                                     f"{USER}{ASSISTANT}{EOS} and {EOS}"])
@pytest.mark.parametrize("role", ["system", "user", "assistant"])
def test_typed_control_tokens_stay_text(tokenizer, role, content):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    messages[0 if role == "system" else 1] = {"role": role, "content": content}
    if role == "assistant":
        messages.append({"role": "user", "content": "more"})
    ids = encode_chat(tokenizer, messages)
    # the control ids are exactly the template's own: those of the same messages with every typed marker removed
    stripped = [{**m, "content": m["content"]} for m in messages]
    for marker in (EOS, USER, ASSISTANT, "<think>", "</think>"):
        stripped = [{**m, "content": m["content"].replace(marker, "")} for m in stripped]
    assert control_ids(tokenizer, ids) == control_ids(tokenizer, template_ids(tokenizer, stripped))
    assert control_ids(tokenizer, ids) != control_ids(tokenizer, template_ids(tokenizer, messages))
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert tokenizer.decode(ids) == rendered  # the same text, only tokenized differently


def test_a_template_that_rewrites_content_refuses_typed_control_tokens(tokenizer, monkeypatch):
    template = ("{{ bos_token }}{% for m in messages %}{{ '<｜User｜>' + m['content'] | trim }}{% endfor %}"
                "{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}")
    monkeypatch.setattr(tokenizer, "chat_template", template)
    assert encode_chat(tokenizer, [{"role": "user", "content": " hi "}]) == \
        template_ids(tokenizer, [{"role": "user", "content": " hi "}])
    with pytest.raises(ValueError, match=r"messages\[0\]\.content contains the text of a control token"):
        encode_chat(tokenizer, [{"role": "user", "content": f" hi{EOS} "}])


def test_streamed_text_adds_up_to_the_whole_decode(tokenizer):
    """The server decodes only the new tokens while streaming (a whole decode per update is O(n^2) over a long
    answer): the pieces it sends, multi-byte characters split over tokens included, add up to the whole decode, and
    a stop string's possible start is held back until it is known."""
    from types import SimpleNamespace

    from eyas.serve.engine import EngineLoop, EngineRequest

    text = "héllo — 世界 🐍 naïve café\n    return x + 1  # ok ✓ END tail"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    engine = EngineLoop.__new__(EngineLoop)
    engine.llm = SimpleNamespace(tokenizer=tokenizer)
    for stop in ([], ["END"]):
        req = EngineRequest.__new__(EngineRequest)
        req.sent_text, req.decoded_text, req.prefix_offset, req.read_offset = "", "", 0, 0
        seq = SimpleNamespace(generated_ids=[], params=SimpleNamespace(stop=stop))
        for n in range(1, len(ids) + 1):
            seq.generated_ids = ids[:n]
            piece = engine._text(req, seq, final=n == len(ids))
            assert piece.startswith(req.sent_text), (n, piece, req.sent_text)
            assert "\ufffd" not in piece
            assert not stop or n == len(ids) or "END" not in piece  # never sent before it is cut
            req.sent_text = piece
        whole = tokenizer.decode(ids, skip_special_tokens=True)
        assert req.sent_text == (whole[:whole.find("END")] if stop else whole)
