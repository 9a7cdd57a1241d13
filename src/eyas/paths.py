"""Where the bundled examples lie: the tiny DeepSeek-V3 every command defaults to, its trained EAGLE-3 draft, a
first draft's training data and the held-out prompts.

A source checkout (or an editable install of one) has them in examples/ beside src/; a wheel carries a copy of
them as eyas/examples/ (package data, pyproject.toml). An installation that has neither still imports: the
defaults then name paths that do not exist, and `missing_hint` says to pass the model (and the rest) explicitly.
"""

from __future__ import annotations

import os
from pathlib import Path

_HERE = Path(__file__).resolve().parent
# the wheel's copy first: a checkout's examples/ two levels up cannot be mistaken for it
CANDIDATES = (_HERE / "examples", _HERE.parents[1] / "examples")


def examples_dir() -> Path:
    """The first candidate that holds the tiny model; the wheel's (missing) location when none does."""
    for candidate in CANDIDATES:
        if (candidate / "tiny-deepseek-v3" / "config.json").is_file():
            return candidate
    return CANDIDATES[0]


EXAMPLES = examples_dir()
DEFAULT_MODEL = EXAMPLES / "tiny-deepseek-v3"
DEFAULT_DRAFT = EXAMPLES / "tiny-deepseek-v3-eagle3-mla"  # its trained EAGLE-3 MLA draft
DEFAULT_DATA = EXAMPLES / "data" / "conversations.jsonl"  # a first draft's training data, for it
DEFAULT_EVAL_PROMPTS = EXAMPLES / "prompts" / "eval.jsonl"  # held-out prompts, for it
# each with what replaces it on the command line
BUNDLED = {DEFAULT_MODEL: "a target checkpoint (--model DIR; --target DIR for train, export and quantize-draft)",
           DEFAULT_DRAFT: "a draft (--draft-model DIR)", DEFAULT_DATA: "training data (--data FILE)",
           DEFAULT_EVAL_PROMPTS: "a prompts file"}


def missing_hint(message: str) -> str | None:
    """What to do when an error `message` names a bundled example this installation does not have; else None."""
    missing = [(path, what) for path, what in BUNDLED.items() if str(path) in message and not path.exists()]
    if not missing:
        return None
    wanted = ", ".join(dict.fromkeys(what for _, what in missing))
    return (f"the bundled examples are not installed with this eyas (looked in {', '.join(map(str, CANDIDATES))}); "
            f"give {wanted}")


def compiled_dir() -> Path:
    """Where the kernels eyas compiles on this machine are kept: $EYAS_CACHE_DIR/compiled, else
    ~/.cache/eyas/compiled."""
    root = os.environ.get("EYAS_CACHE_DIR") or Path.home() / ".cache" / "eyas"
    return Path(root) / "compiled"
