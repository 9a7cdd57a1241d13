"""A small client for a running OpenAI-compatible server (vLLM, SGLang, MAX, `eyas serve`): chat requests with
retries, and the speculative-decoding counters of its Prometheus /metrics. `eyas regenerate --server` and `eyas eval
--server` use it when the target runs on a cluster instead of in this process."""

from __future__ import annotations

import time
from dataclasses import dataclass

import httpx

# vLLM's names (eyas serve exposes the same); a counter may carry prometheus' _total suffix
SPEC_COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens")
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"
RETRIED_STATUSES = (429, 500, 502, 503, 504)


def parse_spec_counters(text: str) -> dict[str, float]:
    """The speculative-decoding counters of a Prometheus /metrics text, summed over label sets, by vLLM's names (the
    per-position one under "per_pos:K" for position K); {} when the server has none."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0].removesuffix("_total")
        value = float(line.rsplit(" ", 1)[1])
        if name in SPEC_COUNTERS:
            values[name] = values.get(name, 0.0) + value
        elif name == PER_POSITION and 'position="' in line:
            key = "per_pos:" + line.split('position="', 1)[1].split('"', 1)[0]
            values[key] = values.get(key, 0.0) + value
    return values


class ServerError(ValueError):
    """A server that refused, failed or could not be reached, naming the URL and what happened."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status  # the HTTP status, when the server answered


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


class ServerClient:
    def __init__(self, url: str, model: str | None = None, api_key: str | None = None, timeout: float = 600.0,
                 retries: int = 4, backoff: float = 1.0, transport: httpx.BaseTransport | None = None) -> None:
        """`model`: the served model name (default: the first of /v1/models). A request that fails to connect, times
        out or gets 429/5xx is retried `retries` times, waiting backoff, 2 x backoff, ...; any other refusal is a
        ServerError at once."""
        self.url = url.rstrip("/")
        self.retries, self.backoff = retries, backoff
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout, transport=transport)
        self.model = model or self.request("GET", "/v1/models")["data"][0]["id"]

    def request(self, method: str, path: str, body: dict | None = None):
        """One request with the retries described above: the JSON answer (the text of /metrics)."""
        for attempt in range(self.retries + 1):
            try:
                r = self.http.request(method, path, json=body)
            except httpx.TransportError as e:  # connection refused, reset, timed out
                if attempt == self.retries:
                    raise ServerError(f"{self.url}{path}: {type(e).__name__}: {e or 'no response'} (after "
                                      f"{self.retries + 1} tries)") from e
            else:
                if r.status_code < 400:
                    return r.json() if path != "/metrics" else r.text
                if r.status_code not in RETRIED_STATUSES or attempt == self.retries:
                    raise ServerError(f"{self.url}{path}: HTTP {r.status_code}: {r.text[:300]}", r.status_code)
            time.sleep(self.backoff * 2 ** attempt)
        raise AssertionError("unreachable")

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
        data = self.request("POST", path, body)
        choice = data["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        meta = data.get("meta_info") or choice.get("meta_info") or {}
        steps = meta.get("spec_verify_ct")
        histogram = meta.get("spec_accept_histogram")
        return ChatResult(text or "", data["usage"]["completion_tokens"], choice["finish_reason"],
                          choice.get("token_ids"), int(steps) if steps is not None else None,
                          [int(h) for h in histogram] if histogram else None)

    def spec_counters(self) -> dict[str, float]:
        """The speculative-decoding counters of the server's /metrics (see parse_spec_counters); {} when it serves
        no /metrics (SGLang without --enable-metrics)."""
        try:
            return parse_spec_counters(self.request("GET", "/metrics"))
        except ServerError as e:
            if e.status == 404:
                return {}
            raise

    def close(self) -> None:
        self.http.close()


def add_server_args(parser, concurrency: int, concurrency_help: str) -> None:
    """The flags every command that talks to a running server shares (beside its own --server URL)."""
    parser.add_argument("--served-model-name", help="with --server: the model name to send (default: the first of "
                        "its /v1/models)")
    parser.add_argument("--api-key", help="with --server: sent as 'Authorization: Bearer KEY'")
    parser.add_argument("--concurrency", type=int, default=concurrency, help=f"with --server: {concurrency_help}")
    parser.add_argument("--request-timeout", type=float, default=600.0, metavar="S", help="with --server: seconds "
                        "one request may take")
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
