"""Keep a process's big, long-lived heap out of CPython's full garbage collections (no Ray).

CPython's cyclic collector stops the process while it scans every tracked container of the
generation it collects, and every entry of each. A full collection (the oldest generation) runs
whenever the objects that survived into it since the last one reach a quarter of what it held
then. Two processes of a kvmesh cluster hold heaps that grow with the cluster:
  * the index actor's trie, one tracked node per cached block of every worker
    (``actors.prefix_index._Node``: ~1M at 64 GPU-sized workers, ~4M at 256);
  * the controller's placement state, one shadow cache per worker whose entries are the
    worker's pool (``policies.placement.ShadowCache``).
Each full collection then stops the index (no lookup is answered: the controller's lookups time
out and route without cache information) or the controller (no request is routed) for 0.3 s at
64 GPU-sized workers and seconds at 256 (``bench/heap_stalls.py``), every few ten thousand
requests.

Neither heap has reference cycles (a trie node refers to its children and to its parent's hash;
the shadows hold hashes and numbers), so reference counting frees each object as it leaves; the
cyclic collector has nothing to find there. ``HeapFreezer`` moves the process's heap into
CPython's permanent generation (``gc.freeze``, which only relinks lists) every ``every`` new
objects the caller counts, after a young collection (``gc.collect(1)``, well under a millisecond)
so that young cycles that died go first. Collections then scan only what came since the last
freeze.

What it costs: cyclic garbage among frozen objects is never found (an object in a cycle that
was alive at a freeze and dies later). The frozen heap beyond the caller's own objects is
watched, at most once every ``check_s`` seconds (counting it walks the frozen heap: ~45 ms at 4M
objects): when it has grown past ``leak_factor`` x what it was after the last full collection plus
``leak_slack``, one full collection runs over everything (``gc.unfreeze``, ``gc.collect``) and it is
frozen again. That pause is the old one, but it comes only as often as such garbage piles up
(never in ``bench/heap_stalls.py``'s runs).
"""

from __future__ import annotations

import gc
import math
import time


class HeapFreezer:
    """Freeze the process's heap every ``every`` new long-lived objects (see the module doc).

    ``grew(new, own)`` after each unit of work: ``new`` objects it made that will live on (the
    index's new nodes; the controller counts one per routed request), ``own`` how many the
    caller holds now (frozen legitimately, left out of the leak check). Returns True when it
    froze. ``freezes``, ``full_collections`` and ``seconds`` (spent in both) are for stats."""

    def __init__(self, every: int = 20_000, leak_factor: float = 2.0, leak_slack: int = 200_000,
                 check_s: float = 60.0, enabled: bool = True, clock=time.monotonic):
        if every < 1 or leak_factor < 1 or leak_slack < 0 or check_s < 0:
            raise ValueError("every >= 1, leak_factor >= 1, leak_slack >= 0 and check_s >= 0 are required")
        self.every, self.leak_factor, self.leak_slack, self.check_s = every, leak_factor, leak_slack, check_s
        self.enabled, self.clock = enabled, clock
        self._new = 0
        self._base: int | None = None  # frozen objects beyond the caller's own after the last full collection
        self._checked = -math.inf
        self.freezes = 0
        self.full_collections = 0
        self.seconds = 0.0

    def grew(self, new: int = 1, own: int = 0) -> bool:
        if not self.enabled:
            return False
        self._new += new
        if self._new < self.every:
            return False
        self._new = 0
        t = time.perf_counter()
        gc.collect(1)
        gc.freeze()
        self.freezes += 1
        now = self.clock()
        if now - self._checked >= self.check_s:
            self._checked = now
            other = gc.get_freeze_count() - own
            if self._base is None:
                self._base = other
            elif other > self.leak_factor * self._base + self.leak_slack:
                gc.unfreeze()
                gc.collect()
                gc.freeze()
                self.full_collections += 1
                self._base = gc.get_freeze_count() - own
        self.seconds += time.perf_counter() - t
        return True

    def stats(self) -> dict:
        return {"enabled": self.enabled, "every": self.every, "freezes": self.freezes,
                "full_collections": self.full_collections, "frozen": gc.get_freeze_count(),
                "seconds": round(self.seconds, 4)}
