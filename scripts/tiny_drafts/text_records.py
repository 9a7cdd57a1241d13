"""Plain-text training records for the drafts: windows of the target's own pretraining text (the standard library
files it was trained on, never the held-out ones), so the drafts also see raw-text contexts, not only chats.

    python scripts/tiny_drafts/text_records.py --num 1024 --tokens 384 -o work/drafts/text.jsonl

Each record is {"text": ...}: eyas tokenizes it with the target's tokenizer and every token is a loss token.
Windows start at evenly spaced offsets of work/tiny_target/train.bin and never cross a file boundary.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from transformers import AutoTokenizer

REPO = Path(__file__).resolve().parents[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", type=Path, default=REPO / "work" / "tiny_target" / "train.bin")
    ap.add_argument("--model", type=Path, default=REPO / "examples" / "tiny-deepseek-v3")
    ap.add_argument("--num", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=384, help="tokens per window")
    ap.add_argument("-o", "--output", type=Path, required=True)
    args = ap.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    ids = np.fromfile(args.bin, dtype=np.uint16)
    special = {tokenizer.bos_token_id, tokenizer.eos_token_id}
    records = []
    for start in np.linspace(0, len(ids) - args.tokens, args.num * 2).astype(int):
        window = ids[start:start + args.tokens].tolist()
        if any(t in special for t in window):  # crosses a file boundary
            continue
        records.append({"text": tokenizer.decode(window)})
        if len(records) == args.num:
            break
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text("".join(json.dumps(r) + "\n" for r in records))
    print(f"wrote {len(records)} windows of {args.tokens} tokens to {args.output}")


if __name__ == "__main__":
    main()
