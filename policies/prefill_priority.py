"""Which priority class contends for prefill compute in a scheduler step (pure rule, no Ray).

On a CPU (or any device where a step's cost grows with its tokens) a step carrying a long
low-priority prefill chunk delays every request in it and every request arriving during it.
The scheduler therefore caps lower-priority prefill chunks while a higher-priority tenant
contends. A priority class *contends* while it has waiting or prefilling work, and for
``hold_s`` seconds after (so that a higher-priority tenant sending requests one after another
does not find each new request waiting out a long low-priority step begun in the gap).

A hold alone leaves a gap: a higher-priority tenant idle for longer than ``hold_s`` meets, on
its return, an uncapped lower-priority step already running (on a CPU, ~1-3 s for a few hundred
tokens; ``bench/flood.py`` measured it as the victim's p99). A *guarded* class (a tenant with
``latency_guard``) therefore contends at all times: the classes below it are capped whenever
they have prefill work, whether or not the guarded tenant is active, at a throughput cost to
them that ``bench/flood.py`` reports.

Invariants:
  * ``top()`` is the highest live priority, or None when fewer than two priority classes are
    live (one class alone is never throttled: no throughput loss without contention);
  * a class is live if observed within ``hold_s`` (stale entries are dropped) or if it is guarded
    (the ``guarded`` of the last ``observe``), so a class below a guarded one with prefill work
    is always throttled, and a guarded class alone is not.
"""

from __future__ import annotations

from typing import Iterable


GUEST_BELOW = 1 << 20  # a guest's class is this far below its tenant's: under any configured priority


def request_class(priority: int, guest: bool = False) -> int:
    """A request's priority class: its tenant's ``priority``; a *guest* (a request on a worker
    lent by the tenant it is assigned to, ``Request.guest``) goes below every configured class, so
    the worker's own tenants contend against it as a higher class does (its prefill chunks capped
    while they have work), while guests keep their tenants' order among themselves. A guest is
    never guarded: it does not interrupt or displace the owner's steps."""
    return priority - GUEST_BELOW if guest else priority


class PriorityContention:
    def __init__(self, hold_s: float = 0.0):
        if hold_s < 0:
            raise ValueError("hold_s must be >= 0")
        self.hold_s = hold_s
        self._seen: dict[int, float] = {}  # priority -> last time it had waiting/prefilling work
        self._guarded: frozenset[int] = frozenset()

    def observe(self, now: float, priorities: Iterable[int], guarded: Iterable[int] = ()) -> int | None:
        """Record the priorities with waiting or prefilling work at ``now`` and the guarded ones
        (configured tenants with ``latency_guard``); return ``top()``."""
        self._guarded = frozenset(guarded)
        for p in priorities:
            self._seen[p] = now
        for p in [p for p, t in self._seen.items() if now - t > self.hold_s]:
            del self._seen[p]
        return self.top()

    def top(self) -> int | None:
        """The priority above which nobody is throttled; None when nobody is (one class live)."""
        live = self._seen.keys() | self._guarded
        return max(live) if len(live) > 1 else None


def throttled(priority: int, top: int | None) -> bool:
    """A sequence's prefill is capped iff a higher priority class contends."""
    return top is not None and priority < top


def may_interrupt(step_top: int, guarded: frozenset[int], interrupted_last: bool) -> bool:
    """May an engine step whose highest sequence priority is ``step_top`` be abandoned for a
    guarded arrival (``engine.step_interrupt``)? Only if some guarded class is above every
    sequence of the step, and the step before was not itself interrupted (no starvation)."""
    return not interrupted_last and any(g > step_top for g in guarded)
