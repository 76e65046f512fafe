"""Regression tests for what bench/faults.py found (issue 13 section 1): fast, loopback, tiny model.

* A holder whose exported KV is damaged after export (in transit, or a lying holder): the puller
  used to import it (the hash chain covers token ids, not KV values) and answer with wrong
  tokens. Pulled chunks now carry a sha256 digest of their content; a mismatch is refused and
  the blocks are recomputed.
* A slow holder: the pull still lands (within the pull timeout) and the output is exact.
* The router actor was not restartable: after its process died the app routed without the
  cost model for the rest of the controller's life. It restarts now, and the pool re-registers
  its workers (``WorkerPool.sync_router``).
"""

import asyncio
import os
import time
from dataclasses import replace

import numpy as np
import pytest

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

from engine.kv_cache import KVBlocks, kv_digest  # noqa: E402
from engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from engine.sequence import Request, SamplingParams  # noqa: E402

CFG = EngineConfig(model="tiny-llama", num_blocks=64, max_num_batched_tokens=256)
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PREFIX = tuple((13 * i) % 250 + 3 for i in range(70))


def ids(outs):
    return [t for o in outs for t in o.new_token_ids]


def test_kv_digest_covers_content_positions_and_hashes():
    k = np.arange(2 * 1 * 4 * 2 * 3, dtype=np.float32).reshape(2, 1, 4, 2, 3)
    data = KVBlocks(k, k + 1, (0,), "m", (b"h" * 32,)).with_digest()
    assert data.digest_ok() and data.digest == kv_digest(data)
    assert not KVBlocks(k, k + 1, (0,), "m", (b"h" * 32,)).digest_ok()  # no digest: refused
    bad = k.copy()
    bad[1, 0, 3, 1, 2] += 0.5
    assert not replace(data, k=bad).digest_ok()
    assert not replace(data, positions=(16,)).digest_ok()
    assert not replace(data, hashes=(b"x" * 32,)).digest_ok()
    assert not replace(data, model_id="other").digest_ok()


def test_corrupt_kv_would_change_the_output_without_the_digest(tiny_model):
    """Why the digest is needed: the engine's import checks hashes, model and positions only, so
    damaged KV imports and the greedy output changes (the bug the bench found)."""
    a, b = LLMEngine(CFG, loaded=tiny_model), LLMEngine(CFG, loaded=tiny_model)
    a.generate([Request("warm", PREFIX + (9,), GREEDY, tenant="t1")])
    prompt = PREFIX + (5, 6, 7)
    req = Request("r", prompt, GREEDY, tenant="t1")
    chains = b.prompt_chains(req)
    data = a.export_prefix(chains, 0, 4)
    k = data.k.copy()
    k.reshape(-1)[:: max(1, k.size // 64)] += 1
    assert b.import_prefix(replace(data, k=k * 50), 0, chains, "t1") == 64
    ref = LLMEngine(CFG, loaded=tiny_model).generate([Request("ref", prompt, GREEDY, reuse="none")])["ref"]
    assert ids(b.generate([req])["r"]) != ids(ref)


@pytest.mark.ray
def test_pulls_from_a_corrupt_or_slow_holder_stay_exact(tiny_model):
    import ray

    from actors.worker import Pull, worker_actor_class

    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        W = worker_actor_class(num_gpus=0, num_cpus=0)
        holder, target = W.remote("h", CFG), W.remote("t", CFG)
        ray.get([holder.ready.remote(), target.ready.remote()])

        def case(n: int):
            prefix = tuple((17 * i + n) % 250 + 3 for i in range(70))
            ray.get(holder.generate_all.remote(Request(f"warm{n}", prefix + (9, 9), GREEDY, tenant="t1")))
            prompt = prefix + (5, 6, 7)
            ref = ray.get(target.generate_all.remote(Request(f"ref{n}", prompt, GREEDY, tenant="t1", reuse="none")))
            outs = ray.get(target.generate_all.remote(Request(f"r{n}", prompt, GREEDY, tenant="t1"),
                                                      (Pull(holder, "n", 0, 4),)), timeout=60)
            return outs, ids(ref)

        outs, ref = case(0)  # healthy holder: pulled, exact
        assert outs[-1].route == "pulled" and outs[-1].pulled_tokens == 64 and ids(outs) == ref

        ray.get(holder.set_faults.remote(["export_corrupt"]))
        outs, ref = case(1)
        assert outs[-1].route == "recomputed" and outs[-1].pulled_tokens == 0
        assert ids(outs) == ref
        st = ray.get(target.stats.remote())
        assert st["pulls"]["rejected_digest"] == 1
        assert ray.get(holder.stats.remote())["faults"]["exports_faulted"] == 1
        books = ray.get(target.pool_accounting.remote())
        assert books["in_use"] == 0 and books["invariants"] is None
        assert books["free"] + books["cached_idle"] == books["total"]

        ray.get(holder.set_faults.remote(["export_slow:0.5"]))
        t0 = time.monotonic()
        outs, ref = case(2)
        assert time.monotonic() - t0 >= 0.5
        assert outs[-1].route == "pulled" and outs[-1].pulled_tokens == 64 and ids(outs) == ref

        # a holder slower than the pull's own deadline (set by the router from its estimates):
        # the target stops waiting at the deadline, not at its 30 s pull timeout, and recomputes
        ray.get(holder.set_faults.remote(["export_slow:60"]))
        prefix = tuple((17 * i + 3) % 250 + 3 for i in range(70))
        ray.get(holder.generate_all.remote(Request("warm3", prefix + (9, 9), GREEDY, tenant="t1")))
        t0 = time.monotonic()
        outs = ray.get(target.generate_all.remote(Request("r3", prefix + (5, 6, 7), GREEDY, tenant="t1"),
                                                  (Pull(holder, "n", 0, 4, timeout_s=1.0),)), timeout=60)
        assert time.monotonic() - t0 < 25  # gave up at its 1 s deadline, not at the worker's 30 s pull timeout
        assert outs[-1].route == "recomputed" and outs[-1].pulled_tokens == 0
        ref = ray.get(target.generate_all.remote(Request("ref3", prefix + (5, 6, 7), GREEDY, tenant="t1",
                                                         reuse="none")))
        assert ids(outs) == ids(ref)

        # a second request of the group sent here without pulls while the first one's pull is in
        # flight (the router counts a routed prefix as held at once) waits for that pull and reuses
        # it, instead of computing the prefix again; another tenant's request does not wait
        ray.get(holder.set_faults.remote(["export_slow:3"]))
        prefix = tuple((17 * i + 4) % 250 + 3 for i in range(70))
        ray.get(holder.generate_all.remote(Request("warm4", prefix + (9, 9), GREEDY, tenant="t1")))
        first = target.generate_all.remote(Request("r4", prefix + (5, 6, 7), GREEDY, tenant="t1"),
                                           (Pull(holder, "n", 0, 4),))
        time.sleep(1.0)
        other = ray.get(target.generate_all.remote(Request("r6", prefix + (8, 8), GREEDY, tenant="t2")), timeout=60)
        second = ray.get(target.generate_all.remote(Request("r5", prefix + (8, 8), GREEDY, tenant="t1")), timeout=60)
        firsts = ray.get(first, timeout=60)
        assert firsts[-1].route == "pulled" and firsts[-1].pulled_tokens == 64
        assert second[-1].route == "local" and second[-1].num_cached_tokens == 64
        assert other[-1].route == "recomputed" and other[-1].num_cached_tokens == 0
        assert ray.get(target.stats.remote())["pulls"]["joined"] == 1
        ray.get(holder.set_faults.remote([]))
    finally:
        if started:
            ray.shutdown()


async def test_a_pull_is_joinable_while_its_plan_waits_for_a_busy_engine():
    """Session 20 (cluster bench, multi-tenant): a request of a prefix routed, 0.35 s after another
    planned to pull that prefix to the same worker, ran with nothing cached: the pull became
    visible to joiners only after its plan's engine call, which waits for the step in progress
    (seconds on a slow host). Now it is registered first: the second request waits for the pull,
    until the pull ends (here: planned, found no room, ended)."""
    from actors.worker import PULL_STATS, Pull, Worker

    w = Worker.__new__(Worker)  # the pull bookkeeping only: no engine, no Ray
    w.config = CFG
    w._pulling, w.router = [], None
    w.pull_stats = dict.fromkeys(PULL_STATS, 0)
    w.pull_timeout_s, w.room_poll_s = 30.0, 0.01
    engine_busy = asyncio.Event()

    class _Engine:  # the plan's call waits for the "step in progress"
        async def call(self, fn):
            await engine_busy.wait()
            return {"t1": [b"h"] * 4}, 0, (False,), False  # the prompt's chains, nothing held, no room, idle

    w.engine = _Engine()
    first = Request("a", PREFIX + (5,), GREEDY, tenant="t1")
    pulling = asyncio.create_task(w._pull(first, (Pull(None, "n", 0, 4),)))
    await asyncio.sleep(0.05)
    joiner = asyncio.create_task(w._join_pull(Request("b", PREFIX + (6,), GREEDY, tenant="t1")))
    stranger = asyncio.create_task(w._join_pull(Request("c", PREFIX + (6,), GREEDY, tenant="t2")))
    await asyncio.sleep(0.05)
    assert stranger.done() and not joiner.done()  # another tenant's request does not wait
    assert w.pull_stats["joined"] == 1
    engine_busy.set()
    assert await pulling == (0, 0)  # no room: skipped, nothing imported
    await asyncio.wait_for(joiner, 5)  # ... and the joiner goes ahead once the pull has ended
    assert w._pulling == []
    # a pull of blocks 2-4 (blocks 0-1 held here already): a prompt that shares only blocks 0-1
    # goes ahead, one that shares block 2 waits (chat turns sharing a system prompt, session 28)
    engine_busy.clear()
    deeper = asyncio.create_task(w._pull(Request("d", PREFIX + (5,), GREEDY, tenant="t1"), (Pull(None, "n", 2, 4),)))
    await asyncio.sleep(0.05)
    bs = CFG.block_size
    sharing_held = asyncio.create_task(w._join_pull(Request("e", PREFIX[:2 * bs] + (7,) * 40, GREEDY, tenant="t1")))
    sharing_pulled = asyncio.create_task(w._join_pull(Request("f", PREFIX[:3 * bs] + (7,) * 40, GREEDY, tenant="t1")))
    await asyncio.sleep(0.05)
    assert sharing_held.done() and not sharing_pulled.done() and w.pull_stats["joined"] == 2
    # a request with pulls of its own: one from block 3 expects block 2 here, which the pull in
    # flight brings, so it waits (session 30: it ran with nothing cached while the first still
    # waited for its pull); one pulling from block 2 on brings its own and goes ahead
    own_from_3 = asyncio.create_task(w._join_pull(Request("g", PREFIX[:4 * bs] + (7,) * 8, GREEDY, tenant="t1"), 3))
    own_from_2 = asyncio.create_task(w._join_pull(Request("h", PREFIX[:4 * bs] + (7,) * 8, GREEDY, tenant="t1"), 2))
    await asyncio.sleep(0.05)
    assert own_from_2.done() and not own_from_3.done() and w.pull_stats["joined"] == 3
    engine_busy.set()
    assert await deeper == (0, 0)
    await asyncio.wait_for(sharing_pulled, 5)
    await asyncio.wait_for(own_from_3, 5)


@pytest.mark.ray
def test_router_actor_restarts_and_the_pool_re_registers_its_workers():
    import ray

    from actors.router import RouterClient, get_or_create_router
    from cluster.pool import PoolConfig, WorkerPool, WorkerState

    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        router = get_or_create_router(app="faults-test")
        pid = ray.get(router.__ray_call__.remote(lambda self: os.getpid()))
        pool = WorkerPool(PoolConfig(app="faults-test", cost_aware_routing=False))
        pool._router_client = client = RouterClient(router, timeout_s=10.0)
        pool.workers = {"w0": WorkerState("w0", None, info={"node_id": "n0"}),
                        "w1": WorkerState("w1", None, info={"node_id": "n1"}),
                        "w2": WorkerState("w2", None)}  # still starting: not registered
        pool.sync_router()
        assert ray.get(router.estimates.remote())["nodes"] == {"w0": "n0", "w1": "n1"}
        os.kill(pid, 9)
        deadline = time.monotonic() + 60
        while True:  # the same handle answers again once Ray restarted the actor
            try:
                nodes = ray.get(router.estimates.remote(), timeout=10)["nodes"]
                break
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                assert time.monotonic() < deadline, "the router actor did not come back"
                time.sleep(0.2)
        assert ray.get(router.__ray_call__.remote(lambda self: os.getpid())) != pid
        assert nodes == {}  # restarted empty ...
        pool.sync_router()  # ... and the tick does not resend an unchanged set ...
        assert ray.get(router.estimates.remote())["nodes"] == {}
        pool.sync_router(force=True)  # ... but a forced sync (a restart seen) does
        assert ray.get(router.estimates.remote())["nodes"] == {"w0": "n0", "w1": "n1"}
        assert ray.get(router.sync_workers.remote({"w0": "n0"})) == 0  # idempotent
        for sample in [(32, 0.3, 0), (256, 2.0, 0), (40, 0.4, 512)]:  # w0's calibration and a request
            pool._report_prefill(pool.workers["w0"], sample)
        fitted = ray.get(router.estimates.remote())["prefill"]
        assert fitted["w0"] != fitted["w1"]  # w0 fitted to its samples, w1 on the prior

        # with coalesced reports the pool notices a restart from the epoch of the next answer
        async def rank_after_restart():
            batched = RouterClient(router, timeout_s=10.0, flush_s=0.05)
            pool._router_client = batched
            batched.on_restart = pool._router_restarted
            assert await batched.rank(64, {}, ["w0", "w1"]) is not None  # first epoch seen
            os.kill(ray.get(router.__ray_call__.remote(lambda self: os.getpid())), 9)
            deadline = time.monotonic() + 60
            while await batched.rank(64, {}, ["w0", "w1"]) is None:  # None while it restarts
                assert time.monotonic() < deadline, "the router actor did not come back"
                await asyncio.sleep(0.2)
            await asyncio.sleep(0.3)  # the forced sync rides on the next flush (flush_s)
            return ray.get(router.estimates.remote())

        est = asyncio.run(rank_after_restart())
        assert est["nodes"] == {"w0": "n0", "w1": "n1"}
        assert est["prefill"] == fitted  # w0's samples replayed: the same fit, not the prior
        assert client.calls >= 2
        ray.kill(router)
    finally:
        if started:
            ray.shutdown()


def test_a_tenant_with_an_assigned_worker_may_still_use_idle_shared_workers():
    """Found by bench/faults.py: one tenant under steady load (demand < target_tokens_per_worker)
    got one assigned worker and all its requests queued there while the other ready workers
    (shared, e.g. a replacement for a killed worker) served nothing."""
    from cluster.pool import PoolConfig, WorkerPool, WorkerState

    pool = WorkerPool(PoolConfig(cost_aware_routing=False))
    info = {"node_id": "n"}
    pool.workers = {"w0": WorkerState("w0", None, info, tenant="acme"),
                    "w1": WorkerState("w1", None, info),
                    "w2": WorkerState("w2", None, info, tenant="globex"),
                    "w3": WorkerState("w3", None, None)}  # starting
    pool.workers["w0"].inflight = pool.workers["w2"].inflight = 1
    # a request waits there for its first token: not lent (lend_workers "unqueued": while none waits, it is)
    pool.workers["w0"].queued["a1"] = pool.workers["w2"].queued["g1"] = 100
    assert [w.worker_id for w in pool.candidates("acme")] == ["w0", "w1"]
    assert [w.worker_id for w in pool.candidates("initech")] == ["w1"]  # never another tenant's queued worker
    pool.workers["w1"].draining = True
    assert [w.worker_id for w in pool.candidates("acme")] == ["w0"]
    assert [w.worker_id for w in pool.candidates("initech")] == ["w0", "w2"]  # nothing shared or lendable: any
