"""eyas.records: each kind of record file read as its commands read it, errors naming the file, line and key."""

import json

import pytest

from eyas.records import DataError, read_eval_prompts, read_prompt_file


def write(path, *lines):
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def test_prompt_files_take_prompts_messages_and_first_turns(tmp_path):
    path = write(tmp_path / "p.jsonl", {"prompt": "ab"}, "", {"messages": [{"role": "user", "content": "hi"}]},
                 {"category": "x", "turns": ["first", "second"]})
    assert read_prompt_file(path) == ["ab", [{"role": "user", "content": "hi"}],
                                      [{"role": "user", "content": "first"}]]


def test_eval_prompts_keep_every_turn(tmp_path):
    path = write(tmp_path / "e.jsonl", {"category": "code", "prompt": "def f():"}, {"turns": ["a", "b"]})
    assert read_eval_prompts(path) == [{"category": "code", "turns": None, "prompt": "def f():"},
                                       {"category": "all", "turns": ["a", "b"], "prompt": None}]


@pytest.mark.parametrize("read, lines, message", [
    (read_prompt_file, [{"prompt": "a"}, {"text": "b"}], r"p\.jsonl:2: expected .*'prompt'.*found keys \['text'\]"),
    (read_prompt_file, [{"prompt": "a"}, "[1]"], r"p\.jsonl:2: expected a JSON object, got list"),
    (read_prompt_file, [""], r"p\.jsonl: no prompts"),
    (read_eval_prompts, [{"turns": ["a", 3]}], r"p\.jsonl:1: key 'turns' must be a list of strings"),
    (read_eval_prompts, [{"category": "x"}], r"p\.jsonl:1: expected .*found keys \['category'\]"),
    (read_eval_prompts, ["{oops"], r"p\.jsonl:1: not valid JSON"),
    # json's own text may end in "at" ("Invalid control character at"): no second "at" follows it
    (read_prompt_file, ['{"prompt": "abc'], r"p\.jsonl:1: not valid JSON \(Invalid control character at; column 16\)"),
])
def test_errors_name_file_line_and_key(tmp_path, read, lines, message):
    with pytest.raises(DataError, match=message):
        read(write(tmp_path / "p.jsonl", *lines))
