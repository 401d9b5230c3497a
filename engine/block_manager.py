"""Paged KV bookkeeping: which cache blocks each sequence owns. Plain Python, no tensors.

A sequence holding n tokens owns ceil(n / block_size) blocks, listed in order in its block table;
token position p lives in slot ``block_table[p // block_size] * block_size + p % block_size``.
Speculative lookahead slots are just extra capacity; rolling back rejected tokens is ``trim``.
"""

from __future__ import annotations

from collections import deque

from .sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1:
            raise ValueError("the KV cache budget is smaller than one block; raise kv_cache_bytes")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def extra_blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        return max(0, self.blocks_for(num_tokens) - len(seq.block_table))

    def ensure_capacity(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow ``seq``'s block table to hold ``num_tokens`` slots; all or nothing."""
        need = self.extra_blocks_needed(seq, num_tokens)
        if need > len(self._free):
            return False
        for _ in range(need):
            seq.block_table.append(self._free.popleft())
        return True

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Free the blocks past those needed for ``num_tokens`` (rollback of lookahead slots)."""
        keep = self.blocks_for(num_tokens)
        while len(seq.block_table) > keep:
            self._free.append(seq.block_table.pop())

    def free(self, seq: Sequence) -> None:
        self._free.extend(seq.block_table)
        seq.block_table.clear()

    def slot(self, seq: Sequence, position: int) -> int:
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size
