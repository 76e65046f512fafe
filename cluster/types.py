"""Types shared by the worker pool (``cluster.pool``) and its routers (``cluster.routing``).

Both modules import from here and neither imports the other's internals for its types, so the
pool can import its router at module level (no import cycle).

Invariants: ``WorkerState.inflight``/``inflight_tokens`` count requests the pool ``acquire``d on
the worker and has not ``release``d; a worker is ``routable`` only when ready, not draining and
not dead.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Mapping, Protocol, Sequence

from engine.sequence import Request
from policies.routing import CostConfig


PREFILL_REPLAY = CostConfig.window  # the samples a worker's prefill fit uses


class WorkerUnavailable(RuntimeError):
    """No worker could take the request (none ready, or the chosen one died)."""


class WorkerDied(WorkerUnavailable):
    """The worker serving a stream died (its actor is gone)."""


@dataclass
class InFlight:
    """A request the pool routed (``WorkerPool.acquire``) until it ends: its demand, the
    router's prediction (reported with the measured TTFT) and what the KV memory signal reads
    (``WorkerState.flights``, ``policies.routing.kv_use``)."""

    tenant: str
    worker_id: str
    prompt_tokens: int
    max_tokens: int
    output_tokens: int = 0
    route: str = "local"  # planned route (reported with the measured TTFT)
    expected_ttft_s: float | None = None
    running_at_route: int = 0  # sequences decoding on the chosen worker when it was chosen (-1: do not
    # learn the decode term from it: its expected TTFT was the KV pool's wait, ``RouteChoice.memory_bound``)
    decode_wait_s: float = 0.0  # the part of expected_ttft_s the router charged for them
    cached_tokens: int = 0  # the router expected these reused there (local + pulled)
    blocks: tuple = ()  # its prompt's block hashes (``RouteChoice.blocks``)
    started_at: float | None = None  # monotonic time its first token was reported
    rows_mark: float = 0.0  # its worker's ``rows_integral`` then (the sequences it decoded beside)

    @property
    def started(self) -> bool:
        return self.started_at is not None

    @property
    def cost(self) -> int:
        return self.prompt_tokens + self.max_tokens


@dataclass(eq=False)
class WorkerState:
    worker_id: str
    actor: object  # ray ActorHandle of actors.worker.Worker
    info: dict | None = None  # Worker.ready(); None while starting
    tenant: str | None = None  # tenant this worker is assigned to; None = shared
    inflight: int = 0
    inflight_tokens: int = 0
    draining: bool = False
    dead: bool = False
    # requests routed here without a first token yet: request id -> prompt tokens expected to be
    # computed (not cached); and requests past their first token (the router's load signal)
    queued: dict[str, int] = field(default_factory=dict)
    running: int = 0
    # the integral of ``running`` over monotonic time, up to ``rows_at`` (``tick``): a request's
    # mean number of sequences decoding beside it, for the router's decode contention
    rows_integral: float = 0.0
    rows_at: float = 0.0
    # every request in flight here (routing order) for the KV memory signal, and what requests
    # that ended here measured: seconds per output token and output tokens (EWMAs; None: none yet)
    flights: dict[str, InFlight] = field(default_factory=dict)
    tpot_s: float | None = None
    output_tokens: float | None = None
    # the prefill samples reported for this worker (calibration, then measured requests), newest
    # last, as many as the router's fit keeps: replayed to a router that restarted empty
    prefill_samples: deque = field(default_factory=lambda: deque(maxlen=PREFILL_REPLAY))

    @property
    def routable(self) -> bool:
        return self.info is not None and not self.draining and not self.dead

    def tick(self, now: float) -> float:
        """``rows_integral`` brought up to ``now`` (call before ``running`` changes); returns it."""
        if self.rows_at:
            self.rows_integral += self.running * max(0.0, now - self.rows_at)
        self.rows_at = max(self.rows_at, now)
        return self.rows_integral


@dataclass(frozen=True)
class RouteChoice:
    worker_id: str
    route: str = "local"  # planned: local | pulled | recomputed (the worker reports what happened)
    pulls: tuple = ()  # actors.worker.Pull instructions for the chosen worker
    expected_ttft_s: float | None = None
    donor_pulls: tuple = ()  # actors.worker.DonorPull offers (approximate reuse) for the chosen worker
    cached_tokens: int = 0  # prompt tokens the router expects to be reused (local + pulled)
    placement: str | None = None  # the placement rule that chose the worker (policies.placement), if any
    decode_wait_s: float = 0.0  # the part of expected_ttft_s charged for sequences decoding there
    # what the choice saw of the prompt's prefix: per worker, prompt tokens held by the global
    # index's answer (None: the index did not answer in time, or was not asked) and by the
    # router's own record of what it routed (``Placer.pending``, not yet indexed included)
    index_holders: dict | None = None
    routed_holders: dict | None = None
    # the cost model's ranking it chose from: per worker, its best option's kind and expected TTFT
    # (and, where a pull was possible but ranked below, that pull's) (``options_of``)
    options: dict | None = None
    blocks: tuple = ()  # the prompt's full blocks' chain hashes in its domain (the KV it shares with others)
    memory_bound: bool = False  # expected_ttft_s waits for room in the worker's KV pool
    # how long the choice took: the router's ``choose`` (index lookup and ranking, measured by the
    # pool) and the whole lease (admission and routing, measured by whoever asked for it: the
    # ingress's round trip to the controller); the response's ``kvmesh.timings``
    route_s: float | None = None
    lease_s: float | None = None
    # the worker is assigned to another tenant, which lends it: the request runs there as a guest,
    # below the owner's priority classes (``PoolConfig.guests_yield``, ``Request.guest``)
    guest: bool = False


@dataclass(frozen=True)
class HitLoan:
    """Workers another tenant owns and does not lend now (``WorkerPool.lendable``), open to a
    request that finds all of its prompt there but at most ``max_new_tokens`` (its own prefix,
    computed there before the assignment): a short prefill ahead of the owner's next request
    instead of recomputing the whole prefix on another worker (``PoolConfig.lend_hit_tokens``).
    Only a router that knows where prefixes are (the index) can use it."""

    workers: tuple[WorkerState, ...] = ()
    max_new_tokens: int = 0

    def admits(self, found: Mapping[str, int] | None, prompt_tokens: int) -> list[WorkerState]:
        """The loan's workers that hold (``found``: the index's answer, tokens per worker) all but
        at most ``max_new_tokens`` of a ``prompt_tokens`` prompt."""
        if not found or not self.workers:
            return []
        need = max(1, prompt_tokens - self.max_new_tokens)
        return [w for w in self.workers if found.get(w.worker_id, 0) >= need]

    def covers(self, cached_tokens: int, prompt_tokens: int) -> bool:
        """A route that reuses ``cached_tokens`` of the prompt computes few enough for the loan."""
        return self.max_new_tokens > 0 and cached_tokens > 0 and prompt_tokens - cached_tokens <= self.max_new_tokens


NO_LOAN = HitLoan()


class Router(Protocol):
    async def choose(self, request: Request, candidates: Sequence[WorkerState],
                     loan: HitLoan = NO_LOAN) -> RouteChoice: ...


class LeastLoadedRouter:
    """Fewest in-flight tokens, then fewest requests, then worker id (deterministic). Knows no
    prefixes, so it takes no ``HitLoan``."""

    async def choose(self, request: Request, candidates: Sequence[WorkerState],
                     loan: HitLoan = NO_LOAN) -> RouteChoice:
        w = min(candidates, key=lambda w: (w.inflight_tokens, w.inflight, w.worker_id))
        return RouteChoice(w.worker_id)
