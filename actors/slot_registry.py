"""Template slot registry of the global index (pure, no Ray): who holds which template slot.

Keyed by (template id, slot class, share domain); each key maps to the workers' cached
instances of that template and slot class, which can donate the template tokens' KV (remap).
Lookups take every domain the request may read (own + grants), so isolation follows the same
rule as block hashes: no grant, no match.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

WorkerId = str
Domain = str


@dataclass(frozen=True)
class SlotKey:
    template_id: str
    slot_class: str
    domain: Domain


@dataclass(frozen=True)
class SlotEntry:
    """A cached template instance a worker can donate: ``slot_id`` is the worker's own handle
    for it; ``num_tokens`` how many tokens of KV it covers; ``meta`` is free-form (msgpack-able)."""

    worker_id: WorkerId
    slot_id: str
    num_tokens: int = 0
    meta: Mapping = field(default_factory=dict)
    last_access: float = 0.0


class SlotRegistry:
    """(template id, slot class, domain) -> the workers' cached instances, newest first.

    Invariant: at most one entry per (key, worker, slot id); a removed worker has none; every
    key with entries is listed under its template (``lookup_template``) and no other key is.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self._slots: dict[SlotKey, dict[tuple[WorkerId, str], SlotEntry]] = {}
        self._by_template: dict[str, set[SlotKey]] = {}

    def __len__(self) -> int:
        return sum(len(v) for v in self._slots.values())

    def register(self, key: SlotKey, worker_id: WorkerId, slot_id: str, num_tokens: int = 0,
                 meta: Mapping | None = None) -> SlotEntry:
        entry = SlotEntry(worker_id, slot_id, num_tokens, dict(meta or {}), self.clock())
        group = self._slots.setdefault(key, {})
        self._by_template.setdefault(key.template_id, set()).add(key)
        group.pop((worker_id, slot_id), None)
        group[(worker_id, slot_id)] = entry  # re-insert: dict order = registration order
        return entry

    def lookup(self, template_id: str, slot_class: str, domains: Iterable[Domain]) -> list[SlotEntry]:
        """Entries of the template + slot class under any readable domain, newest first."""
        out: list[SlotEntry] = []
        for d in dict.fromkeys(domains):
            out.extend(self._slots.get(SlotKey(template_id, slot_class, d), {}).values())
        return sorted(out, key=lambda e: e.last_access, reverse=True)

    def lookup_template(self, template_id: str, domains: Iterable[Domain]) -> list[tuple[SlotKey, SlotEntry]]:
        """Entries of every slot class of the template under any readable domain, newest first."""
        readable = set(domains)
        out = [(k, e) for k in self._by_template.get(template_id, ()) if k.domain in readable
               for e in self._slots[k].values()]
        return sorted(out, key=lambda ke: ke[1].last_access, reverse=True)

    def remove(self, key: SlotKey, worker_id: WorkerId, slot_id: str | None = None) -> int:
        """Remove the worker's entry (or all its entries for the key when slot_id is None)."""
        group = self._slots.get(key)
        if not group:
            return 0
        gone = [k for k in group if k[0] == worker_id and (slot_id is None or k[1] == slot_id)]
        for k in gone:
            del group[k]
        if not group:
            del self._slots[key]
            keys = self._by_template[key.template_id]
            keys.discard(key)
            if not keys:
                del self._by_template[key.template_id]
        return len(gone)

    def remove_worker(self, worker_id: WorkerId) -> int:
        return sum(self.remove(key, worker_id) for key in list(self._slots))

    def replace_worker(self, worker_id: WorkerId,
                       entries: Iterable[tuple[SlotKey, str, int, Mapping | None]]) -> None:
        """Make ``entries`` (key, slot id, tokens, meta) the worker's whole holdings (a snapshot)."""
        self.remove_worker(worker_id)
        for key, slot_id, num_tokens, meta in entries:
            self.register(key, worker_id, slot_id, num_tokens, meta)

    def check_invariants(self) -> None:
        assert all(self._slots.values()), "an empty slot group was kept"
        listed = {k for keys in self._by_template.values() for k in keys}
        assert listed == set(self._slots), "template listing drifted"
        assert all(k.template_id == t for t, keys in self._by_template.items() for k in keys)
