"""Pulled KV is held for the request it was pulled for until that request is admitted
(engine/import_holds.py): queued behind other work, it is not evicted by the work ahead of it;
holds never stall the queue, and a request that does not come leaves nothing held."""

import asyncio

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
    assert eng.import_prefix(data, 0, chains, "t1", hold_for=rid if hold else None) == 64
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
    assert eng.hold_prefix("r", chains) == 2 and eng.hold_prefix("r", chains) == 0  # once per request
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
    eng.import_prefix(data, 0, chains, "t1", hold_for="bad")
    assert eng.pool.num_in_use() == 4
    with pytest.raises(InvalidRequest):  # more tokens than the pool holds
        eng.add_request(Request("bad", prompt, SamplingParams(max_tokens=1000), tenant="t1"))
    assert eng.pool.num_in_use() == 0 and eng.holds.stats["released"] == 1
    eng.import_prefix(data, 0, chains, "t1", hold_for="gone")  # cached already: nothing new to hold
    assert eng.hold_prefix("gone", chains) == 4
    eng.add_request(Request("gone", prompt, GREEDY, tenant="t1"))
    eng.abort("gone")
    assert eng.pool.num_in_use() == 0 and len(eng.holds) == 0
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


async def test_a_pull_without_room_waits_for_room_while_the_engine_runs():
    """Session 20 (cluster bench): a pull planned to a crowded worker found no room and was
    skipped; its request then computed the prefix again (31 s). Now the plan is asked again while
    the engine runs requests (their blocks free up), and the pull goes when it fits."""
    from actors.worker import Pull, Worker

    w = Worker.__new__(Worker)  # the pull bookkeeping only: no engine, no Ray
    w.config = SMALL
    w._pulling, w.router = [], None
    w.pull_stats = {"joined": 0, "waited_for_room": 0, "skipped_no_room": 0, "rejected_digest": 0}
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
    assert got == (0, 0) and len(plans) == 3
    assert w.pull_stats["waited_for_room"] == 1 and w.pull_stats["skipped_no_room"] == 0
