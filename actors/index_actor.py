"""The index actor: one named, detached, restartable actor per cluster wrapping the pure core.

``kvmesh-index`` in namespace ``kvmesh``. State lives only in memory; after a restart the
actor has a new epoch and knows no worker, so every worker's next batch (a heartbeat at the
latest, see ``IndexPublisher``) is refused and the worker resends a full snapshot: the index
rebuilds from the workers' snapshots within about one heartbeat.

Dead workers: a snapshot batch carries the worker's actor handle; the index keeps one call
pending on it (``Worker.until_exit``, which never returns), and Ray fails that call with
``ActorDiedError`` as soon as the worker dies: the index then drops every entry of the worker.
Event-driven, so an idle cluster costs no liveness traffic (it used to ping every worker every
``liveness_s``). Handles without ``until_exit`` (not a kvmesh worker) are still pinged every
``liveness_s``. A liveness loop (local, no calls) also drops workers that have not published for
``stale_s`` seconds (covers workers without a handle, e.g. in tests). Workers hold the same kind
of watch on the index (``until_exit`` here) to notice a restarted index at once.

Template slots (approximate-reuse donors) travel in the same batches (see
``actors.index_publisher``) and follow the same rules: applied only with an accepted batch,
replaced by a worker's snapshot, dropped with a dead worker.

Callers never block on the index: ``lookup_with_timeout`` returns None on timeout or error, and
the caller routes without cache information. Answers are hints, up to about one publish interval
stale (a holder may have just evicted a block): a pull that fails falls back to recompute.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Mapping, Sequence

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError

from actors.head_affinity import on_head
from actors.heap import HeapFreezer
from actors.index_publisher import SlotUpdate, decode_message
from actors.prefix_index import PrefixIndex
from actors.slot_registry import SlotKey, SlotRegistry
from policies.tenancy import domain_tenant, read_label

log = logging.getLogger(__name__)
INDEX_NAME = "kvmesh-index"
NAMESPACE = "kvmesh"


class IndexActor:
    """Thin shell: every method is a few lines over ``PrefixIndex`` / ``SlotRegistry``."""

    def __init__(self, block_size: int = 16, liveness_s: float = 1.0, stale_s: float = 30.0,
                 ping_timeout_s: float = 5.0, freeze_every: int = 20_000):
        self.index = PrefixIndex(block_size)
        # the trie's nodes leave the full garbage collections (``actors.heap``): frozen every
        # ``freeze_every`` new nodes (0: never, CPython's own collections only)
        self.heap = HeapFreezer(max(1, freeze_every), enabled=freeze_every > 0)
        self.slots = SlotRegistry()
        self.epoch = uuid.uuid4().hex
        self.started_at = time.time()
        self.liveness_s, self.stale_s, self.ping_timeout_s = liveness_s, stale_s, ping_timeout_s
        self.handles: dict[str, object] = {}
        self._watches: dict[str, tuple[object, asyncio.Task]] = {}  # worker -> (actor id, its death watch)
        self.counters = {"batches": 0, "refused": 0, "malformed": 0, "lookups": 0, "dropped_workers": 0}
        # isolation audit: prompt tokens found per (reader tenant, policies.tenancy.read_label)
        self.reads: dict[tuple[str, str], int] = {}
        self._liveness: asyncio.Task | None = None
        self._sweeping: set[asyncio.Task] = set()  # sweeps of holdings a snapshot replaced

    def _ensure_liveness(self) -> None:
        if self._liveness is None or self._liveness.done():
            self._liveness = asyncio.get_running_loop().create_task(self._liveness_loop())

    # -- feeds -----------------------------------------------------------------------------
    async def publish(self, payload: bytes, handle=None) -> dict:
        """Apply one msgpack batch. ``ok`` False: resend a snapshot (unknown worker or a gap)."""
        self._ensure_liveness()
        try:
            batch, slots = decode_message(payload)
        except ValueError as e:
            self.counters["malformed"] += 1
            log.warning("dropping malformed index batch: %s", e)
            return {"ok": False, "epoch": self.epoch}
        if batch.block_size != self.index.block_size:
            log.warning("worker %s publishes block size %d, index uses %d", batch.worker_id,
                        batch.block_size, self.index.block_size)
        made, sweeps = self.index.created, []
        ok = self.index.apply_batch(batch, sweeps)  # a snapshot's old holdings: swept in the background
        for sweep in sweeps:
            task = asyncio.get_running_loop().create_task(self._sweep(sweep))
            self._sweeping.add(task)
            task.add_done_callback(self._sweeping.discard)
        if ok:
            self._apply_slots(batch.worker_id, slots)
        self.heap.grew(self.index.created - made, len(self.index))
        if handle is not None and ok:
            self.handles[batch.worker_id] = handle
            self._watch(batch.worker_id, handle)
        self.counters["batches" if ok else "refused"] += 1
        return {"ok": ok, "epoch": self.epoch}

    def _apply_slots(self, worker_id: str, update: SlotUpdate) -> None:
        if update.snapshot is not None:
            self.slots.replace_worker(worker_id, update.snapshot)
        for added, key, slot_id, num_tokens, meta in update.events:
            if added:
                self.slots.register(key, worker_id, slot_id, num_tokens, meta)
            else:
                self.slots.remove(key, worker_id, slot_id)

    async def remove_worker(self, worker_id: str) -> int:
        self.handles.pop(worker_id, None)
        w = self._watches.pop(worker_id, None)
        if w is not None and w[1] is not asyncio.current_task():
            w[1].cancel()
        self.slots.remove_worker(worker_id)
        return await self._sweep(self.index.retire(worker_id))

    async def _sweep(self, sweep) -> int:
        """Run a sweep of a removed or replaced worker's blocks (``PrefixIndex.retire``) a shard per
        turn of the event loop, so lookups and batches are answered between its steps (at 256
        GPU-sized workers the index holds ~4M blocks: 1.3-1.6 s of sweeping in one piece, bench/heap_stalls.py)."""
        n = 0
        for k in sweep:
            n += k
            await asyncio.sleep(0)
        return n

    async def until_exit(self) -> None:
        """Never returns: a worker keeps one such call pending as its death watch on the index
        (it fails when the index dies or restarts; the worker then resends its snapshot)."""
        await asyncio.get_running_loop().create_future()

    def _watch(self, worker_id: str, handle) -> None:
        """Keep one ``until_exit`` call pending on the worker's actor (one watch per actor)."""
        key = getattr(handle, "_actor_id", None) or id(handle)
        cur = self._watches.get(worker_id)
        if cur is not None and cur[0] == key and not cur[1].done():
            return
        if cur is not None:
            cur[1].cancel()
        task = asyncio.get_running_loop().create_task(self._watch_worker(worker_id, handle, key))
        self._watches[worker_id] = (key, task)

    async def _watch_worker(self, worker_id: str, handle, key) -> None:
        """Drop ``worker_id`` when its actor dies. Other failures (unreachable for a while, a
        handle without ``until_exit``) leave it to the liveness loop's pings and retry later."""
        while self._watches.get(worker_id, (None,))[0] == key:
            try:
                await _ref(handle.until_exit.remote())
            except ActorDiedError:
                if self._watches.get(worker_id, (None,))[0] == key:
                    self.counters["dropped_workers"] += 1  # out of every answer now; its sweep follows
                    n = await self.remove_worker(worker_id)
                    log.info("index dropped dead worker %s (%d blocks)", worker_id, n)
                return
            except asyncio.CancelledError:
                raise
            except AttributeError:  # not a kvmesh worker: the liveness loop pings it
                return
            except Exception as e:  # noqa: BLE001 - unreachable, restarting: try again later
                log.debug("death watch of %s: %s", worker_id, type(e).__name__)
            await asyncio.sleep(self.liveness_s)

    def _watched(self, worker_id: str) -> bool:
        w = self._watches.get(worker_id)
        return w is not None and not w[1].done()

    async def _liveness_loop(self) -> None:
        while True:
            await asyncio.sleep(self.liveness_s)
            try:
                await self._check_liveness()
            except Exception:  # pragma: no cover - keep the loop alive
                log.exception("index liveness check failed")

    async def _check_liveness(self) -> None:
        dead = set(self.index.stale_workers(self.stale_s))
        items = [(w, h) for w, h in self.handles.items() if not self._watched(w)]  # the rest have a death watch
        results = await asyncio.gather(
            *(asyncio.wait_for(_ref(h.__ray_ready__.remote()), self.ping_timeout_s) for _, h in items),
            return_exceptions=True)
        for (worker_id, _), res in zip(items, results):
            if isinstance(res, ActorDiedError):  # restarting (ActorUnavailable) / slow: keep
                dead.add(worker_id)
        for worker_id in dead:
            self.counters["dropped_workers"] += 1
            n = await self.remove_worker(worker_id)
            log.info("index dropped worker %s (%d blocks)", worker_id, n)

    # -- queries ---------------------------------------------------------------------------
    async def lookup(self, chains: Mapping[str, Sequence[bytes]]) -> dict[str, int]:
        """Per worker, leading prompt tokens held (see ``PrefixIndex.lookup``)."""
        self.counters["lookups"] += 1
        found = self.index.lookup(chains)
        if found and chains:
            self._count_reads(chains, found)
        return found

    def _count_reads(self, chains: Mapping[str, Sequence[bytes]], found: dict[str, int]) -> None:
        """Attribute a lookup's hits to the domains they were stored under (the first chain is
        the reader's own domain; the others are its grants)."""
        reader = next(iter(chains))
        per = {reader: max(found.values())} if len(chains) == 1 else {
            d: max(self.index.lookup({d: c}).values(), default=0) for d, c in chains.items()}
        for d, n in per.items():
            if n:
                key = (domain_tenant(reader), read_label(reader, d))
                self.reads[key] = self.reads.get(key, 0) + n

    async def read_stats(self) -> dict:
        """``reads``: per reader tenant ``{label: tokens found}`` (labels of ``read_label``);
        ``cross_tenant_reads``: ``"reader<-owner"`` (or ``"reader<-salt"``) for every label
        other than "own" (empty without grants)."""
        reads: dict[str, dict[str, int]] = {}
        cross: dict[str, int] = {}
        for (t, label), n in self.reads.items():
            reads.setdefault(t, {})[label] = n
            if label != "own":
                cross[f"{t}<-{label.removeprefix('tenant:')}"] = n
        return {"reads": reads, "cross_tenant_reads": cross}

    async def workers(self) -> dict[str, dict]:
        return self.index.workers()

    async def worker_handles(self) -> dict[str, object]:
        return dict(self.handles)

    async def stats(self) -> dict:
        return {"epoch": self.epoch, "started_at": self.started_at, "blocks": len(self.index),
                "workers": len(self.index.workers()), "slots": len(self.slots), "heap": self.heap.stats(),
                "sweeping": len(self._sweeping),
                **self.counters}

    # -- template slots --------------------------------------------------------------------
    async def register_slot(self, template_id: str, slot_class: str, domain: str, worker_id: str,
                            slot_id: str, num_tokens: int = 0, meta: dict | None = None) -> None:
        self.slots.register(SlotKey(template_id, slot_class, domain), worker_id, slot_id, num_tokens, meta)

    async def lookup_slots(self, template_id: str, slot_class: str, domains: Sequence[str]) -> list[dict]:
        return [{"worker_id": e.worker_id, "slot_id": e.slot_id, "num_tokens": e.num_tokens,
                 "meta": dict(e.meta), "last_access": e.last_access}
                for e in self.slots.lookup(template_id, slot_class, domains)]

    async def remove_slot(self, template_id: str, slot_class: str, domain: str, worker_id: str,
                          slot_id: str | None = None) -> int:
        return self.slots.remove(SlotKey(template_id, slot_class, domain), worker_id, slot_id)

    async def lookup_template(self, template_id: str, domains: Sequence[str]) -> list[dict]:
        """Every worker's slots of the template (any slot class) under the readable domains,
        newest first: the router picks donors to pull from these."""
        self.counters["lookups"] += 1
        return [{"worker_id": e.worker_id, "slot_id": e.slot_id, "slot_class": k.slot_class, "domain": k.domain,
                 "num_tokens": e.num_tokens, "meta": dict(e.meta), "last_access": e.last_access}
                for k, e in self.slots.lookup_template(template_id, domains)]


async def _ref(ref):
    return await ref


def index_actor_class():
    return ray.remote(num_cpus=0, max_restarts=-1, max_concurrency=1000)(IndexActor)


def get_or_create_index(block_size: int = 16, **kwargs):
    """The cluster's index actor, created (detached, restartable) if missing. Blocking GCS call:
    use at start-up, or through ``asyncio.to_thread`` from async code."""
    return index_actor_class().options(name=INDEX_NAME, namespace=NAMESPACE, lifetime="detached",
                                       get_if_exists=True, **on_head()).remote(block_size, **kwargs)


def get_index():
    """The existing index actor, or None (blocking GCS call, see ``get_or_create_index``)."""
    try:
        return ray.get_actor(INDEX_NAME, namespace=NAMESPACE)
    except ValueError:
        return None


async def _ask(index, method: str, *args, timeout_s: float):
    """``index.<method>(*args)``; None without an index, on timeout or on any failure: callers
    route without cache information rather than wait or fail."""
    if index is None:
        return None
    try:
        return await asyncio.wait_for(_ref(getattr(index, method).remote(*args)), timeout_s)
    except (asyncio.TimeoutError, GetTimeoutError, ActorUnavailableError, ray.exceptions.RayError):
        return None
    except Exception:  # never let cache information break routing
        log.exception("index %s failed", method)
        return None


async def lookup_template_with_timeout(index, template_id: str, domains: Sequence[str],
                                       timeout_s: float = 0.05) -> list[dict] | None:
    """``IndexActor.lookup_template``; None on timeout or any failure (route without donors)."""
    return await _ask(index, "lookup_template", template_id, list(domains), timeout_s=timeout_s)


async def lookup_with_timeout(index, chains: Mapping[str, Sequence[bytes]],
                              timeout_s: float = 0.05) -> dict[str, int] | None:
    """Ask the index; None on timeout or any failure (route without cache information)."""
    return await _ask(index, "lookup", dict(chains), timeout_s=timeout_s)
