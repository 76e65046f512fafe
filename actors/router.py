"""The router actor: one named actor per Serve app (``kvmesh-router:<app>`` in namespace
"kvmesh"; plain ``kvmesh-router`` without an app, as in tests and benches) holding the shared
routing estimates, a thin shell around ``policies.routing.CostModel``. An app's router is created
by its worker pool inside the app's controller (non-detached: it dies with the controller), so
apps sharing a cluster never share or kill each other's estimates.

Workers report measured prefills, transfers, probes and their load (fire and forget); routers ask
``rank``/``decide``. Callers on an event loop use ``RouterClient``, which never blocks: every
question has a timeout and answers ``None`` on timeout or error, and the caller falls back to
``power_of_two``. Reports are coalesced: a client with ``flush_s`` buffers them and sends them
with its next question (one ``batch`` call: the reports, in order, then the question), or, when
no question comes, in one ``batch`` call ``flush_s`` after the first buffered report. So a
routed request costs the router one call (the ranking carries the loads, decisions, outcomes
and prefills reported since the last one) instead of five or more, and an idle app none.
Every ``batch`` answer carries the router's ``epoch`` (new after a restart): the client calls
``on_restart`` when it changes, so the pool re-registers its workers at once instead of every
second.

Metrics: decisions by kind, bytes pulled (reported by workers after a pull), and the error of
predicted vs measured TTFT by route kind.
"""

from __future__ import annotations

import asyncio
import logging
import random
import uuid
from collections import Counter
from typing import Mapping, Sequence

import ray

from actors.head_affinity import on_head
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
        self._err: dict[str, list[float]] = {}  # kind -> [count, sum |err|, sum |err|/actual, sum (predicted - actual)]
        self.epoch = uuid.uuid4().hex  # new after every (re)start
        self.batches = 0

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

    def report_outcome(self, kind: str, predicted_s: float, actual_s: float, worker: WorkerId | None = None,
                       running: int = 0, decode_wait_s: float = 0.0) -> None:
        """A routed request's first token came ``actual_s`` after it was routed, predicted
        ``predicted_s``; with the ``worker``, the sequences ``running`` there at the decision and
        the part of the prediction charged for them, a route without a pull also teaches the
        decode term (``CostModel.observe_outcome``)."""
        if worker is not None and kind in ("local", "recomputed"):
            self.model.observe_outcome(worker, int(running), predicted_s, actual_s, decode_wait_s)
        e = self._err.setdefault(kind, [0, 0.0, 0.0, 0.0])
        e[0] += 1
        e[1] += abs(predicted_s - actual_s)
        e[2] += abs(predicted_s - actual_s) / max(actual_s, 1e-6)
        e[3] += predicted_s - actual_s

    def batch(self, reports: Sequence[tuple[str, tuple]] = (), method: str | None = None, args: tuple = ()):
        """Apply ``reports`` (``(method, args)`` of the report methods, in order; a failing one
        only loses that sample), then answer ``method(*args)`` (a question; None without one).
        Returns ``(epoch, answer)``."""
        self.batches += 1
        for name, a in reports:
            if name not in REPORTS:
                log.warning("router batch: %r is not a report", name)
                continue
            try:
                getattr(self, name)(*a)
            except Exception as e:  # noqa: BLE001 - one bad sample must not lose the others
                log.debug("router report %s failed: %r", name, e)
        if method is None:
            return self.epoch, None
        if method not in QUESTIONS:
            raise ValueError(f"{method!r} is not a router question")
        return self.epoch, getattr(self, method)(*args)

    # -- questions --------------------------------------------------------------------------
    def rank(self, prompt_tokens: int, holdings: Mapping[WorkerId, int],
             workers: Sequence[WorkerId] | None = None,
             pending: Mapping[WorkerId, int] | None = None,
             shared: Mapping[WorkerId, int] | None = None) -> list[Candidate]:
        return self.model.rank(prompt_tokens, holdings, workers, pending, shared)

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
                "decode_s": {w: self.model.decode_s(w) for w in self.model.nodes},
                # the KV memory each worker's pool last published: its size and what requests hold
                "kv": {w: {"tokens": ld.kv_tokens, "running": sum(n for n, _ in ld.kv_running),
                           "waiting": sum(n for n, _, _ in ld.kv_waiting)}
                       for w, ld in self.model.loads.items() if ld.kv_tokens},
                "nodes": dict(self.model.nodes)}

    def metrics(self) -> dict:
        return {"decisions": dict(self.decisions), "bytes_pulled": self.bytes_pulled,
                "pull_failures": self.pull_failures,
                "ttft_error": {k: {"count": int(c), "mean_abs_s": s / c, "mean_rel": r / c, "mean_signed_s": d / c}
                               for k, (c, s, r, d) in self._err.items() if c}}


REPORTS = frozenset({"register", "remove", "sync_workers", "report_prefill", "report_transfer", "report_probe",
                     "report_load", "report_decision", "report_outcome"})
QUESTIONS = frozenset({"rank", "decide", "estimates", "metrics"})


def get_or_create_router(config: CostConfig | None = None, detached: bool = False, app: str | None = None):
    """The named router actor of ``app`` (``router_name(app)``), created on first use
    (``get_if_exists`` makes creation race-free); owned by the caller unless ``detached``.
    Restarted by Ray if its process dies (``max_restarts=-1``; the handles stay valid): it comes
    back with empty estimates, and the pool re-registers its workers (``sync_workers``)."""
    opts = dict(name=router_name(app), namespace=ROUTER_NAMESPACE, get_if_exists=True, num_cpus=0,
                max_restarts=-1, **on_head())
    if detached:
        opts["lifetime"] = "detached"
    return ray.remote(Router).options(**opts).remote(config)


class RouterClient:
    """Async, non-blocking access to the router actor for code on an event loop.

    Questions return ``None`` on timeout or any error; reports are fire and forget (their refs are
    dropped; an error in a report only loses that sample). ``flush_s`` None: each report is its
    own call (as before); else reports wait in a buffer (at most ``max_buffer``) for the next
    question or for ``flush_s`` (see the module docstring); order is kept either way.
    ``on_restart()``: called when an answer shows a new router epoch (not for the first one).
    ``on_dead()``: called once when a call finds the actor dead for good (``replace`` then gives
    the client a new actor).
    """

    def __init__(self, handle=None, timeout_s: float = 0.05, rng: random.Random | None = None,
                 name: str = ROUTER_NAME, flush_s: float | None = None, max_buffer: int = 4096):
        self._handle = handle
        self.name = name  # looked up when no handle is given
        self.timeout_s = timeout_s
        self.rng = rng or random.Random()
        self.flush_s, self.max_buffer = flush_s, max_buffer
        self.on_restart = None
        self.on_dead = None  # called once per handle when a call finds the actor dead for good
        self._dead_seen = False
        self.epoch: str | None = None
        self.calls = 0  # actor calls made (questions + flushes + unbuffered reports)
        self._buffer: list[tuple[str, tuple]] = []
        self._timer: asyncio.TimerHandle | None = None

    @property
    def handle(self):
        if self._handle is None:
            self._handle = ray.get_actor(self.name, namespace=ROUTER_NAMESPACE)
        return self._handle

    async def _ask(self, method: str, *args):
        try:
            if self.flush_s is None:
                self.calls += 1
                ref = getattr(self.handle, method).remote(*args)
                return await asyncio.wait_for(asyncio.wrap_future(ref.future()), self.timeout_s)
            reports = self._take()
            self.calls += 1
            ref = self.handle.batch.remote(reports, method, args)
            epoch, answer = await asyncio.wait_for(asyncio.wrap_future(ref.future()), self.timeout_s)
            self._saw(epoch)
            return answer
        except Exception as e:  # timeout, actor gone, not created yet: the caller falls back
            log.debug("router %s failed: %r", method, e)
            self._check_dead(e)
            return None

    def replace(self, handle) -> None:
        """Use ``handle`` (a new router actor) from now on; its first answer sets the epoch."""
        self._handle, self.epoch, self._dead_seen = handle, None, False

    def _check_dead(self, e: BaseException) -> None:
        """A router killed for good (``ray.kill(no_restart=True)``, or out of restarts) answers
        every call with ``ActorDiedError`` and Ray never brings it back: tell ``on_dead`` once."""
        if isinstance(e, ray.exceptions.ActorDiedError) and not self._dead_seen and self.on_dead is not None:
            self._dead_seen = True
            try:
                self.on_dead()
            except Exception:  # noqa: BLE001 - a callback failure must not fail routing
                log.exception("router on_dead failed")

    def _take(self) -> list[tuple[str, tuple]]:
        reports, self._buffer = self._buffer, []
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        return reports

    def _saw(self, epoch: str) -> None:
        if epoch != self.epoch:
            restarted = self.epoch is not None
            self.epoch = epoch
            if restarted and self.on_restart is not None:
                try:
                    self.on_restart()
                except Exception:  # noqa: BLE001 - a callback failure must not fail routing
                    log.exception("router on_restart failed")

    def flush(self) -> None:
        """Send the buffered reports now (one ``batch`` call; fire and forget but for the epoch)."""
        reports = self._take()
        if not reports:
            return
        try:
            self.calls += 1
            ref = self.handle.batch.remote(reports)
        except Exception as e:
            log.debug("router flush failed: %r", e)
            return
        try:
            fut = asyncio.wrap_future(ref.future())
        except RuntimeError:  # no event loop: nobody to read the epoch
            return
        fut.add_done_callback(self._flushed)

    def _flushed(self, f: asyncio.Future) -> None:
        if f.cancelled():
            return
        if f.exception() is not None:
            self._check_dead(f.exception())
        else:
            self._saw(f.result()[0])

    async def decide(self, prompt_tokens: int, holdings: Mapping[WorkerId, int],
                     workers: Sequence[WorkerId] | None = None) -> RouteDecision | None:
        return await self._ask("decide", prompt_tokens, dict(holdings), list(workers) if workers else None)

    async def rank(self, prompt_tokens: int, holdings: Mapping[WorkerId, int],
                   workers: Sequence[WorkerId] | None = None,
                   pending: Mapping[WorkerId, int] | None = None,
                   shared: Mapping[WorkerId, int] | None = None) -> list[Candidate] | None:
        return await self._ask("rank", prompt_tokens, dict(holdings), list(workers) if workers else None,
                               dict(pending or {}), dict(shared or {}))

    async def choose(self, prompt_tokens: int, holdings: Mapping[WorkerId, int], workers: Sequence[WorkerId],
                     load: Mapping[WorkerId, float]) -> RouteDecision | WorkerId | None:
        """A decision from the router, or, when it cannot answer in time, a worker id picked by
        power of two choices over ``load``."""
        d = await self.decide(prompt_tokens, holdings, workers)
        return d if d is not None else power_of_two(list(workers), load, self.rng)

    def report(self, method: str, *args) -> None:
        if self.flush_s is not None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # not on an event loop: no timer to flush with, send it now
                loop = None
            if loop is not None:
                self._buffer.append((method, args))
                if len(self._buffer) >= self.max_buffer:
                    self.flush()
                elif self._timer is None:
                    self._timer = loop.call_later(self.flush_s, self.flush)
                return
        try:
            self.calls += 1
            getattr(self.handle, method).remote(*args)
        except Exception as e:
            log.debug("router report %s failed: %r", method, e)

