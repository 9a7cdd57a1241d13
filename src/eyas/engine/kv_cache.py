"""The paged KV cache: fixed-size blocks handed out by a free-list allocator (plain Python, no torch),
and the tensors that hold them.

The target's cache stores, per token per layer, only the MLA latent: the normalised compressed KV
(kv_lora_rank values) and the roped shared key (qk_rope_head_dim values) — 576 values for DeepSeek-V3, where
expanded per-head K and V would take num_heads * (qk_head_dim + v_head_dim) = 40,960.
"""

from __future__ import annotations

import torch


class OutOfBlocks(RuntimeError):
    pass


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_grow(self, block_table: list[int], num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) - len(block_table) <= self.num_free

    def grow(self, block_table: list[int], num_tokens: int) -> None:
        """Extend block_table in place so it holds num_tokens tokens."""
        need = self.blocks_for(num_tokens) - len(block_table)
        if need > self.num_free:
            raise OutOfBlocks(f"need {need} more blocks, {self.num_free} free")
        for _ in range(need):
            block_table.append(self.free_blocks.pop())

    def shrink(self, block_table: list[int], num_tokens: int) -> None:
        """Free the blocks past the first num_tokens tokens (rollback of rejected positions)."""
        keep = self.blocks_for(num_tokens)
        while len(block_table) > keep:
            self.free_blocks.append(block_table.pop())

    def free(self, block_table: list[int]) -> None:
        self.shrink(block_table, 0)


class LatentCache:
    """One [num_blocks * block_size, latent_dim] tensor per layer, written through a slot mapping."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, latent_dim: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        self.block_size = block_size
        self.tensors = torch.zeros(num_layers, num_blocks * block_size, latent_dim, dtype=dtype, device=device)

    def __getitem__(self, layer: int) -> torch.Tensor:
        return self.tensors[layer]

    @property
    def bytes_per_token(self) -> int:
        num_layers, _, latent_dim = self.tensors.shape
        return num_layers * latent_dim * self.tensors.element_size()
