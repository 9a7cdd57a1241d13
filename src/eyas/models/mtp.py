"""DeepSeek's NextN (MTP) layer used as a draft head, chained K steps as DeepSeek and vLLM do.

Step 0 reads the target's final (normed) hidden state at position t and the embedding of token t+1; later steps
read the layer's own output. It has the same interface as `Eagle3Draft`, so the engine treats both alike.
"""

from __future__ import annotations

import torch
from torch import nn

from eyas.models.attention import AttentionMetadata
from eyas.models.deepseek_v3 import DeepseekV3ForCausalLM


class MTPDraft(nn.Module):
    aux_hidden_state_ids: tuple[int, ...] = ()

    def __init__(self, target: DeepseekV3ForCausalLM, index: int = 0) -> None:
        super().__init__()
        config = target.config
        if config.num_nextn_predict_layers <= index:
            raise ValueError(f"speculative method 'mtp' needs an MTP layer, but {config.source} has "
                             f"num_nextn_predict_layers={config.num_nextn_predict_layers} (or its weights are "
                             f"absent); use --speculative-method eagle with a draft model")
        self.config = config  # the target's, whose layer this is
        self.layer = target.model.mtp_layer(index)
        self.rotary = target.model.rotary
        self.latent_dim = config.latent_dim

    def combine_hidden_states(self, target_hidden: torch.Tensor, aux_hidden_states: list[torch.Tensor]) -> torch.Tensor:
        return target_hidden

    def forward(self, hidden: torch.Tensor, next_token_ids: torch.Tensor, attn: AttentionMetadata | None = None,
                cache: torch.Tensor | None = None) -> torch.Tensor:
        positions = attn.positions if attn is not None else torch.arange(next_token_ids.shape[-1])
        cos, sin = self.rotary(positions)
        return self.layer(next_token_ids, hidden, cos, sin, attn, cache)

    def compute_logits(self, prenorm: torch.Tensor) -> torch.Tensor:
        return self.layer.compute_logits(prenorm)

    def greedy_tokens(self, prenorm: torch.Tensor) -> torch.Tensor:
        return self.compute_logits(prenorm).argmax(-1)

    def cache_entry_shape(self) -> tuple[int, ...]:
        return (self.latent_dim,)
