"""LLM.generate and `eyas generate` against transformers' generate, and their handling of bad input."""

import json
import shutil

import pytest
import torch
from tiny import YARN, copy_tokenizer, make_hf_checkpoint

from eyas import LLM, SamplingParams
from eyas.cli import main as cli
from eyas.engine.llm import PromptTooLong
from eyas.paths import DEFAULT_MODEL


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    model = make_hf_checkpoint(path, rope_parameters=YARN)
    return path, model


@pytest.fixture(scope="module")
def text_checkpoint(tmp_path_factory):
    """A random checkpoint with the shipped tokenizer's vocabulary, so text prompts encode."""
    path = tmp_path_factory.mktemp("text_ckpt")
    make_hf_checkpoint(path, vocab_size=8192, rope_parameters=YARN)
    copy_tokenizer(path)
    return path


def hf_greedy(model, prompt, n):
    ids = torch.tensor([prompt])
    with torch.no_grad():  # an explicit mask: transformers would otherwise mask every token equal to pad_token_id
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=model.config.vocab_size - 1)
    return out[0, len(prompt):].tolist()


def test_batched_greedy_equals_transformers(checkpoint):
    path, ref = checkpoint
    # a small cache and token budget: chunked prefill, several blocks per sequence, sequences joining mid-way
    llm = LLM(path, max_num_seqs=3, block_size=4, max_num_batched_tokens=6)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, 96, (n,), generator=g).tolist() for n in (1, 9, 17, 4, 30)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=15, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(ref, prompt, 15)
        assert out.finish_reason == "length"
    assert llm.allocator.num_used == 0


def test_preemption_keeps_output(checkpoint):
    path, ref = checkpoint
    # 9 blocks of 4 tokens cannot hold three 20-token sequences at once: some are preempted and recomputed
    llm = LLM(path, max_num_seqs=3, block_size=4, num_blocks=9, max_num_batched_tokens=64)
    prompts = [[3 + i] * 6 for i in range(3)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=14, ignore_eos=True))
    assert llm.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(ref, prompt, 14)
    assert llm.allocator.num_used == 0


def test_eos_and_stop_token_ids_end_generation(checkpoint):
    path, ref = checkpoint
    llm = LLM(path)
    prompt = [7, 8, 9]
    expected = hf_greedy(ref, prompt, 20)
    stop_at = expected[5]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_at]))[0]
    assert out.token_ids == expected[:expected.index(stop_at) + 1] and out.finish_reason == "stop"
    llm.eos_token_ids = {stop_at}
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20))[0]
    assert out.token_ids[-1] == stop_at and out.finish_reason == "stop"


def test_seeded_sampling_does_not_depend_on_batch(checkpoint):
    path, _ = checkpoint
    llm = LLM(path)
    params = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate([[5, 6, 7]], params)[0].token_ids
    others = SamplingParams(temperature=0.7, seed=None, max_tokens=12, ignore_eos=True)
    batched = llm.generate([[9, 9], [5, 6, 7], [1, 2, 3, 4]], [others, params, others])[1].token_ids
    assert alone == batched
    different = llm.generate([[5, 6, 7]], SamplingParams(temperature=1.0, seed=99, max_tokens=12,
                                                         ignore_eos=True))[0].token_ids
    assert different != alone


def test_prompt_longer_than_context_is_refused(checkpoint):
    path, _ = checkpoint
    llm = LLM(path, max_model_len=32)
    with pytest.raises(PromptTooLong, match="32"):
        llm.generate([[5] * 40])


shipped = pytest.mark.skipif(not (DEFAULT_MODEL / "model.safetensors").is_file(), reason="no shipped model")


@shipped
def test_shipped_target_greedy_equals_transformers():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    ref = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()
    prompts = ["def add(a, b):\n", "import os\n\n\nclass ", "    for i in range("]
    llm = LLM(DEFAULT_MODEL)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        ids = tok(prompt).input_ids
        assert out.prompt_token_ids == ids
        assert out.token_ids == hf_greedy(ref, ids, 24)


@shipped
def test_stop_string_cuts_text():
    llm = LLM(DEFAULT_MODEL)
    free = llm.generate(["def add(a, b):\n"], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    stop = free.text[5:8]
    out = llm.generate(["def add(a, b):\n"], SamplingParams(temperature=0, max_tokens=24, stop=[stop]))[0]
    assert out.finish_reason == "stop" and stop not in out.text and free.text.startswith(out.text)


# -- the command line -------------------------------------------------------------------------------------------

def run_cli(args, capsys):
    code = cli(args)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_cli_json_output(text_checkpoint, capsys, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "ab"}) + "\n"
                       + json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n"
                       + json.dumps({"category": "x", "turns": ["hi", "more"]}) + "\n")
    code, out, err = run_cli(["generate", "--model", str(text_checkpoint), "--prompt-file", str(prompts),
                              "--max-new-tokens", "5", "--ignore-eos", "--json"], capsys)
    assert code == 0, err
    lines = out.splitlines()
    assert len(lines) == 3
    assert json.loads(lines[2])["token_ids"] == json.loads(lines[1])["token_ids"]  # a first turn is a user message
    record = json.loads(lines[0])
    assert record["num_generated"] == 5 and len(record["token_ids"]) == 5
    assert set(record) >= {"text", "token_ids", "num_generated", "tokens_per_second"}


def test_cli_chat_prompt_uses_the_template(text_checkpoint, capsys):
    llm = LLM(text_checkpoint)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    chat = llm.generate([[{"role": "user", "content": "hi"}]], params)[0].token_ids
    raw = llm.generate(["hi"], params)[0].token_ids
    outputs = []
    for flag in (["--chat"], []):
        code, out, err = run_cli(["generate", "--model", str(text_checkpoint), "--prompt", "hi", *flag,
                                  "--max-new-tokens", "5", "--ignore-eos", "--json"], capsys)
        assert code == 0, err
        outputs.append(json.loads(out)["token_ids"])
    assert chat != raw and outputs == [chat, raw]


def test_cli_missing_directory(capsys, tmp_path):
    code, _, err = run_cli(["generate", "--model", str(tmp_path / "nope")], capsys)
    assert code != 0 and "nope" in err and "no such" in err


def test_cli_other_architecture(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    code, _, err = run_cli(["generate", "--model", str(tmp_path)], capsys)
    assert code != 0 and "architectures" in err and "LlamaForCausalLM" in err


def test_cli_truncated_safetensors(checkpoint, capsys, tmp_path):
    path, _ = checkpoint
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
    code, _, err = run_cli(["generate", "--model", str(bad)], capsys)
    assert code != 0 and "model.safetensors" in err and "truncated" in err


def test_cli_missing_key(checkpoint, capsys, tmp_path):
    from safetensors.torch import load_file, save_file

    path, _ = checkpoint
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    tensors = load_file(bad / "model.safetensors")
    del tensors["model.layers.2.self_attn.kv_b_proj.weight"]
    save_file(tensors, bad / "model.safetensors")
    code, _, err = run_cli(["generate", "--model", str(bad)], capsys)
    assert code != 0 and "model.layers.2.self_attn.kv_b_proj.weight" in err and "missing" in err


def test_cli_prompt_longer_than_context(text_checkpoint, capsys):
    code, _, err = run_cli(["generate", "--model", str(text_checkpoint), "--prompt", "x = 1\n" * 400], capsys)
    assert code != 0 and "context" in err


def test_a_prompt_past_the_tokenizers_limit_gets_eyas_error_alone():
    """Past the tokenizer's model_max_length (2,048 for the shipped one) transformers would warn "... will result in
    indexing errors" before eyas's own error; eyas checks lengths itself, so only its error is printed."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "eyas.cli", "generate", "--speculative-method", "none",
                           "--prompt", "x = 1\n" * 600], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith("eyas generate: error: prompt has 24"), proc.stderr
    assert "indexing errors" not in proc.stderr


def test_cli_bad_sampling_value(capsys):
    code, _, err = run_cli(["generate", "--top-p", "1.5"], capsys)
    assert code != 0 and "top_p" in err


@shipped
def test_stop_strings_given_but_eos_ends_the_text():
    llm = LLM(DEFAULT_MODEL)
    free = llm.generate(["import os\n\n\nclass "], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    # the first token that did not occur before it becomes the end-of-sequence token
    j = next(j for j in range(1, 12) if free.token_ids[j] not in free.token_ids[:j])
    llm.eos_token_ids = {free.token_ids[j]}
    out = llm.generate(["import os\n\n\nclass "], SamplingParams(temperature=0, max_tokens=12, stop=["never seen"]))[0]
    assert out.finish_reason == "stop" and out.token_ids == free.token_ids[:j + 1]
    assert out.text == llm.tokenizer.decode(free.token_ids[:j + 1], skip_special_tokens=True) != ""


@shipped
def test_stop_strings_are_checked_on_the_last_tokens_only():
    """The output with a stop string equals the full output cut at its first occurrence, and each check decodes
    a window of tokens, not the whole output (that was quadratic in the output's length)."""
    llm = LLM(DEFAULT_MODEL)
    params = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    prompt = 'def parse_args(argv):\n    """Parse the command line."""\n'  # an output that does not loop
    free = llm.generate([prompt], params)[0]
    # a stop string that first appears late in the output: the last 5 characters at whose position they first occur
    text = free.text
    first = max(i for i in range(len(text) - 5) if text.find(text[i:i + 5]) == i)
    stop = text[first:first + 5]
    assert first > len(text) // 2
    decoded: list[int] = []
    decode = llm.tokenizer.decode

    def counting(ids, **kw):
        decoded.append(len(ids))
        return decode(ids, **kw)

    llm.tokenizer.decode = counting
    try:
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=120, ignore_eos=True,
                                                    stop=[stop]))[0]
    finally:
        llm.tokenizer.decode = decode
    assert out.finish_reason == "stop" and out.text == free.text[:first]
    window = 2 * len(stop) + 8
    assert sum(n > window for n in decoded) <= 2  # the full text only once, on the hit (and for the output)
