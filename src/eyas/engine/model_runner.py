"""Runs one step over a scheduled ragged batch and returns what it computed (`StepOutput`); it reads the batch's
sequences and never writes them (`Scheduler.commit` applies the output). Owns the paged caches.

The step, in phase order (K = the width the proposer chooses; K = 0 is plain decoding, no draft work):

  1. merge     each sequence's input = its uncomputed committed token(s) + the drafts proposed last step
               (prefill rows: a prompt chunk, no drafts)
  2. verify    one target forward over the ragged batch -> hidden states (and the draft's aux hidden states)
  3. accept    `Verifier`: logits at the verify rows -> grammar mask -> sampling processing -> acceptance rule
  4. rollback  the target KV of rejected drafts is dropped: num_computed stops after the last accepted draft
  5. propose   `Proposer`: the draft chain over the kept positions -> the next K drafts (`BlockProposer`: the kept
               positions into the draft's context cache, then one block forward -> the next K drafts)
  6. pack      one `StepOutput`
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from eyas.config import SpeculativeConfig
from eyas.engine.batch import ScheduledBatch, StepOutput, VerifyLayout
from eyas.engine.block_proposer import BlockDraft, BlockProposer
from eyas.engine.compiled_step import CompiledDraft, CompiledMTP, CompiledTarget
from eyas.engine.kv_cache import LatentCache
from eyas.engine.proposer import DraftHead, Proposal, Proposer
from eyas.engine.verifier import Verifier
from eyas.models import latent_kernel, rows_matmul
from eyas.models.attention import AttentionMetadata
from eyas.models.deepseek_v3 import DeepseekV3ForCausalLM
from eyas.models.eagle3 import Eagle3Draft
from eyas.models.mtp import MTPDraft


class ModelRunner:
    def __init__(self, model: DeepseekV3ForCausalLM, num_blocks: int, block_size: int,
                 draft: DraftHead | BlockDraft | None = None, speculative_config: SpeculativeConfig | None = None,
                 max_model_len: int | None = None, think_token_ids: tuple[int, int] | None = None,
                 lanes: tuple[int, int] = (0, 0), compiled_step: bool = False,
                 progress: Callable[[str], None] | None = None) -> None:
        """`compiled_step`: decode and verify steps run the target through compiled kernels (CompiledTarget;
        compiled on first use of a model's weights, `progress` hears each kernel)."""
        self.model = model
        config = model.config
        weight = model.lm_head.weight
        self.device, self.dtype = weight.device, weight.dtype
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.lanes = lanes  # the allocator's (number of lanes, blocks per lane), which attention reads in place
        self.compiled = CompiledTarget(model.model, progress) if compiled_step else None
        # a step compiled in bfloat16 needs attention that rounds a row alike however many rows a step verifies:
        # the C kernel's (its latents in bfloat16, half the bytes a step reads) or, where it does not build, SDPA
        # over float32 latents (bfloat16 SDPA rounds a row by the rows beside it)
        kernel = self.device.type == "cpu" and latent_kernel.load()  # C kernels are built before a step
        cache_dtype = torch.float32 if self.compiled is not None and self.compiled.every_step and not kernel \
            else self.dtype
        self.cache = LatentCache(config.num_hidden_layers, num_blocks, block_size, config.latent_dim, cache_dtype,
                                 self.device)
        # the kernel reads only the positions a row sees: a context read in place is padded, not attended alone
        self.free_padding = latent_kernel.reads(self.cache[0])
        if self.device.type == "cpu":  # the logits' kernel (float32 and bfloat16 heads)
            rows_matmul.load()
        self.verifier = Verifier(model, speculative_config, think_token_ids)
        self.proposer = None
        if compiled_step and isinstance(draft, Eagle3Draft):
            draft = CompiledDraft(draft, progress)
        elif compiled_step and isinstance(draft, MTPDraft):
            draft = CompiledMTP(draft, progress)
        if draft is not None:  # a draft that proposes a block in one forward (DFlash), or one token per forward
            kind = BlockProposer if isinstance(draft, BlockDraft) else Proposer
            self.proposer = kind(draft, speculative_config, num_blocks * block_size, block_size,
                                 max_model_len or config.max_position_embeddings, self.dtype, self.device, lanes)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> StepOutput:
        start = time.perf_counter()
        seqs = batch.seqs
        proposer = self.proposer
        width = proposer.width(batch) if proposer is not None else 0
        layout = VerifyLayout.of(batch)
        # 1-2. merge and verify
        aux_ids = proposer.draft.aux_hidden_state_ids if proposer is not None else ()
        hidden, aux = self.forward(batch, aux_ids)
        # 3. accept
        verified = self.verifier(seqs, hidden, layout)
        # 4. rollback: keep the target KV of committed tokens and accepted drafts only
        num_computed = [seq.num_computed + layout.num_kept(i, a)
                        for i, (seq, a) in enumerate(zip(seqs, verified.num_accepted))]
        num_verified = [layout.num_drafts[i] if i in layout.sampling else 0 for i in range(len(seqs))]
        # 5. propose
        if proposer is None:
            proposal = Proposal([[] for _ in seqs], num_computed, [None] * len(seqs), False)
        else:
            proposal = proposer.propose(batch, layout, hidden, aux, verified.new_tokens, verified.num_accepted,
                                        num_computed, width)
        # 6. pack
        output = StepOutput(verified.new_tokens, num_computed, proposal.draft_tokens, proposal.num_draft_computed,
                            proposal.pending_draft_inputs, verified.logprobs, num_verified, verified.num_accepted)
        if proposer is not None:
            proposer.observe(batch, width, num_verified, verified.num_accepted, time.perf_counter() - start, proposal)
        return output

    def forward(self, batch: ScheduledBatch, aux_hidden_state_ids: tuple[int, ...] = ()
                ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Target forward over this step's tokens (committed, then pending drafts, per sequence): final hidden
        states [num_tokens, H] and the aux hidden states asked for."""
        input_ids, seq_lens = [], []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            tokens = seq.token_ids + seq.draft_tokens if seq.draft_tokens else seq.token_ids
            input_ids.extend(tokens[seq.num_computed:seq.num_computed + n])
            seq_lens.append(seq.num_computed + n)
        attn = AttentionMetadata.build(batch.num_new_tokens, seq_lens, [s.block_table for s in batch.seqs],
                                       self.block_size, self.device, lanes=self.lanes,
                                       free_padding=self.free_padding)
        input_ids = torch.tensor(input_ids, device=self.device)
        if self.compiled is not None and self.compiled.runs(attn):
            return self.compiled.forward(input_ids, attn, self.cache, aux_hidden_state_ids)
        return self.model.model(input_ids, attn, self.cache, aux_hidden_state_ids)
