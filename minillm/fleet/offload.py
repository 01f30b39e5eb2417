"""KV offload to host memory: a second, slower capacity tier under a replica's prefix cache.

The device pool is the engine's BlockManager: when it needs a block and has none free it evicts the least recently
used cached block, and that prefix is gone (a later prompt that starts with it recomputes it). With a host tier
the evicted block is copied to host memory instead (the blocks a preempted sequence held are cached blocks, so they
take the same path when the pool reclaims them). A later prompt whose prefix continues past the device hits into
the host tier gets those blocks copied back over PCIe before it is admitted: a transfer instead of a recompute.

Modelled at the level of block hashes, around the real BlockManager rather than inside it:

* HostTier is an LRU of chained block hashes (the prefix cache's own keys) with a capacity in blocks;
* OffloadingBlockManager is the engine's BlockManager whose `take_block` (the one place the pool evicts) first
  records the victim's hash in the host tier;
* `swap_in` (called by the replica before schedule()) walks a waiting prompt's block hashes past the device hits;
  consecutive ones the host holds are re-registered in the device prefix cache exactly as if a sequence had just
  computed them, so the real scheduler's admission sees them as prefix hits. The replica adds the PCIe time of
  those blocks to its next step (not overlapped with the forward pass: a conservative choice).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as Seq

from minillm.engine.sequence import Sequence
from minillm.kv.block_manager import BlockManager

_SWAP_SEQ_ID = -1     # a scratch block table: engine sequence ids count up from 0


class HostTier:
    """Block hashes held in host memory, least recently used first."""

    def __init__(self, capacity_blocks: int, block_bytes: float, bytes_per_s: float) -> None:
        if capacity_blocks < 0 or block_bytes <= 0 or bytes_per_s <= 0:
            raise ValueError("a host KV tier needs capacity_blocks >= 0, block_bytes > 0 and bytes_per_s > 0")
        self.capacity = capacity_blocks
        self.seconds_per_block = block_bytes / bytes_per_s
        self._lru: OrderedDict[int, None] = OrderedDict()
        self.stored = 0        # blocks copied device -> host
        self.loaded = 0        # blocks copied host -> device (hits)
        self.seconds = 0.0     # PCIe time charged for the loads

    def store(self, h: int) -> None:
        if not self.capacity:
            return
        self._lru.pop(h, None)
        self._lru[h] = None
        self.stored += 1
        if len(self._lru) > self.capacity:
            self._lru.popitem(last=False)

    def __contains__(self, h: object) -> bool:
        return h in self._lru

    def __len__(self) -> int:
        return len(self._lru)

    def touch(self, h: int) -> None:
        self._lru.move_to_end(h)

    def empty(self) -> "HostTier":
        """A tier like this one with nothing in it (a replaced replica's)."""
        tier = HostTier(self.capacity, 1.0, 1.0)
        tier.seconds_per_block = self.seconds_per_block
        return tier


class OffloadingBlockManager(BlockManager):
    """The engine's BlockManager (prefix caching on) that copies every cached block it evicts to a host tier."""

    def __init__(self, num_blocks: int, block_size: int, host: HostTier) -> None:
        super().__init__(num_blocks, block_size, enable_prefix_caching=True)
        self.host = host

    def take_block(self) -> int:
        if not self.allocator.num_free_blocks and len(self.evictor):
            victim = next(iter(self.evictor))            # what super().take_block() is about to evict (LRU)
            h = self._block_hash.get(victim)
            if h is not None:
                self.host.store(h)
        return super().take_block()


def block_hashes(bm: BlockManager, token_ids: Seq[int]) -> list[int]:
    """The chained hashes of the prompt's full blocks that a prefix hit may cover ((len - 1) // block_size)."""
    bs, h, out = bm.block_size, None, []
    for i in range((len(token_ids) - 1) // bs):
        h = bm.hash_fn(h, tuple(token_ids[i * bs:(i + 1) * bs]))
        out.append(h)
    return out


def swap_in(bm: OffloadingBlockManager, waiting: Seq[Sequence]) -> int:
    """Load the host-tier blocks that extend the device prefix hits of `waiting` (the sequences about to be
    admitted, in order) back into the device prefix cache. Returns the number of blocks loaded; stops at the first
    sequence whose loads do not fit in the free pool (admission would stop there too)."""
    host, bs, loaded = bm.host, bm.block_size, 0
    if not len(host):
        return 0
    for seq in waiting:
        hashes = block_hashes(bm, seq.token_ids)
        k = bm.peek_prefix(seq.token_ids) // bs
        m = k
        while m < len(hashes) and hashes[m] in host:
            m += 1
        if m == k:
            continue
        prefix = seq.token_ids[:m * bs + 1]
        if bm.blocks_to_admit(prefix, m * bs) > bm.num_free_blocks:
            break
        for h in hashes[k:m]:      # most recently used first: the evictions the loads cause must not drop them
            host.touch(h)
        # Register blocks k..m-1 as a sequence that just computed them would: allocate, write, commit, let go.
        bm.allocate_prompt(_SWAP_SEQ_ID, prefix)
        bm.append_slots(_SWAP_SEQ_ID, m * bs)
        bm.commit_computed(_SWAP_SEQ_ID, prefix, m * bs)
        bm.free(_SWAP_SEQ_ID)
        loaded += m - k
    host.loaded += loaded
    host.seconds += loaded * host.seconds_per_block
    return loaded
