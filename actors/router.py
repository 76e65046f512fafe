"""The router actor: one named actor per Serve app (``kvmesh-router:<app>`` in namespace
"kvmesh"; plain ``kvmesh-router`` without an app, as in tests and benches) holding the shared
routing estimates, a thin shell around ``policies.routing.CostModel``. An app's router is created
by its worker pool inside the app's controller (non-detached: it dies with the controller), so
apps sharing a cluster never share or kill each other's estimates.

Workers report measured prefills, transfers, probes and their load (fire and forget); routers ask
``rank``/``decide``. Callers on an event loop use ``RouterClient``, which never blocks: every
question has a timeout and answers ``None`` on timeout or error, and the caller falls back to
``power_of_two``.

Metrics: decisions by kind, bytes pulled (reported by workers after a pull), and the error of
predicted vs measured TTFT by route kind.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections import Counter
from typing import Mapping, Sequence

import ray

from policies.routing import (Candidate, CostConfig, CostModel, NodeId, RouteDecision, WorkerId,
                              WorkerLoad, power_of_two)

ROUTER_NAME = "kvmesh-router"  # without an app (tests, benches); an app's router: router_name(app)
ROUTER_NAMESPACE = "kvmesh"


def router_name(app: str | None = None) -> str:
    """The router actor's name for ``app`` (``ROUTER_NAME`` when no app is given)."""
    return f"{ROUTER_NAME}:{app}" if app else ROUTER_NAME


log = logging.getLogger(__name__)


class Router:
    """Shared estimates. Methods are quick and synchronous; the actor runs them one at a time."""

    def __init__(self, config: CostConfig | None = None):
        self.model = CostModel(config)
        self.decisions: Counter[str] = Counter()
        self.bytes_pulled = 0
        self.pull_failures = 0
        self._err: dict[str, list[float]] = {}  # kind -> [count, sum |err|, sum |err|/actual]

    # -- reports from workers ---------------------------------------------------------------
    def register(self, worker: WorkerId, node: NodeId) -> None:
        self.model.register(worker, node)

    def remove(self, worker: WorkerId) -> None:
        self.model.remove(worker)

    def sync_workers(self, nodes: Mapping[WorkerId, NodeId]) -> int:
        """Register the workers of ``nodes`` this router does not know (a restarted router
        starts empty; the pool sends its live workers every tick). Returns how many were new."""
        new = [w for w in nodes if w not in self.model.nodes]
        for w in new:
            self.model.register(w, nodes[w])
        return len(new)

    def report_prefill(self, worker: WorkerId, new_tokens: int, seconds: float, cached_tokens: int = 0) -> None:
        self.model.observe_prefill(worker, new_tokens, seconds, cached_tokens)

    def report_transfer(self, src: NodeId, dst: NodeId, nbytes: int, seconds: float, ok: bool = True) -> None:
        if ok:
            self.model.links.observe_transfer(src, dst, nbytes, seconds)
            self.bytes_pulled += nbytes
        else:
            self.pull_failures += 1

    def report_probe(self, src: NodeId, dst: NodeId, rtt_s: float, nbytes: int = 0, seconds: float = 0.0) -> None:
        """A light probe between workers: its RTT and, if it carried ``nbytes``, a bandwidth
        sample (not counted as pulled bytes)."""
        self.model.links.observe_rtt(src, dst, rtt_s)
        if nbytes:
            self.model.links.observe_transfer(src, dst, nbytes, seconds)

    def report_load(self, worker: WorkerId, load: WorkerLoad) -> None:
        self.model.observe_load(worker, load)

    def report_decision(self, kind: str) -> None:
        """A router that ranked here (``rank``) and decided itself (placement) reports its choice."""
        self.decisions[kind] += 1

    def report_outcome(self, kind: str, predicted_s: float, actual_s: float) -> None:
        e = self._err.setdefault(kind, [0, 0.0, 0.0])
        e[0] += 1
        e[1] += abs(predicted_s - actual_s)
        e[2] += abs(predicted_s - actual_s) / max(actual_s, 1e-6)

    # -- questions --------------------------------------------------------------------------
    def rank(self, prompt_tokens: int, holdings: Mapping[WorkerId, int],
             workers: Sequence[WorkerId] | None = None,
             pending: Mapping[WorkerId, int] | None = None) -> list[Candidate]:
        return self.model.rank(prompt_tokens, holdings, workers, pending)

    def decide(self, prompt_tokens: int, holdings: Mapping[WorkerId, int],
               workers: Sequence[WorkerId] | None = None) -> RouteDecision | None:
        d = self.model.decide(prompt_tokens, holdings, workers)
        if d is not None:
            self.decisions[d.kind] += 1
        return d

    def estimates(self) -> dict:
        return {"links": self.model.links.snapshot(),
                "prefill": {w: self.model.prefill_model(w).coefficients for w in self.model.nodes},
                "wait_s": {w: self.model.wait_s(w) for w in self.model.nodes},
                "nodes": dict(self.model.nodes)}

    def metrics(self) -> dict:
        return {"decisions": dict(self.decisions), "bytes_pulled": self.bytes_pulled,
                "pull_failures": self.pull_failures,
                "ttft_error": {k: {"count": int(c), "mean_abs_s": s / c, "mean_rel": r / c}
                               for k, (c, s, r) in self._err.items() if c}}


def get_or_create_router(config: CostConfig | None = None, detached: bool = False, app: str | None = None):
    """The named router actor of ``app`` (``router_name(app)``), created on first use
    (``get_if_exists`` makes creation race-free); owned by the caller unless ``detached``.
    Restarted by Ray if its process dies (``max_restarts=-1``; the handles stay valid): it comes
    back with empty estimates, and the pool re-registers its workers (``sync_workers``)."""
    opts = dict(name=router_name(app), namespace=ROUTER_NAMESPACE, get_if_exists=True, num_cpus=0,
                max_restarts=-1)
    if detached:
        opts["lifetime"] = "detached"
    return ray.remote(Router).options(**opts).remote(config)


class RouterClient:
    """Async, non-blocking access to the router actor for code on an event loop.

    Questions return ``None`` on timeout or any error; reports are fire and forget (their refs are
    dropped; an error in a report only loses that sample).
    """

    def __init__(self, handle=None, timeout_s: float = 0.05, rng: random.Random | None = None,
                 name: str = ROUTER_NAME):
        self._handle = handle
        self.name = name  # looked up when no handle is given
        self.timeout_s = timeout_s
        self.rng = rng or random.Random()

    @property
    def handle(self):
        if self._handle is None:
            self._handle = ray.get_actor(self.name, namespace=ROUTER_NAMESPACE)
        return self._handle

    async def _ask(self, method: str, *args):
        try:
            ref = getattr(self.handle, method).remote(*args)
            return await asyncio.wait_for(asyncio.wrap_future(ref.future()), self.timeout_s)
        except Exception as e:  # timeout, actor gone, not created yet: the caller falls back
            log.debug("router %s failed: %r", method, e)
            return None

    async def decide(self, prompt_tokens: int, holdings: Mapping[WorkerId, int],
                     workers: Sequence[WorkerId] | None = None) -> RouteDecision | None:
        return await self._ask("decide", prompt_tokens, dict(holdings), list(workers) if workers else None)

    async def rank(self, prompt_tokens: int, holdings: Mapping[WorkerId, int],
                   workers: Sequence[WorkerId] | None = None,
                   pending: Mapping[WorkerId, int] | None = None) -> list[Candidate] | None:
        return await self._ask("rank", prompt_tokens, dict(holdings), list(workers) if workers else None,
                               dict(pending or {}))

    async def choose(self, prompt_tokens: int, holdings: Mapping[WorkerId, int], workers: Sequence[WorkerId],
                     load: Mapping[WorkerId, float]) -> RouteDecision | WorkerId | None:
        """A decision from the router, or, when it cannot answer in time, a worker id picked by
        power of two choices over ``load``."""
        d = await self.decide(prompt_tokens, holdings, workers)
        return d if d is not None else power_of_two(list(workers), load, self.rng)

    def report(self, method: str, *args) -> None:
        try:
            getattr(self.handle, method).remote(*args)
        except Exception as e:
            log.debug("router report %s failed: %r", method, e)

