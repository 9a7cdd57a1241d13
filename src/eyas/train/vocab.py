"""The draft's compressed vocabulary: the target ids the draft may propose, chosen by frequency in the training data.

Layout (what every engine loads): ``d2t [draft_vocab] int64`` with target id = i + d2t[i] for draft id i, the kept
ids in ascending order; ``t2d [vocab] bool``, True for kept target ids.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from eyas.models.eagle3 import target_ids_of
from eyas.paths import DEFAULT_MODEL
from eyas.train.data import Example

log = logging.getLogger("eyas")


def count_loss_tokens(examples: Sequence[Example], vocab_size: int) -> torch.Tensor:
    """How often each target id appears as a loss-masked token: LongTensor [vocab_size]."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for n, ex in enumerate(tqdm(examples, desc="counting tokens", unit="example")):
        ids = torch.tensor(ex.input_ids, dtype=torch.int64)[torch.tensor(ex.loss_mask, dtype=torch.bool)]
        if ids.numel() and (ids.min() < 0 or ids.max() >= vocab_size):
            raise ValueError(f"example {n} has token id {int(ids.max())} outside the target vocabulary "
                             f"(vocab_size={vocab_size}); is the tokenizer the target's?")
        counts += torch.bincount(ids, minlength=vocab_size)
    return counts


def select_draft_vocab(counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """d2t [draft_vocab] and t2d [vocab] keeping the `draft_vocab_size` most frequent ids of `counts`."""
    vocab_size = counts.shape[0]
    if not 0 < draft_vocab_size <= vocab_size:
        raise ValueError(f"draft_vocab_size must be between 1 and the target's vocab_size={vocab_size}, "
                         f"got {draft_vocab_size}")
    # a stable descending sort breaks ties by ascending id, so unused ids (count 0) come last, lowest first:
    # data with fewer distinct ids than draft_vocab_size is padded with the lowest unused ids
    order = torch.sort(counts, descending=True, stable=True).indices
    kept = order[:draft_vocab_size].sort().values  # [draft_vocab], ascending target ids
    unused = int((counts[kept] == 0).sum())
    if unused > draft_vocab_size // 2:
        log.warning("%d of the %d draft ids (%.0f%%) never occur among the data's loss tokens: they are padding, "
                    "and the draft head spends their rows on nothing; use a --draft-vocab-size near %d or more data",
                    unused, draft_vocab_size, 100 * unused / draft_vocab_size, draft_vocab_size - unused)
    d2t = kept - torch.arange(draft_vocab_size, dtype=torch.int64)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[kept] = True
    return d2t, t2d


AUTO_COVERAGE = 0.95
# Data with fewer distinct loss tokens than this is too small to choose a draft vocabulary from: the draft learns
# the target's next token, which on such data mostly falls outside the few ids it has (12 conversations gave 4 ids,
# and every position was then dropped from the loss: nothing trained).
AUTO_MIN_IDS = 256


def auto_draft_vocab_size(counts: torch.Tensor, coverage: float = AUTO_COVERAGE, multiple: int = 256) -> int:
    """The draft vocabulary `eyas train` picks by default: the fewest ids (a multiple of `multiple`, or every id the
    data has if fewer) whose tokens make up `coverage` of the loss tokens; the whole vocabulary when that would keep
    more than half of it, where a smaller head saves little, or when the data has fewer than AUTO_MIN_IDS distinct
    loss tokens. The vocabulary-wide head is the draft's largest matmul, paid at every draft step."""
    vocab_size = counts.shape[0]
    cumulative = counts.sort(descending=True).values.cumsum(0)
    if cumulative[-1] == 0 or int((counts > 0).sum()) < min(AUTO_MIN_IDS, vocab_size):
        return vocab_size
    needed = int((cumulative < coverage * cumulative[-1]).sum()) + 1
    # rounded up, but never past the ids the data has: the rest would be padding that never occurs
    size = min(vocab_size, -(-needed // multiple) * multiple, int((counts > 0).sum()))
    return size if size <= vocab_size // 2 else vocab_size


def calibrate_vocab(examples: Sequence[Example], vocab_size: int,
                    draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t LongTensor [draft_vocab], t2d BoolTensor [vocab]) from the loss-masked tokens of `examples`."""
    return select_draft_vocab(count_loss_tokens(examples, vocab_size), draft_vocab_size)


def coverage_stats(counts: torch.Tensor, t2d: torch.Tensor) -> dict:
    """How much of the loss-masked data the draft vocabulary can propose."""
    total = int(counts.sum())
    covered = int(counts[t2d].sum())
    return {
        "vocab_size": int(t2d.shape[0]),
        "draft_vocab_size": int(t2d.sum()),
        "loss_tokens": total,
        "distinct_ids": int((counts > 0).sum()),
        "covered_tokens": covered,
        "coverage": covered / total if total else 0.0,
        "zero_frequency_ids": int((counts[t2d] == 0).sum()),  # padding when the data has too few distinct ids
    }


def check_vocab(d2t: torch.Tensor, t2d: torch.Tensor, source: str = "vocab") -> None:
    """d2t and t2d must describe the same ascending set of target ids."""
    if d2t.dtype != torch.int64 or d2t.dim() != 1:
        raise ValueError(f"{source}: d2t must be a 1-d int64 tensor, got {d2t.dtype} {tuple(d2t.shape)}")
    if t2d.dtype != torch.bool or t2d.dim() != 1:
        raise ValueError(f"{source}: t2d must be a 1-d bool tensor, got {t2d.dtype} {tuple(t2d.shape)}")
    target_ids = target_ids_of(d2t)
    if not torch.equal(target_ids, t2d.nonzero().flatten()):
        raise ValueError(f"{source}: d2t and t2d disagree (d2t must map draft id i to the i-th kept target id, "
                         "ascending, and t2d must mark exactly those ids)")


def save_vocab(path: str | Path, d2t: torch.Tensor, t2d: torch.Tensor, stats: dict) -> Path:
    """Write `path` (safetensors: d2t, t2d) and its coverage stats beside it as `<stem>.json`; returns the
    stats path."""
    path = Path(path)
    stats_path = path.with_suffix(".json")
    if stats_path == path:
        raise ValueError(f"{path}: the vocabulary file needs another suffix than .json (e.g. .safetensors); "
                         "its stats are written to <name>.json")
    check_vocab(d2t, t2d, str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file({"d2t": d2t.contiguous(), "t2d": t2d.contiguous()}, str(tmp),
              metadata={"format": "pt", "draft_vocab_size": str(d2t.shape[0]), "vocab_size": str(t2d.shape[0])})
    tmp.chmod(0o644)  # safetensors creates files owner-only
    tmp.replace(path)
    stats_path.write_text(json.dumps(stats, indent=2) + "\n")
    return stats_path


def load_vocab(path: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) from a file written by `save_vocab`, checked for consistency."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such vocabulary file")
    try:
        with safe_open(str(path), framework="pt") as f:
            missing = {"d2t", "t2d"} - set(f.keys())
            if missing:
                raise ValueError(f"{path}: missing tensor(s) {sorted(missing)}")
            d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
    except ValueError:
        raise
    except Exception as e:  # safetensors raises its own error types for corrupt files
        raise ValueError(f"{path}: cannot read safetensors ({type(e).__name__}: {e})") from e
    check_vocab(d2t, t2d, str(path))
    return d2t, t2d


# -- CLI ---------------------------------------------------------------------------------------------------------

def training_vocab(vocab_file: str | None, draft_vocab_size: int | None, examples, vocab_size: int,
                   report: bool = True) -> tuple[torch.Tensor | None, int]:
    """(d2t or None, the draft's vocabulary size) for a training run: from `vocab_file`, the whole vocabulary
    (`draft_vocab_size` 0), or the most frequent loss tokens of `examples` (how many: `draft_vocab_size`, or chosen
    by auto_draft_vocab_size when None). `examples`: {"input_ids", "loss_mask"} dicts or a dump's shards."""
    if vocab_file:
        d2t, _ = load_vocab(vocab_file)
        return d2t, d2t.shape[0]
    if draft_vocab_size == 0:
        return None, 0
    if isinstance(examples, list):
        examples = [Example(input_ids=e["input_ids"], loss_mask=e["loss_mask"]) for e in examples]
    else:
        examples = examples.token_examples()  # a dump: its token ids and masks only, not the hidden states
    counts = count_loss_tokens(examples, vocab_size)
    chosen = draft_vocab_size if draft_vocab_size is not None else auto_draft_vocab_size(counts)
    d2t = t2d = None
    if chosen != vocab_size:
        d2t, t2d = select_draft_vocab(counts, chosen)
    if report:
        covered = coverage_stats(counts, t2d)["coverage"] if d2t is not None else 1.0
        how = "auto, " if draft_vocab_size is None else ""
        print(f"draft vocabulary: {chosen} of {vocab_size} ids ({how}{covered:.1%} of the loss tokens)",
              file=sys.stderr)
    return d2t, chosen


def cmd_calibrate_vocab(args: argparse.Namespace) -> int:
    from eyas.config import DeepseekV3Config
    from eyas.engine.llm import load_tokenizer
    from eyas.train.data import load_dataset

    config = DeepseekV3Config.from_json(args.model)
    tokenizer = load_tokenizer(args.model)
    if tokenizer is None:
        raise ValueError(f"{args.model}: no tokenizer (tokenizer.json / tokenizer_config.json)")
    examples = load_dataset(args.data, tokenizer, args.max_length)
    counts = count_loss_tokens(examples, config.vocab_size)
    d2t, t2d = select_draft_vocab(counts, args.draft_vocab_size)
    stats = coverage_stats(counts, t2d)
    stats.update(data=str(args.data), model=str(args.model), num_examples=len(examples), max_length=args.max_length)
    stats_path = save_vocab(args.output, d2t, t2d, stats)
    padded = f", {stats['zero_frequency_ids']} unused ids padded in" if stats["zero_frequency_ids"] else ""
    print(f"draft vocabulary of {stats['draft_vocab_size']} / {stats['vocab_size']} ids covers "
          f"{stats['coverage']:.2%} of {stats['loss_tokens']} loss tokens ({stats['distinct_ids']} distinct ids in "
          f"{len(examples)} examples{padded})")
    print(f"wrote {args.output} and {stats_path}")
    return 0


def add_cli(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """`eyas calibrate-vocab`."""
    p = subparsers.add_parser(
        "calibrate-vocab", help="build a compressed draft vocabulary (d2t/t2d) from training data",
        description="Count the loss-masked (assistant) tokens of a JSONL training file, keep the most frequent "
        "--draft-vocab-size ids (padded with unused ids when the data has fewer) and write d2t/t2d as safetensors, "
        "with coverage stats in <OUT stem>.json.")
    p.add_argument("data", type=Path, metavar="DATA.jsonl", help="conversations (OpenAI messages or ShareGPT) "
                   "or {\"text\": ...} records")
    p.add_argument("--draft-vocab-size", type=int, required=True, help="ids the draft can propose (e.g. 32000)")
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="target checkpoint directory: its tokenizer "
                   "and vocab_size (default: the bundled tiny DeepSeek-V3)")
    p.add_argument("--max-length", type=int, default=2048, help="tokens per example; longer ones are truncated")
    p.add_argument("-o", "--output", type=Path, required=True, metavar="OUT",
                   help="output file, e.g. draft_vocab.safetensors")
    p.set_defaults(func=cmd_calibrate_vocab)
    return p
