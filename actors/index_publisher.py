"""Worker side of the global index: drain block events, publish them in msgpack batches.

Wire format (msgpack map, version 1)::

    {"v": 1, "w": worker_id, "s": seq, "bs": block_size,
     "d": [domain, ...],                     # domain table; events refer to it by position
     "e": [[kind, hash, parent|nil, domain_ix|nil], ...],   # kind 0 = stored, 1 = removed
     "snap": [[hash, parent|nil, domain_ix|nil], ...] | nil,  # full holdings, replaces all
     "se": [[kind, template_id, slot_class, domain_ix, slot_id, num_tokens, tenant], ...],
     "ss": [[template_id, slot_class, domain_ix, slot_id, num_tokens, tenant], ...] | nil}

``se``/``ss`` (optional: absent = none) carry the worker's template slots (approximate-reuse
donors, ``engine.slot_pool.SlotEvent``; kind 0 = added, 1 = removed) for the index's
``SlotRegistry``, in the same sequence as the blocks: a slot snapshot goes with every block
snapshot, so a restarted index or a lost batch re-registers the worker's slots too.

One actor call per flush interval (not per block or request). A batch the index cannot place in
sequence (index restarted, a call was lost) makes the next flush send a snapshot instead of
events: the snapshot and the event drain happen in one engine-thread call, so events after it
apply on top of it exactly. With nothing to send a heartbeat (empty batch) goes out after
``heartbeat_s``, backing off to ``max_heartbeat_s`` while the worker stays idle
(``policies.backoff``); any event brings it back. An idle worker costs the index one call per
``max_heartbeat_s`` (it used to be one per second).

A restarted index is noticed by the death watch (``watch``: an awaitable call on the index that
never returns; its failure means the index actor died or restarted), which makes the next flush
a snapshot at once; the heartbeat is only the safety net (a lost watch, a publisher without
one), and keeps the worker fresh against the index's ``stale_s``.
No Ray import: the publisher gets plain async callables (see ``actors.worker``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, Sequence, Union

import msgpack

from actors.prefix_index import REMOVED, STORED, Batch
from actors.slot_registry import SlotKey
from engine.block_pool import BlockEvent
from policies.backoff import Backoff

log = logging.getLogger(__name__)
WIRE_VERSION = 1
SLOT_ADDED, SLOT_REMOVED = 0, 1

Snapshot = list[tuple[bytes, "bytes | None", "str | None"]]
# engine.slot_pool.SlotEvent (duck-typed here: the index actor need not import torch)
SlotEvents = Sequence[object]
Send = Callable[[bytes, bool], Awaitable[dict]]


@dataclass(frozen=True)
class Drained:
    """What one engine-thread drain returns: block events, block snapshot (when asked), slot
    events, slot snapshot (when asked; None from a worker without a slot pool)."""

    events: Sequence[BlockEvent] = ()
    snapshot: Snapshot | None = None
    slot_events: SlotEvents = ()
    slot_snapshot: SlotEvents | None = None


# drain(full) -> Drained, or the (events, snapshot) pair of a worker without slots
Drain = Callable[[bool], Awaitable[Union[Drained, tuple]]]


@dataclass(frozen=True)
class SlotUpdate:
    """The slot part of a decoded batch: ordered (added?, key, slot id, tokens, meta) events and
    an optional full list of (key, slot id, tokens, meta) replacing the worker's slots."""

    events: tuple[tuple[bool, SlotKey, str, int, dict], ...] = ()
    snapshot: tuple[tuple[SlotKey, str, int, dict], ...] | None = None


def encode_batch(worker_id: str, seq: int, block_size: int, events: Sequence[BlockEvent],
                 snapshot: Snapshot | None = None, slot_events: SlotEvents = (),
                 slot_snapshot: SlotEvents | None = None) -> bytes:
    domains: dict[str | None, int | None] = {None: None}

    def ix(d):
        if d not in domains:
            domains[d] = len(domains) - 1
        return domains[d]

    def slot(e):
        return [e.template_id, e.slot_class, ix(e.domain), e.slot_id, int(e.num_tokens), e.tenant]

    ev = [[STORED if e.kind == "stored" else REMOVED, e.block_hash, e.parent_hash, ix(e.domain)] for e in events]
    snap = None if snapshot is None else [[h, p, ix(d)] for h, p, d in snapshot]
    msg = {"v": WIRE_VERSION, "w": worker_id, "s": seq, "bs": block_size, "e": ev, "snap": snap}
    if slot_events:
        msg["se"] = [[SLOT_ADDED if e.kind == "added" else SLOT_REMOVED, *slot(e)] for e in slot_events]
    if slot_snapshot is not None:
        msg["ss"] = [slot(e) for e in slot_snapshot]
    msg["d"] = [d for d in domains if d is not None]
    return msgpack.packb(msg, use_bin_type=True)


HASH_BYTES = 16  # engine.block_pool.hash_block: 16 bytes of sha256
MAX_ID_CHARS = 512  # worker ids, domains, template ids, slot classes, slot ids, tenants
_U63 = 1 << 63


def decode_message(payload: bytes) -> tuple[Batch, SlotUpdate]:
    """Parse a batch with its slot part; raises ValueError (and nothing else) on anything
    malformed. Strict: every field must have its wire type (no coercion: ``bytes(5)`` would
    make five zero bytes, ``bytes(10**10)`` ten gigabytes), hashes are ``HASH_BYTES`` long, a
    block is never its own parent, domain indices are in the table and counts are in range.
    A well-typed batch may still lie (blocks it never stored, parents it does not hold): the
    index stays consistent under any sequence of such batches (``PrefixIndex``)."""
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise ValueError("an index batch must be bytes")
    try:
        m = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack's errors: truncated, extra data, invalid bytes, bad UTF-8
        raise ValueError(f"malformed index batch: {type(e).__name__}") from None
    if not isinstance(m, dict):
        raise ValueError("an index batch must be a map")
    if m.get("v") != WIRE_VERSION or isinstance(m.get("v"), bool):
        raise ValueError(f"unsupported index wire version {str(m.get('v'))[:20]}")
    table = _field(m, "d", list)
    for d in table:
        _text(d, "domain")

    def dom(i):
        if i is None:
            return None
        if not _is_int(i) or not 0 <= i < len(table):
            raise ValueError("domain index out of the table")
        return table[i]

    def block(h, p, d):
        if not (isinstance(h, bytes) and len(h) == HASH_BYTES):
            raise ValueError(f"block hashes must be {HASH_BYTES} bytes")
        if p is not None and not (isinstance(p, bytes) and len(p) == HASH_BYTES):
            raise ValueError(f"parent hashes must be {HASH_BYTES} bytes or nil")
        if p == h:
            raise ValueError("a block cannot be its own parent")
        return h, p, dom(d)

    events = []
    for e in _field(m, "e", list):
        if not (isinstance(e, list) and len(e) == 4):
            raise ValueError("a block event is [kind, hash, parent, domain]")
        if e[0] not in (STORED, REMOVED) or isinstance(e[0], bool):
            raise ValueError("unknown block event kind")
        events.append((e[0], *block(*e[1:])))
    snap = m.get("snap")
    snapshot = None
    if snap is not None:
        if not isinstance(snap, list) or not all(isinstance(x, list) and len(x) == 3 for x in snap):
            raise ValueError("a snapshot is a list of [hash, parent, domain]")
        snapshot = tuple(block(*x) for x in snap)

    def slot(fields):
        if not (isinstance(fields, list) and len(fields) == 6):
            raise ValueError("a slot is [template_id, slot_class, domain, slot_id, num_tokens, tenant]")
        t, c, d, sid, n, tenant = fields
        for x, what in ((t, "template id"), (c, "slot class"), (sid, "slot id"), (tenant, "tenant")):
            _text(x, what)
        domain = dom(d)
        if domain is None:
            raise ValueError("a slot needs a domain")
        if not _is_int(n) or not 0 <= n < _U63:
            raise ValueError("slot token counts must be non-negative integers")
        return SlotKey(t, c, domain), sid, n, {"tenant": tenant}

    def slot_event(fields):
        if not (isinstance(fields, list) and len(fields) == 7) or fields[0] not in (SLOT_ADDED, SLOT_REMOVED) \
                or isinstance(fields[0], bool):
            raise ValueError("unknown slot event kind or shape: a slot event is [kind, template_id, slot_class, "
                             "domain, slot_id, num_tokens, tenant]")
        return (fields[0] == SLOT_ADDED, *slot(fields[1:]))

    slot_events = tuple(slot_event(x) for x in _field(m, "se", list, ()))
    ss = m.get("ss")
    if ss is not None and not isinstance(ss, list):
        raise ValueError("a slot snapshot is a list")
    slots = SlotUpdate(slot_events, None if ss is None else tuple(slot(x) for x in ss))
    worker, seq, bs = m.get("w"), m.get("s"), m.get("bs")
    _text(worker, "worker id")
    if not worker:
        raise ValueError("the worker id is empty")
    if not _is_int(seq) or not 0 <= seq < _U63:
        raise ValueError("the sequence number must be a non-negative integer")
    if not _is_int(bs) or not 0 < bs < 1 << 20:
        raise ValueError("the block size must be a positive integer")
    return Batch(worker, seq, bs, tuple(events), snapshot), slots


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _text(x, what: str) -> str:
    if not isinstance(x, str) or len(x) > MAX_ID_CHARS:
        raise ValueError(f"the {what} must be a string of at most {MAX_ID_CHARS} characters")
    return x


def _field(m: dict, key: str, kind: type, default=None):
    x = m.get(key, default)
    if x is None and default is None:
        raise ValueError(f"the batch lacks {key!r}")
    if not isinstance(x, (kind, tuple)):
        raise ValueError(f"{key!r} has the wrong type")
    return x


def decode_batch(payload: bytes) -> Batch:
    """Parse a batch's block part; raises ValueError on anything malformed."""
    return decode_message(payload)[0]


class IndexPublisher:
    """Batches one worker's block events to the index.

    ``drain(full)`` runs on the engine thread and returns (events, snapshot-or-None), taking the
    snapshot when ``full``; ``send(payload, full)`` delivers one batch and returns the index's
    reply ``{"ok": bool, "epoch": str}``. Invariant: seq numbers are consecutive per publisher;
    after any failure the next batch is a snapshot.
    """

    def __init__(self, worker_id: str, block_size: int, drain: Drain, send: Send,
                 interval_s: float = 0.1, heartbeat_s: float = 1.0, timeout_s: float = 5.0,
                 max_heartbeat_s: float | None = None, watch: Callable[[], Awaitable[object]] | None = None):
        self.worker_id, self.block_size = worker_id, block_size
        self.drain, self.send = drain, send
        self.interval_s, self.heartbeat_s, self.timeout_s = interval_s, heartbeat_s, timeout_s
        self.beat = Backoff(heartbeat_s, max(heartbeat_s, max_heartbeat_s or heartbeat_s))
        self.heartbeat_due_s = heartbeat_s  # current wait before a heartbeat (backs off while idle)
        self.watch = watch  # awaitable call on the index that only ever fails (its death notice)
        self.seq = 0
        self.need_snapshot = True
        self.epoch: str | None = None
        self.last_sent = float("-inf")
        self.stats = {"batches": 0, "events": 0, "snapshots": 0, "failures": 0, "bytes": 0, "index_restarts_seen": 0}
        self._task: asyncio.Task | None = None
        self._watch_task: asyncio.Task | None = None

    async def flush(self, force: bool = False) -> bool:
        """Send what is pending (or a heartbeat when due). False if the send failed."""
        full = self.need_snapshot
        d = await self.drain(full)
        d = d if isinstance(d, Drained) else Drained(*d)
        events, snapshot = d.events, d.snapshot
        now = time.monotonic()
        changed = bool(events or d.slot_events or snapshot is not None)
        if not force and not changed and now - self.last_sent < self.heartbeat_due_s:
            return True
        payload = encode_batch(self.worker_id, self.seq, self.block_size, events, snapshot,
                               d.slot_events, d.slot_snapshot)
        self.seq += 1
        self.last_sent = now
        self.heartbeat_due_s = self.beat.next_interval(self.heartbeat_due_s, changed)
        try:
            reply = await asyncio.wait_for(self.send(payload, snapshot is not None), self.timeout_s)
        except Exception as e:  # timeout, index dead or restarting: resync next time
            log.debug("index publish failed: %s", type(e).__name__)
            self.stats["failures"] += 1
            self.need_snapshot = True
            return False
        self.epoch = reply.get("epoch", self.epoch)
        self.need_snapshot = not reply.get("ok", False)
        self.stats["batches"] += 1
        self.stats["events"] += len(events) + len(d.slot_events)
        self.stats["snapshots"] += snapshot is not None
        self.stats["bytes"] += len(payload)
        return not self.need_snapshot

    async def run(self) -> None:
        while True:
            try:
                await self.flush()
            except asyncio.CancelledError:
                raise
            except Exception:  # never let the loop die (e.g. engine call failed)
                log.exception("index publisher flush failed")
                self.need_snapshot = True
            await asyncio.sleep(self.interval_s)

    async def watch_index(self) -> None:
        """Hold the index's death watch; each time it fails (the index died or restarted, or the
        call was lost) the next flush sends a snapshot at once. Retries at most once a second."""
        while True:
            try:
                await self.watch()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - the death notice itself
                log.debug("index watch ended: %s", type(e).__name__)
            self.stats["index_restarts_seen"] += 1
            self.need_snapshot = True
            self.heartbeat_due_s = self.heartbeat_s
            await asyncio.sleep(max(1.0, self.interval_s))

    def start(self) -> asyncio.Task:
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done():
            self._task = loop.create_task(self.run())
        if self.watch is not None and (self._watch_task is None or self._watch_task.done()):
            self._watch_task = loop.create_task(self.watch_index())
        return self._task

    def stop(self) -> None:
        for t in (self._task, self._watch_task):
            if t is not None:
                t.cancel()
        self._task = self._watch_task = None
