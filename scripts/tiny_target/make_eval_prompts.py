"""Write examples/prompts/eval.jsonl: held-out prompts (from standard-library files the tiny target never saw in
training) in three categories, MT-Bench style records {"category", "turns"} or {"category", "prompt"}.

    python scripts/tiny_target/make_eval_prompts.py     # after build_data.py

- function-body: a held-out function's signature and docstring as a chat request (one turn)
- continuation:  the first lines of a held-out file as raw text to continue
- two-turn:      a function request, then a follow-up asking for a usage example
"""

from __future__ import annotations

import json
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    work = ROOT / "work" / "tiny_target"
    meta = json.loads((work / "meta.json").read_text())
    conversations = [json.loads(line) for line in (work / "conversations_heldout.jsonl").read_text().splitlines()]
    rng = random.Random(0)
    rng.shuffle(conversations)
    records = []
    for conv in conversations[:24]:
        records.append({"category": "function-body", "turns": [conv["messages"][0]["content"]]})
    for conv in conversations[24:32]:
        records.append({"category": "two-turn", "turns": [conv["messages"][0]["content"],
                                                          "Show a short example that calls it."]})
    stdlib = Path(meta["stdlib"])
    files = sorted(meta["heldout_files"])
    rng.shuffle(files)
    for rel in files[:16]:
        lines = (stdlib / rel).read_text(encoding="utf-8").splitlines(keepends=True)
        body = [i for i, line in enumerate(lines) if line.startswith(("def ", "class "))]
        start = body[0] if body else 0
        records.append({"category": "continuation", "prompt": "".join(lines[start:start + 6])})
    out = ROOT / "examples" / "prompts" / "eval.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    print(f"{out}: {len(records)} prompts")


if __name__ == "__main__":
    main()
