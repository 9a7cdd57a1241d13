"""`eyas serve`: an OpenAI-compatible HTTP server over one `LLM`.

Endpoints: POST /v1/completions and /v1/chat/completions (both stream as Server-Sent Events with `stream: true`),
GET /v1/models, /health and /metrics (Prometheus text). Every refusal is a 4xx with an OpenAI error body. The engine
runs in one background thread (see engine.py); a client that disconnects cancels its request and frees its KV
blocks before the next step.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import secrets
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from eyas.engine.llm import LLM
from eyas.engine_args import EngineArgs
from eyas.serve.engine import EngineLoop, EngineRequest, Update
from eyas.serve.limits import GRAMMAR_TIMEOUT_S, MAX_REQUEST_BYTES
from eyas.serve.metrics import ServerMetrics
from eyas.serve.protocol import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    chat_body,
    chat_logprobs,
    completion_body,
    completion_logprobs,
    new_id,
    usage,
    validation_error,
)

MAX_JSON_DEPTH = 64  # OpenAI bodies nest a few levels (messages -> parts, schemas a few more)
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of the context


def build_app(llm: LLM, model_name: str, api_key: str | None = None, enable_docs: bool = False,
              public_metrics: bool = False, max_request_bytes: int = MAX_REQUEST_BYTES,
              grammar_timeout: float = GRAMMAR_TIMEOUT_S, max_prompt_tokens: int | None = None) -> AccessLog:
    """The FastAPI app serving `llm` as `model_name`; with `api_key`, /v1/* and /metrics (unless `public_metrics`)
    need `Authorization: Bearer <key>`. `enable_docs` serves /docs, /redoc and /openapi.json (off by default: they
    describe the server to anyone). A request body over `max_request_bytes` is refused (413) without being read
    whole. A grammar that takes over `grammar_timeout` seconds to compile, or a prompt over `max_prompt_tokens`
    (default: the context), is a 400."""
    if api_key is not None and (not api_key.strip() or any(c.isspace() for c in api_key)):
        raise ValueError("api_key must be a non-empty key without whitespace, or None for no key")
    metrics = ServerMetrics(model_name, llm)
    engine = EngineLoop(llm, metrics, grammar_timeout, max_prompt_tokens)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        engine.stop()

    docs = {} if enable_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="eyas", lifespan=lifespan, **docs)
    app.state.engine = engine
    app.state.metrics = metrics
    _add_error_handlers(app, metrics)
    check_api_key = _api_key_check(api_key)
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])
    _add_health_routes(app, metrics, [] if public_metrics else [Depends(check_api_key)])
    _add_openai_routes(v1, llm, engine, model_name, max_request_bytes)
    app.include_router(v1)
    return AccessLog(app)


def _add_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    """Every refusal, and every bug, answered with an OpenAI error body."""

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> JSONResponse:
        metrics.rejected(e.status)
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(ClientDisconnect)
    async def client_gone(request: Request, e: ClientDisconnect) -> Response:  # it left while sending its body
        request.state.client_gone = True  # for the access log
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def server_error(request: Request, e: Exception) -> JSONResponse:  # a bug: still an OpenAI error body
        return JSONResponse(ApiError(500, f"internal error: {type(e).__name__}: {e}").body(), status_code=500)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(ApiError(e.status_code, f"{request.method} {request.url.path}: {e.detail}").body(),
                            status_code=e.status_code)


def _api_key_check(api_key: str | None) -> Callable[[Request], None]:
    """The dependency that refuses a request without `Authorization: Bearer <api_key>` (none without a key)."""

    def check_api_key(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").strip().partition(" ")
        if scheme.lower() != "bearer":  # auth schemes are case-insensitive (RFC 7235)
            raise ApiError(401, "missing API key: send the header 'Authorization: Bearer <key>'",
                           code="invalid_api_key")
        if not secrets.compare_digest(given.strip().encode(), api_key.encode()):
            raise ApiError(401, "incorrect API key", code="invalid_api_key")

    return check_api_key


def _add_health_routes(app: FastAPI, metrics: ServerMetrics, metrics_dependencies: list) -> None:
    """GET /health (always open) and /metrics (Prometheus text, behind `metrics_dependencies`)."""

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/metrics", dependencies=metrics_dependencies)
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)


def _add_openai_routes(v1: APIRouter, llm: LLM, engine: EngineLoop, model_name: str, max_request_bytes: int) -> None:
    """GET /v1/models, POST /v1/completions and /v1/chat/completions."""

    @v1.get("/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "eyas",
                                            "max_model_len": llm.max_model_len}]}

    @v1.post("/completions")
    async def completions(request: Request) -> Response:
        body = await _parse(request, CompletionRequest, model_name, max_request_bytes)
        max_tokens = body.max_tokens or COMPLETION_DEFAULT_MAX_TOKENS
        return await _respond(request, engine, body, body.prompt, max_tokens, "text_completion", model_name)

    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await _parse(request, ChatRequest, model_name, max_request_bytes)
        max_tokens = body.max_completion_tokens or body.max_tokens
        messages = [m.as_dict() for m in body.messages]
        return await _respond(request, engine, body, messages, max_tokens, "chat.completion", model_name)


class AccessLog:
    """One log line per request once its response has ended (streams included): client, method, route, status,
    prompt + generated tokens, seconds, and "client disconnected" when the client left before the end (one line,
    never a traceback). Written to the "eyas.access" logger."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app
        self.state = app.state  # what tests and the engine thread reach through the app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), [0]

        async def send_and_record(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_record)
        finally:
            usage = scope.get("state", {}).get("usage")
            tokens = f" {usage[0]}+{usage[1]} tokens" if usage else ""
            gone = " client disconnected" if scope.get("state", {}).get("client_gone") else ""
            client = scope.get("client") or ("-", 0)
            ACCESS_LOG.info('%s "%s %s" %s%s %.3fs%s', client[0], scope["method"], scope["path"], status[0] or "-",
                            tokens, time.perf_counter() - start, gone)


ACCESS_LOG = logging.getLogger("eyas.access")


async def _parse(request: Request, cls: type[BaseModel], model_name: str, max_bytes: int):
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type != "application/json":  # a text/plain POST is one any web page may send to localhost
        raise ApiError(415, f"the request body must be JSON sent with Content-Type: application/json, not "
                       f"{media_type or 'no Content-Type'}", code="unsupported_media_type")
    raw = bytearray()
    async for chunk in request.stream():  # read up to the cap, never the whole of an oversized body
        raw += chunk
        if len(raw) > max_bytes:
            raise ApiError(413, f"the request body is over {max_bytes} bytes (the server's --max-request-bytes)",
                           code="request_too_large")
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON ({e})", code="invalid_json") from e
    except RecursionError as e:
        raise ApiError(400, f"the request body nests JSON deeper than {MAX_JSON_DEPTH} levels",
                       code="invalid_json") from e
    if _json_depth(data) > MAX_JSON_DEPTH:
        raise ApiError(400, f"the request body nests JSON deeper than {MAX_JSON_DEPTH} levels", code="invalid_json")
    if not isinstance(data, dict):
        raise ApiError(400, f"the request body must be a JSON object, not {type(data).__name__}")
    try:
        body = cls.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from e
    if body.model != model_name:
        raise ApiError(404, f"the model {body.model!r} does not exist; this server serves {model_name!r}",
                       param="model", code="model_not_found")
    return body


async def _respond(request: Request, engine: EngineLoop, body, prompt, max_tokens: int | None, kind: str,
                   model_name: str) -> Response:
    param = "messages" if kind == "chat.completion" else "prompt"
    grammar_param = "guided_regex" if body.guided_regex is not None else "response_format"
    client = ClientWatch(request, engine)
    try:
        return await _run(request, engine, client, body, prompt, max_tokens, kind, model_name, param, grammar_param)
    except BaseException:  # refused: the response is the error, not a client leaving
        client.stop()
        raise


async def _run(request: Request, engine: EngineLoop, client: ClientWatch, body, prompt, max_tokens: int | None,
               kind: str, model_name: str, param: str, grammar_param: str) -> Response:
    prepared = await client.unless_gone(
        engine.prepare(lambda: body.sampling_params(max_tokens or 1), prompt, param, grammar_param))
    if client.gone.is_set():  # gave up while its prompt was tokenized or its grammar compiled: never submitted
        return Response(status_code=499)
    params, ids = prepared
    req = client.req = engine.submit(ids, params, fill_context=max_tokens is None, param=param)
    try:
        first = await req.queue.get()  # admitted (an empty Update) or refused (an ApiError)
    except BaseException:
        engine.abort(req)
        raise
    if isinstance(first, ApiError):
        raise first
    if client.gone.is_set():
        return Response(status_code=499)
    rid = new_id("chatcmpl" if kind == "chat.completion" else "cmpl")
    updates = _updates(request, engine, req, client)
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return _EventStream(_sse(updates, rid, kind, model_name, first, include_usage, body.return_token_ids),
                            on_close=lambda: engine.abort(req))
    text, token_ids, logprobs, last = [], [], [], first
    async for update in updates:
        text.append(update.text)
        token_ids += update.token_ids
        logprobs += update.logprobs or []
        last = update
    if last.finish_reason is None:  # the client went away; nobody reads this
        return Response(status_code=499)
    make = chat_body if kind == "chat.completion" else completion_body
    return JSONResponse(make(rid, model_name, "".join(text), last.finish_reason, last.num_prompt_tokens,
                             last.num_generated, token_ids if body.return_token_ids else None,
                             logprobs if params.logprobs is not None else None))


class ClientWatch:
    """Notices at once that a request's client went away (the ASGI `http.disconnect` message, read by a task from
    the moment the body has been read), whether the request is being prepared, waits for a slot or is running: its
    sequence is aborted then, so a client that gives up before its first token never costs a prefill, and one
    that leaves mid-response frees its KV blocks before the next step. The access log marks such a request."""

    def __init__(self, request: Request, engine: EngineLoop) -> None:
        self.request, self.engine = request, engine
        self.gone = asyncio.Event()
        self.req: EngineRequest | None = None
        self.finished = False  # the request's last update was read: a disconnect after it is the normal end
        self.task = asyncio.create_task(self._watch())

    async def _watch(self) -> None:
        while (await self.request.receive())["type"] != "http.disconnect":
            pass  # ASGI servers also report the end of a completed response as a disconnect
        if self.finished:
            return
        self.gone.set()
        self.request.state.client_gone = True  # for the access log
        if self.req is not None:
            self.engine.abort(self.req)

    def stop(self) -> None:
        self.finished = True
        self.task.cancel()

    async def unless_gone(self, work):
        """`await work`, or None as soon as the client is gone (the work is cancelled)."""
        work = asyncio.ensure_future(work)
        gone = asyncio.ensure_future(self.gone.wait())
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        gone.cancel()
        if not work.done():
            work.cancel()
            return None
        return work.result()


def _json_depth(value) -> int:
    """How deep containers nest in a parsed JSON value, without recursion (a hostile body may nest 10,000 deep)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth)
            if depth <= MAX_JSON_DEPTH:
                stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


class _EventStream(StreamingResponse):
    """An SSE response that calls `on_close` however it ends (finished, client gone, cancelled), so an abandoned
    stream never keeps its sequence running until garbage collection closes the generators."""

    def __init__(self, content: AsyncIterator[str], on_close) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


async def _updates(request: Request, engine: EngineLoop, req: EngineRequest,
                   client: ClientWatch) -> AsyncIterator[Update]:
    """The request's updates until it finishes; none after an abort (the client went away, or the server stops).
    Anything that stops this generator early (the streaming response cancelled on disconnect) aborts the request."""
    try:
        while True:
            item = await req.queue.get()
            if isinstance(item, ApiError):
                client.finished = True
                raise item
            if item.finish_reason == "abort":
                return
            request.state.usage = (item.num_prompt_tokens, item.num_generated)  # for the access log
            if item.finish_reason is not None:
                client.finished = True
            yield item
            if item.finish_reason is not None:
                return
    finally:
        engine.abort(req)  # a no-op once it has finished


async def _sse(updates: AsyncIterator[Update], rid: str, kind: str, model_name: str, first: Update,
               include_usage: bool, return_token_ids: bool) -> AsyncIterator[str]:
    """OpenAI stream chunks as Server-Sent Events, ending with `data: [DONE]`."""
    created = int(time.time())
    chat = kind == "chat.completion"

    text_offset = 0

    def chunk(text: str, finish_reason: str | None, token_ids: list[int] | None = None, role: bool = False,
              logprobs: list | None = None) -> str:
        if chat:
            delta = {"role": "assistant", "content": text} if role else {"content": text} if text else {}
            choice = {"index": 0, "delta": delta, "logprobs": chat_logprobs(logprobs), "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": completion_logprobs(logprobs, text_offset),
                      "finish_reason": finish_reason}
        if return_token_ids and token_ids is not None:
            choice["token_ids"] = token_ids
        data = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
                "model": model_name, "choices": [choice]}
        if include_usage:
            data["usage"] = None
        return f"data: {json.dumps(data)}\n\n"

    if chat:
        yield chunk("", None, role=True)
    last = first
    try:
        async for update in updates:
            last = update
            if update.text or update.finish_reason or (return_token_ids and update.token_ids) or update.logprobs:
                yield chunk(update.text, update.finish_reason, update.token_ids, logprobs=update.logprobs)
                text_offset += sum(len(e["token"]) for e in update.logprobs or [])
    except ApiError as e:
        yield f"data: {json.dumps(e.body())}\n\n"
    if include_usage and last.finish_reason is not None:
        data = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
                "model": model_name, "choices": [], "usage": usage(last.num_prompt_tokens, last.num_generated)}
        yield f"data: {json.dumps(data)}\n\n"
    yield "data: [DONE]\n\n"


# -- the command line ---------------------------------------------------------------------------------------------

def serve(args: argparse.Namespace) -> int:
    """Load the model, then run uvicorn until interrupted."""
    import uvicorn

    llm = EngineArgs.from_cli_args(args).build_llm()
    name = args.served_model_name or Path(args.model).name
    app = build_app(llm, name, api_key=args.api_key, enable_docs=args.enable_docs,
                    public_metrics=args.public_metrics, max_request_bytes=args.max_request_bytes,
                    grammar_timeout=args.grammar_timeout, max_prompt_tokens=args.max_prompt_tokens)
    if args.access_log:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
        ACCESS_LOG.addHandler(handler)
        ACCESS_LOG.setLevel(logging.INFO)
        ACCESS_LOG.propagate = False
    print(banner(llm, name, args), file=sys.stderr, flush=True)
    log_level = "info" if getattr(args, "verbose", False) else "warning"
    uvicorn.run(app, host=args.host, port=args.port, log_level=log_level, access_log=False)
    return 0


def banner(llm: LLM, name: str, args: argparse.Namespace) -> str:
    """What is served, how, and where."""
    spec = llm.speculative_config
    if spec is None:
        how = "plain decoding"
    else:
        draft = {"mtp": "its own MTP layer", "dflash": f"DFlash block draft {spec.draft_model}"}.get(
            spec.method, f"EAGLE-3 draft {spec.draft_model}")
        off = f", drafting off from {spec.disable_batch_size} running sequences" if spec.disable_batch_size else ""
        how = f"speculative decoding with {draft}, K={spec.num_speculative_tokens}{off}"
    host = f"[{args.host}]" if ":" in args.host else args.host
    url = f"http://{host}:{args.port}"
    auth = "; an API key is required" if args.api_key else ""
    return (f"eyas serve: {name} ({args.model}), {how}; up to {llm.scheduler.max_num_seqs} sequences, context "
            f"{llm.max_model_len}, {llm.num_threads} CPU thread(s)\n"
            f"eyas serve: OpenAI API at {url}/v1 (completions, chat/completions, models), {url}/health, {url}/metrics"
            f"{auth}; Ctrl-C stops")
