"""Tiny random DeepSeek-V3 checkpoints written by transformers itself, for parity and engine tests; stand-in HTTP
servers for the tests of what eyas reads from servers."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch

BASE = dict(
    vocab_size=96, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=24, qk_nope_head_dim=8,
    qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
    n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
    max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False,
)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32,
        "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0}


def hf_config(**overrides):
    from transformers import DeepseekV3Config

    kw = dict(BASE)
    kw.update(overrides)
    return DeepseekV3Config(**kw)


def make_hf_checkpoint(path: Path, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    """Save a random transformers DeepseekV3ForCausalLM; return the model (float32) for reference outputs."""
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    config = hf_config(**overrides)
    model = DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():  # random router bias and larger weights so routing and attention are not uniform
        for name, p in model.named_parameters():
            if p.dim() > 1 or "bias" in name:
                p.normal_(0, 0.15)
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.normal_(0, 0.1)
    model.to(dtype).save_pretrained(path)
    return model.float() if dtype != torch.float32 else model


def read_config(path: Path) -> dict:
    return json.loads((Path(path) / "config.json").read_text())


def copy_tokenizer(path: Path) -> None:
    """The shipped tokenizer (and its chat template) into checkpoint directory `path`."""
    import shutil

    from eyas.paths import DEFAULT_MODEL

    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEFAULT_MODEL / name, path / name)


def make_served_checkpoint(path: Path) -> Path:
    """A random target with the shipped tokenizer (its chat template too) and an MTP layer: what the server and
    structured-output tests run."""
    from test_checkpoint import add_mtp_weights

    make_hf_checkpoint(path, vocab_size=8192, rope_parameters=YARN)
    add_mtp_weights(path)
    copy_tokenizer(path)
    return path


# -- stand-in servers ---------------------------------------------------------------------------------------------

@contextmanager
def stand_in(handle: Callable[[BaseHTTPRequestHandler], None]) -> Iterator[str]:
    """A server on a free loopback port answering every request with `handle(handler)` (a POST's body already
    read, as `handler.body`); yields its URL. Handler threads are daemons, so one still dripping cannot hold the
    test run."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            self.body = b""
            try:
                handle(self)
            except OSError:  # the client hung up
                pass

        def do_POST(self):
            self.body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            try:
                handle(self)
            except OSError:
                pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def reply(handler: BaseHTTPRequestHandler, body: dict | str | bytes, status: int = 200) -> None:
    data = body if isinstance(body, bytes) else (body if isinstance(body, str) else json.dumps(body)).encode()
    handler.send_response(status)
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)
