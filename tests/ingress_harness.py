"""The real HTTP ingress in-process, without Ray: FastAPI app + a stand-in controller client.

``LocalPool`` plays ``cluster.controller.ControllerClient``: admission and templates come from a
real ``Controller`` object (its pool is never started), generation from one in-process
``AsyncEngine`` on tiny-llama; the replica's pre-admission is a real ``LocalAdmission`` fed the
way ``ControllerClient.generate`` feeds it (``begun`` counts the requests the controller saw).
``make_ingress`` builds a ``KvmeshIngress`` replica through its own ``_setup`` and points
Serve's per-request replica lookup at it, so ``httpx.ASGITransport`` requests run every route
exactly as Serve would, in milliseconds.
"""

from __future__ import annotations

import contextlib
import dataclasses
from types import SimpleNamespace

from cluster.controller import Controller, Rejected
from cluster.pool import RouteChoice
from engine.async_engine import AsyncEngine
from engine.llm_engine import EngineConfig
from engine.sequence import InvalidRequest
from policies.pre_admission import LocalAdmission

TINY = "tiny-llama"
TENANTS = {"tenants": [
    {"name": "acme", "api_keys": ["sk-acme"], "share_with": ["globex"]},
    {"name": "globex", "api_keys": ["sk-globex"]},
    {"name": "limited", "api_keys": ["sk-limited"], "limits": {"requests_per_s": 0.001, "burst": 1}},
]}


class LocalPool:
    """The ControllerClient surface the ingress uses, over one local engine."""

    def __init__(self, engine: AsyncEngine, controller: Controller):
        self.engine, self.controller = engine, controller
        self.local = LocalAdmission(controller.tenants)
        self.begun = 0  # admission requests the controller saw (admitted or refused)

    def pre_admit(self, tenant: str):
        return self.local.check(tenant, 0.0)  # the controller's admission runs at time 0.0 here too

    async def call(self, method: str, *args, timeout_s: float | None = None):
        if method == "health":
            return {"workers": 1, "ready": int(self.engine.alive), "error": None}
        if method == "metrics_snapshot":
            return {"queue_depth": {}, "inflight": dict(self.controller.admission.inflight),
                    "states": {"ready": 1, "starting": 0, "draining": 0}, "assigned": {}, "router": None}
        if method == "workers_view":
            from policies.introspection import admin_view, tenant_view

            stats = await self.engine.call(lambda e: e.stats())
            view = {"workers": [{"worker_id": "local", "tenant": None, "ready": True, "draining": False,
                                 "inflight": 0, "engine": stats}], "target": 1, "allocation": {}}
            tenant = args[0] if args else None  # as Controller.workers_view: None = the admin view
            return admin_view(view) if tenant is None else tenant_view(view, tenant)
        return getattr(self.controller, method)(*args)

    async def generate(self, request, ready_timeout_s: float = 60.0):
        if request.tenant not in self.controller.tenants.names():
            raise InvalidRequest(f"unknown tenant {request.tenant!r}")
        ticket = self.local.sent(request.tenant, 0.0)
        self.begun += 1
        d = self.controller.admission.admit(request.tenant, 0.0)
        if not d.ok:
            self.local.refused(ticket, d.reason, d.retry_after_s, 0.0)
            raise Rejected(d.reason, d.retry_after_s)
        self.local.admitted(ticket, 0.0)
        lease = SimpleNamespace(worker_id="local", lease_id=request.request_id)
        try:
            async with contextlib.aclosing(self.engine.generate(request)) as outs:
                async for out in outs:
                    yield lease, RouteChoice("local"), dataclasses.replace(
                        out, route="local" if out.num_cached_tokens else "recomputed")
        finally:
            self.local.released(ticket)
            self.controller.admission.release(request.tenant)

    async def close(self):
        self.engine.shutdown()


def make_ingress(tiny_model, monkeypatch, tenants_data=TENANTS, num_blocks=64, **settings):
    """(FastAPI app, ingress instance, AsyncEngine) for in-process requests."""
    from ray import serve

    from cluster import app as app_mod
    from cluster.app import AppSettings, KvmeshIngress, pool_config
    from policies.tenancy import Tenants

    s = AppSettings(model=TINY, **settings)
    tenants = Tenants.from_dict(tenants_data)
    cfg = dataclasses.replace(pool_config(s, tenants), engine=EngineConfig(
        model=TINY, num_blocks=num_blocks, tenant_quotas=tenants.eviction_quotas(),
        grammar_compile_cpu_s=s.grammar_compile_cpu_s, max_schema_chars=s.max_schema_chars))
    engine = AsyncEngine(cfg.engine, loaded=tiny_model)
    controller = Controller("local", cfg, tenants_data)
    class LocalIngress(KvmeshIngress.func_or_class):
        def __del__(self):  # Serve's replica shutdown hook (detach from the controller): none here
            pass

    ing = object.__new__(LocalIngress)
    e = engine.engine
    ing._setup(s, tenants, LocalPool(engine, controller),
               {"max_model_len": e.max_model_len, "vocab_size": e.loaded.model.config.vocab_size})
    monkeypatch.setattr(serve, "get_replica_context", lambda: SimpleNamespace(servable_object=ing, app_name="local"))
    return app_mod.app, ing, engine


async def pool_idle(engine: AsyncEngine) -> bool:
    """Nothing in use and the pool's accounting exact (checked on the engine thread)."""
    def check(e):
        e.pool.check_invariants()
        return e.pool.num_in_use() == 0 and not e.seqs and e.pool.num_free_blocks() == e.pool.num_blocks

    return await engine.call(check)
