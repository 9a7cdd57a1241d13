"""Quality of a tiny target: bits per byte on the held-out files (standard library and the packages' sources)
against `xz -9e`, and greedy answers to held-out function requests (the signature and docstring of a function the
model never saw, in the chat form it was trained on): how many are repetitive (the measure `eyas eval` reports)
and how many bodies parse as Python.

    python scripts/tiny_target/evaluate.py                       # the bundled target, after build_data.py
    python scripts/tiny_target/evaluate.py --model work/tiny_target/model --out report.json

bpb: each held-out file is scored as bos + tokens + eos in 512-token windows that advance by 256, each token
scored once with up to 256 tokens of context before its window; bits = summed NLL / ln 2; bytes = the files' UTF-8
bytes. xz is given the same files, once each file on its own and once all concatenated (its best case).
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import json
import lzma
import math
import random
from pathlib import Path

import torch
import torch.nn.functional as F

from eyas import LLM, SamplingParams
from eyas.engine.llm import DEFAULT_MODEL
from eyas.eval.acceptance import is_repetitive

ROOT = Path(__file__).resolve().parents[2]


@torch.inference_mode()
def file_bits(model, ids: list[int], window: int = 512, stride: int = 256) -> float:
    tokens = torch.tensor(ids)
    bits, scored = 0.0, 1  # the bos is given, never predicted
    while scored < len(tokens):
        start = max(0, scored - (window - stride))
        end = min(len(tokens), start + window)
        logits = model(tokens[None, start:end - 1])[0]
        targets = tokens[start + 1:end]
        nll = F.cross_entropy(logits, targets, reduction="none")
        bits += nll[scored - start - 1:].sum().item() / math.log(2)
        scored = end
    return bits


def xz_bytes(data: bytes) -> int:
    return len(lzma.compress(data, preset=9 | lzma.PRESET_EXTREME))


def heldout_bpb(llm, files: list[Path]) -> dict:
    tok = llm.tokenizer
    total_bits, total_bytes, xz_each, texts = 0.0, 0, 0, []
    for path in files:
        text = path.read_bytes().decode("utf-8")
        data = text.encode()
        texts.append(data)
        total_bits += file_bits(llm.model, [tok.bos_token_id] + tok(text, add_special_tokens=False).input_ids
                                + [tok.eos_token_id])
        total_bytes += len(data)
        xz_each += xz_bytes(data)
    return {"files": len(texts), "bytes": total_bytes, "model_bpb": round(total_bits / total_bytes, 4),
            "xz_9e_per_file_bpb": round(8 * xz_each / total_bytes, 4),
            "xz_9e_concatenated_bpb": round(8 * xz_bytes(b"".join(texts)) / total_bytes, 4)}


def parses(code: str, body: str, finished: bool) -> bool:
    """Whether signature + docstring + the generated body is Python (a cut-off answer loses its last line)."""
    if not finished:
        body = body[:body.rfind("\n") + 1]
    try:
        ast.parse(code + body)
    except SyntaxError:
        return False
    return True


def function_answers(llm, conversations: list[dict], max_tokens: int) -> dict:
    """Greedy answers to held-out function requests: shares that are repetitive and that parse, and examples."""
    requests = [c["messages"][:1] for c in conversations]
    outs = llm.generate(requests, SamplingParams(temperature=0, max_tokens=max_tokens))
    codes = [r[0]["content"].split("\n\n", 1)[1] for r in requests]  # the request without its instruction
    repetitive = [is_repetitive(o.token_ids) for o in outs]
    parsed = [parses(code, o.text, o.finish_reason == "stop") for code, o in zip(codes, outs)]
    return {"prompts": len(outs), "repetitive_share": round(sum(repetitive) / len(outs), 4),
            "parse_share": round(sum(parsed) / len(outs), 4),
            "stopped_share": round(sum(o.finish_reason == "stop" for o in outs) / len(outs), 4),
            "examples": [code + o.text for code, o in zip(codes[:3], outs[:3])]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--work", type=Path, default=ROOT / "work" / "tiny_target")
    ap.add_argument("--num-prompts", type=int, default=40, help="held-out function requests per source (default 40)")
    ap.add_argument("--max-tokens", type=int, default=128, help="per answer (default 128)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, help="also write the report here (JSON)")
    args = ap.parse_args()

    meta = json.loads((args.work / "meta.json").read_text())
    llm = LLM(args.model, max_num_seqs=16, threads=args.threads)
    stdlib = Path(meta["stdlib"])
    report = {"model": str(args.model), "stdlib": heldout_bpb(llm, [stdlib / f for f in meta["heldout_files"]])}
    if "package_heldout_files" in meta:  # "dist/path", the path relative to where the distribution is installed
        report["packages"] = heldout_bpb(llm, [
            Path(importlib.metadata.distribution(f.split("/", 1)[0]).locate_file(f.split("/", 1)[1]))
            for f in meta["package_heldout_files"]])
    for source, prefix in (("stdlib", ""), ("packages", "packages_")):
        path = args.work / f"conversations_{prefix}heldout.jsonl"
        if path.exists():
            conversations = [json.loads(line) for line in path.read_text().splitlines() if line]
            random.Random(0).shuffle(conversations)
            report[f"{source}_functions"] = function_answers(llm, conversations[:args.num_prompts], args.max_tokens)
    print(json.dumps({k: v for k, v in report.items()}, indent=2))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
