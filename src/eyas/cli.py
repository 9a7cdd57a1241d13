"""The `eyas` command line."""

from __future__ import annotations

import argparse
import functools
import json
import logging
import sys
import textwrap
from pathlib import Path

from eyas.engine_args import EngineArgs
from eyas.prompts import read_prompt_file


def cmd_generate(args: argparse.Namespace) -> int:
    from eyas.sampling_params import SamplingParams

    if args.prompt_file:
        prompts = read_prompt_file(args.prompt_file)
    else:
        prompts = list(args.prompt) if args.prompt is not None else ["def fibonacci(n):\n"]
        if args.chat:
            prompts = [[{"role": "user", "content": p}] for p in prompts]
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                            seed=args.seed, max_tokens=args.max_new_tokens, stop=args.stop or [],
                            ignore_eos=args.ignore_eos)
    engine = EngineArgs.from_cli_args(args)
    engine.max_num_seqs = min(engine.max_num_seqs, len(prompts))  # no KV cache for slots no prompt fills
    llm = engine.build_llm()
    outputs = llm.generate(prompts, params, use_tqdm=not args.json and len(prompts) > 1)
    for prompt, out in zip(prompts, outputs):
        if args.json:
            record = {"prompt": prompt, "text": out.text, "token_ids": out.token_ids,
                      "num_generated": out.num_generated, "finish_reason": out.finish_reason,
                      "time_to_first_token": round(out.time_to_first_token, 6),
                      "tokens_per_second": round(out.tokens_per_second, 2)}
            if llm.speculative is not None:
                record.update(acceptance_length=round(out.acceptance_length, 4), num_drafted=out.num_drafted,
                              num_accepted=out.num_accepted,
                              accepted_per_position=[round(a, 4) for a in out.accepted_per_position])
            print(json.dumps(record))
        else:
            shown = prompt if isinstance(prompt, str) else prompt[-1].get("content", "").rstrip("\n") + "\n"
            print(f"{shown}\033[1m{out.text}\033[0m" if sys.stdout.isatty() else shown + out.text)
            spec = f", acceptance length {out.acceptance_length:.2f}" if llm.speculative is not None else ""
            print(f"-- {out.num_generated} tokens, {out.tokens_per_second:.1f} tok/s, {out.finish_reason}{spec}",
                  file=sys.stderr)
    if llm.speculative is not None and args.speed_check and len(prompts) <= llm.scheduler.max_num_seqs:
        warn_if_slower_than_plain(llm, prompts, params, outputs)
    return 0


def warn_if_slower_than_plain(llm, prompts: list, params, outputs: list) -> None:
    """Decode the same prompts plain (up to 32 tokens each) and warn when the speculative run decoded slower: a
    weak draft must not pass unnoticed. Decode speed excludes the prefill, so runs of different lengths compare."""
    from dataclasses import replace

    from eyas.eval.acceptance import slower_than_plain_warning

    with llm.plain_decoding():
        plain = llm.generate(prompts, replace(params, max_tokens=min(params.max_tokens, 32)))

    def rate(outs) -> float:
        rates = [o.decode_tokens_per_second for o in outs if o.num_generated > 1]
        return sum(rates) / len(rates) if rates else 0.0

    spec_rate, plain_rate = rate(outputs), rate(plain)
    if spec_rate and plain_rate:
        steps = sum(o.num_verify_steps for o in outputs)
        al = 1 + sum(o.num_accepted for o in outputs) / steps if steps else 1.0
        warning = slower_than_plain_warning(spec_rate / plain_rate, spec_rate, plain_rate, al)
        if warning:
            print(warning, file=sys.stderr)


class HelpFormatter(argparse.HelpFormatter):
    """Descriptions keep their line breaks (long lines are wrapped); every option's help ends with its default."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "\n".join(textwrap.fill(line, width, initial_indent=indent, subsequent_indent=indent)
                         if line.strip() else "" for line in text.strip("\n").splitlines())

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="eyas", formatter_class=HelpFormatter,
        description="EAGLE-3 speculative decoding for DeepSeek-V3-family models. Every command's "
        "default model is the tiny DeepSeek-V3 shipped in examples/, so each runs on a fresh machine.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log loading details")
    sub = parser.add_subparsers(dest="command", required=True,
                                parser_class=functools.partial(argparse.ArgumentParser, formatter_class=HelpFormatter))

    g = sub.add_parser("generate", help="run the target on prompts (batched, paged KV cache)",
                       description="Generate continuations. Prompts come from --prompt (repeatable) or "
                       "--prompt-file (JSONL: {\"prompt\": ...}, {\"messages\": [...]} or {\"turns\": [...]} per "
                       "line, chat rendered by the tokenizer's template). Greedy by default (--temperature 0).")
    EngineArgs.add_cli_args(g, without=("--max-model-len",))
    g.add_argument("--prompt", action="append", help="a text prompt; repeat for a batch")
    g.add_argument("--prompt-file", type=Path, help="JSONL file of prompts")
    g.add_argument("--chat", action="store_true", help="send each --prompt as a user message, rendered with the "
                   "tokenizer's chat template (as a chat endpoint would), instead of as raw text")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    g.add_argument("--top-k", type=int, default=0, help="0 is off")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed", type=int, help="per-request seed: same output whatever else is in the batch")
    g.add_argument("--stop", action="append", help="stop string (repeatable); not included in the text")
    g.add_argument("--ignore-eos", action="store_true", help="keep going past the end-of-sequence token")
    g.add_argument("--json", action="store_true", help="one JSON object per prompt: text, token_ids, "
                   "num_generated, finish_reason, time_to_first_token, tokens_per_second")
    g.add_argument("--no-speed-check", dest="speed_check", action="store_false", help="with a draft, skip the "
                   "short plain-decoding run that warns when speculation was slower than plain decoding")
    g.set_defaults(func=cmd_generate)

    from eyas.bench import add_cli as add_bench
    from eyas.eval.acceptance import add_cli as add_eval
    from eyas.export import add_cli as add_export
    from eyas.inspect import add_cli as add_inspect
    from eyas.pipeline import add_cli as add_pipeline
    from eyas.serve.cli import add_cli as add_serve
    from eyas.train.hidden_states import add_cli as add_dump_hidden_states
    from eyas.train.import_dumps import add_cli as add_import_hidden_states
    from eyas.train.regenerate import add_cli as add_regenerate
    from eyas.train.trainer import add_cli as add_train
    from eyas.train.vocab import add_cli as add_calibrate_vocab

    add_regenerate(sub)
    add_calibrate_vocab(sub)
    add_dump_hidden_states(sub)
    add_import_hidden_states(sub)
    add_train(sub)
    add_eval(sub)
    add_export(sub)
    add_inspect(sub)
    add_serve(sub)
    add_bench(sub)
    add_pipeline(sub)
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with a command's `--config RECIPE.yaml` read as its defaults (the command line wins)."""
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    if getattr(args, "config", None) is not None:
        commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        command_parser = commands.choices[args.command]
        command_parser.set_defaults(**settings_from_file(args.config, command_parser, args.command))
        args = parser.parse_args(argv)
    return args


def main(argv: list[str] | None = None) -> int:
    from eyas.checkpoint import CheckpointError
    from eyas.config import ConfigError

    command = "eyas"
    try:
        args = parse_args(argv)
        command = f"eyas {args.command}"
        logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="eyas: %(message)s")
        return args.func(args)
    except (CheckpointError, ConfigError, ValueError, OSError) as e:
        print(f"{command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\n{command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
