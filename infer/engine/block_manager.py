"""KV memory bookkeeping: fixed-size blocks of KV rows, and per-sequence state slots. Pure Python.

Blocks are handed out on demand: a request gets the blocks of its prompt when it is admitted and
one more block whenever its next token's row falls past its last block (`grow`). `seq.blocks` is
the one block table; `row(blocks, pos)` maps a position to its KV row. When `grow` fails the
scheduler preempts (swaps out) a request. With `reserve_kv` the scheduler instead allocates
prompt + max_tokens at admission and `grow` never needs a block.
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

    def can_allocate(self, tokens: int, keep_free: int = 0) -> bool:
        """A slot and the blocks for `tokens` rows are free, leaving `keep_free` blocks free."""
        return bool(self.free_slots) and self.blocks_for(tokens) + keep_free <= len(self.free_blocks)

    def allocate(self, tokens: int) -> tuple[list[int], int]:
        """Blocks for `tokens` rows and a state slot."""
        n = self.blocks_for(tokens)
        if not self.can_allocate(tokens):
            raise RuntimeError(f"cannot allocate {n} blocks (free {len(self.free_blocks)}) and a slot")
        return [self.free_blocks.popleft() for _ in range(n)], self.free_slots.popleft()

    def grow(self, blocks: list[int], tokens: int) -> bool:
        """Extend the block table `blocks` in place to hold `tokens` rows; False (and no change)
        when not enough blocks are free."""
        n = self.blocks_for(tokens) - len(blocks)
        if n > len(self.free_blocks):
            return False
        blocks.extend(self.free_blocks.popleft() for _ in range(max(0, n)))
        return True

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
