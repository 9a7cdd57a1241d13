"""The server's engine loop: one thread owns the `LLM` (and its tokenizer) and is the only caller of `step()`.

Handlers never touch the LLM. They `submit` a request and read `Update`s from the request's asyncio queue:

    handler --submit/abort--> inbox (queue.Queue) --> engine thread: add / abort / step / detokenize
    handler <--Update | ApiError-- request.queue (asyncio.Queue, fed with loop.call_soon_threadsafe)

The first item a request receives says whether it was admitted (an empty Update) or refused (an ApiError), so a
streaming handler knows its status code before it sends headers. An abort is applied between two steps: the
sequence finishes with reason "abort", its KV blocks go back to the allocator before the next step runs, and the
request receives a last Update with finish_reason "abort". A request added and aborted between two steps never
runs: a client that gives up before its first token costs no prefill.

Work whose cost the client controls never runs on the engine thread or the event loop: `prepare` checks the
sampling values and the grammar's size, compiles the grammar (within `grammar_timeout`), renders the chat template
and tokenizes, in a small pool of worker threads, before the request is submitted as token ids. One 5 MB prompt
then costs its own request seconds, not every stream a pause.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from eyas.engine.llm import LLM, PromptTooLong
from eyas.engine.sampling import TokenLogprobs
from eyas.engine.sequence import Sequence
from eyas.sampling_params import SamplingParams
from eyas.serve.limits import GRAMMAR_TIMEOUT_S
from eyas.serve.metrics import ServerMetrics
from eyas.serve.protocol import ApiError, LogprobEntry

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05  # how long the idle loop blocks on the inbox before checking for shutdown
PREPARE_WORKERS = 2  # threads that tokenize and compile grammars; requests past them wait their turn
# the seconds a thread holding the GIL runs on before it yields to one waiting for it (Python's default: 0.005). The
# engine thread drops the GIL in every kernel and waits for it after each, while the event loop formats the streams
# of the step before: at Python's default a step of 16 sequences waited up to 5 ms a time. Held-out prompts at c=16
# on the bundled target, 2 cores, three interleaved pairs: median decode step 22.0 / 21.0 / 18.3 ms at the default,
# 20.5 / 19.0 / 18.3 at 0.0002; output tok/s 1.04-1.11x
GIL_SWITCH_S = 0.0002


@dataclass(slots=True)
class Update:
    text: str  # text new since the previous update
    token_ids: list[int]  # tokens new since the previous update
    num_prompt_tokens: int
    num_generated: int  # all generated tokens so far
    finish_reason: str | None = None  # "stop" | "length" on the last update; "abort" when cancelled
    logprobs: list[LogprobEntry] | None = None  # for the new tokens, when the request asked for them


@dataclass(eq=False)
class EngineRequest:
    prompt: str | list[int] | list[dict]
    params: SamplingParams
    fill_context: bool  # no max_tokens given: generate up to the end of the context
    loop: asyncio.AbstractEventLoop
    param: str = "prompt"  # the request field an error about the prompt names ("prompt" or "messages")
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrival: float = field(default_factory=time.perf_counter)
    seq: Sequence | None = None
    # engine-thread state: what has been sent so far, and the incremental detokenizer's place (`_text`)
    sent_text: str = ""
    num_sent_tokens: int = 0
    decoded_text: str = ""  # the text of generated_ids[:read_offset], as decoded piece by piece
    prefix_offset: int = 0
    read_offset: int = 0

    def deliver(self, item: Update | ApiError) -> None:
        _deliver_all(self.loop, [(self.queue, item)])


def _deliver_all(loop: asyncio.AbstractEventLoop, items: list[tuple[asyncio.Queue, Update | ApiError]]) -> None:
    """Put each item on its queue, from the engine thread, in one call into the event loop."""
    try:
        loop.call_soon_threadsafe(_put_each, items)
    except RuntimeError:  # the event loop is closed: the server is shutting down
        pass


def _put_each(items: list[tuple[asyncio.Queue, Update | ApiError]]) -> None:
    for queue_, item in items:
        queue_.put_nowait(item)


class EngineLoop:
    def __init__(self, llm: LLM, metrics: ServerMetrics, grammar_timeout: float = GRAMMAR_TIMEOUT_S,
                 max_prompt_tokens: int | None = None) -> None:
        self.llm = llm
        self.metrics = metrics
        self.grammar_timeout = grammar_timeout
        self.max_prompt_tokens = min(max_prompt_tokens or llm.max_model_len, llm.max_model_len)
        # no prompt of max_prompt_tokens tokens is longer than this, so a longer one is refused before tokenizing
        tokenizer = llm.tokenizer
        longest_token = max(map(len, tokenizer.get_vocab())) if tokenizer is not None else 1
        self.max_prompt_chars = self.max_prompt_tokens * longest_token
        self.pool = ThreadPoolExecutor(PREPARE_WORKERS, thread_name_prefix="eyas-prepare")
        self.inbox: queue.Queue[tuple[str, EngineRequest]] = queue.Queue()
        self.live: dict[int, EngineRequest] = {}  # seq_id -> request, engine thread only
        self._stopping = threading.Event()
        self._switch_interval: float | None = None
        self._thread = threading.Thread(target=self._run, name="eyas-engine", daemon=True)
        spec = llm.speculative_config
        self._draft_slack = spec.max_num_tokens if spec is not None else 0

    # -- called from the event loop -------------------------------------------------------------------------------
    def start(self) -> None:
        self._switch_interval = sys.getswitchinterval()  # the process's, back at stop()
        sys.setswitchinterval(GIL_SWITCH_S)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(timeout=10)
        if self._switch_interval is not None:
            sys.setswitchinterval(self._switch_interval)
        self.pool.shutdown(wait=False, cancel_futures=True)

    async def prepare(self, make_params, prompt: str | list[int] | list[dict], param: str,
                      grammar_param: str = "response_format") -> tuple[SamplingParams, list[int]]:
        """(SamplingParams, prompt token ids) for a request, computed in the worker pool: `make_params()` (the
        values and the grammar's size checked), the grammar compiled within `grammar_timeout` seconds, the prompt
        rendered and tokenized and its length checked. Each failure is an ApiError naming the field."""
        loop = asyncio.get_running_loop()

        def params_and_grammar() -> SamplingParams:
            params = make_params()
            if params.structured_output is not None:
                try:
                    self.llm.grammar_cache().compile(params.structured_output)
                except ValueError as e:
                    raise ApiError(400, str(e), param=grammar_param) from e
            return params

        future = loop.run_in_executor(self.pool, params_and_grammar)
        try:
            params = await asyncio.wait_for(asyncio.shield(future), self.grammar_timeout)
        except asyncio.TimeoutError as e:  # the compile goes on in its worker; its result is cached for later
            raise ApiError(400, f"the requested grammar took longer than {self.grammar_timeout:g} s to compile "
                           "(the server's --grammar-timeout); simplify the schema or regex",
                           param=grammar_param) from e
        ids = await loop.run_in_executor(self.pool, self._encode, prompt, param)
        return params, ids

    def _encode(self, prompt: str | list[int] | list[dict], param: str) -> list[int]:
        chars = len(prompt) if isinstance(prompt, str) else sum(
            len(m["content"]) for m in prompt if isinstance(m, dict) and isinstance(m.get("content"), str))
        if chars > self.max_prompt_chars:
            raise ApiError(400, f"{param} has {chars} characters; this server takes at most {self.max_prompt_tokens} "
                           f"tokens (--max-prompt-tokens), and no prompt that long has over {self.max_prompt_chars} "
                           "characters", param=param, code="context_length_exceeded")
        try:
            ids = self.llm.encode(prompt)
        except Exception as e:  # no tokenizer, or the chat template refused the messages
            raise ApiError(400, f"{param} could not be tokenized: {e}", param=param) from e
        if not ids:
            raise ApiError(400, f"{param} is empty after tokenization", param=param)
        context = self.llm.max_model_len
        if len(ids) >= context:
            raise ApiError(400, f"{param} has {len(ids)} tokens; this model's context holds {context} (the prompt "
                           "plus at least one generated token must fit)", param=param, code="context_length_exceeded")
        if len(ids) > self.max_prompt_tokens:
            raise ApiError(400, f"{param} has {len(ids)} tokens; this server takes at most {self.max_prompt_tokens} "
                           "(--max-prompt-tokens)", param=param, code="context_length_exceeded")
        return ids

    def submit(self, prompt: str | list[int] | list[dict], params: SamplingParams, fill_context: bool,
               param: str = "prompt") -> EngineRequest:
        req = EngineRequest(prompt, params, fill_context, asyncio.get_running_loop(), param)
        self.inbox.put(("add", req))
        return req

    def abort(self, req: EngineRequest) -> None:
        """Cancel `req` if it is still running (a no-op once it has finished)."""
        self.inbox.put(("abort", req))

    # -- the engine thread ----------------------------------------------------------------------------------------
    def _run(self) -> None:
        scheduler = self.llm.scheduler
        while not self._stopping.is_set():
            self._drain(block=not scheduler.has_work())
            if not scheduler.has_work():
                continue
            try:
                self.llm.step()
                self._publish()
            except Exception as e:  # an engine bug: fail what is running rather than spin on it
                log.exception("engine step failed")
                for req in list(self.live.values()):
                    self._finish(req, "abort")
                    req.deliver(ApiError(500, f"engine step failed: {type(e).__name__}: {e}"))
        for req in list(self.live.values()):
            self._cancel(req)

    def _drain(self, block: bool) -> None:
        try:
            item = self.inbox.get(timeout=IDLE_WAIT_S) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, req = item
            if kind == "add":
                self._add(req)
            elif req.seq is not None and req.seq.seq_id in self.live:
                self._cancel(req)
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _add(self, req: EngineRequest) -> None:
        try:
            req.seq = self._admit(req)
        except ApiError as e:
            req.deliver(e)
            return
        except Exception as e:  # a bug, not the client's fault; the engine thread must survive it
            log.exception("admitting a request failed")
            req.deliver(ApiError(500, f"could not admit the request: {type(e).__name__}: {e}"))
            return
        self.live[req.seq.seq_id] = req
        req.deliver(Update("", [], req.seq.num_prompt_tokens, 0))

    def _admit(self, req: EngineRequest) -> Sequence:
        """Check the request against the engine's state; anything wrong with it is a 400 that names the field.
        A prepared request arrives as token ids, so `_encode` here only re-checks their length."""
        llm, params, param = self.llm, req.params, req.param
        ids = self._encode(req.prompt, param)
        context = llm.max_model_len
        allocator = llm.allocator
        if req.fill_context:  # up to the end of the context, or of the KV cache if that is smaller
            capacity = allocator.num_blocks * allocator.block_size - self._draft_slack
            params.max_tokens = max(1, min(context, capacity) - len(ids))
        elif len(ids) + params.max_tokens > context:
            raise ApiError(400, f"max_tokens is {params.max_tokens}; the prompt has {len(ids)} tokens and this "
                           f"model's context holds {context}, so at most {context - len(ids)} can be generated",
                           param="max_tokens", code="context_length_exceeded")
        if allocator.blocks_for(len(ids) + params.max_tokens + self._draft_slack) > allocator.num_blocks:
            raise ApiError(400, f"the prompt ({len(ids)} tokens) plus max_tokens ({params.max_tokens}) needs more "
                           f"KV cache than this server has ({allocator.num_blocks * allocator.block_size} tokens)",
                           param="max_tokens", code="context_length_exceeded")
        try:
            return llm.add_request(ids, params)
        except (PromptTooLong, ValueError) as e:
            raise ApiError(400, f"{param}: {e}", param=param) from e

    def _publish(self) -> None:
        """Send each live request the text and tokens it has not seen yet; retire the finished ones. A step's
        updates reach the event loop in one wake-up, not one per request (each a write to the loop's pipe and a
        turn of its selector, with the engine thread waiting for the lock the event loop holds)."""
        updates: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Update]]] = {}
        for req in list(self.live.values()):
            seq = req.seq
            if seq.num_generated == req.num_sent_tokens and not seq.is_finished:
                continue
            text = self._text(req, seq, final=seq.is_finished)
            delta = text[len(req.sent_text):] if text.startswith(req.sent_text) else ""
            new_ids = seq.generated_ids[req.num_sent_tokens:]
            logprobs = self._logprob_entries(seq.logprobs[req.num_sent_tokens:]) \
                if seq.params.logprobs is not None else None
            req.sent_text += delta
            req.num_sent_tokens = seq.num_generated
            if seq.is_finished:
                self._finish(req, seq.finish_reason)
            updates.setdefault(req.loop, []).append((req.queue, Update(
                delta, new_ids, seq.num_prompt_tokens, seq.num_generated,
                seq.finish_reason if seq.is_finished else None, logprobs)))
        for loop, items in updates.items():
            _deliver_all(loop, items)

    def _logprob_entries(self, logprobs: list[TokenLogprobs]) -> list[LogprobEntry]:
        """Token ids -> text here, in the thread that owns the tokenizer. Each token is decoded alone, so a piece
        of a multi-byte character shows as U+FFFD (as in vLLM)."""
        tokenizer = self.llm.tokenizer

        def text(token_id: int) -> str:
            return tokenizer.decode([token_id]) if tokenizer is not None else str(token_id)

        return [{"token": text(token_id), "logprob": logprob, "top": [[text(t), lp] for t, lp in top]}
                for token_id, logprob, top in logprobs]

    def _text(self, req: EngineRequest, seq: Sequence, final: bool) -> str:
        """The generated text, cut at the first stop string (as the engine cuts it). Until the end, hold back
        what could still turn out to be the start of a stop string or of a multi-byte character.

        While streaming, only the new tokens are decoded (with a few before them, so that byte-level pieces join as
        in a whole decode): decoding the whole output at every update would cost O(n^2) over a long answer. The
        last update decodes the whole output once, so the text sent adds up to exactly the decoded output."""
        tokenizer = self.llm.tokenizer
        if tokenizer is None:
            return ""
        ids = seq.generated_ids
        if final:
            text = tokenizer.decode(ids, skip_special_tokens=True)
        else:
            before = tokenizer.decode(ids[req.prefix_offset:req.read_offset], skip_special_tokens=True)
            after = tokenizer.decode(ids[req.prefix_offset:], skip_special_tokens=True)
            if len(after) > len(before) and not after.endswith("\ufffd"):  # a whole character more
                req.decoded_text += after[len(before):]
                req.prefix_offset, req.read_offset = req.read_offset, len(ids)
            text = req.decoded_text
        stops = seq.params.stop
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            return text[:min(hits)]
        if final:
            return text
        if stops:
            text = text[:len(text) - (max(len(s) for s in stops) - 1)]
        return text.rstrip("\ufffd")

    def _cancel(self, req: EngineRequest) -> None:
        """Abort a live request and tell its handler, which may be waiting for its next update."""
        self._finish(req, "abort")
        seq = req.seq
        req.deliver(Update("", [], seq.num_prompt_tokens, seq.num_generated, "abort"))

    def _finish(self, req: EngineRequest, reason: str) -> None:
        seq = req.seq
        self.live.pop(seq.seq_id, None)
        if reason == "abort":
            self.llm.abort(seq)
        end = seq.finish_time or time.perf_counter()
        ttft = seq.first_token_time - req.arrival if seq.first_token_time else None
        tpot = (end - seq.first_token_time) / (seq.num_generated - 1) \
            if seq.first_token_time and seq.num_generated > 1 else None
        self.metrics.finished(reason, seq.num_prompt_tokens, seq.num_generated, ttft, tpot)
