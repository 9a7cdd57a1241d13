"""Every eyas command on one argparse parser, a command's YAML recipe read as its defaults, and running one command
line with the errors a user can act on printed as one line. `eyas.cli` adds `eyas pipeline`, which runs the others
through `run`.
"""

from __future__ import annotations

import argparse
import functools
import logging
import re
import sys
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path

from eyas.paths import missing_hint

LIST_ITEM = re.compile(r"(?:[-*]|\d+\.) ")


class HelpFormatter(argparse.HelpFormatter):
    """Descriptions are wrapped to the terminal paragraph by paragraph (a blank line, a list item or an indented line
    starts a new one; indented lines, such as examples, are kept as written); every option's help ends with its
    default."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        out: list[str] = []
        words: list[str] = []
        hang = ""

        def flush() -> None:
            if words:
                out.append(textwrap.fill(" ".join(words), width, initial_indent=indent,
                                         subsequent_indent=indent + hang))
                words.clear()

        for line in text.strip("\n").splitlines():
            if not line.strip() or line.startswith((" ", "\t")):
                flush()
                out.append(indent + line.rstrip() if line.strip() else "")
                continue
            item = LIST_ITEM.match(line)
            if item:
                flush()
                hang = " " * item.end()
            elif not words:
                hang = ""
            words.append(line.strip())
        flush()
        return "\n".join(out)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = (action.help or "").strip()
        if action.nargs == 0 or action.default in (None, argparse.SUPPRESS) or "default" in text.lower():
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"


def _show_every_default(parser: argparse.ArgumentParser) -> None:
    """argparse prints no help line, so no default, for an option without help text: give each one its default."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _show_every_default(sub)
        elif action.help is None and action.default not in (None, False):
            action.help = "default: %(default)s"


def build_parser(extra: Sequence[Callable[[argparse._SubParsersAction], None]] = ()) -> argparse.ArgumentParser:
    """The parser of every command, and of the commands each of `extra` registers."""
    from eyas.bench import add_cli as add_bench
    from eyas.eval.acceptance import add_cli as add_eval
    from eyas.export import add_cli as add_export
    from eyas.generate import add_cli as add_generate
    from eyas.inspect import add_cli as add_inspect
    from eyas.serve.cli import add_cli as add_serve
    from eyas.train.cli import add_cli as add_train
    from eyas.train.dump import add_cli as add_dump_hidden_states
    from eyas.train.import_dumps import add_cli as add_import_hidden_states
    from eyas.train.regenerate import add_cli as add_regenerate
    from eyas.train.vocab import add_cli as add_calibrate_vocab

    parser = argparse.ArgumentParser(
        prog="eyas", formatter_class=HelpFormatter,
        description="EAGLE-3 speculative decoding for DeepSeek-V3-family models. Every command's "
        "default model is the tiny DeepSeek-V3 shipped in examples/, so each runs on a fresh machine.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log loading details")
    sub = parser.add_subparsers(dest="command", required=True,
                                parser_class=functools.partial(argparse.ArgumentParser, formatter_class=HelpFormatter))
    for add in (add_generate, add_regenerate, add_calibrate_vocab, add_dump_hidden_states, add_import_hidden_states,
                add_train, add_eval, add_export, add_inspect, add_serve, add_bench, *extra):
        add(sub)
    _show_every_default(parser)
    return parser


def read_recipe_file(path: Path, expected: str) -> dict:
    """A YAML recipe as a mapping (empty for an empty file); errors name the file and say what was `expected`."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"{path}: cannot read the recipe ({e.strerror})") from e
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML ({e})") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of {expected}, got {type(data).__name__}")
    return data


def settings_from_file(path: Path, parser: argparse.ArgumentParser, command: str) -> dict:
    """The options a YAML recipe sets for `parser` (a command's parser), as argparse destinations."""
    data = read_recipe_file(path, "settings (key: value lines)")
    return settings_from_mapping(data, parser, command, str(path))


def settings_from_mapping(data: dict, parser: argparse.ArgumentParser, command: str, where: str) -> dict:
    """{option: value} (option names with dashes or underscores) checked against `parser`'s options and converted
    as the command line would; an unknown key, or a value of the wrong kind, is an error naming it."""
    actions = {a.dest: a for a in parser._actions if a.option_strings and a.dest not in ("help", "config")}
    settings = {}
    for key, value in data.items():
        action = actions.get(str(key).replace("-", "_"))
        if action is None:
            raise ValueError(f"{where}: unknown setting {key!r} for eyas {command} (known: "
                             f"{', '.join(sorted(actions))})")
        settings[action.dest] = _setting_value(where, key, value, action)
    return settings


def _setting_value(path: str, key: str, value, action: argparse.Action):
    if value is None:
        return None
    if action.nargs == 0:  # a switch: --resume, --fsdp, ...
        if not isinstance(value, bool):
            raise ValueError(f"{path}: {key} is a switch; expected true or false, got {value!r}")
        return value
    many = action.nargs in ("+", "*") or isinstance(action.nargs, int)
    if many != isinstance(value, list) or isinstance(value, dict):
        raise ValueError(f"{path}: {key} expects {'a list' if many else 'one value'}, got {value!r}")
    convert = action.type or str

    def one(v):
        if isinstance(v, (bool, list, dict)) or (convert is int and not isinstance(v, int)):
            raise ValueError(f"{path}: {key} expects {getattr(convert, '__name__', 'a value')} values, got {v!r}")
        try:
            return convert(str(v) if convert is not int else v)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{path}: {key}: {v!r} is not a valid {getattr(convert, '__name__', 'value')}") from e

    converted = [one(v) for v in value] if many else one(value)
    for v in converted if many else [converted]:
        if action.choices is not None and v not in action.choices:
            raise ValueError(f"{path}: {key} is {v!r}; expected one of {', '.join(map(str, action.choices))}")
    return converted


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line, with a command's `--config RECIPE.yaml` read as its defaults (the command line wins)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    if getattr(args, "config", None) is not None:
        commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        command_parser = commands.choices[args.command]
        command_parser.set_defaults(**settings_from_file(args.config, command_parser, args.command))
        args = parser.parse_args(argv)
    return args


def run(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> int:
    """Parse `argv` with `parser` and run its command; returns the exit status (2 for an error printed as one
    line, 130 for Ctrl-C)."""
    from eyas.config import ConfigError
    from eyas.weights import CheckpointError

    command = "eyas"
    try:
        args = parse_args(parser, argv)
        command = f"eyas {args.command}"
        logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="eyas: %(message)s")
        return args.func(args)
    except (CheckpointError, ConfigError, ValueError, OSError) as e:
        print(f"{command}: error: {e}", file=sys.stderr)
        hint = missing_hint(str(e))
        if hint:
            print(f"{command}: {hint}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\n{command}: interrupted", file=sys.stderr)
        return 130
