"""`eyas import-hidden-states`: dumps written in vLLM's, Model Optimizer's and SpecForge's layouts (from a tiny
target) import into shards equal to eyas's own dump of the same records and train to the same loss; every file
eyas cannot read the same way is refused, naming it."""

import gzip
import io
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile

import pytest
import torch
from safetensors.torch import save_file
from tiny import make_tokenized_target

from eyas.cli import main, parse_args
from eyas.train.batches import collate, target_features
from eyas.train.config import TrainConfig
from eyas.train.hidden_states import HiddenStateError, HiddenStateShards, capture_hidden_states, dump_hidden_states
from eyas.train.trainer import train

AUX = (1, 2, 3)  # hidden_states ids of the 4-layer tiny target; L = 4 is the last hidden state


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The target, its records, eyas's own float32 dump of them, the states of every example (aux in AUX order,
    last pre-norm) and the loss a short offline run on eyas's dump reaches."""
    from eyas import load_model
    from eyas.train.data import load_dataset

    root = tmp_path_factory.mktemp("import")
    target_dir = root / "target"
    make_tokenized_target(target_dir)
    records = []
    for i in range(6):
        records.append({"messages": [{"role": "user", "content": f"def add_{i}(a, b):"},
                                     {"role": "assistant", "content": f"    return a + b + {i}\n" * 2}]})
        records.append({"text": f"for i in range({i}):\n    print(i, {i})\n"})
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    from eyas.engine.llm import load_tokenizer

    target = load_model(target_dir)
    examples = load_dataset(data, load_tokenizer(target_dir), 256)
    states = [capture_hidden_states(target, torch.tensor([ex.input_ids]), AUX) for ex in examples]
    states = [(aux[0], last[0]) for aux, last in states]  # [T, 3, H], [T, H]
    dump = root / "eyas_dump"
    dump_hidden_states(target, examples, dump, AUX, examples_per_shard=5, dtype=torch.float32, batch_size=1,
                       target_path=target_dir)
    loss = train(train_config(root, target_dir, "run_eyas", dump))["loss_per_step"]
    return dict(root=root, target_dir=target_dir, target=target, data=data, examples=examples, states=states,
                dump=dump, loss=loss)


def train_config(root, target_dir, out, hidden_states):
    return TrainConfig(target=str(target_dir), out=str(root / out), hidden_states=str(hidden_states),
                       draft_arch="mla", draft_vocab_size=0, lr=3e-3, warmup_steps=2, max_steps=2, batch_size=4,
                       max_length=256, save_every=2, seed=0)


def run(setup, src, fmt, *flags):
    """`eyas import-hidden-states SRC --format FMT --out SRC.eyas --model TARGET FLAGS...`; the output dir."""
    out = src.with_name(src.name + ".eyas")
    args = parse_args(["import-hidden-states", str(src), "--format", fmt, "--out", str(out), "--model",
                       str(setup["target_dir"]), *flags])
    assert args.func(args) == 0
    return out


def normed(setup, last):
    with torch.no_grad():
        return setup["target"].model.norm(last)


# -- each tool's layout, as its dumper writes it ------------------------------------------------------------------

def write_vllm(setup, src, requested=(3, 1, 4, 2)):
    """ExampleHiddenStatesConnector: <request id>.safetensors, hidden_states [T, n_ids, H] in the order the ids
    were requested (id 4 = L, the last hidden state before the norm), token_ids [T]; a released .lock beside."""
    src.mkdir()
    for i, (ex, (aux, last)) in enumerate(zip(setup["examples"], setup["states"])):
        slots = [last if rid == 4 else aux[:, AUX.index(rid)] for rid in requested]
        name = f"cmpl-{i:04d}-0.safetensors"
        save_file({"hidden_states": torch.stack(slots, dim=1).contiguous(),
                   "token_ids": torch.tensor(ex.input_ids)}, str(src / name))
        (src / (name + ".lock")).write_text("")
    return src


def write_modelopt(setup, src, post_norm=False):
    """collect_hidden_states: <conversation id>.pt with input_ids [T], hidden_states [T, H] (its vLLM dumper:
    before the norm; its HF dumper: after), aux_hidden_states [T, 3H] ascending, loss_mask [T], conversation_id.
    conv_2 sorts before conv_10, as the records do."""
    src.mkdir()
    for i, (ex, (aux, last)) in enumerate(zip(setup["examples"], setup["states"])):
        torch.save({"input_ids": torch.tensor(ex.input_ids), "hidden_states": normed(setup, last) if post_norm
                    else last, "aux_hidden_states": aux.reshape(aux.shape[0], -1),
                    "loss_mask": torch.tensor(ex.loss_mask), "conversation_id": f"conv_{i}"}, src / f"conv_{i}.pt")
    return src


def write_specforge(setup, src, group=5):
    """prepare_hidden_states: rows_a-b/data_{i}.ckpt with input_ids [T'], loss_mask [T'], hidden_state [1, T, H]
    (what SGLang's lm_head reads: after the norm), aux_hidden_state [1, T, 3H]. Odd rows are padded as its batched
    dumper pads them (ids and mask to a longer row, the states not); one file is gzipped."""
    for i, (ex, (aux, last)) in enumerate(zip(setup["examples"], setup["states"])):
        pad = 3 if i % 2 else 0
        row = {"input_ids": torch.tensor(ex.input_ids + [0] * pad),
               "loss_mask": torch.tensor(ex.loss_mask + [0] * pad),
               "hidden_state": normed(setup, last)[None], "aux_hidden_state": aux.reshape(1, aux.shape[0], -1)}
        folder = src / f"rows_{i // group * group}-{i // group * group + group}"
        folder.mkdir(parents=True, exist_ok=True)
        if i == 7:
            with gzip.open(folder / f"data_{i}.ckpt.gz", "wb") as f:
                torch.save(row, f)
        else:
            torch.save(row, folder / f"data_{i}.ckpt")
    return src


def assert_same_as_eyas_dump(setup, out, post_norm):
    ours, imported = HiddenStateShards(setup["dump"]), HiddenStateShards(out)
    assert len(imported) == len(ours) and imported.last_hidden_post_norm is post_norm
    for key in ("aux_hidden_state_ids", "num_examples", "total_tokens", "total_loss_tokens", "data_fingerprint",
                "dtype", "hidden_size", "num_shards"):
        assert imported.manifest[key] == ours.manifest[key], key
    for i in range(len(ours)):
        a, b = ours[i], imported[i]
        for key in ("input_ids", "loss_mask", "aux_hidden_states"):
            assert torch.equal(a[key], b[key]), (i, key)
        expected = normed(setup, a["last_hidden"]) if post_norm else a["last_hidden"]
        assert torch.equal(b["last_hidden"], expected), i


# -- round trips ---------------------------------------------------------------------------------------------------

def test_vllm_files_matched_to_records_equal_eyas_dump_and_train_the_same(setup):
    src = write_vllm(setup, setup["root"] / "vllm")
    out = run(setup, src, "vllm", "--aux-layer-ids", "3", "1", "4", "2", "--data", str(setup["data"]),
              "--examples-per-shard", "5")
    assert_same_as_eyas_dump(setup, out, post_norm=False)
    manifest = HiddenStateShards(out).manifest
    assert manifest["source"]["format"] == "vllm" and manifest["source"]["aux_layer_ids"] == [3, 1, 4, 2]
    assert manifest["source_path"] == str(src.resolve())
    loss = train(train_config(setup["root"], setup["target_dir"], "run_vllm", out))["loss_per_step"]
    assert loss == setup["loss"]
    inside = src / "eyas"  # an OUT inside SRC: its shards are *.safetensors too, and are not read as vLLM files
    for _ in range(2):
        args = parse_args(["import-hidden-states", str(src), "--format", "vllm", "--out", str(inside), "--model",
                           str(setup["target_dir"]), "--aux-layer-ids", "3", "1", "4", "2", "--data",
                           str(setup["data"])])
        assert args.func(args) == 0
        assert HiddenStateShards(inside).manifest["num_examples"] == len(setup["examples"])


def test_modelopt_pre_norm_files_equal_eyas_dump_and_train_the_same(setup):
    src = write_modelopt(setup, setup["root"] / "modelopt")
    out = run(setup, src, "modelopt", "--aux-layer-ids", "1", "2", "3", "--aux-layer-convention", "hidden_states",
              "--last-hidden", "pre-norm", "--examples-per-shard", "5")
    assert_same_as_eyas_dump(setup, out, post_norm=False)
    loss = train(train_config(setup["root"], setup["target_dir"], "run_modelopt", out))["loss_per_step"]
    assert loss == setup["loss"]


def test_specforge_post_norm_files_keep_their_norm_and_train_the_same(setup):
    """SpecForge's last hidden state is past the final norm: stored as it is, said in the manifest, and the
    trainer's teacher logits from it are the ones eyas's pre-norm dump gives."""
    src = write_specforge(setup, setup["root"] / "specforge")
    out = run(setup, src, "specforge", "--aux-layer-ids", "0", "1", "2", "--examples-per-shard", "5")
    assert_same_as_eyas_dump(setup, out, post_norm=True)
    manifest = HiddenStateShards(out).manifest
    assert manifest["last_hidden_post_norm"] is True and manifest["source"]["aux_layer_convention"] == "layer_output"
    ours, imported = HiddenStateShards(setup["dump"]), HiddenStateShards(out)
    items = [0, 1, 2, 3]
    _, pre = target_features(setup["target"], collate([ours[i] for i in items], 256), AUX)
    _, post = target_features(setup["target"], collate([imported[i] for i in items], 256), AUX,
                              last_hidden_post_norm=True)
    torch.testing.assert_close(post, pre, rtol=1e-5, atol=1e-5)
    loss = train(train_config(setup["root"], setup["target_dir"], "run_specforge", out))["loss_per_step"]
    assert loss == pytest.approx(setup["loss"], rel=1e-5, abs=1e-6)


def test_import_resumes_and_refuses_another_source(setup):
    from eyas.train.import_dumps import SOURCE_FORMATS, final_norm_weight, import_hidden_states, resolve_layout

    src = write_modelopt(setup, setup["root"] / "modelopt_resume")
    config = setup["target"].config
    layout = resolve_layout(SOURCE_FORMATS["modelopt"], AUX, "hidden_states", "pre-norm", 4, config.hidden_size,
                            config.vocab_size, config.max_position_embeddings)
    out = setup["root"] / "resumed"
    kw = dict(examples_per_shard=5, norm_weight=final_norm_weight(setup["target_dir"]))
    partial = import_hidden_states(src, out, layout, config, setup["target_dir"], max_shards=1, **kw)
    assert not partial["complete"] and [s["file"] for s in partial["shards"]] == ["shard-00000.safetensors"]
    first = (out / "shard-00000.safetensors").stat().st_mtime_ns
    assert import_hidden_states(src, out, layout, config, setup["target_dir"], **kw)["complete"]
    assert (out / "shard-00000.safetensors").stat().st_mtime_ns == first  # kept, not rewritten
    assert_same_as_eyas_dump(setup, out, post_norm=False)
    torch.save(torch.load(src / "conv_0.pt", weights_only=True), src / "conv_12.pt")  # one more file
    with pytest.raises(HiddenStateError, match="refusing to mix"):
        import_hidden_states(src, out, layout, config, setup["target_dir"], **kw)


# -- refusals ------------------------------------------------------------------------------------------------------

def one_modelopt_file(setup, src, **changes):
    """A modelopt dump of the first two examples, the second file's dict changed by `changes`: a value, a function
    of the value it replaces, or None to drop the key."""
    src.mkdir()
    for i in range(2):
        (ex, (aux, last)) = setup["examples"][i], setup["states"][i]
        row = {"input_ids": torch.tensor(ex.input_ids), "hidden_states": last,
               "aux_hidden_states": aux.reshape(aux.shape[0], -1), "loss_mask": torch.tensor(ex.loss_mask),
               "conversation_id": i}
        if i == 1:
            row.update({k: v(row[k]) if callable(v) else v for k, v in changes.items()})
            row = {k: v for k, v in row.items() if v is not None}
        torch.save(row, src / f"c{i}.pt")
    return src, src / "c1.pt"


MODELOPT_FLAGS = ("--aux-layer-ids", "1", "2", "3", "--aux-layer-convention", "hidden_states", "--last-hidden",
                  "pre-norm")


class Opaque:
    pass


@pytest.mark.parametrize("changes, message", [
    (dict(hidden_states=[1.0, 2.0]), r"key 'hidden_states' holds a list; expected a tensor"),
    (dict(conversation_id=Opaque()), r"holds objects other than tensors \(\S*Opaque\): refused"),
    (dict(loss_mask=None), r"no 'loss_mask' \(keys: \['aux_hidden_states', 'hidden_states', 'input_ids'\]\)"),
    (dict(aux_hidden_states=torch.zeros(5, 64)), r"'aux_hidden_states' is \[5, 64\]; expected \[T, 96\]"),
    (dict(hidden_states=torch.zeros(2, 3, 32)), r"'hidden_states' is \[2, 3, 32\]; expected \[T, 32\]"),
    (dict(loss_mask=torch.ones(3, dtype=torch.long)), r"'loss_mask' has 3 entries for \d+ rows"),
    (dict(input_ids=torch.tensor([5, 9000])), r"'input_ids' has 2 entries for \d+ rows"),
    (dict(hidden_states=torch.zeros(3, 32)), r"'hidden_states' has 3 rows, 'aux_hidden_states' \d+"),
    (dict(hidden_states=lambda last: last.double()), r"holds torch.float64 hidden states"),
    (dict(input_ids=lambda ids: ids.float()), r"'input_ids' is torch.float32; expected integer token ids"),
    (dict(loss_mask=lambda mask: mask * 2), r"'loss_mask' holds values other than 0 and 1"),
], ids=["list", "object", "missing-key", "aux-width", "state-dims", "short-mask", "short-ids", "rows-differ",
        "float64", "float-ids", "mask-values"])
def test_a_bad_modelopt_file_is_refused_naming_it(setup, tmp_path, changes, message):
    src, bad = one_modelopt_file(setup, tmp_path / "src", **changes)
    with pytest.raises(HiddenStateError, match=rf"{bad}: .*{message}"):
        run(setup, src, "modelopt", *MODELOPT_FLAGS)
    assert not (tmp_path / "src.eyas" / "shard-00000.safetensors").exists()  # refused before writing


def test_a_pickle_that_is_not_a_dict_of_tensors_is_refused(setup, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    torch.save([torch.zeros(3)], src / "c0.pt")
    with pytest.raises(HiddenStateError, match=rf"{src / 'c0.pt'}: holds a list; expected a dict of tensors"):
        run(setup, src, "modelopt", *MODELOPT_FLAGS)
    torch.save({"input_ids": Opaque()}, src / "c0.pt")
    with pytest.raises(HiddenStateError, match=rf"{src / 'c0.pt'}: holds objects other than tensors "
                                               r"\(\S*Opaque\): refused"):
        run(setup, src, "modelopt", *MODELOPT_FLAGS)


def test_a_vllm_file_matching_no_record_is_refused(setup, tmp_path):
    src = write_vllm(setup, tmp_path / "vllm")
    bad = src / "cmpl-0003-0.safetensors"
    aux, last = setup["states"][3]
    ids = torch.tensor(setup["examples"][3].input_ids)
    ids[-1] = (ids[-1] + 1) % 8192
    save_file({"hidden_states": torch.stack([aux[:, 2], aux[:, 0], last, aux[:, 1]], dim=1).contiguous(),
               "token_ids": ids}, str(bad))
    flags = ("--aux-layer-ids", "3", "1", "4", "2", "--data", str(setup["data"]))
    with pytest.raises(HiddenStateError, match=rf"{bad}: its \d+ token ids .* match no record of --data"):
        run(setup, src, "vllm", *flags)
    shutil.copy(src / "cmpl-0002-0.safetensors", bad)  # the same record twice
    with pytest.raises(HiddenStateError, match=rf"{bad}: holds the same \d+ tokens as .*cmpl-0002-0.safetensors"):
        run(setup, src, "vllm", *flags)
    with pytest.raises(HiddenStateError, match=r"'hidden_states' is \[\d+, 4, 32\]; expected \[T, 3, 32\]"):
        run(setup, src, "vllm", "--aux-layer-ids", "3", "1", "4", "--data", str(setup["data"]))
    with pytest.raises(ValueError, match="holds no id 4"):
        run(setup, src, "vllm", "--aux-layer-ids", "3", "1", "2", "--data", str(setup["data"]))
    with pytest.raises(ValueError, match="give --data"):
        run(setup, src, "vllm", "--aux-layer-ids", "3", "1", "4", "2")


def test_the_wrong_side_of_the_norm_is_refused(setup, tmp_path):
    """A post-norm state claimed pre-norm, or the other way round, is caught on the first file, before any
    shard; modelopt, whose dumpers differ, must be told which."""
    src = write_modelopt(setup, tmp_path / "hf_dumper", post_norm=True)
    with pytest.raises(HiddenStateError, match=r"conv_0.pt: the last hidden state looks past the final norm"):
        run(setup, src, "modelopt", *MODELOPT_FLAGS)
    pre = write_modelopt(setup, tmp_path / "vllm_dumper")
    flags = list(MODELOPT_FLAGS)
    flags[-1] = "post-norm"
    with pytest.raises(HiddenStateError, match=r"conv_0.pt: the last hidden state is not past the final norm: "
                                               r"row 0 has RMS"):
        run(setup, pre, "modelopt", *flags)
    with pytest.raises(ValueError, match="give --last-hidden"):
        run(setup, src, "modelopt", "--aux-layer-ids", "1", "2", "3", "--aux-layer-convention", "hidden_states")
    with pytest.raises(ValueError, match="give --aux-layer-convention"):
        run(setup, src, "modelopt", "--aux-layer-ids", "1", "2", "3", "--last-hidden", "post-norm")


def test_specforge_padding_with_loss_and_mixed_dtypes_are_refused(setup, tmp_path):
    src = write_specforge(setup, tmp_path / "sf")
    bad = src / "rows_0-5" / "data_3.ckpt"
    row = torch.load(bad, weights_only=True)
    row["loss_mask"][-1] = 1  # "padding" that carries loss: not padding
    torch.save(row, bad)
    with pytest.raises(HiddenStateError, match=rf"{bad}: 'input_ids' has \d+ entries for \d+ rows"):
        run(setup, src, "specforge", "--aux-layer-ids", "0", "1", "2")
    row["loss_mask"][-1] = 0
    row["aux_hidden_state"] = row["aux_hidden_state"].bfloat16()
    torch.save(row, bad)
    with pytest.raises(HiddenStateError, match=rf"{bad}: holds torch.bfloat16 states where .* holds torch.float32"):
        run(setup, src, "specforge", "--aux-layer-ids", "0", "1", "2")
    out = run(setup, src, "specforge", "--aux-layer-ids", "0", "1", "2", "--dtype", "bfloat16")
    assert HiddenStateShards(out)[3]["aux_hidden_states"].dtype == torch.bfloat16


# -- files crafted to cost more than they hold -----------------------------------------------------------------------
# Each refusal is one line naming the file, reached before the file's claimed size is allocated. The memory bounds are
# measured in a child process whose address space is capped at 2 GiB, so a regression fails there instead of taking
# the machine's memory.

ADDRESS_SPACE = 2 << 30
LIMITED = """
import json, resource, sys
resource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit}))
import torch
import eyas.cli
import eyas.train.import_dumps
baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB; eyas and torch loaded: only the work counts
{body}
grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - baseline) * 1024
print(json.dumps({{"result": result, "grown": grown}}))
"""


def in_limited_process(body, *argv):
    """Run `body` (Python setting `result`; sys.argv[1:] is `argv`) in a child limited to ADDRESS_SPACE; returns
    its `result`, `grown` (bytes its peak RSS rose above its peak once eyas was imported) and its stderr."""
    script = LIMITED.format(limit=ADDRESS_SPACE, body=textwrap.dedent(body))
    child = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-3000:]
    return {**json.loads(child.stdout.splitlines()[-1]), "stderr": child.stderr}


def error_lines(stderr):
    """What the CLI printed besides its progress bars."""
    return [line for line in re.split(r"[\r\n]+", stderr) if line.strip() and not line.startswith("indexing")]


def gzip_bomb(path, expanded=200 << 20):
    """`expanded` bytes of zeros gzipped (about 1000:1), written a MiB at a time: never whole in memory."""
    zeros = bytes(1 << 20)
    with gzip.open(path, "wb") as f:
        for _ in range(expanded >> 20):
            f.write(zeros)


def rezip(saved, compression):
    """The torch.save file `saved` (bytes) with every record written again with `compression`."""
    with zipfile.ZipFile(io.BytesIO(saved)) as z:
        records = {name: z.read(name) for name in z.namelist()}
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression) as z:
        for name, data in records.items():
            z.writestr(name, data)
    return out.getvalue()


def with_pickle(path, pickled):
    """A torch.save zip whose data.pkl is `pickled`, as a hand-made file would be."""
    buffer = io.BytesIO()
    torch.save({}, buffer)
    with zipfile.ZipFile(buffer) as z:
        records = {name: pickled if name.endswith("/data.pkl") else z.read(name) for name in z.namelist()}
    with zipfile.ZipFile(path, "w") as z:
        for name, data in records.items():
            z.writestr(name, data)


@pytest.fixture
def loaded(monkeypatch):
    """What torch.load is asked to read, in order: paths, and "a buffer" for a decompressed .gz."""
    paths, load = [], torch.load

    def recording(f, *args, **kwargs):
        paths.append(f if isinstance(f, (str, os.PathLike)) else "a buffer")
        return load(f, *args, **kwargs)
    monkeypatch.setattr(torch, "load", recording)
    return paths


def test_a_gzip_bomb_is_refused_within_a_memory_bound(setup, tmp_path):
    """200 MiB of zeros as a 200 KB data_0.ckpt.gz: decompressed a chunk at a time and refused once past what
    a file of the tiny target can hold (max_file_bytes: 4.1 MiB here), so the child's peak RSS rises by a few
    MiB. The bound, 64 MiB, leaves room for the CLI's own work and allocator slack and is far below any reading
    of the whole stream (200 MiB at the least; 400 MiB when it was read whole and copied)."""
    src = tmp_path / "sf"
    (src / "rows_0-5").mkdir(parents=True)
    bomb = src / "rows_0-5" / "data_0.ckpt.gz"
    gzip_bomb(bomb)
    assert bomb.stat().st_size < 1 << 20
    child = in_limited_process("result = eyas.cli.main(sys.argv[1:])", "import-hidden-states", str(src), "--format",
                               "specforge", "--out", str(tmp_path / "out"), "--model", str(setup["target_dir"]),
                               "--aux-layer-ids", "0", "1", "2")
    assert child["result"] == 2
    assert child["grown"] < 64 << 20, child["grown"]
    [line] = error_lines(child["stderr"])
    limit = re.fullmatch(rf"eyas import-hidden-states: error: {bomb}: decompresses to more than \d+ bytes, more "
                         r"than a file of this target can hold \((\d+) bytes: .*\): refused", line)
    assert limit and int(limit.group(1)) < 8 << 20, line


@pytest.mark.parametrize("view, message", [
    (lambda aux: torch.zeros(1, 1).expand(*aux.shape), r"is \[\d+, 96\] with strides \[0, 0\]: a stride-0 view"),
    (lambda aux: torch.zeros(aux.shape[0] + 95).as_strided(aux.shape, (1, 1)),
     r"is \[\d+, 96\] with strides \[1, 1\]: \d+ elements over a storage holding \d+, an overlapping view"),
], ids=["stride-0", "overlapping"])
def test_a_view_claiming_more_than_its_storage_is_refused(setup, tmp_path, view, message):
    """Aux states saved as a view repeating a few stored numbers: a copy would expand them to their declared
    size, and the states would be no states at all."""
    src, bad = one_modelopt_file(setup, tmp_path / "src", aux_hidden_states=view)
    with pytest.raises(HiddenStateError, match=rf"{bad}: 'aux_hidden_states' {message}.*: refused"):
        run(setup, src, "modelopt", *MODELOPT_FLAGS)


def test_a_stride_0_file_declaring_gigabytes_is_refused_unmaterialised(tmp_path):
    """A 2 KB file declaring 10**7 tokens of states (5 GB as float32 once copied) over one stored number per
    tensor, for a target that takes 10**7 tokens: refused on its strides, the child's memory barely moving;
    a copy would fail on its 2 GiB address space instead of swapping."""
    T, path = 10**7, tmp_path / "c0.pt"
    torch.save({"input_ids": torch.zeros(1, dtype=torch.long).expand(T),
                "loss_mask": torch.ones(1, dtype=torch.long).expand(T),
                "hidden_states": torch.zeros(1, 1).expand(T, 32),
                "aux_hidden_states": torch.zeros(1, 1).expand(T, 96), "conversation_id": "c0"}, path)
    assert path.stat().st_size < 4096
    child = in_limited_process("""
        from pathlib import Path
        from eyas.train.hidden_states import HiddenStateError
        from eyas.train.import_dumps import SOURCE_FORMATS, read_sequence, resolve_layout

        layout = resolve_layout(SOURCE_FORMATS["modelopt"], [1, 2, 3], "hidden_states", "pre-norm", 4, 32, 8192,
                                10**7)
        try:
            read_sequence(Path(sys.argv[1]), layout)
            result = "read"
        except HiddenStateError as e:
            result = str(e)
        """, str(path))
    assert child["grown"] < 64 << 20, child["grown"]
    assert re.fullmatch(rf"{path}: 'input_ids' is \[10000000\] with strides \[0\]: a stride-0 view .*: refused",
                        child["result"])


def test_a_file_larger_than_the_target_allows_is_refused_unread(setup, tmp_path, loaded):
    """8 MiB of extra tensor in a file of the tiny target, whose files hold 4.1 MiB at most: refused on the
    file's size, before torch.load opens it."""
    src, bad = one_modelopt_file(setup, tmp_path / "src", padding=torch.zeros(2 << 20))
    with pytest.raises(HiddenStateError, match=rf"{bad}: holds \d+ bytes, more than a file of this target can "
                                               r"hold \(\d+ bytes: .*\): refused"):
        run(setup, src, "modelopt", *MODELOPT_FLAGS)
    assert loaded == [src / "c0.pt"]


@pytest.mark.parametrize("padding, message", [
    (2 << 20, r"its zip records declare \d+ bytes, more than a file of this target can hold"),
    (0, r"zip records \[.*\] are compressed; torch.save stores every record as it is: refused"),
], ids=["declared-too-large", "compressed"])
def test_a_gzipped_zip_of_compressed_records_is_refused_before_loading(setup, tmp_path, loaded, padding, message):
    """A .ckpt.gz whose torch zip holds deflated records: 8 MiB of zeros inflating out of a few KB, or any record
    compressed at all (torch.save compresses none; torch.load would inflate each to the size it declares)."""
    src = write_specforge(setup, tmp_path / "sf")
    bad = src / "rows_5-10" / "data_7.ckpt.gz"
    with gzip.open(bad, "rb") as f:
        row = torch.load(f, weights_only=True)
    if padding:
        row["padding"] = torch.zeros(padding)
    saved = io.BytesIO()
    torch.save(row, saved)
    with gzip.open(bad, "wb") as f:
        f.write(rezip(saved.getvalue(), zipfile.ZIP_DEFLATED))
    assert bad.stat().st_size < 1 << 20
    loaded.clear()
    with pytest.raises(HiddenStateError, match=rf"{bad}: {message}"):
        run(setup, src, "specforge", "--aux-layer-ids", "0", "1", "2")
    assert loaded == [src / f"rows_{i // 5 * 5}-{i // 5 * 5 + 5}" / f"data_{i}.ckpt" for i in range(7)]


@pytest.mark.parametrize("pickled, held", [
    # print("hi"), were it run: GLOBAL builtins.print, REDUCE, in the dict's only value
    (b"\x80\x02}X\x01\x00\x00\x00acbuiltins\nprint\nX\x02\x00\x00\x00hi\x85Rs.", r"print"),
    # os.getcwd(), were it run: a module torch blocks outright
    (b"\x80\x02}X\x01\x00\x00\x00acos\ngetcwd\n)Rs.", r"os\.getcwd"),
    # protocol 4 names globals with STACK_GLOBAL, an opcode torch's unpickler does not run
    (pickle.dumps({"a": print}, protocol=4), r"Unsupported operand \d+"),
], ids=["global-print", "blocked-module", "stack-global"])
def test_a_pickle_of_other_objects_is_refused_in_one_line_of_our_own(setup, tmp_path, capsys, pickled, held):
    """Whatever torch.load(weights_only=True) refuses, the user reads one line naming the file and what it
    holds, never torch's advice to load it with weights_only=False."""
    src, _ = one_modelopt_file(setup, tmp_path / "src")
    bad = src / "c1.pt"
    with_pickle(bad, pickled)
    assert main(["import-hidden-states", str(src), "--format", "modelopt", "--out", str(tmp_path / "out"), "--model",
                 str(setup["target_dir"]), *MODELOPT_FLAGS]) == 2
    [line] = error_lines(capsys.readouterr().err)
    assert re.fullmatch(rf"eyas import-hidden-states: error: {bad}: holds objects other than tensors \({held}\): "
                        r"refused", line), line
    assert "weights_only" not in line


@pytest.mark.parametrize("tensor, kind", [
    (lambda ids: ids.to_sparse(), r"a torch\.sparse_coo tensor"),
    (lambda ids: torch.empty(ids.shape, dtype=ids.dtype, device="meta"), r"a meta tensor"),
], ids=["sparse", "meta"])
def test_a_tensor_that_is_not_dense_data_is_refused_in_one_line(setup, tmp_path, capsys, tensor, kind):
    """Tensors weights_only loading allows but no dumper writes: refused as they load, not left to fail in an
    operation later with a traceback."""
    src, bad = one_modelopt_file(setup, tmp_path / "src", input_ids=tensor)
    assert main(["import-hidden-states", str(src), "--format", "modelopt", "--out", str(tmp_path / "out"), "--model",
                 str(setup["target_dir"]), *MODELOPT_FLAGS]) == 2
    [line] = error_lines(capsys.readouterr().err)
    assert re.fullmatch(rf"eyas import-hidden-states: error: {bad}: 'input_ids' is {kind}; expected a dense CPU "
                        r"tensor: refused", line), line


def test_a_source_file_linking_outside_src_is_refused(setup, tmp_path):
    """A dump from elsewhere may hold links: one leading out of SRC is refused (the import would otherwise read,
    and copy into OUT, any file of this machine); one to a file inside SRC is read as that file."""
    src = write_modelopt(setup, tmp_path / "modelopt")
    link, outside = src / "conv_3.pt", tmp_path / "outside.pt"
    link.rename(outside)
    link.symlink_to(outside)
    with pytest.raises(HiddenStateError, match=rf"{link}: links to {outside.resolve()}, outside {src}: refused"):
        run(setup, src, "modelopt", *MODELOPT_FLAGS)
    (src / "kept").mkdir()
    link.unlink()
    outside.rename(src / "kept" / "conv_3.data")
    link.symlink_to(src / "kept" / "conv_3.data")
    assert_same_as_eyas_dump(setup, run(setup, src, "modelopt", *MODELOPT_FLAGS, "--examples-per-shard", "5"),
                             post_norm=False)


@pytest.mark.parametrize("listed", ["dotdot", "absolute", "link"])
def test_a_resumed_manifest_listing_a_shard_outside_out_is_refused(setup, tmp_path, listed):
    """OUT's manifest from an earlier run names each shard as a plain file in OUT, as a safetensors index names
    its shards; a resumed import keeps the shards it lists and training reads them, so one naming a file
    elsewhere (by `..`, an absolute path or a link) is refused, even where that file is a real shard."""
    from eyas.train.import_dumps import SOURCE_FORMATS, final_norm_weight, import_hidden_states, resolve_layout

    src = write_modelopt(setup, tmp_path / "modelopt")
    config = setup["target"].config
    layout = resolve_layout(SOURCE_FORMATS["modelopt"], AUX, "hidden_states", "pre-norm", 4, config.hidden_size,
                            config.vocab_size, config.max_position_embeddings)
    out = tmp_path / "out"
    kw = dict(examples_per_shard=5, norm_weight=final_norm_weight(setup["target_dir"]))
    import_hidden_states(src, out, layout, config, setup["target_dir"], max_shards=1, **kw)
    shard, elsewhere = out / "shard-00000.safetensors", tmp_path / "elsewhere.safetensors"
    shard.rename(elsewhere)
    manifest = json.loads((out / "manifest.json").read_text())
    name = {"dotdot": "../elsewhere.safetensors", "absolute": str(elsewhere), "link": shard.name}[listed]
    if listed == "link":
        shard.symlink_to(elsewhere)
    manifest["shards"][0]["file"] = name
    (out / "manifest.json").write_text(json.dumps(manifest))
    # a name that is no plain file name is refused as the manifest is read, a link leading out before it is used
    expected = (rf"shards\[0\] names '{re.escape(name)}'; expected the file name of a shard" if listed != "link" else
                rf"lists shard '{re.escape(name)}', which is not a file in {out}: refused")
    with pytest.raises(HiddenStateError, match=rf"{out / 'manifest.json'}: {expected}"):
        import_hidden_states(src, out, layout, config, setup["target_dir"], **kw)
