"""The paged KV cache: fixed-size blocks handed out by a free-list allocator (plain Python, no torch),
and the tensors that hold them.

The target's cache stores, per token per layer, only the MLA latent: the normalised compressed KV
(kv_lora_rank values) and the roped shared key (qk_rope_head_dim values) — 576 values for DeepSeek-V3, where
expanded per-head K and V would take num_heads * (qk_head_dim + v_head_dim) = 40,960.
"""

from __future__ import annotations

import heapq

import torch


class OutOfBlocks(RuntimeError):
    pass


class BlockAllocator:
    """Free-list allocation of fixed-size blocks, with lanes as a placement preference.

    With `num_lanes`, the first num_lanes * lane_blocks blocks are cut into lanes of lane_blocks consecutive blocks.
    A sequence's first block starts a lane when a whole lane is free, and it grows along its lane while the next
    block is free, so its context is one contiguous run of the cache that batched attention reads in place (a
    strided view) instead of gathering it. Lanes only choose which free block is handed out: every block stays
    available to every sequence, and a sequence that starts with no lane free, or grows past its lane, takes any
    free block (from the top of the cache down, to keep whole lanes free) and is attended by gathering.
    """

    def __init__(self, num_blocks: int, block_size: int, num_lanes: int = 0) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.lane_blocks = num_blocks // num_lanes if num_lanes and num_blocks // num_lanes >= 2 else 0
        self.num_lanes = num_lanes if self.lane_blocks else 0
        self._free: set[int] = set(range(num_blocks))
        # candidates for a block with no placement preference (lazy: entries may be taken); see _order
        self._heap = sorted(map(self._order, range(num_blocks)))
        self._lane_free = [self.lane_blocks] * self.num_lanes  # free blocks per lane

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

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
            block = self._placed(block_table)
            block = self._any_free() if block is None else block
            self._take(block)
            block_table.append(block)

    def shrink(self, block_table: list[int], num_tokens: int) -> None:
        """Free the blocks past the first num_tokens tokens (rollback of rejected positions)."""
        keep = self.blocks_for(num_tokens)
        while len(block_table) > keep:
            block = block_table.pop()
            self._free.add(block)
            heapq.heappush(self._heap, self._order(block))
            if block < self.num_lanes * self.lane_blocks:
                self._lane_free[block // self.lane_blocks] += 1
        if len(self._heap) > 4 * self.num_blocks:  # blocks placed by lanes leave stale entries behind
            self._heap = sorted(map(self._order, self._free))

    def free(self, block_table: list[int]) -> None:
        self.shrink(block_table, 0)

    def _placed(self, block_table: list[int]) -> int | None:
        """The block a lane prefers next for this table: the next one along its lane, or the start of a whole free
        lane for a new table; None when there is none."""
        if not self.num_lanes:
            return None
        if not block_table:
            for lane, free in enumerate(self._lane_free):
                if free == self.lane_blocks:
                    return lane * self.lane_blocks
            return None
        nxt = block_table[-1] + 1
        in_lane = nxt < self.num_lanes * self.lane_blocks and nxt % self.lane_blocks
        return nxt if in_lane and nxt in self._free else None

    def _order(self, block: int) -> int:
        """The heap key: with lanes the highest free block comes first (whole lanes stay free longest), without
        them the lowest (a sequence alone gets ascending blocks, one run)."""
        return -block if self.num_lanes else block

    def _any_free(self) -> int:
        while True:
            block = self._order(heapq.heappop(self._heap))  # the key is its own inverse
            if block in self._free:
                return block

    def _take(self, block: int) -> None:
        self._free.remove(block)
        if block < self.num_lanes * self.lane_blocks:
            self._lane_free[block // self.lane_blocks] -= 1


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
