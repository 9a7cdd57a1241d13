"""The `eyas` command line: every command of eyas.commands, and `eyas pipeline`, which runs them."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from eyas import commands
from eyas.pipeline import add_cli as add_pipeline


def build_parser() -> argparse.ArgumentParser:
    return commands.build_parser(extra=(add_pipeline,))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line, with a command's `--config RECIPE.yaml` read as its defaults (the command line wins)."""
    return commands.parse_args(build_parser(), argv)


def main(argv: Sequence[str] | None = None) -> int:
    return commands.run(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
