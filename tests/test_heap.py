"""``actors.heap.HeapFreezer``: the index's and the controller's long-lived heaps leave CPython's
full collections (frozen), dead young cycles are collected before a freeze, garbage that piles up
in the frozen heap is collected once it passes the bound, and both callers freeze as they grow."""

import asyncio
import gc
import weakref

import pytest

from actors.heap import HeapFreezer


class _Node:  # a trie node's shape: tracked, acyclic
    __slots__ = ("kids", "__weakref__")

    def __init__(self):
        self.kids = None


class _Cyclic:
    def __init__(self):
        self.me = self


@pytest.fixture(autouse=True)
def _thawed():
    gc.collect()
    yield
    gc.unfreeze()
    gc.collect()


def _scanned(objs) -> int:
    """How many of ``objs`` a full collection would scan (tracked in a generation, not frozen)."""
    ids = {id(o) for o in objs}
    return sum(1 for o in gc.get_objects() if id(o) in ids)


def test_the_heap_is_frozen_every_so_many_new_objects_and_its_dead_nodes_still_go():
    heap = HeapFreezer(every=1000)
    nodes = [_Node() for _ in range(1500)]
    assert not heap.grew(999) and heap.freezes == 0
    assert _scanned(nodes) == 1500
    assert heap.grew(1) and heap.freezes == 1
    assert _scanned(nodes) == 0  # out of every collection from now on
    young = [_Node() for _ in range(10)]
    assert _scanned(young) == 10  # what came after the freeze is collected as ever
    gone = weakref.ref(nodes[0])
    del nodes[0]  # acyclic: reference counting frees it, frozen or not
    assert gone() is None
    assert not heap.grew(999) and heap.grew(5) and heap.freezes == 2
    assert _scanned(young) == 0


def test_dead_young_cycles_are_collected_before_a_freeze_not_frozen():
    heap = HeapFreezer(every=1)
    c = _Cyclic()
    dead = weakref.ref(c)
    del c
    assert dead() is not None  # a cycle: only the collector frees it
    heap.grew()
    assert dead() is None


def test_garbage_that_piles_up_in_the_frozen_heap_is_collected_past_the_bound():
    clock = [0.0]
    heap = HeapFreezer(every=1, leak_factor=1.0, leak_slack=50, check_s=10.0, clock=lambda: clock[0])
    heap.grew()  # the first check: what is frozen now is the base
    alive = [_Cyclic() for _ in range(100)]  # cycles alive at a freeze ...
    refs = [weakref.ref(c) for c in alive]
    heap.grew()
    del alive  # ... that die later: the collector never scans them while frozen
    clock[0] = 5.0
    heap.grew()  # not checked yet (check_s)
    assert heap.full_collections == 0 and all(r() is not None for r in refs)
    clock[0] = 10.0
    heap.grew()
    assert heap.full_collections == 1 and all(r() is None for r in refs)
    assert heap.stats()["full_collections"] == 1


def test_a_disabled_freezer_and_bad_settings():
    heap = HeapFreezer(every=1, enabled=False)
    assert not heap.grew(10) and heap.freezes == 0 and gc.get_freeze_count() == 0
    for bad in ({"every": 0}, {"leak_factor": 0.5}, {"leak_slack": -1}, {"check_s": -1}):
        with pytest.raises(ValueError):
            HeapFreezer(**bad)


def test_the_index_actor_freezes_its_trie_as_nodes_are_made():
    from actors.index_actor import IndexActor
    from actors.index_publisher import encode_batch
    from engine.block_pool import BlockEvent

    async def run():
        actor = IndexActor(16, freeze_every=64)
        chain = [bytes([k]) * 16 for k in range(100)]
        events = [BlockEvent("stored", h, chain[k - 1] if k else None, "t") for k, h in enumerate(chain)]
        assert (await actor.publish(encode_batch("w0", 0, 16, [], [])))["ok"]
        assert (await actor.publish(encode_batch("w0", 1, 16, events[:50])))["ok"]
        assert (await actor.stats())["heap"]["freezes"] == 0
        assert (await actor.publish(encode_batch("w0", 2, 16, events[50:])))["ok"]
        st = await actor.stats()
        assert st["blocks"] == 100 and st["heap"]["freezes"] == 1
        assert _scanned(actor.index._nodes.values()) == 0
        assert await actor.lookup({"t": chain}) == {"w0": 1600}
        off = IndexActor(16, freeze_every=0)
        assert (await off.publish(encode_batch("w1", 0, 16, [], [(h, e.parent_hash, "t") for h, e in
                                                                   zip(chain, events)])))["ok"]
        assert (await off.stats())["heap"]["freezes"] == 0
    asyncio.run(run())


def test_the_controller_freezes_its_heap_every_so_many_routed_requests():
    from cluster.routing import FREEZE_EVERY, CostAwareRouter
    from cluster.types import WorkerState
    from engine.sequence import Request, SamplingParams

    class _Client:
        async def rank(self, *a, **k):
            return None

        def report(self, *args):
            pass
    states = [WorkerState(f"w{i}", None, info={"num_blocks": 48}) for i in range(2)]
    router = CostAwareRouter("m", 16, index=None, client=_Client(), timeout_s=0.01, freeze_every=3)
    assert CostAwareRouter("m", 16, client=_Client()).heap.every == FREEZE_EVERY
    for i in range(7):
        asyncio.run(router.choose(Request(f"r{i}", tuple(range(40)), SamplingParams(max_tokens=4), tenant="t"), states))
    assert router.heap.freezes == 2
    assert _scanned(list(router.placer.shadows.values())) == 0


def test_the_stall_bench_runs_the_index_and_the_controller_frozen():
    """``bench/heap_stalls.py`` at a tiny size: every call timed, the freezer on as the product
    ships it, the pools' blocks all in the index."""
    from bench.heap_stalls import run_controller, run_index

    row = asyncio.run(run_index(2, 200, True, 0))
    assert row["blocks"] == 2 * 16384 and row["per_request"]["p50_ms"] > 0
    assert row["freezer"]["freezes"] >= 1 and row["fill"]["collections"]["gen2"]["count"] == 0
    plain = asyncio.run(run_index(2, 50, False, 0))
    assert plain["freezer"]["freezes"] == 0
    ctl = asyncio.run(run_controller(4, 20, True, 0))
    assert ctl["part"] == "controller" and ctl["requests"] == 20 and ctl["tracked_without_index"] <= ctl["tracked"]
