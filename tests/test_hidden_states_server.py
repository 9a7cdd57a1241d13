"""Hidden states from a running vLLM (`dump-hidden-states --server`, `train --hidden-states-server`), against a
stand-in that speaks vLLM's `extract_hidden_states` protocol as its ExampleHiddenStatesConnector does: an answer
naming the file, the file written after the answer under an exclusive .lock. The states it serves are eyas's own
capture, so the dump must equal eyas's in-process dump bit for bit."""

import fcntl
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny import copy_tokenizer, make_hf_checkpoint

from eyas.cli import parse_args
from eyas.client import ServerClient, ServerError
from eyas.train.hidden_states import HiddenStateError, capture_hidden_states, dump_hidden_states
from eyas.train.hidden_states_server import ServerHiddenStates, vllm_command

AUX = (1, 2, 3)  # hidden_states ids of the 4-layer tiny target; L = 4
REQUESTED = [1, 2, 3, 4]


class FakeVllm:
    """POST /v1/completions with token ids -> kv_transfer_params.hidden_states_path; the file (hidden_states
    [T, n_ids, H], token_ids [T]) is written 50 ms after the answer while its .lock is held, as vLLM does."""

    def __init__(self, target, storage, corrupt=None):
        self.target, self.storage, self.corrupt = target, storage, corrupt
        self.count = 0
        self.lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def reply(self, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self.reply({"object": "list", "data": [{"id": "target", "object": "model"}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with fake.lock:
                    fake.count += 1
                    path = fake.storage / f"cmpl-{fake.count}-0.safetensors"
                lock_fd = os.open(str(path) + ".lock", os.O_CREAT | os.O_WRONLY, 0o644)
                fcntl.flock(lock_fd, fcntl.LOCK_EX)
                threading.Thread(target=fake.write, args=(body["prompt"], path, lock_fd)).start()
                self.reply({"id": "cmpl", "choices": [{"text": "x", "index": 0, "finish_reason": "length"}],
                            "kv_transfer_params": {"hidden_states_path": str(path)}})

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def write(self, token_ids, path, lock_fd):
        time.sleep(0.05)
        ids = torch.tensor([token_ids])
        with torch.no_grad():
            aux, last = capture_hidden_states(self.target, ids, AUX)
        states = torch.cat([aux[0], last[0, :, None]], dim=1)  # [T, 4, H] in REQUESTED order
        if self.corrupt == "token_ids":
            token_ids = token_ids[:-1] + [token_ids[-1] + 1]
        save_file({"hidden_states": states.contiguous(), "token_ids": torch.tensor(token_ids)}, str(path))
        os.close(lock_fd)

    def close(self):
        self.http.shutdown()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from eyas import load_model
    from eyas.engine.llm import load_tokenizer
    from eyas.train.data import load_dataset

    root = tmp_path_factory.mktemp("server_states")
    target_dir = root / "target"
    make_hf_checkpoint(target_dir, vocab_size=8192)
    copy_tokenizer(target_dir)
    records = [{"messages": [{"role": "user", "content": f"def add_{i}(a, b):"},
                             {"role": "assistant", "content": f"    return a + b + {i}\n"}]} for i in range(7)]
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    target = load_model(target_dir)
    examples = load_dataset(data, load_tokenizer(target_dir), 256)
    dump = root / "eyas_dump"
    dump_hidden_states(target, examples, dump, AUX, examples_per_shard=3, dtype=torch.float32, batch_size=1,
                       target_path=target_dir)
    storage = root / "storage"
    storage.mkdir()
    server = FakeVllm(target, storage)
    yield dict(root=root, target_dir=target_dir, target=target, data=data, examples=examples, dump=dump,
               storage=storage, server=server)
    server.close()


def dump_args(setup, out, *flags):
    return parse_args(["dump-hidden-states", str(setup["data"]), str(out), "--model", str(setup["target_dir"]),
                       "--aux-layer-ids", *map(str, AUX), "--dtype", "float32", "--examples-per-shard", "3",
                       *flags])


def shards(directory):
    return sorted(p.name for p in directory.glob("shard-*.safetensors"))


def test_dump_from_the_server_equals_the_in_process_dump(setup):
    out = setup["root"] / "from_server"
    args = dump_args(setup, out, "--server", setup["server"].url, "--concurrency", "3")
    assert args.func(args) == 0
    assert shards(out) == shards(setup["dump"]) == ["shard-00000.safetensors", "shard-00001.safetensors",
                                                     "shard-00002.safetensors"]
    for name in shards(out):
        ours, theirs = load_file(str(out / name)), load_file(str(setup["dump"] / name))
        assert ours.keys() == theirs.keys()
        for key in ours:
            assert torch.equal(ours[key], theirs[key]), (name, key)
    manifest = json.loads((out / "manifest.json").read_text())
    reference = json.loads((setup["dump"] / "manifest.json").read_text())
    assert manifest["complete"] and manifest["aux_hidden_state_ids"] == reference["aux_hidden_state_ids"]
    assert manifest["source"] == {"server": setup["server"].url, "hidden_state_ids_requested": REQUESTED}
    assert not list(setup["storage"].iterdir())  # every server file was deleted once read


def test_a_dump_cut_short_resumes_without_refetching(setup):
    from eyas.train.hidden_states_server import dump_from_server

    out = setup["root"] / "resumed"
    client = ServerClient(setup["server"].url)
    states = ServerHiddenStates(client, AUX, 4, setup["target"].config.hidden_size)
    common = dict(config=setup["target"].config, target_path=setup["target_dir"], examples_per_shard=3,
                  dtype=torch.float32)
    dump_from_server(states, setup["examples"], out, max_shards=1, **common)
    assert shards(out) == ["shard-00000.safetensors"]
    before = setup["server"].count
    manifest = dump_from_server(states, setup["examples"], out, **common)
    assert manifest["complete"] and shards(out) == shards(setup["dump"])
    assert setup["server"].count - before == len(setup["examples"]) - 3  # the first shard was not fetched again
    for name in shards(out):
        assert torch.equal(load_file(str(out / name))["aux_hidden_states"],
                           load_file(str(setup["dump"] / name))["aux_hidden_states"])


def test_a_server_without_extraction_or_with_other_tokens_is_refused(setup, tmp_path):
    states = ServerHiddenStates(ServerClient(setup["server"].url), AUX, 4, setup["target"].config.hidden_size)
    aux, last = states.fetch(setup["examples"][0].input_ids)
    assert aux.shape == (len(setup["examples"][0].input_ids), 3, setup["target"].config.hidden_size)
    wrong = ServerHiddenStates(ServerClient(setup["server"].url), (1, 2), 4, setup["target"].config.hidden_size)
    with pytest.raises(HiddenStateError, match=r"has shape .*eagle_aux_hidden_state_layer_ids \[1, 2, 4\]"):
        wrong.fetch(setup["examples"][0].input_ids)
    storage = tmp_path / "storage"
    storage.mkdir()
    liar = FakeVllm(setup["target"], storage, corrupt="token_ids")
    try:
        states = ServerHiddenStates(ServerClient(liar.url), AUX, 4, setup["target"].config.hidden_size)
        with pytest.raises(HiddenStateError, match="token_ids differ from the .* sent .*first difference at"):
            states.fetch(setup["examples"][0].input_ids)
    finally:
        liar.close()


def test_an_eyas_or_plain_openai_server_is_refused_naming_the_command(setup, monkeypatch):
    client = ServerClient(setup["server"].url)
    monkeypatch.setattr(client, "request", lambda method, path, body=None: {"choices": [{"text": "x"}]})
    states = ServerHiddenStates(client, AUX, 4, setup["target"].config.hidden_size)
    with pytest.raises(ServerError, match="no kv_transfer_params.hidden_states_path.*--print-vllm-command"):
        states.fetch([1, 2, 3])


def test_print_vllm_command(setup, capsys):
    args = parse_args(["dump-hidden-states", "--print-vllm-command", "--model", str(setup["target_dir"]),
                       "--aux-layer-ids", "1", "2", "3", "--vllm-storage", "/data/hs"])
    assert args.func(args) == 0
    printed = capsys.readouterr().out.strip()
    assert printed == vllm_command(setup["target_dir"], AUX, 4, "/data/hs")
    assert '"eagle_aux_hidden_state_layer_ids":[1,2,3,4]' in printed and "ExampleHiddenStatesConnector" in printed
    assert '"shared_storage_path":"/data/hs"' in printed and "--no-enable-prefix-caching" in printed


def train_config(setup, out, **kw):
    from eyas.train.trainer import TrainConfig

    return TrainConfig(target=str(setup["target_dir"]), out=str(setup["root"] / out), draft_arch="mla",
                       draft_vocab_size=0, aux_layer_ids=list(AUX), lr=3e-3, warmup_steps=2, max_steps=4,
                       batch_size=2, max_length=256, save_every=2, seed=0, **kw)


def losses(out):
    return [r["loss"] for r in map(json.loads, (out / "train_log.jsonl").read_text().splitlines())]


def test_streamed_training_equals_training_on_the_dump_and_resumes_exactly(setup, monkeypatch):
    """The same losses, step for step, as offline training on eyas's dump of the same records, with only the
    target's head loaded; a run stopped at step 2 and resumed fetches the same batches; no server file is left."""
    import eyas.checkpoint
    from eyas.train.trainer import train

    offline = train_config(setup, "offline", hidden_states=str(setup["dump"]))
    train(offline)
    monkeypatch.setattr(eyas.checkpoint, "load_model", lambda *a, **k: pytest.fail("the whole target was loaded"))
    streamed = train_config(setup, "streamed", data=str(setup["data"]), hidden_states_server=setup["server"].url)
    train(streamed)
    assert losses(setup["root"] / "streamed") == losses(setup["root"] / "offline")
    assert not list(setup["storage"].glob("*.safetensors"))
    cut = train_config(setup, "cut", data=str(setup["data"]), hidden_states_server=setup["server"].url)
    cut.max_steps = 2
    train(cut)
    cut.max_steps = 4
    train(cut, resume=True)
    assert losses(setup["root"] / "cut") == losses(setup["root"] / "streamed")
    recipe = (setup["root"] / "cut" / "train_config.yaml").read_text()
    assert "hidden_states_server:" in recipe and "api_key" not in recipe


def test_a_dump_split_over_ranks_is_the_whole_dump_once_every_rank_has_written(setup):
    """Two ranks share OUT_DIR: rank 1 alone leaves no readable dump
    (the error names the missing part), rank 0 completes it and its manifest lists every shard, each equal to the
    single-process dump's."""
    from eyas.train.hidden_states import HiddenStateShards

    out = setup["root"] / "ranks"
    args = dump_args(setup, out, "--server", setup["server"].url, "--world-size", "2", "--rank", "1")
    assert args.func(args) == 0
    assert shards(out) == ["shard-00001.safetensors"] and not (out / "manifest.json").exists()
    with pytest.raises(HiddenStateError, match="not every rank has finished .*manifest.rank-00001-of-00002.json"):
        HiddenStateShards(out)
    args = dump_args(setup, out, "--server", setup["server"].url, "--world-size", "2", "--rank", "0")
    assert args.func(args) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["complete"] and [s["file"] for s in manifest["shards"]] == shards(setup["dump"])
    for name in shards(out):
        ours, theirs = load_file(str(out / name)), load_file(str(setup["dump"] / name))
        assert all(torch.equal(ours[key], theirs[key]) for key in ours), name
    assert len(HiddenStateShards(out)) == len(setup["examples"])
    with pytest.raises(ValueError, match="rank 2 is not in 0..1"):
        args = dump_args(setup, out, "--world-size", "2", "--rank", "2")
        args.func(args)
