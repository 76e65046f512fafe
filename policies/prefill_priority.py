"""Which priority class contends for prefill compute in a scheduler step (pure rule, no Ray).

On a CPU (or any device where a step's cost grows with its tokens) a step carrying a long
low-priority prefill chunk delays every request in it and every request arriving during it.
The scheduler therefore caps lower-priority prefill chunks while a higher-priority tenant
contends. A priority class *contends* while it has waiting or prefilling work, and for
``hold_s`` seconds after (so that a higher-priority tenant sending requests one after another
does not find each new request waiting out a long low-priority step begun in the gap).

Invariants:
  * ``top()`` is the highest priority seen within ``hold_s`` of now, or None when fewer than two
    priority classes are live (one class alone is never throttled: no throughput loss without
    contention);
  * a class is live only if observed within ``hold_s`` (stale entries are dropped).
"""

from __future__ import annotations

from typing import Iterable


class PriorityContention:
    def __init__(self, hold_s: float = 0.0):
        if hold_s < 0:
            raise ValueError("hold_s must be >= 0")
        self.hold_s = hold_s
        self._seen: dict[int, float] = {}  # priority -> last time it had waiting/prefilling work

    def observe(self, now: float, priorities: Iterable[int]) -> int | None:
        """Record the priorities with waiting or prefilling work at ``now``; return ``top()``."""
        for p in priorities:
            self._seen[p] = now
        for p in [p for p, t in self._seen.items() if now - t > self.hold_s]:
            del self._seen[p]
        return self.top()

    def top(self) -> int | None:
        """The priority above which nobody is throttled; None when nobody is (one class live)."""
        return max(self._seen) if len(self._seen) > 1 else None


def throttled(priority: int, top: int | None) -> bool:
    """A sequence's prefill is capped iff a higher priority class contends."""
    return top is not None and priority < top
