"""Greedy loops of tiny-target candidates on prompts that eval.jsonl and evaluate.py never draw, to choose between
training runs without tuning on the project's test prompts: continuations (six lines from the first def/class) of
24 held-out package files, and 32 held-out function requests from the second half of conversations_heldout.jsonl,
256 greedy tokens each; the measure is `eyas eval`'s (eyas.eval.acceptance.is_repetitive).

    python scripts/tiny_target/validate.py examples/tiny-deepseek-v3 work/tiny_target/stage3/model-step60
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import random
from pathlib import Path

from eyas import LLM, SamplingParams
from eyas.eval.acceptance import is_repetitive

ROOT = Path(__file__).resolve().parents[2]


def continuation_prompts(meta: dict, n: int = 24) -> list[str]:
    files = sorted(meta["package_heldout_files"])
    random.Random(0).shuffle(files)
    prompts = []
    for name in files:
        dist, rel = name.split("/", 1)
        try:
            text = Path(importlib.metadata.distribution(dist).locate_file(rel)).read_text()
        except (OSError, UnicodeDecodeError, importlib.metadata.PackageNotFoundError):
            continue
        lines = text.splitlines(keepends=True)
        starts = [i for i, line in enumerate(lines) if line.startswith(("def ", "class "))]
        if starts and len(lines) >= starts[0] + 6:
            prompts.append("".join(lines[starts[0]:starts[0] + 6]))
        if len(prompts) == n:
            break
    return prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", type=Path, nargs="+", help="checkpoint directories (with the tokenizer files)")
    ap.add_argument("--work", type=Path, default=ROOT / "work" / "tiny_target")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    meta = json.loads((args.work / "meta.json").read_text())
    continuations = continuation_prompts(meta)
    requests = [json.loads(line)["messages"][:1]
                for line in (args.work / "conversations_heldout.jsonl").read_text().splitlines() if line]
    requests = requests[len(requests) // 2:][:32]
    params = SamplingParams(temperature=0, max_tokens=256)
    for model in args.models:
        llm = LLM(model, max_num_seqs=16, threads=args.threads)
        looped = [sum(is_repetitive(o.token_ids) for o in llm.generate(prompts, params))
                  for prompts in (continuations, requests)]
        print(f"{model}: continuations repetitive {looped[0]} / {len(continuations)}, "
              f"function requests repetitive {looped[1]} / {len(requests)}", flush=True)


if __name__ == "__main__":
    main()
