"""Hidden states from a running vLLM (`dump-hidden-states --server`, `train --hidden-states-server`), against a
stand-in that speaks vLLM's `extract_hidden_states` protocol as its ExampleHiddenStatesConnector does: an answer
naming the file, the file written after the answer under an exclusive .lock. The states it serves are eyas's own
capture, so the dump must equal eyas's in-process dump bit for bit.

The server names the file, so eyas must not trust the name: the tests below name files outside the storage
directory, through symlinks, FIFOs, directories and checkpoints, and check that each is refused in one line and left
where it was. A test that could block (a FIFO, a lock held forever) runs its command on a thread with a deadline and
unblocks it afterwards, so that a regression fails the test instead of hanging the run."""

import fcntl
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny import make_tokenized_target

from eyas.cli import main, parse_args
from eyas.client import ServerClient, ServerError
from eyas.train.hidden_states import HiddenStateError, capture_hidden_states, dump_hidden_states
from eyas.train.hidden_states_server import ServerHiddenStates, vllm_command

AUX = (1, 2, 3)  # hidden_states ids of the 4-layer tiny target; L = 4
REQUESTED = [1, 2, 3, 4]


class FakeVllm:
    """POST /v1/completions with token ids -> kv_transfer_params.hidden_states_path; the file (hidden_states
    [T, n_ids, H], token_ids [T]) is written 50 ms after the answer while its .lock is held, as vLLM does.

    `names(n)` (n: the request's number, from 1), when it gives a path, is the answer instead and nothing is written;
    `hold(n)` true keeps the request's .lock held, its file unwritten, until `release()`."""

    def __init__(self, target, storage, corrupt=None, names=None, hold=None):
        self.target, self.storage, self.corrupt = target, storage, corrupt
        self.names, self.hold = names or (lambda n: None), hold or (lambda n: False)
        self.count = 0
        self.lock = threading.Lock()
        self.held = []
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
                    n = fake.count
                    path = fake.storage / f"cmpl-{n}-0.safetensors"
                named = fake.names(n)
                if named is None:
                    named = str(path)
                    lock_fd = os.open(str(path) + ".lock", os.O_CREAT | os.O_WRONLY, 0o644)
                    fcntl.flock(lock_fd, fcntl.LOCK_EX)
                    if fake.hold(n):
                        with fake.lock:
                            fake.held.append((body["prompt"], path, lock_fd))
                    else:
                        threading.Thread(target=fake.write, args=(body["prompt"], path, lock_fd)).start()
                self.reply({"id": "cmpl", "choices": [{"text": "x", "index": 0, "finish_reason": "length"}],
                            "kv_transfer_params": {"hidden_states_path": named}})

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

    def release(self):
        with self.lock:
            held, self.held = self.held, []
        for prompt, path, lock_fd in held:
            self.write(prompt, path, lock_fd)

    def close(self):
        self.release()
        self.http.shutdown()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from eyas import load_model
    from eyas.engine.llm import load_tokenizer
    from eyas.train.data import load_dataset

    root = tmp_path_factory.mktemp("server_states")
    target_dir = root / "target"
    make_tokenized_target(target_dir)
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


def dump_argv(setup, out, *flags):
    return ["dump-hidden-states", str(setup["data"]), str(out), "--model", str(setup["target_dir"]),
            "--aux-layer-ids", *map(str, AUX), "--dtype", "float32", "--examples-per-shard", "3", *flags]


def dump_args(setup, out, *flags):
    return parse_args(dump_argv(setup, out, *flags))


def server_flags(setup, *more):
    return ["--server", setup["server"].url, "--vllm-storage", str(setup["storage"]), *more]


def shards(directory):
    return sorted(p.name for p in directory.glob("shard-*.safetensors"))


def test_dump_from_the_server_equals_the_in_process_dump(setup):
    out = setup["root"] / "from_server"
    args = dump_args(setup, out, *server_flags(setup, "--concurrency", "3"))
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
    states = ServerHiddenStates(client, AUX, 4, setup["target"].config.hidden_size, setup["storage"])
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
    hidden = setup["target"].config.hidden_size
    states = ServerHiddenStates(ServerClient(setup["server"].url), AUX, 4, hidden, setup["storage"])
    aux, last = states.fetch(setup["examples"][0].input_ids)
    assert aux.shape == (len(setup["examples"][0].input_ids), 3, setup["target"].config.hidden_size)
    wrong = ServerHiddenStates(ServerClient(setup["server"].url), (1, 2), 4, hidden, setup["storage"])
    with pytest.raises(HiddenStateError, match=r"has shape .*eagle_aux_hidden_state_layer_ids \[1, 2, 4\]"):
        wrong.fetch(setup["examples"][0].input_ids)
    storage = tmp_path / "storage"
    storage.mkdir()
    liar = FakeVllm(setup["target"], storage, corrupt="token_ids")
    try:
        states = ServerHiddenStates(ServerClient(liar.url), AUX, 4, hidden, storage)
        with pytest.raises(HiddenStateError, match="token_ids differ from the .* sent .*first difference at"):
            states.fetch(setup["examples"][0].input_ids)
        assert (storage / "cmpl-1-0.safetensors").is_file()  # not the request's file: not deleted
    finally:
        liar.close()


def test_an_eyas_or_plain_openai_server_is_refused_naming_the_command(setup, monkeypatch):
    client = ServerClient(setup["server"].url)
    monkeypatch.setattr(client, "request", lambda method, path, body=None: {"choices": [{"text": "x"}]})
    states = ServerHiddenStates(client, AUX, 4, setup["target"].config.hidden_size, setup["storage"])
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
    from eyas.train.config import TrainConfig

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
    streamed = train_config(setup, "streamed", data=str(setup["data"]), hidden_states_server=setup["server"].url,
                            vllm_storage=str(setup["storage"]))
    train(streamed)
    assert losses(setup["root"] / "streamed") == losses(setup["root"] / "offline")
    assert not list(setup["storage"].glob("*.safetensors"))
    cut = train_config(setup, "cut", data=str(setup["data"]), hidden_states_server=setup["server"].url,
                            vllm_storage=str(setup["storage"]))
    cut.max_steps = 2
    train(cut)
    cut.max_steps = 4
    train(cut, resume=True)
    assert losses(setup["root"] / "cut") == losses(setup["root"] / "streamed")
    recipe = (setup["root"] / "cut" / "train_config.yaml").read_text()
    assert "hidden_states_server:" in recipe and "api_key" not in recipe



def test_a_dflash_draft_streamed_from_the_server_trains_as_on_the_dump(setup):
    """A DFlash block draft over the same three target layers: the same losses, step for step, streamed from the
    server as read from eyas's dump; no server file is left."""
    from eyas.train.config import TrainConfig
    from eyas.train.trainer import train

    def dflash_config(out, **kw):
        return TrainConfig(target=str(setup["target_dir"]), out=str(setup["root"] / out), draft_arch="dflash",
                           block_size=4, num_anchors=4, aux_layer_ids=list(AUX), lr=3e-3, warmup_steps=2,
                           max_steps=4, batch_size=2, max_length=256, save_every=2, seed=0, **kw)

    train(dflash_config("dflash-offline", hidden_states=str(setup["dump"])))
    train(dflash_config("dflash-streamed", data=str(setup["data"]), hidden_states_server=setup["server"].url,
                        vllm_storage=str(setup["storage"])))
    offline, streamed = losses(setup["root"] / "dflash-offline"), losses(setup["root"] / "dflash-streamed")
    assert len(streamed) == 4 and streamed == offline
    assert not list(setup["storage"].glob("*.safetensors"))
    config = json.loads((setup["root"] / "dflash-streamed" / "draft" / "config.json").read_text())
    assert config["dflash_config"]["target_layer_ids"] == [i - 1 for i in AUX]

def test_a_dump_split_over_ranks_is_the_whole_dump_once_every_rank_has_written(setup):
    """Two ranks share OUT_DIR: rank 1 alone leaves no readable dump
    (the error names the missing part), rank 0 completes it and its manifest lists every shard, each equal to the
    single-process dump's."""
    from eyas.train.hidden_states import HiddenStateShards

    out = setup["root"] / "ranks"
    args = dump_args(setup, out, *server_flags(setup, "--world-size", "2", "--rank", "1"))
    assert args.func(args) == 0
    assert shards(out) == ["shard-00001.safetensors"] and not (out / "manifest.json").exists()
    with pytest.raises(HiddenStateError, match="not every rank has finished .*manifest.rank-00001-of-00002.json"):
        HiddenStateShards(out)
    args = dump_args(setup, out, *server_flags(setup, "--world-size", "2", "--rank", "0"))
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


# -- files the server names that are not its hidden-states files for the request ----------------------------------

def bounded(run, timeout):
    """run() on a daemon thread: (finished within `timeout` seconds, its result or the exception it raised)."""
    box = {}

    def target():
        try:
            box["value"] = run()
        except BaseException as e:  # noqa: BLE001 - handed to the test to assert on
            box["value"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    return not thread.is_alive(), box.get("value")


def run_eyas(argv, timeout):
    """`eyas ARGV` in a process of its own: (its exit status, or None when it was still running after `timeout`
    seconds and was killed; its stderr; seconds until it exited). A process, not a thread: what counts is when it
    exits, after its threads, and a regression may block in a call that holds the GIL (safetensors opening a
    FIFO), which no thread of the test could then end."""
    start = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "-m", "eyas.cli", *argv], capture_output=True, text=True,
                              timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr or ""
        return None, err, time.monotonic() - start
    return done.returncode, done.stderr, time.monotonic() - start


def snapshot(paths):
    """What each path is (type, inode, bytes of a regular file): to check that nothing was deleted or changed."""
    state = {}
    for p in paths:
        st = os.lstat(p)
        data = p.read_bytes() if stat.S_ISREG(st.st_mode) else None
        state[str(p)] = (stat.S_IFMT(st.st_mode), st.st_ino, data)
    return state


def other_request_file(path):
    """A well-formed connector file, for a request other than any of the data's."""
    save_file({"hidden_states": torch.zeros(3, len(REQUESTED), 64), "token_ids": torch.tensor([1, 2, 3])}, str(path))
    return path


def victim_outside_text(storage, elsewhere, setup):
    (elsewhere / "notes.txt").write_text("keep me\n")
    return str(elsewhere / "notes.txt"), "is outside the storage directory"


def victim_outside_states(storage, elsewhere, setup):
    path = other_request_file(elsewhere / "cmpl-9-0.safetensors")
    (elsewhere / "cmpl-9-0.safetensors.lock").touch()
    return str(path), "is outside the storage directory"


def victim_dotdot(storage, elsewhere, setup):
    other_request_file(elsewhere / "cmpl-9-0.safetensors")
    return f"{storage}/../{elsewhere.name}/cmpl-9-0.safetensors", r"'\.\.' components"


def victim_relative(storage, elsewhere, setup):
    other_request_file(storage / "cmpl-9-0.safetensors")
    os.chdir(storage)  # where a relative name would land; the test's monkeypatch restores the directory
    return "cmpl-9-0.safetensors", "is a relative path"


def victim_symlink_inside(storage, elsewhere, setup):
    other_request_file(storage / "cmpl-9-0.safetensors")
    (storage / "link.safetensors").symlink_to(storage / "cmpl-9-0.safetensors")
    (storage / "link.safetensors.lock").touch()
    return str(storage / "link.safetensors"), "runs through a symlink"


def victim_symlink_outside(storage, elsewhere, setup):
    other_request_file(elsewhere / "cmpl-9-0.safetensors")
    (storage / "link.safetensors").symlink_to(elsewhere / "cmpl-9-0.safetensors")
    return str(storage / "link.safetensors"), "runs through a symlink"


def victim_symlinked_directory(storage, elsewhere, setup):
    other_request_file(elsewhere / "cmpl-9-0.safetensors")
    (storage / "sub").symlink_to(elsewhere, target_is_directory=True)
    return str(storage / "sub" / "cmpl-9-0.safetensors"), "runs through a symlink"


def victim_symlink_lock(storage, elsewhere, setup):
    other_request_file(storage / "cmpl-9-0.safetensors")
    (elsewhere / "precious").write_text("keep me\n")
    (storage / "cmpl-9-0.safetensors.lock").symlink_to(elsewhere / "precious")
    return str(storage / "cmpl-9-0.safetensors"), "has a .lock that is not a regular file but a symlink"


def victim_fifo(storage, elsewhere, setup):
    os.mkfifo(storage / "cmpl-9-0.safetensors")
    return str(storage / "cmpl-9-0.safetensors"), "is not a regular file but a FIFO"


def victim_fifo_lock(storage, elsewhere, setup):
    other_request_file(storage / "cmpl-9-0.safetensors")
    os.mkfifo(storage / "cmpl-9-0.safetensors.lock")
    return str(storage / "cmpl-9-0.safetensors"), "has a .lock that is not a regular file but a FIFO"


def victim_directory(storage, elsewhere, setup):
    (storage / "cmpl-9-0.safetensors").mkdir()
    (storage / "cmpl-9-0.safetensors" / "inside").write_text("keep me\n")
    return str(storage / "cmpl-9-0.safetensors"), "is not a regular file but a directory"


def victim_text_inside(storage, elsewhere, setup):
    (storage / "notes.txt").write_text("keep me\n")
    return str(storage / "notes.txt"), r"is not a \.safetensors file"


def victim_checkpoint_elsewhere(storage, elsewhere, setup):
    shutil.copy(setup["target_dir"] / "model.safetensors", elsewhere / "model.safetensors")
    return str(elsewhere / "model.safetensors"), "is outside the storage directory"


def victim_checkpoint_inside(storage, elsewhere, setup):
    shutil.copy(setup["target_dir"] / "model.safetensors", storage / "model.safetensors")
    return str(storage / "model.safetensors"), r"has no \['hidden_states', 'token_ids'\]"


def victim_other_request(storage, elsewhere, setup):
    other_request_file(storage / "cmpl-9-0.safetensors")
    (storage / "cmpl-9-0.safetensors.lock").touch()
    return str(storage / "cmpl-9-0.safetensors"), "does not match its request: token_ids of shape"


VICTIMS = [victim_outside_text, victim_outside_states, victim_dotdot, victim_relative, victim_symlink_inside,
           victim_symlink_outside, victim_symlinked_directory, victim_symlink_lock, victim_directory,
           victim_text_inside, victim_checkpoint_elsewhere, victim_checkpoint_inside, victim_other_request]


def victim_setup(setup, tmp_path, make):
    storage, elsewhere = tmp_path / "storage", tmp_path / "elsewhere"
    storage.mkdir()
    elsewhere.mkdir()
    named, reason = make(storage, elsewhere, setup)
    everything = sorted(p for root in (storage, elsewhere) for p in root.rglob("*"))
    # only the first request names it: a later one (sent by a regression that goes on after the refusal) gets a
    # file of its own, so that the regression fails on what it deleted rather than waiting for a deleted file
    server = FakeVllm(setup["target"], storage, names=lambda n: named if n == 1 else None)
    return storage, named, reason, everything, server


def assert_one_line_error(err, command, url, named, reason):
    # a progress bar cut short by the error leaves no newline: its last redraw (after a \r) shares the line
    errors = [line.rsplit("\r", 1)[-1].split(f"{command}: error: ", 1)[-1] for line in err.splitlines()
              if f"{command}: error: " in line]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert errors[0].startswith(f"{url}: hidden_states_path {named!r} "), errors[0]
    assert re.search(reason, errors[0]) and errors[0].endswith("left in place"), errors[0]


@pytest.mark.parametrize("make", VICTIMS, ids=lambda f: f.__name__.removeprefix("victim_"))
def test_a_named_file_that_is_not_the_requests_is_refused_and_left_in_place(setup, tmp_path, make, monkeypatch,
                                                                               capsys):
    """`dump-hidden-states --server`: whatever the server names outside the storage directory, through a
    symlink, as a directory, a checkpoint or another request's file, the dump stops in one line naming the
    server, the path and what is wrong, and every file stays."""
    monkeypatch.chdir(tmp_path)
    storage, named, reason, everything, server = victim_setup(setup, tmp_path, make)
    before = snapshot(everything)
    try:
        argv = dump_argv(setup, tmp_path / "out", "--server", server.url, "--vllm-storage", str(storage),
                         "--concurrency", "1")
        finished, rc = bounded(lambda: main(argv), 30)
    finally:
        server.close()
    assert snapshot(everything) == before
    assert finished, f"the dump was still running after 30 s on {named}"
    assert rc == 2
    assert_one_line_error(capsys.readouterr().err, "eyas dump-hidden-states", server.url, named, reason)
    assert not list((tmp_path / "out").glob("shard-*"))


@pytest.mark.parametrize("make", [victim_fifo, victim_fifo_lock], ids=["file", "lock"])
def test_a_fifo_named_as_the_file_or_its_lock_is_refused_without_blocking(setup, tmp_path, make):
    """A FIFO is opened without blocking and refused before anything reads it: the dump ends in one line (before,
    opening it waited for a writer forever, whatever the lock timeout), and the FIFO and the file stay."""
    storage, named, reason, everything, server = victim_setup(setup, tmp_path, make)
    before = snapshot(everything)
    try:
        argv = dump_argv(setup, tmp_path / "out", "--server", server.url, "--vllm-storage", str(storage))
        rc, err, _ = run_eyas(argv, 60)
    finally:
        server.close()
    assert snapshot(everything) == before
    assert rc == 2, f"the dump was still running after 60 s on a FIFO:\n{err}" if rc is None else err
    assert_one_line_error(err, "eyas dump-hidden-states", server.url, named, reason)


def test_streamed_training_refuses_a_file_outside_the_storage_directory_and_leaves_it(setup, tmp_path, capsys):
    """`train --hidden-states-server`: the same refusal, in one line, the file left where it was."""
    storage, named, reason, everything, server = victim_setup(setup, tmp_path, victim_checkpoint_elsewhere)
    before = snapshot(everything)
    try:
        argv = ["train", "--target", str(setup["target_dir"]), "--data", str(setup["data"]), "--hidden-states-server",
                server.url, "--vllm-storage", str(storage), "--out", str(tmp_path / "run"), "--aux-layer-ids",
                *map(str, AUX), "--draft-vocab-size", "0", "--batch-size", "2", "--max-steps", "2",
                "--max-length", "256"]
        finished, rc = bounded(lambda: main(argv), 30)
    finally:
        server.close()
    assert snapshot(everything) == before
    assert finished and rc == 2
    assert_one_line_error(capsys.readouterr().err, "eyas train", server.url, named, reason)


def test_the_server_options_need_the_storage_directory(setup, tmp_path, capsys):
    """No default storage directory with --server or --hidden-states-server: it bounds what may be read and
    deleted, so it must be the one the server was started with."""
    assert main(dump_argv(setup, tmp_path / "out", "--server", setup["server"].url)) == 2
    assert "--server needs --vllm-storage DIR" in capsys.readouterr().err
    argv = ["train", "--target", str(setup["target_dir"]), "--data", str(setup["data"]), "--hidden-states-server",
            setup["server"].url, "--out", str(tmp_path / "run")]
    assert main(argv) == 2
    assert "--hidden-states-server needs --vllm-storage DIR" in capsys.readouterr().err
    from eyas.train.cli import config_from_args

    cfg = config_from_args(parse_args([*argv, "--vllm-storage", str(setup["storage"]), "--keep-server-files"]))
    assert cfg.vllm_storage == str(setup["storage"]) and cfg.keep_server_files


@pytest.mark.parametrize("named_under", ["link", "real"])
def test_the_requests_file_is_read_and_deleted_with_its_lock_also_through_a_linked_storage(setup, tmp_path,
                                                                                            named_under):
    """--vllm-storage may itself be a symlink (as /tmp is on some systems), and the server may name its files
    under it or under the directory it resolves to: the request's file is read and deleted with its .lock; with
    keep_files both stay."""
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real, target_is_directory=True)
    server = FakeVllm(setup["target"], tmp_path / named_under)
    try:
        hidden = setup["target"].config.hidden_size
        states = ServerHiddenStates(ServerClient(server.url), AUX, 4, hidden, tmp_path / "link")
        example = setup["examples"][0].input_ids
        aux, last = states.fetch(example)
        assert aux.shape == (len(example), 3, hidden) and last.shape == (len(example), hidden)
        assert not list(real.iterdir())
        states.keep_files = True
        states.fetch(example)
        assert sorted(p.name for p in real.iterdir()) == ["cmpl-2-0.safetensors", "cmpl-2-0.safetensors.lock"]
    finally:
        server.close()


# -- a failure stops the fetches in flight -------------------------------------------------------------------------

def threads_left(prefix, before, wait=5.0):
    """Threads named `prefix`* started since `before` that are still alive after `wait` seconds."""
    new = [t for t in threading.enumerate() if t.name.startswith(prefix) and t not in before]
    deadline = time.monotonic() + wait
    for t in new:
        t.join(max(0.0, deadline - time.monotonic()))
    return [t.name for t in new if t.is_alive()]


def test_a_failed_fetch_stops_the_dump_at_once_with_others_in_flight(setup, tmp_path, capsys):
    """Two fetches wait on .locks the server never releases while a third is refused: the dump reports the
    refusal within seconds and leaves no fetch thread behind (before: it waited LOCK_TIMEOUT_S, 600 s, per
    file in flight)."""
    storage = tmp_path / "storage"
    storage.mkdir()
    (tmp_path / "notes.txt").write_text("keep me\n")
    server = FakeVllm(setup["target"], storage, names=lambda n: str(tmp_path / "notes.txt") if n == 3 else None,
                      hold=lambda n: n < 3)
    before = set(threading.enumerate())
    try:
        argv = dump_argv(setup, tmp_path / "out", "--server", server.url, "--vllm-storage", str(storage),
                         "--concurrency", "3")
        start = time.monotonic()
        finished, rc = bounded(lambda: main(argv), 20)
        took = time.monotonic() - start
        left = threads_left("eyas-fetch", before)
    finally:
        server.close()  # releases the locks: a regression's threads end too
    assert (tmp_path / "notes.txt").is_file()
    assert finished, "the dump was still running 20 s after a fetch failed"
    assert rc == 2 and not left, (rc, left)
    assert_one_line_error(capsys.readouterr().err, "eyas dump-hidden-states", server.url,
                          str(tmp_path / "notes.txt"), "is outside the storage directory")
    assert took < 20


def test_the_process_exits_at_once_after_a_failed_fetch_with_others_in_flight(setup, tmp_path):
    """The same as a command: `eyas dump-hidden-states` exits with its one-line error within seconds, its fetch
    threads stopped (before, the process stayed up to LOCK_TIMEOUT_S, 600 s, after printing the error)."""
    storage = tmp_path / "storage"
    storage.mkdir()
    (tmp_path / "notes.txt").write_text("keep me\n")
    server = FakeVllm(setup["target"], storage, names=lambda n: str(tmp_path / "notes.txt") if n == 3 else None,
                      hold=lambda n: n < 3)
    try:
        argv = dump_argv(setup, tmp_path / "out", "--server", server.url, "--vllm-storage", str(storage),
                         "--concurrency", "3")
        rc, err, took = run_eyas(argv, 60)
    finally:
        server.close()
    assert rc == 2, f"still running after 60 s:\n{err}" if rc is None else err
    assert_one_line_error(err, "eyas dump-hidden-states", server.url, str(tmp_path / "notes.txt"),
                          "is outside the storage directory")
    assert took < 60 and (tmp_path / "notes.txt").is_file()


def test_a_failed_fetch_stops_the_streamed_fetches_in_flight(setup, tmp_path):
    """StreamedHiddenStates: the next steps' fetches wait on held .locks when this step's is refused; the error
    is raised at once and no fetch thread is left running."""
    from eyas.train.hidden_states_server import StreamedHiddenStates

    storage = tmp_path / "storage"
    storage.mkdir()
    (tmp_path / "notes.txt").write_text("keep me\n")
    server = FakeVllm(setup["target"], storage, names=lambda n: str(tmp_path / "notes.txt") if n == 3 else None,
                      hold=lambda n: n < 3)
    before = set(threading.enumerate())
    try:
        states = ServerHiddenStates(ServerClient(server.url), AUX, 4, setup["target"].config.hidden_size, storage)
        streamed = StreamedHiddenStates(states, setup["examples"], torch.float32, workers=3)
        streamed.prefetch(1, [0, 1])
        while server.count < 2:
            time.sleep(0.01)
        finished, raised = bounded(lambda: streamed.batch(0, [2]), 20)
        left = threads_left("eyas-stream", before)
    finally:
        server.close()
    assert finished and not left, (raised, left)
    assert isinstance(raised, HiddenStateError) and "is outside the storage directory" in str(raised), raised
    assert (tmp_path / "notes.txt").is_file()
