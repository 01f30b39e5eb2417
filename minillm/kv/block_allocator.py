"""The block allocator: the KV pool's block ids and one reference count per block (the BlockAllocator seam).

A block is free when nothing holds it (ref count 0). The BlockManager takes blocks from here for block tables,
shares them (fork, prefix-cache hits, the prefix cache's own hold on a cached block) and gives them back; a block
returns to the pool only when its last holder lets go."""
from __future__ import annotations

from collections import deque


class NoFreeBlocksError(RuntimeError):
    """Not enough free blocks for the request. The state of whoever raised it is unchanged."""


class BlockAllocator:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = int(num_blocks)
        self.ref_counts = [0] * self.num_blocks
        # FIFO: a freed block goes to the back, so the blocks handed out next are the ones idle longest.
        self.free_blocks: deque[int] = deque(range(self.num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def allocate(self) -> int:
        if not self.free_blocks:
            raise NoFreeBlocksError(f"all {self.num_blocks} blocks are in use")
        block = self.free_blocks.popleft()
        self.ref_counts[block] = 1
        return block

    def share(self, block: int) -> None:
        if self.ref_counts[block] <= 0:
            raise ValueError(f"share({block}): block {block} is free; only a block in use can be shared")
        self.ref_counts[block] += 1

    def free(self, block: int) -> None:
        if self.ref_counts[block] <= 0:
            raise ValueError(f"free({block}): block {block} is already free (a double free would hand it out twice)")
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free_blocks.append(block)

    def ref_count(self, block: int) -> int:
        return self.ref_counts[block]
