"""`eyas regenerate`: assistant turns replaced by the target's own answers; interrupted runs resume."""

import json
import shutil

import pytest
from tiny import make_hf_checkpoint

from eyas import LLM, SamplingParams
from eyas.cli import main as cli
from eyas.engine.llm import DEFAULT_MODEL
from eyas.train.regenerate import regenerate

CONVERSATIONS = [
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def f(x):"},
                  {"role": "assistant", "content": "old answer"}, {"role": "user", "content": "again"},
                  {"role": "assistant", "content": "old 2"}]},
    {"conversations": [{"from": "human", "value": "import os"}, {"from": "gpt", "value": "old"}]},
    {"messages": [{"role": "user", "content": "class A:"}, {"role": "assistant", "content": "x"}]},
]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("target")
    make_hf_checkpoint(path, vocab_size=8192)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEFAULT_MODEL / name, path / name)
    return path


def test_assistant_turns_are_the_targets_answers(target):
    from eyas.train.regenerate import normalise

    llm = LLM(target)
    params = SamplingParams(temperature=0, max_tokens=6)
    convs = [normalise(c, "test") for c in CONVERSATIONS]
    out = regenerate(llm, convs, params)
    for before, after in zip(convs, out):
        assert [m["role"] for m in before] == [m["role"] for m in after]
        for i, (b, a) in enumerate(zip(before, after)):
            if b["role"] != "assistant":
                assert a == b
            else:  # the answer the target gives to the regenerated conversation so far
                assert a["content"] == llm.generate([after[:i]], params)[0].text != b["content"]


def test_cli_resumes_after_an_interruption(target, tmp_path):
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in CONVERSATIONS))
    args = ["regenerate", str(data), "", "--model", str(target), "--max-new-tokens", "5", "--chunk-size", "1"]
    full = tmp_path / "full.jsonl"
    assert cli(args[:2] + [str(full)] + args[3:]) == 0
    lines = full.read_text().splitlines()
    assert len(lines) == 3
    cut = tmp_path / "cut.jsonl"
    cut.write_text(lines[0] + "\n" + lines[1][:10])  # killed while writing the second chunk
    assert cli(args[:2] + [str(cut)] + args[3:]) == 0
    assert cut.read_text() == full.read_text()
