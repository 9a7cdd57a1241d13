"""The server's default bounds on what one request may cost. A module of its own, importing nothing, so the server
(app.py, engine.py) and the `eyas serve` flags share them and building the `eyas` parser imports no FastAPI."""

MAX_REQUEST_BYTES = 8 * 2**20  # the request-body cap (a 2,048-token context is a few KB of text)
GRAMMAR_TIMEOUT_S = 5.0  # seconds a request's grammar may take to compile
