"""Data stage for training a tiny DeepSeek-V3 language model on Python source.

Builds, from the running Python's standard library and the Python sources of the packages eyas installs (its
requirements, followed transitively through the installed distributions' metadata):

  * a byte-level BPE tokenizer with DeepSeek-V3 special tokens and chat template
    (``tokenizer.json`` + ``tokenizer_config.json`` in the model dir),
  * function-completion conversations (``conversations_{train,heldout}.jsonl``),
  * flat uint16 token arrays for pretraining (``train.bin``, ``val.bin``) and for
    chat fine-tuning with a loss mask (``chat_{train,val}.bin`` + ``*_mask.bin``),
  * flat token arrays of the package sources (``packages_train.bin``, ``packages_val.bin``),
  * ``meta.json`` with counts, the package versions and the held-out file lists.

Files are held out by name (a hash of the path), so a rebuild on another machine holds out the same ones. Package
files that repeat a held-out standard-library file (setuptools' copy of distutils, for example) are dropped, so
the standard-library held-out loss stays a held-out loss.

Every stage is skipped when its outputs already exist (use ``--force`` to rebuild);
a rebuilt stage forces the stages that depend on it.

Run from the repository root:  python scripts/tiny_target/build_data.py
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import json
import os
import re
import sys
import sysconfig
import time
import warnings
import zlib
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL_DIR = REPO_ROOT / "examples" / "tiny-deepseek-v3"
DEFAULT_WORK_DIR = REPO_ROOT / "work" / "tiny_target"

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
PAD = "<｜▁pad▁｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
# Order matters: the trainer assigns ids 0.. in this order, so bos=0, eos=1, pad=2.
SPECIAL_TOKENS = [BOS, EOS, PAD, USER, ASSISTANT, "<think>", "</think>"]

# DeepSeek-V3 layout: bos, system text as-is, then <｜User｜>q / <｜Assistant｜>a<｜end▁of▁sentence｜> turns.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}"
    "{% elif message['role'] == 'user' %}{{ '" + USER + "' + message['content'] }}"
    "{% elif message['role'] == 'assistant' %}{{ '" + ASSISTANT + "' + message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('unknown role: ' + message['role']) }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '" + ASSISTANT + "' }}{% endif %}"
)

# lib2to3's test data lives under lib2to3/tests/, so "tests" covers it.
EXCLUDED_DIRS = {"test", "tests", "idlelib", "site-packages", "__pycache__"}
HELDOUT_MODULUS = 20
# Per distribution, so torch and transformers (50 MB each) do not drown the rest; files are taken in hash order.
PACKAGE_BYTES_CAP = 4_000_000
# A package file sharing this share of its 8-line windows with a held-out standard-library file counts as a copy.
COPY_SHARE = 0.2

INSTRUCTIONS = [
    "Complete this Python function:\n\n",
    "Write the body of this Python function:\n\n",
    "Implement the following Python function:\n\n",
    "Finish the implementation of this function:\n\n",
]
MIN_BODY_LINES = 2
MAX_BODY_LINES = 60

PRETRAIN_BINS = {"train": "train.bin", "heldout": "val.bin"}
PACKAGE_BINS = {"train": "packages_train.bin", "heldout": "packages_val.bin"}
CHAT_BINS = {"train": ("chat_train.bin", "chat_train_mask.bin"), "heldout": ("chat_val.bin", "chat_val_mask.bin")}
SPLITS = ("train", "heldout")


def log(msg: str) -> None:
    print(msg, flush=True)


def write_atomic(path: Path, data: bytes) -> None:
    # Write-then-rename so an interrupted run never leaves a file that a rerun would take as finished.
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def is_heldout(rel_path: str) -> bool:
    return zlib.crc32(rel_path.encode()) % HELDOUT_MODULUS == 0


# ---------------------------------------------------------------- 1. corpus


def collect_corpus(stdlib: Path) -> tuple[dict[str, dict[str, str]], int]:
    """Return {split: {relative_path: text}} (paths sorted) and the number of undecodable files."""
    corpus: dict[str, dict[str, str]] = {split: {} for split in SPLITS}
    undecodable = 0
    paths = sorted(p.relative_to(stdlib).as_posix() for p in stdlib.rglob("*.py"))
    for rel in paths:
        if EXCLUDED_DIRS.intersection(rel.split("/")[:-1]):
            continue
        try:
            # Decode the raw bytes (no newline translation) so the text is exactly the file.
            text = (stdlib / rel).read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            undecodable += 1
            continue
        corpus["heldout" if is_heldout(rel) else "train"][rel] = text
    return corpus, undecodable


def requirement_closure(root: str = "eyas") -> list[importlib.metadata.Distribution]:
    """The installed distributions `root` needs without extras, followed through their own requirements."""
    from packaging.requirements import Requirement

    found: dict[str, importlib.metadata.Distribution] = {}
    todo = [root]
    while todo:
        name = re.sub(r"[-_.]+", "-", todo.pop()).lower()
        if name in found:
            continue
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue  # an optional platform requirement that is not installed here
        found[name] = dist
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return [found[name] for name in sorted(found) if name != root]


def windows(text: str, size: int = 8) -> set[int]:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return {zlib.crc32("\n".join(lines[i:i + size]).encode()) for i in range(max(0, len(lines) - size + 1))}


def collect_packages(heldout_stdlib: dict[str, str]) -> tuple[dict[str, dict[str, str]], dict[str, str], int]:
    """{split: {"dist/relative_path": text}}, {dist: version}, and the number of files dropped as copies."""
    corpus: dict[str, dict[str, str]] = {split: {} for split in SPLITS}
    protected = set().union(*(windows(t) for t in heldout_stdlib.values()))
    seen: set[int] = set()
    versions: dict[str, str] = {}
    copies = 0
    for dist in requirement_closure():
        name = dist.metadata["Name"]
        versions[name] = dist.version
        files = sorted((f for f in dist.files or [] if f.suffix == ".py"
                        and not EXCLUDED_DIRS.intersection(f.parts[:-1])),
                       key=lambda f: zlib.crc32(f"{name}/{f.as_posix()}".encode()))
        taken = 0
        for f in files:
            try:
                text = Path(dist.locate_file(f)).read_bytes().decode("utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            digest = zlib.crc32(text.encode())
            if not text.strip() or digest in seen:
                continue  # empty __init__.py files and exact duplicates (vendored copies)
            own = windows(text)
            if own and len(own & protected) >= COPY_SHARE * len(own):
                copies += 1
                continue
            seen.add(digest)
            rel = f"{name}/{f.as_posix()}"
            corpus["heldout" if is_heldout(rel) else "train"][rel] = text
            taken += len(text.encode())
            if taken >= PACKAGE_BYTES_CAP:
                break
    return corpus, versions, copies


def n_bytes(texts: dict[str, str]) -> int:
    return sum(len(t.encode()) for t in texts.values())


# ---------------------------------------------------------------- 2. tokenizer


def train_tokenizer(train_texts: list[str], vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,  # counts the special tokens and the 256-byte alphabet too
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(train_texts, trainer, length=len(train_texts))
    # transformers 5 ignores add_bos_token for a plain fast tokenizer, so BOS comes from the post-processor.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 0)]
    )
    for i, tok in enumerate(SPECIAL_TOKENS):
        assert tokenizer.token_to_id(tok) == i, (tok, tokenizer.token_to_id(tok))
    assert tokenizer.get_vocab_size() == vocab_size, tokenizer.get_vocab_size()
    return tokenizer


def tokenizer_config() -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "model_max_length": 2048,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def check_tokenizer(model_dir: Path, raw: Tokenizer, heldout: dict[str, str]) -> int:
    """Load through transformers the way users will, check BOS and chat template; return round-trip mismatches."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    assert tok("x").input_ids[0] == 0, tok("x").input_ids
    assert tok("x", add_special_tokens=False).input_ids[0] != 0
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2)
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1"},
        {"role": "user", "content": "Q2"},
    ]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected = f"{BOS}S{USER}Q1{ASSISTANT}A1{EOS}{USER}Q2{ASSISTANT}"
    assert rendered == expected, rendered

    mismatches = 0
    texts = list(heldout.values())
    for text, enc in zip(texts, raw.encode_batch(texts, add_special_tokens=False), strict=True):
        if raw.decode(enc.ids, skip_special_tokens=False) != text or tok.decode(enc.ids) != text:
            mismatches += 1
    return mismatches


# ---------------------------------------------------------------- 3. conversations


def split_lines(text: str) -> list[str]:
    # Match ast's line numbering (\n, \r\n, \r) rather than str.splitlines, which also splits on \f, \v, etc.
    lines: list[str] = []
    start = 0
    i = 0
    while i < len(text):
        c = text[i]
        if c == "\n" or c == "\r":
            if c == "\r" and i + 1 < len(text) and text[i + 1] == "\n":
                i += 1
            lines.append(text[start : i + 1])
            start = i + 1
        i += 1
    if start < len(text):
        lines.append(text[start:])
    return lines


def candidate_functions(tree: ast.Module) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    """Top-level functions and methods (of classes at any nesting depth), but not functions inside functions."""
    found: list[ast.FunctionDef | ast.AsyncFunctionDef] = []
    stack: list[ast.AST] = [tree]
    while stack:
        for child in getattr(stack.pop(), "body", []):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.append(child)
            elif isinstance(child, ast.ClassDef):
                stack.append(child)
    return sorted(found, key=lambda f: f.lineno)


def function_conversation(rel: str, lines: list[str], fn: ast.FunctionDef | ast.AsyncFunctionDef) -> dict | None:
    body = fn.body
    if len(body) < 2 or not isinstance(body[0], ast.Expr):
        return None
    doc = body[0]
    if not (isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str)):
        return None
    # The docstring must occupy its own lines so that signature / docstring / body split cleanly on lines.
    # ast column offsets are UTF-8 byte offsets.
    first = lines[doc.lineno - 1].encode()
    last = lines[doc.end_lineno - 1].encode()
    if first[: doc.col_offset].strip() or last[doc.end_col_offset :].strip():
        return None
    if body[1].lineno <= doc.end_lineno:
        return None
    n_body = fn.end_lineno - doc.end_lineno
    if not MIN_BODY_LINES <= n_body <= MAX_BODY_LINES:
        return None

    start = min([fn.lineno] + [d.lineno for d in fn.decorator_list])
    prompt = "".join(lines[start - 1 : doc.end_lineno])
    completion = "".join(lines[doc.end_lineno : fn.end_lineno])
    instruction = INSTRUCTIONS[zlib.crc32(f"{rel}:{fn.lineno}".encode()) % len(INSTRUCTIONS)]
    return {
        "messages": [
            {"role": "user", "content": instruction + prompt},
            {"role": "assistant", "content": completion},
        ]
    }


def build_conversations(texts: dict[str, str]) -> tuple[list[dict], int]:
    conversations: list[dict] = []
    unparsable = 0
    for rel, text in texts.items():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # invalid-escape SyntaxWarnings in old stdlib code
                tree = ast.parse(text)
        except SyntaxError:
            unparsable += 1
            continue
        lines = split_lines(text)
        for fn in candidate_functions(tree):
            conv = function_conversation(rel, lines, fn)
            if conv is not None:
                conversations.append(conv)
    return conversations, unparsable


def write_jsonl(path: Path, rows: list[dict]) -> None:
    write_atomic(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode())


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


# ---------------------------------------------------------------- 4. token arrays


def pretrain_tokens(raw: Tokenizer, texts: list[str]) -> np.ndarray:
    bos, eos = raw.token_to_id(BOS), raw.token_to_id(EOS)
    encodings = raw.encode_batch(texts, add_special_tokens=False)
    pieces = [np.array([bos, *enc.ids, eos], dtype=np.uint16) for enc in encodings]
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.uint16)


def chat_tokens(tok: Any, raw: Tokenizer, conversations: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """Tokens of each rendered conversation, and a mask that is 1 exactly on assistant content + its closing eos.

    The mask comes from rendering prefixes: tokens of "everything before the assistant content" (history plus
    the generation prompt) and of "everything through the assistant's eos". Special tokens are atomic in the
    tokenizer, so these prefixes tokenize to prefixes of the full conversation, which is asserted below.
    """
    full_texts: list[str] = []
    spans: list[list[tuple[str, str, str]]] = []  # per conversation: (before, through, content) per assistant turn
    for conv in conversations:
        msgs = conv["messages"]
        full_texts.append(tok.apply_chat_template(msgs, tokenize=False))
        turns = []
        for i, m in enumerate(msgs):
            if m["role"] == "assistant":
                before = tok.apply_chat_template(msgs[:i], tokenize=False, add_generation_prompt=True)
                through = tok.apply_chat_template(msgs[: i + 1], tokenize=False)
                turns.append((before, through, m["content"]))
        spans.append(turns)

    flat = [s for turns in spans for before, through, _ in turns for s in (before, through)]
    full_enc = raw.encode_batch(full_texts, add_special_tokens=False)
    prefix_enc = iter(raw.encode_batch(flat, add_special_tokens=False))

    ids_parts: list[np.ndarray] = []
    mask_parts: list[np.ndarray] = []
    for full_text, enc, turns in zip(full_texts, full_enc, spans, strict=True):
        ids = np.array(enc.ids, dtype=np.uint16)
        mask = np.zeros(len(ids), dtype=np.uint8)
        for before, through, content in turns:
            lo_ids, hi_ids = next(prefix_enc).ids, next(prefix_enc).ids
            assert full_text.startswith(before) and full_text.startswith(through)
            assert enc.ids[: len(hi_ids)] == hi_ids and hi_ids[: len(lo_ids)] == lo_ids
            mask[len(lo_ids) : len(hi_ids)] = 1
            # Cheap enough to check every turn, not just a sample.
            assert raw.decode(enc.ids[len(lo_ids) : len(hi_ids)], skip_special_tokens=False) == content + EOS
        ids_parts.append(ids)
        mask_parts.append(mask)
    if not ids_parts:
        return np.zeros(0, dtype=np.uint16), np.zeros(0, dtype=np.uint8)
    return np.concatenate(ids_parts), np.concatenate(mask_parts)


# ---------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR, help="where tokenizer files go")
    parser.add_argument("--work-dir", type=Path, default=DEFAULT_WORK_DIR, help="where data files go")
    parser.add_argument("--vocab-size", type=int, default=8192, help="total vocab size, special tokens included")
    parser.add_argument("--force", action="store_true", help="rebuild every stage even if its outputs exist")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # transformers is imported lazily below; loading a tokenizer from a local directory must never reach the Hub.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model_dir: Path = args.model_dir
    work_dir: Path = args.work_dir
    model_dir.mkdir(parents=True, exist_ok=True)
    work_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()

    # 1. Corpus: cheap to re-read, so never cached.
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    corpus, undecodable = collect_corpus(stdlib)
    log(f"[corpus] {stdlib} (Python {sys.version.split()[0]})")
    for split in SPLITS:
        log(f"[corpus] {split:8s} {len(corpus[split]):5d} files {n_bytes(corpus[split]):>11,d} bytes")
    log(f"[corpus] skipped {undecodable} files that are not valid UTF-8")
    packages, versions, copies = collect_packages(corpus["heldout"])
    log(f"[corpus] packages: {len(versions)} distributions; dropped {copies} files that copy held-out stdlib files")
    for split in SPLITS:
        log(f"[corpus] {split:8s} {len(packages[split]):5d} files {n_bytes(packages[split]):>11,d} bytes (packages)")
    with_specials = [rel for s in SPLITS for rel, t in corpus[s].items() if any(sp in t for sp in SPECIAL_TOKENS)]
    if with_specials:
        log(f"[corpus] warning: special-token strings appear in {with_specials}; they will encode as special tokens")

    # 2. Tokenizer.
    tok_json, tok_cfg = model_dir / "tokenizer.json", model_dir / "tokenizer_config.json"
    rebuilt_tokenizer = args.force or not (tok_json.exists() and tok_cfg.exists())
    t0 = time.perf_counter()
    if rebuilt_tokenizer:
        raw = train_tokenizer(list(corpus["train"].values()), args.vocab_size)
        write_atomic(tok_json, raw.to_str(pretty=True).encode())
        write_atomic(tok_cfg, (json.dumps(tokenizer_config(), indent=2, ensure_ascii=False) + "\n").encode())
        log(f"[tokenizer] trained vocab {raw.get_vocab_size()} in {time.perf_counter() - t0:.1f}s -> {model_dir}")
    else:
        raw = Tokenizer.from_file(str(tok_json))
        log(f"[tokenizer] exists, skipped ({tok_json})")
    mismatches = check_tokenizer(model_dir, raw, corpus["heldout"])
    log(f"[tokenizer] AutoTokenizer ok (bos prepended, chat template); round-trip mismatches on held-out: {mismatches}")

    # 3. Conversations.
    # conversations_{split}.jsonl stay standard-library only: the draft scripts select from them by position
    conv_paths = {(source, s): work_dir / f"conversations_{prefix}{s}.jsonl"
                  for source, prefix in (("stdlib", ""), ("packages", "packages_")) for s in SPLITS}
    rebuilt_convs = args.force or not all(p.exists() for p in conv_paths.values())
    conversations: dict[tuple[str, str], list[dict]] = {}
    for (source, split), path in conv_paths.items():
        if rebuilt_convs:
            conversations[source, split], unparsable = build_conversations(
                (corpus if source == "stdlib" else packages)[split])
            write_jsonl(path, conversations[source, split])
            note = f"{unparsable} files failed to parse"
        else:
            conversations[source, split], note = read_jsonl(path), "exists, loaded"
        log(f"[conversations] {source:8s} {split:8s} {len(conversations[source, split]):6d} ({note})")

    # 4. Token arrays; meta.json is written last, so its presence marks the stage complete.
    meta_path = work_dir / "meta.json"
    array_paths = [work_dir / n for bins in (PRETRAIN_BINS, PACKAGE_BINS) for n in bins.values()] \
        + [work_dir / n for p in CHAT_BINS.values() for n in p]
    if rebuilt_tokenizer or rebuilt_convs or not all(p.exists() for p in [meta_path, *array_paths]):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_dir)
        meta: dict[str, Any] = {
            "python_version": sys.version.split()[0],
            "stdlib": str(stdlib),
            "vocab_size": raw.get_vocab_size(),
            "special_tokens": SPECIAL_TOKENS,
            "dtype": "uint16",
            "undecodable_files": undecodable,
            "roundtrip_mismatches_heldout": mismatches,
            "packages": versions,
            "package_copies_dropped": copies,
            "splits": {},
            "package_splits": {},
            "chat": {},
        }
        for split in SPLITS:
            sources = ((corpus, PRETRAIN_BINS, "splits"), (packages, PACKAGE_BINS, "package_splits"))
            for texts_by_path, bins, key in sources:
                texts = list(texts_by_path[split].values())
                ids = pretrain_tokens(raw, texts)
                write_atomic(work_dir / bins[split], ids.tobytes())
                nb = n_bytes(texts_by_path[split])
                text_tokens = len(ids) - 2 * len(texts)  # without the bos/eos added per file
                meta[key][split] = {
                    "file": bins[split],
                    "files": len(texts),
                    "bytes": nb,
                    "tokens": len(ids),
                    "text_tokens": int(text_tokens),
                    "bytes_per_token": round(nb / max(text_tokens, 1), 4),
                }
            chat_ids, chat_mask = chat_tokens(
                tok, raw, conversations["stdlib", split] + conversations["packages", split])
            ids_name, mask_name = CHAT_BINS[split]
            write_atomic(work_dir / ids_name, chat_ids.tobytes())
            write_atomic(work_dir / mask_name, chat_mask.tobytes())
            meta["chat"][split] = {
                "files": [ids_name, mask_name],
                "conversations": len(conversations["stdlib", split]) + len(conversations["packages", split]),
                "tokens": len(chat_ids),
                "masked_tokens": int(chat_mask.sum()),
            }
        meta["heldout_files"] = list(corpus["heldout"])
        meta["package_heldout_files"] = list(packages["heldout"])
        write_atomic(meta_path, (json.dumps(meta, indent=2, ensure_ascii=False) + "\n").encode())
        log(f"[arrays] written to {work_dir}")
    else:
        meta = json.loads(meta_path.read_text())
        log(f"[arrays] exist, skipped ({meta_path})")

    # 5. Summary.
    log("")
    log("split      files        bytes      tokens  bytes/tok  convs  chat_tokens  masked")
    for split in SPLITS:
        s, p, c = meta["splits"][split], meta["package_splits"][split], meta["chat"][split]
        log(
            f"{split:8s} {s['files']:7d} {s['bytes']:12,d} {s['tokens']:11,d} {s['bytes_per_token']:10.3f}"
            f" {c['conversations']:6d} {c['tokens']:12,d} {c['masked_tokens']:7,d}"
        )
        log(f"{'+ pkgs':8s} {p['files']:7d} {p['bytes']:12,d} {p['tokens']:11,d} {p['bytes_per_token']:10.3f}")
    log(f"done in {time.perf_counter() - t_start:.1f}s")


if __name__ == "__main__":
    main()
