"""Idle backoff for background loops: a loop with nothing to do waits longer each time, up to a cap,
and goes back to its base interval as soon as something changes. Pure, no Ray.

Used by the index publisher's heartbeat (``actors.index_publisher``): an idle worker sends its
heartbeat after 1, 2, 4, 8, 8, ... s instead of every second, and any block or slot event brings
it back to 1 s. What the heartbeat used to detect at once (a restarted index) a worker learns
from its death watch on the index instead (``IndexPublisher.watch``), so the backoff costs no
recovery time.

Invariants: ``base_s <= next_interval(...) <= max_s``; an interval after a change is
``base_s``; without changes the interval never shrinks.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Backoff:
    """``base_s``: the interval while something changes; ``max_s``: the cap while idle;
    ``factor``: growth per idle round (>= 1)."""

    base_s: float
    max_s: float
    factor: float = 2.0

    def __post_init__(self):
        if not 0 <= self.base_s <= self.max_s:
            raise ValueError("need 0 <= base_s <= max_s")
        if self.factor < 1:
            raise ValueError("factor must be >= 1")

    def next_interval(self, current_s: float | None, changed: bool) -> float:
        """The interval to wait after one of ``current_s`` (None: the first) given whether the
        round that just ended had something to do (``changed``)."""
        if changed or current_s is None:
            return self.base_s
        return min(self.max_s, max(self.base_s, current_s * self.factor))
