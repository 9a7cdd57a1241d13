"""`eyas eval`: acceptance length of a draft per prompt category, through the real engine.

Prompts file: JSONL records `{"category": ..., "turns": ["first user turn", ...]}` (MT-Bench style; each turn is
sent as a chat message after the model's previous answers) or `{"category": ..., "prompt": "raw text"}`.
Acceptance at draft position k = verify steps that accepted draft k (and every draft before it) / verify steps that
verified draft k, summed over a category's requests before dividing; acceptance length (AL) = 1 + the sum of the
positions' acceptance: with every step verifying K drafts, the tokens committed per verify step (a sequence's last
steps, which verify only the drafts its remaining tokens can use, do not count against the later positions).

Loops are trivially predictable, so they inflate AL: an output is counted repetitive when more than half of its
tokens lie inside a repeated 4-gram (one whose tokens occurred in that order earlier in the same output), and the
report gives, beside AL, the share of repetitive outputs and the AL over the other ones.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

from eyas.client import add_server_args
from eyas.engine.sequence import AcceptanceCounts, acceptance_rates, add_counts
from eyas.engine_args import EngineArgs
from eyas.paths import EXAMPLES
from eyas.records import read_eval_prompts
from eyas.sampling_params import SamplingParams


def spread(records: list[dict], n: int) -> list[dict]:
    """`n` records taken at even strides over the file (its categories come in blocks)."""
    return records[::max(1, len(records) // n)][:n]


REPEAT_NGRAM = 4
REPETITIVE_SHARE = 0.5


def repeated_positions(token_ids: list[int], n: int = REPEAT_NGRAM) -> list[bool]:
    """Which tokens lie inside a repeated n-gram: tokens j..j+n-1 when the n-gram at j occurred at an earlier start
    in the same sequence."""
    seen: set[tuple[int, ...]] = set()
    inside = [False] * len(token_ids)
    for j in range(len(token_ids) - n + 1):
        gram = tuple(token_ids[j:j + n])
        if gram in seen:
            inside[j:j + n] = [True] * n
        seen.add(gram)
    return inside


def repeated_share(token_ids: list[int], n: int = REPEAT_NGRAM) -> float:
    """The share of tokens inside a repeated n-gram. A loop scores near 1 ("#\n#\n#..."), ordinary code and text
    low (0.1 to 0.16 on average for the held-out functions' real bodies)."""
    return sum(repeated_positions(token_ids, n)) / len(token_ids) if token_ids else 0.0


def is_repetitive(token_ids: list[int]) -> bool:
    return repeated_share(token_ids) > REPETITIVE_SHARE


def evaluate(llm, records: list[dict], params: SamplingParams, progress: bool = False) -> dict:
    """Run every record (turn by turn, all records batched per turn); aggregate acceptance per category.
    `progress`: a progress bar per turn on stderr."""
    counts: dict[str, dict] = defaultdict(lambda: {**_totals(), "non_repetitive": _totals()})
    histories: list[list[dict]] = [[] for _ in records]
    num_turns = [len(r["turns"]) if r["turns"] else 1 for r in records]
    for turn in range(max(num_turns)):
        active = [i for i in range(len(records)) if num_turns[i] > turn]
        prompts = []
        for i in active:
            if records[i]["turns"]:
                histories[i].append({"role": "user", "content": records[i]["turns"][turn]})
                prompts.append(list(histories[i]))
            else:
                prompts.append(records[i]["prompt"])
        for i, out in zip(active, llm.generate(prompts, params, use_tqdm=progress)):
            if records[i]["turns"]:
                histories[i].append({"role": "assistant", "content": out.text})
            repetitive = is_repetitive(out.token_ids)
            for key in (records[i]["category"], "overall"):
                _add(counts[key], out)
                if not repetitive:
                    _add(counts[key]["non_repetitive"], out)
    return {"categories": {c: _summary(counts[c]) for c in sorted(counts) if c != "overall"},
            "overall": _summary(counts["overall"])}


def measure_acceptance(target: str, draft, device: str, prompts: Path | None = None, num_prompts: int = 8,
                       max_new_tokens: int = 64, threads: int | None = None) -> float:
    """A draft's acceptance length as it is now (in training), through the engine: greedy, K=3 (an EAGLE-3
    draft) or its whole block (a DFlash draft), on `num_prompts` of the eval prompts spread over the file (its
    categories come in blocks)."""
    import tempfile

    from eyas.config import SpeculativeConfig
    from eyas.engine.llm import LLM
    from eyas.export import save_dflash_draft, save_draft
    from eyas.models.dflash import DFlashDraft
    from eyas.paths import DEFAULT_EVAL_PROMPTS

    records = spread(read_eval_prompts(Path(prompts or DEFAULT_EVAL_PROMPTS)), num_prompts)
    with tempfile.TemporaryDirectory(prefix="eyas-eval-draft-") as tmp:
        if isinstance(draft, DFlashDraft):
            save_dflash_draft(draft, Path(tmp))
            spec = SpeculativeConfig(method="dflash", draft_model=tmp, num_speculative_tokens=draft.block_size - 1)
        else:
            save_draft(draft, Path(tmp), fmt="eyas")
            spec = SpeculativeConfig(method="eagle", draft_model=tmp)
        llm = LLM(target, device=device, max_num_seqs=len(records), threads=threads, speculative_config=spec)
        report = evaluate(llm, records, SamplingParams(temperature=0, max_tokens=max_new_tokens))
    return report["overall"]["acceptance_length"]


@dataclass(slots=True)
class ServerOutput:
    """What the report reads of one request answered by a running server: its tokens from the response, its
    verify steps and accepted drafts from the deltas of the server's counters around it."""

    num_generated: int
    num_verify_steps: int
    num_accepted: int
    accepted_counts: list[int]
    token_ids: list[int]
    num_requests: int = 1  # more when concurrent requests are counted together

    @property
    def verified_counts(self) -> list[int]:
        """A server's counters give only the steps that had drafts: each is taken to have verified every position
        (vLLM's and SGLang's fixed width)."""
        return [self.num_verify_steps] * len(self.accepted_counts)


def evaluate_by_server(client, records: list[dict], params: SamplingParams, concurrency: int = 1) -> dict:
    """`evaluate` for a target served elsewhere (vLLM, MAX, eyas serve, SGLang). Acceptance comes from the deltas
    of the server's vLLM spec-decode counters around each request, so by default requests go one at a time (turn by
    turn). With `concurrency` N the records of each category go N at a time and the deltas around each group count
    for the group: the same totals per category, but no per-request split (the non-repetitive figures are then
    None). A server without those counters that counts each response itself (SGLang's meta_info.spec_verify_ct) is
    read per response, at any concurrency.

    Beside AL (1 + accepted / drafts, as the counters count: vLLM also counts drafts accepted past max_tokens) the
    report gives `acceptance_length_returned`: tokens the responses returned after their first, per verify step."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be at least 1, got {concurrency}")
    counts: dict[str, dict] = defaultdict(lambda: {**_totals(), "non_repetitive": _totals(), "returned": 0})
    by_category: dict[str, list[dict]] = defaultdict(list)
    for record in records:
        by_category[record["category"]].append(record)
    with ThreadPoolExecutor(concurrency, thread_name_prefix="eyas-eval") as pool:
        for category, group in by_category.items():
            for first in range(0, len(group), concurrency):
                before = client.spec_counters()
                converse = partial(_converse, client, params=params, alone=concurrency == 1, before=before)
                results = [r for turns in pool.map(converse, group[first:first + concurrency]) for r in turns]
                outputs = [out for out, _ in results if out is not None]
                if len(outputs) < len(results):  # counted by the server's counters, all requests together
                    outputs = [_from_counters(client, before, client.spec_counters(), [r for _, r in results])]
                for out in outputs:
                    split = is_repetitive(out.token_ids) if out.num_requests == 1 else None
                    for key in (category, "overall"):
                        _add(counts[key], out)
                        counts[key]["returned"] += max(0, out.num_generated - out.num_requests)
                        if split is None:
                            counts[key]["non_repetitive"] = None
                        elif not split and counts[key]["non_repetitive"] is not None:
                            _add(counts[key]["non_repetitive"], out)
    return {"categories": {c: _summary(counts[c]) for c in sorted(counts) if c != "overall"},
            "overall": _summary(counts["overall"])}


def _converse(client, record: dict, params: SamplingParams, alone: bool, before: dict) -> list[tuple]:
    """Send a record's turns in order: per turn (its ServerOutput or None, its ChatResult). `alone`: no other
    request runs meanwhile, so each turn is measured by the counters' deltas around it."""
    out, history = [], []
    for turn in record["turns"] or [None]:
        if alone and out:
            before = client.spec_counters()
        if turn is None:
            result = client.completion(record["prompt"], params.max_tokens, params.temperature, params.seed)
        else:
            history.append({"role": "user", "content": turn})
            result = client.chat(history, params.max_tokens, params.temperature, params.seed)
            history.append({"role": "assistant", "content": result.text})
        if result.spec_verify_steps is not None:
            out.append((_from_response(client, result), result))
        elif alone:
            out.append((_from_counters(client, before, client.spec_counters(), [result]), result))
        else:
            out.append((None, result))
    return out


def _from_response(client, result) -> ServerOutput:
    """SGLang's count of one response: completion tokens / verify steps is its AL; spec_accept_histogram[i] is
    the steps that accepted i drafts, so position k was accepted in the steps that accepted k or more."""
    from eyas.client import ServerError

    steps = result.spec_verify_steps
    if steps > result.completion_tokens:  # each verify step commits at least one token
        raise ServerError(f"{client.url}: an answer counts {steps} verify steps (meta_info.spec_verify_ct) for "
                          f"{result.completion_tokens} tokens (usage.completion_tokens); expected at most one step "
                          "per token")
    histogram = result.spec_accept_histogram or []
    per_position = [sum(histogram[k:]) for k in range(1, len(histogram))]
    return ServerOutput(result.completion_tokens, steps, result.completion_tokens - steps, per_position,
                        result.token_ids or [])


def _from_counters(client, before: dict, after: dict, results: list) -> ServerOutput:
    """The deltas of the server's counters around `results` (ChatResults, whose token counts the client has
    checked): a counter that went backwards or is not a count is a ServerError naming the server and the counter."""
    from eyas.client import ServerError, counter_deltas

    if "vllm:spec_decode_num_drafts" not in after:
        raise ServerError(f"{client.url}/metrics has no vllm:spec_decode_num_drafts counter and its responses carry "
                          "no meta_info.spec_verify_ct: the server is not speculating, or reports acceptance in a "
                          "way eyas does not read")
    delta = counter_deltas(client.url, before, after)
    accepted, drafted = delta.get("vllm:spec_decode_num_accepted_tokens", 0), delta.get(
        "vllm:spec_decode_num_draft_tokens")
    if drafted is not None and accepted > drafted:
        raise ServerError(f"{client.url}/metrics: vllm:spec_decode_num_accepted_tokens rose by {accepted} but "
                          f"vllm:spec_decode_num_draft_tokens only by {drafted}; a server accepts only drafted tokens")
    positions = sorted(int(k.split(":")[1]) for k in delta if k.startswith("per_pos:"))
    return ServerOutput(sum(r.completion_tokens for r in results), delta["vllm:spec_decode_num_drafts"], accepted,
                        [delta[f"per_pos:{k}"] for k in positions],
                        results[0].token_ids or [] if len(results) == 1 else [], len(results))


def _totals() -> dict:
    return {"requests": 0, "generated_tokens": 0, "verify_steps": 0, "accepted_drafts": 0, "accepted_counts": [],
            "verified_counts": []}


def _add(c: dict, out) -> None:
    c["requests"] += getattr(out, "num_requests", 1)
    c["generated_tokens"] += out.num_generated
    c["verify_steps"] += out.num_verify_steps
    c["accepted_drafts"] += out.num_accepted
    add_counts(c["accepted_counts"], out.accepted_counts)
    add_counts(c["verified_counts"], out.verified_counts)


def _summary(c: dict) -> dict:
    steps = c["verify_steps"]
    rates = acceptance_rates(c["accepted_counts"], c["verified_counts"])
    summary = {"requests": c["requests"], "generated_tokens": c["generated_tokens"], "verify_steps": steps,
               "accepted_drafts": c["accepted_drafts"], "acceptance_length": round(1 + sum(rates), 4),
               "accepted_per_position": [round(r, 4) for r in rates]}
    if "non_repetitive" in c and c["non_repetitive"] is None:  # concurrent requests counted together
        summary.update(repetitive_outputs=None, repetitive_share=None, acceptance_length_non_repetitive=None)
    elif "non_repetitive" in c:
        other = _summary(c["non_repetitive"])
        summary["repetitive_outputs"] = c["requests"] - other["requests"]
        summary["repetitive_share"] = round(summary["repetitive_outputs"] / c["requests"], 4) if c["requests"] else 0.0
        summary["acceptance_length_non_repetitive"] = other["acceptance_length"]
    if "returned" in c:  # tokens a server returned after each response's first
        summary["acceptance_length_returned"] = round(c["returned"] / steps, 4) if steps else 1.0
    return summary


def speed_against_plain(llm, prompts: list, params: SamplingParams) -> dict:
    """Each prompt generated alone (batch 1, where speculation is meant to pay), plain and then speculative on the
    same engine: tokens per second of each over all prompts, their ratio, and (greedy) whether the tokens matched."""
    warm = replace(params, max_tokens=min(4, params.max_tokens))
    with llm.plain_decoding():
        llm.generate(prompts[:1], warm)
    llm.generate(prompts[:1], warm)
    totals = {"plain": [0, 0.0], "speculative": [0, 0.0]}
    same, outputs = True, []
    for prompt in prompts:
        start = time.perf_counter()
        with llm.plain_decoding():
            plain = llm.generate([prompt], params)[0]
        middle = time.perf_counter()
        spec = llm.generate([prompt], params)[0]
        end = time.perf_counter()
        totals["plain"][0] += plain.num_generated
        totals["plain"][1] += middle - start
        totals["speculative"][0] += spec.num_generated
        totals["speculative"][1] += end - middle
        same = same and plain.token_ids == spec.token_ids
        outputs.append(spec)
    rates = {k: n / t if t > 0 else 0.0 for k, (n, t) in totals.items()}
    return {"prompts": len(prompts), "batch_size": 1, "plain_tokens_per_s": round(rates["plain"], 1),
            "speculative_tokens_per_s": round(rates["speculative"], 1),
            "speedup": round(rates["speculative"] / rates["plain"], 3) if rates["plain"] else 0.0,
            "acceptance_length": round(AcceptanceCounts.total(outputs).acceptance_length, 4),
            "same_tokens_as_plain": same if params.greedy else None}


def slower_than_plain_warning(speedup: float, speculative_rate: float, plain_rate: float,
                              acceptance_length: float) -> str | None:
    """The warning for a draft that costs more than it saves (more than 5% slower than plain decoding, so timing
    noise alone does not raise it), or that accepts almost nothing (acceptance length under 1.1), whatever the
    clock says: an adaptive width can make such a draft nearly free, so its speed is plain decoding's give or take
    the noise of a busy machine, and it is still of no use. Else None."""
    if speedup >= 0.95 and acceptance_length >= 1.1:
        return None
    # a draft that accepts well and still loses is not helped by training: its steps cost too much next to the
    # target's here (a small target whose plain step is cheap, or a draft run op by op)
    why = ("; decode with --speculative-method none, or train the draft longer" if acceptance_length < 2 else
           ", though it accepts well: on this machine a step that verifies drafts costs more than the tokens they "
           "add; decode with --speculative-method none")
    return (f"warning: speculative decoding ran at {speedup:.2f}x the speed of plain decoding on these prompts "
            f"({speculative_rate:.0f} vs {plain_rate:.0f} tok/s, acceptance length {acceptance_length:.2f}): this "
            f"draft costs more than it saves{why}")


def draft_title(spec, model: Path) -> str:
    """What a plot is of: the draft (its architecture and directory) and the target."""
    if spec.method == "mtp":
        return f"MTP layer of {Path(model).name}, K={spec.num_speculative_tokens}"
    path = Path(spec.draft_model)
    name = str(path) if path.name in ("draft", "checkpoint") else path.name  # runs/x/draft, not draft/draft
    try:
        arch = json.loads((path / "config.json").read_text())["architectures"][0]
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        arch = "EAGLE-3"
    return f"{arch} {name} for {Path(model).name}, K={spec.num_speculative_tokens}"


def plot_report(report: dict, png: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    categories = list(report["categories"])
    fig, (ax_al, ax_pos) = plt.subplots(1, 2, figsize=(11, 4))
    values = [report["categories"][c]["acceptance_length"] for c in categories] + [
        report["overall"]["acceptance_length"]]
    bars = ax_al.bar(categories + ["overall"], values, color=["C0"] * len(categories) + ["C1"])
    ax_al.bar_label(bars, fmt="%.2f", fontsize=8)
    ax_al.set(ylabel="acceptance length (tokens / verify step)", title="acceptance length per category")
    ax_al.tick_params(axis="x", rotation=30)
    for category in categories:
        rates = report["categories"][category]["accepted_per_position"]
        ax_pos.plot(range(1, len(rates) + 1), rates, marker="o", label=category)
    overall = report["overall"]["accepted_per_position"]
    ax_pos.plot(range(1, len(overall) + 1), overall, marker="s", color="black", label="overall")
    ax_pos.set(xlabel="draft position", ylabel="acceptance rate", ylim=(0, 1), title="acceptance per position",
               xticks=range(1, len(overall) + 1))
    ax_pos.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def add_cli(subparsers) -> None:
    p = subparsers.add_parser(
        "eval", help="acceptance length per category of a draft on a prompts file, through the engine",
        description=__doc__)
    p.add_argument("prompts", type=Path, help="JSONL prompts file (category + turns, or category + prompt)")
    EngineArgs.add_cli_args(p, without=("--device", "--max-model-len", "--kv-cache-memory"))
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0: sampled (residual rule)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="write the report JSON here and the plot beside it (.png); default: "
                   "beside the draft's directory, DRAFT-eval.json; in the current directory for mtp "
                   "(eval-mtp-TARGET.json), a bundled draft (eval-NAME.json) or --server (eval-MODEL.json)")
    p.add_argument("--server", metavar="URL", help="measure a running server instead (vLLM, SGLang, MAX, eyas "
                   "serve; e.g. http://127.0.0.1:8000): acceptance from the deltas of its vllm:spec_decode_* "
                   "counters (SGLang: each response's meta_info.spec_verify_ct); the speculative options and "
                   "--speed-prompts do not apply")
    add_server_args(p, 1, "requests in flight; above 1 a category's counters are read around each group of "
                    "requests, so there is no per-request split into repetitive and not")
    p.add_argument("--speed-prompts", type=int, default=8, help="also time this many prompts (spread over the "
                   "file, first turns) one at a time, plain and speculative on the same engine, and report the "
                   "speedup; 0: skip")
    p.set_defaults(func=_cmd_eval)


def _cmd_eval(args: argparse.Namespace) -> int:
    if args.server:
        return _eval_by_server(args)
    engine = EngineArgs.from_cli_args(args)
    # acceptance is measured: draft at every batch size unless told otherwise (0: never disable)
    engine.speculative_disable_batch_size = engine.speculative_disable_batch_size or 0
    engine.speculative_width = "fixed"  # the draft is measured at K, not the serving policy
    spec = engine.speculative_config()
    if spec is None:
        raise ValueError("eyas eval measures a draft: give --speculative-method eagle (or dflash) --draft-model "
                         "DIR, or mtp")
    records = read_eval_prompts(args.prompts)
    llm = engine.build_llm()
    params = _params(args)
    report = evaluate(llm, records, params, progress=True)
    if args.speed_prompts > 0:
        print(f"timing {args.speed_prompts} prompts one at a time, plain and speculative", file=sys.stderr)
        first_turns = [r["prompt"] if r["prompt"] is not None else [{"role": "user", "content": r["turns"][0]}]
                       for r in spread(records, args.speed_prompts)]
        report["speed"] = speed_against_plain(llm, first_turns, params)
    report["settings"] = {"model": str(args.model), "method": spec.method, "draft_model": spec.draft_model,
                          "num_speculative_tokens": spec.num_speculative_tokens,
                          "temperature": args.temperature, "max_new_tokens": args.max_new_tokens,
                          "prompts": str(args.prompts)}
    _write_report(report, args.out or default_report_path(spec, args.model), draft_title(spec, args.model))
    overall = report["overall"]
    repetitive = overall["repetitive_outputs"]
    line = (f"acceptance length {overall['acceptance_length']:.2f} over {overall['requests']} requests "
            f"({overall['acceptance_length_non_repetitive']:.2f} over the {overall['requests'] - repetitive} that are "
            f"not repetitive; {repetitive} repetitive)")
    if "speed" in report:
        speed = report["speed"]
        line += (f"; one request at a time, {speed['speedup']:.2f}x plain decoding "
                 f"({speed['speculative_tokens_per_s']:.0f} vs {speed['plain_tokens_per_s']:.0f} tok/s)")
        warning = slower_than_plain_warning(speed["speedup"], speed["speculative_tokens_per_s"],
                                            speed["plain_tokens_per_s"], speed["acceptance_length"])
        if warning:
            line += "\n" + warning
    print(line, file=sys.stderr)
    return 0


def _eval_by_server(args: argparse.Namespace) -> int:
    from eyas.client import client_from_args

    records = read_eval_prompts(args.prompts)
    client = client_from_args(args)
    try:
        report = evaluate_by_server(client, records, _params(args), args.concurrency)
    finally:
        client.close()
    report["settings"] = {"server": args.server, "model": client.model, "concurrency": args.concurrency,
                          "temperature": args.temperature,
                          "max_new_tokens": args.max_new_tokens, "prompts": str(args.prompts)}
    out = args.out or Path(f"eval-{re.sub(r'[^A-Za-z0-9._-]+', '_', client.model).strip('_.') or 'server'}.json")
    _write_report(report, out, f"{client.model} served at {args.server}")
    overall = report["overall"]
    non_repetitive = overall["acceptance_length_non_repetitive"]
    split = f"; {non_repetitive:.2f} over the non-repetitive outputs" if non_repetitive is not None else ""
    print(f"acceptance length {overall['acceptance_length']:.2f} over {overall['requests']} requests (from the "
          f"tokens returned: {overall['acceptance_length_returned']:.2f}{split})", file=sys.stderr)
    return 0


def _params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(temperature=args.temperature, seed=args.seed if args.temperature > 0 else None,
                          max_tokens=args.max_new_tokens)


def default_report_path(spec, model: Path) -> Path:
    """Where eval writes without --out: beside the draft's directory (runs/x/draft -> runs/x/draft-eval.json), so
    reports of several drafts do not overwrite each other; in the current directory for the MTP layer and for a
    draft shipped with eyas (never into the installed package)."""
    if spec.method == "mtp":
        return Path(f"eval-mtp-{Path(model).name}.json")
    draft = Path(spec.draft_model)
    if draft.resolve().parent == EXAMPLES.resolve():
        return Path(f"eval-{draft.name}.json")
    return draft.parent / f"{draft.name}-eval.json"


def _write_report(report: dict, out: Path, title: str) -> None:
    """The report as JSON on stdout and in `out`, with its plot beside it."""
    text = json.dumps(report, indent=2)
    print(text)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    plot_report(report, out.with_suffix(".png"), title)
    print(f"wrote {out} and {out.with_suffix('.png')}", file=sys.stderr)
