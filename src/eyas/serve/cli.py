"""`eyas serve` on the command line. Kept apart from app.py so building the `eyas` parser does not import
FastAPI and uvicorn."""

from __future__ import annotations

import argparse

from eyas.engine_args import EngineArgs
from eyas.serve.limits import GRAMMAR_TIMEOUT_S, MAX_REQUEST_BYTES, api_key


def _serve(args: argparse.Namespace) -> int:
    from eyas.serve.app import serve

    return serve(args)


def add_cli(subparsers) -> None:
    p = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                              description="Serve the target (optionally with speculative decoding) at "
                              "/v1/completions, /v1/chat/completions, /v1/models, /health and /metrics.")
    EngineArgs.add_cli_args(p)
    p.add_argument("--served-model-name", help="the name clients pass as `model` (default: the directory name)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", type=api_key, help="require 'Authorization: Bearer KEY' on /v1/* (a non-empty key "
                   "without spaces)")
    p.add_argument("--public-metrics", action="store_true", help="with --api-key, serve /metrics without the key "
                   "(it needs the key otherwise)")
    p.add_argument("--max-request-bytes", type=int, default=MAX_REQUEST_BYTES, help="larger request bodies are "
                   "refused with 413, read no further than this")
    p.add_argument("--max-prompt-tokens", type=int, help="longer prompts are refused with 400; one with more "
                   "characters than this many of the vocabulary's longest token is refused before tokenizing "
                   "(default: the context)")
    p.add_argument("--grammar-timeout", type=float, default=GRAMMAR_TIMEOUT_S, help="seconds a request's JSON "
                   "schema or regex may take to compile; past it the request is a 400")
    p.add_argument("--enable-docs", action="store_true", help="serve /docs, /redoc and /openapi.json (they "
                   "describe every route to anyone who can reach the server)")
    p.add_argument("--no-access-log", dest="access_log", action="store_false", help="no log line per request "
                   "(client, method, route, status, tokens, seconds) on stderr")
    p.set_defaults(func=_serve)
