"""What ``GET /kvmesh/workers`` shows to whom: a tenant sees only its own state, an admin all.

Pure (no Ray). The controller builds the full view (pool state plus every worker's engine stats);
``tenant_view`` cuts it down for one tenant's API key. Invariant: nothing in a tenant's view is
derived from another tenant's requests, except the number of workers and whether each is ready
or draining (capacity, not content). In particular it holds no pool-wide block or queue counts
(free blocks and running/waiting counts move with other tenants' prompts: a side channel), no
other tenant's counters, templates, gate keys (``<domain>/auto:<digest of the prompt's tokens>``
would let a tenant confirm a guessed prompt offline) or allocation.
"""

from __future__ import annotations

from typing import Mapping

from policies.tenancy import SALT_SEP


def owns_key(tenant: str, key: str) -> bool:
    """Whether a ``"<domain>/<template>"`` gate key belongs to ``tenant`` (its own domain or one
    of its salted domains; tenant names contain neither "/" nor "#")."""
    return key.startswith(tenant + "/") or key.startswith(tenant + SALT_SEP)


def _engine_view(tenant: str, engine: Mapping | None) -> dict | None:
    if engine is None:
        return None
    out: dict = {"tenants": {tenant: engine["tenants"][tenant]} if tenant in engine.get("tenants", {}) else {}}
    approx = engine.get("approx")
    if approx is not None:
        out["approx"] = {"gate": {k: v for k, v in (approx.get("gate") or {}).items() if owns_key(tenant, k)}}
    cross = engine.get("cross_tenant_reads") or {}
    out["cross_tenant_reads"] = {k: v for k, v in cross.items() if k.split("<-", 1)[0] == tenant}
    return out


def tenant_view(view: Mapping, tenant: str) -> dict:
    """``view`` (``Controller.workers_view``'s full answer) as ``tenant`` may see it."""
    workers = []
    for w in view.get("workers", []):
        workers.append({"worker_id": w["worker_id"], "ready": w["ready"], "draining": w["draining"],
                        "assigned_to_you": w.get("tenant") == tenant,
                        "engine": _engine_view(tenant, w.get("engine"))})
    alloc = view.get("allocation") or {}
    return {"scope": f"tenant:{tenant}", "workers": workers, "target": view.get("target"),
            "allocation": {tenant: alloc[tenant]} if tenant in alloc else {}}


def admin_view(view: Mapping) -> dict:
    return {"scope": "admin", **view}
