"""KV memory bookkeeping: fixed-size blocks of KV rows, and per-sequence state slots. Pure Python.

Blocks are handed out on demand: a request gets the blocks of its prompt when it is admitted and
one more block whenever its next token's row falls past its last block (`grow_seq`). `seq.blocks`
is the one block table; `kv_rows(blocks, ...)` maps positions to KV rows. When `grow_seq` fails the
scheduler preempts (swaps out) a request. With `reserve_kv` the scheduler instead allocates
prompt + max_tokens at admission and `grow_seq` never needs a block.

This class is the one owner of a sequence's KV memory (vLLM V1's KV cache manager): the scheduler
and its parts (chunks.py, preemption.py) decide when, and `allocate_seq` / `grow_seq` /
`shrink_seq` / `free_seq` change `seq.blocks`, `seq.slot` and `seq.room` together, so that no call
site can change a table and forget `room` (sequence.py: OWNERS). `allocate` and `free` are the
same on bare block lists, for callers without a scheduled Sequence (infer/sim/latency.py).

Prefix caching (chunks.py decides when to look up and register): a block is reference counted
(`ref`: how many block tables hold it). A full prompt block whose rows are completely written can
be registered under the hash of its token prefix (`block_hashes`); a later request whose prompt
starts with the same tokens takes it read-only (`allocate_seq(..., hits)`). A registered block that
nobody holds any more stays cached (`cached`, LRU order) and counts as free: allocation takes
never-registered free blocks first, then evicts the least recently used cached block (its hash
is forgotten). A block is always exactly one of: held (ref > 0), plain free, or cached.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (annotations only: nothing of the engine is imported at run time, so no cycle)
    from .sequence import Sequence


def block_hashes(ids: list[int], block_size: int, known: list[bytes]) -> list[bytes]:
    """Extend `known` (a prefix of the chain) to one digest per full block of `ids`: block i's
    digest covers tokens 0..(i+1)*block_size-1 (the parent's digest + its own token ids), so equal
    digests mean equal prefixes (sha256: collisions are not a practical correctness risk)."""
    for i in range(len(known), len(ids) // block_size):
        parent = known[-1] if known else b""
        known.append(hashlib.sha256(parent + array("q", ids[i * block_size:(i + 1) * block_size]).tobytes()).digest())
    return known


def kv_rows(blocks: list[int], block_size: int, n: int) -> list[int]:
    """The KV rows of positions 0..n-1 of a sequence whose block table is `blocks`: the one place the
    row of a position is computed (block `p // block_size`, offset `p % block_size`)."""
    return [blocks[p // block_size] * block_size + p % block_size for p in range(n)]


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, num_slots: int):
        if num_blocks < 1 or block_size < 1 or num_slots < 1:
            raise ValueError("num_blocks, block_size and num_slots must be >= 1")
        self.num_blocks, self.block_size, self.num_slots = num_blocks, block_size, num_slots
        self.free_blocks: deque[int] = deque(range(num_blocks))  # free, never registered (or evicted)
        self.free_slots: deque[int] = deque(range(num_slots))
        self.ref = [0] * num_blocks
        self.by_hash: dict[bytes, int] = {}  # registered blocks (held or cached)
        self.hash_of: dict[int, bytes] = {}
        self.cached: OrderedDict[int, None] = OrderedDict()  # registered, held by nobody; oldest first
        self.evictions = 0  # cached blocks reused for something else

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: plain free ones and evictable cached ones."""
        return len(self.free_blocks) + len(self.cached)

    def match(self, hashes: list[bytes]) -> list[int]:
        """The registered blocks of the longest leading run of `hashes` (a prompt's block chain)."""
        out = []
        for h in hashes:
            b = self.by_hash.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def can_allocate(self, tokens: int, keep_free: int = 0, hits: list[int] = ()) -> bool:
        """A slot and the blocks for `tokens` rows are free, leaving `keep_free` blocks free; the
        first len(hits) blocks are the cached blocks `hits` (taking a cached one uses up a free one)."""
        new = self.blocks_for(tokens) - len(hits)
        idle = sum(1 for b in hits if b in self.cached)
        return bool(self.free_slots) and new + keep_free <= self.num_free - idle

    def allocate(self, tokens: int, hits: list[int] = ()) -> tuple[list[int], int]:
        """Blocks for `tokens` rows (the shared `hits` first, then new ones) and a state slot
        (a bare table: a scheduled Sequence gets its own through `allocate_seq`)."""
        if not self.can_allocate(tokens, 0, hits):
            raise RuntimeError(f"cannot allocate {self.blocks_for(tokens)} blocks (free {self.num_free}) and a slot")
        for b in hits:
            self.cached.pop(b, None)
            self.ref[b] += 1
        blocks = list(hits)
        blocks.extend(self._take() for _ in range(self.blocks_for(tokens) - len(hits)))
        return blocks, self.free_slots.popleft()

    # ---- a sequence's block table and slot: the one place they change (sequence.py: OWNERS)
    def _fit(self, seq: Sequence) -> None:
        # the output tokens whose KV rows the table holds, kept with the table so that the growth
        # check after each token is one comparison (Scheduler.postprocess)
        seq.room = len(seq.blocks) * self.block_size - len(seq.prompt_ids)

    def allocate_seq(self, seq: Sequence, tokens: int, hits: list[int] = ()) -> None:
        """Give `seq` (holding nothing) the blocks for `tokens` rows (`hits` first) and a slot."""
        seq.blocks, seq.slot = self.allocate(tokens, hits)
        self._fit(seq)

    def grow_seq(self, seq: Sequence, tokens: int) -> bool:
        """Extend `seq`'s block table in place to hold `tokens` rows; False (and no change) when
        not enough blocks are free."""
        n = self.blocks_for(tokens) - len(seq.blocks)
        if n <= 0:
            return True
        if n > self.num_free:
            return False
        for _ in range(n):  # (decode grows one block at a time: a plain loop, no generator to build)
            seq.blocks.append(self._take())
        self._fit(seq)
        return True

    def shrink_seq(self, seq: Sequence, tokens: int) -> None:
        """Cut `seq`'s block table in place to the blocks of `tokens` rows, freeing the rest
        (speculative decoding's rollback: the blocks of rejected draft positions)."""
        n = self.blocks_for(tokens)
        if len(seq.blocks) > n:
            tail = seq.blocks[n:]
            del seq.blocks[n:]
            self.free(tail, -1)
            self._fit(seq)

    def free_seq(self, seq: Sequence) -> None:
        """Release `seq`'s blocks and slot (`free`); it holds neither afterwards. The table becomes a
        new empty list, not the old one cleared: a swap-out's SwapOp still reads the old one."""
        self.free(seq.blocks, seq.slot)
        seq.blocks, seq.slot = [], -1
        self._fit(seq)

    def _take(self) -> int:
        if self.free_blocks:
            b = self.free_blocks.popleft()
        else:  # evict the least recently used cached block: its prefix is forgotten
            b, _ = self.cached.popitem(last=False)
            del self.by_hash[self.hash_of.pop(b)]
            self.evictions += 1
        self.ref[b] = 1
        return b

    def free(self, blocks: list[int], slot: int) -> None:
        """Release a block table (and a slot): a block nobody holds any more becomes free, or
        cached if registered. Last block first, so that a prompt's tail is evicted before its head
        (a later block can only be hit together with every block before it)."""
        for b in reversed(blocks):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                if b in self.hash_of:
                    self.cached[b] = None
                else:
                    self.free_blocks.append(b)
        if slot >= 0:
            self.free_slots.append(slot)

    def register(self, block: int, h: bytes) -> None:
        """Offer a held, completely written prompt block to later requests under its prefix hash
        `h`; a hash already registered keeps its block (this one stays private)."""
        if h not in self.by_hash and block not in self.hash_of:
            self.by_hash[h], self.hash_of[block] = block, h

    def reset_cache(self) -> None:
        """Forget every registered prefix: cached blocks become plain free blocks, held ones private."""
        self.free_blocks.extend(self.cached)
        self.cached.clear()
        self.by_hash.clear()
        self.hash_of.clear()

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    @property
    def all_free(self) -> bool:
        return self.num_free == self.num_blocks and len(self.free_slots) == self.num_slots

