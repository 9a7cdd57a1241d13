"""The shape of the source: no function in src/ longer than a screen (60 lines), so each reads as one idea; the
long ones are split into named steps. Measured with `ast` (decorators and docstring included)."""

from __future__ import annotations

import ast
from pathlib import Path

import eyas

MAX_FUNCTION_LINES = 60


def long_functions(root: Path, limit: int) -> list[tuple[int, str]]:
    """(lines, "path:line name") of every function or method under `root` longer than `limit` lines."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                start = min([node.lineno] + [d.lineno for d in node.decorator_list])
                lines = node.end_lineno - start + 1
                if lines > limit:
                    found.append((lines, f"{path.relative_to(root)}:{start} {node.name}"))
    return sorted(found, reverse=True)


def test_long_functions_finds_a_planted_one(tmp_path):
    body = "".join(f"        x{i} = {i}\n" for i in range(60))
    (tmp_path / "planted.py").write_text(f"def short():\n    pass\n\n\nclass A:\n    @staticmethod\n"
                                         f"    def long():\n{body}")
    assert long_functions(tmp_path, MAX_FUNCTION_LINES) == [(62, "planted.py:6 long")]


def test_no_function_in_src_is_over_60_lines():
    found = long_functions(Path(eyas.__file__).parent, MAX_FUNCTION_LINES)
    assert not found, f"functions over {MAX_FUNCTION_LINES} lines (split them into named steps): " + "; ".join(
        f"{where} ({lines} lines)" for lines, where in found)
