"""The server's default bounds on what one request may cost, and what its API key may be. A module of its own,
importing nothing but argparse, so the server (app.py, engine.py) and the `eyas serve` flags share them and building
the `eyas` parser imports no FastAPI."""

import argparse

MAX_REQUEST_BYTES = 8 * 2**20  # the request-body cap (a 2,048-token context is a few KB of text)
GRAMMAR_TIMEOUT_S = 5.0  # seconds a request's grammar may take to compile


def api_key(value: str) -> str:
    """The argparse type of `eyas serve --api-key`: an empty key would make 'Authorization: Bearer' with nothing
    after it a valid credential, and a key with spaces could never match what a client sends after stripping."""
    if not value.strip():
        raise argparse.ArgumentTypeError("an empty API key is no key: pass a non-empty one, or leave the flag out")
    if value != value.strip() or any(c.isspace() for c in value):
        raise argparse.ArgumentTypeError("an API key cannot contain spaces or other whitespace")
    return value
