"""`EngineArgs`: the engine settings `eyas generate`, `serve`, `bench serve`, `eval` and `regenerate` share, the
flags that fill them, and the `LLM` they describe (vLLM's pattern: one dataclass with `add_cli_args` and
`from_cli_args`, so a flag's name, default and help live in one place). Each flag's default is its field's; a
speculative setting passed to SpeculativeConfig unchanged takes SpeculativeConfig's default, so each default is
written once.

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    llm = EngineArgs.from_cli_args(parser.parse_args()).build_llm()
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any

from eyas.config import DEFAULT_NUM_SPECULATIVE_TOKENS, REJECTION_STRATEGIES, SpeculativeConfig
from eyas.engine.llm import LLM
from eyas.models.dflash import read_dflash_config
from eyas.paths import DEFAULT_DRAFT, DEFAULT_MODEL
from eyas.threads import THREADS_HELP

# measured with `eyas bench serve` on the bundled target against plain: drafting always on, c=8 1.15x, c=12 1.10x,
# c=14 1.20x, c=16 0.95x; off from 16, c=16 0.92x and 0.95x (whenever the batch dips below 16 drafting resumes, with
# the draft blind to the positions computed while it was off: AL 1.93); off from 12, c=8 1.22-1.24x, c=16 0.96x,
# 1.04x, 0.99x, 1.04x; off from 10, c=8 1.18x, c=16 1.11x (fewer blind resumptions as a wave of requests drains)
CPU_DISABLE_BATCH_SIZE = 10

MODEL_HELP = "HF checkpoint directory of the target (default: the bundled tiny DeepSeek-V3)"
# the engine flags a command may leave out (add_cli_args' `without`)
OPTIONAL_FLAGS = ("--dtype", "--device", "--max-model-len", "--kv-cache-memory")


def field_defaults(cls: type) -> dict[str, Any]:
    """A dataclass's field defaults by name (fields with a default_factory left out)."""
    return {f.name: f.default for f in fields(cls) if f.default is not MISSING}


_SPECULATIVE = field_defaults(SpeculativeConfig)


@dataclass(slots=True)
class EngineArgs:
    """What the engine is built from; each field is the flag of the same name."""

    model: Path = DEFAULT_MODEL
    dtype: str = "auto"  # see eyas.checkpoint.inference_dtype
    device: str = "cpu"
    max_num_seqs: int = 16
    max_model_len: int | None = None  # None: the model's
    kv_cache_memory: float | None = None  # GiB; None: on CPU 0.25 plus a draft's cache; 90% of free accelerator memory
    threads: int | None = None  # None: the rule in eyas.threads
    enforce_eager: bool = False  # True: no compiled step (also when EYAS_ENFORCE_EAGER=1, or off CPU)
    # speculative decoding; speculative_method None: decided by speculative_config(). The settings it passes on to
    # SpeculativeConfig as they are take SpeculativeConfig's defaults (whose comments say what they mean)
    speculative_method: str | None = None
    draft_model: Path | None = _SPECULATIVE["draft_model"]
    num_speculative_tokens: int | None = _SPECULATIVE["num_speculative_tokens"]  # for dflash: block_size - 1
    num_speculative_tokens_per_batch_size: str | None = None  # JSON, as the flag takes it: read when speculating
    speculative_disable_batch_size: int | None = None  # None: the device's default; 0: never disable
    speculative_width: str = "adaptive"  # adaptive: chosen by measurement up to K; fixed: K (or the overrides)
    num_speculative_tokens_mixed_batch: int | None = _SPECULATIVE["num_speculative_tokens_mixed_batch"]
    rejection_sampling_strategy: str = _SPECULATIVE["rejection_sampling_strategy"]
    synthetic_acceptance_rate: float | None = _SPECULATIVE["synthetic_acceptance_rate"]
    relaxed_thinking: bool = _SPECULATIVE["relaxed_thinking"]
    relaxed_thinking_topk: int = _SPECULATIVE["relaxed_thinking_topk"]
    relaxed_thinking_delta: float = _SPECULATIVE["relaxed_thinking_delta"]
    allow_unused_draft_weights: bool = _SPECULATIVE["allow_unused_draft_weights"]
    aux_layer_convention: str | None = _SPECULATIVE["aux_layer_convention"]

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, *, model_help: str = MODEL_HELP,
                     max_num_seqs: int | None = None, without: tuple[str, ...] = (), speculative: bool = True,
                     title: str = "engine") -> None:
        """Add the engine flags to a command's parser, each defaulting to its field's default. A command that
        differs says how: its own --model help or --max-num-seqs default, engine flags it does not take (`without`,
        from OPTIONAL_FLAGS), no speculative flags. --model joins the command's own options; the other engine flags
        form the group `title`."""
        unknown = set(without) - set(OPTIONAL_FLAGS)
        if unknown:
            raise ValueError(f"add_cli_args: {sorted(unknown)} cannot be left out; expected some of {OPTIONAL_FLAGS}")
        defaults = field_defaults(EngineArgs)
        if max_num_seqs is not None:
            defaults["max_num_seqs"] = max_num_seqs
        _flag(parser, "--model", defaults, type=Path, help=model_help)
        g = parser.add_argument_group(title)
        _flag(g, "--max-num-seqs", defaults, type=int, help="sequences decoded together")
        if "--max-model-len" not in without:
            _flag(g, "--max-model-len", defaults, type=int, help="context length (default: the model's)")
        if "--kv-cache-memory" not in without:
            _flag(g, "--kv-cache-memory", defaults, type=float, metavar="GIB", help="KV cache budget in GiB "
                  "(default: on CPU 0.25 plus a draft's cache; 90%% of free accelerator memory); requests beyond it "
                  "wait or are preempted")
        if "--dtype" not in without:
            _flag(g, "--dtype", defaults, help="auto (bfloat16 on GPU, and on CPUs with AMX for a bfloat16 "
                  "checkpoint unless --enforce-eager; else float32), float32, bfloat16")
        if "--device" not in without:
            _flag(g, "--device", defaults, help="cpu or cuda")
        _flag(g, "--threads", defaults, type=int, help=THREADS_HELP)
        _flag(g, "--enforce-eager", defaults, action="store_true", help="run every step op by op; by default, on "
              "CPU, decode and verify steps run the target as kernels compiled on the first use of a model's weights "
              "(two to three minutes for the bundled target and draft; kept in $EYAS_CACHE_DIR/compiled, default "
              "~/.cache/eyas/compiled) and loaded in a few seconds after. EYAS_ENFORCE_EAGER=1 sets this flag")
        if speculative:
            _add_speculative_args(parser, defaults)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """The settings of a parsed command line; a flag the command does not take keeps the field's default."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})

    def speculative_config(self) -> SpeculativeConfig | None:
        """The SpeculativeConfig these settings describe, or None for plain decoding. With no speculative_method:
        dflash or eagle when a draft_model is given (as its config.json names it); for the bundled target, eagle
        with its bundled MLA draft; otherwise plain."""
        method, draft = self.speculative_method, self.draft_model
        if method is None:
            if draft is not None:
                method = "dflash" if read_dflash_config(draft) is not None else "eagle"
            elif Path(self.model).resolve() == DEFAULT_MODEL.resolve() and DEFAULT_DRAFT.is_dir():
                method, draft = "eagle", DEFAULT_DRAFT
            else:
                method = "none"
        if method == "none":
            if draft is not None:  # plain decoding would silently leave the draft unused
                raise ValueError(f"--speculative-method none decodes without a draft, but --draft-model {draft} is "
                                 "given: drop --draft-model, or pass --speculative-method eagle (or dflash) to draft "
                                 "with it")
            return None
        num_tokens = self.num_speculative_tokens
        if method == "dflash" and num_tokens is None:  # the block's drafts (a bad block_size fails on loading)
            block_size = (read_dflash_config(draft) or {}).get("block_size")
            num_tokens = block_size - 1 if isinstance(block_size, int) and block_size >= 2 else None
        # unset: on CPU, where a verify step of K + 1 rows per sequence is compute-bound well before a GPU's would be,
        # drafting stops from CPU_DISABLE_BATCH_SIZE running sequences; on GPUs it stays on
        disable = self.speculative_disable_batch_size
        adaptive = self.speculative_width == "adaptive"
        if disable is None and not adaptive:  # the adaptive width finds where drafting stops paying by itself
            disable = CPU_DISABLE_BATCH_SIZE if str(self.device).startswith("cpu") else None
        return SpeculativeConfig(
            method=method, draft_model=str(draft) if draft else None, num_speculative_tokens=num_tokens,
            num_speculative_tokens_per_batch_size=_per_batch_size_rules(self.num_speculative_tokens_per_batch_size),
            disable_batch_size=disable or None, adaptive_width=adaptive,
            num_speculative_tokens_mixed_batch=self.num_speculative_tokens_mixed_batch,
            rejection_sampling_strategy=self.rejection_sampling_strategy,
            synthetic_acceptance_rate=self.synthetic_acceptance_rate, relaxed_thinking=self.relaxed_thinking,
            relaxed_thinking_topk=self.relaxed_thinking_topk, relaxed_thinking_delta=self.relaxed_thinking_delta,
            aux_layer_convention=self.aux_layer_convention,
            allow_unused_draft_weights=self.allow_unused_draft_weights)

    def build_llm(self) -> LLM:
        """Load the target (and its draft), size the KV cache and set torch's threads."""
        return LLM(self.model, dtype=self.dtype, device=self.device, max_num_seqs=self.max_num_seqs,
                   max_model_len=self.max_model_len, kv_cache_memory_gb=self.kv_cache_memory,
                   speculative_config=self.speculative_config(), threads=self.threads,
                   compiled_step=self.compiled_step, progress=lambda line: print(line, file=sys.stderr, flush=True))

    @property
    def compiled_step(self) -> bool:
        """Whether steps run compiled: on CPU, unless --enforce-eager or EYAS_ENFORCE_EAGER=1."""
        eager = self.enforce_eager or os.environ.get("EYAS_ENFORCE_EAGER", "0") not in ("", "0")
        return not eager and str(self.device).startswith("cpu")


def _per_batch_size_rules(text: str | None) -> list:
    if not text:
        return []
    try:
        rules = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--num-speculative-tokens-per-batch-size is not valid JSON ({e})") from e
    if not isinstance(rules, list):
        raise ValueError("--num-speculative-tokens-per-batch-size must be a JSON list of "
                         '{"batch_start": ..., "batch_end": ..., "num_tokens": ...} objects')
    return rules


def _flag(group: argparse.ArgumentParser | argparse._ArgumentGroup, flag: str, defaults: dict[str, Any],
          **kwargs: Any) -> None:
    """Add `flag` (--draft-model) with the default of the field it fills (draft_model): no flag has its own."""
    group.add_argument(flag, default=defaults[flag.removeprefix("--").replace("-", "_")], **kwargs)


def _add_speculative_args(parser: argparse.ArgumentParser, defaults: dict[str, Any]) -> None:
    s = parser.add_argument_group("speculative decoding")
    _flag(s, "--speculative-method", defaults, choices=["eagle", "mtp", "dflash", "none"],
          help="eagle: an EAGLE-3 draft head (--draft-model), one draft token per draft forward; mtp: the "
          "target's own NextN layer; dflash: a DFlash block draft (--draft-model, z-lab's layout or the "
          "speculators format), whose one forward proposes a whole block of drafts; none: plain decoding. "
          "Default: dflash or eagle when --draft-model is given (as its config.json names it); for the bundled "
          "tiny target, eagle with its bundled MLA draft; otherwise none")
    _flag(s, "--draft-model", defaults, type=Path, help="draft directory: EAGLE-3 (vLLM, SGLang, Model Optimizer, "
          "MAX or eyas layout; MLA or Llama-style MHA) or DFlash (z-lab's layout, as vLLM and SGLang load it, or the "
          "speculators format)")
    _flag(s, "--num-speculative-tokens", defaults, type=int, help=f"drafts verified per step (K); default "
          f"{DEFAULT_NUM_SPECULATIVE_TOKENS}, and for dflash the draft's block_size - 1 (at most that: its block is "
          "the anchor and that many drafts)")
    _flag(s, "--num-speculative-tokens-per-batch-size", defaults, metavar="JSON",
          help='K by running batch size, e.g. \'[{"batch_start": 1, "batch_end": 4, "num_tokens": 4}, '
          '{"batch_start": 5, "batch_end": 64, "num_tokens": 2}]\'')
    _flag(s, "--speculative-disable-batch-size", defaults, type=int, metavar="N",
          help="no draft work while N or more sequences run (verifying K + 1 rows per sequence costs more "
          "than it saves once a step is compute-bound), so such steps cost what plain steps cost; when the "
          "batch shrinks, drafting resumes with the draft attending to the positions computed since. "
          f"Default: with --speculative-width fixed, {CPU_DISABLE_BATCH_SIZE} on CPU and off on GPUs; "
          "with adaptive, off; 0: never disable")
    _flag(s, "--speculative-width", defaults, choices=["adaptive", "fixed"],
          help="adaptive: per batch size, the verify width (0..K drafts) with the most tokens per second, "
          "from measured step times and acceptance (Modular MAX's policy; --speculative-disable-batch-size "
          "and --num-speculative-tokens-per-batch-size still rule where they apply); fixed: K, with "
          f"drafting off from {CPU_DISABLE_BATCH_SIZE} running sequences on CPU unless "
          "--speculative-disable-batch-size says otherwise")
    _flag(s, "--num-speculative-tokens-mixed-batch", defaults, type=int, metavar="N", help="at most N drafts for a "
          "step that also prefills prompts (it is compute-bound already); default: no cap")
    _flag(s, "--rejection-sampling-strategy", defaults, choices=list(REJECTION_STRATEGIES),
          help="greedy: accept drafts equal to the target's own choice (lossless); residual: rejection "
          "sampling, accept with min(1, p/q) else resample from max(0, p - q) (lossless, accepts more "
          "when sampling); typical or typical-acceptance: Medusa's typical acceptance (LOSSY: output is not "
          "the target's); logit-comparison: accept while the draft's and the target's top tokens agree "
          "(exact for greedy requests, LOSSY for sampled ones)")
    _flag(s, "--synthetic-acceptance-rate", defaults, type=float, help="BENCHMARK ONLY, LOSSY: accept each draft "
          "position with this probability regardless of the draft, to measure engine overhead")
    _flag(s, "--relaxed-thinking", defaults, action="store_true", help="LOSSY: inside <think>...</think>, accept a "
          "draft among the target's top-k whose log-prob is within delta of the best")
    _flag(s, "--relaxed-thinking-topk", defaults, type=int)
    _flag(s, "--relaxed-thinking-delta", defaults, type=float)
    _flag(s, "--allow-unused-draft-weights", defaults, action="store_true", help="load a draft whose file holds "
          "weights its config does not use (for example fc_norm.* with fc_norm false), dropping them; without it "
          "that is an error naming them and the switch that would use them")
    _flag(s, "--aux-layer-convention", defaults, choices=["hidden_states", "layer_output"],
          help="how to read the draft's aux layer ids: hidden_states (vLLM/SGLang/MAX) or layer_output "
          "(Model Optimizer, one lower); default: detected from the draft's config, else hidden_states")
