"""The cost-aware router of the worker pool: index lookup + the router actor's TTFT ranking.

Per request: hash the prompt's blocks under every domain the tenant may read, ask the index
actor which worker holds how much of it, publish the candidates' loads and ask the router actor
for the option with the least expected TTFT (local holder, pull to a less-loaded worker, or
recompute). Placement (``policies.placement.Placer``, one per pool) sits on top of that
ranking: prompts routed but not yet indexed count as held by their worker (a burst of one group
stays together), a prompt without a significant match goes to the worker where it evicts the
least (among those not much slower: load-based spill-over), and a holder keeps its prefix group
unless another option is clearly faster. Both calls are async with short timeouts; if either is
unavailable the request still routes (no holdings: by placement alone; no router: placement on
the pool's own loads). The decision travels with the request as ``Pull`` instructions, so the
chosen worker knows what to fetch and from whom; ``placements`` counts the rules that chose.

Approximate reuse: for a request with ``reuse == "approximate"`` that names a template, the
index's slot registry is asked (same short timeout, concurrently with the block lookup) for that
template's donors under the domains the request may read; donors on other live workers, of slot
classes the chosen worker does not already hold, travel as ``DonorPull`` offers, newest first.
The router cannot tokenize, so it does not know the request's slot class: the chosen worker
computes it and pulls one offer that fits (or none).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import replace
from typing import Callable, Sequence

from actors.heap import HeapFreezer
from actors.index_actor import lookup_template_with_timeout, lookup_with_timeout
from actors.prefix_index import prompt_chains
from actors.router import RouterClient
from actors.worker import DonorPull, Pull
from cluster.types import NO_LOAN, HitLoan, LeastLoadedRouter, RouteChoice, WorkerState
from engine.sequence import Request
from policies.placement import PlacementConfig, Placer, leading_key, shortlist
from policies.replication import ReplicationConfig, ReplicationPolicy
from policies.routing import (ROW_FIT_WEIGHT, DecodeModel, KvFlight, WorkerLoad, held_prefix, kv_counted, kv_use,
                              pull_deadline_s)

log = logging.getLogger(__name__)


# How long one request waits for the index lookup and the router's ranking before it routes
# without them. 50 ms timed out under load on 2 cores (the cluster bench: lookups dropped to
# placement without holdings, whose misses cost a full prefill); a miss costs far more than this.
ROUTE_TIMEOUT_S = 0.2
# Reports to the router actor (loads, decisions, outcomes, prefills) wait at most this long for
# the next ranking to carry them (``actors.router.RouterClient``). What a ranking needs always
# rides on that ranking, so the timer only bounds how stale the router's metrics (TTFT error)
# get when no request comes; at 1 s most requests' outcomes still cost a flush of their own.
ROUTER_FLUSH_S = 5.0
# A worker's KV memory signal (``CostAwareRouter._publish_loads``) is recomputed when its requests
# in flight changed, else at most this often. Its times (seconds until each running request ends)
# are relative to when it was taken, and the router actor counts them down from when it got it
# (``policies.routing.LOAD_AGE_MIN_S``); what an unchanged signal misses is the KV its running
# requests add as they decode (a block per 16 tokens), so it is taken again now and then.
# Recomputing every worker's for every request cost O(workers x requests in flight) per request:
# 64 sequences on each of 16 workers, ~10 ms of the controller per request (bench/router_scale.py).
LOAD_REFRESH_S = 1.0
# Workers ranked and weighed per request (``policies.placement.shortlist``: the prompt's holders,
# then the least busy); 0: all. On 64 GPU-sized workers ranking all of them cost ~20 ms of the
# controller and the router actor per request (bench/router_scale.py).
MAX_CANDIDATES = 16
# routed requests between two freezes of the controller's heap (``actors.heap.HeapFreezer``):
# each costs a young collection, ~1-3 ms; between them the full collections scan only what came since
FREEZE_EVERY = 1000


def options_of(ranking) -> dict | None:
    """Per ranked worker: its best option's kind and expected TTFT, its best pull's TTFT where a
    pull was possible but ranked below, and when it would find room in the worker's KV pool where
    that is later than now (None: no ranking, the router did not answer)."""
    if not ranking:
        return None
    return {c.worker: {"kind": c.kind, "ttft_s": round(c.expected_ttft_s, 3),
                       **({"pull_ttft_s": round(c.pull_option_ttft_s, 3)} if c.pull_option_ttft_s is not None else {}),
                       **({"kv_wait_s": round(c.kv_wait_s, 3)} if c.kv_wait_s > 0 else {})}
            for c in ranking}


def decode_tokens(candidates: Sequence[WorkerState]) -> int | None:
    """The output tokens a request is expected to produce at most, from what requests that ended on
    ``candidates`` produced (their EWMAs): twice their mean, at least 16; None before any ended.
    A request's ``max_tokens`` is a bound, often far above what it produces (a chat's default)."""
    outs = [w.output_tokens for w in candidates if w.output_tokens]
    return output_cap(sum(outs) / len(outs)) if outs else None


def output_cap(mean_tokens: float) -> int:
    """The output a request is taken to produce at most where requests produced ``mean_tokens`` on
    average: twice that, at least 16."""
    return max(16, math.ceil(2 * mean_tokens))


class CostAwareRouter:
    def __init__(self, model_id: str, block_size: int, index=None, client: RouterClient | None = None,
                 worker_lookup: Callable[[str], WorkerState | None] | None = None, timeout_s: float = 0.05,
                 replication: ReplicationConfig | None = None, placement: PlacementConfig | None = None,
                 kv_memory: bool = True, max_candidates: int = MAX_CANDIDATES, freeze_every: int = FREEZE_EVERY):
        self.model_id = model_id
        # the placement state (a shadow cache per worker) leaves the full garbage collections
        # (``actors.heap``): the heap is frozen every ``freeze_every`` routed requests (0: never)
        self.heap = HeapFreezer(max(1, freeze_every), enabled=freeze_every > 0)
        self.kv_memory = kv_memory  # publish each worker's KV memory (``_publish_loads``)
        self.max_candidates = max_candidates  # workers weighed per request (``shortlist``; 0: all)
        self.block_size = block_size
        self.index = index
        self.client = client or RouterClient(timeout_s=timeout_s)
        self.worker_lookup = worker_lookup or (lambda _wid: None)
        self.timeout_s = timeout_s
        self.fallback = LeastLoadedRouter()
        self._published: dict[str, WorkerLoad] = {}
        # per worker: (what its signal was taken from, when, the signal, the prompt blocks it holds)
        self._kv_taken: dict[str, tuple[tuple, float, WorkerLoad, set]] = {}
        # per worker: its requests in flight (ids, how many run, the output cap), them as the
        # signal reads them, when, and ``kv_counted`` of them: kept while a signal is retaken only
        # because time passed (building them and counting their blocks was most of its cost)
        self._kv_flights: dict[str, tuple[tuple, list[KvFlight], float, tuple]] = {}
        self.replication = ReplicationPolicy(replication)
        self.placer = Placer(placement)
        # seconds one more sequence decoding beside a request adds to each of its output tokens: the
        # slope of ended requests' seconds per output token over the mean number of sequences that
        # decoded on their worker meanwhile (themselves included), 0 until measured (placement's
        # decode contention, ``PlacementConfig.contention_weight``)
        self.rows = DecodeModel(0.0, weight=ROW_FIT_WEIGHT)

    def observe_tpot(self, rows: float, tpot_s: float) -> None:
        """An ended request: ``rows`` sequences decoded beside it on average (itself included), at
        ``tpot_s`` seconds per output token."""
        if rows > 0 and math.isfinite(tpot_s) and tpot_s >= 0:
            self.rows.observe(rows, tpot_s)

    @property
    def row_s(self) -> float:
        """Seconds per output token one more sequence decoding beside a request adds (``rows``)."""
        return self.rows.seconds

    @property
    def placements(self):
        """Decisions by placement rule (match | spill | place; -fallback without estimates)."""
        return self.placer.placements

    def decision_log(self) -> list[dict]:
        """The last placement decisions that gave a group a worker (``Placer.log``) and the last
        matches that kept a request on a holder much slower than another worker (``Placer.held``),
        oldest first."""
        return sorted([*self.placer.log, *self.placer.held], key=lambda e: e["t"])

    def groups(self) -> dict[str, int]:
        """Prefix groups routed to each worker lately (``Placer.groups_per_worker``)."""
        return self.placer.groups_per_worker(time.monotonic())

    max_donor_offers = 8  # donor offers sent with one request (the worker pulls at most one or two)

    async def choose(self, request: Request, candidates: Sequence[WorkerState],
                     loan: HitLoan = NO_LOAN) -> RouteChoice:
        """``loan``: other tenants' workers (not lent now) that become candidates where the index
        finds all but a few tokens of the prompt (``HitLoan``)."""
        self.heap.grew()
        found: dict[str, int] | None = {}  # None: the index did not answer in time
        chains: dict[str, list[bytes]] = {}
        slots: list[dict] | None = None
        domains = (request.domain, *request.read_domains)
        if request.reuse != "none":
            chains = prompt_chains(request.prompt_ids, self.block_size, self.model_id, domains)
            if request.reuse == "approximate" and isinstance(request.template, str):
                found, slots = await asyncio.gather(
                    lookup_with_timeout(self.index, chains, self.timeout_s),
                    lookup_template_with_timeout(self.index, request.template, domains, self.timeout_s))
            else:
                found = await lookup_with_timeout(self.index, chains, self.timeout_s)
        admitted = loan.admits(found, len(request.prompt_ids))
        if admitted:
            taken = {w.worker_id for w in candidates}
            candidates = [*candidates, *(w for w in admitted if w.worker_id not in taken)]
        choice = await self._choose_exact(request, candidates, found, chains)
        if slots:
            offers = self._donor_offers(choice.worker_id, slots)
            if offers:
                choice = replace(choice, donor_pulls=offers)
        return choice

    def _donor_offers(self, target: str, slots: list[dict]) -> tuple[DonorPull, ...]:
        """Donors of other live workers, of slot classes ``target`` does not hold (newest first)."""
        held = {s["slot_class"] for s in slots if s["worker_id"] == target}
        offers = []
        for s in slots:
            if s["worker_id"] == target or s["slot_class"] in held:
                continue
            holder = self.worker_lookup(s["worker_id"])
            if holder is None or holder.dead:
                continue  # gone since the index saw it
            offers.append(DonorPull(holder.actor, s["worker_id"], s["slot_id"], s["slot_class"], s["domain"],
                                    s.get("num_tokens", 0)))
            if len(offers) >= self.max_donor_offers:
                break
        return tuple(offers)

    async def _choose_exact(self, request: Request, candidates: Sequence[WorkerState], found: dict[str, int] | None,
                            chains: dict[str, list[bytes]]) -> RouteChoice:
        """Holder / pull / recompute by the router actor's TTFT ranking, with placement on top
        (``policies.placement``): prefixes routed but not yet indexed count as held, a new
        prefix goes where it evicts the least, a holder keeps its group unless clearly slower.
        Without the router actor, placement decides from the pool's loads alone."""
        workers = [w.worker_id for w in candidates]
        for w in candidates:  # capacity from the worker's ready() (unknown: unbounded)
            self.placer.shadow(w.worker_id, (w.info or {}).get("num_blocks"))
        prompt = len(request.prompt_ids)
        holdings = found or {}  # ``found`` None (timed out) must not purge the shadow caches: passed as is
        pending = self.placer.pending_tokens(chains, found, workers, prompt, self.block_size, time.monotonic())
        blocks = tuple(chains.get(request.domain) or ())
        if 0 < self.max_candidates < len(candidates):
            held = {w: max(holdings.get(w, 0), pending.get(w, 0)) for w in workers}
            key = leading_key(blocks, request.prompt_ids, self.placer.config.key_blocks)
            short = set(shortlist(workers, held, {w.worker_id: len(w.queued) + w.running for w in candidates}, key,
                                  self.max_candidates))
            candidates = [w for w in candidates if w.worker_id in short]
            workers = [w.worker_id for w in candidates]
        shared = self._publish_loads(candidates, blocks)
        ranked = {w.worker_id: float(sum(w.queued.values())) for w in candidates}  # the loads it ranks on
        ranking = await self.client.rank(prompt, holdings, workers, pending, shared)
        # decided after the await, so requests routed meanwhile are in the shadow caches already,
        # and their prompts (queued since the loads above were published) count in the TTFTs
        loads = {w.worker_id: float(sum(w.queued.values())) for w in candidates}
        placed = self.placer.decide(request.prompt_ids, request.params.max_tokens, self.block_size, chains,
                                    request.domain, found, workers, loads, ranking or None, time.monotonic(),
                                    reuse=request.reuse != "none",
                                    running={w.worker_id: w.running for w in candidates},
                                    queued={w.worker_id: len(w.queued) for w in candidates},
                                    unranked={w: n - ranked[w] for w, n in loads.items() if n > ranked[w]},
                                    row_s=self.row_s, decode_tokens=decode_tokens(candidates))
        if placed is None:
            choice = await self.fallback.choose(request, candidates)
            return replace(choice, index_holders=found, blocks=blocks) if chains else choice
        choice = self._route_choice(request, candidates, holdings, chains, placed)
        self.client.report("report_decision", choice.route)
        # what it saw: the index's answer (None: none in time), the router's own record, the ranking
        return replace(choice, index_holders=found, routed_holders=pending, options=options_of(ranking),
                       blocks=blocks) if chains else choice

    def _route_choice(self, request: Request, candidates: Sequence[WorkerState], holdings: dict[str, int],
                      chains: dict[str, list[bytes]], placed) -> RouteChoice:
        chosen = placed.candidate
        if chosen is None:  # no estimates: the worker's own prefix, no pulls
            cached = placed.view.local_blocks * self.block_size
            return RouteChoice(placed.worker, "local" if cached else "recomputed", (), None,
                               cached_tokens=cached, placement=placed.kind)
        pulls = []
        if chosen.pulls:  # recomputing the pulled tokens: its prefill without the pulls less with them
            deadline = pull_deadline_s(chosen.pull_s, chosen.own_prefill_s - chosen.prefill_s)
            if chosen.exposed_pull_s < chosen.pull_s:  # it transfers while queued: the wait costs it nothing
                deadline = max(deadline, chosen.wait_s)
        for r in chosen.pulls:
            holder = self.worker_lookup(r.holder)
            if holder is None or holder.dead:
                continue  # gone since the index saw it: those blocks are recomputed
            pulls.append(Pull(holder.actor, r.node, r.start_block, r.end_block, deadline))
        if pulls:
            self._replicate(request, chains, pulls, chosen.worker, holdings, candidates)
        return RouteChoice(chosen.worker, chosen.kind, tuple(pulls), chosen.expected_ttft_s,
                           cached_tokens=chosen.cached_tokens, placement=placed.kind,
                           decode_wait_s=chosen.decode_wait_s, memory_bound=chosen.memory_bound)

    def _replicate(self, request: Request, chains, pulls: list[Pull], target: str, holdings, candidates) -> None:
        """Count the pull; if the prefix is hot, copy it ahead of demand (fire and forget)."""
        now = time.monotonic()
        key = chains[request.domain][pulls[-1].end_block - 1]
        self.replication.record_pull(key, now)
        holders = {w for w, n in holdings.items() if n >= pulls[-1].end_block * self.block_size} | {target}
        for wid in self.replication.targets(key, [w.worker_id for w in candidates], holders, now):
            ws = self.worker_lookup(wid)
            if ws is None or ws.dead:
                continue
            first = pulls[0]
            copy = (Pull(first.holder, first.holder_node, 0, first.end_block), *pulls[1:])
            log.info("replicating a hot prefix (%d blocks) to %s", pulls[-1].end_block, wid)
            ws.actor.prefetch.remote(request, copy)
            self.placer.commit(wid, chains[request.domain][:pulls[-1].end_block], 0, now, request.domain)

    def remove(self, worker_id: str) -> None:
        """``worker_id`` left the pool: its shadow cache and the router's copies of its load go."""
        self.placer.remove(worker_id)
        for d in (self._published, self._kv_taken, self._kv_flights):
            d.pop(worker_id, None)

    def forget_published(self) -> None:
        """Resend every load with the next ranking (the router actor restarted empty)."""
        self._published.clear()
        self._kv_taken.clear()
        self._kv_flights.clear()

    def _publish_loads(self, candidates: Sequence[WorkerState], blocks: tuple = ()) -> dict[str, int]:
        """Each candidate's queue for the cost model: the prompt tokens each routed request
        without a first token is expected to compute (its cached prefix excluded), and how many
        are past their first token; and, once the worker's pool size and (its own, else the
        candidates' mean) seconds per output token are known, its KV memory (``kv_use``: what the
        requests in flight there hold and when they end; each one's output taken as its
        max_tokens, but at most twice what requests ending there produced, at least 16). Returns
        per worker the prompt tokens of ``blocks`` (a prompt's chain hashes) held there already."""
        now = time.monotonic()
        tpots = [w.tpot_s for w in candidates if w.tpot_s]
        pooled = sum(tpots) / len(tpots) if tpots else None
        shared: dict[str, int] = {}
        for w in candidates:
            load, held = self._load_of(w, w.tpot_s or pooled, now)
            hit = held_prefix(blocks, held) if held else 0
            if hit:
                shared[w.worker_id] = hit * self.block_size
            if self._published.get(w.worker_id) != load:
                self._published[w.worker_id] = load
                self.client.report("report_load", w.worker_id, load)
        return shared

    def _load_of(self, w: WorkerState, tpot: float | None, now: float) -> tuple[WorkerLoad, set]:
        """``w``'s load and the prompt blocks its requests in flight hold: taken again when they
        changed (or its seconds per output token, output size or pool did), else at most every
        ``LOAD_REFRESH_S`` (its KV signal's times are relative to when it was taken)."""
        num_blocks = (w.info or {}).get("num_blocks")
        taken = (len(w.flights), next(reversed(w.flights), None), len(w.queued), w.running, tpot,
                 w.output_tokens, num_blocks, self.kv_memory)
        last = self._kv_taken.get(w.worker_id)
        if last is not None and last[0] == taken and now - last[1] < LOAD_REFRESH_S:
            return last[2], last[3]
        kv: dict = {}
        held: set = set()
        if tpot and num_blocks and self.kv_memory:
            cap = output_cap(w.output_tokens) if w.output_tokens else None
            shape = (tuple(w.flights), w.running, cap)
            read = self._kv_flights.get(w.worker_id)
            if read is None or read[0] != shape:
                flights = [KvFlight(f.prompt_tokens, f.cached_tokens, f.blocks,
                                    f.max_tokens if cap is None else min(f.max_tokens, cap),
                                    None if f.started_at is None else now - f.started_at)
                           for f in w.flights.values()]
                read = self._kv_flights[w.worker_id] = (shape, flights, now, kv_counted(flights))
            running, waiting, held = kv_use(read[1], tpot, self.block_size, read[3], now - read[2])
            kv = dict(kv_tokens=num_blocks * self.block_size, kv_running=running, kv_waiting=waiting)
        load = WorkerLoad(waiting_tokens=tuple(n for n in w.queued.values() if n), running=w.running, **kv)
        self._kv_taken[w.worker_id] = (taken, now, load, held)
        return load, held
