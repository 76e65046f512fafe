"""Approximate-reuse state (donor pool, detected-family maps) is bounded per tenant, over all of
the tenant's domains.

Every ``cache_salt`` is a share domain of its own; without a per-tenant bound a tenant sending
many salts could hold ``bytes_per_domain`` per salt on every worker (unbounded memory). No model.
"""

from __future__ import annotations

import torch

from engine.manual_forward import SeqKV
from engine.slot_pool import Donor, SlotPool


def kv(n: int) -> SeqKV:
    return SeqKV(torch.zeros(2, n, 1, 4), torch.zeros(2, n, 1, 4), torch.arange(n))


PER = kv(10).k.nbytes * 2  # one 10-token donor


def d(tenant: str, domain: str, first: int, template: str | None = None) -> Donor:
    return Donor(domain, tenant, (first,) * 10, kv(10), None, template, None)


def test_salted_domains_share_their_tenants_bound():
    pool = SlotPool(bytes_per_domain=4 * PER, bytes_per_tenant=6 * PER)
    for i in range(4):
        assert pool.put(d("globex", "globex", 100 + i))
    for i in range(50):  # acme: one donor in each of 50 salted domains
        assert pool.put(d("acme", f"acme#salt:{i:04x}", i))
        pool.check_invariants()
    assert pool.tenant_bytes("acme") == 6 * PER and len(pool) == 6 + 4
    kept = sorted(x.token_ids[0] for x in pool if x.tenant == "acme")
    assert kept == list(range(44, 50))  # the tenant's least recently used went first
    assert pool.tenant_bytes("globex") == 4 * PER  # another tenant's donors are untouched
    assert {x.domain for x in pool if x.tenant == "acme"} == {f"acme#salt:{i:04x}" for i in range(44, 50)}
    assert pool.domain_bytes("acme#salt:0000") == 0 and pool.nbytes == 10 * PER


def test_touch_orders_the_tenant_lru_across_domains():
    pool = SlotPool(bytes_per_domain=4 * PER, bytes_per_tenant=3 * PER)
    a, b, c = d("acme", "acme", 1), d("acme", "acme#salt:1", 2), d("acme", "acme#salt:2", 3)
    for x in (a, b, c):
        pool.put(x)
    pool.touch(a)  # a is now the most recent: b goes first
    pool.put(d("acme", "acme", 4))
    assert sorted(x.token_ids[0] for x in pool) == [1, 3, 4] and pool.get(b.slot_id) is None
    pool.check_invariants()


def test_default_tenant_bound_is_the_domain_bound_and_refresh_keeps_books():
    pool = SlotPool(bytes_per_domain=2 * PER)
    assert pool.bytes_per_tenant == 2 * PER
    for i in range(3):
        pool.put(d("acme", f"acme#salt:{i}", i))
    assert pool.tenant_bytes("acme") == 2 * PER and pool.evictions == 1
    again = d("acme", "acme#salt:2", 2, template=None)
    assert pool.put(again)  # the same prompt again: replaced, not counted twice
    assert pool.tenant_bytes("acme") == 2 * PER and len(pool) == 2
    assert not pool.put(Donor("acme", "acme", (7,) * 40, kv(40)))  # larger than the bound
    pool.check_invariants()


def test_detected_family_maps_bounded_per_tenant():
    """Auto-detected template families are kept per share domain; salted domains of one tenant
    share FAMILY_DOMAINS_PER_TENANT maps (least recently used dropped), others are untouched."""
    from engine.approx import FAMILY_DOMAINS_PER_TENANT, ApproxReuse
    from engine.sequence import Request

    ax = ApproxReuse(None, None)  # bookkeeping only: no model needed for the family maps
    other = Request("g", (5, 6, 7), tenant="globex")
    ax._family(other, d("globex", "globex", 5))  # noqa: SLF001
    for i in range(200):
        req = Request(f"r{i}", (1, 2, i), tenant="acme", share_domain=f"acme#salt:{i}")
        ax._family(req, d("acme", f"acme#salt:{i}", i))  # noqa: SLF001
    acme = [dom for dom in ax._families if dom.startswith("acme")]  # noqa: SLF001
    assert len(acme) == FAMILY_DOMAINS_PER_TENANT
    assert set(acme) == {f"acme#salt:{i}" for i in range(200 - FAMILY_DOMAINS_PER_TENANT, 200)}
    assert "globex" in ax._families  # noqa: SLF001
