"""What a training step reads: the examples (tokenized conversations, a dump's shards, or a server's stream of
hidden states for --data's records), each step's global batch as a pure function of (seed, step), this rank's
slice of it, padded, and the target's features for it (its fused hidden states and its logits at the positions a
loss reads). A resumed run therefore sees exactly the batches the uninterrupted run would have seen."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from eyas.aux_layers import AuxConvention, default_aux_layer_ids, to_hidden_state_ids
from eyas.models.deepseek_v3 import DeepseekV3ForCausalLM
from eyas.models.dflash import default_target_layer_ids
from eyas.train.config import TrainConfig
from eyas.train.ttt import read_positions

PREFETCH_STEPS = 4  # with --hidden-states-server, the batches of this many next steps are fetched ahead


def batch_indices(num_examples: int, step: int, batch_size: int, seed: int) -> list[int]:
    """The global batch for `step`: consecutive slices of one seeded permutation per epoch."""
    per_epoch = max(1, num_examples // batch_size)
    epoch, k = divmod(step, per_epoch)
    order = torch.randperm(num_examples, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
    return order[k * batch_size:(k + 1) * batch_size].tolist()


def collate(items: list[dict], max_length: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest item (padding is masked out of the loss and, being last, invisible to causal
    attention of the real tokens)."""
    T = min(max_length, max(len(item["input_ids"]) for item in items))
    out = {"input_ids": torch.zeros(len(items), T, dtype=torch.long), "loss_mask": torch.zeros(len(items), T)}
    extra = [k for k in ("aux_hidden_states", "last_hidden") if k in items[0]]
    for key in extra:
        out[key] = items[0][key].new_zeros((len(items), T, *items[0][key].shape[1:]))
    for b, item in enumerate(items):
        n = min(T, len(item["input_ids"]))
        out["input_ids"][b, :n] = torch.as_tensor(item["input_ids"][:n])
        out["loss_mask"][b, :n] = torch.as_tensor(item["loss_mask"][:n], dtype=torch.float32)
        for key in extra:
            out[key][b, :n] = item[key][:n]
    return out


@torch.no_grad()
def target_features(target: DeepseekV3ForCausalLM, batch: dict, aux_ids: tuple[int, ...],
                    last_hidden_post_norm: bool = False):
    """(aux [B, T, n_aux, H], target logits [R, vocab]) from a dumped batch or by running the target.

    Logits only at the R positions a loss reads (`read_positions`, row-major): in chat data the prompts and the
    padding are many positions, and the vocab-wide head is the target's largest matmul. A dump whose last hidden
    state is already past the final norm (`last_hidden_post_norm`, from its manifest: some tools store it so)
    goes straight to the head; normed twice, the teacher would be another distribution."""
    aux, last = target_hidden_states(target, batch, aux_ids)
    if "aux_hidden_states" not in batch:
        last_hidden_post_norm = False  # captured here: before the norm
    read = read_positions(batch["loss_mask"].to(last.device))
    normed = last[read] if last_hidden_post_norm else target.model.norm(last[read])
    return aux, target.compute_logits(normed)


@torch.no_grad()
def target_hidden_states(target: DeepseekV3ForCausalLM, batch: dict, aux_ids: tuple[int, ...]
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(aux [B, T, n_aux, H], last hidden state [B, T, H]) from a dumped batch or by running the target."""
    if "aux_hidden_states" in batch:
        dtype = target.lm_head.weight.dtype
        return batch["aux_hidden_states"].to(dtype), batch["last_hidden"].to(dtype)
    from eyas.train.hidden_states import capture_hidden_states

    return capture_hidden_states(target, batch["input_ids"], aux_ids)


@dataclass(slots=True)
class TrainingData:
    examples: Any  # list of {"input_ids", "loss_mask"} (online), HiddenStateShards or StreamedHiddenStates
    streamed: Any  # the StreamedHiddenStates of --hidden-states-server, else None
    aux_ids: tuple[int, ...]
    last_hidden_post_norm: bool  # whether a dump's last hidden state is past the final norm


def load_training_data(cfg: TrainConfig, target: nn.Module) -> TrainingData:
    """A dump's examples, or --data's tokenized (with their states fetched from --hidden-states-server)."""
    L = target.config.num_hidden_layers
    if cfg.hidden_states:
        from eyas.train.hidden_states import HiddenStateShards

        data = HiddenStateShards(cfg.hidden_states)
        return TrainingData(data, None, tuple(data.manifest["aux_hidden_state_ids"]), data.last_hidden_post_norm)
    from eyas.engine.llm import load_tokenizer
    from eyas.train.data import load_dataset

    if cfg.draft_arch == "dflash" and not cfg.aux_layer_ids:  # z-lab's rule: one target layer per draft layer
        aux_ids = tuple(i + 1 for i in default_target_layer_ids(L, cfg.num_draft_layers))
        if len(set(aux_ids)) != len(aux_ids):
            raise ValueError(f"a target with {L} layers has no {cfg.num_draft_layers} distinct default target layers "
                             f"for a {cfg.num_draft_layers}-layer DFlash draft (got hidden_states {list(aux_ids)}); "
                             "pass --aux-layer-ids")
    else:
        aux_ids = to_hidden_state_ids(cfg.aux_layer_ids or list(default_aux_layer_ids(L)),
                                      AuxConvention(cfg.aux_layer_convention), L)
    loaded = load_dataset(cfg.data, load_tokenizer(cfg.target), cfg.max_length)
    if not cfg.hidden_states_server:
        return TrainingData([{"input_ids": e.input_ids, "loss_mask": e.loss_mask} for e in loaded], None, aux_ids,
                            False)
    from eyas.client import ServerClient
    from eyas.train.hidden_states_server import ServerHiddenStates, StreamedHiddenStates

    client = ServerClient(cfg.hidden_states_server, cfg.served_model_name, cfg.api_key)
    states = ServerHiddenStates(client, aux_ids, L, target.config.hidden_size, cfg.vllm_storage,
                                keep_files=cfg.keep_server_files)
    streamed = StreamedHiddenStates(states, loaded, target.lm_head.weight.dtype)
    return TrainingData(streamed, streamed, aux_ids, False)


class Batches:
    """This rank's slice of each step's global batch, collated on the training device; with a server, the next
    steps' batches are fetched while this one trains."""

    def __init__(self, data: TrainingData, cfg: TrainConfig, rank: int, world: int, device: torch.device) -> None:
        self.data, self.cfg, self.rank, self.world, self.device = data, cfg, rank, world, device

    def indices(self, step: int) -> list[int]:
        cfg = self.cfg
        return batch_indices(len(self.data.examples), step, cfg.batch_size, cfg.seed)[self.rank::self.world]

    def at(self, step: int) -> dict[str, torch.Tensor]:
        streamed = self.data.streamed
        if streamed is not None:  # this step's batch waits on the server; the next steps' are fetched meanwhile
            for ahead in range(step + 1, min(step + 1 + PREFETCH_STEPS, self.cfg.max_steps)):
                streamed.prefetch(ahead, self.indices(ahead))
            items = streamed.batch(step, self.indices(step))
        else:
            items = [self.data.examples[i] for i in self.indices(step)]
        return {k: v.to(self.device) for k, v in collate(items, self.cfg.max_length).items()}

    def close(self) -> None:
        """Cancel the server fetches still in flight (none without a server)."""
        if self.data.streamed is not None:
            self.data.streamed.close()
