"""The paged KV block pool: allocation, refcounts, the prefix cache and its events.

A block holds the KV of ``block_size`` consecutive tokens of one sequence. A *full* block can be
registered in the prefix cache under its chain hash (see ``hash_block``); another request whose
prompt produces the same hash reuses it instead of recomputing it.

Invariants:
  * every block is in exactly one state: free (no hash, refcount 0, in ``_free``),
    cached-evictable (hash, refcount 0, owned by the eviction policy), or in use (refcount > 0);
  * a block's hash never changes while it is cached; ``_cached[h].block_hash == h``; a cached
    block's KV is never written (writes go to uncached blocks), and ``generation`` grows each
    time a block leaves the cache, so the KV of a block whose hash and generation are unchanged
    over a copy is the KV of that hash (what lets pulls export without the engine thread);
  * ``num_free_blocks()`` = free + cached-evictable blocks; ``num_free_blocks(tenant)`` = what
    ``tenant`` may take without touching another tenant's guaranteed minimum = the most
    ``allocate(n, tenant)`` can get. Another tenant's guaranteed blocks are never taken, not
    even when the pool is idle: a request that could only fit that way is refused up front
    (``capacity(tenant)``, checked by ``LLMEngine.validate``), so every admitted request fits
    once the requests in use release their blocks, and none has to wait forever.
Side effects on the prefix cache become data: ``take_events()`` drains stored/removed events
(published in batches to the global index).
"""

from __future__ import annotations

import hashlib
import struct
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from policies.eviction import TenantEvictionPolicy

BlockHash = bytes
TenantId = str
ROOT_HASH: BlockHash = b"\x00" * 16


def hash_block(parent: BlockHash | None, tokens: Sequence[int], extra: bytes) -> BlockHash:
    """Stable chain hash of a full block: H(parent, tokens, extra keys), 16 bytes of sha256.

    ``extra`` carries the model id and the share domain, so blocks of different models or of
    isolated tenants never collide.
    """
    h = hashlib.sha256(parent or ROOT_HASH)
    h.update(struct.pack(f"<{len(tokens)}I", *tokens))
    h.update(extra)
    return h.digest()[:16]


def extra_key(model_id: str, domain: str) -> bytes:
    """The extra keys of every block hash: model id and share domain."""
    return f"{model_id}\x00{domain}".encode()


def hash_blocks(tokens: Sequence[int], block_size: int, extra: bytes, parent: BlockHash | None = None) -> list[BlockHash]:
    """Chain hashes of every full block of ``tokens``."""
    out: list[BlockHash] = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash_block(parent, tokens[start : start + block_size], extra)
        out.append(parent)
    return out


def prompt_chains(tokens: Sequence[int], block_size: int, model_id: str, domains: Iterable[str],
                  num_blocks: int | None = None) -> dict[str, list[BlockHash]]:
    """Chain hashes of a prompt under each readable domain (own domain first, then grants).

    By default ``(len - 1) // block_size`` blocks, as many as the engine can reuse (it always
    computes at least one token).
    """
    n = (len(tokens) - 1) // block_size if num_blocks is None else num_blocks
    head = list(tokens[: n * block_size])
    return {d: hash_blocks(head, block_size, extra_key(model_id, d)) for d in dict.fromkeys(domains)}


@dataclass(slots=True)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    parent_hash: BlockHash | None = None
    owner: TenantId | None = None
    # bumped each time the block leaves the prefix cache: a reader off the engine thread that saw
    # the same generation and hash before and after copying the block read KV that was not
    # overwritten meanwhile (only uncached blocks are ever written; ``LLMEngine.export_prefix``)
    generation: int = 0


@dataclass(frozen=True, slots=True)
class BlockEvent:
    """A change of the prefix cache: kind is 'stored' or 'removed'."""

    kind: str
    block_hash: BlockHash
    parent_hash: BlockHash | None = None
    domain: str | None = None


class NoFreeBlocks(RuntimeError):
    pass


@dataclass
class TenantCacheStats:
    evictions: int = 0
    stored: int = 0


class BlockPool:
    """Fixed pool of KV blocks with a hash → block prefix cache and pluggable eviction."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        eviction: TenantEvictionPolicy | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() gives lowest id first
        self._cached: dict[BlockHash, Block] = {}
        self._domain: dict[BlockHash, str] = {}
        self.eviction = eviction or TenantEvictionPolicy()
        self.clock = clock
        self._events: list[BlockEvent] = []
        self._num_in_use = 0
        self.stats: dict[TenantId, TenantCacheStats] = {}

    # -- queries ---------------------------------------------------------------------------
    def num_free_blocks(self, tenant: TenantId | None = None) -> int:
        """Free + evictable blocks; for a ``tenant``, only those it may take (see module doc)."""
        if tenant is None:
            return len(self._free) + self.eviction.num_evictable()
        return len(self._free) + self.eviction.num_evictable_for(tenant)

    def capacity(self, tenant: TenantId) -> int:
        """The most blocks ``tenant`` can ever hold at once: the pool minus every other tenant's
        guaranteed minimum (blocks it may keep cached whatever ``tenant`` needs)."""
        return max(0, self.num_blocks - self.eviction.guaranteed_for_others(tenant))

    def num_in_use(self) -> int:
        """Blocks with refcount > 0."""
        return self._num_in_use

    def get_cached_block(self, block_hash: BlockHash) -> Block | None:
        return self._cached.get(block_hash)

    def domain_of(self, block_hash: BlockHash) -> str | None:
        """The share domain a cached block was stored under (None if not cached)."""
        return self._domain.get(block_hash)

    def cached_hashes(self) -> list[tuple[BlockHash, BlockHash | None, str | None]]:
        """Snapshot of the prefix cache (for rebuilding a global index)."""
        return [(h, b.parent_hash, self._domain.get(h)) for h, b in self._cached.items()]

    def _tenant_stats(self, tenant: TenantId) -> TenantCacheStats:
        return self.stats.setdefault(tenant, TenantCacheStats())

    # -- verbs -----------------------------------------------------------------------------
    def allocate(self, n: int, tenant: TenantId) -> list[Block]:
        """Take ``n`` blocks (refcount 1), evicting cached blocks chosen by the policy, never
        another tenant's guaranteed ones. Raises NoFreeBlocks, changing nothing, when
        ``n > num_free_blocks(tenant)``.
        """
        if n > self.num_free_blocks(tenant):
            raise NoFreeBlocks(f"need {n} blocks, {self.num_free_blocks(tenant)} free for tenant {tenant!r}")
        out: list[Block] = []
        now = self.clock()
        for _ in range(n):
            if not self._free:
                victim = self.eviction.pop_victim(tenant, now)
                assert victim is not None, "num_free_blocks() counted a block the policy cannot give"
                self._evict(self.blocks[victim])
            block = self.blocks[self._free.pop()]
            block.ref_cnt = 1
            out.append(block)
        self._num_in_use += n
        return out

    def can_allocate(self, n: int, tenant: TenantId | None = None) -> bool:
        return n <= self.num_free_blocks(tenant)

    def touch(self, blocks: Sequence[Block]) -> None:
        """Take a reference on cache-hit blocks (removing them from the evictable set)."""
        for block in blocks:
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    raise AssertionError(f"touch of free block {block.block_id}")
                self.eviction.on_acquired(block.block_id)
                self._num_in_use += 1
            self.eviction.on_hit(block.block_id)
            block.ref_cnt += 1

    def free(self, blocks: Sequence[Block]) -> None:
        """Drop one reference on each block; tail blocks first so they are evicted first."""
        now = self.clock()
        for block in reversed(blocks):
            if block.ref_cnt <= 0:
                raise AssertionError(f"double free of block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt:
                continue
            self._num_in_use -= 1
            if block.block_hash is None:
                self._free.append(block.block_id)
            else:
                self.eviction.on_released(block.block_id, now)
        self._enforce_caps({b.owner for b in blocks if b.owner is not None})

    def cache_full_block(
        self, block: Block, block_hash: BlockHash, parent: BlockHash | None, owner: TenantId, domain: str
    ) -> bool:
        """Register a full, in-use block under ``block_hash``. False if that hash is cached already
        (another request computed it concurrently): the block then stays private."""
        if block.block_hash is not None:
            return block.block_hash == block_hash
        if block_hash in self._cached:
            return False
        block.block_hash, block.parent_hash, block.owner = block_hash, parent, owner
        self._cached[block_hash] = block
        self._domain[block_hash] = domain
        up = self._cached.get(parent) if parent is not None else None
        self.eviction.on_cached(block.block_id, owner, up.block_id if up is not None else None)
        self._tenant_stats(owner).stored += 1
        self._events.append(BlockEvent("stored", block_hash, parent, domain))
        return True

    def evict_expired(self) -> int:
        victims = self.eviction.pop_expired(self.clock())
        for victim in victims:
            self._evict(self.blocks[victim])
        return len(victims)

    def reset_prefix_cache(self) -> int:
        """Drop every evictable cached block (in-use blocks stay). Returns how many."""
        n = 0
        for block in list(self._cached.values()):
            if block.ref_cnt == 0:
                self.eviction.on_acquired(block.block_id)
                self._evict(block)
                n += 1
        return n

    def take_events(self) -> list[BlockEvent]:
        events, self._events = self._events, []
        return events

    @property
    def has_events(self) -> bool:
        """Whether events wait for ``take_events``. Safe to read from another thread (one list
        truthiness read): a stale False only delays their publication by one publisher tick."""
        return bool(self._events)

    def check_invariants(self) -> None:
        """Raise AssertionError unless the accounting in the module docstring holds (for tests)."""
        free = set(self._free)
        assert len(free) == len(self._free), "a block is twice in the free list"
        evictable = self.eviction.evictable_ids()
        held: dict[TenantId, int] = {}
        for block in self.blocks:
            i = block.block_id
            assert block.ref_cnt >= 0, f"block {i} has refcount {block.ref_cnt}"
            if block.block_hash is None:
                assert block.owner is None and i not in evictable, f"uncached block {i} is evictable"
                assert (i in free) == (block.ref_cnt == 0), f"block {i}: refcount {block.ref_cnt}, free={i in free}"
            else:
                assert i not in free, f"cached block {i} is in the free list"
                assert self._cached.get(block.block_hash) is block, f"block {i} is not cached under its hash"
                assert (i in evictable) == (block.ref_cnt == 0), f"cached block {i}: refcount {block.ref_cnt}"
                held[block.owner] = held.get(block.owner, 0) + 1
        assert len(self._cached) == sum(held.values()), "hash map and blocks disagree"
        assert self._num_in_use == sum(1 for b in self.blocks if b.ref_cnt), "in-use count is off"
        assert {t: n for t, n in self.eviction.held.items() if n} == held, "policy's held counts are off"
        assert self.eviction.tail_ids() <= evictable, "a tail block is not evictable"

    # -- internals -------------------------------------------------------------------------
    def _enforce_caps(self, tenants: set[TenantId]) -> None:
        for tenant in tenants:
            for victim in self.eviction.pop_over_cap(tenant):
                self._evict(self.blocks[victim])

    def _evict(self, block: Block) -> None:
        """Uncache a block the policy has already removed from its evictable set."""
        assert block.ref_cnt == 0 and block.block_hash is not None
        owner = block.owner
        del self._cached[block.block_hash]
        domain = self._domain.pop(block.block_hash, None)
        self._events.append(BlockEvent("removed", block.block_hash, block.parent_hash, domain))
        self.eviction.on_dropped(block.block_id)
        self._tenant_stats(owner).evictions += 1
        block.generation += 1
        block.block_hash = block.parent_hash = block.owner = None
        self._free.append(block.block_id)
