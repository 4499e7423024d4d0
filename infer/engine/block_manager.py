"""KV memory bookkeeping: fixed-size blocks of KV rows, and per-sequence state slots. Pure Python.

A request reserves the blocks for its whole possible length (prompt + max_tokens, capped by the
context) when it is admitted, so a running request can never run out of KV and admission can
never deadlock: a request that does not fit waits until others finish, and one that could never
fit in the pool is rejected when it is added.
"""
from __future__ import annotations

from collections import deque


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, num_slots: int):
        if num_blocks < 1 or block_size < 1 or num_slots < 1:
            raise ValueError("num_blocks, block_size and num_slots must be >= 1")
        self.num_blocks, self.block_size, self.num_slots = num_blocks, block_size, num_slots
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.free_slots: deque[int] = deque(range(num_slots))

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def can_allocate(self, tokens: int) -> bool:
        return bool(self.free_slots) and self.blocks_for(tokens) <= len(self.free_blocks)

    def allocate(self, tokens: int) -> tuple[list[int], int]:
        """Blocks for `tokens` rows and a state slot."""
        n = self.blocks_for(tokens)
        if not self.can_allocate(tokens):
            raise RuntimeError(f"cannot allocate {n} blocks (free {len(self.free_blocks)}) and a slot")
        return [self.free_blocks.popleft() for _ in range(n)], self.free_slots.popleft()

    def free(self, blocks: list[int], slot: int) -> None:
        self.free_blocks.extend(blocks)
        if slot >= 0:
            self.free_slots.append(slot)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free_blocks) / self.num_blocks

    @property
    def all_free(self) -> bool:
        return len(self.free_blocks) == self.num_blocks and len(self.free_slots) == self.num_slots

    def row(self, blocks: list[int], pos: int) -> int:
        return blocks[pos // self.block_size] * self.block_size + pos % self.block_size
