"""Training data: chat-template loss masks, draft vocabulary calibration, hidden-state capture and resumable dumps."""

import argparse
import copy
import json
import pickle

import pytest
import torch
from tiny import copy_tokenizer, make_hf_checkpoint

from eyas import load_model
from eyas.engine.llm import load_tokenizer
from eyas.paths import DEFAULT_MODEL
from eyas.records import read_records
from eyas.train import dump, vocab
from eyas.train.data import DataError, Example, load_dataset, tokenize_conversation, tokenize_text
from eyas.train.hidden_states import HiddenStateError, HiddenStateShards, capture_hidden_states, dump_hidden_states
from eyas.train.vocab import calibrate_vocab, count_loss_tokens, coverage_stats, load_vocab, save_vocab

EOS = "<｜end▁of▁sentence｜>"
L = 8  # default aux ids (2, 4, 5) are distinct from 8 layers on
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Say hi"},
    {"role": "assistant", "content": " Hello there!\n  indented → 世界 42"},
    {"role": "user", "content": "Again, in code"},
    {"role": "assistant", "content": "def hi():\n    return 'hi'\n"},
]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    """A random 8-layer target with the shipped tokenizer's vocabulary, so text encodes."""
    path = tmp_path_factory.mktemp("target")
    ref = make_hf_checkpoint(path, vocab_size=8192, num_hidden_layers=L)
    copy_tokenizer(path)
    return path, ref


@pytest.fixture(scope="module")
def target(target_dir):
    return load_model(target_dir[0], dtype="float32")


@pytest.fixture(scope="module")
def tokenizer(target_dir):
    return load_tokenizer(target_dir[0])


def masked_runs(tokenizer, example: Example) -> list[str]:
    """The decoded text of each contiguous run of loss-masked tokens."""
    runs, current = [], []
    for token, m in zip(example.input_ids + [None], example.loss_mask + [0]):
        if m:
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    return runs


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    return path


def sharegpt(messages):
    names = {"system": "system", "user": "human", "assistant": "gpt"}
    return {"conversations": [{"from": names[m["role"]], "value": m["content"]} for m in messages]}


# -- data --------------------------------------------------------------------------------------------------------

def test_chat_mask_is_exactly_assistant_content_and_eos(tokenizer):
    ex = tokenize_conversation(tokenizer, CONVERSATION, max_length=4096)
    assert masked_runs(tokenizer, ex) == [CONVERSATION[2]["content"] + EOS, CONVERSATION[4]["content"] + EOS]
    # the ids are what the engine feeds the target for the same chat, with bos once
    expected = tokenizer.apply_chat_template(CONVERSATION, tokenize=True, return_dict=False)
    assert ex.input_ids == list(expected)
    assert ex.input_ids[0] == tokenizer.bos_token_id and ex.input_ids.count(tokenizer.bos_token_id) == 1
    assert len(ex.loss_mask) == len(ex.input_ids)


def test_openai_and_sharegpt_files_give_the_same_examples(tokenizer, tmp_path, caplog):
    no_assistant = [{"role": "user", "content": "only a question"}]
    single = CONVERSATION[1:3]
    openai = write_jsonl(tmp_path / "openai.jsonl", [{"messages": CONVERSATION}, {"messages": no_assistant},
                                                     {"messages": single}])
    share = write_jsonl(tmp_path / "sharegpt.jsonl", [sharegpt(CONVERSATION), sharegpt(no_assistant),
                                                      sharegpt(single)])
    with caplog.at_level("WARNING", logger="eyas"):
        a = load_dataset(openai, tokenizer, 4096)
    assert "skipped 1 of 3" in caplog.text
    b = load_dataset(share, tokenizer, 4096)
    assert a == b and len(a) == 2
    assert masked_runs(tokenizer, a[1]) == [single[1]["content"] + EOS]
    assert len(read_records(share)) == 3


def test_plain_text_and_truncation(tokenizer, tmp_path, caplog):
    text = "plain text: every token is trained on, and the end-of-sequence token after it.\n"
    ex = tokenize_text(tokenizer, text, 4096)
    assert ex.input_ids[0] == tokenizer.bos_token_id and ex.input_ids[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(ex.input_ids[1:-1]) == text
    assert ex.loss_mask == [0] + [1] * (len(ex.input_ids) - 1)
    path = write_jsonl(tmp_path / "mixed.jsonl", [{"text": text}, {"messages": CONVERSATION}])
    full = tokenize_conversation(tokenizer, CONVERSATION, 4096)
    cut = full.loss_mask.index(1) + 2  # inside the first assistant turn
    short = load_dataset(path, tokenizer, cut)
    assert len(ex.input_ids) > cut and [len(e.input_ids) for e in short] == [cut, cut]
    assert short[0] == Example(ex.input_ids[:cut], ex.loss_mask[:cut])
    assert short[1] == Example(full.input_ids[:cut], full.loss_mask[:cut])
    with caplog.at_level("WARNING", logger="eyas"):  # cut before any assistant token: nothing to train on
        assert len(load_dataset(path, tokenizer, cut - 2)) == 1
    assert "skipped 1 of 2" in caplog.text


def test_offsets_fallback_when_a_token_crosses_the_turn_boundary():
    # a template with no separator: user "the ret" + assistant "ing the" tokenizes as ... 'Ġre' 'ting' ..., a token
    # that straddles the turn boundary, so prefix token counts cannot place it; character offsets can
    tokenizer = copy.deepcopy(load_tokenizer(DEFAULT_MODEL))
    tokenizer.chat_template = ("{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}"
                               "{% else %}{{ m['content'] + eos_token }}{% endif %}{% endfor %}")
    ex = tokenize_conversation(tokenizer, [{"role": "user", "content": "the ret"},
                                           {"role": "assistant", "content": "ing the"}], 100)
    tokens = tokenizer.convert_ids_to_tokens(ex.input_ids)
    assert tokens == ["the", "Ġre", "ting", "Ġthe", EOS]
    assert ex.loss_mask == [0, 0, 1, 1, 1]  # the straddling token holds assistant text, so it is trained on


def test_errors_name_file_line_and_field(tokenizer, tmp_path):
    cases = [
        ('{"messages": [{"role": "user", "content": "a"}]}\n{not json\n', ":2: not valid JSON"),
        ('{"messages": [{"role": "user", "content": "a"}, {"content": "b"}]}\n', ":1: messages[1].role"),
        ('\n{"conversations": [{"from": "bot", "value": "x"}]}\n', ":2: conversations[0].from is 'bot'"),
        ('{"prompt": "x"}\n', ":1: expected a 'messages' (OpenAI), 'conversations' (ShareGPT) or 'text'"),
        ('{"messages": [{"role": "tool", "content": "x"}]}\n', ":1: the chat template failed"),
    ]
    for n, (text, message) in enumerate(cases):
        path = tmp_path / f"bad{n}.jsonl"
        path.write_text(text)
        with pytest.raises(DataError) as e:
            load_dataset(path, tokenizer, 64)
        assert f"{path}{message}" in str(e.value)


# -- draft vocabulary --------------------------------------------------------------------------------------------

def vocab_examples():
    # masked: 5 x3, 7 x2, 9 x2, 2 x1; id 3 appears 4 times but only in unmasked (prompt) positions
    return [Example([3, 3, 5, 7, 9], [0, 0, 1, 1, 1]), Example([3, 5, 9, 3, 5, 7, 2], [0, 1, 1, 0, 1, 1, 1])]


def test_calibrate_vocab_keeps_the_most_frequent_ids():
    d2t, t2d = calibrate_vocab(vocab_examples(), vocab_size=16, draft_vocab_size=3)
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool and t2d.shape == (16,)
    assert (torch.arange(3) + d2t).tolist() == [5, 7, 9]  # target id = i + d2t[i], ascending
    assert t2d.nonzero().flatten().tolist() == [5, 7, 9]
    d2t, _ = calibrate_vocab(vocab_examples(), vocab_size=16, draft_vocab_size=2)
    assert (torch.arange(2) + d2t).tolist() == [5, 7]  # 7 and 9 tie: the lower id wins


def test_calibrate_vocab_pads_with_the_lowest_unused_ids():
    d2t, t2d = calibrate_vocab(vocab_examples(), vocab_size=16, draft_vocab_size=7)
    kept = (torch.arange(7) + d2t).tolist()
    assert kept == [0, 1, 2, 3, 5, 7, 9]  # 4 seen ids + unused 0, 1, 3 (3 only ever appeared unmasked)
    assert t2d.nonzero().flatten().tolist() == kept
    counts = count_loss_tokens(vocab_examples(), 16)
    stats = coverage_stats(counts, t2d)
    assert stats["loss_tokens"] == 8 and stats["coverage"] == 1.0 and stats["zero_frequency_ids"] == 3
    with pytest.raises(ValueError, match="draft_vocab_size"):
        calibrate_vocab(vocab_examples(), vocab_size=16, draft_vocab_size=17)


def test_save_load_vocab_and_cli(target_dir, tmp_path, capsys):
    d2t, t2d = calibrate_vocab(vocab_examples(), vocab_size=16, draft_vocab_size=2)
    stats = coverage_stats(count_loss_tokens(vocab_examples(), 16), t2d)
    save_vocab(tmp_path / "v.safetensors", d2t, t2d, stats)
    loaded = load_vocab(tmp_path / "v.safetensors")
    assert torch.equal(loaded[0], d2t) and torch.equal(loaded[1], t2d)
    assert json.loads((tmp_path / "v.json").read_text())["coverage"] == 5 / 8

    data = write_jsonl(tmp_path / "d.jsonl", [{"messages": CONVERSATION}, sharegpt(CONVERSATION[1:3])])
    parser = argparse.ArgumentParser()
    vocab.add_cli(parser.add_subparsers())
    out = tmp_path / "out" / "draft_vocab.safetensors"
    args = parser.parse_args(["calibrate-vocab", str(data), "--draft-vocab-size", "64", "--model",
                              str(target_dir[0]), "-o", str(out)])
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    d2t, t2d = load_vocab(out)
    assert d2t.shape == (64,) and t2d.shape == (8192,)
    sidecar = json.loads(out.with_suffix(".json").read_text())
    assert sidecar["distinct_ids"] < 64 and sidecar["coverage"] == 1.0  # few distinct ids: all covered, padded
    assert "covers 100.00%" in printed


# -- hidden states -----------------------------------------------------------------------------------------------

def test_capture_matches_transformers_hidden_states(target, target_dir):
    ref = target_dir[1]
    ids = torch.randint(0, 8192, (2, 19), generator=torch.Generator().manual_seed(0))
    aux_ids = (5, 0, 2)  # any order: returned as asked
    aux, last = capture_hidden_states(target, ids, aux_ids)
    assert aux.shape == (2, 19, 3, 32) and last.shape == (2, 19, 32) and not aux.requires_grad
    with torch.no_grad():
        expected = ref(ids, output_hidden_states=True)
        logits = target.compute_logits(target.model.norm(last))
    for k, i in enumerate(aux_ids):
        torch.testing.assert_close(aux[:, :, k], expected.hidden_states[i], atol=1e-5, rtol=1e-5)
    # transformers' index L is after the final norm; ours is before it
    torch.testing.assert_close(target.model.norm(last), expected.hidden_states[L], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits, expected.logits, atol=1e-4, rtol=1e-4)
    assert torch.equal(logits, target(ids))


@pytest.fixture(scope="module")
def examples(tokenizer):
    texts = ["one", "two words here", "a somewhat longer line of plain text to vary lengths", "x"]
    chats = [tokenize_conversation(tokenizer, c, 256) for c in (CONVERSATION, CONVERSATION[1:3])]
    return chats + [tokenize_text(tokenizer, t, 256) for t in texts]


def test_dump_reads_back_bit_exact(target, target_dir, examples, tmp_path):
    manifest = dump_hidden_states(target, examples, tmp_path, (5, 2, 4), examples_per_shard=4, dtype=torch.float32,
                                  batch_size=1, target_path=target_dir[0])
    assert manifest["complete"] and manifest["num_shards"] == 2 and manifest["aux_hidden_state_ids"] == [2, 4, 5]
    assert manifest["aux_convention"] == "hidden_states" and manifest["hidden_size"] == 32
    assert manifest["total_tokens"] == sum(len(e.input_ids) for e in examples)
    shards = HiddenStateShards(tmp_path)
    assert len(shards) == len(examples) and shards.manifest == manifest
    for i in [0, 5, 4, 1, 2, 3, -1]:  # out of order: shards open and close
        item, ex = shards[i], examples[i]
        aux, last = capture_hidden_states(target, torch.tensor([ex.input_ids]), (2, 4, 5))
        assert torch.equal(item["input_ids"], torch.tensor(ex.input_ids))
        assert item["loss_mask"].dtype == torch.float32 and item["loss_mask"].tolist() == ex.loss_mask
        assert torch.equal(item["aux_hidden_states"], aux[0]) and torch.equal(item["last_hidden"], last[0])
    assert len(shards._open) <= 2
    copied = pickle.loads(pickle.dumps(shards))  # DataLoader workers get copies without open handles
    assert torch.equal(copied[3]["last_hidden"], shards[3]["last_hidden"])
    with pytest.raises(IndexError):
        shards[len(examples)]


def test_batched_bf16_dump_is_close(target, examples, tmp_path):
    dump_hidden_states(target, examples, tmp_path, (2, 4, 5), examples_per_shard=8, batch_size=3)
    shards = HiddenStateShards(tmp_path)
    for i, ex in enumerate(examples):
        aux, last = capture_hidden_states(target, torch.tensor([ex.input_ids]), (2, 4, 5))
        assert shards[i]["aux_hidden_states"].dtype == torch.bfloat16
        torch.testing.assert_close(shards[i]["aux_hidden_states"].float(), aux[0], atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(shards[i]["last_hidden"].float(), last[0], atol=1e-2, rtol=1e-2)


def test_interrupted_dump_resumes_to_identical_files(target, target_dir, examples, tmp_path):
    kw = dict(examples_per_shard=2, batch_size=2, target_path=target_dir[0])
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    dump_hidden_states(target, examples, full, (2, 4, 5), **kw)

    partial = dump_hidden_states(target, examples, resumed, (2, 4, 5), max_shards=1, **kw)
    assert not partial["complete"] and [s["file"] for s in partial["shards"]] == ["shard-00000.safetensors"]
    (resumed / "shard-00001.safetensors.tmp").write_bytes(b"half-written")  # killed while writing shard 1
    with pytest.raises(HiddenStateError, match="incomplete"):
        HiddenStateShards(resumed)
    first = (resumed / "shard-00000.safetensors").stat().st_mtime_ns
    dump_hidden_states(target, examples, resumed, (2, 4, 5), **kw)
    assert (resumed / "shard-00000.safetensors").stat().st_mtime_ns == first  # kept, not recomputed
    names = sorted(p.name for p in full.iterdir())
    assert names == sorted(p.name for p in resumed.iterdir()) == [
        "manifest.json", "shard-00000.safetensors", "shard-00001.safetensors", "shard-00002.safetensors"]
    for name in names:
        assert (full / name).read_bytes() == (resumed / name).read_bytes(), name

    with pytest.raises(HiddenStateError, match="aux_hidden_state_ids"):
        dump_hidden_states(target, examples, resumed, (1, 4, 5), **kw)
    with pytest.raises(HiddenStateError, match="num_examples"):
        dump_hidden_states(target, examples[:-1], resumed, (2, 4, 5), **kw)
    with pytest.raises(HiddenStateError, match="target_fingerprint"):  # another target (its config.json differs)
        dump_hidden_states(target, examples, resumed, (2, 4, 5), **{**kw, "target_path": DEFAULT_MODEL})


def test_missing_or_corrupt_shard_is_named(target, examples, tmp_path):
    dump_hidden_states(target, examples, tmp_path, (2, 4, 5), examples_per_shard=2)
    shard = tmp_path / "shard-00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:100])
    shards = HiddenStateShards(tmp_path)
    shards[0]
    with pytest.raises(HiddenStateError, match="shard-00001.safetensors: cannot read"):
        shards[2]
    shard.unlink()
    with pytest.raises(HiddenStateError, match="shard-00001.safetensors: shard listed in manifest.json is missing"):
        HiddenStateShards(tmp_path)[3]


def test_a_manifest_naming_files_outside_its_dump_is_refused(target, examples, tmp_path):
    """A dump's manifest.json names its shards; one that names a path outside the dump directory (absolute, `..`,
    a subdirectory) is refused before any file is opened, as a safetensors index naming such a path is."""
    import json

    dump = tmp_path / "dump"
    dump_hidden_states(target, examples, dump, (2, 4, 5), examples_per_shard=2)
    manifest = json.loads((dump / "manifest.json").read_text())
    secret = tmp_path / "elsewhere.safetensors"
    secret.write_bytes((dump / "shard-00000.safetensors").read_bytes())
    for name in (str(secret), "../elsewhere.safetensors", "sub/shard-00000.safetensors", 7):
        (dump / "manifest.json").write_text(json.dumps({**manifest, "shards": [{**manifest["shards"][0],
                                                                                 "file": name}]}))
        with pytest.raises(HiddenStateError, match=r"shards\[0\] names .*expected the file name of a shard"):
            HiddenStateShards(dump)


def test_dump_cli_converts_layer_output_ids(target_dir, tmp_path, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", [{"messages": CONVERSATION}, sharegpt(CONVERSATION[1:3]),
                                              {"text": "hello"}])
    parser = argparse.ArgumentParser()
    dump.add_cli(parser.add_subparsers())
    out = tmp_path / "dump"
    args = parser.parse_args(["dump-hidden-states", str(data), str(out), "--model", str(target_dir[0]),
                              "--aux-layer-ids", "1", "3", "4", "--aux-layer-convention", "layer_output",
                              "--examples-per-shard", "2", "--dtype", "float32"])
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    assert "hidden_states ids [2, 4, 5] (given as layer_output ids [1, 3, 4])" in printed
    shards = HiddenStateShards(out)
    assert len(shards) == 3 and shards.manifest["num_shards"] == 2
    assert shards.manifest["target"]["path"] == str(target_dir[0])
    assert shards[2]["aux_hidden_states"].shape[1:] == (3, 32)
    # default ids: (2, L//2, L-3) = (2, 4, 5), the same dump
    args = parser.parse_args(["dump-hidden-states", str(data), str(tmp_path / "dump2"), "--model",
                              str(target_dir[0]), "--examples-per-shard", "2", "--dtype", "float32"])
    assert args.func(args) == 0
    assert HiddenStateShards(tmp_path / "dump2").manifest == shards.manifest


def test_auto_draft_vocab_size():
    """The default draft vocabulary: the fewest ids, rounded up to 256, covering 95% of the loss tokens, never more
    ids than the data has, and the whole vocabulary when that would be more than half of it or when the data has
    under 256 distinct loss tokens."""
    import torch

    from eyas.train.vocab import auto_draft_vocab_size

    counts = torch.zeros(8192, dtype=torch.int64)
    counts[:300] = 1000  # 300 ids hold 300,000 tokens
    counts[300:3000] = 1  # a tail of 2,700 rare ids
    assert auto_draft_vocab_size(counts) == 512  # 300 ids cover 99%: rounded up to 512
    few = torch.zeros(8192, dtype=torch.int64)
    few[:300] = 5
    assert auto_draft_vocab_size(few) == 300  # no padding past the ids the data has
    few[61:] = 0
    assert auto_draft_vocab_size(few) == 8192  # 61 distinct ids: too little data to choose from
    flat = torch.ones(8192, dtype=torch.int64)
    assert auto_draft_vocab_size(flat) == 8192  # 95% needs 7,783 ids: more than half, so the whole vocabulary
    assert auto_draft_vocab_size(torch.zeros(100, dtype=torch.int64)) == 100


def test_a_mostly_padding_vocabulary_is_warned_about(caplog):
    import torch

    from eyas.train.vocab import select_draft_vocab

    counts = torch.zeros(8192, dtype=torch.int64)
    counts[:100] = 7  # 100 ids occur; a 2,048-id vocabulary would be 95% padding
    with caplog.at_level("WARNING", logger="eyas"):
        select_draft_vocab(counts, 2048)
    assert "1948 of the 2048 draft ids (95%) never occur" in caplog.text and "near 100" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="eyas"):
        select_draft_vocab(counts, 128)
    assert "never occur" not in caplog.text
