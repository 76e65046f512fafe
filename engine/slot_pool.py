"""Slot pool: donor instances for approximate (Oneiros) reuse, grouped per share domain.

A donor is a prompt that was prefilled exactly, kept with its per-layer K/V on the CPU (keys
rotated at positions 0..n-1) and, when it was sent as an instance of a named template, its
segmentation (``policies.remap.Instance``). Invariants:

* a donor's KV is exact: only sequences prefilled by the normal (exact) path are stored, never
  one whose KV was itself built from a donor;
* donors live in the group of the storing request's share domain; a lookup reads its own domain
  and the domains its request may read (grants), nothing else;
* each group is an LRU bounded by ``bytes_per_domain`` (least recently used donor evicted first;
  a donor larger than the bound is not stored); ``nbytes`` is the sum of the groups' bytes;
* all donors of one tenant (``Donor.tenant``), over all its domains, hold at most
  ``bytes_per_tenant`` (default: ``bytes_per_domain``), the tenant's least recently used donor
  evicted first: a tenant cannot multiply its budget with domains of its own (every
  ``cache_salt`` is one), so the pool's memory is bounded by tenants x ``bytes_per_tenant``;
  a group left empty is dropped (no state stays behind per domain).

Cluster sharing (``actors.slot_registry``): with ``record_events`` on, storing a donor that
instantiates a named template queues an "added" ``SlotEvent`` and evicting or replacing one a
"removed" event (``take_events`` drains them, ``slot_entries`` is the full list for a snapshot),
so the global index can tell other workers who holds which template slot. A donor's
``slot_id`` is a stable sha256 of its domain, template id and tokens. A peer pulls a donor as a
``DonorPayload`` (``ApproxReuse.export_donor``/``import_donor``: only a pool's own donors, so
only exact KV, travel) and files it under the *donor's* domain, so the group, read and byte
rules above hold for pulled donors too.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from functools import cached_property
from typing import Hashable, Iterator

import numpy as np
import torch

from engine.manual_forward import SeqKV
from policies.remap import Instance


@dataclass(frozen=True)
class Donor:
    """One cached prompt that may donate its KV. ``slot_key`` is the remap policy's key (template
    and slot classes) when ``instance`` is set, None for a prompt without a template."""

    domain: str
    tenant: str
    token_ids: tuple[int, ...]
    kv: SeqKV
    instance: Instance | None = None
    template_id: str | None = None
    slot_key: Hashable | None = None

    @property
    def nbytes(self) -> int:
        return self.kv.k.nbytes + self.kv.v.nbytes

    @cached_property
    def slot_id(self) -> str:
        """Stable id of (domain, template id, tokens): the same on every worker."""
        # surrogatepass: an id that is not valid Unicode text (rejected at the ingress and by
        # LLMEngine.validate) must still never raise here, inside an engine step
        h = hashlib.sha256(self.domain.encode("utf-8", "surrogatepass") + b"\0"
                           + (self.template_id or "").encode("utf-8", "surrogatepass") + b"\0")
        h.update(np.asarray(self.token_ids, dtype=np.int64).tobytes())
        return h.hexdigest()

    @property
    def slot_class(self) -> str | None:
        """The policy's slot key and the template's text as a stable string, None without a
        template (see ``slot_class_of``)."""
        return None if self.slot_key is None else slot_class_of(self.slot_key, self.instance)


def slot_class_of(slot_key: Hashable, instance: Instance | None) -> str:
    """``repr(slot_key)`` plus a digest of the instance's template pieces (its text inside the
    prompt's wrapper): a donor can only serve an instance of the very same template
    (``choose_donor`` compares templates), so two templates sharing an id (another chat wrapper,
    another tenant's text) must not look like the same slot class to routing."""
    if instance is None:
        return repr(slot_key)
    digest = hashlib.sha256(repr(instance.template.pieces).encode()).hexdigest()[:16]
    return f"{slot_key!r}#{digest}"


@dataclass(frozen=True)
class SlotEvent:
    """A template donor appeared in ("added") or left ("removed") the pool."""

    kind: str  # added | removed
    template_id: str
    slot_class: str
    domain: str
    slot_id: str
    num_tokens: int
    tenant: str = ""


@dataclass(frozen=True)
class DonorPayload:
    """A donor as plain arrays for another worker (through the object store), like ``KVBlocks``.

    ``k``/``v``: float32 ``[num_layers, n, num_kv_heads, head_dim]``, keys rotated at positions
    0..n-1. ``instance``/``slot_key`` are the segmentation and key the storing worker computed
    (pure dataclasses from ``policies.remap``)."""

    k: np.ndarray
    v: np.ndarray
    model_id: str
    token_ids: tuple[int, ...]
    domain: str
    tenant: str
    template_id: str | None = None
    instance: Instance | None = None
    slot_key: Hashable | None = None

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


class SlotPool:
    def __init__(self, bytes_per_domain: int = 64 * 1024 * 1024, max_donors_per_domain: int = 64,
                 record_events: bool = False, bytes_per_tenant: int | None = None):
        self.bytes_per_domain = bytes_per_domain
        self.bytes_per_tenant = bytes_per_domain if bytes_per_tenant is None else bytes_per_tenant
        self.max_donors_per_domain = max_donors_per_domain
        self._groups: dict[str, OrderedDict[tuple, Donor]] = {}
        self._bytes: dict[str, int] = {}
        self._tenant_lru: dict[str, OrderedDict[tuple, None]] = {}  # tenant -> (domain, key), oldest first
        self._tenant_bytes: dict[str, int] = {}
        self._by_id: dict[str, Donor] = {}
        self.evictions = 0
        self.record_events = record_events  # on while a publisher drains them (else they would pile up)
        self._events: list[SlotEvent] = []

    def put(self, donor: Donor) -> bool:
        """Store (or refresh) ``donor`` in its domain's group; False when it cannot fit at all."""
        if donor.nbytes > min(self.bytes_per_domain, self.bytes_per_tenant):
            return False
        group = self._groups.setdefault(donor.domain, OrderedDict())
        key = (donor.token_ids, donor.template_id)
        old = group.get(key)
        if old is not None:
            self._unlink(old)
            self._forget(old, replaced_by=donor)
            group = self._groups.setdefault(donor.domain, OrderedDict())
        group[key] = donor
        self._bytes[donor.domain] = self._bytes.get(donor.domain, 0) + donor.nbytes
        self._tenant_lru.setdefault(donor.tenant, OrderedDict())[(donor.domain, key)] = None
        self._tenant_bytes[donor.tenant] = self._tenant_bytes.get(donor.tenant, 0) + donor.nbytes
        self._by_id[donor.slot_id] = donor
        self._event("added", donor)
        while self._bytes[donor.domain] > self.bytes_per_domain or len(group) > self.max_donors_per_domain:
            self._evict(next(iter(group.values())))
        lru = self._tenant_lru[donor.tenant]
        while self._tenant_bytes[donor.tenant] > self.bytes_per_tenant:
            domain, k = next(iter(lru))
            self._evict(self._groups[domain][k])
        return True

    def _unlink(self, donor: Donor) -> None:
        """Take ``donor`` out of its group and its tenant's books (dropping what is left empty)."""
        key = (donor.token_ids, donor.template_id)
        group = self._groups[donor.domain]
        del group[key]
        self._bytes[donor.domain] -= donor.nbytes
        if not group:
            del self._groups[donor.domain], self._bytes[donor.domain]
        lru = self._tenant_lru[donor.tenant]
        del lru[(donor.domain, key)]
        self._tenant_bytes[donor.tenant] -= donor.nbytes
        if not lru:
            del self._tenant_lru[donor.tenant], self._tenant_bytes[donor.tenant]

    def _evict(self, donor: Donor) -> None:
        self._unlink(donor)
        self._forget(donor)
        self.evictions += 1

    def get(self, slot_id: str) -> Donor | None:
        return self._by_id.get(slot_id)

    def take_events(self) -> list[SlotEvent]:
        """Drain the queued slot events (oldest first)."""
        events, self._events = self._events, []
        return events

    @property
    def has_events(self) -> bool:
        """Whether slot events wait for ``take_events`` (safe from another thread, like
        ``BlockPool.has_events``)."""
        return bool(self._events)

    def slot_entries(self) -> list[SlotEvent]:
        """Every template donor held now, as "added" events (a snapshot for the index)."""
        return [e for d in self for e in [_slot_event("added", d)] if e is not None]

    def _forget(self, donor: Donor, replaced_by: Donor | None = None) -> None:
        if replaced_by is None or replaced_by.slot_id != donor.slot_id:
            self._by_id.pop(donor.slot_id, None)
        if replaced_by is None or replaced_by.slot_class != donor.slot_class:
            self._event("removed", donor)

    def _event(self, kind: str, donor: Donor) -> None:
        if self.record_events:
            e = _slot_event(kind, donor)
            if e is not None:
                self._events.append(e)

    def candidates(self, domains: tuple[str, ...]) -> list[Donor]:
        """Donors readable from ``domains`` (first domain first, most recent first in each)."""
        out: list[Donor] = []
        for d in dict.fromkeys(domains):
            out.extend(reversed(self._groups.get(d, {}).values()))
        return out

    def touch(self, donor: Donor) -> None:
        """Mark ``donor`` most recently used in its group."""
        group = self._groups.get(donor.domain)
        key = (donor.token_ids, donor.template_id)
        if group is not None and group.get(key) is donor:
            group.move_to_end(key)
            self._tenant_lru[donor.tenant].move_to_end((donor.domain, key))

    def __len__(self) -> int:
        return sum(len(g) for g in self._groups.values())

    def __iter__(self) -> Iterator[Donor]:
        for g in self._groups.values():
            yield from g.values()

    @property
    def nbytes(self) -> int:
        return sum(self._bytes.values())

    def domain_bytes(self, domain: str) -> int:
        return self._bytes.get(domain, 0)

    def tenant_bytes(self, tenant: str) -> int:
        return self._tenant_bytes.get(tenant, 0)

    def check_invariants(self) -> None:
        for d, g in self._groups.items():
            assert all(x.domain == d for x in g.values()), "a donor is filed under another domain"
            assert self._bytes.get(d, 0) == sum(x.nbytes for x in g.values()), "byte accounting drifted"
            assert self._bytes.get(d, 0) <= self.bytes_per_domain and len(g) <= self.max_donors_per_domain
            assert g, "an empty group was kept"
        assert set(self._bytes) == set(self._groups), "bytes kept for a domain without donors"
        by_tenant: dict[str, int] = {}
        for x in self:
            by_tenant[x.tenant] = by_tenant.get(x.tenant, 0) + x.nbytes
            assert (x.domain, (x.token_ids, x.template_id)) in self._tenant_lru.get(x.tenant, {}), "tenant LRU drifted"
        assert by_tenant == self._tenant_bytes, "tenant byte accounting drifted"
        assert sum(len(o) for o in self._tenant_lru.values()) == len(self), "tenant LRU drifted"
        assert all(b <= self.bytes_per_tenant for b in by_tenant.values()), "a tenant is over its bound"
        assert set(self._by_id) == {x.slot_id for x in self}, "slot id map drifted"


def _slot_event(kind: str, donor: Donor) -> SlotEvent | None:
    """The registry event of a template donor; None for a donor without a template."""
    if donor.template_id is None or donor.slot_key is None:
        return None
    return SlotEvent(kind, donor.template_id, donor.slot_class, donor.domain, donor.slot_id,
                     len(donor.token_ids), donor.tenant)


def seq_kv(k: torch.Tensor, v: torch.Tensor) -> SeqKV:
    """Donor KV ``[layers, n, kv_heads, head_dim]`` at positions 0..n-1."""
    return SeqKV(k, v, torch.arange(k.shape[1]))
