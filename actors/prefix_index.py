"""The global prefix index: which worker holds which KV block, cluster-wide (pure, no Ray).

A *node* is one cached block, keyed by its chain hash. A chain hash already names the whole
token prefix up to the end of its block (H(parent, tokens, model + share domain)), so the map
hash -> node *is* a token-exact prefix trie: a node's path from the root is its parent chain,
and two prompts share a node exactly when they share every token up to it. Each node records
the workers holding it (a bitset over small interned worker slots), its share domain and its
last access.

Invariants:
  * a node exists iff at least one live worker holds it (``node.workers != 0``), or a removed
    worker's slot whose sweep has not reached it yet (``retire``);
  * bit ``s`` is set in some node only while worker slot ``s`` is registered, or retired and
    being swept out (it then reports no one and is not reused);
  * ``node.domain`` is the domain the block was stored under; a lookup chain hashed for domain
    ``d`` only matches nodes of domain ``d``, at every position of a worker's run (isolation
    does not rest on hashes alone: a lying feed may file a block of ``d``'s chain under another
    domain, and the run ends there).
Feeds: each worker sends batches numbered 0, 1, 2, ...; batch 0 (and any batch after a gap)
must carry a full snapshot that *replaces* the worker's holdings, so duplicated, lost or stale
events heal at the next snapshot. Batches of different workers are independent.
The template slot registry, its sibling in the index actor, is ``actors.slot_registry``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Mapping, Sequence

from engine.block_pool import BlockHash, extra_key, prompt_chains  # noqa: F401 - re-exported for callers

WorkerId = str
Domain = str
STORED, REMOVED = 0, 1  # event kinds on the wire
_RETIRED = object()  # a slot whose bits are being swept out (``PrefixIndex.retire``): reports no one, not reused


class _Node:
    """One cached block. ``workers``: slots holding it; ``full``: slots holding it *and* every
    ancestor, all of its own domain (so ``full`` only shrinks along a chain, and is empty below
    a change of domain). ``parent`` is the parent's hash (the parent node's key object when
    known, so the bytes are shared); ``children`` is None, one node, or a set of nodes (chains
    are mostly linear, so sets are rare)."""

    __slots__ = ("key", "parent", "children", "workers", "full", "domain", "last")

    def __init__(self, key: BlockHash, parent: BlockHash | None, domain: Domain | None, last: float):
        self.key = key
        self.parent = parent
        self.children: _Node | set[_Node] | None = None
        self.workers = 0
        self.full = 0
        self.domain = domain
        self.last = last


def _kids(node: _Node) -> tuple | set:
    c = node.children
    return () if c is None else c if type(c) is set else (c,)


def _add_kid(holder, key, child: _Node) -> None:
    """Attach ``child`` to ``holder`` (a node's ``children`` slot or an orphan dict entry)."""
    if isinstance(holder, dict):
        cur = holder.get(key)
        if cur is None:
            holder[key] = child
        elif type(cur) is set:
            cur.add(child)
        else:
            holder[key] = {cur, child}
        return
    cur = holder.children
    if cur is None:
        holder.children = child
    elif type(cur) is set:
        cur.add(child)
    else:
        holder.children = {cur, child}


class _Shards:
    """The index's nodes by hash: a dict split by the hash's first byte into 256 dicts (block
    hashes are sha256 bytes, so the shards fill evenly; a feed that lies about hashes can at worst
    fill one, which is where one dict was). One dict of millions of keys stops its process while
    it grows (a 2.8M-key dict's rehash took 0.14 s here) and again each time inserts after deletes
    use up its room (0.86 s at 4.3M keys after 1.3M inserts under churn: ``bench/heap_stalls.py``);
    a shard rehashes 1/256 of that. The hot paths index ``shards[h[0]]`` inline (a method call
    per probe cost lookups ~20%; this costs them nothing measurable, ``bench/index.py``)."""

    __slots__ = ("shards", "size")

    def __init__(self):
        self.shards: list[dict[BlockHash, _Node]] = [{} for _ in range(256)]
        self.size = 0

    def get(self, key, default=None):
        return self.shards[key[0]].get(key, default)

    def __getitem__(self, key) -> _Node:
        return self.shards[key[0]][key]

    def __contains__(self, key) -> bool:
        return key in self.shards[key[0]]

    def __setitem__(self, key, node: _Node) -> None:
        shard = self.shards[key[0]]
        self.size += key not in shard
        shard[key] = node

    def __delitem__(self, key) -> None:
        del self.shards[key[0]][key]
        self.size -= 1

    def __len__(self) -> int:
        return self.size

    def __iter__(self):
        for shard in self.shards:
            yield from shard

    def values(self):
        for shard in self.shards:
            yield from shard.values()

    def items(self):
        for shard in self.shards:
            yield from shard.items()

    def clear(self) -> None:
        for shard in self.shards:
            shard.clear()
        self.size = 0


@dataclass(frozen=True)
class Batch:
    """One decoded publish message of a worker (see ``actors.index_publisher`` for the wire)."""

    worker_id: WorkerId
    seq: int
    block_size: int
    events: tuple[tuple[int, BlockHash, BlockHash | None, Domain | None], ...] = ()
    # Full holdings (hash, parent, domain) replacing the worker's entries; None = incremental.
    snapshot: tuple[tuple[BlockHash, BlockHash | None, Domain | None], ...] | None = None


@dataclass
class _Feed:
    slot: int
    next_seq: int = 0
    last_seen: float = 0.0
    blocks: int = 0
    meta: dict = field(default_factory=dict)


class PrefixIndex:
    """Prefix trie over block hashes with per-worker holdings; lookups count leading tokens.

    Beyond the module invariants: ``full(n) = {w : w holds n and all its ancestors}`` when every
    ancestor has ``n``'s domain, else empty; hence ``full(child) ⊆ full(parent)``; a node whose
    parent node is absent is an *orphan*, filed under its parent's hash until that node appears
    (out-of-order or partial holdings).
    """

    def __init__(self, block_size: int = 16, clock: Callable[[], float] = time.monotonic):
        self.block_size = block_size
        self.clock = clock
        self._nodes = _Shards()
        self._orphans: dict[BlockHash, _Node | set[_Node]] = {}
        self._feeds: dict[WorkerId, _Feed] = {}
        self._slot_owner: list[WorkerId | None] = []
        self._domains: dict[str, str] = {}
        self._owner_cache: dict[int, tuple[WorkerId, ...]] = {}  # bits -> workers; reset on slot changes
        self.created = 0  # nodes ever made (the index actor's ``HeapFreezer`` counts them)

    # -- queries ---------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._nodes)

    def workers(self) -> dict[WorkerId, dict]:
        return {w: {"blocks": f.blocks, "next_seq": f.next_seq, "last_seen": f.last_seen, **f.meta}
                for w, f in self._feeds.items()}

    def holders(self, block_hash: BlockHash) -> set[WorkerId]:
        node = self._nodes.get(block_hash)
        return set() if node is None else set(self._owners(node.workers))

    def lookup(self, chains: Mapping[Domain, Sequence[BlockHash]]) -> dict[WorkerId, int]:
        """Per worker, how many leading prompt tokens it holds (workers with 0 are left out).

        ``chains`` maps each readable domain to the prompt's chain under that domain (all of
        equal length). Position i counts for a worker if it holds block i under *any* of the
        chains (the same KV); a worker's run ends at its first missing position.
        Per chain, a bisection over ``full`` sets finds every worker's run from the root in
        O(distinct run lengths x log n) probes. With several chains a holder may switch domain
        mid-prompt, so runs are then extended position by position past their bisected end.
        Probed nodes get ``last`` = now; a node's effective last access is the max over its
        subtree (a lookup always probes the deepest block each holder holds from the root).
        """
        now = self.clock()
        if len(chains) == 1:
            for domain, chain in chains.items():
                return self._tokens(self._runs(domain, chain, now))
        items = [(d, c) for d, c in chains.items()]
        n = min((len(c) for _, c in items), default=0)
        per_domain = [r for r in (self._runs(d, c if len(c) == n else c[:n], now) for d, c in items) if r]
        starts: dict[int, int] = {}  # run end -> bits of workers whose longest run ends there
        if len(per_domain) == 1:
            for bits, blocks in per_domain[0]:
                starts[blocks] = bits
        elif per_domain:
            best: dict[int, int] = {}  # slot bit -> blocks
            for runs_d in per_domain:
                for bits, blocks in runs_d:
                    for bit in self._bits(bits):
                        if best.get(bit, 0) < blocks:
                            best[bit] = blocks
            for bit, blocks in best.items():
                starts[blocks] = starts.get(blocks, 0) | bit
        order = sorted(starts)
        shards, runs, active, i, p = self._nodes.shards, [], 0, 0, (order[0] if order else n)
        while p < n:
            while i < len(order) and order[i] <= p:
                active |= starts[order[i]]
                i += 1
            if not active:
                if i == len(order):
                    break
                p = order[i]
                continue
            held = 0
            for domain, chain in items:
                h = chain[p]
                node = shards[h[0]].get(h)
                if node is not None and node.domain == domain:
                    held |= node.workers
                    node.last = now
            if active & ~held:
                runs.append((active & ~held, p))
                active &= held
            p += 1
        runs.extend((starts[b], n) for b in order[i:])  # only runs that already reach n
        if active:
            runs.append((active, n))
        return self._tokens(runs)

    def _runs(self, domain: Domain, chain: Sequence[BlockHash], now: float) -> list[tuple[int, int]]:
        """[(worker bits, blocks)]: each worker's run of leading blocks of ``chain`` that it holds
        with every ancestor, all of ``domain``. ``full`` only shrinks along a chain, so each
        distinct run end is found by one binary search (about log2 n probes); a probed node of
        another domain counts as held by none, and every node past it has an empty ``full``."""
        shards, n, out = self._nodes.shards, len(chain), []
        if not n:
            return out
        h = chain[0]
        node = shards[h[0]].get(h)
        if node is None or node.domain != domain or not node.full:
            return out
        node.last = now
        cur = node.full
        h = chain[n - 1]
        node = shards[h[0]].get(h)
        if node is not None and node.domain == domain:
            node.last = now
            end = node.full & cur
        else:
            end = 0
        lo = 0  # invariant: every worker in cur holds blocks 0..lo with their ancestors
        while cur != end:
            a, b, fb = lo, n - 1, end  # full(a) ⊇ cur; full(b) ∩ cur = fb ≠ cur
            while b - a > 1:
                mid = (a + b) >> 1
                h = chain[mid]
                node = shards[h[0]].get(h)
                if node is not None and node.domain == domain:
                    node.last = now
                    fm = node.full & cur
                else:
                    fm = 0
                if fm == cur:
                    a = mid
                else:
                    b, fb = mid, fm
            out.append((cur & ~fb, b))
            cur, lo = fb, b
        if cur:
            out.append((cur, n))
        return out

    def _tokens(self, runs: list[tuple[int, int]]) -> dict[WorkerId, int]:
        out: dict[WorkerId, int] = {}
        bs = self.block_size
        for bits, blocks in runs:
            if blocks:
                for w in self._owners(bits):
                    out[w] = blocks * bs
        return out

    @staticmethod
    def _bits(bits: int) -> list[int]:
        out = []
        while bits:
            low = bits & -bits
            out.append(low)
            bits ^= low
        return out

    def _owners(self, bits: int) -> tuple[WorkerId, ...]:
        owners = self._owner_cache.get(bits)
        if owners is None:
            slots = self._slot_owner
            owners = tuple(o for o in (slots[b.bit_length() - 1] for b in self._bits(bits)
                                       if b.bit_length() - 1 < len(slots)) if o is not None and o is not _RETIRED)
            if len(self._owner_cache) < 4096:
                self._owner_cache[bits] = owners
        return owners

    # -- verbs -----------------------------------------------------------------------------
    def add_worker(self, worker_id: WorkerId, **meta) -> None:
        """Register a worker (idempotent); its slot bit stays reserved until remove_worker."""
        feed = self._feeds.get(worker_id)
        if feed is None:
            try:
                slot = self._slot_owner.index(None)
                self._slot_owner[slot] = worker_id
            except ValueError:
                slot = len(self._slot_owner)
                self._slot_owner.append(worker_id)
            feed = self._feeds[worker_id] = _Feed(slot, last_seen=self.clock())
            self._owner_cache.clear()
        feed.meta.update(meta)

    def stored(self, worker_id: WorkerId, block_hash: BlockHash, parent: BlockHash | None,
               domain: Domain | None, now: float | None = None) -> None:
        """Record that the worker holds the block (duplicates are harmless)."""
        self.add_worker(worker_id)
        self._store(self._feeds[worker_id], block_hash, parent, domain, self.clock() if now is None else now)

    def removed(self, worker_id: WorkerId, block_hash: BlockHash) -> None:
        """Record that the worker dropped the block (unknown blocks/workers are ignored)."""
        feed = self._feeds.get(worker_id)
        if feed is not None:
            self._remove(feed, block_hash)

    def remove_worker(self, worker_id: WorkerId) -> int:
        """Drop every entry of the worker and free its slot. Returns how many it held."""
        return sum(self.retire(worker_id))

    def retire(self, worker_id: WorkerId) -> Iterator[int]:
        """Remove the worker from every answer now and return the sweep of its entries: an
        iterator that clears them one shard at a time, yielding each shard's count, and frees the
        slot at its end. The caller may answer lookups and apply batches between steps (the
        index actor does: a sweep of 4M blocks is 1.3-1.8 s of work): meanwhile the slot reports no
        one and is not given to another worker, and every other worker's runs are exact (each
        worker's ``full`` bit still only shrinks along a chain). Run it to its end."""
        feed = self._feeds.pop(worker_id, None)
        if feed is None:
            return iter(())
        self._slot_owner[feed.slot] = _RETIRED
        self._owner_cache.clear()
        return self._sweep(feed.slot, feed.blocks)

    def replace_worker(self, worker_id: WorkerId,
                       snapshot: Iterable[tuple[BlockHash, BlockHash | None, Domain | None]],
                       sweeps: list | None = None) -> None:
        """Make the worker's holdings exactly ``snapshot`` (rebuild after restart or a gap).
        ``sweeps``: the old holdings' sweep (``retire``) is appended there for the caller to run,
        the snapshot going into a new slot meanwhile; None: swept here first."""
        old = self._feeds.get(worker_id)
        if old is not None and old.blocks:
            sweep = self.retire(worker_id)
            if sweeps is None:
                for _ in sweep:
                    pass
            else:
                sweeps.append(sweep)
            self.add_worker(worker_id, **old.meta)
            self._feeds[worker_id].last_seen = old.last_seen
        self.add_worker(worker_id)
        feed = self._feeds[worker_id]
        now = self.clock()
        for h, parent, domain in snapshot:
            self._store(feed, h, parent, domain, now)

    def apply_batch(self, batch: Batch, sweeps: list | None = None) -> bool:
        """Apply one published batch. False: it was out of sequence and ignored, so the worker
        must resend a snapshot. A snapshot batch is always accepted and restarts the sequence.
        ``sweeps``: see ``replace_worker``."""
        now = self.clock()
        feed = self._feeds.get(batch.worker_id)
        if batch.snapshot is not None:
            self.replace_worker(batch.worker_id, batch.snapshot, sweeps)
            feed = self._feeds[batch.worker_id]
            feed.meta["block_size"] = batch.block_size
        elif feed is None or batch.seq != feed.next_seq:
            if feed is not None:
                feed.last_seen = now
            return False
        for kind, h, parent, domain in batch.events:
            if kind == STORED:
                self._store(feed, h, parent, domain, now)
            else:
                self._remove(feed, h)
        feed.next_seq = batch.seq + 1
        feed.last_seen = now
        return True

    def stale_workers(self, older_than_s: float) -> list[WorkerId]:
        """Workers that have not published for ``older_than_s`` seconds."""
        cutoff = self.clock() - older_than_s
        return [w for w, f in self._feeds.items() if f.last_seen < cutoff]

    # -- internals -------------------------------------------------------------------------
    def _store(self, feed: _Feed, h: BlockHash, parent: BlockHash | None, domain: Domain | None, now: float) -> None:
        if parent == h:  # a lying feed (the wire decoder refuses it): a self-loop would corrupt the trie
            return
        nodes = self._nodes
        shards, shard = nodes.shards, nodes.shards[h[0]]
        node = shard.get(h)
        if node is None:
            if domain is not None:
                domain = self._domains.setdefault(domain, domain)
            p = shards[parent[0]].get(parent) if parent is not None else None
            node = shard[h] = _Node(h, p.key if p is not None else parent, domain, now)
            nodes.size += 1
            self.created += 1
            if p is not None:
                _add_kid(p, None, node)
            elif parent is not None:
                _add_kid(self._orphans, parent, node)
            adopted = self._orphans.pop(h, None)
            if adopted is not None:
                node.children = adopted
        else:
            p = shards[node.parent[0]].get(node.parent) if node.parent is not None else None
        node.last = now
        bit = 1 << feed.slot
        if node.workers & bit:
            return
        node.workers |= bit
        feed.blocks += 1
        if node.parent is None or (p is not None and p.full & bit and p.domain == node.domain):
            self._set_full(node, bit)

    def _set_full(self, node: _Node, bit: int) -> None:
        """Mark ``node`` full for ``bit`` and every descendant run the worker holds below it in
        ``node``'s domain."""
        stack = [node]
        while stack:
            n = stack.pop()
            n.full |= bit
            stack.extend(c for c in _kids(n) if c.workers & bit and not c.full & bit and c.domain == n.domain)

    def _clear_full(self, node: _Node, bit: int) -> None:
        stack = [node]
        while stack:
            n = stack.pop()
            n.full &= ~bit
            stack.extend(c for c in _kids(n) if c.full & bit)

    def _remove(self, feed: _Feed, h: BlockHash) -> None:
        node = self._nodes.get(h)
        bit = 1 << feed.slot
        if node is None or not node.workers & bit:
            return
        node.workers &= ~bit
        feed.blocks -= 1
        if node.full & bit:
            self._clear_full(node, bit)
        if not node.workers:
            self._delete(node)

    def _delete(self, node: _Node) -> None:
        """Unlink an unheld node: its children become orphans filed under its hash."""
        del self._nodes[node.key]
        if node.parent is not None:
            p = self._nodes.get(node.parent)
            if p is not None:
                p.children = self._without(p.children, node)
            else:
                rest = self._without(self._orphans.get(node.parent), node)
                if rest is None:
                    self._orphans.pop(node.parent, None)
                else:
                    self._orphans[node.parent] = rest
        if node.children is not None:
            self._orphans[node.key] = node.children
            node.children = None

    @staticmethod
    def _without(kids, node: _Node):
        if kids is node:
            return None
        if type(kids) is set:
            kids.discard(node)
            if len(kids) == 1:
                return next(iter(kids))
        return kids

    def _sweep(self, slot: int, blocks: int) -> Iterator[int]:
        """Clear ``slot``'s bit from every node, a shard per step (O(nodes): on worker removal or
        a snapshot replacing a worker's holdings); nodes no one holds then go. Frees the slot."""
        bit = 1 << slot
        if blocks:  # a feed's ``blocks`` counts exactly the nodes carrying its bit
            for shard in self._nodes.shards:
                n, empty = 0, []
                for node in shard.values():
                    if node.workers & bit:
                        node.workers &= ~bit
                        node.full &= ~bit
                        n += 1
                        if not node.workers:
                            empty.append(node)
                for node in empty:
                    self._delete(node)
                yield n
        self._slot_owner[slot] = None
        self._owner_cache.clear()
