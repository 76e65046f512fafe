"""Which cached KV block to evict: per-tenant LRU with TTL, priority classes, minimum and cap.

Pure policy (no torch, no Ray). The block pool tells the policy about every change of a cached
block's state and asks it for victims; the policy never touches blocks itself.

States of a *cached* block (one that has a hash and can be hit):
  in use     refcount > 0: never a victim;
  evictable  refcount == 0: kept in its owner's LRU list, oldest release first.

Rules for choosing a victim for a requesting tenant (first rule that yields a block wins):
  1. an expired block (released longer ago than its owner's TTL), any tenant;
  2. a block of a tenant holding more than its cap;
  3. the least recently released block among the lowest priority class that has candidates,
     where a tenant is a candidate only while it holds more than its guaranteed minimum.
     A lower-priority requester takes higher-priority blocks only when no block of its own
     class or lower is left;
  4. the requester's own blocks below its minimum (a tenant may recycle its own guarantee).
Blocks of other tenants at or below their minimum are never victims for someone else, with one
exception the caller must ask for: ``last_resort=True`` adds
  5. any evictable block, lowest priority class first, LRU within it, ignoring minimums.
The block pool never asks for it: a request that could only fit by taking another tenant's
guaranteed blocks is refused up front (``guaranteed_for_others`` bounds what a tenant can ever
hold), so honouring the minimums never leaves an admitted request stuck.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable

BlockId = int
TenantId = str


@dataclass(frozen=True)
class TenantQuota:
    """Per-tenant cache policy. Blocks are KV cache blocks (block_size tokens each)."""

    priority: int = 0  # higher = more important
    min_blocks: int = 0  # guaranteed: never evicted for another tenant while held <= min
    max_blocks: int | None = None  # cap on cached blocks; None = unlimited
    ttl_s: float | None = None  # evictable blocks older than this are dropped first
    # scheduling, not caching (it travels with the quotas to the engines): lower priority classes'
    # prefill is capped at all times, as if this tenant always contended (engine/scheduler.py)
    latency_guard: bool = False

    def __post_init__(self):
        if self.min_blocks < 0:
            raise ValueError("min_blocks must be >= 0")
        if self.max_blocks is not None and self.max_blocks < self.min_blocks:
            raise ValueError("max_blocks must be >= min_blocks")
        if self.ttl_s is not None and self.ttl_s <= 0:
            raise ValueError("ttl_s must be > 0")


class TenantEvictionPolicy:
    """Per-tenant LRU lists of evictable blocks plus counts of cached blocks per tenant.

    Invariants: a block id is in at most one LRU list, and only while it is cached and
    released (refcount 0); ``held[t]`` counts tenant t's cached blocks, in use or not.
    """

    def __init__(self, quotas: dict[TenantId, TenantQuota] | None = None, default: TenantQuota | None = None):
        self._quotas = dict(quotas or {})
        self._default = default or TenantQuota()
        self._lru: dict[TenantId, OrderedDict[BlockId, float]] = {}
        self._owner: dict[BlockId, TenantId] = {}
        self.held: dict[TenantId, int] = {}

    # -- configuration -------------------------------------------------------------------
    def quota(self, tenant: TenantId) -> TenantQuota:
        return self._quotas.get(tenant, self._default)

    def set_quota(self, tenant: TenantId, quota: TenantQuota) -> None:
        self._quotas[tenant] = quota

    def guarded_priorities(self) -> frozenset[int]:
        """Priority classes of the configured tenants with ``latency_guard`` (they always contend)."""
        return frozenset(q.priority for q in self._quotas.values() if q.latency_guard)

    # -- notifications from the pool -------------------------------------------------------
    def on_cached(self, block: BlockId, tenant: TenantId) -> None:
        """A block got a hash (it is in use by its computing request)."""
        self._owner[block] = tenant
        self.held[tenant] = self.held.get(tenant, 0) + 1

    def on_released(self, block: BlockId, now: float) -> None:
        """A cached block's refcount dropped to 0: it becomes evictable, most recent last."""
        tenant = self._owner[block]
        self._lru.setdefault(tenant, OrderedDict())[block] = now

    def on_acquired(self, block: BlockId) -> None:
        """A cached, evictable block got a hit: it is in use again."""
        tenant = self._owner[block]
        self._lru[tenant].pop(block, None)

    def on_dropped(self, block: BlockId) -> None:
        """A cached block lost its hash (evicted or reset); it must not be in use."""
        tenant = self._owner.pop(block)
        lru = self._lru.get(tenant)
        if lru is not None:
            lru.pop(block, None)
        self.held[tenant] -= 1

    # -- questions from the pool -----------------------------------------------------------
    def num_evictable(self) -> int:
        return sum(len(lru) for lru in self._lru.values())

    def num_evictable_for(self, requester: TenantId) -> int:
        """Evictable blocks that ``pop_victim(requester, now)`` is sure to hand out, one by one.

        The requester's own evictable blocks, plus every other tenant's evictable blocks above
        its guaranteed minimum. Each victim lowers this count by at most one, and while it is
        positive ``pop_victim`` never returns None (rule 3 or 4 applies). Expired blocks below a
        minimum are not counted (a lower bound: the pool drops them on its next TTL sweep).
        """
        n = 0
        for tenant, lru in self._lru.items():
            if tenant == requester:
                n += len(lru)
            else:
                n += min(len(lru), max(0, self.held.get(tenant, 0) - self.quota(tenant).min_blocks))
        return n

    def guaranteed_for_others(self, tenant: TenantId) -> int:
        """Blocks other tenants are guaranteed (their ``min_blocks``): configured tenants, plus
        tenants on the default quota that hold blocks now."""
        named = sum(q.min_blocks for t, q in self._quotas.items() if t != tenant)
        default = self._default.min_blocks
        if default:
            named += default * sum(1 for t in self.held if t != tenant and t not in self._quotas)
        return named

    def evictable_ids(self) -> set[BlockId]:
        """Every evictable block (for invariant checks)."""
        return {b for lru in self._lru.values() for b in lru}

    def evictable(self, tenant: TenantId) -> int:
        return len(self._lru.get(tenant, ()))

    def over_cap(self, tenant: TenantId) -> bool:
        cap = self.quota(tenant).max_blocks
        return cap is not None and self.held.get(tenant, 0) > cap

    def pop_expired(self, now: float) -> list[BlockId]:
        """Evictable blocks whose owner's TTL has passed since their release."""
        out: list[BlockId] = []
        for tenant, lru in self._lru.items():
            ttl = self.quota(tenant).ttl_s
            if ttl is None:
                continue
            while lru:
                block, released = next(iter(lru.items()))
                if now - released < ttl:
                    break
                out.append(block)
                lru.popitem(last=False)
        return out

    def pop_over_cap(self, tenant: TenantId) -> list[BlockId]:
        """Evictable blocks of ``tenant`` to drop so that it holds at most its cap."""
        cap = self.quota(tenant).max_blocks
        lru = self._lru.get(tenant)
        out: list[BlockId] = []
        if cap is None or not lru:
            return out
        excess = self.held.get(tenant, 0) - cap
        while excess > 0 and lru:
            out.append(lru.popitem(last=False)[0])
            excess -= 1
        return out

    def pop_victim(self, requester: TenantId, now: float, last_resort: bool = False) -> BlockId | None:
        """Choose and remove one evictable block for ``requester``'s demand, or None."""
        # 1. expired blocks
        for tenant, lru in self._lru.items():
            ttl = self.quota(tenant).ttl_s
            if ttl is not None and lru and now - next(iter(lru.values())) >= ttl:
                return lru.popitem(last=False)[0]
        # 2. tenants over their cap
        for tenant, lru in self._lru.items():
            if lru and self.over_cap(tenant):
                return lru.popitem(last=False)[0]
        # 3. lowest priority class first, LRU within it, respecting minimums
        victim = self._pop_lowest(honour_minimums=True)
        if victim is not None:
            return victim
        # 4. the requester's own guaranteed blocks
        own = self._lru.get(requester)
        if own:
            return own.popitem(last=False)[0]
        # 5. (last resort only) other tenants' guaranteed blocks
        return self._pop_lowest(honour_minimums=False) if last_resort else None

    def _pop_lowest(self, honour_minimums: bool) -> BlockId | None:
        """Oldest evictable block of the lowest priority class (among tenants above their minimum)."""
        best: tuple[int, float, TenantId] | None = None
        for tenant, lru in self._lru.items():
            if not lru or (honour_minimums and self.held.get(tenant, 0) <= self.quota(tenant).min_blocks):
                continue
            key = (self.quota(tenant).priority, next(iter(lru.values())), tenant)
            if best is None or key < best:
                best = key
        return None if best is None else self._lru[best[2]].popitem(last=False)[0]

    def tenants(self) -> Iterable[TenantId]:
        return self.held.keys()
