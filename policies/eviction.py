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
"LRU" in rules 3-5 passes over reused prefixes for unshared tails (``protect_s`` > 0): a block
hit since it was cached (*reused*: a shared prefix) and released less than ``protect_s`` ago is
not the victim while the tenant has an evictable *tail* block, which goes instead (the oldest
one): a block never hit, cached as the continuation of a reused block or of another tail (a
request's question and answer after a shared prefix, which nobody asks for again). Plain LRU let
each finished request's tail push out the deepest blocks of the oldest shared prefix whenever the
prefixes fill the pool (measured in ``bench/eviction_scan.py``). A new chain (a prefix nobody
reused yet) is no tail and keeps plain LRU order against reused blocks, so new groups are not
locked out by reused ones; a reused block released ``protect_s`` ago or more is plain LRU again.
A new chain's blocks (*seeded*: never hit, of a chain whose first block nobody had cached: a new
group's first prompt, or a one-off prompt) released less than ``seed_s`` ago are passed over for
tails the same way, while the tenant's seeded blocks have been reused more often than its tails
(``reuse_rates``: per block, of those hit or dropped since, recent ones weighing most). A group's
first prompt is its prefix's only copy until a second prompt asks for it; plain LRU evicted it as
the oldest block before the newer tails of the worker's other groups, and the group's next prompt,
100 s later, recomputed 552 tokens behind a queue (the cluster bench, sessions 28-29). Where
tails are reused more (a chat's history before its next turn) or seeded blocks are not (one-off
prompts), seeded blocks keep plain LRU order.
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
    released (refcount 0); ``held[t]`` counts tenant t's cached blocks, in use or not;
    ``_tails[t]`` is the subset of ``_lru[t]`` that are tail blocks, in the same order.
    """

    def __init__(self, quotas: dict[TenantId, TenantQuota] | None = None, default: TenantQuota | None = None,
                 protect_s: float = 60.0, seed_s: float = 120.0):
        if protect_s < 0 or seed_s < 0:
            raise ValueError("protect_s and seed_s must be >= 0")
        self._quotas = dict(quotas or {})
        self._default = default or TenantQuota()
        self.protect_s = protect_s  # 0: reused blocks keep plain LRU order (see the module docstring)
        self.seed_s = seed_s  # 0: seeded blocks keep plain LRU order
        self._lru: dict[TenantId, OrderedDict[BlockId, float]] = {}
        self._tails: dict[TenantId, OrderedDict[BlockId, None]] = {}  # evictable tail blocks
        self._hit: set[BlockId] = set()  # cached blocks hit since they were cached
        self._tail: set[BlockId] = set()  # cached blocks never hit that continue a reused block or a tail
        self._seeded: set[BlockId] = set()  # cached blocks never hit of a chain nobody hit (the rest)
        # per tenant, of its tail and seeded blocks: [reused, dropped unused], decayed (``_resolve``)
        self._outcomes: dict[TenantId, dict[str, list[float]]] = {}
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
    def on_cached(self, block: BlockId, tenant: TenantId, parent: BlockId | None = None) -> None:
        """A block got a hash (it is in use by its computing request); ``parent``: the cached
        block it continues, if any."""
        self._owner[block] = tenant
        if parent is not None and (parent in self._hit or parent in self._tail):
            self._tail.add(block)
        else:
            self._seeded.add(block)
        self.held[tenant] = self.held.get(tenant, 0) + 1

    def on_released(self, block: BlockId, now: float) -> None:
        """A cached block's refcount dropped to 0: it becomes evictable, most recent last."""
        tenant = self._owner[block]
        self._lru.setdefault(tenant, OrderedDict())[block] = now
        if block in self._tail:
            self._tails.setdefault(tenant, OrderedDict())[block] = None

    def on_hit(self, block: BlockId) -> None:
        """A request reuses a cached block (a prefix-cache hit); it is in use (an evictable one was
        ``on_acquired`` first), so it is in no evictable list."""
        self._resolve(block, reused=True)
        self._hit.add(block)

    def on_acquired(self, block: BlockId) -> None:
        """A cached, evictable block is in use again (a hit, or the pool taking it back)."""
        self._unlist(self._owner[block], block)

    def on_dropped(self, block: BlockId) -> None:
        """A cached block lost its hash (evicted or reset); it must not be in use."""
        self._resolve(block, reused=False)
        tenant = self._owner.pop(block)
        self._unlist(tenant, block)
        self._hit.discard(block)
        self.held[tenant] -= 1

    _DECAY_AT = 1024.0  # outcomes counted per tenant and kind before both counts are halved

    def _resolve(self, block: BlockId, reused: bool) -> None:
        """A tail or seeded block is hit for the first time, or dropped never hit: count it."""
        for kind, blocks in (("tail", self._tail), ("seed", self._seeded)):
            if block in blocks:
                blocks.discard(block)
                counts = self._outcomes.setdefault(self._owner[block], {}).setdefault(kind, [0.0, 0.0])
                counts[0 if reused else 1] += 1
                if counts[0] + counts[1] > self._DECAY_AT:
                    counts[0] /= 2
                    counts[1] /= 2
                return

    def reuse_rates(self, tenant: TenantId) -> dict[str, float]:
        """Share of ``tenant``'s tail and of its seeded blocks that were hit before being dropped
        (add-one smoothed: 0.5 before any outcome)."""
        return {kind: self._reuse_rate(tenant, kind) for kind in ("tail", "seed")}

    def _reuse_rate(self, tenant: TenantId, kind: str) -> float:
        reused, dropped = self._outcomes.get(tenant, {}).get(kind, (0.0, 0.0))
        return (reused + 1) / (reused + dropped + 2)

    def _unlist(self, tenant: TenantId, block: BlockId) -> None:
        for lists in (self._lru, self._tails):
            lst = lists.get(tenant)
            if lst is not None:
                lst.pop(block, None)

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

    def tail_ids(self) -> set[BlockId]:
        """Every evictable tail block (for invariant checks: a subset of ``evictable_ids``)."""
        return {b for lst in self._tails.values() for b in lst}

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
                self._unlist(tenant, block)
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
            out.append(self._take(tenant, None))
            excess -= 1
        return out

    def pop_victim(self, requester: TenantId, now: float, last_resort: bool = False) -> BlockId | None:
        """Choose and remove one evictable block for ``requester``'s demand, or None."""
        # 1. expired blocks
        for tenant, lru in self._lru.items():
            ttl = self.quota(tenant).ttl_s
            if ttl is not None and lru and now - next(iter(lru.values())) >= ttl:
                return self._take(tenant, None)
        # 2. tenants over their cap
        for tenant, lru in self._lru.items():
            if lru and self.over_cap(tenant):
                return self._take(tenant, now)
        # 3. lowest priority class first, LRU within it, respecting minimums
        victim = self._pop_lowest(now, honour_minimums=True)
        if victim is not None:
            return victim
        # 4. the requester's own guaranteed blocks
        if self._lru.get(requester):
            return self._take(requester, now)
        # 5. (last resort only) other tenants' guaranteed blocks
        return self._pop_lowest(now, honour_minimums=False) if last_resort else None

    def _take(self, tenant: TenantId, now: float | None) -> BlockId:
        """Remove and return ``tenant``'s victim: its least recently released block, unless that
        one is protected while a tail block is evictable (the oldest tail then): reused and
        released under ``protect_s`` before ``now``, or seeded and released under ``seed_s``
        before it while the tenant's seeded blocks are reused more than its tails. ``now`` None:
        plain LRU (expiry is by age alone)."""
        lru = self._lru[tenant]
        block, released = next(iter(lru.items()))
        if now is not None and self._protected(tenant, block, now - released):
            tails = self._tails.get(tenant)
            if tails:
                block = next(iter(tails))
        self._unlist(tenant, block)
        return block

    def _protected(self, tenant: TenantId, block: BlockId, age_s: float) -> bool:
        if block in self._hit:
            return age_s < self.protect_s
        if block in self._seeded and age_s < self.seed_s:
            return self._reuse_rate(tenant, "seed") > self._reuse_rate(tenant, "tail")
        return False

    def _pop_lowest(self, now: float, honour_minimums: bool) -> BlockId | None:
        """Oldest evictable block of the lowest priority class (among tenants above their minimum)."""
        best: tuple[int, float, TenantId] | None = None
        for tenant, lru in self._lru.items():
            if not lru or (honour_minimums and self.held.get(tenant, 0) <= self.quota(tenant).min_blocks):
                continue
            key = (self.quota(tenant).priority, next(iter(lru.values())), tenant)
            if best is None or key < best:
                best = key
        return None if best is None else self._take(best[2], now)

    def tenants(self) -> Iterable[TenantId]:
        return self.held.keys()
