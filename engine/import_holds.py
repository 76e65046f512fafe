"""Pulled KV held for the request it was pulled for, until that request is admitted.

A pull lands its blocks in the prefix cache before its request is added to the engine; on a busy
worker the request then waits in the queue, seconds to tens of seconds, while the requests ahead
of it allocate. Cached blocks with no reference are evictable, so without a hold the pulled
prefix (and the local prefix it extends) can be evicted before the request it was pulled for is
admitted, which then computes it again (the cluster bench, session 20: a pull the router planned
right ran as a recompute on a worker with a 13 s queue).

A hold is one reference per block, taken when the pull is planned (the local prefix it extends)
and as each chunk lands (the pulled blocks), and dropped when:
  * the request is scheduled (its admission took its own references on its prefix hits),
  * the request ends or is refused before admission, or was never added (``release``),
  * ``hold_s`` passed since the hold was taken (a request that never arrived),
  * the engine could schedule nothing while requests wait (``release_all``): holds are a
    preference, never a reason for the queue to stall.

Invariant: every block in a hold has one reference owned by that hold (``BlockPool.touch`` or
``allocate``) and ``BlockPool.free`` is called exactly once per block when the hold is dropped.

Requests whose pull is still arriving (``expect`` .. ``landed``) are ``awaiting``: the request
is queued in the engine while its KV is transferred (its place in the queue kept, the transfer
overlapping the wait for the requests ahead), and the scheduler passes it over until the pull
ends (landed, partly, or failed). An awaiting entry goes with the request's hold (``release``)
and after ``hold_s`` at most, so a pull that never reports back cannot park its request.
"""

from __future__ import annotations

import time
from typing import Callable

from engine.block_pool import Block, BlockPool


class ImportHolds:
    def __init__(self, pool: BlockPool, hold_s: float = 60.0, clock: Callable[[], float] = time.monotonic):
        self.pool = pool
        self.hold_s = hold_s
        self.clock = clock
        self._holds: dict[str, tuple[list[Block], float]] = {}  # request id -> (blocks, taken at)
        self.awaiting: dict[str, float] = {}  # request id -> since when its pull is arriving
        self.stats = {"taken": 0, "used": 0, "released": 0, "expired": 0, "starved": 0}

    def __len__(self) -> int:
        return len(self._holds)

    def __bool__(self) -> bool:  # anything to settle: holds or requests awaiting their pull
        return bool(self._holds or self.awaiting)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._holds

    def num_blocks(self) -> int:
        return sum(len(b) for b, _ in self._holds.values())

    def expect(self, request_id: str) -> None:
        """``request_id``'s pull is under way: it waits for ``landed`` before admission."""
        self.awaiting.setdefault(request_id, self.clock())

    def landed(self, request_id: str) -> bool:
        """``request_id``'s pull ended: it may be admitted. False if it was not awaiting."""
        return self.awaiting.pop(request_id, None) is not None

    def add(self, request_id: str, blocks: list[Block], referenced: bool = False) -> None:
        """Hold ``blocks`` for ``request_id``. ``referenced``: the caller's reference (from
        ``allocate``) passes to the hold; otherwise the hold takes one (``touch``, cached blocks)."""
        if not blocks:
            return
        if not referenced:
            self.pool.touch(blocks)
        held = self._holds.get(request_id)
        if held is None:
            self.stats["taken"] += 1
            self._holds[request_id] = (list(blocks), self.clock())
        else:
            held[0].extend(blocks)

    def release(self, request_id: str, used: bool = False) -> bool:
        """Drop ``request_id``'s hold (``used``: its request was admitted) and its awaiting
        entry. False if it held nothing."""
        self.awaiting.pop(request_id, None)
        return self._drop(request_id, "used" if used else "released")

    def expire(self) -> int:
        """Drop holds (and awaiting entries) older than ``hold_s``; how many holds."""
        if not self._holds and not self.awaiting:
            return 0
        cut = self.clock() - self.hold_s
        for r in [r for r, t in self.awaiting.items() if t <= cut]:
            del self.awaiting[r]
        return sum(self._drop(r, "expired") for r, (_, t) in list(self._holds.items()) if t <= cut)

    def release_all(self) -> int:
        """Drop every hold (the queue could not move with them); how many."""
        return sum(self._drop(r, "starved") for r in list(self._holds))

    def _drop(self, request_id: str, why: str) -> bool:
        held = self._holds.pop(request_id, None)
        if held is None:
            return False
        self.pool.free(held[0])
        self.stats[why] += 1
        return True
