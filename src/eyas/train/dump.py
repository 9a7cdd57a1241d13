"""`eyas dump-hidden-states`: tokenize a training file and write the target's hidden states for it as shards
(eyas.train.hidden_states), computed here or fetched from a running vLLM (eyas.train.hidden_states_server)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from eyas.aux_layers import default_aux_layer_ids, to_hidden_state_ids
from eyas.client import add_server_args
from eyas.config import DeepseekV3Config
from eyas.paths import DEFAULT_MODEL
from eyas.threads import THREADS_HELP, configure_threads
from eyas.train.data import Example
from eyas.train.hidden_states import DTYPES, dump_hidden_states

log = logging.getLogger("eyas")
DEFAULT_VLLM_STORAGE = Path("/tmp/eyas-hidden-states")  # what --print-vllm-command names when not told


def cmd_dump_hidden_states(args: argparse.Namespace) -> int:
    config = DeepseekV3Config.from_json(args.model)
    L = config.num_hidden_layers
    if args.aux_layer_ids:
        aux_ids = to_hidden_state_ids(args.aux_layer_ids, args.aux_layer_convention, L)
    else:
        aux_ids = default_aux_layer_ids(L)
    if args.print_vllm_command:
        from eyas.train.hidden_states_server import vllm_command

        print(vllm_command(args.model, aux_ids, L, args.vllm_storage or DEFAULT_VLLM_STORAGE,
                           served_model_name=args.served_model_name))
        return 0
    if args.data is None or args.out_dir is None:
        raise ValueError("give DATA.jsonl and OUT_DIR (or --print-vllm-command)")
    if args.server and args.vllm_storage is None:
        # no default: the directory bounds which of the server's files are read and deleted
        raise ValueError("--server needs --vllm-storage DIR: the shared_storage_path that vLLM was started with "
                         "(only files inside it are read)")
    examples = _examples(args, config)
    manifest = _dump_from_server(args, config, examples, aux_ids) if args.server else \
        _dump_here(args, examples, aux_ids)
    if not manifest["complete"] or args.world_size > 1 and len(manifest["shards"]) < manifest["num_shards"]:
        print(f"rank {args.rank} of {args.world_size}: wrote its {len(manifest['shards'])} shards to "
              f"{args.out_dir}; the dump's manifest.json is written once every rank has finished")
        return 0
    given = (f" (given as {args.aux_layer_convention} ids {args.aux_layer_ids})"
             if args.aux_layer_ids and args.aux_layer_convention != "hidden_states" else "")
    print(f"wrote {manifest['num_examples']} examples ({manifest['total_tokens']} tokens, "
          f"{manifest['total_loss_tokens']} loss tokens) in {manifest['num_shards']} shards to {args.out_dir}")
    print(f"aux hidden states at hidden_states ids {manifest['aux_hidden_state_ids']}{given} and the last hidden "
          f"state (id {L}, before the final norm), {manifest['dtype']}, hidden size {manifest['hidden_size']}")
    return 0


def _examples(args: argparse.Namespace, config: DeepseekV3Config) -> list[Example]:
    """DATA tokenized with the target's tokenizer, each example at most --max-length (and the target's context)."""
    from eyas.engine.llm import load_tokenizer
    from eyas.train.data import load_dataset

    tokenizer = load_tokenizer(args.model)
    if tokenizer is None:
        raise ValueError(f"{args.model}: no tokenizer (tokenizer.json / tokenizer_config.json)")
    max_length = args.max_length
    if max_length > config.max_position_embeddings:
        log.warning("--max-length %d exceeds the target's max_position_embeddings; truncating examples to %d",
                    max_length, config.max_position_embeddings)
        max_length = config.max_position_embeddings
    return load_dataset(args.data, tokenizer, max_length)


def _dump_here(args: argparse.Namespace, examples: list[Example], aux_ids: tuple[int, ...]) -> dict:
    from eyas.checkpoint import load_model

    target = load_model(args.model, dtype=args.target_dtype, device=args.device)
    configure_threads(target, args.threads)
    return dump_hidden_states(target, examples, args.out_dir, aux_ids, examples_per_shard=args.examples_per_shard,
                              dtype=DTYPES[args.dtype], batch_size=args.batch_size, target_path=args.model,
                              rank=args.rank, world_size=args.world_size)


def _dump_from_server(args: argparse.Namespace, config: DeepseekV3Config, examples: list[Example],
                      aux_ids: tuple[int, ...]) -> dict:
    from eyas.client import client_from_args
    from eyas.train.hidden_states_server import ServerHiddenStates, dump_from_server

    client = client_from_args(args)
    states = ServerHiddenStates(client, aux_ids, config.num_hidden_layers, config.hidden_size, args.vllm_storage,
                                keep_files=args.keep_server_files)
    return dump_from_server(states, examples, args.out_dir, config, args.model,
                            examples_per_shard=args.examples_per_shard, dtype=DTYPES[args.dtype],
                            concurrency=args.concurrency, rank=args.rank, world_size=args.world_size)


def add_cli(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """`eyas dump-hidden-states`."""
    p = subparsers.add_parser(
        "dump-hidden-states", help="write the target's aux hidden states for offline draft training",
        description="Tokenize a JSONL training file and write, per token, the target's aux hidden states and its "
        "last hidden state (before the final norm) as sharded safetensors plus manifest.json. Rerunning with the "
        "same arguments resumes an interrupted dump.")
    p.add_argument("data", type=Path, nargs="?", metavar="DATA.jsonl", help="conversations (OpenAI messages or "
                   "ShareGPT) or {\"text\": ...} records")
    p.add_argument("out_dir", type=Path, nargs="?", metavar="OUT_DIR")
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="target checkpoint directory (default: the "
                   "bundled tiny DeepSeek-V3)")
    p.add_argument("--aux-layer-ids", type=int, nargs="+", metavar="ID", help="layers whose hidden states the "
                   "draft fuses (default: (2, L//2, L-3) in hidden_states convention)")
    p.add_argument("--aux-layer-convention", choices=["hidden_states", "layer_output"], default="hidden_states",
                   help="how --aux-layer-ids count: hidden_states (vLLM/SGLang/MAX: id i = input of layer i) or "
                   "layer_output (Model Optimizer: id i = output of layer i, one lower)")
    p.add_argument("--max-length", type=int, default=2048, help="tokens per example; longer ones are truncated")
    p.add_argument("--examples-per-shard", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8, help="examples per target forward")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16", help="dtype of the stored states")
    p.add_argument("--target-dtype", default="auto", help="dtype the target runs in: auto (float32 on CPU, "
                   "bfloat16 on GPU), float32, bfloat16")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--threads", type=int, help=THREADS_HELP)
    p.add_argument("--world-size", type=int, default=1, help="split the dump over this many processes or machines "
                   "sharing OUT_DIR: each writes every world-size-th shard")
    p.add_argument("--rank", type=int, default=0, help="this process's share, 0..world-size-1")
    g = p.add_argument_group("from a running vLLM (a target this machine cannot hold)")
    g.add_argument("--server", metavar="URL", help="fetch the states from this vLLM, started with the command "
                   "--print-vllm-command prints; the target is not loaded here (--model gives its config and "
                   "tokenizer)")
    g.add_argument("--print-vllm-command", action="store_true", help="print that command for --model and the aux "
                   "ids, and exit")
    g.add_argument("--vllm-storage", type=Path, metavar="DIR", help="the directory the server writes one file per "
                   "request into (its shared_storage_path), at the same path on this machine; required with --server: "
                   "only regular .safetensors files inside it, reached without symlinks, are read (default for "
                   f"--print-vllm-command: {DEFAULT_VLLM_STORAGE})")
    add_server_args(g, 8, "requests in flight")
    g.add_argument("--keep-server-files", action="store_true", help="with --server: leave the server's files in "
                   "place once read (default: each file whose token ids match its request is deleted with its .lock: "
                   "the shards hold the same states; any other file is never deleted)")
    p.set_defaults(func=cmd_dump_hidden_states)
    return p
