"""The baselines a user would deploy instead of kvmesh: the same engine as plain Serve replicas.

``serve run cluster/serve-pow2.yaml`` or ``cluster/serve-affinity.yaml`` (``import_path:
cluster.baselines:build_app``, the same ``args`` as ``cluster/serve.yaml``). Each worker is one
``EngineReplica`` (a Serve deployment wrapping ``engine.async_engine.AsyncEngine``: same model,
``kv_cache_bytes``, engine limits and CPUs per replica as a kvmesh worker), each with its own
prefix cache and no cross-replica index, pulls or replication. Requests reach a replica through a
Serve handle, so the deployment's ``request_router_config`` picks the replica:
  * none (Serve's default): power of two choices on queue length (``serve-pow2.yaml``);
  * ``PrefixCacheAffinityRouter`` (``ray.llm._internal.serve.routing_policies.prefix_aware.
    prefix_aware_router``, Ray's own class, ``serve-affinity.yaml``): a character prefix tree of
    the prompts it routed, highest match when load is balanced, the replica with the smallest
    tree below a 10% match.

The front end is kvmesh's own ingress (``cluster.app.KvmeshIngress``: auth, validation, chat
template, tokenizing, the OpenAI responses, ``usage.prompt_tokens_details.cached_tokens`` and
``kvmesh.worker``), with only its request path swapped (``_open_pool``): no controller, no
tenant admission limits or autoscaling; ``kvmesh.worker`` is the replica id and ``route`` is
``local`` (cached prefix) or ``recomputed``. ``PrefixCacheAffinityRouter`` reads the prompt text
from the handle call's argument (an object with ``.prompt``): ``EngineCall.prompt`` is the
request's prompt decoded from its token ids (for chat: the chat-templated text), which keeps
the prefix relations the router keys on.
"""

# No `from __future__ import annotations`: FastAPI must see the real annotations of the routes.
import asyncio
import dataclasses
import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI
from fastapi.routing import APIRoute
from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

import cluster.app as kvmesh_app
from actors.head_affinity import ingress_actor_options
from cluster.app import AppSettings, pool_config
from cluster.pool import resolve_pool_config
from cluster.types import RouteChoice
from engine.llm_engine import EngineConfig
from engine.sequence import Request, RequestOutput
from policies.tenancy import read_tenants_file, tenants_path

log = logging.getLogger(__name__)

AFFINITY_ROUTER = ("ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router:"
                   "PrefixCacheAffinityRouter")
ROUTERS = ("pow2", "affinity")


@dataclass(frozen=True)
class EngineCall:
    """The argument of ``EngineReplica.generate``. ``prompt`` is what Ray's
    ``PrefixCacheAffinityRouter`` reads (``arg.prompt``, a string); ``request`` is what the engine
    runs (token ids, sampling, tenant domain)."""

    prompt: str
    request: Request


@serve.deployment(max_ongoing_requests=64, ray_actor_options={"num_cpus": 1})
class EngineReplica:
    """One engine per replica, its own prefix cache. ``generate`` streams ``(replica id, output)``."""

    def __init__(self, engine: EngineConfig):
        from engine.async_engine import AsyncEngine

        self.engine = AsyncEngine(engine)
        self.replica_id = serve.get_replica_context().replica_id.unique_id

    def ready(self) -> dict:
        e = self.engine.engine
        return {"worker_id": self.replica_id, "model": e.loaded.name, "max_model_len": e.max_model_len,
                "block_size": e.config.block_size}

    async def generate(self, call: EngineCall):
        async for out in self.engine.generate(call.request):
            yield self.replica_id, dataclasses.replace(out, route="local" if out.num_cached_tokens else "recomputed")

    def __del__(self):
        self.engine.shutdown()


@dataclass(frozen=True)
class _Replica:
    worker_id: str  # what the ingress reads of the "worker state" it is handed


class ServePool:
    """The ingress's request path over an ``EngineReplica`` handle: the controller client's
    interface (``connect``, ``wait_ready``, ``call``, ``generate``, ``close``) without a controller.
    Counts are this ingress replica's own (requests routed per replica id)."""

    def __init__(self, handle, decode):
        self.handle = handle
        self.decode = decode  # token ids -> text (the prompt the affinity router matches)
        self.info: dict | None = None
        self.routed: Counter[str] = Counter()
        self.inflight: Counter[str] = Counter()
        self.templates: dict[tuple[str, str], str] = {}

    async def connect(self) -> None:
        return None

    async def wait_ready(self, timeout_s: float) -> dict:
        self.info = await asyncio.wait_for(self.handle.ready.remote(), timeout_s)
        return self.info

    async def close(self) -> None:
        return None

    async def call(self, method: str, *args):
        if method == "health":
            return {"workers": 1 if self.info else 0, "ready": 1 if self.info else 0, "error": None}
        if method == "metrics_snapshot":
            return {"queue_depth": {}, "inflight": {t: n for t, n in self.inflight.items() if n},
                    "states": {"ready": len(self.routed)}, "assigned": {}, "router": {"routed": dict(self.routed)}}
        if method == "workers_view":
            return {"workers": [{"worker_id": w, "routed": n} for w, n in sorted(self.routed.items())],
                    "target": None, "allocation": {}}
        if method == "template":
            return self.templates.get((args[0], args[1]))
        if method == "register_template":
            self.templates[(args[0], args[1])] = args[2]
            return None
        raise AttributeError(f"the baseline front end has no {method!r}")

    async def generate(self, request: Request):
        """``(worker, planned route, output)`` per output, like ``ControllerClient.generate``.
        Closing early cancels the replica's stream (the engine aborts the request)."""
        text = self.decode(request.prompt_ids) or " ".join(map(str, request.prompt_ids))  # never empty
        call = EngineCall(text, request)
        gen = self.handle.options(stream=True).generate.remote(call)
        finished, first = False, True
        self.inflight[request.tenant] += 1
        try:
            async for replica_id, out in gen:
                out: RequestOutput
                if first:
                    self.routed[replica_id] += 1
                    first = False
                finished = out.finished
                yield _Replica(replica_id), RouteChoice(replica_id, out.route or "recomputed"), out
                if finished:
                    return
        finally:
            self.inflight[request.tenant] -= 1
            if not finished:
                gen.cancel()


class BaselineIngress(kvmesh_app.KvmeshIngress.func_or_class.__bases__[0]):
    """``KvmeshIngress`` with its request path over an ``EngineReplica`` handle."""

    async def __init__(self, settings: dict, tenants_data: dict, engines):
        self._engines = engines
        await super().__init__(settings, tenants_data)

    async def _open_pool(self, tenants_data: dict):
        return ServePool(self._engines, lambda ids: self.tokenizer.decode(list(ids)))

    async def check_health(self):
        return None  # the replicas have their own health checks


# The ingress's routes, re-registered on this module's own FastAPI app (the same functions; Serve
# binds them to the replica's instance), with the same OpenAI error handlers.
baseline_app = FastAPI(title="kvmesh-baseline", docs_url=None, redoc_url=None)
baseline_app.exception_handlers.update(kvmesh_app.app.exception_handlers)


def _api_routes(router):
    """The API routes under ``router`` (FastAPI >= 0.137 nests included routers)."""
    for r in router.routes:
        if isinstance(r, APIRoute):
            yield r
        elif hasattr(r, "original_router"):
            yield from _api_routes(r.original_router)


for _route in _api_routes(kvmesh_app.app):
    if hasattr(_route.endpoint, "_serve_cls"):  # a method of KvmeshIngress
        baseline_app.add_api_route(_route.path, _route.endpoint, methods=sorted(_route.methods),
                                   name=_route.name, include_in_schema=_route.include_in_schema)
BaselineDeployment = serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000,
                                      num_replicas=1, name="BaselineIngress")(serve.ingress(baseline_app)(BaselineIngress))


def engine_config(settings: AppSettings, tenants_data: dict) -> EngineConfig:
    """The engine configuration a kvmesh worker of these settings gets (device/dtype resolved
    against the running cluster when ``ray`` is initialised, else CPU/float32)."""
    from policies.tenancy import Tenants

    return resolve_pool_config(pool_config(settings, Tenants.from_dict(tenants_data))).engine


def build_app(args: dict) -> Application:
    """``import_path: cluster.baselines:build_app``. ``args`` are ``cluster/serve.yaml``'s plus
    ``router: pow2 | affinity`` (default pow2; the YAML's ``request_router_config`` on the
    ``EngineReplica`` deployment overrides it). ``workers`` = replicas (fixed, no autoscaling)."""
    args = dict(args or {})
    router = args.pop("router", "pow2")
    if router not in ROUTERS:
        raise ValueError(f"router must be one of {ROUTERS}, not {router!r}")
    settings = AppSettings.from_args(args)
    path = Path(settings.tenants) if settings.tenants else tenants_path(kvmesh_app.EXAMPLE_TENANTS)
    tenants_data = read_tenants_file(path)
    engine = engine_config(settings, tenants_data)
    options = dict(num_replicas=settings.workers, max_ongoing_requests=settings.max_num_seqs,
                   ray_actor_options={"num_cpus": settings.worker_num_cpus,
                                      "num_gpus": settings.worker_num_gpus or 0})
    if router == "affinity":
        options["request_router_config"] = RequestRouterConfig(request_router_class=AFFINITY_ROUTER)
    engines = EngineReplica.options(**options).bind(engine)
    return BaselineDeployment.options(ray_actor_options=ingress_actor_options()).bind(
        dataclasses.asdict(settings), tenants_data, engines)
