"""The global prefix index core (pure) and its wire format / publisher, without Ray."""

import asyncio

import pytest

from actors.index_publisher import IndexPublisher, decode_batch, encode_batch
from actors.prefix_index import REMOVED, STORED, Batch, PrefixIndex, extra_key, prompt_chains
from actors.slot_registry import SlotKey, SlotRegistry
from engine.block_pool import BlockEvent, BlockPool, hash_blocks
from engine.kv_manager import KVManager

BS = 4
MODEL = "m"


def chain(tokens, domain="t1"):
    return hash_blocks(tokens, BS, extra_key(MODEL, domain))


def store_chain(index, worker, tokens, domain="t1", upto=None):
    hs = chain(tokens, domain)[:upto]
    for i, h in enumerate(hs):
        index.stored(worker, h, hs[i - 1] if i else None, domain)
    return hs


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_extra_key_matches_engine():
    pool = BlockPool(4, BS)
    assert KVManager(pool, MODEL).extra_key("acme") == extra_key(MODEL, "acme")


def test_insert_and_lookup_counts_leading_tokens_per_worker():
    idx = PrefixIndex(BS)
    a = list(range(20))  # 5 blocks
    store_chain(idx, "w1", a)
    store_chain(idx, "w2", a, upto=2)
    assert idx.lookup({"t1": chain(a)}) == {"w1": 20, "w2": 8}
    assert idx.lookup({"t1": chain(a)[:3]}) == {"w1": 12, "w2": 8}
    b = a[:8] + [99] * 12  # diverges at block 2
    assert idx.lookup({"t1": chain(b)}) == {"w1": 8, "w2": 8}
    assert idx.lookup({"t1": chain([7] * 20)}) == {}
    assert idx.lookup({"t1": []}) == {} and idx.lookup({}) == {}
    assert len(idx) == 5 and idx.holders(chain(a)[0]) == {"w1", "w2"}


def test_run_ends_at_first_missing_block():
    idx = PrefixIndex(BS)
    a = list(range(20))
    hs = store_chain(idx, "w1", a)
    idx.removed("w1", hs[1])  # a hole: blocks 2.. are not reachable as a prefix
    assert idx.lookup({"t1": hs}) == {"w1": 4}
    assert idx.holders(hs[1]) == set() and len(idx) == 4


def test_remove_and_duplicates_are_idempotent():
    idx = PrefixIndex(BS)
    a = list(range(8))
    hs = store_chain(idx, "w1", a)
    store_chain(idx, "w1", a)  # duplicate stored events
    assert idx.workers()["w1"]["blocks"] == 2
    idx.removed("w1", hs[1])
    idx.removed("w1", hs[1])  # duplicate removed
    idx.removed("w9", hs[0])  # unknown worker
    idx.removed("w1", b"x" * 16)  # unknown block
    assert idx.lookup({"t1": hs}) == {"w1": 4}
    assert idx.workers()["w1"]["blocks"] == 1


def test_share_domain_isolation():
    idx = PrefixIndex(BS)
    a = list(range(12))
    store_chain(idx, "w1", a, domain="acme")
    assert idx.lookup({"globex": chain(a, "globex")}) == {}
    # a chain presented under the wrong domain label never matches, even with the right hashes
    assert idx.lookup({"globex": chain(a, "acme")}) == {}
    assert idx.lookup({"acme": chain(a, "acme")}) == {"w1": 12}


def test_several_readable_domains_count_as_one_prompt():
    idx = PrefixIndex(BS)
    a = list(range(16))
    own, granted = chain(a, "globex"), chain(a, "acme")
    # w1 holds blocks 0,1 under acme (granted) and 2 under globex (own): the same KV
    idx.stored("w1", granted[0], None, "acme")
    idx.stored("w1", granted[1], granted[0], "acme")
    idx.stored("w1", own[2], own[1], "globex")
    idx.stored("w2", own[0], None, "globex")
    assert idx.lookup({"globex": own, "acme": granted}) == {"w1": 12, "w2": 4}
    assert idx.lookup({"globex": own}) == {"w2": 4}


def test_dead_worker_removal_frees_entries_and_slot():
    idx = PrefixIndex(BS)
    a, b = list(range(12)), list(range(100, 112))
    store_chain(idx, "w1", a)
    store_chain(idx, "w2", a)
    store_chain(idx, "w2", b)
    assert idx.remove_worker("w2") == 6
    assert idx.remove_worker("w2") == 0
    assert idx.lookup({"t1": chain(a)}) == {"w1": 12}
    assert idx.lookup({"t1": chain(b)}) == {} and len(idx) == 3
    store_chain(idx, "w3", b)  # reuses w2's slot bit: no stale holder shows up
    assert idx.lookup({"t1": chain(a)}) == {"w1": 12}
    assert idx.lookup({"t1": chain(b)}) == {"w3": 12}


def test_stale_workers_by_last_publish():
    clock = Clock()
    idx = PrefixIndex(BS, clock=clock)
    idx.apply_batch(Batch("w1", 0, BS, snapshot=()))
    clock.t = 5.0
    idx.apply_batch(Batch("w2", 0, BS, snapshot=()))
    clock.t = 11.0
    assert idx.stale_workers(10.0) == ["w1"]


def test_last_access_updated_by_lookup():
    clock = Clock()
    idx = PrefixIndex(BS, clock=clock)
    hs = store_chain(idx, "w1", list(range(8)))
    clock.t = 7.0
    idx.lookup({"t1": hs[:1]})
    assert idx._nodes[hs[0]].last == 7.0 and idx._nodes[hs[1]].last == 0.0


def test_rebuild_from_snapshots_equals_event_history():
    """A fresh index fed only the pools' snapshots answers like the one fed every event."""
    pools = {"w1": BlockPool(8, BS), "w2": BlockPool(8, BS)}
    live = PrefixIndex(BS)
    seqs = {w: 0 for w in pools}
    prompts = [list(range(12)), list(range(8)) + [50] * 4, [9] * 12, list(range(100, 112))]

    def run(w, tokens, domain="t1"):
        pool = pools[w]
        hs = chain(tokens, domain)
        blocks = pool.allocate(len(hs), "t1")
        for i, (b, h) in enumerate(zip(blocks, hs)):
            pool.cache_full_block(b, h, hs[i - 1] if i else None, "t1", domain)
        pool.free(blocks)
        ev = [(STORED if e.kind == "stored" else REMOVED, e.block_hash, e.parent_hash, e.domain)
              for e in pool.take_events()]
        assert live.apply_batch(Batch(w, seqs[w], BS, tuple(ev), () if seqs[w] == 0 else None))
        seqs[w] += 1

    run("w1", prompts[0]); run("w2", prompts[1]); run("w1", prompts[2])  # noqa: E702
    run("w1", prompts[3])  # evicts on w1 (8 blocks)
    rebuilt = PrefixIndex(BS)
    for w, pool in pools.items():
        assert not rebuilt.apply_batch(Batch(w, 7, BS))  # unknown worker: refused, asks for snapshot
        assert rebuilt.apply_batch(Batch(w, 7, BS, snapshot=tuple(pool.cached_hashes())))
    assert len(rebuilt) == len(live)
    for p in prompts:
        assert rebuilt.lookup({"t1": chain(p)}) == live.lookup({"t1": chain(p)})
    assert live.lookup({"t1": chain(prompts[3])}) == {"w1": 12}


def test_sequence_gap_refused_and_snapshot_replaces():
    idx = PrefixIndex(BS)
    a, b = chain(list(range(8))), chain(list(range(50, 58)))
    assert idx.apply_batch(Batch("w1", 0, BS, ((STORED, a[0], None, "t1"),), snapshot=()))
    assert not idx.apply_batch(Batch("w1", 2, BS, ((STORED, a[1], a[0], "t1"),)))  # gap
    assert idx.lookup({"t1": a}) == {"w1": 4}
    # the snapshot replaces everything the worker had (a[0] is gone, b is there)
    assert idx.apply_batch(Batch("w1", 3, BS, snapshot=((b[0], None, "t1"), (b[1], b[0], "t1"))))
    assert idx.lookup({"t1": a}) == {} and idx.lookup({"t1": b}) == {"w1": 8}
    assert idx.apply_batch(Batch("w1", 4, BS, ((REMOVED, b[1], b[0], "t1"),)))
    assert idx.lookup({"t1": b}) == {"w1": 4}


def test_prompt_chains_match_engine_hashes():
    tokens = list(range(18))
    ch = prompt_chains(tokens, BS, MODEL, ["acme", "globex", "acme"])
    assert list(ch) == ["acme", "globex"]
    assert ch["acme"] == chain(tokens[:16], "acme")  # (18 - 1) // 4 = 4 blocks
    assert len(prompt_chains(list(range(16)), BS, MODEL, ["a"])["a"]) == 3


def test_slot_registry():
    clock = Clock()
    reg = SlotRegistry(clock)
    k = SlotKey("translate", "len<=16", "acme")
    reg.register(k, "w1", "s1", 40)
    clock.t = 1
    reg.register(k, "w2", "s9", 40, {"blocks": 3})
    clock.t = 2
    reg.register(SlotKey("translate", "len<=16", "globex"), "w3", "s2", 40)
    assert [e.worker_id for e in reg.lookup("translate", "len<=16", ["acme"])] == ["w2", "w1"]
    assert [e.worker_id for e in reg.lookup("translate", "len<=16", ["acme", "globex"])] == ["w3", "w2", "w1"]
    assert reg.lookup("translate", "len<=32", ["acme"]) == []
    assert reg.lookup("translate", "len<=16", ["initech"]) == []  # domain isolation
    clock.t = 3
    reg.register(k, "w1", "s1", 40)  # re-register refreshes, no duplicate
    assert [e.worker_id for e in reg.lookup("translate", "len<=16", ["acme"])] == ["w1", "w2"]
    assert reg.remove(k, "w1", "s1") == 1 and len(reg) == 2
    assert reg.remove_worker("w2") == 1 and reg.remove_worker("w3") == 1 and len(reg) == 0


def test_wire_roundtrip_and_malformed():
    hs = chain(list(range(8)), "acme")
    events = [BlockEvent("stored", hs[0], None, "acme"), BlockEvent("stored", hs[1], hs[0], "acme"),
              BlockEvent("removed", hs[1], hs[0], "acme")]
    b = decode_batch(encode_batch("w1", 3, BS, events, [(hs[0], None, "acme")]))
    assert b == Batch("w1", 3, BS, ((STORED, hs[0], None, "acme"), (STORED, hs[1], hs[0], "acme"),
                                    (REMOVED, hs[1], hs[0], "acme")), ((hs[0], None, "acme"),))
    assert decode_batch(encode_batch("w1", 4, BS, [])).snapshot is None
    for bad in (b"\xc1", b"\x80", encode_batch("w", 0, BS, [])[:-3]):
        with pytest.raises(ValueError):
            decode_batch(bad)


async def test_publisher_batches_and_resyncs_after_index_restart():
    idx = PrefixIndex(BS)
    pool = BlockPool(8, BS)
    hs = chain(list(range(12)))
    sent = []

    async def drain(full):
        return pool.take_events(), (pool.cached_hashes() if full else None)

    async def send(payload, full):
        sent.append(full)
        return {"ok": idx.apply_batch(decode_batch(payload)), "epoch": "e"}

    pub = IndexPublisher("w1", BS, drain, send, heartbeat_s=0.0)
    blocks = pool.allocate(3, "t1")
    for i, (b, h) in enumerate(zip(blocks, hs)):
        pool.cache_full_block(b, h, hs[i - 1] if i else None, "t1", "t1")
    assert await pub.flush() and sent == [True]  # first batch: snapshot (covers the events)
    pool.free(blocks)
    pool.reset_prefix_cache()  # removes all three: one batch of 3 events
    assert await pub.flush() and sent == [True, False]
    assert idx.lookup({"t1": hs}) == {}
    blocks = pool.allocate(3, "t1")
    for i, (b, h) in enumerate(zip(blocks, hs)):
        pool.cache_full_block(b, h, hs[i - 1] if i else None, "t1", "t1")
    idx = PrefixIndex(BS)  # the index "restarted": the next batch is refused ...
    assert not await pub.flush()
    assert await pub.flush() and sent[-1] is True  # ... and a snapshot rebuilds it
    assert idx.lookup({"t1": hs}) == {"w1": 12}


async def test_publisher_send_failure_forces_snapshot():
    pool = BlockPool(4, BS)
    calls = []

    async def drain(full):
        return pool.take_events(), (pool.cached_hashes() if full else None)

    async def send(payload, full):
        calls.append(full)
        if len(calls) == 2:
            await asyncio.sleep(10)
        return {"ok": True, "epoch": "e"}

    pub = IndexPublisher("w1", BS, drain, send, heartbeat_s=0.0, timeout_s=0.05)
    assert await pub.flush()
    assert not await pub.flush()  # timed out
    assert await pub.flush() and calls == [True, False, True]


async def test_lookup_with_timeout_falls_back_to_none():
    from types import SimpleNamespace

    from actors.index_actor import lookup_with_timeout

    async def never(_chains):
        await asyncio.sleep(10)

    async def fails(_chains):
        raise RuntimeError("index gone")

    async def answers(chains):
        return {"w1": 16 * len(chains["t1"])}

    def fake(fn):
        return SimpleNamespace(lookup=SimpleNamespace(remote=fn))

    assert await lookup_with_timeout(fake(never), {"t1": [b"x"]}, timeout_s=0.01) is None
    assert await lookup_with_timeout(fake(fails), {"t1": [b"x"]}) is None
    assert await lookup_with_timeout(None, {"t1": [b"x"]}) is None
    assert await lookup_with_timeout(fake(answers), {"t1": [b"x", b"y"]}) == {"w1": 32}


def _check_invariants(idx: PrefixIndex, held: set, parent_of: dict) -> None:
    nodes = idx._nodes
    assert set(nodes) == {h for _, h in held}
    for h, node in nodes.items():
        owners = set(idx._owners(node.workers))
        assert owners == {w for w, x in held if x == h}
        full = set()
        for w in owners:
            a = parent_of[h]
            while a is not None and (w, a) in held:
                a = parent_of[a]
            if a is None:
                full.add(w)
        assert set(idx._owners(node.full)) == full, "full = holds the node and every ancestor"
        kids = set(node.children) if type(node.children) is set else {node.children} - {None}
        assert kids == {c for c in nodes.values() if c.parent == h}
    for ph, kids in idx._orphans.items():
        assert ph not in nodes
        kids = kids if type(kids) is set else {kids}
        assert kids == {c for c in nodes.values() if c.parent == ph}


def _random_chains(rng):
    """Twelve chains over three trunks (shared, partly shared, repeated tokens) in two domains,
    and each block's parent and domain."""
    trunks = [list(range(8)), list(range(4)) + [50, 51, 52, 53], [9] * 8]
    chains = [(d, chain(t + [rng.randrange(3)] * 4, d)) for t in trunks for d in ("t1", "t2") for _ in range(2)]
    parent_of, domain_of = {}, {}
    for d, c in chains:
        for i, h in enumerate(c):
            parent_of[h], domain_of[h] = (c[i - 1] if i else None), d
    return chains, parent_of, domain_of


def _model_lookup(held, workers, query):
    """The model's answer: per worker, its run of leading positions held under any chain."""
    want = {}
    n = min(len(q) for q in query.values())
    for w in workers:
        k = 0
        while k < n and any((w, q[k]) in held for q in query.values()):
            k += 1
        if k:
            want[w] = k * BS
    return want


@pytest.mark.parametrize("stepwise", [False, True], ids=["whole", "stepwise"])
@pytest.mark.parametrize("seed", range(6))
def test_random_ops_match_brute_force(seed, stepwise):
    """Stores (in any order), removes, worker removal and snapshot replaces, against a model.
    ``stepwise``: removals and snapshots leave their sweeps (``retire``) to the caller, and those
    advance a few shards at a time, in random order, between the other operations: every lookup
    still matches the model at every point (a removed worker reports nothing, the others their
    exact runs, a worker re-added under the same id only what it stored since), and the
    invariants hold whenever no sweep is under way."""
    import random

    from actors.prefix_index import _RETIRED

    rng = random.Random(seed + 100 * stepwise)
    chains, parent_of, domain_of = _random_chains(rng)
    idx, held, workers, sweeps = PrefixIndex(BS), set(), ["w1", "w2", "w3"], []
    for step in range(300):
        op, w = rng.random(), rng.choice(workers)
        h = rng.choice(list(parent_of))
        if op < 0.55:
            idx.stored(w, h, parent_of[h], domain_of[h])
            held.add((w, h))
        elif op < 0.9:
            idx.removed(w, h)
            held.discard((w, h))
        elif op < 0.95:
            if stepwise:
                sweeps.append(idx.retire(w))
            else:
                idx.remove_worker(w)
            held = {x for x in held if x[0] != w}
        else:
            snap = tuple((x, parent_of[x], domain_of[x]) for x in rng.sample(list(parent_of), 6))
            if stepwise:
                idx.apply_batch(Batch(w, 0, BS, (), snap), sweeps)
            else:
                idx.replace_worker(w, snap)
            held = {x for x in held if x[0] != w} | {(w, x[0]) for x in snap}
        for sweep in rng.sample(sweeps, len(sweeps)):  # each a few shards on
            for _ in range(rng.randrange(1, 60)):
                if next(sweep, None) is None:
                    sweeps.remove(sweep)
                    break
        if step % 10 == 0 and not sweeps:
            _check_invariants(idx, held, parent_of)
        for d, c in chains:
            other = "t2" if d == "t1" else "t1"
            twin = next(c2 for d2, c2 in chains if d2 == other)
            for query in ({d: c}, {d: c, other: twin}):
                assert idx.lookup(query) == _model_lookup(held, workers, query), (step, query)
    for sweep in sweeps:
        for _ in sweep:
            pass
    _check_invariants(idx, held, parent_of)
    assert _RETIRED not in idx._slot_owner  # every slot freed, or a live worker's
    assert {o for o in idx._slot_owner if o is not None} == set(idx._feeds)


def test_the_index_actor_answers_lookups_while_a_removed_worker_is_swept():
    from actors.index_actor import IndexActor
    from actors.prefix_index import _RETIRED

    async def run():
        actor = IndexActor(BS, freeze_every=0)
        a, b = list(range(400)), [7] * 400
        for w, tokens in (("w0", a), ("w1", b)):
            hs = chain(tokens)
            snap = tuple((h, hs[i - 1] if i else None, "t1") for i, h in enumerate(hs))
            assert (await actor.publish(encode_batch(w, 0, BS, [], snap)))["ok"]
        removal = asyncio.get_running_loop().create_task(actor.remove_worker("w0"))
        await asyncio.sleep(0)  # the sweep has begun
        found = await actor.lookup({"t1": chain(a)})
        mid = _RETIRED in actor.index._slot_owner
        assert await removal == 100
        assert mid and found == {}  # answered mid-sweep, without the removed worker
        assert _RETIRED not in actor.index._slot_owner and len(actor.index) == 100
        assert await actor.lookup({"t1": chain(b)}) == {"w1": 400}
        # a snapshot replacing w1's holdings: its old ones are swept in the background
        hs = chain(a)
        snap = tuple((h, hs[i - 1] if i else None, "t1") for i, h in enumerate(hs[:10]))
        assert (await actor.publish(encode_batch("w1", 0, BS, [], snap)))["ok"]
        assert (await actor.stats())["sweeping"] == 1
        assert await actor.lookup({"t1": chain(b)}) == {} and await actor.lookup({"t1": hs}) == {"w1": 40}
        while (await actor.stats())["sweeping"]:
            await asyncio.sleep(0)
        assert len(actor.index) == 10
    asyncio.run(run())
