"""Slot pool: donor instances for approximate (Oneiros) reuse, grouped per share domain.

A donor is a prompt that was prefilled exactly, kept with its per-layer K/V on the CPU (keys
rotated at positions 0..n-1) and, when it was sent as an instance of a named template, its
segmentation (``policies.remap.Instance``). Invariants:

* a donor's KV is exact: only sequences prefilled by the normal (exact) path are stored, never
  one whose KV was itself built from a donor;
* donors live in the group of the storing request's share domain; a lookup reads its own domain
  and the domains its request may read (grants), nothing else;
* each group is an LRU bounded by ``bytes_per_domain`` (least recently used donor evicted first;
  a donor larger than the bound is not stored); ``nbytes`` is the sum of the groups' bytes.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Hashable, Iterator

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


class SlotPool:
    def __init__(self, bytes_per_domain: int = 64 * 1024 * 1024, max_donors_per_domain: int = 64):
        self.bytes_per_domain = bytes_per_domain
        self.max_donors_per_domain = max_donors_per_domain
        self._groups: dict[str, OrderedDict[tuple, Donor]] = {}
        self._bytes: dict[str, int] = {}
        self.evictions = 0

    def put(self, donor: Donor) -> bool:
        """Store (or refresh) ``donor`` in its domain's group; False when it cannot fit at all."""
        if donor.nbytes > self.bytes_per_domain:
            return False
        group = self._groups.setdefault(donor.domain, OrderedDict())
        key = (donor.token_ids, donor.template_id)
        old = group.pop(key, None)
        if old is not None:
            self._bytes[donor.domain] -= old.nbytes
        group[key] = donor
        self._bytes[donor.domain] = self._bytes.get(donor.domain, 0) + donor.nbytes
        while self._bytes[donor.domain] > self.bytes_per_domain or len(group) > self.max_donors_per_domain:
            _, gone = group.popitem(last=False)
            self._bytes[donor.domain] -= gone.nbytes
            self.evictions += 1
        return True

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
        if group is not None and key in group:
            group.move_to_end(key)

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

    def check_invariants(self) -> None:
        for d, g in self._groups.items():
            assert all(x.domain == d for x in g.values()), "a donor is filed under another domain"
            assert self._bytes.get(d, 0) == sum(x.nbytes for x in g.values()), "byte accounting drifted"
            assert self._bytes.get(d, 0) <= self.bytes_per_domain and len(g) <= self.max_donors_per_domain


def seq_kv(k: torch.Tensor, v: torch.Tensor) -> SeqKV:
    """Donor KV ``[layers, n, kv_heads, head_dim]`` at positions 0..n-1."""
    return SeqKV(k, v, torch.arange(k.shape[1]))
