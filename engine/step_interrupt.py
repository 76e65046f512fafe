"""Interrupting a lower-class engine step when a guarded tenant's request arrives.

On a CPU a step is not preemptible and costs ~110 ms even for one decode row (every step reads
all the weights), so a guarded (``latency_guard``) tenant's request arriving during a flood of
lower-priority steps waits out the step in progress: ``bench/flood.py`` measured that wait as the
largest part of the victim's extra TTFT under a flood. The engine therefore checks, between
transformer layers, whether a request of a guarded class above every sequence of the step is
waiting to be added; if so it abandons the step (``StepInterrupted``) and takes the request next.

Why abandoning is safe: a step changes engine state only after its forward (``num_computed``,
prefix-cache commits, sampling); the forward itself only writes K/V into the slots of positions
``>= num_computed`` of blocks the sequence owns and has not committed, so the rerun writes the
same values there again (the same tokens at the same positions). The blocks the scheduler grew
for the abandoned plan stay with their sequences and are used by the rerun.

Invariants (the rule is ``policies.prefill_priority.may_interrupt``):
  * a step carrying any sequence of a guarded class, or of a class at or above the arrival's,
    is never interrupted;
  * two steps in a row are never interrupted, so the lower classes' work completes at least every
    other step even under a steady stream of guarded arrivals (no starvation);
  * ``ArrivalSignal`` only tells the engine thread that such a request is on its way; the request
    itself travels through the normal command queue (a missed signal costs latency, never state).
"""

from __future__ import annotations

import threading
from collections import Counter


class StepInterrupted(Exception):
    """Raised between layers of a forward that was asked to stop; carries no request's fault."""


class ArrivalSignal:
    """Priorities of guarded requests posted to the engine thread and not yet added (thread-safe).

    ``note(p)`` on the caller's thread before the request's add command is queued, ``done(p)`` on
    the engine thread when the add ran (or failed); ``top`` is the highest such priority or None.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: Counter[int] = Counter()
        self.top: int | None = None  # read without the lock by the engine thread (one attribute load)

    def note(self, priority: int) -> None:
        with self._lock:
            self._pending[priority] += 1
            self.top = max(self._pending)

    def done(self, priority: int) -> None:
        with self._lock:
            if self._pending[priority] <= 1:
                self._pending.pop(priority, None)
            else:
                self._pending[priority] -= 1
            self.top = max(self._pending) if self._pending else None

    def above(self, priority: int) -> bool:
        """A guarded request of a priority above ``priority`` is on its way."""
        top = self.top
        return top is not None and top > priority
