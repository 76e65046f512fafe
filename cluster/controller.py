"""The controller: one named actor per Serve app that owns the worker pool and the tenants' limits.

Ingress replicas (``cluster/app.py``) are stateless HTTP front ends; the controller owns the
``WorkerPool`` (workers, routing, tenant autoscaling, link probes), the in-flight accounting,
admission (per-tenant rate and concurrency limits) and the templates registered over HTTP, so any
number of ingress replicas share one set of workers and one set of limits. Tokens do not pass
through the controller: per request a replica asks for a lease (``begin``: admission + the
router's choice), streams the outputs straight from the leased worker actor, and reports the first
output (``started``) and the end (``end``). Output-token progress rides on the heartbeats.

Lifetime: named ``kvmesh-controller:<app>`` in namespace ``kvmesh``, detached, created by the
first replica (``get_if_exists``); later replicas attach and must bring the same pool
configuration (else ``ConfigChanged``, which the replica retries for ``2 * client_ttl_s`` while
the old replicas leave; a replica bringing another configuration to a controller none of whose
replicas is attached, a deleted app's leftover, stops that controller and starts a fresh one with
its own); a replica bringing *new* tenants data (a redeploy with a
changed tenants file) updates the running app instead: keys, grants, limits, quotas, gates (see
``attach``), and the other replicas pick the new data up on their next heartbeat. Replicas send the configuration unresolved (``worker_num_gpus=None``,
auto device/dtype); the controller resolves it once, when it is created, so a replica started
later (when the cluster's GPUs changed) still matches. Workers (ids ``<app>-w<n>``) and the
router actor (``kvmesh-router:<app>``) are the controller's non-detached children, so they die
with it. If the pool fails to start, the controller stops (kills what it spawned) and exits.
Each replica heartbeats every ``client_ttl_s / 5``; a replica silent for ``client_ttl_s`` is
presumed dead and its leases are reclaimed (the worker aborts them). When no replica is attached
(the last one expired, or the last one detached in its ``__del__`` and none attached within
``client_ttl_s`` after it: a redeploy's new replica keeps the workers) the controller kills its
workers and itself; a replica that comes later creates a fresh one.

Invariants: every open lease belongs to exactly one attached client and holds one admission and
one pool flight; ending a lease (``end``, ``detach``, expiry) releases both exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

import ray

from actors.head_affinity import on_head
from cluster.pool import (PoolConfig, RouteChoice, WorkerDied, WorkerPool, WorkerUnavailable, prefill_sample,
                          resolve_pool_config, stream_outputs)
from engine.sequence import InvalidRequest, Request, RequestOutput
from policies.autoscale import check_shares
from policies.introspection import admin_view, tenant_view
from policies.pre_admission import LocalAdmission
from policies.tenancy import Admission, AdmitDecision, Tenants, domain_tenant

log = logging.getLogger(__name__)
NAMESPACE = "kvmesh"


def controller_name(app: str) -> str:
    return f"kvmesh-controller:{app}"


class Rejected(Exception):
    """Admission refused the request: the tenant is over its ``reason`` ("rate" | "concurrency") limit."""

    def __init__(self, reason: str, retry_after_s: float):
        super().__init__(reason, retry_after_s)
        self.reason, self.retry_after_s = reason, retry_after_s


TEMPLATES_PER_TENANT = 256
# an ``end`` for a lease not (yet) open is remembered this long, at most this many: a replica whose
# client left while ``begin`` was in flight ends the lease by its id without knowing whether begin
# ran, ran to the end, or is still routing (then begin finds the end here and opens nothing)
EARLY_END_KEEP_S = 600.0
EARLY_END_MAX = 65536
STREAM_RETRIES = 1  # a request whose worker fails before its first output begins again this many times
TEMPLATE_CHARS_PER_TENANT = 4 << 20


class TemplateQuotaExceeded(Exception):
    """A tenant's registered templates would exceed its count or size limit (HTTP 429)."""


class ControllerClosing(RuntimeError):
    """The controller is stopping (its last client left); connect again for a fresh one."""


class ConfigMismatch(ValueError):
    """A replica brought a configuration the controller cannot run with."""


class ConfigChanged(ConfigMismatch):
    """A replica brought another pool configuration while replicas of the running one are attached
    (``ControllerClient.connect`` waits up to ``2 * client_ttl_s`` for them to leave: replicas being
    stopped detach, vanished ones are reaped)."""


@dataclass(frozen=True)
class Lease:
    """A request's claim on one worker: stream from ``actor``, then ``end`` the lease once."""

    lease_id: str  # the request id
    worker_id: str
    actor: object  # ray ActorHandle of actors.worker.Worker
    choice: RouteChoice


@dataclass
class _Client:
    last_seen: float
    leases: set[str] = field(default_factory=set)
    begun: int = 0


@dataclass(frozen=True)
class _Open:
    client_id: str
    tenant: str
    actor: object


def for_app(config: PoolConfig, app: str) -> PoolConfig:
    """``config`` of the Serve app ``app`` (names its workers and router actor)."""
    return config if config.app == app else dataclasses.replace(config, app=app)


def without_tenants(config: PoolConfig) -> PoolConfig:
    """``config`` without the fields derived from the tenants file (eviction quotas, quality
    gates, worker shares): those change with the tenants data, at run time."""
    engine = config.engine
    approx = engine.approx
    if approx is not None:
        approx = dataclasses.replace(approx, tenant_gates={})
    return dataclasses.replace(config, shares=(), engine=dataclasses.replace(engine, tenant_quotas={}, approx=approx))


def tenants_digest(tenants_data: dict) -> str:
    """A stable digest of a tenants file's parsed data."""
    return hashlib.sha256(json.dumps(tenants_data, sort_keys=True, default=str).encode()).hexdigest()


def _diff(a: PoolConfig, b: PoolConfig) -> list[str]:
    out = []
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if x != y:
            if dataclasses.is_dataclass(x) and type(x) is type(y):
                out += [f"{f.name}.{g.name}" for g in dataclasses.fields(x) if getattr(x, g.name) != getattr(y, g.name)]
            else:
                out.append(f.name)
    return out


class Controller:
    """The app's worker pool and admission behind leases (see the module docstring)."""

    def __init__(self, app: str, config: PoolConfig, tenants_data: dict, client_ttl_s: float = 30.0,
                 template_store: TemplateStore | None | str = "auto"):
        config = for_app(config, app)
        self.app, self.config, self.tenants_data, self.client_ttl_s = app, config, tenants_data, client_ttl_s
        self.tenants = Tenants.from_dict(tenants_data)
        self.admission = Admission(self.tenants)
        # self.config is what replicas send (compared on attach); the pool runs the resolved one
        self.pool = WorkerPool(resolve_pool_config(config))
        self.clients: dict[str, _Client] = {}
        self.templates: dict[tuple[str, str], str] = {}  # (tenant, id) -> text, POST /v1/templates
        # kept beyond a crash of this actor ("auto": in Ray's GCS when this runs as an actor)
        self._template_store = (TemplateStore(app) if _in_actor() else None) if template_store == "auto" \
            else template_store
        if self._template_store is not None:
            try:
                self.templates = {k: v for k, v in self._template_store.load().items() if k[0] in self.tenants.by_name}
            except Exception:  # noqa: BLE001 - the GCS answers later calls or not: serve without them
                log.exception("the templates of app %r could not be loaded", app)
        self.tenants_version = 1  # bumped by every applied tenants change
        self._superseded: set[str] = set()  # digests of tenants data replaced by a newer deploy
        self._detached_at: float | None = None  # when the last replica detached (None: one is attached)
        self._open: dict[str, _Open] = {}  # lease id -> owner
        self._early_ends: dict[str, float] = {}  # lease id -> when its end came before its lease (insertion order)
        self._started = self._reaping = False
        self._start_lock: asyncio.Lock | None = None
        self._closing = False
        self._tasks: set[asyncio.Task] = set()

    # -- clients ---------------------------------------------------------------------------------
    async def attach(self, client_id: str, config: PoolConfig, tenants_data: dict, client_ttl_s: float) -> float:
        """Register an ingress replica (starting the pool on the first one); returns its heartbeat
        interval in seconds."""
        if self._closing:
            raise ControllerClosing(f"the controller of app {self.app!r} is stopping")
        config = for_app(config, self.app)
        diff = _diff(without_tenants(self.config), without_tenants(config))
        diff += ["client_ttl_s"] if client_ttl_s != self.client_ttl_s else []
        if diff:
            if not self.clients and self._started:
                # none of the app's replicas is attached (it was deleted, or its replicas stopped for a
                # redeploy with new args): this controller is a leftover, not a running app to protect
                self._stop(f"a replica brought another configuration ({', '.join(diff)} differ) and no "
                           "replica of the old one is attached")
                raise ControllerClosing(f"the controller of app {self.app!r} is stopping for a new configuration")
            raise ConfigChanged(
                f"the kvmesh controller of app {self.app!r} runs with another configuration ({', '.join(diff)} "
                f"differ) for {len(self.clients)} attached replica(s); delete the app (serve delete / serve "
                "shutdown) and deploy it again")
        if tenants_data != self.tenants_data and tenants_digest(tenants_data) not in self._superseded:
            await self.update_tenants(tenants_data, config)
        self._touch(client_id)
        if self._start_lock is None:
            self._start_lock = asyncio.Lock()
        async with self._start_lock:
            if not self._reaping:  # before the pool starts: a failed start must not orphan us
                self._spawn(self._reap_loop())
                self._reaping = True
            if not self._started:
                try:
                    await self.pool.start()
                except BaseException as e:
                    log.exception("the worker pool of app %r failed to start", self.app)
                    self._drop(client_id)
                    self._stop(f"its worker pool failed to start: {e!r}")
                    raise
                self._started = True
        return {"heartbeat_s": self.client_ttl_s / 5, "tenants_version": self.tenants_version}

    async def update_tenants(self, tenants_data: dict, config: PoolConfig) -> int:
        """Apply new tenants data (a redeploy brought a changed tenants file) to the running app:
        admission (keys, limits: in-flight counts kept), grants (requests admitted from now on get
        the new read domains; cached blocks of a grantor become unreadable to a revoked grantee at
        once, since read domains are computed per request), eviction quotas and quality gates on
        every worker, worker shares. ``config`` carries the tenant-derived fields (its other fields
        equal ours). The data it replaces is remembered as superseded: a replica of the old deploy
        that attaches later does not revert it. Raises ConfigMismatch (nothing changed) when the
        new shares do not fit the pool. Returns the new tenants version."""
        tenants = Tenants.from_dict(tenants_data)
        shares = dict(config.shares)
        try:
            check_shares(shares, self.pool.config.autoscale)
        except ValueError as e:
            raise ConfigMismatch(f"the new tenants file does not fit app {self.app!r}: {e}") from None
        old = self.tenants_data
        self._superseded.add(tenants_digest(old))
        self._superseded.discard(tenants_digest(tenants_data))
        self.tenants_data, self.tenants = tenants_data, tenants
        self.admission.update(tenants)
        e = config.engine
        self.config = dataclasses.replace(self.config, shares=config.shares, engine=dataclasses.replace(
            self.config.engine, tenant_quotas=e.tenant_quotas, approx=e.approx))
        pe = self.pool.config.engine
        approx = pe.approx if pe.approx is None or e.approx is None else dataclasses.replace(
            pe.approx, tenant_gates=e.approx.tenant_gates)
        self.pool.config = dataclasses.replace(self.pool.config, shares=config.shares, engine=dataclasses.replace(
            pe, tenant_quotas=e.tenant_quotas, approx=approx))
        self.pool.autoscaler.shares = shares
        for k in [k for k in self.templates if k[0] not in tenants.by_name]:  # a tenant that left
            self._forget_template(*k)
        self.tenants_version += 1
        gates = None if approx is None else approx.tenant_gates
        live = [w for w in self.pool.workers.values() if w.info is not None]
        results = await asyncio.gather(*(asyncio.wait_for(_aref(w.actor.set_tenant_policies.remote(
            e.tenant_quotas, gates)), 10.0) for w in live), return_exceptions=True)
        for w, r in zip(live, results):
            if isinstance(r, BaseException):
                log.warning("worker %s did not take the new tenant policies: %r", w.worker_id, r)
        log.info("kvmesh app %r applied a new tenants file (version %d): tenants %s", self.app,
                 self.tenants_version, sorted(tenants.by_name))
        return self.tenants_version

    def tenants_state(self) -> dict:
        """The tenants data in force and its version (replicas sync their keys from it)."""
        return {"version": self.tenants_version, "data": self.tenants_data}

    def heartbeat(self, client_id: str, progress: dict[str, int]) -> dict:
        """A replica is alive; ``progress``: output tokens of its open leases. ``alive`` False:
        the controller is stopping (connect again); ``tenants_version`` newer than the replica's:
        fetch ``tenants_state``."""
        self._touch(client_id)
        for lid, n in progress.items():
            if lid in self._open:
                self.pool.progress(lid, n)
        return {"alive": not self._closing, "tenants_version": self.tenants_version}

    def detach(self, client_id: str) -> None:
        """A replica stops: end its leases. When it was the last one, the controller stops unless
        a replica attaches within ``client_ttl_s``: a redeploy (Serve stops the old replica, then
        starts the new one) keeps the workers and their caches."""
        self._drop(client_id)
        if not self.clients:
            self._detached_at = time.monotonic()  # the reap loop stops us client_ttl_s from now

    def reap(self, now: float | None = None) -> list[str]:
        """Drop replicas silent for ``client_ttl_s`` (their leases are reclaimed); stop when none is left."""
        now = time.monotonic() if now is None else now
        gone = [cid for cid, c in self.clients.items() if now - c.last_seen > self.client_ttl_s]
        for cid in gone:
            log.warning("ingress client %s silent for %.0f s: reclaiming its %d leases", cid,
                        now - self.clients[cid].last_seen, len(self.clients[cid].leases))
            self._drop(cid)
        if not self.clients and (gone or self._detached_at is None or now - self._detached_at >= self.client_ttl_s):
            # the last replica detached (the app was deleted) and none came back: templates go too;
            # replicas that vanished (crashed) will be back, and find them
            self._stop("no ingress replica is left", forget_templates=not gone and self._detached_at is not None)
        return gone

    def _touch(self, client_id: str) -> _Client:
        c = self.clients.get(client_id)
        if c is None:
            c = self.clients[client_id] = _Client(time.monotonic())
            self._detached_at = None
        c.last_seen = time.monotonic()
        return c

    def _drop(self, client_id: str) -> None:
        c = self.clients.pop(client_id, None)
        for lid in list(c.leases) if c else ():
            self._end(lid, abort=True)

    async def _reap_loop(self) -> None:
        while not self._closing:
            await asyncio.sleep(self.client_ttl_s / 5)
            self.reap()

    # -- leases ----------------------------------------------------------------------------------
    async def begin(self, client_id: str, request: Request, ready_timeout_s: float = 60.0) -> Lease:
        """Admit and route a request. Raises ``Rejected`` (over a limit), ``WorkerUnavailable``."""
        if self._closing:
            raise WorkerUnavailable("the kvmesh controller is stopping")
        if request.tenant not in self.tenants.names():
            raise InvalidRequest(f"unknown tenant {request.tenant!r}")
        if domain_tenant(request.domain) != request.tenant:
            raise InvalidRequest(f"share domain {request.domain!r} is not one of tenant {request.tenant!r}")
        # The grants in force now decide what the request may read, whatever the replica knew.
        grants = self.tenants.read_domains(request.tenant) if request.domain == request.tenant else ()
        if grants != request.read_domains:
            request = dataclasses.replace(request, read_domains=grants)
        self._touch(client_id)
        rid = request.request_id
        if self._early_ends.pop(rid, None) is not None:
            raise WorkerUnavailable(f"request {rid!r} was ended by its client before it began")
        decision = self.admission.admit(request.tenant, time.monotonic())
        if not decision.ok:
            raise Rejected(decision.reason, decision.retry_after_s)
        try:
            ws, choice = await self.pool.acquire(request, ready_timeout_s)
        except BaseException:
            self.admission.release(request.tenant)
            raise
        if self._early_ends.pop(rid, None) is not None:  # its client left while we routed: open nothing
            self.pool.release(rid)
            self.admission.release(request.tenant)
            raise WorkerUnavailable(f"request {rid!r} was ended by its client before it began")
        c = self._touch(client_id)  # re-registers a client reaped while we routed
        c.leases.add(rid)
        c.begun += 1
        self._open[rid] = _Open(client_id, request.tenant, ws.actor)
        return Lease(rid, ws.worker_id, ws.actor, choice)

    def started(self, lease_id: str, route: str | None, ttft_s: float, prefill: tuple | None = None) -> None:
        """The lease's first output came ``ttft_s`` after the replica got the lease; ``prefill``:
        the worker's measured ``(computed tokens, seconds, cached tokens)`` from that output,
        for the router's prefill fit (it rides on the router's next call; see ``prefill_sample``)."""
        if lease_id in self._open:
            self.pool.mark_started(lease_id, route, ttft_s, prefill=prefill)

    def end(self, lease_id: str, finished: bool, worker_dead: bool = False, output_tokens: int | None = None) -> None:
        """The replica's stream ended (idempotent; a reclaimed lease is already ended) after
        ``output_tokens`` (None: unknown). An end for a lease that is not open is remembered for
        ``EARLY_END_KEEP_S``: its ``begin`` may still be routing, and then opens nothing."""
        if not self._end(lease_id, worker_dead=worker_dead, output_tokens=output_tokens):
            self._remember_early_end(lease_id)

    def _remember_early_end(self, lease_id: str) -> None:
        now = time.monotonic()
        ends = self._early_ends
        ends.pop(lease_id, None)
        ends[lease_id] = now
        while ends:  # the oldest first (insertion order); only what is dropped is visited
            old = next(iter(ends))
            if len(ends) <= EARLY_END_MAX and now - ends[old] < EARLY_END_KEEP_S:
                break
            del ends[old]

    def _end(self, lease_id: str, worker_dead: bool = False, abort: bool = False,
             output_tokens: int | None = None) -> bool:
        """End an open lease; False if ``lease_id`` is not open."""
        o = self._open.pop(lease_id, None)
        if o is None:
            return False
        c = self.clients.get(o.client_id)
        if c is not None:
            c.leases.discard(lease_id)
        if abort:
            try:
                o.actor.abort.remote(lease_id)  # fire and forget: frees the request's blocks
            except Exception:  # noqa: BLE001 - worker gone
                pass
        self.pool.release(lease_id, worker_dead=worker_dead, output_tokens=output_tokens)
        self.admission.release(o.tenant)
        return True

    # -- lifecycle -------------------------------------------------------------------------------
    async def wait_ready(self, timeout_s: float) -> dict:
        """The model info of a ready worker (name, max_model_len, block size)."""
        if not await self.pool.wait_ready(timeout_s):
            raise WorkerUnavailable(self.pool.error or "no worker became ready")
        return self.pool.model_info()

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _stop(self, why: str, forget_templates: bool = False) -> None:
        if self._closing:
            return
        self._closing = True
        log.info("kvmesh controller of app %r stops: %s", self.app, why)
        if forget_templates:  # stopped on purpose: a later deploy of the app starts without them
            for k in list(self.templates):
                self._forget_template(*k)
        self._spawn(self._shutdown())

    async def _shutdown(self) -> None:
        await asyncio.sleep(0.1)  # let the current reply go out
        await self.pool.close()
        ray.kill(ray.get_runtime_context().current_actor, no_restart=True)

    # -- introspection ---------------------------------------------------------------------------
    def health(self) -> dict:
        return {"workers": len(self.pool.workers), "ready": sum(w.routable for w in self.pool.workers.values()),
                "error": self.pool.error}

    async def metrics_snapshot(self) -> dict:
        states: dict[str, int] = {"ready": 0, "starting": 0, "draining": 0}
        assigned: dict[str, int] = {}
        for w in self.pool.workers.values():
            states["draining" if w.draining else "ready" if w.info else "starting"] += 1
            if w.tenant and not w.draining:
                assigned[w.tenant] = assigned.get(w.tenant, 0) + 1
        return {"queue_depth": self.pool.queue_depth(), "inflight": dict(self.admission.inflight), "states": states,
                "assigned": assigned, "router": await self.pool.router_metrics()}

    async def workers_view(self, tenant: str | None = None) -> dict:
        """Pool and engine state: all of it for an admin (``tenant`` None), else only what
        ``tenant`` may see (``policies.introspection.tenant_view``)."""
        d = self.pool.last_decision
        view = {"workers": await self.pool.stats(), "target": d.target if d else None,
                "allocation": dict(d.allocation) if d else {}}
        if tenant is None:  # the router's estimates: links, prefill fits, waits (admins only: load-derived)
            view["router"] = await self.pool.router_estimates()
            log = getattr(self.pool.router, "decision_log", None)
            view["placement_log"] = log() if log is not None else []
        return admin_view(view) if tenant is None else tenant_view(view, tenant)

    def snapshot(self) -> dict:
        """Clients with their open leases, workers with their in-flight counts (tests, debugging)."""
        return {"clients": {cid: {"leases": sorted(c.leases), "begun": c.begun} for cid, c in self.clients.items()},
                "workers": {w.worker_id: {"inflight": w.inflight, "inflight_tokens": w.inflight_tokens,
                                          "ready": w.info is not None, "draining": w.draining}
                            for w in self.pool.workers.values()},
                "admitted": dict(self.admission.inflight), "closing": self._closing}

    def register_template(self, tenant: str, template_id: str, text: str) -> None:
        """Keep ``text`` as ``tenant``'s template ``template_id`` (replacing one of that id).
        Bounded per tenant: at most ``TEMPLATES_PER_TENANT`` ids (``TemplateQuotaExceeded``
        beyond) and ``TEMPLATE_CHARS_PER_TENANT`` characters of text (the same), each text at most
        ``MAX_TEMPLATE_CHARS`` characters (InvalidRequest); one tenant cannot grow the
        controller's memory for all."""
        from cluster.input_limits import MAX_TEMPLATE_CHARS

        if tenant not in self.tenants.names():
            raise InvalidRequest(f"unknown tenant {tenant!r}")
        if len(text) > MAX_TEMPLATE_CHARS:
            raise InvalidRequest(f"a template has at most {MAX_TEMPLATE_CHARS} characters")
        mine = {tid: t for (ten, tid), t in self.templates.items() if ten == tenant}
        if template_id not in mine and len(mine) >= TEMPLATES_PER_TENANT:
            raise TemplateQuotaExceeded(f"tenant {tenant!r} already has {len(mine)} templates (the limit); "
                                        "re-register an existing id to replace it")
        size = sum(len(t) for tid, t in mine.items() if tid != template_id) + len(text)
        if size > TEMPLATE_CHARS_PER_TENANT:
            raise TemplateQuotaExceeded(f"tenant {tenant!r}'s templates would hold {size} characters, more than "
                                        f"the limit of {TEMPLATE_CHARS_PER_TENANT}")
        if self._template_store is not None:
            self._template_store.put(tenant, template_id, text)  # before it answers: kept once acknowledged
        self.templates[(tenant, template_id)] = text

    def template(self, tenant: str, template_id: str) -> str | None:
        return self.templates.get((tenant, template_id))

    def _forget_template(self, tenant: str, template_id: str) -> None:
        self.templates.pop((tenant, template_id), None)
        if self._template_store is not None:
            try:
                self._template_store.delete(tenant, template_id)
            except Exception:  # noqa: BLE001 - the GCS is gone with the cluster
                pass


class TemplateStore:
    """Where a controller keeps the templates registered over HTTP beyond its own life: Ray's GCS
    key-value store, one key per (tenant, id) under the app's prefix. A controller that crashed
    and was created again (by the next replica call) finds them there; an app stopped on purpose
    (deleted, or its last replica detached) clears them. The GCS lives as long as the Ray cluster
    (a fault probe: a template registered before a controller kill was a 400 "unknown template"
    after it)."""

    def __init__(self, app: str):
        self.prefix = f"templates:{app}:".encode()

    def _key(self, tenant: str, template_id: str) -> bytes:
        return self.prefix + json.dumps([tenant, template_id]).encode()

    def load(self) -> dict[tuple[str, str], str]:
        from ray.experimental import internal_kv as kv

        out = {}
        for key in kv._internal_kv_list(self.prefix, namespace=NAMESPACE):
            text = kv._internal_kv_get(key, namespace=NAMESPACE)
            if text is not None:
                tenant, tid = json.loads(key[len(self.prefix):])
                out[(tenant, tid)] = text.decode()
        return out

    def put(self, tenant: str, template_id: str, text: str) -> None:
        from ray.experimental import internal_kv as kv

        kv._internal_kv_put(self._key(tenant, template_id), text.encode(), overwrite=True, namespace=NAMESPACE)

    def delete(self, tenant: str, template_id: str) -> None:
        from ray.experimental import internal_kv as kv

        kv._internal_kv_del(self._key(tenant, template_id), namespace=NAMESPACE)


def _in_actor() -> bool:
    try:
        return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None
    except Exception:  # noqa: BLE001 - no runtime context: not in an actor
        return False


def get_or_create_controller(app: str, config: PoolConfig, tenants_data: dict, client_ttl_s: float = 30.0):
    """The app's controller actor, created (detached) if missing. Blocking GCS call: from async
    code use ``asyncio.to_thread``."""
    cls = ray.remote(num_cpus=0, max_concurrency=1000, max_restarts=0)(Controller)
    return cls.options(name=controller_name(app), namespace=NAMESPACE, lifetime="detached",
                       get_if_exists=True, **on_head()).remote(app, config, tenants_data, client_ttl_s)


def _cause(e: BaseException) -> BaseException:
    """The exception an actor method raised (Ray wraps it in a RayTaskError)."""
    return getattr(e, "cause", None) or e if isinstance(e, ray.exceptions.RayTaskError) else e


class ControllerClient:
    """An ingress replica's side of the controller: leases a worker per request and streams from
    it directly. ``connect()`` inside the replica's event loop; ``close()`` when it stops.

    ``pre_admit(tenant)`` answers from this replica's own leases and the controller's past answers
    (``policies.pre_admission.LocalAdmission``): a refusal there is one the controller would give
    too, so the ingress can refuse before reading the request's body; every lease ``generate``
    takes is recorded there (admitted, refused, ended)."""

    def __init__(self, app: str, config: PoolConfig, tenants_data: dict, client_ttl_s: float = 30.0,
                 call_timeout_s: float = 10.0):
        self.app, self.tenants_data, self.client_ttl_s = app, tenants_data, client_ttl_s
        self.config = for_app(config, app)
        self.call_timeout_s = call_timeout_s
        self.client_id = f"{app}-{uuid.uuid4().hex[:12]}"
        self.handle = None
        self._heartbeat_s = client_ttl_s / 5
        self._progress: dict[str, int] = {}  # open lease -> output tokens so far
        self._tasks: set[asyncio.Task] = set()
        self._heartbeats: asyncio.Task | None = None
        self._lock = asyncio.Lock()
        self.tenants_version = 0  # of the controller's tenants data this client holds (0: its own)
        self.on_tenants = None  # callback(tenants_data) when the controller's tenants changed
        self.local = LocalAdmission(Tenants.from_dict(tenants_data))

    async def connect(self, timeout_s: float = 120.0) -> None:
        """Attach to the app's controller, creating it if missing (retries while an old one stops)."""
        async with self._lock:
            deadline = time.monotonic() + timeout_s
            changed_until = None  # waiting for the replicas of another configuration to leave, until
            while True:
                handle = await asyncio.to_thread(get_or_create_controller, self.app, self.config, self.tenants_data,
                                                 self.client_ttl_s)
                try:
                    reply = await handle.attach.remote(self.client_id, self.config, self.tenants_data,
                                                       self.client_ttl_s)
                    break
                except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as e:
                    cause = _cause(e)
                    retry = isinstance(cause, (ControllerClosing, ray.exceptions.RayActorError))
                    if isinstance(cause, ConfigChanged):  # the old replicas may be on their way out
                        if changed_until is None:
                            changed_until = time.monotonic() + 2 * self.client_ttl_s
                            log.warning("%s; waiting up to %.0f s for them to leave", cause, 2 * self.client_ttl_s)
                        retry = time.monotonic() < changed_until
                    if not retry or time.monotonic() > deadline:
                        raise cause from None
                    await asyncio.sleep(0.5)
            if self.handle is not None:  # a new controller: it counts none of our old leases
                self.local.reset()
            self.handle = handle
            if isinstance(reply, dict):
                self._heartbeat_s = reply["heartbeat_s"]
                await self._sync_tenants(reply.get("tenants_version", 0))
            else:  # an older controller: the interval only
                self._heartbeat_s = reply
            if self._heartbeats is None:
                self._heartbeats = asyncio.get_running_loop().create_task(self._heartbeat_loop())

    async def close(self) -> None:
        """Detach (the last replica to detach stops the controller and its workers)."""
        if self._heartbeats is not None:
            self._heartbeats.cancel()
        if self.handle is not None:
            try:
                await asyncio.wait_for(_aref(self.handle.detach.remote(self.client_id)), self.call_timeout_s)
            except Exception:  # noqa: BLE001 - gone already: it reaps us after client_ttl_s anyway
                pass

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self._heartbeat_s)
            try:
                ref = self.handle.heartbeat.remote(self.client_id, dict(self._progress))
                beat = await asyncio.wait_for(_aref(ref), self.call_timeout_s)
                alive = beat["alive"] if isinstance(beat, dict) else beat
                if not alive:
                    await self.connect()
                elif isinstance(beat, dict):
                    await self._sync_tenants(beat.get("tenants_version", 0))
            except asyncio.CancelledError:
                raise
            except ray.exceptions.RayActorError:
                log.warning("kvmesh controller of app %r is gone: connecting to a new one", self.app)
                try:
                    await self.connect()
                except Exception:  # noqa: BLE001 - retried on the next beat
                    log.exception("reconnecting to the kvmesh controller failed")
            except Exception:  # noqa: BLE001 - a slow beat: the next one may pass
                log.warning("kvmesh controller heartbeat failed", exc_info=True)

    async def _sync_tenants(self, version: int) -> None:
        """Take the controller's tenants data when it is newer than ours (a redeploy changed the
        tenants file): from now on this replica authenticates with it and reconnects with it."""
        if version <= self.tenants_version:
            return
        state = await asyncio.wait_for(_aref(self.handle.tenants_state.remote()), self.call_timeout_s)
        self.tenants_version = state["version"]
        if state["data"] != self.tenants_data:
            self.tenants_data = state["data"]
            try:
                self.local.update(Tenants.from_dict(state["data"]))
            except Exception:  # noqa: BLE001 - invalid data: the ingress logs it (on_tenants); keep the old limits
                pass
            if self.on_tenants is not None:
                self.on_tenants(state["data"])

    async def call(self, method: str, *args, timeout_s: float | None = None):
        """``Controller.<method>(*args)``; reconnects once if the controller died."""
        return await self._invoke(method, args, timeout_s or self.call_timeout_s)

    async def _invoke(self, method: str, args: tuple, timeout_s: float | None, on_cancel=None):
        """``Controller.<method>(*args)`` (no time limit when ``timeout_s`` is None), reconnecting
        once if the controller died; ``on_cancel(ref)`` runs if the caller is cancelled meanwhile."""
        for attempt in (0, 1):
            ref = getattr(self.handle, method).remote(*args)
            try:
                return await (ref if timeout_s is None else asyncio.wait_for(_aref(ref), timeout_s))
            except asyncio.CancelledError:
                if on_cancel is not None:
                    on_cancel(ref)
                raise
            except ray.exceptions.RayActorError:
                if attempt:
                    raise WorkerUnavailable("the kvmesh controller is unavailable") from None
                await self.connect()
            except ray.exceptions.RayTaskError as e:
                raise _cause(e) from None

    async def wait_ready(self, timeout_s: float) -> dict:
        return await self.call("wait_ready", timeout_s, timeout_s=timeout_s + self.call_timeout_s)

    async def _begin(self, request: Request, ready_timeout_s: float) -> Lease:
        # the HTTP client left while begin was in flight: end the lease once begin has answered
        return await self._invoke("begin", (self.client_id, request, ready_timeout_s), None,
                                  lambda ref: self._spawn(self._end_when_begun(ref, request.request_id)))

    async def _end_when_begun(self, ref, lease_id: str) -> None:
        """End lease ``lease_id`` (a lease's id is its request's) whatever ``begin`` answered,
        unless it refused. Its answer does not tell whether the controller opened the lease:
        Serve cancels a request's child tasks too, so ``ref`` can fail with
        ``TaskCancelledError`` after (or while) the controller's ``begin`` ran (measured: ~10% of
        requests whose client left 50-80 ms in leaked their lease, and a tenant that lost
        ``max_concurrent`` of them got 429s until the controller restarted). The end comes after
        the answer, so an open lease is ended; if begin is still routing, the controller keeps the
        end and begin opens nothing."""
        try:
            await ref
        except Exception as e:  # noqa: BLE001 - cancelled, failed or lost: it may have begun
            if isinstance(_cause(e), (Rejected, InvalidRequest)):  # refused before anything was opened
                return
        self.handle.end.remote(lease_id, False)

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def pre_admit(self, tenant: str) -> AdmitDecision:
        """Would the controller refuse a request of ``tenant`` now? (``LocalAdmission.check``.)"""
        return self.local.check(tenant, time.monotonic())

    async def generate(self, request: Request, ready_timeout_s: float = 60.0
                       ) -> AsyncIterator[tuple[Lease, RouteChoice, RequestOutput]]:
        """Like ``WorkerPool.generate``: stream a request's outputs from the leased worker. Closing
        the iterator early cancels the request on the worker (its blocks are freed). A worker
        that dies (or cannot be reached) before the request's first output is not the client's
        problem: the request begins again, on another lease, up to ``STREAM_RETRIES`` times
        (its lease ended first, as a dead worker's, so the router does not choose it again); after
        an output has gone out, the stream fails (the client has part of an answer)."""
        for attempt in range(STREAM_RETRIES + 1):
            attempt_request = request if not attempt else dataclasses.replace(
                request, request_id=f"{request.request_id}-retry{attempt}")  # a new lease id
            sent = False
            try:
                async with contextlib.aclosing(self._generate_once(attempt_request, ready_timeout_s)) as items:
                    async for item in items:
                        sent = True
                        yield item
                return
            except WorkerUnavailable as e:
                if sent or not getattr(e, "before_output", False) or attempt == STREAM_RETRIES:
                    raise
                log.warning("request %s: %s before its first output; beginning it again", request.request_id, e)

    async def _generate_once(self, request: Request, ready_timeout_s: float
                             ) -> AsyncIterator[tuple[Lease, RouteChoice, RequestOutput]]:
        ticket = self.local.sent(request.tenant, time.monotonic())
        t_lease = time.perf_counter()
        try:
            lease = await self._begin(request, ready_timeout_s)
        except Rejected as e:
            self.local.refused(ticket, e.reason, e.retry_after_s, time.monotonic())
            raise
        self.local.admitted(ticket, time.monotonic())
        choice = dataclasses.replace(lease.choice, lease_s=time.perf_counter() - t_lease)
        lid, finished, dead, first = lease.lease_id, False, False, True
        self._progress[lid] = 0
        t0 = time.monotonic()
        try:
            async with contextlib.aclosing(stream_outputs(lease.actor, lease.worker_id, request, lease.choice)) as outs:
                async for out in outs:
                    if first:
                        self.handle.started.remote(lid, out.route, time.monotonic() - t0, prefill_sample(out))
                        first = False
                    self._progress[lid] = out.num_output_tokens
                    finished = out.finished
                    yield lease, choice, out
        except WorkerUnavailable as e:  # from the worker's stream (WorkerDied: it is gone)
            dead = isinstance(e, WorkerDied)
            e.before_output = first
            raise
        finally:
            self.local.released(ticket)  # before end(): this replica never counts more than the controller
            await self._end(lid, finished, dead, self._progress.pop(lid, None))

    async def _end(self, lease_id: str, finished: bool, dead: bool, output_tokens: int | None = None) -> None:
        """End a lease (after ``output_tokens``). A finished stream waits for the controller to
        record it (one round trip after the last token, never before the first): the client may
        send its next request to another ingress replica at once, and that replica's ``begin``
        must not find this lease still open (a spurious 429 at exactly ``max_concurrent``). A
        stream that failed or was abandoned ends fire-and-forget: its client is gone or gets an
        error anyway."""
        try:
            ref = self.handle.end.remote(lease_id, finished, dead, output_tokens)
            if finished:
                await asyncio.wait_for(_aref(ref), self.call_timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - controller gone (its leases went with it) or slow: the lease ends anyway
            pass


async def _aref(ref):
    return await ref
