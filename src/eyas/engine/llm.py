"""`LLM`: requests in, text out. Owns the tokenizer, the scheduler, the runner and the step loop:
schedule -> run -> commit."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from eyas.checkpoint import inference_dtype, load_dflash_draft, load_draft, load_model
from eyas.config import SpeculativeConfig
from eyas.engine.block_proposer import BlockDraft
from eyas.engine.chat import encode_chat
from eyas.engine.grammar import GrammarCache
from eyas.engine.kv_cache import BlockAllocator
from eyas.engine.model_runner import ModelRunner
from eyas.engine.proposer import Proposer
from eyas.engine.sampling import TokenLogprobs
from eyas.engine.scheduler import Scheduler
from eyas.engine.sequence import Sequence
from eyas.engine.stop import StopChecker
from eyas.models.layers import pack_for_inference
from eyas.paths import DEFAULT_MODEL
from eyas.sampling_params import SamplingParams
from eyas.threads import configure_threads


@dataclass(slots=True)
class RequestOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    time_to_first_token: float
    elapsed: float
    num_drafted: int = 0
    num_accepted: int = 0
    num_verify_steps: int = 0
    acceptance_length: float = 1.0  # the draft's, at the widest width verified: 1 + sum(accepted_per_position)
    accepted_per_position: list[float] = field(default_factory=list)  # P(drafts 0..k accepted | draft k verified)
    accepted_counts: list[int] = field(default_factory=list)  # verify steps that accepted drafts 0..k
    verified_counts: list[int] = field(default_factory=list)  # verify steps that verified draft k
    logprobs: list[TokenLogprobs] | None = None  # per generated token, when SamplingParams.logprobs is set

    @property
    def num_generated(self) -> int:
        return len(self.token_ids)

    @property
    def tokens_per_second(self) -> float:
        return self.num_generated / self.elapsed if self.elapsed > 0 else 0.0

    @property
    def tokens_per_verify_step(self) -> float:
        """1 + accepted drafts / verify steps: what the widths verified delivered (the width policy's doing too)."""
        return 1.0 + self.num_accepted / self.num_verify_steps if self.num_verify_steps else 1.0

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens after the first per second after the first: the decode speed, without the prompt's prefill."""
        decode_time = self.elapsed - self.time_to_first_token
        return (self.num_generated - 1) / decode_time if self.num_generated > 1 and decode_time > 0 else 0.0


class PromptTooLong(ValueError):
    pass


class LLM:
    def __init__(self, model: str | Path = DEFAULT_MODEL, dtype: str | torch.dtype = "auto", device: str = "cpu",
                 max_num_seqs: int = 16, max_model_len: int | None = None, block_size: int = 16,
                 num_blocks: int | None = None, max_num_batched_tokens: int = 512,
                 kv_cache_memory_gb: float | None = None,
                 speculative_method: str | None = None, draft_model: str | Path | None = None,
                 num_speculative_tokens: int | None = None, speculative_config: SpeculativeConfig | None = None,
                 threads: int | None = None, compiled_step: bool = False,
                 progress: Callable[[str], None] | None = None) -> None:
        """`dtype` "auto": bfloat16 on accelerators, and on CPUs with AMX for a bfloat16 checkpoint with
        `compiled_step`; else float32 (eyas.checkpoint.inference_dtype).
        `speculative_method` "eagle" or "dflash" (with `draft_model`) or "mtp" turns on speculative decoding
        (`num_speculative_tokens`: 3 drafts a step, a DFlash draft's block_size - 1);
        `speculative_config` gives every speculative setting at once. `threads`: torch CPU threads (default: the
        rule in eyas.threads, 1 on CPU for small models), set for the whole process. `compiled_step`: decode and
        verify steps run the target as compiled kernels (eyas.engine.compiled_step; CPU only), compiled on the
        first use of a model's weights (`progress` hears each kernel) and loaded from the disk cache after."""
        if compiled_step and torch.device(device).type != "cpu":
            raise ValueError(f"the compiled step runs on CPU only; on {device} leave compiled_step off "
                             "(--enforce-eager)")
        if speculative_config is None and speculative_method not in (None, "none"):
            speculative_config = SpeculativeConfig(
                method=speculative_method, draft_model=str(draft_model) if draft_model else None,
                num_speculative_tokens=num_speculative_tokens)
        self.model = load_model(model, dtype=inference_dtype(model, dtype, device, compiled_step), device=device)
        self.num_threads = configure_threads(self.model, threads)
        pack_for_inference(self.model)
        config = self.model.config
        self.tokenizer = load_tokenizer(model)
        self.max_model_len = min(max_model_len or config.max_position_embeddings, config.max_position_embeddings)
        self.draft = None
        if speculative_config is not None:
            self.draft = load_draft_for(speculative_config, self.model)
            pack_for_inference(self.draft)
            if isinstance(self.draft, BlockDraft):  # its block bounds the drafts of a step
                speculative_config = speculative_config.for_block_size(self.draft.block_size)
        self.speculative_config = speculative_config
        if num_blocks is None:
            num_blocks = default_num_blocks(config, self.model.lm_head.weight, max_num_seqs, self.max_model_len,
                                            block_size, kv_cache_memory_gb, self.draft)
        # one lane per running sequence: contexts stay contiguous, so batched attention reads them in place
        self.allocator = BlockAllocator(num_blocks, block_size, num_lanes=max_num_seqs)
        eos_token_ids = set(config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos_token_ids.add(self.tokenizer.eos_token_id)
        self._grammars: GrammarCache | None = None  # built on the first structured-output request (grammar_cache)
        self._grammars_lock = threading.Lock()
        self.runner = ModelRunner(self.model, num_blocks, block_size, self.draft, speculative_config,
                                  self.max_model_len, think_token_ids(self.tokenizer),
                                  (self.allocator.num_lanes, self.allocator.lane_blocks), compiled_step, progress)
        # a sampling sequence commits up to K + 1 tokens and then gets up to K drafts (a block draft: K <= B - 1, and
        # its block's own rows past the drafts are never written)
        lookahead = 1 + speculative_config.max_num_tokens if speculative_config is not None else 0
        self.scheduler = Scheduler(self.allocator, max_num_seqs, max_num_batched_tokens,
                                   StopChecker(eos_token_ids, self.tokenizer, self.max_model_len), lookahead)

    @property
    def eos_token_ids(self) -> set[int]:
        return self.scheduler.stop.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: set[int]) -> None:
        self.scheduler.stop.eos_token_ids = set(ids)

    @property
    def speculative(self) -> Proposer | None:
        """The draft side of the engine; None when decoding plainly."""
        return self.runner.proposer

    # -- requests ------------------------------------------------------------------------------------------------
    def encode(self, prompt: str | list[int] | list[dict]) -> list[int]:
        """Token ids of a text prompt, a list of ids, or chat messages (rendered by the tokenizer's template; a
        control token's text typed in a message's content stays plain text, see `encode_chat`)."""
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        if self.tokenizer is None:
            raise ValueError("this checkpoint has no tokenizer; pass token ids")
        if isinstance(prompt, list):
            return encode_chat(self.tokenizer, prompt)
        return self.tokenizer(prompt).input_ids

    def add_request(self, prompt: str | list[int] | list[dict], params: SamplingParams) -> Sequence:
        ids = self.encode(prompt)
        if not ids:
            raise ValueError("empty prompt")
        if len(ids) >= self.max_model_len:
            raise PromptTooLong(f"prompt has {len(ids)} tokens; the context holds {self.max_model_len} "
                                "(the prompt plus at least one generated token must fit)")
        bad = [t for t in ids if not 0 <= t < self.model.config.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary (size {self.model.config.vocab_size})")
        seq = Sequence(ids, params)
        if params.structured_output is not None:
            seq.grammar = self.grammar_cache().matcher(params.structured_output)
        self.scheduler.add(seq)
        return seq

    def grammar_cache(self) -> GrammarCache:
        """The compiled-grammar cache, built on first use (from any thread)."""
        if self.tokenizer is None:
            raise ValueError("structured_output needs a tokenizer; this checkpoint has none")
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = GrammarCache(self.tokenizer, self.model.config.vocab_size, self.eos_token_ids)
        return self._grammars

    # -- the step ------------------------------------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """One engine step; returns the sequences it finished."""
        batch = self.scheduler.schedule()
        if not batch:
            finished = self.scheduler.take_finished()
            if not finished:
                raise RuntimeError("no sequence could be scheduled (KV cache too small for the waiting requests)")
            return finished
        output = self.runner.run(batch)
        return self.scheduler.commit(batch, output)

    def output(self, seq: Sequence) -> RequestOutput:
        text = seq.text
        if text is None:
            text = self.tokenizer.decode(seq.generated_ids, skip_special_tokens=True) if self.tokenizer else ""
        counts = seq.acceptance
        return RequestOutput(
            prompt_token_ids=seq.token_ids[:seq.num_prompt_tokens], token_ids=seq.generated_ids, text=text,
            finish_reason=seq.finish_reason or "", time_to_first_token=(seq.first_token_time or 0) - seq.arrival_time,
            elapsed=(seq.finish_time or time.perf_counter()) - seq.arrival_time, num_drafted=counts.num_drafted,
            num_accepted=counts.num_accepted, num_verify_steps=counts.num_verify_steps,
            acceptance_length=counts.acceptance_length, accepted_per_position=counts.rates,
            accepted_counts=list(counts.accepted_per_position), verified_counts=list(counts.verified_per_position),
            logprobs=list(seq.logprobs) if seq.params.logprobs is not None else None)

    def generate(self, prompts: Seq[str | list[int] | list[dict]] | str,
                 params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = False, on_finish: Callable[[int], None] | None = None) -> list[RequestOutput]:
        """Generate for every prompt (text, token ids, or chat messages); outputs in prompt order. `on_finish(i)` is
        called as prompt i's request finishes (for progress reports)."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        params_list = list(params) if isinstance(params, Seq) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(params_list)} sampling params for {len(prompts)} prompts")
        seqs = [self.add_request(p, sp) for p, sp in zip(prompts, params_list)]
        index = {id(s): i for i, s in enumerate(seqs)}
        bar = tqdm(total=len(seqs), desc="generate", unit="req", disable=not use_tqdm)
        while self.scheduler.has_work():
            finished = self.step()
            bar.update(len(finished))
            if on_finish is not None:
                for seq in finished:
                    if id(seq) in index:
                        on_finish(index[id(seq)])
        bar.close()
        return [self.output(s) for s in seqs]

    @contextmanager
    def plain_decoding(self) -> Iterator[None]:
        """Requests started inside the block run on the target alone, with no draft: a baseline for the speed of
        speculative decoding on the same engine. No request may be in flight on entry."""
        if self.scheduler.has_work():
            raise RuntimeError("plain_decoding() needs an idle engine: finish the running requests first")
        proposer, self.runner.proposer = self.runner.proposer, None
        try:
            yield
        finally:
            self.runner.proposer = proposer

    @contextmanager
    def fixed_width(self) -> Iterator[None]:
        """Requests started inside the block verify the configured width every step (K, or the override for the
        batch size) instead of the adaptive width's choice, which learns nothing meanwhile: a draft timed as it is,
        not while the width policy explores. No request may be in flight on entry."""
        if self.scheduler.has_work():
            raise RuntimeError("fixed_width() needs an idle engine: finish the running requests first")
        proposer = self.runner.proposer
        adaptive = proposer.adaptive if proposer is not None else None
        if proposer is not None:
            proposer.adaptive = None
        try:
            yield
        finally:
            if proposer is not None:
                proposer.adaptive = adaptive

    def abort(self, seq: Sequence) -> None:
        """Cancel a request between steps: it finishes with reason "abort" and its KV blocks are freed now."""
        if not seq.is_finished:
            self.scheduler.finish(seq, "abort")


def default_num_blocks(config, weight: torch.Tensor, max_num_seqs: int, max_model_len: int, block_size: int,
                       memory_gb: float | None, draft=None) -> int:
    """Blocks for max_num_seqs full-length sequences, capped by a memory budget: `memory_gb`, else on CPU 0.25 GiB
    of the target's cache with the draft's beside it, and 90% of the free accelerator memory. Sequences past the cap
    wait or are preempted, never lost."""
    target_bytes = config.num_hidden_layers * config.latent_dim * weight.element_size()
    bytes_per_token = target_bytes
    if draft is not None:  # the draft's cache shares the block tables (a DFlash draft's holds K and V per layer)
        bytes_per_token += math.prod(draft.cache_entry_shape()) * weight.element_size()
    if memory_gb is None and weight.device.type == "cpu":
        # the default holds as many positions with a draft as without, so each sequence's lane is as long: with
        # the draft's cache inside 0.25 GiB the bundled MLA draft's lanes at 32 sequences held 400 positions
        # against 448, the longest held-out prompts with 96 new tokens outgrew them, and their attention gathered
        # (a drafting engine at width 0 ran 3.4% behind plain at c=32, level with it on lanes of 448)
        memory_gb = 0.25 * bytes_per_token / target_bytes
    elif memory_gb is None:
        memory_gb = 0.9 * torch.cuda.mem_get_info(weight.device)[0] / 2**30
    budget_blocks = int(memory_gb * 2**30 // (bytes_per_token * block_size))
    needed = -(-max_num_seqs * max_model_len // block_size)
    if budget_blocks < -(-max_model_len // block_size):
        raise ValueError(f"a KV cache of {memory_gb:.3g} GiB holds {budget_blocks * block_size} tokens, less than "
                         f"one {max_model_len}-token sequence; raise the KV cache memory or lower max_model_len")
    return min(needed, budget_blocks)


def load_draft_for(config: SpeculativeConfig, target):
    """The draft head for `config.method`: the target's own MTP layer, an EAGLE-3 or a DFlash checkpoint."""
    if config.method == "mtp":
        from eyas.models.mtp import MTPDraft

        return MTPDraft(target)
    if config.method == "dflash":
        return load_dflash_draft(config.draft_model, target)
    return load_draft(config.draft_model, target, aux_convention=config.aux_layer_convention,
                      allow_unused_weights=config.allow_unused_draft_weights)


def think_token_ids(tokenizer) -> tuple[int, int] | None:
    if tokenizer is None:
        return None
    vocab = tokenizer.get_vocab()
    if "<think>" in vocab and "</think>" in vocab:
        return vocab["<think>"], vocab["</think>"]
    return None


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    path = Path(path)
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        return None
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    # eyas checks lengths itself, against the model's context, with an error naming both: transformers' own warning
    # about model_max_length ("... will result in indexing errors") would come first and say less
    tokenizer.model_max_length = int(1e30)
    return tokenizer
