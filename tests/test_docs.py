"""The docs' command lines parse with eyas's own parser, and the paths and links the docs name exist.

Documents: README.md and docs/*.md.

Command lines are taken from fenced code blocks tagged bash, sh, shell or console or not tagged at all, and from
inline code spans that start with `eyas `:
- a line ending in `\\` is joined with the next; shlex (posix) splits it, dropping a trailing `# comment`; `$'...'`
  is read as `'...'`;
- the line is cut into commands at `|`, `||`, `&&`, `;` and `&`; a command stops at a redirection (`>`, `>>`, `<`,
  `2>`);
- a command whose first word (after any `NAME=value` words) is `eyas`, or one holding `-m eyas.cli`, gives the
  words after that as argv;
- a command is skipped when an argument holds a placeholder: an ALL-CAPS word (`DIR`, `RECIPE.yaml`,
  `http://HOST:8000`, `N`), `...`, `<...>`, or an optional part written `[--flag ...]`;
- an inline span that only names a command (`eyas export`, `eyas bench serve`) must name one; every other command
  is given to `parse_args(argv)` of `eyas.cli.build_parser()`, the parser the `eyas` entry point builds
  (`pipeline` included), with abbreviations off in it and every subparser: `--max-step` would otherwise pass as
  `--max-steps`, and a flag renamed to a longer name would still accept its old one;
- that only parses: nothing runs, and `--config FILE` is read by `commands.parse_args`, not by `parse_args`; eyas's
  argparse `type=` converters (int, float, Path, `serve.limits.api_key`, bench's `_positive_int`) read no file;
- `--help` (exit 0) passes; any other SystemExit fails, naming the file, the line and argparse's message.

Repository paths: every word of a fenced block, and every inline code span, that starts with `examples/`,
`scripts/`, `benchmarks/`, `src/`, `tests/` or `docs/` must exist under the repository root (`{a,b}` expanded, a
`*` glob matching something). Outputs (`runs/`, `work/`, `/tmp/...`) and words holding a placeholder are not
checked.

Links: every relative `[text](target)` outside code must point at an existing file or directory, and a `#anchor`
on a Markdown file (or alone, for the same file) at one of its headings, slugged as GitHub slugs them.
"""

import argparse
import contextlib
import io
import itertools
import re
import shlex
from pathlib import Path

import pytest

from eyas.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_TAGS = {"", "bash", "sh", "shell", "console"}
OPERATORS = {"|", "||", "&&", ";", "&", ";;"}
REDIRECTIONS = {">", ">>", "<", ">&", "&>"}
REPO_DIRS = ("examples/", "scripts/", "benchmarks/", "src/", "tests/", "docs/")
REPO_PATH = re.compile(r"(?<![\w./~-])(?:" + "|".join(map(re.escape, REPO_DIRS)) + r")[\w./{},*-]*")
PLACEHOLDER_WORD = re.compile(r"^[A-Z][A-Z0-9_]*$")
FENCE = re.compile(r"^\s*(```+|~~~+)\s*([\w+-]*)")
INLINE_CODE = re.compile(r"(`+)(.+?)\1")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def doc_lines(path: Path):
    """(line number, text, fence tag or None outside a fence) per line; fence lines themselves are left out."""
    fence = None
    for number, text in enumerate(path.read_text().splitlines(), 1):
        m = FENCE.match(text)
        if m and (fence is None or m.group(1)[0] == fence[0][0] and not m.group(2)):
            fence = (m.group(1), m.group(2).lower()) if fence is None else None
            continue
        yield number, text, None if fence is None else fence[1]


def logical_lines(path: Path):
    """(line number, text, inline) of each shell line in a fenced block, `\\`-continued lines joined, and of each
    inline code span outside fences that starts with `eyas `."""
    pending, start = "", 0
    for number, text, tag in doc_lines(path):
        if tag is None or tag not in SHELL_TAGS:
            if pending:
                yield start, pending, False
                pending = ""
            if tag is None:
                for span in INLINE_CODE.finditer(text):
                    if span.group(2).strip().startswith("eyas "):
                        yield number, span.group(2).strip(), True
            continue
        if not pending:
            start = number
        if text.rstrip().endswith("\\"):
            pending += text.rstrip()[:-1] + " "
            continue
        yield start, pending + text, False
        pending = ""
    if pending:
        yield start, pending, False


def commands(line: str) -> list[list[str]]:
    """The argv of every eyas command on a shell line (see the module docstring)."""
    if not re.search(r"(^|[\s;&|(])eyas(\s|$)|-m\s+eyas\.cli", line):
        return []
    line = re.sub(r"(?<=\s)\d+(?=>)", "", line.replace("$'", "'"))  # `2> err` is a redirection, not an argument 2
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    found, words = [], []
    for word in [*lexer, ";"]:
        if word not in OPERATORS:
            words.append(word)
            continue
        cut = next((i for i, w in enumerate(words) if w in REDIRECTIONS), len(words))
        words = words[:cut]
        while words and re.match(r"^\w+=", words[0]):
            words = words[1:]
        if words[:1] == ["eyas"]:
            found.append(words[1:])
        elif "eyas.cli" in words and words[words.index("eyas.cli") - 1] == "-m":
            found.append(words[words.index("eyas.cli") + 1:])
        words = []
    return found


def has_placeholder(word: str) -> bool:
    if "..." in word or re.search(r"<[^>]*>", word) or word.startswith("[-"):
        return True
    return any(PLACEHOLDER_WORD.match(w) for w in re.split(r"[^A-Za-z0-9_-]+", word) if w)


def docs_parser() -> argparse.ArgumentParser:
    """The `eyas` parser, taking only whole option names."""
    parsers = [build_parser()]
    for parser in parsers:
        parser.allow_abbrev = False
        parsers += [sub for a in parser._actions if isinstance(a, argparse._SubParsersAction)
                    for sub in a.choices.values()]
    return parsers[0]


def names_a_command(parser: argparse.ArgumentParser, argv: list[str]) -> bool:
    """Whether argv is only command names: `export`, `bench serve`."""
    for word in argv:
        sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        if sub is None or word not in sub.choices:
            return False
        parser = sub.choices[word]
    return bool(argv)


def parse_error(parser: argparse.ArgumentParser, argv: list[str]) -> str | None:
    """argparse's message when argv does not parse, else None."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            parser.parse_args(argv)
        except SystemExit as e:
            if e.code not in (0, None):
                return err.getvalue().strip().splitlines()[-1]
    return None


def slug(heading: str) -> str:
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    for _, text, tag in doc_lines(path):
        m = HEADING.match(text) if tag is None else None
        if m:
            base = slug(m.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
    return {base if i == 0 else f"{base}-{i}" for base, n in seen.items() for i in range(n)}


def expand(word: str) -> list[str]:
    """`a{b,c}d` -> [abd, acd] (one level of braces per pair, as the docs write them)."""
    parts = re.split(r"\{([^{}]*)\}", word)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def test_every_command_line_parses():
    parser = docs_parser()
    failures, parsed = [], 0
    for doc in DOCS:
        for number, line, inline in logical_lines(doc):
            where = f"{doc.relative_to(ROOT)}:{number}"
            try:
                argvs = commands(line)
            except ValueError as e:  # shlex: an unclosed quote
                failures.append(f"{where}: cannot split {line!r}: {e}")
                continue
            for argv in argvs:
                if any(has_placeholder(w) for w in argv):
                    continue
                if inline and names_a_command(parser, argv):
                    continue
                error = parse_error(parser, argv)
                if error:
                    failures.append(f"{where}: eyas {shlex.join(argv)}\n    {error}")
                parsed += 1
    assert not failures, "documented command lines that eyas does not parse:\n" + "\n".join(failures)
    assert parsed > 30, f"only {parsed} command lines found: has the extraction broken?"


def test_every_repository_path_exists():
    missing = []
    for doc in DOCS:
        for number, text, tag in doc_lines(doc):
            spans = [text] if tag is not None else [m.group(2) for m in INLINE_CODE.finditer(text)]
            for span in spans:
                for word in REPO_PATH.findall(span):
                    word = word.rstrip(".,:;")
                    if has_placeholder(word):
                        continue
                    for path in expand(word):
                        exists = any(ROOT.glob(path)) if "*" in path else (ROOT / path).exists()
                        if not exists:
                            missing.append(f"{doc.relative_to(ROOT)}:{number}: {path}")
    assert not missing, "paths the docs name that are not in the repository:\n" + "\n".join(missing)


def test_every_relative_link_resolves():
    broken = []
    for doc in DOCS:
        for number, text, tag in doc_lines(doc):
            if tag is not None:
                continue
            prose = INLINE_CODE.sub("", text)
            for target in LINK.findall(prose):
                if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                    continue
                file, _, anchor = target.partition("#")
                path = (doc.parent / file).resolve() if file else doc
                if not path.exists():
                    broken.append(f"{doc.relative_to(ROOT)}:{number}: {target} (no such file)")
                elif anchor and path.suffix == ".md" and anchor not in anchors(path):
                    broken.append(f"{doc.relative_to(ROOT)}:{number}: {target} (no such heading in {path.name})")
    assert not broken, "links in the docs that point nowhere:\n" + "\n".join(broken)


def test_no_code_span_breaks_across_lines():
    """A span split over two lines renders as one, but the checks above read line by line and would miss it."""
    split = [f"{doc.relative_to(ROOT)}:{number}" for doc in DOCS for number, text, tag in doc_lines(doc)
             if tag is None and INLINE_CODE.sub("", text).count("`") % 2]
    assert not split, f"inline code spans broken across lines (join them onto one line): {split}"


def test_the_readme_links_every_docs_page():
    readme = (ROOT / "README.md").read_text()
    unlinked = [p.name for p in DOCS[1:] if f"](docs/{p.name})" not in readme]
    assert not unlinked, f"docs pages README.md does not link: {unlinked}"


@pytest.mark.parametrize(("line", "expected"), [
    ("eyas train --out runs/x  # a comment", [["train", "--out", "runs/x"]]),
    ("pip install -e . && eyas generate --prompt $'a\\nb' | head > out.txt", [["generate", "--prompt", "a\\nb"]]),
    ("OMP_NUM_THREADS=1 eyas eval p.jsonl 2> err.txt; eyas serve", [["eval", "p.jsonl"], ["serve"]]),
    ("torchrun --standalone --nproc_per_node 2 -m eyas.cli train --fsdp", [["train", "--fsdp"]]),
    ("python scripts/x.py --eyas 1", []),
])
def test_commands_are_cut_as_the_docstring_says(line, expected):
    assert commands(line) == expected


def test_a_renamed_flag_fails():
    parser = docs_parser()
    assert parse_error(parser, ["train", "--max-steps", "10"]) is None
    assert "unrecognized arguments: --max-step 10" in parse_error(parser, ["train", "--max-step", "10"])
    assert has_placeholder("RECIPE.yaml") and has_placeholder("http://HOST:8000") and not has_placeholder("DeepSeek-V3")
