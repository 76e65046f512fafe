"""Pulled KV is held for the request it was pulled for until that request is admitted
(engine/import_holds.py): queued behind other work, it is not evicted by the work ahead of it;
holds never stall the queue, and a request that does not come leaves nothing held."""

import asyncio
import dataclasses

import pytest

from engine.block_pool import BlockPool
from engine.import_holds import ImportHolds
from engine.llm_engine import EngineConfig, LLMEngine
from engine.sequence import InvalidRequest, Request, SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PREFIX = tuple((7 * i) % 250 + 3 for i in range(64))  # 4 full blocks of 16
SMALL = EngineConfig(model="tiny-llama", num_blocks=12, max_num_batched_tokens=256)


def ids(outs):
    return [t for o in outs for t in o.new_token_ids]


def pulled(tiny_model, prompt):
    """A holder engine that computed ``prompt``'s prefix, and its export of the 4 blocks."""
    holder = LLMEngine(EngineConfig(model="tiny-llama", num_blocks=64), loaded=tiny_model)
    holder.generate([Request("warm", PREFIX + (9,), GREEDY, tenant="t1")])
    chains = holder.prompt_chains(Request("x", prompt, GREEDY, tenant="t1"))
    return chains, holder.export_prefix(chains, 0, 4)


@pytest.mark.parametrize("hold", [True, False])
def test_a_pulled_prefix_survives_the_work_queued_ahead_of_its_request(tiny_model, hold):
    """Blocks pulled for request r land while other requests run; each of them takes 7 of the
    pool's 12 blocks, so plain LRU evicts the idle imported blocks before r is added. Held for r,
    they survive and r is served from them; then the hold is gone and the pool is consistent."""
    prompt = PREFIX + (5, 6, 7)
    chains, data = pulled(tiny_model, prompt)
    eng = LLMEngine(SMALL, loaded=tiny_model)
    rid = "r"
    if hold:
        assert eng.expect_pull(rid, chains) == 0  # nothing cached here yet
    assert eng.import_prefix(data, 0, chains, "t1", hold_for=rid if hold else None) == 64
    assert eng.pull_landed(rid) == hold
    for i in range(3):  # the queue ahead of r: 100-token prompts of their own
        eng.generate([Request(f"o{i}", tuple(200 + (i * 13 + j) % 50 for j in range(100)), GREEDY, tenant="t1")])
    assert eng.held_prefix_tokens(chains) == (64 if hold else 0)
    out = eng.generate([Request(rid, prompt, GREEDY, tenant="t1")])[rid]
    assert out[-1].num_cached_tokens == (64 if hold else 0)
    ref = LLMEngine(SMALL, loaded=tiny_model).generate([Request("ref", prompt, GREEDY, reuse="none")])["ref"]
    assert ids(out) == ids(ref)
    assert len(eng.holds) == 0 and eng.holds.stats["used"] == (1 if hold else 0)
    eng.pool.check_invariants()
    assert eng.pool.num_in_use() == 0


def test_the_local_prefix_a_pull_extends_is_held_too_and_released_with_it(tiny_model):
    prompt = PREFIX + (5, 6, 7)
    eng = LLMEngine(SMALL, loaded=tiny_model)
    eng.generate([Request("half", PREFIX[:33], GREEDY, tenant="t1")])  # caches blocks 0-1 here
    chains = eng.prompt_chains(Request("x", prompt, GREEDY, tenant="t1"))
    assert eng.expect_pull("r", chains) == 2 and eng.expect_pull("r", chains) == 0  # once per request
    assert eng.pool.num_in_use() == 2
    assert eng.release_hold("r") and not eng.release_hold("r")
    assert eng.pool.num_in_use() == 0 and eng.held_prefix_tokens(chains) == 32  # cached still, evictable
    eng.pool.check_invariants()


def test_holds_never_stall_the_queue(tiny_model):
    """A hold for a request that never comes takes room a waiting request needs while nothing
    runs: the engine drops the holds and runs it."""
    prompt = PREFIX + (5, 6, 7)
    chains, data = pulled(tiny_model, prompt)
    eng = LLMEngine(SMALL, loaded=tiny_model)
    eng.expect_pull("never", chains)
    eng.import_prefix(data, 0, chains, "t1", hold_for="never")
    big = Request("big", tuple(200 + j % 50 for j in range(140)), GREEDY, tenant="t1")  # 9 of 12 blocks at once
    out = eng.generate([big])["big"]
    assert out[-1].finished and len(out[-1].new_token_ids) + sum(len(o.new_token_ids) for o in out[:-1]) == 8
    assert eng.holds.stats["starved"] == 1 and len(eng.holds) == 0
    eng.pool.check_invariants()


def test_a_refused_or_aborted_request_leaves_nothing_held(tiny_model):
    prompt = PREFIX + (5, 6, 7)
    chains, data = pulled(tiny_model, prompt)
    eng = LLMEngine(SMALL, loaded=tiny_model)
    eng.import_prefix(data, 0, chains, "t1", hold_for="bad")  # not expected: evictable at once
    assert eng.pool.num_in_use() == 0 and eng.held_prefix_tokens(chains) == 64
    eng = LLMEngine(SMALL, loaded=tiny_model)
    eng.expect_pull("bad", chains)
    eng.import_prefix(data, 0, chains, "t1", hold_for="bad")
    assert eng.pool.num_in_use() == 4
    with pytest.raises(InvalidRequest):  # more tokens than the pool holds
        eng.add_request(Request("bad", prompt, SamplingParams(max_tokens=1000), tenant="t1"))
    assert eng.pool.num_in_use() == 0 and eng.holds.stats["released"] == 1
    eng.import_prefix(data, 0, chains, "t1", hold_for="gone")  # cached already: nothing new to hold
    assert eng.expect_pull("gone", chains) == 4
    eng.add_request(Request("gone", prompt, GREEDY, tenant="t1"))
    eng.abort("gone")
    assert eng.pool.num_in_use() == 0 and len(eng.holds) == 0 and not eng.holds.awaiting
    eng.import_prefix(data, 0, chains, "t1", hold_for="gone")  # a chunk landing after the abort
    assert eng.pool.num_in_use() == 0
    eng.pool.check_invariants()


def test_a_request_queued_while_its_pull_lands_waits_for_it(tiny_model):
    """The request is queued as soon as its pull is planned (its place kept, the transfer
    overlapping the wait): the engine runs the work behind it and admits it only once the pull
    has landed, then it is served from the pulled blocks. Waiting for a pull is no work: an engine
    with nothing else has none (its loop sleeps instead of spinning)."""
    prompt = PREFIX + (5, 6, 7)
    chains, data = pulled(tiny_model, prompt)
    eng = LLMEngine(SMALL, loaded=tiny_model)
    eng.expect_pull("r", chains)
    eng.add_request(Request("r", prompt, GREEDY, tenant="t1"))
    eng.add_request(Request("o", tuple(200 + j % 50 for j in range(20)), SamplingParams(max_tokens=2), tenant="t1"))
    outs = []
    while eng.has_work():
        outs += eng.step()
    assert {o.request_id for o in outs} == {"o"} and outs[-1].finished  # behind r, served first
    assert eng.has_unfinished() and [s.request_id for s in eng.scheduler.waiting] == ["r"]
    assert eng.import_prefix(data, 0, chains, "t1", hold_for="r") == 64
    assert eng.pull_landed("r") and eng.has_work()
    while eng.has_unfinished():
        outs += eng.step()
    mine = [o for o in outs if o.request_id == "r"]
    assert mine[-1].finished and mine[-1].num_cached_tokens == 64
    ref = LLMEngine(SMALL, loaded=tiny_model).generate([Request("ref", prompt, GREEDY, reuse="none")])["ref"]
    assert ids(mine) == ids(ref)
    assert eng.holds.stats["used"] == 1 and len(eng.holds) == 0 and eng.pool.num_in_use() == 0
    eng.pool.check_invariants()


def test_holds_expire():
    now = [0.0]
    pool = BlockPool(8, 16, clock=lambda: now[0])
    holds = ImportHolds(pool, hold_s=10.0, clock=lambda: now[0])
    a, b = pool.allocate(2, "t"), pool.allocate(1, "t")
    holds.add("a", a, referenced=True)
    now[0] = 5.0
    holds.add("b", b, referenced=True)
    holds.add("a", pool.allocate(1, "t"), referenced=True)  # a later chunk keeps the first time
    assert holds.num_blocks() == 4
    now[0] = 10.0
    assert holds.expire() == 1 and "a" not in holds and "b" in holds
    assert pool.num_in_use() == 1 and holds.stats["expired"] == 1
    now[0] = 15.0
    assert holds.expire() == 1 and pool.num_in_use() == 0
    pool.check_invariants()


@pytest.mark.parametrize("hold_s", [60.0, 0.0])
async def test_a_pull_without_room_waits_for_room_while_the_engine_runs(hold_s):
    """Session 20 (cluster bench): a pull planned to a crowded worker found no room and was
    skipped; its request then computed the prefix again (31 s). Now the plan is asked again while
    the engine runs requests (their blocks free up), and the pull goes when it fits.
    ``import_hold_s`` 0 (off): skipped at once, as before."""
    from actors.worker import PULL_STATS, Pull, Worker

    w = Worker.__new__(Worker)  # the pull bookkeeping only: no engine, no Ray
    w.config = dataclasses.replace(SMALL, import_hold_s=hold_s)
    w._pulling, w.router = [], None
    w.pull_stats = dict.fromkeys(PULL_STATS, 0)
    w.pull_timeout_s, w.room_poll_s, w.pull_window, w.pull_chunk_bytes = 30.0, 0.01, 2, 1 << 20
    plans = []

    class _Engine:
        engine = type("E", (), {"cache": type("C", (), {"num_layers": 1, "num_kv_heads": 1, "head_dim": 1,
                                                        "dtype": None, "bytes_per_block": staticmethod(
                                                            lambda *a: 1024)})()})()

        async def call(self, fn):
            plans.append(1)
            room = len(plans) >= 3  # room from the third plan on
            return {"t1": [b"h"] * 4}, 0, (room,), True

    class _Holder:  # has nothing: the pull ends at its first chunk
        class export_prefix:
            @staticmethod
            async def remote(*a):
                return None

    w.engine = _Engine()
    got = await asyncio.wait_for(w._pull(Request("a", PREFIX + (5,), GREEDY, tenant="t1"),
                                         (Pull(_Holder, "n", 0, 4),)), 5)
    assert got == (0, 0)
    if hold_s:
        assert len(plans) == 3 and w.pull_stats["waited_for_room"] == 1 and w.pull_stats["skipped_no_room"] == 0
    else:
        assert len(plans) == 1 and w.pull_stats["waited_for_room"] == 0 and w.pull_stats["skipped_no_room"] == 1


@pytest.mark.parametrize("hold_s", [60.0, 0.0])
async def test_the_request_is_queued_once_its_pull_is_planned_and_freed_once_it_landed(hold_s):
    """``Worker._pull`` sets ``queued`` (the worker then adds the request to the engine) as soon as
    the plan found room, while the KV is still on its way, and tells the engine ``pull_landed``
    after the last chunk's import. ``import_hold_s`` 0: queued only after the pull, as before."""
    from types import SimpleNamespace

    from actors.worker import PULL_STATS, Pull, Worker

    w = Worker.__new__(Worker)  # the pull bookkeeping only: no engine thread, no Ray
    w.config = dataclasses.replace(SMALL, import_hold_s=hold_s)
    w._pulling, w.router = [], None
    w.pull_stats = dict.fromkeys(PULL_STATS, 0)
    w.pull_timeout_s, w.room_poll_s, w.pull_window, w.pull_chunk_bytes = 30.0, 0.01, 2, 1 << 20
    calls = []

    class _E:  # what the plan and the imports ask of the engine
        scheduler = SimpleNamespace(running=[object()])
        cache = SimpleNamespace(num_layers=1, num_kv_heads=1, head_dim=1, dtype=None,
                                bytes_per_block=staticmethod(lambda *a: 1024))
        prompt_chains = staticmethod(lambda r: {"t1": [b"h"] * 4})
        can_import = staticmethod(lambda *a: True)
        held_prefix_tokens = staticmethod(lambda chains: 0)
        expect_pull = staticmethod(lambda rid, chains: calls.append(("expect", rid)))
        pull_landed = staticmethod(lambda rid: calls.append(("landed", rid)))

        @staticmethod
        def import_prefix(data, a, chains, tenant, hold_for=None):
            calls.append(("import", hold_for))
            return 64

    class _Engine:
        engine = _E

        async def call(self, fn):
            return fn(_E)

    arrive = asyncio.Event()

    class _Holder:  # 4 blocks, sent when the test says so
        class export_prefix:
            @staticmethod
            async def remote(*a):
                await arrive.wait()
                return SimpleNamespace(num_blocks=4, nbytes=4096, digest_ok=lambda: True)

    w.engine = _Engine()
    queued = asyncio.Event()
    pull = asyncio.create_task(w._pull(Request("r", PREFIX + (5,), GREEDY, tenant="t1"),
                                       (Pull(_Holder, "n", 0, 4),), queued=queued))
    await asyncio.sleep(0.05)
    assert queued.is_set() == bool(hold_s) and not pull.done()  # queued while its KV is on the way
    arrive.set()
    assert await asyncio.wait_for(pull, 5) == (0, 64) and queued.is_set()
    if hold_s:
        assert calls == [("expect", "r"), ("import", "r"), ("landed", "r")]
    else:
        assert calls == [("import", None)]
