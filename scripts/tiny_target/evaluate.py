"""Quality of the shipped tiny target: bits per byte on the held-out standard-library files against `xz -9e`,
and greedy continuations of code prompts.

    python scripts/tiny_target/evaluate.py            # after build_data.py (it lists the held-out files)

bpb: each held-out file is scored as bos + tokens + eos in 512-token windows that advance by 256, each token
scored once with up to 256 tokens of context before its window; bits = summed NLL / ln 2; bytes = the files' UTF-8
bytes. xz is given the same files, once each file on its own and once all concatenated (its best case).
"""

from __future__ import annotations

import argparse
import json
import lzma
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from eyas import LLM, SamplingParams
from eyas.engine.llm import DEFAULT_MODEL

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["def is_prime(n):\n", "import os\n\n\ndef list_python_files(path):\n",
           "class Stack:\n    def __init__(self):\n", "    for line in lines:\n"]


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--work", type=Path, default=ROOT / "work" / "tiny_target")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    meta = json.loads((args.work / "meta.json").read_text())
    stdlib = Path(meta["stdlib"])
    llm = LLM(args.model)
    tok = llm.tokenizer
    bos, eos = tok.bos_token_id, tok.eos_token_id
    total_bits, total_bytes, xz_each, texts = 0.0, 0, 0, []
    for rel in meta["heldout_files"]:
        text = (stdlib / rel).read_text(encoding="utf-8")
        data = text.encode()
        texts.append(data)
        total_bits += file_bits(llm.model, [bos] + tok(text, add_special_tokens=False).input_ids + [eos])
        total_bytes += len(data)
        xz_each += xz_bytes(data)
    xz_all = xz_bytes(b"".join(texts))
    report = {"heldout_files": len(texts), "bytes": total_bytes,
              "model_bpb": round(total_bits / total_bytes, 4),
              "xz_9e_per_file_bpb": round(8 * xz_each / total_bytes, 4),
              "xz_9e_concatenated_bpb": round(8 * xz_all / total_bytes, 4)}
    print(json.dumps(report, indent=2))
    params = SamplingParams(temperature=0, max_tokens=64)
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, params)):
        print("-" * 60)
        print(prompt + out.text)


if __name__ == "__main__":
    main()
