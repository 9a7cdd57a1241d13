"""eyas's EAGLE-3 draft trainer against NVIDIA Model Optimizer's, on the same target, data, batches and schedule.

Runs, in one invocation and one after another (same thread count for all):
  (a) `eyas train` with --draft-arch mha (the counterpart of Model Optimizer's llama-type draft) and mla, with the
      plain recipe (forward KL) and every --recipe (an LK loss, the EAGLE-3.1 norms, ...);
  (b) Model Optimizer's EAGLE-3 trainer (benchmarks/modelopt_train.py) with the Model Optimizer virtualenv's python;
  (c) `eyas eval` of every draft on the held-out prompts (K = 3, greedy), Model Optimizer's export loaded as is;
then prints a table: trainer, draft arch, training tokens/s, acceptance length (AL) overall and per category, and
the eyas / Model Optimizer ratios.

Training tokens/s, both trainers: batch x padded positions per step (the same tensors: same batches, padded to the
longest sequence of the batch), over the steps after --measure-after warm-up steps, divided by their wall time
(each loop iteration whole: batch assembly, target forward, draft train-time-test forward/backward, optimizer step;
loading and export excluded). For eyas it is recovered from its train_log.jsonl (cumulative tokens/s per step, with
the per-step token counts recomputed from eyas's own batch order).

The target directory is snapshotted (copied) first, so a checkpoint being rewritten by another job is never read
half-written; every run uses the snapshot.

Setting up the Model Optimizer virtualenv (once; it needs transformers 5.14.1, so it lives apart from eyas's
environment; CPU-only torch, never a CUDA build):

    python -m venv /tmp/modelopt-venv
    /tmp/modelopt-venv/bin/pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
    /tmp/modelopt-venv/bin/pip install "nvidia-modelopt==0.47.*" requests transformers==5.14.1 safetensors \\
        torch==2.13.0

(where a local CPU wheel of torch 2.13.0 is on pip's find-links, the plain `pip install torch==2.13.0` takes it;
keep `torch==2.13.0` in the second command so pip cannot swap torch for another build.) Then:

    python benchmarks/modelopt_compare.py --steps 600 --batch-size 4 --max-length 128 --lr 3e-3 \\
        --warmup-steps 50 --max-new-tokens 128 --modelopt-python /tmp/modelopt-venv/bin/python \\
        --throughput-rounds 3 --throughput-steps 60 --cpu-time-steps 20 80

On a shared machine wall-clock tokens/s is only as good as the machine is quiet; --cpu-time-steps gives a figure
that other processes barely move.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import resource
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200, help="training steps, every trainer")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--warmup-steps", type=int, default=50)
    p.add_argument("--ttt-steps", type=int, default=3)
    p.add_argument("--target", type=Path, default=REPO / "examples" / "tiny-deepseek-v3")
    p.add_argument("--data", type=Path, default=REPO / "work" / "tiny_target" / "conversations_train.jsonl",
                   help="training conversations (JSONL, OpenAI messages); `python scripts/tiny_target/build_data.py` "
                   "creates the default")
    p.add_argument("--prompts", type=Path, default=REPO / "examples" / "prompts" / "eval.jsonl")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--num-speculative-tokens", type=int, default=3)
    p.add_argument("--modelopt-python", default="/tmp/modelopt-venv/bin/python",
                   help="python of the Model Optimizer virtualenv (see above)")
    p.add_argument("--archs", nargs="+", default=["mha", "mla"], choices=["mha", "mla"],
                   help="eyas draft architectures to train")
    p.add_argument("--threads", type=int, default=1, help="torch / OpenMP threads for every run")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"],
                   help="every trainer alike. fp32: all float32. bf16: the frozen target in bfloat16 and the draft "
                   "under bfloat16 autocast with float32 weights (eyas: --target-dtype bfloat16 --mixed-precision "
                   "bf16; Model Optimizer: modelopt_train.py --precision bf16)")
    p.add_argument("--draft-vocab-size", type=int, default=0, metavar="N",
                   help="train every draft with a compressed vocabulary of N ids: `eyas calibrate-vocab` on --data "
                   "once, the same d2t for every trainer (eyas: --vocab-file, its head initialised from the "
                   "target's rows; Model Optimizer: draft_vocab_size + d2t, its own freshly initialised head). "
                   "0 (default): the target's whole vocabulary (Model Optimizer then reuses the target's frozen "
                   "lm_head; eyas trains a copy of it)")
    p.add_argument("--recipe", action="append", default=[], metavar="NAME=FLAGS",
                   help="an eyas training recipe to compare besides the plain one (forward KL, EAGLE-3 norms): a name "
                        "and the `eyas train` flags it adds, e.g. lk-alpha='--loss lk-alpha' or "
                        "eagle31='--norm-before-fc --norm-output'; repeatable, each trained for every --archs")
    p.add_argument("--measure-after", type=int, default=5, help="warm-up steps left out of tokens/s")
    p.add_argument("--extra-seeds", type=int, nargs="+", default=[], metavar="SEED",
                   help="also train and evaluate every trainer with these seeds (draft init and batch order), for "
                   "acceptance only; the report then gives each seed's AL and the ratio of the means (600-step "
                   "runs on the bundled target differ by up to 0.1 AL from seed to seed)")
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/modelopt-compare"),
                   help="outputs: target snapshot, drafts, logs, eval reports, summary.json")
    p.add_argument("--reuse", action="store_true", help="skip runs whose outputs already exist in --work-dir "
                   "(and keep its target snapshot)")
    p.add_argument("--throughput-rounds", type=int, default=0,
                   help="extra short training runs for tokens/s only, interleaved (eyas archs, then Model "
                   "Optimizer, per round) so that load from other processes hits every trainer alike; the "
                   "table then reports the median per trainer and the median of the per-round ratios")
    p.add_argument("--throughput-steps", type=int, default=60, help="steps of each --throughput-rounds run")
    p.add_argument("--cpu-time-steps", type=int, nargs=2, metavar=("N1", "N2"),
                   help="also measure tokens per CPU-second, robust to other processes on the machine: each trainer "
                   "runs N1 and N2 steps; (tokens(N2) - tokens(N1)) / (CPU time(N2) - CPU time(N1)) of the whole "
                   "child process cancels loading, tokenizing and export (with 1 thread, CPU time is the time "
                   "the trainer itself computed, not time it waited for a core)")
    return p.parse_args()


def snapshot(src: Path, dst: Path) -> Path:
    """Copy a checkpoint directory, retrying while a file in it changes during the copy."""
    for _ in range(10):
        before = {f.name: f.stat().st_mtime_ns for f in src.iterdir() if f.is_file()}
        if dst.exists():
            shutil.rmtree(dst)
        shutil.copytree(src, dst)
        after = {f.name: f.stat().st_mtime_ns for f in src.iterdir() if f.is_file()}
        if before == after:
            from safetensors import safe_open  # a whole, readable file

            for f in dst.glob("*.safetensors"):
                with safe_open(f, "pt") as handle:
                    list(handle.keys())
            return dst
        time.sleep(5)
    raise SystemExit(f"{src} kept changing while being copied")


def run(cmd: list[str], log: Path, env: dict) -> None:
    print("$ " + " ".join(cmd), flush=True)
    start = time.perf_counter()
    with log.open("w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    print(f"  ({time.perf_counter() - start:.0f} s, log {log})", flush=True)
    if proc.returncode:
        sys.stdout.write(log.read_text()[-3000:])
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}")


def eyas_tokens_per_s(log_path: Path, target: Path, data: Path, batch_size: int, max_length: int,
                      measure_after: int) -> tuple[float, float]:
    """(tokens/s after the warm-up steps, tokens/s over all steps) from an `eyas train` log. Its records hold the
    cumulative tokens/s since the loop started; the per-step token counts (batch x padded length) are recomputed
    from eyas's own data pipeline and batch order, which gives each step's end time."""
    from transformers import AutoTokenizer

    from eyas.train.batches import batch_indices
    from eyas.train.data import load_dataset

    records = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
    with contextlib.redirect_stderr(io.StringIO()):  # no tokenizing progress bar in the report
        examples = load_dataset(data, AutoTokenizer.from_pretrained(target), max_length)
    cum, ends = 0, []
    for r in records:
        idx = batch_indices(len(examples), r["step"] - 1, batch_size, 0)
        cum += batch_size * min(max_length, max(len(examples[i].input_ids) for i in idx))
        ends.append((cum, cum / r["tokens_per_s"]))
    if len(ends) <= measure_after:
        return ends[-1][0] / ends[-1][1], ends[-1][0] / ends[-1][1]
    (c0, t0), (c1, t1) = ends[measure_after - 1] if measure_after else (0, 0.0), ends[-1]
    return (c1 - c0) / (t1 - t0), c1 / t1


def run_cpu(cmd: list[str], log: Path, env: dict) -> float:
    """Run `cmd`; return the user + system CPU seconds it (a direct child) used."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    run(cmd, log, env)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def tokens_for_steps(target: Path, data: Path, batch_size: int, max_length: int, steps: int) -> int:
    """batch x padded length summed over the first `steps` batches (eyas's order, which modelopt_train.py uses)."""
    from transformers import AutoTokenizer

    from eyas.train.batches import batch_indices
    from eyas.train.data import load_dataset

    with contextlib.redirect_stderr(io.StringIO()):
        examples = load_dataset(data, AutoTokenizer.from_pretrained(target), max_length)
    return sum(batch_size * min(max_length, max(len(examples[i].input_ids)
                                                for i in batch_indices(len(examples), s, batch_size, 0)))
               for s in range(steps))


def mean_last(values: list[float], n: int = 20) -> float:
    tail = values[-n:]
    return sum(tail) / len(tail) if tail else float("nan")


def main() -> int:
    args = parse_args()
    work = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    if not Path(args.modelopt_python).is_file():
        raise SystemExit(f"{args.modelopt_python}: no such python; set up the Model Optimizer venv (see --help)")
    if not args.data.is_file():
        raise SystemExit(f"{args.data}: missing; run `python scripts/tiny_target/build_data.py`")
    # --reuse keeps the earlier snapshot: reused drafts were trained against it
    target = work / "target" if args.reuse and (work / "target" / "config.json").is_file() else snapshot(
        args.target, work / "target")
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads),
               TOKENIZERS_PARALLELISM="false")
    common = ["--batch-size", str(args.batch_size), "--max-length", str(args.max_length)]
    vocab = work / f"vocab-{args.draft_vocab_size}.safetensors"
    if args.draft_vocab_size and not (args.reuse and vocab.is_file()):
        run(["eyas", "calibrate-vocab", str(args.data), "--model", str(target), "--draft-vocab-size",
             str(args.draft_vocab_size), "--max-length", str(args.max_length), "-o", str(vocab)],
            work / "calibrate-vocab.log", env)
    vocab_args = ["--vocab-file", str(vocab)] if args.draft_vocab_size else []

    recipes = {"": []}  # the plain recipe keeps the run names earlier reports (and --reuse) know
    for spec in args.recipe:
        name, sep, flags = spec.partition("=")
        if not sep or not name or name in recipes:
            raise SystemExit(f"--recipe {spec!r}: expected NAME=FLAGS with a new name")
        recipes[name] = shlex.split(flags)

    def eyas_train(out: Path, arch: str, steps: int, seed: int = 0, recipe: str = "") -> list[str]:
        precision = (["--target-dtype", "bfloat16", "--mixed-precision", "bf16"] if args.precision == "bf16" else
                     ["--target-dtype", "float32", "--mixed-precision", "no"])
        return ["eyas", "train", *precision, "--target", str(target), "--data", str(args.data), "--out", str(out),
                "--draft-arch", arch, "--ttt-steps", str(args.ttt_steps), "--max-steps", str(steps), "--lr",
                str(args.lr), "--warmup-steps", str(args.warmup_steps),
                "--save-every", str(steps), "--seed", str(seed), *vocab_args, *common, *recipes[recipe]]

    def modelopt_train(out: Path, steps: int, seed: int = 0) -> list[str]:
        return [args.modelopt_python, str(REPO / "benchmarks" / "modelopt_train.py"), "--target", str(target),
                "--data", str(args.data), "--out", str(out), "--steps", str(steps), "--lr", str(args.lr),
                "--warmup-steps", str(args.warmup_steps), "--ttt-steps", str(args.ttt_steps), "--threads",
                str(args.threads), "--precision", args.precision, "--measure-after",
                str(min(args.measure_after, steps - 1)), "--seed", str(seed), *vocab_args, *common]

    def evaluate(draft: Path, name: str) -> dict:
        report = work / f"eval-{name}.json"
        if not (args.reuse and report.is_file()):
            run(["eyas", "eval", str(args.prompts), "--model", str(target), "--speculative-method", "eagle",
                 "--draft-model", str(draft), "--num-speculative-tokens", str(args.num_speculative_tokens),
                 "--max-new-tokens", str(args.max_new_tokens), "--temperature", "0", "--threads",
                 str(args.threads), "--out", str(report)], work / f"eval-{name}.log", env)
        return json.loads(report.read_text())

    rows = []

    # (a) eyas, every recipe
    for recipe in recipes:
        for arch in args.archs:
            variant = f"{arch}-{recipe}" if recipe else arch
            out = work / f"eyas-{variant}"
            if not (args.reuse and (out / "draft" / "model.safetensors").is_file()):
                run(eyas_train(out, arch, args.steps, recipe=recipe), work / f"train-eyas-{variant}.log", env)
            tps, tps_all = eyas_tokens_per_s(out / "train_log.jsonl", target, args.data, args.batch_size,
                                             args.max_length, args.measure_after)
            log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines() if line.strip()]
            rows.append({"trainer": "eyas", "arch": variant, "base_arch": arch, "recipe": recipe or "kl",
                         "draft": out / "draft", "tokens_per_s": tps, "tokens_per_s_all_steps": tps_all,
                         "train_acc0_last20": mean_last([r["acc_per_step"][0] for r in log])})

    # (b) Model Optimizer
    out = work / "modelopt-mha"
    result_file = work / "modelopt-result.json"
    if not (args.reuse and result_file.is_file() and (out / "model.safetensors").is_file()):
        log_file = work / "train-modelopt-mha.log"
        run(modelopt_train(out, args.steps), log_file, env)
        last = [line for line in log_file.read_text().splitlines() if line.startswith("{")][-1]
        result_file.write_text(last + "\n")
    mo = json.loads(result_file.read_text())
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines() if line.strip()]
    rows.append({"trainer": "modelopt", "arch": "mha", "base_arch": "mha", "recipe": "modelopt", "draft": out,
                 "tokens_per_s": mo["tokens_per_s"],
                 "tokens_per_s_all_steps": mo["tokens_per_s_all_steps"],
                 "train_acc0_last20": mean_last([r["acc_per_step"][0] for r in log]), "modelopt": mo})

    # (b') interleaved throughput-only rounds
    rounds: dict[str, list[float]] = {}
    for k in range(args.throughput_rounds):  # the plain recipe's: the others cost the same per token
        for arch in args.archs:
            out = work / f"tp{k}-eyas-{arch}"
            run(eyas_train(out, arch, args.throughput_steps), work / f"tp{k}-eyas-{arch}.log", env)
            rounds.setdefault(f"eyas-{arch}", []).append(eyas_tokens_per_s(
                out / "train_log.jsonl", target, args.data, args.batch_size, args.max_length, args.measure_after)[0])
        out = work / f"tp{k}-modelopt-mha"
        run(modelopt_train(out, args.throughput_steps), work / f"tp{k}-modelopt-mha.log", env)
        last = [line for line in (work / f"tp{k}-modelopt-mha.log").read_text().splitlines()
                if line.startswith("{")][-1]
        rounds.setdefault("modelopt-mha", []).append(json.loads(last)["tokens_per_s"])
    for row in rows:
        row["tokens_per_s_main_run"] = row["tokens_per_s"]
        samples = rounds.get(f"{row['trainer']}-{row['arch']}")
        if samples:
            row["tokens_per_s_rounds"] = samples
            row["tokens_per_s"] = sorted(samples)[len(samples) // 2]

    # (b'') tokens per CPU-second
    if args.cpu_time_steps:
        n1, n2 = args.cpu_time_steps
        dtok = (tokens_for_steps(target, args.data, args.batch_size, args.max_length, n2)
                - tokens_for_steps(target, args.data, args.batch_size, args.max_length, n1))
        for row in rows:
            cpu = []
            for n in (n1, n2):
                out = work / f"cpu{n}-{row['trainer']}-{row['arch']}"
                cmd = eyas_train(out, row["base_arch"], n, recipe=row["recipe"] if row["recipe"] != "kl" else "") \
                    if row["trainer"] == "eyas" else modelopt_train(out, n)
                cpu.append(run_cpu(cmd, work / f"cpu{n}-{row['trainer']}-{row['arch']}.log", env))
            row["tokens_per_cpu_s"] = dtok / (cpu[1] - cpu[0])
            row["cpu_seconds"] = {n1: round(cpu[0], 1), n2: round(cpu[1], 1)}

    # (c) acceptance length, every draft through eyas's engine
    for row in rows:
        r = evaluate(row["draft"], f"{row['trainer']}-{row['arch']}")
        row["al"] = r["overall"]["acceptance_length"]
        # loops inflate AL: the AL over the outputs that are not repetitive, and how many are
        row["al_non_repetitive"] = r["overall"].get("acceptance_length_non_repetitive")
        row["repetitive_share"] = r["overall"].get("repetitive_share")
        row["al_categories"] = {c: v["acceptance_length"] for c, v in r["categories"].items()}
        row["accepted_per_position"] = r["overall"]["accepted_per_position"]

    # (c') acceptance over more seeds
    for row in rows:
        row["al_per_seed"] = {0: row["al"]}
        row["al_non_repetitive_per_seed"] = {0: row["al_non_repetitive"]}
        for seed in args.extra_seeds:
            name = f"seed{seed}-{row['trainer']}-{row['arch']}"
            out = work / name
            eyas = row["trainer"] == "eyas"
            draft = out / "draft" if eyas else out
            if not (args.reuse and (draft / "model.safetensors").is_file()):
                recipe = row["recipe"] if row["recipe"] != "kl" else ""
                cmd = eyas_train(out, row["base_arch"], args.steps, seed, recipe) if eyas else \
                    modelopt_train(out, args.steps, seed)
                run(cmd, work / f"train-{name}.log", env)
            overall = evaluate(draft, name)["overall"]
            row["al_per_seed"][seed] = overall["acceptance_length"]
            row["al_non_repetitive_per_seed"][seed] = overall.get("acceptance_length_non_repetitive")
        row["al_mean"] = sum(row["al_per_seed"].values()) / len(row["al_per_seed"])
        spread = list(row["al_per_seed"].values())
        row["al_spread"] = max(spread) - min(spread)

    # table
    categories = sorted({c for row in rows for c in row["al_categories"]})
    head = ["trainer", "draft", "train tok/s" + (" (median of rounds)" if rounds else ""), "main-run tok/s",
            *(["train tok/CPU-s"] if args.cpu_time_steps else []), "AL overall", "AL non-repetitive",
            "repetitive outputs", *[f"AL {c}" for c in categories],
            "accept@1..K", "train acc0 (last 20)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [row["trainer"], row["arch"], f"{row['tokens_per_s']:.0f}", f"{row['tokens_per_s_main_run']:.0f}",
                 *([f"{row['tokens_per_cpu_s']:.0f}"] if args.cpu_time_steps else []), f"{row['al']:.3f}",
                 f"{row['al_non_repetitive']:.3f}" if row["al_non_repetitive"] is not None else "-",
                 f"{row['repetitive_share']:.2f}" if row["repetitive_share"] is not None else "-",
                 *[f"{row['al_categories'].get(c, float('nan')):.3f}" for c in categories],
                 " / ".join(f"{x:.2f}" for x in row["accepted_per_position"]), f"{row['train_acc0_last20']:.3f}"]
        lines.append("| " + " | ".join(cells) + " |")
    ref = rows[-1]
    ratios = []
    for row in rows[:-1]:
        speed = row["tokens_per_s"] / ref["tokens_per_s"]
        if rounds:  # the median of same-round ratios: each round's runs ran back to back
            per_round = sorted(a / b for a, b in zip(rounds[f"eyas-{row['base_arch']}"], rounds["modelopt-mha"]))
            speed = per_round[len(per_round) // 2]
        ratios.append(f"eyas {row['arch']} / Model Optimizer: tokens/s x{speed:.2f}, "
                      + (f"tokens/CPU-s x{row['tokens_per_cpu_s'] / ref['tokens_per_cpu_s']:.2f}, "
                         if args.cpu_time_steps else "")
                      + f"AL x{row['al'] / ref['al']:.3f} ({row['al']:.3f} vs {ref['al']:.3f})"
                      + (f"; AL over seeds {', '.join(map(str, row['al_per_seed']))}: mean x"
                         f"{row['al_mean'] / ref['al_mean']:.3f} ({row['al_mean']:.3f} vs {ref['al_mean']:.3f}; "
                         f"spread {row['al_spread']:.3f} vs {ref['al_spread']:.3f}; "
                         f"per seed {' / '.join(f'{a:.3f}' for a in row['al_per_seed'].values())} vs "
                         f"{' / '.join(f'{a:.3f}' for a in ref['al_per_seed'].values())})"
                         if args.extra_seeds else ""))
    settings = (f"target {args.target} (snapshot {target}); data {args.data}; {args.steps} steps, batch "
                f"{args.batch_size} x max {args.max_length} tokens, lr {args.lr} (warmup {args.warmup_steps}, cosine "
                f"to 0.1x), TTT {args.ttt_steps}, {args.precision}, draft vocabulary "
                f"{args.draft_vocab_size or 'full'}, {args.threads} thread(s); tokens/s after "
                f"{args.measure_after} warm-up steps; eval {args.prompts.name}, K={args.num_speculative_tokens}, "
                f"greedy, max {args.max_new_tokens} new tokens")
    text = "\n".join([settings, "", *lines, "", *ratios,
                      "Model Optimizer served-vs-trained step-0 top-1 agreement (its double norm, see "
                      f"modelopt_train.py): {mo.get('served_vs_trained_step0_top1_agreement')}; input_layernorm max "
                      f"|w - 1| = {mo.get('input_layernorm_max_abs_dev_from_1')}"])
    print(text)
    (work / "summary.md").write_text(text + "\n")
    (work / "summary.json").write_text(json.dumps(
        {"settings": vars(args) | {"target_snapshot": str(target)}, "rows": rows}, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
