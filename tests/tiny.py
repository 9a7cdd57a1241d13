"""What more than one test module needs: tiny random DeepSeek-V3 checkpoints written by transformers itself (with an
MTP layer, rigged to be copied), the EAGLE-3 and DFlash drafts written against them, the structured-output cases,
the check that sampled tokens follow the target, `eyas serve` running on loopback, and stand-in HTTP servers for
the tests of what eyas reads from servers. Shared fixtures are in conftest.py."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file, save_file

if TYPE_CHECKING:
    from eyas import LLM, SamplingParams
    from eyas.sampling_params import StructuredOutputParams

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


def make_tokenized_target(path: Path) -> Path:
    """A random tiny target with the shipped tokenizer (vocab 8,192, as the tokenizer's): what training, dumps,
    regeneration and the pipeline read."""
    make_hf_checkpoint(path, vocab_size=8192)
    copy_tokenizer(path)
    return path


def copy_tokenizer(path: Path) -> None:
    """The shipped tokenizer (and its chat template) into checkpoint directory `path`."""
    import shutil

    from eyas.paths import DEFAULT_MODEL

    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEFAULT_MODEL / name, path / name)


def add_mtp_weights(path, seed=0):
    """Append a random MTP layer (model.layers.L.*) to a transformers-saved checkpoint, as DeepSeek stores it."""
    from eyas.config import DeepseekV3Config
    from eyas.models.deepseek_v3 import MTPLayer

    config = DeepseekV3Config.from_json(path)
    L = config.num_hidden_layers
    torch.manual_seed(seed)
    layer = MTPLayer(config, L)
    tensors = load_file(path / "model.safetensors")
    for key, t in layer.state_dict().items():
        t = torch.randn_like(t) * 0.15 if t.dim() > 1 else 1 + 0.1 * torch.randn_like(t)
        tensors[f"model.layers.{L}.{key}"] = t
    save_file(tensors, path / "model.safetensors")
    return tensors


def rig_bigram_target_and_copying_mtp(path):
    """Zero every layer's writes to the residual stream: the target becomes a bigram model
    (next = argmax lm_head(norm(embed(token)))). The MTP layer is set to predict the same function of the token it
    is given, so it proposes exactly what the target will say: nearly every draft is accepted."""
    tensors = load_file(path / "model.safetensors")
    L = max(int(k.split(".")[2]) for k in tensors if k.startswith("model.layers."))
    H = tensors["model.embed_tokens.weight"].shape[1]
    for key in tensors:
        if key.endswith(("o_proj.weight", "down_proj.weight")):
            tensors[key] = torch.zeros_like(tensors[key])
    p = f"model.layers.{L}."
    tensors[p + "eh_proj.weight"] = torch.cat([torch.eye(H), torch.zeros(H, H)], dim=1)
    for name in ("enorm", "hnorm", "shared_head.norm", "input_layernorm", "post_attention_layernorm"):
        tensors[p + name + ".weight"] = torch.ones(H)
    tensors[p + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    tensors[p + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, path / "model.safetensors")


def make_served_checkpoint(path: Path) -> Path:
    """A random target with the shipped tokenizer (its chat template too) and an MTP layer: what the server and
    structured-output tests run."""
    make_hf_checkpoint(path, vocab_size=8192, rope_parameters=YARN)
    add_mtp_weights(path)
    copy_tokenizer(path)
    return path


# -- EAGLE-3 drafts for the tiny target --------------------------------------------------------------------------

H, V, DV, L = 32, 96, 48, 4  # the tiny target (BASE): hidden, vocab, 4 layers; the draft vocab is half the target's
MODELOPT_EAGLE_CONFIG = {"use_aux_hidden_state": True, "use_input_layernorm_in_first_layer": True,
                         "use_last_layernorm": True, "use_mtp_layernorm": False, "next_layer_regular": True,
                         "parallel_draft_step": 1, "parallel_draft_heads_num_layers": 1}
YARN_SCALING = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32,
                "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}


def _random(seed):
    g = torch.Generator().manual_seed(seed)

    def mat(*shape):
        return torch.randn(*shape, generator=g) * 0.15

    def norm(n):
        return 1 + 0.1 * torch.randn(n, generator=g)

    return mat, norm, g


def vocab_map(g):
    ids = torch.randperm(V, generator=g)[:DV].sort().values
    return {"d2t": ids - torch.arange(DV)}


def mha_weights(seed=0, n_aux=3, compressed=True):
    """Canonical (layers.0.) keys and shapes from DESIGN.md §4: 4 heads, 2 kv heads, head_dim 8."""
    mat, norm, g = _random(seed)
    w = {"fc.weight": mat(H, n_aux * H), "layers.0.input_layernorm.weight": norm(H),
         "layers.0.hidden_norm.weight": norm(H), "layers.0.self_attn.q_proj.weight": mat(32, 2 * H),
         "layers.0.self_attn.k_proj.weight": mat(16, 2 * H), "layers.0.self_attn.v_proj.weight": mat(16, 2 * H),
         "layers.0.self_attn.o_proj.weight": mat(H, 32), "layers.0.post_attention_layernorm.weight": norm(H),
         "layers.0.mlp.gate_proj.weight": mat(64, H), "layers.0.mlp.up_proj.weight": mat(64, H),
         "layers.0.mlp.down_proj.weight": mat(H, 64), "norm.weight": norm(H),
         "lm_head.weight": mat(DV if compressed else V, H)}
    return w | vocab_map(g) if compressed else w


def mla_weights(seed=1):
    """q_lora 16, kv_lora 24, nope 8, rope 8, v 12, 4 heads; every down-projection reads 2H."""
    mat, norm, g = _random(seed)
    a = "layers.0.self_attn."
    w = {"fc.weight": mat(H, 3 * H), "layers.0.input_layernorm.weight": norm(H),
         "layers.0.hidden_norm.weight": norm(H), a + "q_a_proj.weight": mat(16, 2 * H),
         a + "q_a_layernorm.weight": norm(16), a + "q_b_proj.weight": mat(4 * 16, 16),
         a + "kv_a_proj_with_mqa.weight": mat(24 + 8, 2 * H), a + "kv_a_layernorm.weight": norm(24),
         a + "kv_b_proj.weight": mat(4 * (8 + 12), 24), a + "o_proj.weight": mat(H, 4 * 12),
         "layers.0.post_attention_layernorm.weight": norm(H), "layers.0.mlp.gate_proj.weight": mat(64, H),
         "layers.0.mlp.up_proj.weight": mat(64, H), "layers.0.mlp.down_proj.weight": mat(H, 64),
         "norm.weight": norm(H), "lm_head.weight": mat(DV, H)}
    d2t = vocab_map(g)["d2t"]
    return w | {"d2t": d2t, "t2d": torch.zeros(V, dtype=torch.bool).index_fill_(0, torch.arange(DV) + d2t, True)}


def mha_config(arch="LlamaForCausalLMEagle3", ids=(1, 2, 3), where="eagle_config", **extra):
    cfg = {"architectures": [arch], "model_type": "llama", "hidden_size": H, "intermediate_size": 64,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "num_hidden_layers": 1,
           "rms_norm_eps": 1e-6, "hidden_act": "silu", "vocab_size": V, "draft_vocab_size": DV,
           "max_position_embeddings": 256, "rope_theta": 10000.0, "torch_dtype": "float32"}
    if ids is not None:
        if where == "eagle_config":
            cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(ids)}
        else:
            cfg["eagle_aux_hidden_state_layer_ids"] = list(ids)
    for key, value in extra.items():
        if key == "eagle_config":
            cfg.setdefault("eagle_config", {}).update(value)
        else:
            cfg[key] = value
    return cfg


def mla_config(arch="Eagle3DeepseekV2ForCausalLM", model_type="deepseek_v2", ids=(1, 2, 3), **eagle):
    cfg = {"architectures": [arch] if arch else None, "model_type": model_type, "hidden_size": H,
           "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 16,
           "kv_lora_rank": 24, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 12,
           "num_hidden_layers": 1, "n_routed_experts": None, "rms_norm_eps": 1e-6, "vocab_size": V,
           "draft_vocab_size": DV, "max_position_embeddings": 256, "rope_theta": 10000.0, "rope_interleave": True,
           "rope_scaling": YARN_SCALING, "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(ids), **eagle}}
    return cfg


def write_draft(path, config, weights, layout="layers.0."):
    """Write config.json + model.safetensors with the layer under `layout` (midlayer., layers.0., model.)."""
    def rename(key):
        if layout == "midlayer.":
            return key.replace("layers.0.", "midlayer.", 1)
        if layout == "model.":  # vLLM-style: model.layers.0., model.fc, model.norm
            return "model." + key if key.startswith(("layers.", "fc.", "norm.")) else key
        return key

    path.mkdir(parents=True, exist_ok=True)
    save_file({rename(k): v.contiguous() for k, v in weights.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    return path


def draft_steps(draft, T=7, seed=5):
    """Step 0 from fused aux states, then one step on the draft's own pre-norm output; logits of both."""
    g = torch.Generator().manual_seed(seed)
    aux = [torch.randn(2, T, H, generator=g) for _ in range(draft.config.num_aux_hidden_states)]
    tokens = torch.randint(0, V, (2, T), generator=g)
    with torch.no_grad():
        pre0 = draft(draft.combine_hidden_states(None, aux), tokens)
        pre1 = draft(pre0, tokens.roll(1, -1))
        return draft.compute_logits(pre0), draft.compute_logits(pre1)


def assert_same_draft(drafts):
    first = drafts[0]
    for other in drafts[1:]:
        a, b = first.state_dict(), other.state_dict()
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), key
        assert other.aux_hidden_state_ids == first.aux_hidden_state_ids
        for x, y in zip(draft_steps(first), draft_steps(other)):
            assert torch.equal(x, y)


def rms(x, w, eps=1e-6):
    return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


# -- DFlash drafts ------------------------------------------------------------------------------------------------

def dflash_raw(**overrides) -> dict:
    raw = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": H, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 48,
           "rms_norm_eps": 1e-6, "vocab_size": V, "max_position_embeddings": 256, "rope_theta": 10000.0,
           "block_size": 4, "num_target_layers": L,
           "dflash_config": {"target_layer_ids": [1, 2], "mask_token_id": V - 1}}
    return raw | overrides


def dflash_mla_raw(**overrides) -> dict:
    """An MLA-shaped DFlash draft (SpecForge's fields): low-rank queries, a latent narrower than H, interleaved rope
    over 8 of each head's 16 query/key values, YaRN as DeepSeek-V3's (so the softmax scale carries its mscale)."""
    raw = dflash_raw(num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=20, qk_nope_head_dim=8, qk_rope_head_dim=8,
                     v_head_dim=12, rope_interleave=True,
                     rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                   "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
                     dflash_config={"target_layer_ids": [1, 2], "mask_token_id": V - 1, "attention_mode": "mla"})
    del raw["head_dim"]
    return raw | overrides


# -- structured output --------------------------------------------------------------------------------------------

# bounded (string lengths, integer ranges, array sizes) so every output can end within max_tokens
SCHEMAS = {
    "person": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]}}, "required": ["name", "age", "role"]},
    "item": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 9999},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "in_stock": {"type": "boolean"}}, "required": ["id", "tags", "in_stock"]},
    "point": {"type": "object", "properties": {
        "at": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -100, "maximum": 100},
                                                "y": {"type": "integer", "minimum": -100, "maximum": 100}},
               "required": ["x", "y"]},
        "label": {"enum": ["start", "end", "via"]}}, "required": ["at", "label"]},
}
STRUCTURED_PROMPTS = ["Describe a user as JSON:", "def add(a, b):\n", "The config is", "import json\n\ndata = ",
                      "Q: what is in stock?\nA:", "x", "Once upon a time", "# settings\n", "{", "The answer:"]
REGEX = r"[0-9]{3}-[a-z]{2,5}"


def spec(name: str) -> StructuredOutputParams:
    from eyas.sampling_params import StructuredOutputParams

    return StructuredOutputParams(json_schema=SCHEMAS[name])


# -- sampled tokens against the target's exact distribution -------------------------------------------------------

P_VALUE = 1e-3  # a chi-square test fails below it; its power is worked out in tests/test_acceptance.py


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token with zero target probability was produced"
    expected = probs[keep] * counts.sum()
    stat = ((counts[keep] - expected) ** 2 / expected).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2), stat / 2))


def exact_marginals(model, prompt: list[int], params: SamplingParams, vocab: int) -> list[torch.Tensor]:
    """Exact distributions of generated tokens 1, 2 and 3 under the processed target distribution."""
    from eyas.engine.sampling import process_logits

    def next_dist(prefixes: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            logits = model(prefixes)[:, -1]
        return process_logits(logits, [params] * len(prefixes)).exp()

    p1 = next_dist(torch.tensor([prompt]))[0]  # [V]
    two = torch.tensor([prompt + [a] for a in range(vocab)])
    p2_given = next_dist(two)  # [V(t1), V(t2)]
    three = torch.tensor([prompt + [a, b] for a in range(vocab) for b in range(vocab)])
    p3_given = next_dist(three).view(vocab, vocab, vocab)
    joint12 = p1[:, None] * p2_given
    return [p1, joint12.sum(0), (joint12[..., None] * p3_given).sum((0, 1))]


def assert_the_first_tokens_follow_the_target(llm: LLM, prompt: list[int], vocab: int) -> list:
    """8,000 sampled requests of 4 tokens (the first from the prefill, then one verify of 2 drafts yields tokens 2
    and 3, and a bonus 4th): tokens 1-3 against their exact marginals (chi-square, p > P_VALUE), both drafts of
    every request verified. Returns the outputs."""
    from eyas import SamplingParams

    params = SamplingParams(temperature=0.8, top_k=6, top_p=0.9, max_tokens=4, ignore_eos=True)
    outs = llm.generate([prompt] * 8000, params)
    exact = exact_marginals(llm.model, prompt, params, vocab)
    tokens = torch.tensor([o.token_ids for o in outs])
    for position in range(3):
        counts = torch.bincount(tokens[:, position], minlength=vocab).float()
        assert chi_square_p_value(counts, exact[position]) > P_VALUE, position
    assert sum(o.num_drafted for o in outs) >= 2 * 8000
    return outs


# -- `eyas serve` on loopback -------------------------------------------------------------------------------------

KEY = "sk-test"  # the API key and the model name `running` serves under
NAME = "tiny"


@contextmanager
def running(llm, api_key=KEY, **app_options):
    """A real uvicorn server on a free loopback port, in a background thread."""
    import uvicorn

    from eyas.serve.app import build_app

    app = build_app(llm, NAME, api_key=api_key, **app_options)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 20
    while not server.started:
        assert time.time() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        server.should_exit = True
        thread.join(timeout=20)


def wait_idle(llm, timeout=10.0):
    deadline = time.time() + timeout
    while llm.scheduler.has_work() or llm.allocator.num_used:
        assert time.time() < deadline, f"engine still busy: {llm.allocator.num_used} blocks used"
        time.sleep(0.02)


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


def interrupt_training(args: list[str], log: Path, after_steps: int = 3) -> tuple[int, str]:
    """Run `eyas ARGS` (a training run), send it SIGINT once its log holds `after_steps` steps: its exit code and
    stderr."""
    proc = subprocess.Popen([sys.executable, "-m", "eyas.cli", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while time.time() < deadline and not (log.exists() and len(log.read_text().splitlines()) >= after_steps):
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    return proc.returncode, stderr.decode()
