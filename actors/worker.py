"""The worker actor: one engine per actor (one per GPU; CPU otherwise), streaming generation.

A thin shell: all logic lives in ``engine`` (tested without Ray). Requests stream back as a Ray
generator; cancelling the generator (client gone) aborts the request and frees its blocks.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, replace

import numpy as np
import ray

from engine.async_engine import AsyncEngine, EngineDead
from engine.redact import describe_exc
from engine.kv_cache import KVBlocks
from engine.llm_engine import EngineConfig
from engine.sequence import Request, RequestOutput

log = logging.getLogger(__name__)
# what a pull did (``RequestOutput.pull_outcome``, the response's ``kvmesh.pull_outcome``)
PULL_OUTCOMES = ("landed", "partial", "skipped_no_room", "holder_missing", "timed_out", "failed")
PULL_STATS = ("rejected_digest", "joined", "waited_for_room", *PULL_OUTCOMES[2:])
ROUTER_REPORT_FLUSH_S = 0.5  # a worker's reports to the router wait at most this long to share one call


async def _await(ref):
    return await ref


@dataclass(frozen=True)
class Pull:
    """Fetch prompt blocks [start_block, end_block) from ``holder`` (a Worker actor handle).
    ``timeout_s``: give up (and recompute what did not arrive) after this long; None: the
    worker's ``pull_timeout_s``, which also caps it."""

    holder: object
    holder_node: str
    start_block: int
    end_block: int
    timeout_s: float | None = None


@dataclass(frozen=True)
class DonorPull:
    """A template donor (slot-pool entry ``slot_id`` of ``slot_class``) that ``holder`` (a Worker
    actor handle, id ``holder_id``) registered in the index; the target pulls one that fits."""

    holder: object
    holder_id: str
    slot_id: str
    slot_class: str
    domain: str
    num_tokens: int = 0


class Worker:
    def __init__(self, worker_id: str, config: EngineConfig, pull_timeout_s: float = 30.0,
                 pull_chunk_bytes: int = 8 << 20, donor_pull_timeout_s: float = 5.0, pull_window: int = 2):
        self.worker_id = worker_id
        self.config = config
        self.engine = AsyncEngine(config)
        self.node_id = ray.get_runtime_context().get_node_id()
        self.pull_timeout_s = pull_timeout_s
        self.pull_chunk_bytes = pull_chunk_bytes
        self.pull_window = max(1, pull_window)  # chunks requested ahead of the one being imported
        self.donor_pull_timeout_s = donor_pull_timeout_s  # all donor offers together: the request waits
        # fault hooks (tests, bench/faults.py), see ``set_faults``
        self.faults: set[str] = set()
        self.export_delay_s = 0.0
        self.router = None  # RouterClient when a router actor exists (reports measurements)
        self.report_prefills = True
        self.donor_stats = {"pulled": 0, "failed": 0, "skipped": 0}
        self.export_stats = {"calls": 0, "blocks": 0}  # export_prefix served to pulling peers
        self.fault_stats = {"exports_faulted": 0}  # exports the fault hooks slowed or altered
        # pulled chunks refused (content != the holder's digest); requests that waited for a pull in
        # progress; pulls that waited for room; and the outcomes of pulls that did not land whole
        self.pull_stats = dict.fromkeys(PULL_STATS, 0)
        self.room_poll_s = 0.2  # a pull with no room yet asks again this often (``_pull_planned``)
        # prefixes this worker is pulling now: (domain, the prompt tokens up to the pull's end, the
        # first token it brings (what is before it was held here already), set when it ends)
        self._pulling: list[tuple[str, tuple[int, ...], int, asyncio.Event]] = []
        self._aborted: OrderedDict[str, None] = OrderedDict()  # aborts of requests not (yet) in the engine

    def ready(self) -> dict:
        self._check_alive()
        e = self.engine.engine
        return {"worker_id": self.worker_id, "model": e.loaded.name, "model_id": e.loaded.model_id,
                "max_model_len": e.max_model_len, "block_size": e.config.block_size,
                "vocab_size": int(e.loaded.model.config.vocab_size),
                "kv_bytes_per_token": e.cache.bytes_per_block(e.cache.num_layers, 1, e.cache.num_kv_heads,
                                                              e.cache.head_dim, e.cache.dtype),
                "node_id": self.node_id, "pid": os.getpid(), "num_blocks": e.pool.num_blocks}

    async def calibrate(self, lengths: tuple[int, ...] | None = None) -> list[tuple[int, float]]:
        """The engine's timed prefills of synthetic prompts (``LLMEngine.calibrate``), before this
        worker serves: samples for the router's prefill fit."""
        self._check_alive()
        return await self.engine.call(lambda e: e.calibrate(lengths))

    async def generate(self, request: Request, pulls: tuple[Pull, ...] = (), donor_pulls: tuple[DonorPull, ...] = ()):
        """Stream outputs. ``pulls`` (from the router) name holders of the prompt's prefix: their
        KV is fetched while the request waits in the engine's queue (admitted once it has landed);
        any failure just leaves those blocks to be recomputed.
        ``donor_pulls`` name template donors on other workers (approximate reuse): one that fits
        the request's slot class is fetched first; any failure leaves the request to run as it
        would have (exactly, unless a local donor fits). A request whose approximate KV came
        from a pulled donor reports route "pulled" with those tokens in ``pulled_tokens``."""
        await self._join_pull(request, min((p.start_block for p in pulls), default=None))
        # the request is queued as soon as its pull is planned: it keeps its place in the queue
        # and the transfer overlaps its wait there (the engine admits it once the pull has landed)
        queued, outcomes = asyncio.Event(), []
        pull = asyncio.ensure_future(self._pull(request, pulls, queued=queued, outcomes=outcomes))
        try:
            donor = await self._pull_donor(request, donor_pulls)
            await queued.wait()
            if pull.done():
                pull.result()  # what the plan raised
            if request.request_id in self._aborted:
                del self._aborted[request.request_id]
                if pulls:  # what its pull holds here for it
                    await self.engine.call(lambda e: e.release_hold(request.request_id))
                return  # aborted while its KV was being pulled: never run it
            first = True
            async for out in self.engine.generate(request):
                if first:  # admitted: its pull has ended (the engine waited for it)
                    local, pulled = await pull
                    outcome = ",".join(dict.fromkeys(outcomes)) or None
                gained = max(0, min(pulled, out.num_cached_tokens - local))
                if donor and out.num_approx_tokens:
                    gained += out.num_approx_tokens
                route = "pulled" if gained else ("local" if out.num_cached_tokens else "recomputed")
                out = replace(out, route=route, pulled_tokens=gained, pull_outcome=outcome)
                if first and out.prefill_s is not None and self.router is not None and self.report_prefills:
                    self.router.report("report_prefill", self.worker_id, out.num_prompt_tokens - out.num_cached_tokens,
                                       out.prefill_s, out.num_cached_tokens)
                first = False
                yield out
        finally:
            if not pull.done():  # the request ended (abort, disconnect, refusal) before its pull
                pull.cancel()

    async def generate_all(self, request: Request, pulls: tuple[Pull, ...] = (),
                           donor_pulls: tuple[DonorPull, ...] = ()) -> list[RequestOutput]:
        return [out async for out in self.generate(request, pulls, donor_pulls)]

    # -- approximate-reuse donors across workers (issue 6) ---------------------------------
    async def export_donor(self, slot_id: str):
        """A slot-pool donor as ``DonorPayload`` (object store), None if no longer held."""
        if "export_donor" in self.faults:
            raise RuntimeError("simulated donor export failure")
        return await self.engine.call(lambda e: e.export_donor(slot_id))

    async def _pull_donor(self, request: Request, donor_pulls: tuple[DonorPull, ...]) -> bool:
        """Import the first offered donor of the slot class the request needs (none when a local
        donor fits); True if one was stored. Never raises: failures are logged and skipped."""
        if not donor_pulls:
            return False
        try:
            want = await self.engine.call(lambda e: e.needed_slot_class(request))
        except Exception as e:  # noqa: BLE001 - e.g. a malformed request: generate reports it
            log.debug("donor need of %s failed: %s", request.request_id, describe_exc(e))
            return False
        offers = [p for p in donor_pulls if p.slot_class == want and p.holder_id != self.worker_id]
        if want is None or not offers:
            self.donor_stats["skipped"] += 1
            return False
        readable = (request.domain, *request.read_domains)
        deadline = time.perf_counter() + self.donor_pull_timeout_s  # the request waits for this
        for p in offers[:2]:  # newest first; a second try if the first holder evicted it or failed
            t0 = time.perf_counter()
            if t0 >= deadline:
                break
            try:
                payload = await asyncio.wait_for(_await(p.holder.export_donor.remote(p.slot_id)), deadline - t0)
                if payload is None:
                    continue
                if await self.engine.call(lambda e: e.import_donor(payload, readable)):
                    self.donor_stats["pulled"] += 1
                    log.info("pulled donor %s (%d tokens) from %s in %.3fs", p.slot_id[:12], len(payload.token_ids),
                             p.holder_id, time.perf_counter() - t0)
                    return True
            except Exception as e:  # noqa: BLE001 - any failure: run without this donor
                log.warning("donor pull of %s from %s failed: %s", p.slot_id[:12], p.holder_id, describe_exc(e))
            self.donor_stats["failed"] += 1
        return False

    # -- KV pulls (issue 7) ----------------------------------------------------------------
    async def export_prefix(self, chains: dict, start_block: int, end_block: int) -> KVBlocks | None:
        """Blocks [start, end) of a prompt whose chain hashes the requester sends (object store)."""
        if "export" in self.faults:
            raise RuntimeError("simulated export failure")
        self._check_alive()

        def export() -> KVBlocks | None:  # gather and seal in a thread: never waits for the step in progress
            data = self.engine.engine.export_prefix(chains, start_block, end_block)
            return None if data is None else data.with_digest()  # ~1 GB/s

        data = await asyncio.to_thread(export)
        self.export_stats["calls"] += 1
        self.export_stats["blocks"] += 0 if data is None else data.num_blocks
        if data is None:
            return None
        if self.export_delay_s or "export_corrupt" in self.faults:
            self.fault_stats["exports_faulted"] += 1
            await asyncio.sleep(self.export_delay_s)
            if "export_corrupt" in self.faults:  # after the digest: as if damaged on the way
                k = data.k.copy()
                k.reshape(-1)[:: max(1, k.size // 64)] += 1
                data = replace(data, k=k)
        return data

    async def _pull(self, request: Request, pulls: tuple[Pull, ...], serving: bool = True,
                    queued: asyncio.Event | None = None, outcomes: list[str] | None = None) -> tuple[int, int]:
        """(prompt tokens held locally before, tokens imported by pulls). ``serving``: the request
        runs here next (its pull waits for room and is held for it); False: a copy (replication).
        ``queued`` is set once the request may be added to the engine: when its pull is planned
        (the engine then admits it only after ``LLMEngine.pull_landed``), or when the pull ends.
        ``outcomes`` gets each pull's outcome (``PULL_OUTCOMES``).

        The engine thread is asked once before the transfers (chains, held prefix, room for each
        pull) and once per arrived chunk (its import, queued without waiting for the one before:
        commands run in order on that thread); the holders export without their engine threads
        (``LLMEngine.export_prefix``). On a busy worker each engine call waits for the step in
        progress, so these waits, not the link, used to set a pull's time."""
        if not pulls:
            if queued is not None:
                queued.set()
            return 0, 0
        # registered before the plan: on a busy worker the plan's engine call waits for the step in
        # progress (seconds on a slow host), and a request of the same prefix routed here meanwhile
        # must find this pull and wait for it (the cluster bench, session 20: one 0.35 s behind ran
        # with nothing cached while the first, planned to pull the prefix here, ran with all of it)
        span = max(p.end_block for p in pulls) * self.config.block_size
        first = min(p.start_block for p in pulls) * self.config.block_size
        entry = (request.domain, tuple(request.prompt_ids[:span]), first, asyncio.Event())
        self._pulling.append(entry)
        expected = {"landing": False}  # set on the engine thread: the engine waits for pull_landed
        try:  # import_hold_s 0: pulled KV is evictable as it lands, and a pull with no room is skipped
            return await self._pull_planned(request, pulls, serving and self.config.import_hold_s > 0, expected,
                                            queued, [] if outcomes is None else outcomes)
        finally:
            self._pulling.remove(entry)
            entry[3].set()
            if expected["landing"]:
                try:
                    await self.engine.call(lambda e: e.pull_landed(request.request_id))
                except Exception as e:  # noqa: BLE001 - a dead engine ends the request anyway
                    log.debug("pull_landed of %s failed: %s", request.request_id, describe_exc(e))
            if queued is not None:
                queued.set()

    async def _pull_planned(self, request: Request, pulls: tuple[Pull, ...], serving: bool, expected: dict,
                            queued: asyncio.Event | None, outcomes: list[str]) -> tuple[int, int]:
        """``_pull`` once registered: the plan on the engine thread, then the pulls that fit.

        While no pull fits and the engine runs requests (whose blocks free up as they finish),
        the plan is asked again, until the pull's deadline: the request would wait for room in
        the queue anyway, and started without its pull it computes the prefix again (the cluster
        bench, session 20: a planned pull skipped on a crowded worker ran as a 31 s recompute).
        The prefix held here and each landed chunk are held for the request until it is admitted,
        and once a pull fits the request is queued while the chunks arrive (``queued``, see
        ``LLMEngine.expect_pull``, ``engine/import_holds.py``)."""

        def plan(e):
            chains = e.prompt_chains(request)
            if not chains:
                return chains, 0, (), False
            room = tuple(e.can_import(chains, p.start_block, p.end_block, request.tenant) for p in pulls)
            local = e.held_prefix_tokens(chains)
            if serving and any(room):
                e.expect_pull(request.request_id, chains)
                expected["landing"] = True
            return chains, local, room, bool(e.scheduler.running)

        deadline = time.perf_counter() + self.pull_timeout_s  # not the transfer's: the queue is waited anyway
        chains, local, room, busy = await self.engine.call(plan)
        waited = False
        while serving and chains and not any(room) and busy and time.perf_counter() < deadline:
            waited = True
            await asyncio.sleep(self.room_poll_s)
            chains, local, room, busy = await self.engine.call(plan)
        if waited:
            self.pull_stats["waited_for_room"] += 1
        if expected["landing"] and queued is not None:
            queued.set()  # queued now: admitted once pull_landed
        if not chains:
            return 0, 0

        async def one(p: Pull, fits: bool) -> int:
            """Fetch [start, end) from the holder in chunks, ``pull_window`` requested ahead: the
            holder exports (gathers and seals) the next chunk while one is on the wire, and at
            most that many exports are wasted when the pull stops early. Chunks import in order;
            a chunk that fails or comes back short ends the pull (later blocks could not extend
            the prefix), and nothing lands after a chunk whose import failed. A pull that cannot
            land whole in the pool is not started."""
            if not fits:
                log.info("pull of blocks %d-%d skipped: no room for them", p.start_block, p.end_block)
                return outcome("skipped_no_room", 0)
            t0 = time.perf_counter()
            got = {"nbytes": 0, "seconds": 0.0}
            step = self._pull_chunk_blocks()
            ranges = [(a, min(a + step, p.end_block)) for a in range(p.start_block, p.end_block, step)]
            landing = {"ok": True}  # written on the engine thread (in import order), read by fetch
            seen = {"missing": False, "whole": False}  # the holder had nothing; every chunk came whole

            def land(e, data: KVBlocks, a: int) -> int:
                if not landing["ok"]:
                    return 0
                try:
                    return e.import_prefix(data, a, chains, request.tenant,
                                           hold_for=request.request_id if serving else None)
                except BaseException:
                    landing["ok"] = False
                    raise

            async def arrive(a: int, b: int):  # the chunk and when it arrived (transfer time, not imports)
                data = await p.holder.export_prefix.remote(chains, a, b)
                return data, time.perf_counter() - t0

            ahead: deque[asyncio.Future] = deque()
            imports: list[asyncio.Future] = []

            async def fetch() -> None:
                nxt = 0
                for a, b in ranges:
                    if not landing["ok"]:  # an import failed: the rest could not extend the prefix
                        return
                    while nxt < len(ranges) and len(ahead) < self.pull_window:
                        ahead.append(asyncio.ensure_future(arrive(*ranges[nxt])))
                        nxt += 1
                    data, arrived = await ahead.popleft()
                    if data is None:  # the holder no longer has them (evicted since it was indexed)
                        if a == p.start_block:
                            seen["missing"] = True
                            log.info("pull of blocks %d-%d from %s: the holder has them no longer",
                                     p.start_block, p.end_block, p.holder_node)
                        return
                    if not await asyncio.to_thread(data.digest_ok):
                        self.pull_stats["rejected_digest"] += 1
                        raise ValueError(f"pulled blocks {a}-{b} fail their digest: recomputing them")
                    got["nbytes"] += data.nbytes
                    got["seconds"] = arrived
                    imports.append(self.engine.call(lambda e, data=data, a=a: land(e, data, a)))
                    if data.num_blocks < b - a:
                        return
                seen["whole"] = True

            failure = None
            try:
                await asyncio.wait_for(fetch(), min(self.pull_timeout_s, p.timeout_s or self.pull_timeout_s))
            except Exception as e:  # noqa: BLE001 - any failure: recompute the blocks not imported
                failure = e
            finally:
                for chunk in ahead:  # requested but not consumed: stop waiting; mark errors as seen
                    if chunk.done() and not chunk.cancelled():
                        chunk.exception()
                    chunk.cancel()
            imported = 0  # queued imports land whatever happened after them
            for res in await asyncio.gather(*imports, return_exceptions=True):
                if isinstance(res, BaseException):
                    failure = failure or res
                else:
                    imported += res
            if failure is not None:
                log.warning("pull of blocks %d-%d from %s failed after %d tokens: %s", p.start_block, p.end_block,
                            p.holder_node, imported, describe_exc(failure))
            ok = got["nbytes"] > 0
            if self.router is not None:
                self.router.report("report_transfer", p.holder_node, self.node_id, got["nbytes"],
                                   got["seconds"] if ok else time.perf_counter() - t0, ok)
            if failure is not None:
                return outcome("timed_out" if isinstance(failure, asyncio.TimeoutError) else "failed", imported)
            return outcome("holder_missing" if seen["missing"] else "landed" if seen["whole"] else "partial", imported)

        def outcome(what: str, imported: int) -> int:
            if what in self.pull_stats:
                self.pull_stats[what] += 1
            outcomes.append(what)
            return imported

        imported = await asyncio.gather(*(one(p, fits) for p, fits in zip(pulls, room)))
        return local, sum(imported)

    async def _join_pull(self, request: Request, pulls_from_block: int | None = None) -> None:
        """A request sent here whose prompt shares at least one of the blocks this worker is
        pulling for an earlier request, and that expects to find them here, waits for that pull
        to end (the router counts a routed prefix as held at once, so a group's next request
        follows the first): admitted now, it would compute those blocks again (the cluster bench,
        session 17: two requests of one group 0.35 s apart, the second recomputed). A request
        with pulls of its own from block ``pulls_from_block`` on expects the blocks before it
        here, so it waits for a pull that brings any of those (session 30: a hot group's second
        request, routed to a worker whose copy of the prefix was still arriving, pulled only
        its own last blocks; that pull timed out behind the first one on the slow link, and it
        computed all 552 tokens while the first waited for its pull: 5.1 and 6.0 s). Sharing only
        blocks held here before the pull is no reason to wait (the cluster bench, session 28:
        chat turns sharing a system prompt held here waited 2-5 s for another session's pull of
        its history). Only its own or granted domains' pulls (another tenant's would be a timing
        side channel); a pull ends by its own deadline."""
        if not self._pulling or request.reuse == "none":
            return
        domains = {request.domain, *request.read_domains}
        prompt, bs = request.prompt_ids, self.config.block_size
        before = None if pulls_from_block is None else pulls_from_block * bs
        waits = [ev for d, toks, first, ev in self._pulling
                 if d in domains and (before is None or first < before)
                 and len(os.path.commonprefix([tuple(prompt[:len(toks)]), toks])) >= first + bs]
        if not waits:
            return
        self.pull_stats["joined"] += 1
        try:
            await asyncio.wait_for(asyncio.gather(*(ev.wait() for ev in waits)), self.pull_timeout_s)
        except asyncio.TimeoutError:
            pass

    def _pull_chunk_blocks(self) -> int:
        """Blocks per pull chunk: ``pull_chunk_bytes`` of KV (at least one block)."""
        c = self.engine.engine.cache
        per_block = c.bytes_per_block(c.num_layers, self.config.block_size, c.num_kv_heads, c.head_dim, c.dtype)
        return max(1, self.pull_chunk_bytes // per_block)

    async def prefetch(self, request: Request, pulls: tuple[Pull, ...]) -> int:
        """Import a prompt's prefix from holders without running the request (replication)."""
        return (await self._pull(request, pulls, serving=False))[1]

    def probe_payload(self, nbytes: int):
        """Bytes for a peer's link probe (through the object store, like a pull)."""
        return np.zeros(nbytes, dtype=np.uint8) if nbytes else b""

    async def probe(self, peers: list[tuple[str, object]], nbytes: int = 1 << 20) -> dict[str, tuple[float, float]]:
        """Time a tiny and a ``nbytes`` fetch from each peer worker on another node and report
        them to the router (its light periodic probes). Returns {peer node: (rtt_s, seconds)}."""
        out = {}
        for node, handle in peers:
            if node == self.node_id:
                continue
            try:
                t0 = time.perf_counter()
                await asyncio.wait_for(_await(handle.probe_payload.remote(0)), self.pull_timeout_s)
                rtt = time.perf_counter() - t0
                t0 = time.perf_counter()
                await asyncio.wait_for(_await(handle.probe_payload.remote(nbytes)), self.pull_timeout_s)
                seconds = time.perf_counter() - t0
            except Exception as e:  # noqa: BLE001 - a failed probe only loses a sample
                log.debug("probe of %s failed: %s", node, describe_exc(e))
                continue
            out[node] = (rtt, seconds)
            if self.router is not None:
                self.router.report("report_probe", node, self.node_id, rtt, nbytes, seconds)
        return out

    async def set_tenant_policies(self, quotas: dict, gates: dict | None = None) -> bool:
        """A changed tenants file (redeploy): new eviction quotas and quality gates, no restart."""
        await self.engine.call(lambda e: e.set_tenant_policies(quotas, gates))
        return True

    def set_faults(self, faults: list[str]) -> None:
        """Fault hooks for tests and ``bench/faults.py`` (replaces the previous set):
        ``export`` / ``export_donor``: those calls raise; ``export_slow:<s>``: each KV export
        answers ``s`` seconds late; ``export_corrupt``: exported KV is altered after its digest
        (the puller must refuse it); ``engine_death``: ends the engine loop now (as a fatal step
        error would); ``engine_stall:<s>``: the engine thread sleeps ``s`` seconds once, as in one
        long step of a busy worker."""
        self.faults, self.export_delay_s = set(), 0.0
        for f in faults:
            name, _, arg = f.partition(":")
            if name == "export_slow":
                self.export_delay_s = float(arg or 1.0)
            elif name == "engine_stall":
                self.engine.stall(float(arg or 1.0))
            self.faults.add(name)
        if "engine_death" in self.faults:
            self.engine.die(RuntimeError("simulated engine death"))

    def _check_alive(self) -> None:
        if not self.engine.alive:
            raise EngineDead(f"the engine of worker {self.worker_id} died: {self.engine.error!r}")

    async def until_exit(self) -> None:
        """Never returns. A watcher (the index, the pool) keeps one such call pending per worker:
        Ray fails it with ``ActorDiedError`` as soon as this actor dies, so liveness needs no
        periodic pings (one idle coroutine here, no traffic)."""
        await asyncio.get_running_loop().create_future()

    async def watch_engine(self, poll_s: float = 0.5) -> None:
        """Raises ``EngineDead`` once the engine loop died (at once if it has); never returns
        while it lives. The pool keeps one such call pending per worker instead of asking
        ``health`` every few seconds: the engine's liveness is checked here, locally, every
        ``poll_s`` (no actor call, no hop onto the engine thread)."""
        while self.engine.alive:
            await asyncio.sleep(poll_s)
        self._check_alive()

    async def health(self) -> dict:
        """Raises EngineDead once the engine loop died (the pool then replaces this worker);
        else the engine's load (running and waiting requests), read on the engine thread."""
        self._check_alive()
        return await self.engine.call(lambda e: {"alive": True, "running": len(e.scheduler.running),
                                                 "waiting": len(e.scheduler.waiting)})

    def attach_router(self, handle=None, report_prefills: bool = True) -> bool:
        """Report transfers, probes and (``report_prefills``) prefills to the router actor (fire
        and forget, coalesced: at most one call per ``ROUTER_REPORT_FLUSH_S``). The pool passes
        ``report_prefills=False``: it reports each request's prefill itself, on the router's
        next ranking (``WorkerPool.mark_started``), which costs no call of its own."""
        from actors.router import RouterClient

        self.router = RouterClient(handle, flush_s=ROUTER_REPORT_FLUSH_S)
        self.report_prefills = report_prefills
        return True

    async def abort(self, request_id: str) -> None:
        """Abort a request; one not in the engine yet (still pulling KV) is remembered so that
        ``generate`` drops it instead of running it for nobody."""
        self._aborted[request_id] = None
        while len(self._aborted) > 4096:
            self._aborted.popitem(last=False)
        await self.engine.abort(request_id)

    async def stats(self) -> dict:
        return {**await self.engine.call(lambda e: e.stats()), "donor_pulls": dict(self.donor_stats),
                "exports": dict(self.export_stats), "pulls": dict(self.pull_stats),
                "faults": dict(self.fault_stats)}

    async def pool_accounting(self) -> dict:
        """The block pool's books: ``free`` (free list) + ``cached_idle`` (cached, refcount 0)
        + ``in_use`` (refcount > 0) == ``total``; after a drain ``in_use`` must be 0.
        ``invariants`` is None when ``BlockPool.check_invariants`` passes, else its message."""
        def books(e) -> dict:
            pool = e.pool
            try:
                pool.check_invariants()
                err = None
            except AssertionError as x:
                err = str(x) or "invariant violated"
            return {"free": len(pool._free), "cached_idle": pool.eviction.num_evictable(), "in_use": pool.num_in_use(),
                    "total": pool.num_blocks, "running": len(e.scheduler.running),
                    "waiting": len(e.scheduler.waiting), "invariants": err}
        return await self.engine.call(books)

    # -- global prefix index (issue 4) -----------------------------------------------------
    async def snapshot(self) -> list[tuple[bytes, bytes | None, str | None]]:
        """This worker's prefix cache: [(block hash, parent hash, share domain)]."""
        return await self.engine.call(lambda e: e.pool.cached_hashes())

    async def start_index_publisher(self, interval_s: float = 0.1, heartbeat_s: float = 1.0,
                                    max_heartbeat_s: float = 8.0) -> bool:
        """Publish block and template-slot events to the cluster's index actor in batches
        (idempotent). Idle, the heartbeat backs off from ``heartbeat_s`` to ``max_heartbeat_s``;
        a restarted index is noticed at once by a death watch on it (``IndexActor.until_exit``)."""
        from actors.index_actor import get_or_create_index
        from actors.index_publisher import Drained, IndexPublisher

        if getattr(self, "index_publisher", None) is not None:
            return True
        index = await asyncio.to_thread(get_or_create_index, self.config.block_size)
        me = ray.get_runtime_context().current_actor

        def take(e, full: bool) -> Drained:
            slots = e.approx.pool if e.approx is not None else None
            if slots is not None:
                slots.record_events = True
            return Drained(e.pool.take_events(), e.pool.cached_hashes() if full else None,
                           slots.take_events() if slots is not None else (),
                           slots.slot_entries() if slots is not None and full else None)

        async def drain(full: bool):
            # nothing new (the common case between steps that store or evict blocks): answer
            # without a hop onto the engine thread, which would wait for the step in progress
            e = self.engine.engine
            slots = e.approx.pool if e.approx is not None else None
            if not full and not e.pool.has_events and not (slots is not None and slots.record_events
                                                           and slots.has_events):
                return Drained((), None, (), None)
            return await self.engine.call(lambda e: take(e, full))

        async def send(payload: bytes, full: bool) -> dict:
            return await index.publish.remote(payload, me if full else None)

        async def watch() -> None:
            await index.until_exit.remote()

        self.index_publisher = IndexPublisher(self.worker_id, self.config.block_size, drain, send,
                                              interval_s=interval_s, heartbeat_s=heartbeat_s,
                                              max_heartbeat_s=max_heartbeat_s, watch=watch)
        self.index_publisher.start()
        return True


def worker_actor_class(num_gpus: float | None = None, num_cpus: float = 1):
    """The Ray actor class for Worker, asking for a GPU when the cluster has them."""
    if num_gpus is None:
        num_gpus = 1 if ray.is_initialized() and ray.cluster_resources().get("GPU", 0) >= 1 else 0
    return ray.remote(num_gpus=num_gpus, num_cpus=num_cpus, max_concurrency=1000)(Worker)
