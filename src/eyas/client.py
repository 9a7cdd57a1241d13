"""A small client for a running OpenAI-compatible server (vLLM, SGLang, MAX, `eyas serve`): chat requests with
retries, and the speculative-decoding counters of its Prometheus /metrics. `eyas regenerate --server` and `eyas eval
--server` use it when the target runs on a cluster instead of in this process.

A server is not trusted to behave: each request has a wall-clock deadline (connecting, sending and reading the whole
answer), an answer larger than `max_response_bytes` is refused as soon as it passes the cap, and an answer of the
wrong shape or type is a one-line ServerError naming the URL and the field."""

from __future__ import annotations

import json
import math
import re
import threading
import time
from dataclasses import dataclass

import httpcore
import httpx

# vLLM's names (eyas serve exposes the same); a counter may carry prometheus' _total suffix
SPEC_COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens")
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"
METRIC_NAME = re.compile(r"[^{\s]*")
RETRIED_STATUSES = (429, 500, 502, 503, 504)
# The largest legitimate answers are a long completion's token ids (return_token_ids also echoes the prompt's: a
# million-token prompt is ~7 MiB of JSON) and the /metrics of a big deployment (a few MiB with many label sets);
# 64 MiB is well above both, and small enough that the parsed JSON cannot exhaust the host's memory.
MAX_RESPONSE_BYTES = 64 * 2**20
ERROR_PREVIEW_BYTES = 4096  # of a refusal's body, for its message


class ServerError(ValueError):
    """A server that refused, failed or could not be reached, naming the URL and what happened."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status  # the HTTP status, when the server answered


class DeadlineExceeded(httpx.TimeoutException):
    """The answer was still arriving when the request's deadline passed (a timeout, so it is retried)."""


# -- /metrics -------------------------------------------------------------------------------------------------------

def parse_spec_counters(text: str) -> dict[str, float]:
    """The speculative-decoding counters of a Prometheus /metrics text, summed over label sets, by vLLM's names (the
    per-position one under "per_pos:K" for position K); {} when the server has none. A malformed sample of those
    counters is a ValueError naming its line; other metrics are not read."""
    values: dict[str, float] = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        full_name = METRIC_NAME.match(line).group()
        name = full_name.removesuffix("_total")
        if name not in SPEC_COUNTERS and name != PER_POSITION:
            continue
        try:
            labels, value = _parse_sample(line[len(full_name):])
            position = labels.get("position", "")
            if name == PER_POSITION and not (position.isascii() and position.isdigit()):
                raise ValueError(f"position {position!r}; expected a whole number")
        except ValueError as e:
            raise ValueError(f"line {lineno} ({line[:80]!r}): {e}") from None
        key = f"per_pos:{int(position)}" if name == PER_POSITION else name
        values[key] = values.get(key, 0.0) + value
    return values


# Not prometheus_client.parser's: it reads `name 1 2 3` as the value 1 at the timestamp 3, reports a label value
# without its closing quote as a bad metric name or value (in words that change between its releases), and on a whole
# text stops at the first malformed line of any metric, where only the speculative counters matter here.
def _parse_sample(after_name: str) -> tuple[dict[str, str], float]:
    """The labels and value of one sample line of the Prometheus text format, `name{label="value",...} value
    [timestamp]`, from what follows its name: label values may hold spaces, braces and the escapes \\\\, \\" and
    \\n; the value is a float (NaN, +Inf and -Inf included), the optional timestamp an integer in milliseconds."""
    labels: dict[str, str] = {}
    rest = after_name.lstrip()
    if rest.startswith("{"):
        i = 1
        while True:
            while i < len(rest) and rest[i] in " \t,":
                i += 1
            if i < len(rest) and rest[i] == "}":
                break
            equals = rest.find("=", i)
            if equals < 0:
                raise ValueError("a label without '='")
            label = rest[i:equals].strip()
            i = equals + 1
            while i < len(rest) and rest[i] in " \t":
                i += 1
            if i == len(rest) or rest[i] != '"':
                raise ValueError(f"label {label!r} has no quoted value")
            value, i = _quoted(rest, i + 1)
            labels[label] = value
        rest = rest[i + 1:]
    fields = rest.split()
    if not 1 <= len(fields) <= 2:
        raise ValueError(f"expected a value and at most a timestamp after the name and labels, got {rest.strip()!r}")
    try:
        number = float(fields[0])
    except ValueError:
        raise ValueError(f"the value {fields[0]!r} is not a number") from None
    if len(fields) == 2 and not fields[1].lstrip("-").isdigit():
        raise ValueError(f"the timestamp {fields[1]!r} is not an integer")
    return labels, number


def _quoted(text: str, i: int) -> tuple[str, int]:
    """The label value starting at text[i] (after its opening quote), unescaped, and the index after its closing
    quote."""
    out = []
    while i < len(text):
        c = text[i]
        if c == "\\" and i + 1 < len(text):
            out.append({"n": "\n"}.get(text[i + 1], text[i + 1]))
            i += 2
        elif c == '"':
            return "".join(out), i + 1
        else:
            out.append(c)
            i += 1
    raise ValueError("a label value without its closing quote")


def counter_deltas(url: str, before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    """after - before for every counter in `after` (one absent before counts from 0), as whole numbers. A counter
    that is not a finite whole number, went backwards or disappeared is a ServerError naming the server and the
    counter: a delta across a restart or a reset would read as a meaningless acceptance."""
    gone = sorted(before.keys() - after.keys())
    if gone:
        raise ServerError(f"{url}/metrics: counter {_counter_name(gone[0])} disappeared (it was {before[gone[0]]:g}): "
                          "the server restarted or the counter was reset; rerun")
    deltas = {}
    for name, value in after.items():
        old = before.get(name, 0.0)
        for count in (old, value):
            if not math.isfinite(count) or count < 0 or count != int(count):
                raise ServerError(f"{url}/metrics: counter {_counter_name(name)} is {count:g}; expected a whole "
                                  "number of at least 0")
        if value < old:
            raise ServerError(f"{url}/metrics: counter {_counter_name(name)} went from {old:g} to {value:g}: the "
                              "server restarted or the counter was reset; rerun")
        deltas[name] = int(value) - int(old)
    return deltas


def _counter_name(key: str) -> str:
    """The /metrics name of a key of parse_spec_counters."""
    if key.startswith("per_pos:"):
        return f'{PER_POSITION}{{position="{key.removeprefix("per_pos:")}"}}'
    return key


# -- answers --------------------------------------------------------------------------------------------------------

@dataclass(slots=True)
class ChatResult:
    text: str
    completion_tokens: int
    finish_reason: str
    token_ids: list[int] | None = None  # when the server returns them (vLLM and eyas do with return_token_ids)
    # SGLang's own count for this response (meta_info.spec_verify_ct), when it gives one: verify steps, and how many
    # of them accepted 0, 1, 2, ... drafts (spec_accept_histogram)
    spec_verify_steps: int | None = None
    spec_accept_histogram: list[int] | None = None


_MISSING = object()


def _get(data: object, *keys: str | int) -> object:
    """data[k0][k1]..., or _MISSING where a level is absent or of the wrong container type."""
    for key in keys:
        if isinstance(key, int) and isinstance(data, list) and -len(data) <= key < len(data):
            data = data[key]
        elif isinstance(key, str) and isinstance(data, dict) and key in data:
            data = data[key]
        else:
            return _MISSING
    return data


def _show(value: object) -> str:
    if value is _MISSING:
        return "missing"
    text = json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def _wrong(where: str, field: str, value: object, expected: str) -> ServerError:
    return ServerError(f"{where}: the answer's {field} is {_show(value)}; expected {expected}")


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _counts(where: str, field: str, value: object) -> list[int] | None:
    """A list of non-negative ints, or None when absent."""
    if value is _MISSING or value is None:
        return None
    if not isinstance(value, list):
        raise _wrong(where, field, value, "a list of whole numbers of at least 0")
    for i, v in enumerate(value):
        if not _is_count(v):
            raise _wrong(where, f"{field}[{i}]", v, "a whole number of at least 0")
    return value


def parse_generation(where: str, data: dict) -> ChatResult:
    """The ChatResult of a /v1/chat/completions or /v1/completions answer, every field it reads checked."""
    choice = _get(data, "choices", 0)
    if not isinstance(choice, dict):
        raise _wrong(where, "choices", _get(data, "choices"), "a non-empty list of objects")
    if "message" in choice:
        if not isinstance(choice["message"], dict):
            raise _wrong(where, "choices[0].message", choice["message"], "an object")
        field, text = "choices[0].message.content", choice["message"].get("content")  # None: tool calls only
    elif "text" in choice:
        field, text = "choices[0].text", choice["text"]
    else:
        raise ServerError(f"{where}: the answer's choices[0] has neither message nor text")
    if text is not None and not isinstance(text, str):
        raise _wrong(where, field, text, "a string")
    tokens = _get(data, "usage", "completion_tokens")
    if not _is_count(tokens):
        raise _wrong(where, "usage.completion_tokens", tokens, "a whole number of at least 0")
    finish = _get(choice, "finish_reason")
    if not isinstance(finish, str):
        raise _wrong(where, "choices[0].finish_reason", finish, "a string")
    token_ids = _counts(where, "choices[0].token_ids", _get(choice, "token_ids"))
    meta_field = "meta_info" if data.get("meta_info") else "choices[0].meta_info"
    meta = data.get("meta_info") or choice.get("meta_info") or {}
    if not isinstance(meta, dict):
        raise _wrong(where, meta_field, meta, "an object")
    steps = meta.get("spec_verify_ct")
    if steps is not None and not _is_count(steps):
        raise _wrong(where, f"{meta_field}.spec_verify_ct", steps, "a whole number of at least 0")
    histogram = _counts(where, f"{meta_field}.spec_accept_histogram", meta.get("spec_accept_histogram"))
    return ChatResult(text or "", tokens, finish, token_ids, steps, histogram or None)


# -- the client -----------------------------------------------------------------------------------------------------

class ServerClient:
    def __init__(self, url: str, model: str | None = None, api_key: str | None = None, timeout: float = 600.0,
                 retries: int = 4, backoff: float = 1.0, transport: httpx.BaseTransport | None = None,
                 max_response_bytes: int = MAX_RESPONSE_BYTES) -> None:
        """`model`: the served model name (default: the first of /v1/models). A request may take `timeout` seconds
        in all, from connecting to the last byte of its answer. One that fails to connect, times out (the deadline
        included) or gets 429/5xx is retried `retries` times, waiting backoff, 2 x backoff, ...; any other refusal,
        an answer over `max_response_bytes` or one of the wrong shape is a ServerError at once."""
        self.url = url.rstrip("/")
        self.timeout, self.retries, self.backoff = timeout, retries, backoff
        self.max_response_bytes = max_response_bytes
        # compressed answers would be inflated before the size cap sees them
        headers = {"Accept-Encoding": "identity"} | ({"Authorization": f"Bearer {api_key}"} if api_key else {})
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout, transport=transport)
        self._deadline = threading.local()  # .end: the monotonic deadline of the request this thread is making
        self.model = model or self._served_model()

    def request(self, method: str, path: str, body: dict | None = None) -> dict | str:
        """One request with the retries described above: the JSON object answered (the text of /metrics)."""
        where = f"{self.url}{path}"
        for attempt in range(self.retries + 1):
            try:
                status, content = self._send(method, path, body)
            except httpx.TransportError as e:  # connection refused, reset, timed out
                if attempt == self.retries:
                    tries = f"after {self.retries + 1} {'try' if self.retries == 0 else 'tries'}"
                    detail = (f"no complete answer within {self.timeout:g} s" if isinstance(e, httpx.TimeoutException)
                              else " ".join(str(e).split()) or "no response")
                    raise ServerError(f"{where}: {type(e).__name__}: {detail} ({tries})") from e
            else:
                if status < 400:
                    return _decode(where, content) if path != "/metrics" else content.decode(errors="replace")
                if status not in RETRIED_STATUSES or attempt == self.retries:
                    preview = " ".join(content.decode(errors="replace").split())[:300]
                    raise ServerError(f"{where}: HTTP {status}: {preview}", status)
            time.sleep(self.backoff * 2 ** attempt)
        raise AssertionError("unreachable")

    def _send(self, method: str, path: str, body: dict | None) -> tuple[int, bytes]:
        """(status, body) of one try, its whole answer read before the deadline."""
        end = self._deadline.end = time.monotonic() + self.timeout
        try:
            with self.http.stream(method, path, json=body, extensions={"trace": self._trace}) as r:
                limit = self.max_response_bytes if r.status_code < 400 else ERROR_PREVIEW_BYTES
                declared = r.headers.get("content-length", "")
                if r.status_code < 400 and declared.isdigit() and int(declared) > limit:
                    raise ServerError(f"{self.url}{path}: the answer is {int(declared)} bytes; at most {limit} "
                                      "are read")
                chunks, size = [], 0
                for chunk in r.iter_bytes():
                    if time.monotonic() > end:
                        raise DeadlineExceeded("the deadline passed while the answer arrived")
                    size += len(chunk)
                    if size > limit:
                        if r.status_code >= 400:  # enough to say why it refused
                            chunks.append(chunk[:limit - size])
                            break
                        raise ServerError(f"{self.url}{path}: the answer is larger than {limit} bytes; stopped "
                                          "reading there")
                    chunks.append(chunk)
                return r.status_code, b"".join(chunks)
        finally:
            self._deadline.end = None

    def _trace(self, event: str, info: dict) -> None:
        """httpx bounds each read of a socket, not a request: a server that sends a byte now and then, in its
        headers or its body, would hold a request forever. So every stream this client opens bounds each read
        and write by the deadline of the request using it (kept per thread: httpx's sync I/O runs in the caller's
        thread, and a pooled connection serves one request at a time)."""
        stream = info.get("return_value")
        if event.endswith(("connect_tcp.complete", "start_tls.complete")) and stream is not None:
            stream.read = _before_deadline(stream.read, self._deadline, httpcore.ReadTimeout)
            stream.write = _before_deadline(stream.write, self._deadline, httpcore.WriteTimeout)

    def _served_model(self) -> str:
        model = _get(self.request("GET", "/v1/models"), "data", 0, "id")
        if not isinstance(model, str) or not model:
            raise ServerError(f"{self.url}/v1/models: the answer's data[0].id is {_show(model)}; expected the "
                              "served model's name (or pass --served-model-name)")
        return model

    def chat(self, messages: list[dict], max_tokens: int, temperature: float = 0.0,
             seed: int | None = None) -> ChatResult:
        """One chat completion; the server renders the chat template."""
        return self._generate("/v1/chat/completions", {"messages": messages}, max_tokens, temperature, seed)

    def completion(self, prompt: str, max_tokens: int, temperature: float = 0.0,
                   seed: int | None = None) -> ChatResult:
        """One text completion of a raw prompt."""
        return self._generate("/v1/completions", {"prompt": prompt}, max_tokens, temperature, seed)

    def _generate(self, path: str, prompt: dict, max_tokens: int, temperature: float,
                  seed: int | None) -> ChatResult:
        body = {"model": self.model, **prompt, "max_tokens": max_tokens, "temperature": temperature,
                "return_token_ids": True}
        if seed is not None:
            body["seed"] = seed
        return parse_generation(f"{self.url}{path}", self.request("POST", path, body))

    def spec_counters(self) -> dict[str, float]:
        """The speculative-decoding counters of the server's /metrics (see parse_spec_counters); {} when it serves
        no /metrics (SGLang without --enable-metrics)."""
        try:
            text = self.request("GET", "/metrics")
        except ServerError as e:
            if e.status == 404:
                return {}
            raise
        try:
            return parse_spec_counters(text)
        except ValueError as e:
            raise ServerError(f"{self.url}/metrics: {e}") from None

    def close(self) -> None:
        self.http.close()


def _decode(where: str, content: bytes) -> dict:
    try:
        data = json.loads(content)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ServerError(f"{where}: the answer is not JSON ({type(e).__name__}: {str(e)[:100]})") from None
    if not isinstance(data, dict):
        raise ServerError(f"{where}: the answer is a JSON {type(data).__name__}; expected an object")
    return data


def _before_deadline(io, deadline: threading.local, timeout_error: type[Exception]):
    """`io(data, timeout)` with its timeout cut to what is left of the calling thread's request deadline."""
    def bounded(data, timeout: float | None = None):
        end = getattr(deadline, "end", None)
        if end is not None:
            left = end - time.monotonic()
            if left <= 0:
                raise timeout_error("the request's deadline passed")
            timeout = left if timeout is None else min(timeout, left)
        return io(data, timeout)

    return bounded


def add_server_args(parser, concurrency: int, concurrency_help: str) -> None:
    """The flags every command that talks to a running server shares (beside its own --server URL)."""
    parser.add_argument("--served-model-name", help="with --server: the model name to send (default: the first of "
                        "its /v1/models)")
    parser.add_argument("--api-key", help="with --server: sent as 'Authorization: Bearer KEY'")
    parser.add_argument("--concurrency", type=int, default=concurrency, help=f"with --server: {concurrency_help}")
    parser.add_argument("--request-timeout", type=float, default=600.0, metavar="S", help="with --server: seconds "
                        "one request may take in all, from connecting to the last byte of its answer; one still "
                        "unfinished then counts as timed out (retried, see --retries). An answer over "
                        f"{MAX_RESPONSE_BYTES // 2**20} MiB is refused")
    parser.add_argument("--retries", type=int, default=4, help="with --server: tries after the first for a request "
                        "that fails to connect, times out or gets 429/5xx, waiting 1, 2, 4, ... s between them")


def client_from_args(args) -> ServerClient:
    """The ServerClient for `--server` and the flags of `add_server_args`."""
    if args.concurrency < 1:
        raise ValueError(f"--concurrency is {args.concurrency}; expected at least 1")
    if args.retries < 0 or args.request_timeout <= 0:
        raise ValueError("--retries must be at least 0 and --request-timeout positive")
    return ServerClient(args.server, args.served_model_name, args.api_key, timeout=args.request_timeout,
                        retries=args.retries)
