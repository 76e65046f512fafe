"""Predictive replication: copy a hot, repeatedly pulled prefix to the workers likely to need it.

A pull means a request paid transfer time in its TTFT because its prefix lived elsewhere. When
the same prefix (named by the hash of its deepest pulled block) is pulled ``threshold`` times
within ``window_s``, demand for it is spreading beyond its holders: the policy then names the
tenant's other candidate workers that do not hold it, so they fetch it ahead of demand.

Pure bookkeeping: the caller (the pool's router) performs the copies, which import blocks
charged to the tenant, so per-tenant cache caps and eviction rules still bound them.
Invariants: a prefix is replicated at most once per ``cooldown_s``; at most ``max_targets``
workers per replication; memory is bounded by ``max_tracked`` prefixes (oldest dropped).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Iterable

WorkerId = str
PrefixKey = bytes


@dataclass(frozen=True)
class ReplicationConfig:
    threshold: int = 3  # pulls within the window that make a prefix hot
    window_s: float = 60.0
    cooldown_s: float = 60.0
    max_targets: int = 2
    max_tracked: int = 4096
    enabled: bool = True


class ReplicationPolicy:
    def __init__(self, config: ReplicationConfig | None = None):
        self.config = config or ReplicationConfig()
        self._pulls: OrderedDict[PrefixKey, deque[float]] = OrderedDict()
        self._last_replicated: dict[PrefixKey, float] = {}
        self.replications = 0

    def record_pull(self, key: PrefixKey, now: float) -> None:
        times = self._pulls.pop(key, None) or deque()
        times.append(now)
        self._pulls[key] = times  # most recent last
        while len(self._pulls) > self.config.max_tracked:
            old, _ = self._pulls.popitem(last=False)
            self._last_replicated.pop(old, None)

    def targets(self, key: PrefixKey, candidates: Iterable[WorkerId], holders: Iterable[WorkerId],
                now: float) -> list[WorkerId]:
        """Workers to copy the prefix to now (empty unless it is hot and not cooling down)."""
        cfg = self.config
        times = self._pulls.get(key)
        if not cfg.enabled or times is None:
            return []
        while times and now - times[0] > cfg.window_s:
            times.popleft()
        if len(times) < cfg.threshold:
            return []
        last = self._last_replicated.get(key)
        if last is not None and now - last < cfg.cooldown_s:
            return []
        held = set(holders)
        out = [w for w in candidates if w not in held][: cfg.max_targets]
        if out:
            self._last_replicated[key] = now
            self.replications += 1
        return out
