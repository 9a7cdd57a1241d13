"""Runs the target over a scheduled ragged batch: builds the step's attention metadata, owns the paged cache."""

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
        self.cache = LatentCache(config.num_hidden_layers, num_blocks, block_size, config.latent_dim, self.dtype,
                                 self.device)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> torch.Tensor:
        """Forward this step's tokens; return logits [num_seqs, vocab] at each sequence's last computed token."""
        input_ids, query_lens, seq_lens = [], [], []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            input_ids.extend(seq.token_ids[seq.num_computed:seq.num_computed + n])
            query_lens.append(n)
            seq_lens.append(seq.num_computed + n)
        attn = AttentionMetadata.build(query_lens, seq_lens, [s.block_table for s in batch.seqs], self.block_size,
                                       self.device)
        hidden, _ = self.model.model(torch.tensor(input_ids, device=self.device), attn, self.cache)
        last_rows = torch.tensor(query_lens, device=self.device).cumsum(0) - 1
        return self.model.compute_logits(hidden[last_rows])
