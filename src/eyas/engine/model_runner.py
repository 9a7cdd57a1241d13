"""Runs the target over a scheduled ragged batch: builds the step's attention metadata, owns the paged caches."""

from __future__ import annotations

import torch

from eyas.engine.kv_cache import LatentCache
from eyas.engine.scheduler import ScheduledBatch
from eyas.models.attention import AttentionMetadata
from eyas.models.deepseek_v3 import DeepseekV3ForCausalLM


class ModelRunner:
    def __init__(self, model: DeepseekV3ForCausalLM, num_blocks: int, block_size: int) -> None:
        self.model = model
        config = model.config
        weight = model.lm_head.weight
        self.device, self.dtype = weight.device, weight.dtype
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.cache = LatentCache(config.num_hidden_layers, num_blocks, block_size, config.latent_dim, self.dtype,
                                 self.device)

    def metadata(self, query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
                 kv_starts: list[int] | None = None) -> AttentionMetadata:
        return AttentionMetadata.build(query_lens, seq_lens, block_tables, self.block_size, self.device, kv_starts)

    @torch.inference_mode()
    def forward(self, batch: ScheduledBatch, aux_hidden_state_ids: tuple[int, ...] = ()):
        """Target forward over this step's tokens (committed, then pending drafts, per sequence).

        Returns (final hidden [num_tokens, H], aux hidden states, query_lens)."""
        input_ids, query_lens, seq_lens = [], [], []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            tokens = seq.token_ids + seq.draft_tokens
            input_ids.extend(tokens[seq.num_computed:seq.num_computed + n])
            query_lens.append(n)
            seq_lens.append(seq.num_computed + n)
        attn = self.metadata(query_lens, seq_lens, [s.block_table for s in batch.seqs])
        hidden, aux = self.model.model(torch.tensor(input_ids, device=self.device), attn, self.cache,
                                       aux_hidden_state_ids)
        return hidden, aux, query_lens
