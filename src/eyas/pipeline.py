"""`eyas pipeline RECIPE.yaml`: a draft from a conversations file in one command, each stage resumable.

Stages, in order, each the eyas command of its name run with the settings of its section (omit a section to skip
the stage; train is always run):

  regenerate          the conversations' assistant turns rewritten by the target
                        -> WORK/regenerated.jsonl
  (training data)     that, or `data` as it is, plus the `extra_data` files
                        -> WORK/train_data.jsonl
  calibrate_vocab     a compressed draft vocabulary from the training data
                        -> WORK/vocab.safetensors
  dump_hidden_states  the target's aux hidden states (else training runs online)
                        -> WORK/hidden_states/
  train               the draft (always with --resume)  -> WORK/NAME/draft
  eval                its acceptance length on held-out prompts
                        -> WORK/NAME/eval.json (+ .png)
  export              the draft in other engines' layouts (`format(s)`)
                        -> WORK/NAME/export-FORMAT/

A recipe:

  target: examples/tiny-deepseek-v3   # default: the bundled tiny target
  work_dir: runs/tiny                 # where every stage writes
  name: mla                           # the draft's own directory in it (default:
                                      # draft); recipes with the same data stages
                                      # and work_dir share them
  data: conversations.jsonl           # OpenAI messages or ShareGPT records
  extra_data: [text.jsonl]            # optional: added to the training data
  regenerate: {max_new_tokens: 192}
  calibrate_vocab: {draft_vocab_size: 2048}
  dump_hidden_states: {max_length: 512}
  train: {draft_arch: mla, max_steps: 600}
  eval: {prompts: examples/prompts/eval.jsonl, max_new_tokens: 128}
  export: {formats: [vllm, sglang]}

A section's keys are its command's options (dashes or underscores); the inputs and outputs above are the
pipeline's own. A finished stage is recorded in WORK/stages.json with the command it ran, and skipped when the
recipe asks for the same command again; an interrupted stage resumes (regenerate, dump-hidden-states and train
continue where they stopped). A finished stage asked to run with other settings is an error naming them, except
train, whose own --resume check decides (a larger max_steps extends the run).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
from pathlib import Path

from eyas.commands import build_parser, read_recipe_file, run, settings_from_mapping
from eyas.paths import DEFAULT_EVAL_PROMPTS, DEFAULT_MODEL

STAGES = ("regenerate", "calibrate_vocab", "dump_hidden_states", "train", "eval", "export")
TOP_LEVEL = ("target", "work_dir", "name", "data", "extra_data", *STAGES)
DRAFT_STAGES = ("train", "eval", "export")  # the ones writing under WORK/NAME, recorded under "NAME: stage"
# options the pipeline sets itself, per stage: its inputs and outputs
RESERVED = {
    "regenerate": {"data", "out", "model"},
    "calibrate_vocab": {"data", "output", "model"},
    "dump_hidden_states": {"data", "out_dir", "model"},
    "train": {"target", "data", "hidden_states", "vocab_file", "out", "resume", "config"},
    "eval": {"model", "speculative_method", "draft_model", "out"},
    "export": {"draft", "out", "target"},
}


# a recipe's name becomes a directory under work_dir and an export format part of one: plain names only, so
# neither can point outside it
PLAIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
SECRET_OPTIONS = ("--api-key",)  # their values are never printed or written to WORK/stages.json


class PipelineError(ValueError):
    pass


def redacted(argv: list[str]) -> list[str]:
    """`argv` with the value of every secret option replaced: what the pipeline prints and records."""
    out = list(argv)
    for i, arg in enumerate(out):
        if arg in SECRET_OPTIONS and i + 1 < len(out):
            out[i + 1] = "***"
        elif arg.startswith(tuple(o + "=" for o in SECRET_OPTIONS)):
            out[i] = arg.split("=", 1)[0] + "=***"
    return out


def read_recipe(path: Path) -> dict:
    """The recipe as a mapping, its top-level keys and section kinds checked."""
    recipe = read_recipe_file(path, "target, work_dir, data and stage sections")
    unknown = sorted(set(recipe) - set(TOP_LEVEL))
    if unknown:
        raise PipelineError(f"{path}: unknown key(s) {unknown}; expected {', '.join(TOP_LEVEL)}")
    for key in ("work_dir", "data"):
        if not isinstance(recipe.get(key), str):
            raise PipelineError(f"{path}: {key} must be set to a path")
    name = recipe.get("name", "draft")
    if not isinstance(name, str) or not PLAIN_NAME.fullmatch(name):
        raise PipelineError(f"{path}: name is {name!r}; expected a directory name of letters, digits, '.', '_' "
                            "and '-' that starts with a letter or digit")
    if not isinstance(recipe.get("extra_data", []), list):
        raise PipelineError(f"{path}: extra_data must be a list of JSONL files")
    for stage in STAGES:
        if recipe.get(stage) is not None and not isinstance(recipe[stage], dict):
            raise PipelineError(f"{path}: the {stage} section must be a mapping of its options")
    return recipe


def stage_commands(recipe: dict, recipe_path: Path) -> list[tuple[str, list[str]]]:
    """(stage, eyas argv) for every stage the recipe runs, in order; the training-data stage is ("data", [])."""
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    target = str(recipe.get("target") or DEFAULT_MODEL)
    work = Path(recipe["work_dir"])
    own = work / draft_name(recipe)
    train_data = work / "train_data.jsonl"

    def flags(stage: str, section: dict) -> list[str]:
        return _section_flags(stage, section, commands, recipe_path)

    out: list[tuple[str, list[str]]] = []
    if recipe.get("regenerate") is not None:
        out.append(("regenerate", ["regenerate", recipe["data"], str(work / "regenerated.jsonl"), "--model", target,
                                   *flags("regenerate", recipe["regenerate"])]))
    out.append(("data", []))
    if recipe.get("calibrate_vocab") is not None:
        out.append(("calibrate_vocab", ["calibrate-vocab", str(train_data), "-o", str(work / "vocab.safetensors"),
                                        "--model", target, *flags("calibrate_vocab", recipe["calibrate_vocab"])]))
    if recipe.get("dump_hidden_states") is not None:
        out.append(("dump_hidden_states", ["dump-hidden-states", str(train_data), str(work / "hidden_states"),
                                           "--model", target,
                                           *flags("dump_hidden_states", recipe["dump_hidden_states"])]))
    train_flags = flags("train", recipe.get("train") or {})
    block_draft = "--draft-arch" in train_flags and train_flags[train_flags.index("--draft-arch") + 1] == "dflash"
    if block_draft:
        _check_block_draft_recipe(recipe, recipe_path)
    source = (["--hidden-states", str(work / "hidden_states")] if recipe.get("dump_hidden_states") is not None
              else ["--data", str(train_data)])
    vocab = ["--vocab-file", str(work / "vocab.safetensors")] if recipe.get("calibrate_vocab") is not None else []
    out.append(("train", ["train", "--target", target, *source, *vocab, "--out", str(own), "--resume",
                          *train_flags]))
    draft = str(own / "draft")
    if recipe.get("eval") is not None:
        section = dict(recipe["eval"])
        prompts = section.pop("prompts", None)
        if prompts is None:
            if Path(target).resolve() != DEFAULT_MODEL.resolve():
                raise PipelineError(f"{recipe_path}: eval needs `prompts` (a JSONL prompts file) for this target")
            prompts = str(DEFAULT_EVAL_PROMPTS)
        method = "dflash" if block_draft else "eagle"
        out.append(("eval", ["eval", str(prompts), "--model", target, "--speculative-method", method,
                             "--draft-model", draft, "--out", str(own / "eval.json"), *flags("eval", section)]))
    if recipe.get("export") is not None:
        out += _export_commands(recipe["export"], draft, own, target, commands, recipe_path)
    return out


def _check_block_draft_recipe(recipe: dict, recipe_path: Path) -> None:
    """A DFlash draft drafts over the target's whole vocabulary and is written in z-lab's layout, which vLLM and
    SGLang load as it is: the stages that would make a vocabulary or convert the draft have nothing to do."""
    for stage, why in (("calibrate_vocab", "a DFlash draft drafts over the target's whole vocabulary"),
                       ("export", "NAME/draft is already in z-lab's layout, which vLLM (method dflash) and SGLang "
                                  "load")):
        if recipe.get(stage) is not None:
            raise PipelineError(f"{recipe_path}: {stage} with train.draft_arch dflash: {why}; drop the {stage} "
                                "section")


def _section_flags(stage: str, section: dict, commands: dict[str, argparse.ArgumentParser],
                   recipe_path: Path) -> list[str]:
    """A stage section's options as the command line of its eyas command, refusing the options the pipeline sets."""
    command = stage.replace("_", "-")
    reserved = sorted(RESERVED[stage] & {str(k).replace("-", "_") for k in section})
    if reserved:
        raise PipelineError(f"{recipe_path}: {stage} sets {reserved}, which the pipeline sets itself")
    settings = settings_from_mapping(section, commands[command], command, f"{recipe_path} ({stage})")
    argv = []
    for dest, value in settings.items():
        option = "--" + dest.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            argv.append(option)
        elif isinstance(value, list):
            argv += [option, *map(str, value)]
        else:
            argv += [option, str(value)]
    return argv


def _export_commands(export: dict, draft: str, own: Path, target: str, commands: dict[str, argparse.ArgumentParser],
                     recipe_path: Path) -> list[tuple[str, list[str]]]:
    """One export stage per format of the export section, each writing WORK/NAME/export-FORMAT."""
    section = dict(export)
    formats = section.pop("formats", None) or [section.pop("format", None)]
    section.pop("format", None)
    if formats == [None] or not isinstance(formats, list):
        raise PipelineError(f"{recipe_path}: export needs `format` or a `formats` list")
    known = next(a for a in commands["export"]._actions if a.dest == "format").choices
    out = []
    for fmt in formats:
        if fmt not in known:  # checked here, before it names a directory
            raise PipelineError(f"{recipe_path}: export format {fmt!r} is not one of {', '.join(known)}")
        out.append((f"export {fmt}", ["export", draft, str(own / f"export-{fmt}"), "--format", str(fmt),
                                      "--target", target, *_section_flags("export", section, commands, recipe_path)]))
    return out


def remove_stale_export(directory: Path, work: Path) -> None:
    """Remove an earlier export's directory, only where the pipeline itself puts one: WORK/NAME/export-FORMAT."""
    resolved, root = directory.resolve(), work.resolve()
    if (directory.is_symlink() or resolved.parent.parent != root or not resolved.name.startswith("export-")):
        raise PipelineError(f"{directory}: not an export directory inside {work}; not removing it")
    shutil.rmtree(resolved, ignore_errors=True)


def draft_name(recipe: dict) -> str:
    return str(recipe.get("name") or "draft")


def write_training_data(recipe: dict, work: Path) -> Path:
    """WORK/train_data.jsonl: the regenerated conversations (or `data`) followed by the extra files, written whole
    each time (a copy, cheap next to any other stage)."""
    sources = [work / "regenerated.jsonl" if recipe.get("regenerate") is not None else Path(recipe["data"])]
    sources += [Path(p) for p in recipe.get("extra_data", [])]
    out = work / "train_data.jsonl"
    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "wb") as f:
        for src in sources:
            if not src.is_file():
                raise PipelineError(f"{src}: no such training data file")
            data = src.read_bytes()
            f.write(data if data.endswith(b"\n") or not data else data + b"\n")
    os.replace(tmp, out)
    return out


def missing_inputs(recipe: dict, recipe_path: Path) -> list[str]:
    """The recipe's own inputs that do not exist yet (the target, the data, the extra data, eval's prompts), each
    as 'what: path'; what a stage writes for a later one is not an input."""
    target = Path(recipe.get("target") or DEFAULT_MODEL)
    wanted = [("target", target, target.is_dir()), ("data", Path(recipe["data"]), Path(recipe["data"]).is_file())]
    wanted += [("extra_data", Path(f), Path(f).is_file()) for f in recipe.get("extra_data", [])]
    prompts = (recipe.get("eval") or {}).get("prompts")
    if prompts is not None:
        wanted.append(("eval prompts", Path(prompts), Path(prompts).is_file()))
    return [f"{what}: {path}" for what, path, present in wanted if not present]


# what each stage leaves that a rerun would continue from instead of starting afresh (relative to WORK, NAME for
# the draft's own directory)
RESUMED_OUTPUTS = {"regenerate": "regenerated.jsonl", "dump_hidden_states": "hidden_states", "train": "NAME"}


def forget_from(stage: str, stages: list[tuple[str, list[str]]], done: dict, recipe: dict, work: Path) -> None:
    """--from STAGE: drop the records of STAGE and every later stage, and move the outputs they would resume from
    aside (WORK/X -> WORK/X.old-N, never deleted), so they run afresh with the recipe's settings."""
    kinds = [kind for kind, _ in stages if kind != "data"]  # "export vllm" is of the stage "export"
    names = [kind.split(" ")[0] for kind in kinds]
    if stage not in names:
        raise PipelineError(f"--from {stage}: this recipe runs only {', '.join(dict.fromkeys(names))}")
    later = kinds[names.index(stage):]
    for kind in later:
        done.pop(f"{draft_name(recipe)}: {kind}" if kind.split(" ")[0] in DRAFT_STAGES else kind, None)
        output = RESUMED_OUTPUTS.get(kind)
        if output is None:
            continue
        path = work / output.replace("NAME", draft_name(recipe))
        if path.exists():
            n = 1
            while path.with_name(f"{path.name}.old-{n}").exists():
                n += 1
            path.rename(path.with_name(f"{path.name}.old-{n}"))
            print(f"eyas pipeline: --from {stage}: moved {path} to {path.name}.old-{n}", file=sys.stderr)


def run_pipeline(recipe_path: Path, dry_run: bool = False, from_stage: str | None = None) -> int:
    recipe = read_recipe(recipe_path)
    work = Path(recipe["work_dir"])
    stages = stage_commands(recipe, recipe_path)
    record_path = work / "stages.json"
    done: dict = json.loads(record_path.read_text()) if record_path.is_file() else {}
    missing = missing_inputs(recipe, recipe_path)
    if dry_run:
        for stage, argv in stages:
            print(f"{stage}: " + ("(concatenate the training data)" if not argv else "eyas " +
                                  " ".join(redacted(argv))))
        for line in missing:
            print(f"missing input: {line}")
        return 1 if missing else 0
    if missing:  # before any stage runs, so nothing half-done looks resumable
        raise PipelineError(f"{recipe_path}: missing input{'s' * (len(missing) > 1)}: {'; '.join(missing)} "
                            "(a recipe's comments say how its inputs are made)")
    work.mkdir(parents=True, exist_ok=True)
    if from_stage is not None:
        forget_from(from_stage, stages, done, recipe, work)
    changed = False  # once a stage reruns, the stages after it see new inputs and rerun too
    for i, (kind, argv) in enumerate(stages, 1):
        if kind == "data":
            write_training_data(recipe, work)
            continue
        stage = f"{draft_name(recipe)}: {kind}" if kind.split(" ")[0] in DRAFT_STAGES else kind
        label = f"[{i}/{len(stages)}] {stage}"
        shown = redacted(argv)  # what is printed and recorded: the same settings, no secrets
        previous = done.get(stage)
        if previous is not None and previous == shown and not changed:
            print(f"{label}: done earlier, skipped", file=sys.stderr)
            continue
        if previous is not None and previous != shown and kind != "train":
            raise PipelineError(f"stage {stage} finished earlier with other settings:\n  was: eyas "
                                f"{' '.join(redacted(previous))}\n  now: eyas {' '.join(shown)}\nremove its "
                                f"output and its entry in {record_path} to run it again")
        print(f"{label}: eyas {' '.join(shown)}", file=sys.stderr)
        if kind.startswith("export "):  # an export writes a fresh directory: a stale one's files would mix in
            remove_stale_export(Path(argv[2]), work)
        try:
            code = run(build_parser(), argv)  # every command but this one: a stage never runs a pipeline
        except SystemExit as e:  # argparse refusing an option
            code = e.code if isinstance(e.code, int) else 2
        if code != 0:
            print(f"eyas pipeline: stage {stage} stopped (exit {code}); rerun `eyas pipeline {recipe_path}` to "
                  "resume", file=sys.stderr)
            return code
        done[stage] = shown
        changed = changed or previous != shown
        tmp = record_path.with_name(record_path.name + ".tmp")
        tmp.write_text(json.dumps(done, indent=2) + "\n")
        os.replace(tmp, record_path)
    print(f"pipeline done: draft in {work / draft_name(recipe) / 'draft'}", file=sys.stderr)
    return 0


def add_cli(subparsers) -> None:
    p = subparsers.add_parser("pipeline", help="regenerate -> calibrate-vocab -> dump -> train -> eval -> export "
                              "from one recipe file, each stage resumable", description=__doc__)
    p.add_argument("recipe", type=Path, metavar="RECIPE.yaml", help="the recipe (see above)")
    p.add_argument("--dry-run", action="store_true", help="print each stage's command and the recipe's missing "
                   "inputs, and run nothing (exit 1 when an input is missing)")
    p.add_argument("--from", dest="from_stage", choices=STAGES, metavar="STAGE",
                   help="run STAGE and every stage after it again, with the recipe's current settings, even if "
                   "recorded as done; the outputs they would resume from (regenerated.jsonl, hidden_states/, the "
                   f"draft's directory) are moved aside to NAME.old-N, never deleted. One of {', '.join(STAGES)}")
    p.set_defaults(func=lambda args: run_pipeline(args.recipe, args.dry_run, args.from_stage))
