"""The worker pool: plain Ray worker actors, a routing hook, tenant autoscaling.

Workers are plain Ray actors (``actors.worker``), one per GPU when the cluster has GPUs, created
and removed by the pool; the pool lives in the app's controller actor (``cluster.controller``),
which leases workers to the Serve ingress replicas. Why plain actors
rather than a Serve deployment of workers: a KV pull needs worker-to-worker calls to a *named*
holder and requests sent to a chosen target worker; plain actor handles give both directly, while
Serve replicas are reachable only through a handle's router. Ray's cluster autoscaler adds GPU
nodes when the pool asks for more ``num_gpus=1`` actors than fit.

Routing is one replaceable object, ``Router.choose(request, candidates)`` (the shared types live in
``cluster.types``, imported by this module and by ``cluster.routing``); without cost-aware routing
``LeastLoadedRouter`` picks the worker with the fewest in-flight tokens. Later routers (prefix
index lookup, network-aware cost model) plug in here and may name a pull source.

Tenant autoscaling: every ``interval_s`` the pool hands per-tenant demand (tokens of queued and
running requests) to ``policies.autoscale.TenantAutoscaler``, creates or drains workers to meet
the target and assigns workers to tenants by the allocation. A tenant's requests go to the
workers assigned to it, to the unassigned (shared) ones and to other tenants' idle workers
(nothing in flight there: ``candidates``); when there are none of these, to any worker. (Own
workers only would leave shared workers idle: with one tenant whose demand asks for one worker,
every request went to that worker while the other idled: 23 of 24 in issue 11's run.)
Draining workers finish their requests and are then killed.

Worker ids are ``<app>-w<n>`` (``w<n>`` when ``PoolConfig.app`` is empty), unique across the apps
of one cluster: the global index actor (``kvmesh-index``) is keyed by worker id. The router actor
is one per app (``kvmesh-router:<app>``), created by the pool (so owned by the app's controller).

Invariants: a worker's ``inflight``/``inflight_tokens`` count the requests ``acquire``d on it
and not yet ``release``d (``generate`` does both around its stream); a draining or dead worker
is never chosen; only ``ActorDiedError`` marks a worker dead (an unreachable one,
``ActorUnavailableError``, fails that request with ``WorkerUnavailable`` and stays); a stream
that ends early (client gone, error) cancels the worker's generator, which aborts the request
there and frees its blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import AsyncIterator, Sequence

import ray

from actors.worker import worker_actor_class
from cluster.routing import ROUTE_TIMEOUT_S, ROUTER_FLUSH_S, CostAwareRouter
from cluster.types import (NO_LOAN, HitLoan, InFlight, LeastLoadedRouter, RouteChoice, Router, WorkerDied,  # noqa: F401 - re-exported
                           WorkerState, WorkerUnavailable)
from engine.async_engine import EngineDead
from engine.llm_engine import EngineConfig
from engine.redact import describe_exc
from engine.sequence import InvalidRequest, Request, RequestOutput
from policies.autoscale import AutoscaleConfig, ScaleDecision, TenantAutoscaler, TenantDemand, TenantShare
from policies.placement import PlacementConfig

log = logging.getLogger(__name__)

LEND_MODES = ("unqueued", "idle", "never")  # PoolConfig.lend_workers (WorkerPool.lendable)
LIFETIME_ALPHA = 0.2  # EWMA weight of one ended request in a worker's tpot_s / output_tokens
CLOSE_WAIT_S = 10.0  # WorkerPool.close waits at most this long for its killed actors to be gone
ROUTER_RESYNC_S = 30.0  # sync_router resends an unchanged worker set this often (a safety net)
ROUTE_ATTEMPTS = 3  # a request whose chosen worker became unavailable while the router chose is routed again


@dataclass(frozen=True)
class PoolConfig:
    """The pool's configuration. ``worker_num_gpus=None`` (and ``auto_device``/``auto_dtype``) are
    resolved once, by ``resolve_pool_config`` in the controller, never by the replicas: two
    replicas of one app always send equal configs."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    autoscale: AutoscaleConfig = AutoscaleConfig()
    shares: tuple[tuple[str, TenantShare], ...] = ()
    worker_num_cpus: float = 1.0
    worker_num_gpus: float | None = None  # None: 1 when the cluster has GPUs, else 0
    auto_device: bool = False  # engine.device unset: cuda when workers get GPUs, else cpu
    auto_dtype: bool = False  # engine.dtype unset: bfloat16 on cuda, else float32
    app: str = ""  # the Serve app: prefixes worker ids and names the router actor
    ready_timeout_s: float = 600.0
    # Route by the global index + router actor's TTFT model (pull / local / recompute). Off:
    # least-loaded routing and no index/router actors.
    cost_aware_routing: bool = True
    router_learn_decode: bool = True  # CostConfig.learn_decode of the router actor this pool creates
    # when another tenant's request may use a worker assigned to a tenant (WorkerPool.lendable):
    # "unqueued" (no request waits there for its first token), "idle" (nothing in flight), "never"
    lend_workers: str = "unqueued"
    # a worker not lent now is still open to another tenant's request that finds all of its prompt
    # there but at most this many tokens (its own prefix, computed there before the assignment):
    # a short prefill ahead of the owner's next request instead of the whole prefix recomputed
    # elsewhere (``HitLoan``; 0: off)
    lend_hit_tokens: int = 64
    # a request on another tenant's (lent) worker runs there below the owner's priority classes
    # (``Request.guest``): the owner's requests arriving meanwhile cap the guest's prefill chunks.
    # Off by default: on the cluster bench's multi-tenant mix it made every tenant slower (session 23)
    guests_yield: bool = False
    # a new worker times a short and a long synthetic prefill before it serves (LLMEngine.calibrate),
    # and the router's prefill fit starts from those instead of a prior from another machine
    calibrate_prefill: bool = True
    # the router prices each worker's KV memory: a request waits for room in a full pool
    # (policies.routing.kv_use / kv_admission_s, CostAwareRouter.kv_memory); False: queue compute only
    router_kv_memory: bool = True
    # workers the router ranks and weighs per request: the prompt's holders, then the least busy
    # (policies.placement.shortlist); 0: every worker
    router_max_candidates: int = 16
    router_idle_spill: bool = True  # False: PlacementConfig.idle_slack = 0 (a hot group never spills to an idle worker)
    # False: PlacementConfig.spill_share_margin = None (any group dominant on its holder spills, without
    # its holders' worth of the cluster's traffic)
    router_spill_needs_share: bool = True
    # PlacementConfig.balance_ratio: a holder whose averaged queue wait exceeds this x the least-waiting
    # worker's + balance_abs_s lets any of its groups go (0: off, the default)
    router_balance_ratio: float = 0.0
    # PlacementConfig.place_tie: a new prefix's options within this x its own prefill of the cheapest
    # are ties decided by headroom (prefixes held); None: the policy's default
    router_place_tie: float | None = None
    router_prefix_fill: float | None = None  # PlacementConfig.prefix_fill (None: its default; 1: off)
    # any other PlacementConfig fields, (name, value) pairs applied last (AppSettings.router_placement)
    router_placement: tuple[tuple[str, object], ...] = ()
    probe_interval_s: float = 30.0  # light link probes between workers on different nodes (0: off)
    health_interval_s: float = 2.0  # engine/actor death watch per worker (0: off); its retry delay
    health_timeout_s: float = 10.0  # a slower answer is not a death (unreachable != dead)

    def placement(self) -> PlacementConfig:
        """The placement rules of the router this pool creates."""
        off: dict = {} if self.router_idle_spill else {"idle_slack": 0.0}
        if not self.router_spill_needs_share:
            off["spill_share_margin"] = None
        if self.router_balance_ratio:
            off["balance_ratio"] = self.router_balance_ratio
        if self.router_place_tie is not None:
            off["place_tie"] = self.router_place_tie
        if self.router_prefix_fill is not None:
            off["prefix_fill"] = self.router_prefix_fill
        off.update(self.router_placement)
        return PlacementConfig(**off)


def resolve_pool_config(config: PoolConfig, cluster_gpus: float | None = None) -> PoolConfig:
    """``config`` with ``worker_num_gpus`` (and an auto device/dtype) fixed against
    ``cluster_gpus`` (default: the running cluster's GPU count, read once here)."""
    if config.worker_num_gpus is not None and not (config.auto_device or config.auto_dtype):
        return config
    gpus = config.worker_num_gpus
    if gpus is None:
        if cluster_gpus is None:
            cluster_gpus = ray.cluster_resources().get("GPU", 0) if ray.is_initialized() else 0
        gpus = 1 if cluster_gpus >= 1 else 0
    engine = config.engine
    if config.auto_device:
        engine = dataclasses.replace(engine, device="cuda" if gpus else "cpu")
    if config.auto_dtype:
        engine = dataclasses.replace(engine, dtype="float32" if engine.device == "cpu" else "bfloat16")
    return dataclasses.replace(config, engine=engine, worker_num_gpus=gpus, auto_device=False, auto_dtype=False)


class WorkerPool:
    """Owns the worker actors. Call ``start()`` inside a running event loop; ``close()`` kills
    the workers."""

    def __init__(self, config: PoolConfig, router: Router | None = None):
        self.config = config
        self.router: Router = router or LeastLoadedRouter()
        self.autoscaler = TenantAutoscaler(config.autoscale, dict(config.shares))
        self.workers: dict[str, WorkerState] = {}
        self.last_decision: ScaleDecision | None = None
        self._flights: dict[str, InFlight] = {}
        self._ids = itertools.count()
        self._ready = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self._loop_task: asyncio.Task | None = None
        self._actor_cls = None
        self._index = self._router_actor = self._router_client = None
        self._router_cost = None  # CostConfig the router actor was created with (a replacement gets the same)
        self._closing = self._router_replacing = False
        self._synced_nodes: dict[str, str] = {}  # what the router actor was last told (sync_router)
        self._synced_at = float("-inf")
        self.error: str | None = None
        self.routed: Counter[str] = Counter()  # requests routed per worker
        self.decisions: Counter[str] = Counter()  # by planned route: local | pulled | recomputed

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self, autoscale: bool = True) -> None:
        self.config = resolve_pool_config(self.config)  # no-op when the controller resolved it
        gpus = self.config.worker_num_gpus
        self._actor_cls = worker_actor_class(num_gpus=gpus, num_cpus=self.config.worker_num_cpus)
        if self.config.cost_aware_routing:
            from actors.index_actor import get_or_create_index

            self._index = await asyncio.to_thread(get_or_create_index, self.config.engine.block_size)
        decision = self.autoscaler.decide(0, {}, time.monotonic())
        await self._apply(ScaleDecision(max(1, decision.target), decision.allocation))
        if autoscale:
            self._loop_task = asyncio.create_task(self._autoscale_loop())
        if self.config.cost_aware_routing and self.config.probe_interval_s > 0:
            task = asyncio.create_task(self._probe_loop())
            self._tasks.add(task)

    async def wait_ready(self, timeout: float | None = None) -> bool:
        try:
            await asyncio.wait_for(self._ready.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    async def close(self) -> None:
        """Stop the pool's loops, kill its workers and its router actor, and return once Ray
        reports each of them dead (at most ``CLOSE_WAIT_S``). ``ray.kill`` only asks for the
        kill: the actor goes on answering calls until its process has gone, and the controller
        exits right after ``close``, so whoever sees the controller gone may take its workers
        and router to be gone too."""
        self._closing = True
        if self._loop_task is not None:
            self._loop_task.cancel()
        for t in list(self._tasks):
            t.cancel()
        doomed = [w.actor for w in self.workers.values()]
        for w in list(self.workers.values()):
            self._kill(w)
        if self._router_actor is not None:  # ours (its owner); killed now, not when the owner's death
            try:                             # reaches it (asynchronous: it answered calls meanwhile)
                ray.kill(self._router_actor, no_restart=True)
                doomed.append(self._router_actor)
            except Exception as e:  # noqa: BLE001 - already gone
                log.debug("router kill failed: %r", e)
            self._router_actor = self._router_client = None
        await _until_dead(doomed, CLOSE_WAIT_S)

    def model_info(self) -> dict | None:
        """``ready()`` of any ready worker (model name, max_model_len, block size)."""
        for w in self.workers.values():
            if w.info is not None and not w.dead:
                return w.info
        return None

    # -- workers -----------------------------------------------------------------------------
    def _spawn(self) -> WorkerState:
        n = next(self._ids)
        wid = f"{self.config.app}-w{n}" if self.config.app else f"w{n}"
        actor = self._actor_cls.remote(wid, self.config.engine)
        ws = WorkerState(wid, actor)
        self.workers[wid] = ws
        task = asyncio.create_task(self._await_ready(ws))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return ws

    async def _await_ready(self, ws: WorkerState) -> None:
        try:
            info = await asyncio.wait_for(_aref(ws.actor.ready.remote()), self.config.ready_timeout_s)
            samples = await self._calibrate(ws) if self.config.cost_aware_routing else []
            ws.info = info  # routable from here on
            if self.config.cost_aware_routing:
                await self._join_cluster_routing(ws)
                for n, seconds in samples:  # the router prices its first requests with its own speed
                    self._report_prefill(ws, (n, seconds, 0))
            if self.config.health_interval_s > 0:
                self._spawn_task(self._watch_worker(ws))
            self._ready.set()
            log.info("worker %s ready: %s", ws.worker_id, ws.info)
        except Exception as e:  # noqa: BLE001 - any failure: the worker is unusable
            self.error = f"worker {ws.worker_id} failed to start: {e!r}"
            log.error(self.error)
            self._mark_dead(ws)

    async def _calibrate(self, ws: WorkerState) -> list[tuple[int, float]]:
        """The worker's timed prefills (``Worker.calibrate``) before it is routable, when
        ``PoolConfig.calibrate_prefill``; none if it cannot (an older worker, a timeout): the
        router's fit then starts from its prior, as before."""
        if not self.config.calibrate_prefill:
            return []
        try:
            return list(await asyncio.wait_for(_aref(ws.actor.calibrate.remote()), self.config.ready_timeout_s))
        except Exception as e:  # noqa: BLE001 - never keeps a worker from serving
            log.warning("worker %s: prefill calibration skipped (%s)", ws.worker_id, describe_exc(e))
            return []

    async def _join_cluster_routing(self, ws: WorkerState) -> None:
        """Publish the worker's blocks to the index, let it report measurements to the router,
        and switch the pool to cost-aware routing once the model id is known."""
        from actors.router import RouterClient, get_or_create_router
        from policies.routing import CostConfig

        if self._router_actor is None:  # the first ready worker tells the KV size per token
            self._router_cost = CostConfig(block_size=ws.info["block_size"], bytes_per_token=ws.info["kv_bytes_per_token"],
                                           learn_decode=self.config.router_learn_decode,
                                           pull_overlaps_wait=self.config.engine.import_hold_s > 0)
            self._router_actor = await asyncio.to_thread(get_or_create_router, self._router_cost, False,
                                                         self.config.app or None)
            self._router_client = RouterClient(self._router_actor, timeout_s=ROUTE_TIMEOUT_S,
                                               flush_s=ROUTER_FLUSH_S)
            self._router_client.on_restart = self._router_restarted
            self._router_client.on_dead = self._router_died
        await _aref(ws.actor.start_index_publisher.remote())
        await _aref(ws.actor.attach_router.remote(self._router_actor, False))
        self._router_client.report("register", ws.worker_id, ws.info["node_id"])
        if not isinstance(self.router, CostAwareRouter):
            self.router = CostAwareRouter(ws.info["model_id"], ws.info["block_size"], self._index,
                                          self._router_client, self.workers.get, timeout_s=ROUTE_TIMEOUT_S,
                                          placement=self.config.placement(), kv_memory=self.config.router_kv_memory,
                                          max_candidates=self.config.router_max_candidates)

    async def check_health(self) -> list[str]:
        """Ask every ready worker for its health; retire (and replace) those whose engine died.
        A worker that is slow or unreachable stays (it may recover). Returns the retired ids."""
        ready = [w for w in self.workers.values() if w.info is not None and not w.dead]

        async def one(w: WorkerState):
            try:
                await asyncio.wait_for(_aref(w.actor.health.remote()), self.config.health_timeout_s)
                return None
            except (EngineDead, ray.exceptions.ActorDiedError) as e:
                return e
            except Exception:  # noqa: BLE001 - slow or unreachable: not (yet) a death
                return None

        results = await asyncio.gather(*(one(w) for w in ready))
        gone = []
        for w, err in zip(ready, results):
            if err is not None and w.worker_id in self.workers:
                self.retire(w, _first_line(err))
                gone.append(w.worker_id)
        return gone

    async def _watch_worker(self, ws: WorkerState) -> None:
        """The worker's health without polling: one ``Worker.watch_engine`` call stays pending
        (the worker checks its engine locally every 0.5 s) and fails with ``EngineDead`` when the
        engine loop dies, or ``ActorDiedError`` when the actor does: then the worker is retired
        (and replaced). Anything else (slow, unreachable: not a death) re-arms the watch after
        ``health_interval_s``. Ends when the worker leaves the pool. (It used to ask every ready
        worker's ``health`` every ``health_interval_s``: 0.5 calls/s per worker, each a hop onto
        the engine thread, idle or not.)"""
        while self.workers.get(ws.worker_id) is ws and not ws.dead:
            try:
                await _aref(ws.actor.watch_engine.remote())
                err = None
            except asyncio.CancelledError:
                raise
            except (EngineDead, ray.exceptions.ActorDiedError) as e:
                err = e
            except Exception:  # noqa: BLE001 - slow or unreachable: not (yet) a death
                err = None
            if err is not None:
                if self.workers.get(ws.worker_id) is ws:
                    self.retire(ws, _first_line(err))
                return
            await asyncio.sleep(self.config.health_interval_s)

    def _spawn_task(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def retire(self, ws: WorkerState, why: str) -> None:
        """``ws`` can serve nothing any more (its engine died): kill it and start a replacement
        when the pool is below its target. Its in-flight requests already failed (EngineDead)."""
        log.error("worker %s is unhealthy (%s): replacing it", ws.worker_id, why)
        self.error = f"worker {ws.worker_id} was replaced: {why}"
        was_draining = ws.draining
        self._mark_dead(ws)
        target = self.last_decision.target if self.last_decision is not None else 1
        if not was_draining and len(self.active()) < max(1, target) and self._actor_cls is not None:
            self._spawn()  # (a pool never started, e.g. over fake workers in tests, spawns nothing)

    def _mark_dead(self, ws: WorkerState) -> None:
        ws.dead = True
        self._kill(ws)

    def _kill(self, ws: WorkerState) -> None:
        self.workers.pop(ws.worker_id, None)
        if isinstance(self.router, CostAwareRouter):
            self.router.remove(ws.worker_id)
        if self.config.cost_aware_routing and self._router_client is not None:
            self._router_client.report("remove", ws.worker_id)
        try:
            ray.kill(ws.actor)
        except Exception:  # noqa: BLE001 - already gone
            pass
        if not any(w.info is not None for w in self.workers.values()):
            self._ready.clear()

    def active(self) -> list[WorkerState]:
        """Workers counted toward the target: starting or ready, not draining."""
        return [w for w in self.workers.values() if not w.draining and not w.dead]

    # -- autoscaling -------------------------------------------------------------------------
    def demand(self) -> dict[str, TenantDemand]:
        """Per tenant: queued = prompt + max_tokens of requests without output yet;
        running = output tokens still allowed for started requests."""
        queued: dict[str, int] = {}
        running: dict[str, int] = {}
        for f in self._flights.values():
            if f.started:
                running[f.tenant] = running.get(f.tenant, 0) + max(0, f.max_tokens - f.output_tokens)
            else:
                queued[f.tenant] = queued.get(f.tenant, 0) + f.cost
        return {t: TenantDemand(queued.get(t, 0), running.get(t, 0)) for t in set(queued) | set(running)}

    async def autoscale_once(self, now: float | None = None) -> ScaleDecision:
        now = time.monotonic() if now is None else now
        decision = self.autoscaler.decide(len(self.active()), self.demand(), now)
        await self._apply(decision)
        return decision

    async def _probe_loop(self) -> None:
        """Every ``probe_interval_s`` each ready worker probes the others on other nodes, so the
        router knows links before the first pull over them (fire and forget)."""
        while True:
            await asyncio.sleep(self.config.probe_interval_s)
            ready = [w for w in self.workers.values() if w.routable]
            peers = [(w.info["node_id"], w.actor) for w in ready]
            if len({n for n, _ in peers}) < 2:
                continue
            for w in ready:
                w.actor.probe.remote([p for p in peers if p[0] != w.info["node_id"]])

    async def _autoscale_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.autoscale.interval_s)
            try:
                await self.autoscale_once()
            except Exception:  # noqa: BLE001 - keep scaling on the next tick
                log.exception("autoscale tick failed")
            self.sync_router()

    async def router_estimates(self, timeout_s: float = 5.0) -> dict | None:
        """The router actor's estimates (``Router.estimates``: per link bandwidth and RTT, per worker
        the prefill fit (seconds: fixed, per 1024 new tokens, per 1024**2 attention units), expected
        wait and decode step); None without a router or when it does not answer within ``timeout_s``."""
        if self._router_client is None:
            return None
        try:
            ref = self._router_client.handle.estimates.remote()
            est = await asyncio.wait_for(asyncio.wrap_future(ref.future()), timeout_s)
        except Exception as e:  # noqa: BLE001 - an introspection call: report the router as unknown
            log.debug("router estimates failed: %r", e)
            return None
        if est is not None:
            est["prefill"] = {w: {"fixed_s": a, "per_1k_tokens_s": b, "per_1k2_attention_s": c}
                              for w, (a, b, c) in est.get("prefill", {}).items()}
        return est

    def sync_router(self, force: bool = False) -> None:
        """Tell the router actor every routable worker's node when that set changed since the
        last sync, or ``force`` (fire and forget): a router that was restarted after its process
        died knows none of them (it would price every pull as cross-node and report no worker's
        estimates). A restart shows as a new epoch in the router's next answer, which forces a
        sync (``_router_restarted``); the tick no longer sends one every second regardless, only
        every ``ROUTER_RESYNC_S`` as a safety net."""
        if self._router_client is not None:
            nodes = {w.worker_id: w.info["node_id"] for w in self.workers.values() if w.routable}
            now = time.monotonic()
            if nodes and (force or nodes != self._synced_nodes or now - self._synced_at >= ROUTER_RESYNC_S):
                self._synced_nodes, self._synced_at = nodes, now
                self._router_client.report("sync_workers", nodes)

    def _router_died(self) -> None:
        """The router actor is dead for good (killed with ``no_restart``, e.g. by an older pool of
        this app closing while this one started, or out of restarts): routing has fallen back to
        power of two choices. Create a new one (``_replace_router``) unless the pool is closing."""
        if self._closing or self._router_replacing:
            return
        log.warning("router actor of app %r is dead: creating a new one", self.config.app)
        self._router_replacing = True
        self._spawn_task(self._replace_router())

    async def _replace_router(self, attempts: int = 40, retry_s: float = 0.5) -> None:
        """Get the app's router actor anew (its name may still point at the dead one for a moment:
        retried until it does not), hand it to the router client and to every worker, and
        re-register the workers (``_router_restarted``)."""
        from actors.router import get_or_create_router

        try:
            dead = getattr(self._router_actor, "_actor_id", None)
            for _ in range(attempts):
                actor = await asyncio.to_thread(get_or_create_router, self._router_cost, False,
                                                self.config.app or None)
                if getattr(actor, "_actor_id", None) != dead:
                    break
                await asyncio.sleep(retry_s)
            else:
                log.error("no new router actor for app %r: routing stays on power of two choices", self.config.app)
                return
            if self._closing:
                return
            self._router_actor = actor
            self._router_client.replace(actor)
            for w in [w for w in self.workers.values() if w.info is not None and not w.dead]:
                try:
                    await asyncio.wait_for(_aref(w.actor.attach_router.remote(actor, False)), 10)
                except Exception as e:  # noqa: BLE001 - a dead worker is replaced (and attached) anyway
                    log.warning("worker %s did not take the new router: %r", w.worker_id, e)
            self._router_restarted()
        finally:
            self._router_replacing = False

    def _router_restarted(self) -> None:
        """The router actor came back empty: re-register the workers, resend the loads and replay
        each worker's last prefill samples (its calibration among them), so that the new router
        prices its first requests with the workers' measured speed instead of its prior."""
        log.warning("router actor restarted: re-registering %d workers", len(self.workers))
        if isinstance(self.router, CostAwareRouter):
            self.router.forget_published()
        self.sync_router(force=True)
        for ws in self.workers.values():
            if ws.routable:
                for sample in ws.prefill_samples:
                    self._router_client.report("report_prefill", ws.worker_id, *sample)

    def _report_prefill(self, ws: WorkerState, sample: tuple[int, float, int]) -> None:
        """Report a measured prefill ``(computed tokens, seconds, cached tokens)`` of ``ws`` to
        the router and keep it for a replay (``_router_restarted``)."""
        ws.prefill_samples.append(tuple(sample))
        self._router_client.report("report_prefill", ws.worker_id, *sample)

    async def _apply(self, decision: ScaleDecision) -> None:
        self.last_decision = decision
        active = self.active()
        if decision.target > len(active):
            for _ in range(decision.target - len(active)):
                self._spawn()
        elif decision.target < len(active):
            # drain the least useful: still starting, then shared, then least loaded
            order = sorted(active, key=lambda w: (w.info is not None, w.tenant is not None, w.inflight, w.worker_id))
            for w in order[: len(active) - decision.target]:
                w.draining, w.tenant = True, None
        for w in [w for w in self.workers.values() if w.draining and w.inflight == 0]:
            self._kill(w)
        self._assign(dict(decision.allocation))

    def _assign(self, allocation: dict[str, int]) -> None:
        """Keep existing assignments up to each tenant's allocation; fill the rest from shared
        workers, tenants in name order. Unallocated workers are shared."""
        active = sorted(self.active(), key=lambda w: w.worker_id)
        kept: dict[str, int] = {}
        for w in active:
            if w.tenant is not None:
                if kept.get(w.tenant, 0) < allocation.get(w.tenant, 0):
                    kept[w.tenant] = kept.get(w.tenant, 0) + 1
                else:
                    w.tenant = None
        free = [w for w in active if w.tenant is None]
        for tenant in sorted(allocation):
            for _ in range(allocation[tenant] - kept.get(tenant, 0)):
                if not free:
                    return
                free.pop(0).tenant = tenant

    def assignment(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for w in self.active():
            out.setdefault(w.tenant or "", []).append(w.worker_id)
        return out

    # -- requests ----------------------------------------------------------------------------
    def candidates(self, tenant: str) -> list[WorkerState]:
        """A tenant's own workers, the unassigned (shared) ones and the workers of other tenants
        that may be lent now (``lendable``); without any of these: any. (Own workers alone left
        shared workers idle while the tenant queued on its one assigned worker; and once every
        worker was assigned (4 tenants with demand on 4 workers: one each) each tenant was confined
        to its one worker, its KV computed elsewhere before the assignment reachable only by a pull,
        while a tenant with no worker of its own could use all four: the cluster bench's
        multi-tenant workload, session 20.) An assignment guarantees a tenant its workers; it does
        not fence the others out of them while they have room."""
        ready = [w for w in self.workers.values() if w.routable]
        own = [w for w in ready if w.tenant == tenant]
        shared = [w for w in ready if w.tenant is None]
        lent = [w for w in ready if w.tenant not in (None, tenant) and self.lendable(w)]
        return own + shared + lent or ready

    def lendable(self, w: WorkerState) -> bool:
        """Whether another tenant's request may go to ``w`` (assigned to a tenant) now:
        ``PoolConfig.lend_workers`` "unqueued": no request waits there for its first token (its
        owner's requests are all decoding, or none is there), so a guest is let in only while
        nobody waits, and at most one guest's prefill is ahead of an owner's request that arrives
        next (a request of the owner's own would be as much); "idle": nothing in flight there
        (session 20); "never": an assignment fences the others out."""
        mode = self.config.lend_workers
        return (mode == "unqueued" and not w.queued) or (mode == "idle" and w.inflight == 0)

    def hit_loan(self, tenant: str, candidates: Sequence[WorkerState]) -> HitLoan:
        """The workers ``candidates`` leaves out (other tenants' and not lendable now), open to a
        request of ``tenant`` that finds its prompt there (``HitLoan``, ``PoolConfig.lend_hit_tokens``)."""
        n = self.config.lend_hit_tokens
        if n <= 0 or self.config.lend_workers == "never":
            return NO_LOAN
        taken = {w.worker_id for w in candidates}
        fenced = tuple(w for w in self.workers.values()
                       if w.routable and w.tenant not in (None, tenant) and w.worker_id not in taken)
        return HitLoan(fenced, n) if fenced else NO_LOAN

    async def acquire(self, request: Request, ready_timeout_s: float = 60.0) -> tuple[WorkerState, RouteChoice]:
        """Route a request and count it on the chosen worker: it stays in flight (demand, the
        worker's ``inflight``) until ``release``. On any error nothing stays counted."""
        rid = request.request_id
        if rid in self._flights:
            raise InvalidRequest(f"request id {rid!r} is already in flight")
        flight = InFlight(request.tenant, "", len(request.prompt_ids), request.params.max_tokens)
        self._flights[rid] = flight  # demand while we wait (scale from zero) and choose
        try:
            if not self._ready.is_set() and not await self.wait_ready(ready_timeout_s):
                raise WorkerUnavailable(self.error or "no worker is ready yet")
            t0 = time.perf_counter()
            for _ in range(ROUTE_ATTEMPTS):
                cands = self.candidates(request.tenant)
                if not cands:
                    raise WorkerUnavailable(self.error or "no worker is ready")
                loan = self.hit_loan(request.tenant, cands)
                choice = await self.router.choose(request, cands, loan)
                ws = self.workers.get(choice.worker_id)
                if (ws is not None and ws.tenant not in (None, request.tenant) and not self.lendable(ws)
                        and not loan.covers(choice.cached_tokens, len(request.prompt_ids))):
                    # lent, then taken by another request while the router chose: the choice again
                    # among the tenant's own and shared workers (if any; else it stays)
                    rest = [w for w in cands if w.tenant in (None, request.tenant)]
                    if rest:
                        choice = await self.router.choose(request, rest)
                        ws = self.workers.get(choice.worker_id)
                if ws is not None and ws.routable:
                    break
                # the chosen worker died or began draining while the router chose (a dead worker's
                # stream retires it at once; other requests were being routed meanwhile): again,
                # among the workers left (a fault probe: 5 of 10 requests sent as a worker died
                # were 503s "router chose unavailable worker")
            else:
                raise WorkerUnavailable(f"router chose unavailable worker {choice.worker_id!r}")
            guest = self.config.guests_yield and ws.tenant not in (None, request.tenant)
            choice = dataclasses.replace(choice, route_s=time.perf_counter() - t0, guest=guest)
        except BaseException:
            self._flights.pop(rid, None)
            raise
        flight.worker_id, flight.route, flight.expected_ttft_s = ws.worker_id, choice.route, choice.expected_ttft_s
        flight.running_at_route = -1 if choice.memory_bound else ws.running
        flight.decode_wait_s = choice.decode_wait_s
        ws.inflight += 1
        ws.inflight_tokens += flight.cost
        ws.queued[rid] = max(0, flight.prompt_tokens - choice.cached_tokens)
        flight.cached_tokens, flight.blocks = choice.cached_tokens, choice.blocks
        ws.flights[rid] = flight
        self.routed[ws.worker_id] += 1
        self.decisions[choice.route] += 1
        return ws, choice

    def mark_started(self, request_id: str, route: str | None, ttft_s: float | None, output_tokens: int = 1,
                     prefill: tuple | None = None) -> None:
        """The request's first output arrived ``ttft_s`` after dispatch: report the router's
        prediction error and the worker's measured prefill (``prefill_sample``) once, and count
        the request as running. (The pool reports prefills, not the workers: the sample then
        rides on the router's next ranking instead of costing a call of its own.)"""
        f = self._flights.get(request_id)
        if f is None:
            return
        if not f.started:
            ws = self.workers.get(f.worker_id)
            if self._router_client is not None:
                if f.expected_ttft_s is not None and ttft_s is not None:
                    self._router_client.report("report_outcome", route or f.route, f.expected_ttft_s, ttft_s,
                                               f.worker_id, f.running_at_route, f.decode_wait_s)
                if prefill is not None and ws is not None:
                    self._report_prefill(ws, prefill)
            f.started_at = time.monotonic()
            if ws is not None and ws.queued.pop(request_id, None) is not None:
                f.rows_mark = ws.tick(f.started_at)
                ws.running += 1
        f.output_tokens = max(f.output_tokens, output_tokens)

    def progress(self, request_id: str, output_tokens: int) -> None:
        """Output tokens produced so far (running demand shrinks as a request nears max_tokens)."""
        f = self._flights.get(request_id)
        if f is not None:
            f.output_tokens = max(f.output_tokens, output_tokens)

    def release(self, request_id: str, worker_dead: bool = False, output_tokens: int | None = None) -> None:
        """End an ``acquire``d request (idempotent). ``worker_dead``: its worker died mid-stream;
        ``output_tokens``: what it produced (default: the last progress reported). A request with
        two or more output tokens teaches the worker's seconds per output token and output size
        (``WorkerState.tpot_s``, ``output_tokens``: the router's KV memory signal)."""
        f = self._flights.pop(request_id, None)
        ws = self.workers.get(f.worker_id) if f is not None and f.worker_id else None
        if ws is None:
            return
        ws.flights.pop(request_id, None)
        out = max(f.output_tokens, output_tokens or 0)
        now = time.monotonic()
        rows = ws.tick(now)
        if f.started and out >= 2 and not worker_dead:
            a = LIFETIME_ALPHA
            tpot = (now - f.started_at) / (out - 1)
            ws.tpot_s = tpot if ws.tpot_s is None else (1 - a) * ws.tpot_s + a * tpot
            ws.output_tokens = out if ws.output_tokens is None else (1 - a) * ws.output_tokens + a * out
            if isinstance(self.router, CostAwareRouter) and now > f.started_at:
                self.router.observe_tpot((rows - f.rows_mark) / (now - f.started_at), tpot)
        ws.inflight -= 1
        ws.inflight_tokens -= f.cost
        if ws.queued.pop(request_id, None) is None and f.started:
            ws.running -= 1
        if worker_dead:
            self.retire(ws, "its stream failed: the actor or its engine died")
        elif ws.draining and ws.inflight == 0:
            self._kill(ws)

    async def generate(self, request: Request, ready_timeout_s: float = 60.0
                       ) -> AsyncIterator[tuple[WorkerState, RouteChoice, RequestOutput]]:
        """Stream a request's outputs from the chosen worker. Closing the iterator early cancels
        the request on the worker (its blocks are freed)."""
        t0 = time.perf_counter()
        ws, choice = await self.acquire(request, ready_timeout_s)
        choice = dataclasses.replace(choice, lease_s=time.perf_counter() - t0)
        dead = False
        t_start = time.monotonic()
        try:
            async with contextlib.aclosing(stream_outputs(ws.actor, ws.worker_id, request, choice)) as outs:
                async for out in outs:
                    self.mark_started(request.request_id, out.route, time.monotonic() - t_start, out.num_output_tokens,
                                      prefill=prefill_sample(out))
                    yield ws, choice, out
        except WorkerDied:
            dead = True
            raise
        finally:
            self.release(request.request_id, worker_dead=dead)

    # -- introspection -----------------------------------------------------------------------
    async def stats(self, timeout_s: float = 2.0) -> list[dict]:
        """Per worker: the pool's view plus the engine's stats (None if it did not answer within
        ``timeout_s``; the workers are asked concurrently, so the whole call takes <= ``timeout_s``)."""
        workers = list(self.workers.values())

        async def one(w: WorkerState) -> dict | None:
            if w.info is None:
                return None
            try:
                return await asyncio.wait_for(_aref(w.actor.stats.remote()), timeout_s)
            except Exception:  # noqa: BLE001 - report what we know
                return None

        engines = await asyncio.gather(*(one(w) for w in workers))
        return [{"worker_id": w.worker_id, "tenant": w.tenant, "ready": w.info is not None, "draining": w.draining,
                 "inflight": w.inflight, "tpot_s": w.tpot_s, "output_tokens": w.output_tokens, "engine": s}
                for w, s in zip(workers, engines)]

    async def router_metrics(self, timeout_s: float = 2.0) -> dict:
        """Routing counts for ``/metrics``: decisions by planned route, placements by rule and
        requests per worker (kept here, so they show whatever the router actor does), plus the
        router actor's bytes pulled, pull failures and TTFT errors when it answers within
        ``timeout_s``."""
        out: dict = {"decisions": dict(self.decisions), "routed": dict(self.routed),
                     "placements": dict(getattr(self.router, "placements", {}) or {})}
        groups = getattr(self.router, "groups", None)
        if groups is not None:
            out["groups"] = groups()
        if isinstance(self.router, CostAwareRouter):
            out["decode_row_s"] = self.router.row_s
        if self._router_client is not None:
            try:
                actor = await asyncio.wait_for(_aref(self._router_client.handle.metrics.remote()), timeout_s)
            except Exception:  # noqa: BLE001 - slow or gone: show what the pool knows
                actor = None
            if actor:
                out.update({k: v for k, v in actor.items() if k != "decisions"})
        return out

    def queue_depth(self) -> dict[str, int]:
        """Per tenant: requests admitted but without their first token yet."""
        out: dict[str, int] = {}
        for f in self._flights.values():
            if not f.started:
                out[f.tenant] = out.get(f.tenant, 0) + 1
        return out


async def stream_outputs(actor, worker_id: str, request: Request, choice: RouteChoice) -> AsyncIterator[RequestOutput]:
    """A routed request's outputs, straight from its worker actor. Closing the iterator before
    the last output cancels the worker's generator and aborts the request there (its blocks are
    freed). A dead worker (``ActorDiedError``) raises ``WorkerDied``; an unreachable one (any other
    ``RayActorError``, e.g. ``ActorUnavailableError`` on a network blip: it may recover) raises
    ``WorkerUnavailable``, so the caller fails the request but keeps the worker."""
    finished = False
    if choice.guest:
        request = dataclasses.replace(request, guest=True)
    gen = actor.generate.remote(request, choice.pulls, choice.donor_pulls)
    refs = aiter(gen)
    try:
        while True:
            try:
                ref = await anext(refs)
                out: RequestOutput = await ref
            except StopAsyncIteration:
                return
            except ray.exceptions.ActorDiedError as e:  # Ray's text (actor id, pid, address) stays in the log
                log.warning("worker %s died while streaming request %s: %s", worker_id, request.request_id, e)
                raise WorkerDied(f"worker {worker_id} died; retry the request") from None
            except EngineDead as e:  # the actor lives but its engine loop died: as good as dead
                raise WorkerDied(f"the engine of worker {worker_id} died; retry the request ({_first_line(e)})") from None
            except ray.exceptions.RayActorError as e:
                log.warning("worker %s unreachable while streaming request %s: %s", worker_id, request.request_id, e)
                raise WorkerUnavailable(f"worker {worker_id} is unreachable; retry the request") from None
            finished = out.finished
            yield out
            if finished:
                return
    finally:
        if not finished:
            try:
                ray.cancel(gen)
            except Exception:  # noqa: BLE001 - already finished or gone
                pass
            try:
                actor.abort.remote(request.request_id)  # fire and forget
            except Exception:  # noqa: BLE001 - worker gone: nothing to free
                pass


def prefill_sample(out: RequestOutput) -> tuple[int, float, int] | None:
    """``(computed prompt tokens, prefill seconds, cached tokens)`` of a request's output that
    carries its measured prefill (the first one), else None: ``Router.report_prefill``'s args."""
    if out.prefill_s is None:
        return None
    return (out.num_prompt_tokens - out.num_cached_tokens, out.prefill_s, out.num_cached_tokens)


async def _aref(ref):
    return await ref


async def _until_dead(actors: list, timeout_s: float) -> None:
    """Return once every actor of ``actors`` (killed already) fails a call with
    ``ActorDiedError``, or after ``timeout_s``. An answer means it still runs: asked again."""
    async def one(actor) -> None:
        while True:
            try:
                await actor.__ray_ready__.remote()
            except ray.exceptions.ActorDiedError:
                return
            except ray.exceptions.ActorUnavailableError:  # unreachable for now: not dead yet
                pass
            except Exception:  # noqa: BLE001 - not an actor handle (tests' fakes): nothing to wait for
                return
            await asyncio.sleep(0.05)

    if actors:
        try:
            await asyncio.wait_for(asyncio.gather(*(one(a) for a in actors)), timeout_s)
        except asyncio.TimeoutError:
            log.warning("some of %d killed actors still answered after %.0f s", len(actors), timeout_s)


def _first_line(e: BaseException) -> str:
    lines = [x for x in str(e).splitlines() if x.strip()]
    return lines[-1][:200] if lines else type(e).__name__
