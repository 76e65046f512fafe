"""Which tenant's waiting request a worker admits next, within one priority class (pure, no Ray).

A worker's engine admits waiting requests while its step budget, sequence limit and free blocks
allow. In arrival order, a tenant that sends 200 requests at once puts every later request of
every other tenant of its class behind all 200: a live probe (2 workers, a tenant without
``limits`` flooding, another sending one short stream every 0.5 s) measured the victim's TTFT at
5.9 s instead of 0.15 s, ~3.5-4 s of it in the engines' waiting queues. ``limits.max_concurrent``
bounds a tenant's flood, but a tenant without limits (the shipped ``demo``) or several tenants
within theirs still share one queue.

Virtual token counters (VTC; Sheng et al., "Fairness in Serving Large Language Models", OSDI
2024): each tenant has a counter of the tokens the engine computed for it (prefill chunks and
decoded tokens alike, ``charge``); the next admission goes to the waiting tenant with the
smallest counter, its oldest request first (``order``). A tenant that had no work in the engine
and now has (``join``) starts at the smallest counter of the tenants that have work, not at its
own old value: idle time banks no credit, so a returning tenant gets its share from now on, not a
burst that starves the others. A tenant that has received more than the others (it was alone and
busy, or its requests are long) waits until they catch up, one admission at a time.

Invariants:
  * counters only grow, except that a ``join`` into an engine with no other work clears them all
    (nothing to be fair against) and a join drops the counters of inactive tenants at or below the
    floor it lifts to (a later join would lift them at least as high), so the map holds at most
    the tenants with work plus those that left ahead of the others;
  * ``order`` is a permutation of its input, each tenant's requests in their given (arrival) order;
    with one tenant it is the input unchanged;
  * ties between counters go to the tenant whose next request arrived first.

What this does not do: preempt. A tenant whose requests fill the engine's sequence limit keeps
those sequences until they finish; fairness applies from the next free slot. Counters are per
worker: a worker is fair among the requests routed to it.
"""

from __future__ import annotations

import heapq
from typing import Callable, Hashable, Iterable, Sequence, TypeVar

T = TypeVar("T")
TenantKey = Hashable


class FairShare:
    """Per-tenant virtual token counters (see the module docstring)."""

    def __init__(self) -> None:
        self.counters: dict[TenantKey, float] = {}

    def join(self, tenant: TenantKey, active: Iterable[TenantKey]) -> None:
        """``tenant`` had no waiting or running request and now has one; ``active`` are the
        tenants that have (``tenant`` itself excluded or not)."""
        others = [a for a in active if a != tenant]
        if not others:
            self.counters.clear()
            self.counters[tenant] = 0.0
            return
        floor = min(self.counters.get(a, 0.0) for a in others)
        keep = set(others)
        for t in [t for t, c in self.counters.items() if t not in keep and c <= floor]:
            del self.counters[t]
        self.counters[tenant] = max(self.counters.get(tenant, 0.0), floor)

    def charge(self, tenant: TenantKey, tokens: float) -> None:
        """The engine computed ``tokens`` tokens (a prefill chunk, a decode) for ``tenant``."""
        self.counters[tenant] = self.counters.get(tenant, 0.0) + tokens

    def order(self, items: Sequence[T], tenant: Callable[[T], TenantKey], cost: Callable[[T], float]) -> list[T]:
        """``items`` (in arrival order) in the order to admit them: repeatedly the oldest item of
        the tenant with the smallest counter, that counter then raised by the item's expected
        ``cost`` (a simulation; ``charge`` records what is really computed)."""
        queues: dict[TenantKey, list[int]] = {}
        for i, it in enumerate(items):
            queues.setdefault(tenant(it), []).append(i)
        if len(queues) <= 1:
            return list(items)
        heap = [(self.counters.get(t, 0.0), idx[0], t) for t, idx in queues.items()]
        heapq.heapify(heap)
        heads = dict.fromkeys(queues, 0)
        out: list[T] = []
        while heap:
            c, i, t = heapq.heappop(heap)
            out.append(items[i])
            heads[t] += 1
            if heads[t] < len(queues[t]):
                heapq.heappush(heap, (c + max(1.0, cost(items[i])), queues[t][heads[t]], t))
        return out
