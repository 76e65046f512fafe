"""A worker whose engine loop died is reported unhealthy and replaced; requests go on elsewhere.
A router actor killed for good is replaced too.

Real worker actors (tiny-llama) in a local Ray instance. The engine thread is ended with the
worker's ``set_faults(["engine_death"])`` hook while the actor process stays alive (the case
that looked healthy before: its load read 0 and routing preferred it).
"""

import asyncio

import pytest

pytestmark = pytest.mark.ray


def _req(rid, max_tokens=4):
    from engine.sequence import Request, SamplingParams

    return Request(rid, tuple(range(3, 40)), SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                   tenant="acme")


async def _run(pool, rid, max_tokens=4):
    outs = [out async for _, _, out in pool.generate(_req(rid, max_tokens))]
    assert outs[-1].finished and outs[-1].num_output_tokens == max_tokens
    return outs


async def _wait_ready(pool, n, timeout=240):
    for _ in range(timeout * 10):
        if sum(w.routable for w in pool.workers.values()) >= n:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"only {[w.worker_id for w in pool.workers.values() if w.routable]} ready")


async def _wait_retired(pool, worker_id, timeout=30):
    for _ in range(timeout * 10):
        if worker_id not in pool.workers:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"{worker_id} was never retired")


def _with_pool(body, health_interval_s: float, cost_aware: bool = False) -> None:
    """Run ``await body(pool)`` on a started 2-worker tiny-llama pool (both ready) in a local Ray;
    the pool is closed and Ray shut down whatever happens."""
    import ray

    from cluster.pool import PoolConfig, WorkerPool
    from engine.llm_engine import EngineConfig
    from policies.autoscale import AutoscaleConfig

    ray.init(address="local", num_cpus=3, include_dashboard=False, log_to_driver=False)

    async def main():
        cfg = PoolConfig(engine=EngineConfig(model="tiny-llama", num_blocks=64), cost_aware_routing=cost_aware,
                         autoscale=AutoscaleConfig(min_workers=2, max_workers=2), worker_num_cpus=0,
                         worker_num_gpus=0, health_interval_s=health_interval_s)
        pool = WorkerPool(cfg)
        await pool.start(autoscale=False)
        try:
            await _wait_ready(pool, 2)
            await body(pool)
        finally:
            await pool.close()

    try:
        asyncio.run(main())
    finally:
        ray.shutdown()


def test_dead_engines_are_detected_idle_and_mid_stream_and_replaced():
    from cluster.pool import WorkerDied
    from engine.async_engine import EngineDead

    async def body(pool):
        w0, w1 = sorted(pool.workers)
        # 1. an idle worker's engine dies: health fails, the pool replaces it
        await pool.workers[w0].actor.set_faults.remote(["engine_death"])
        with pytest.raises(EngineDead):
            await pool.workers[w0].actor.health.remote()
        assert await pool.check_health() == [w0]
        assert w0 not in pool.workers and len(pool.workers) == 2
        await _wait_ready(pool, 2)
        for i in range(4):
            outs = await _run(pool, f"after-idle-{i}")
        assert {w for w in pool.workers} != {w0, w1}
        # 2. a worker's engine dies mid-decode: that stream fails (503-class), the worker is
        # replaced at once, and the next requests are served by the healthy ones
        stream = pool.generate(_req("victim", max_tokens=900))
        async for target, _, out in stream:
            await target.actor.set_faults.remote(["engine_death"])
            break
        with pytest.raises(WorkerDied, match="engine"):
            async for _ in stream:
                pass
        await stream.aclose()
        assert target.worker_id not in pool.workers and target.dead
        await _wait_ready(pool, 2)
        served = {}
        for i in range(4):
            outs = await _run(pool, f"after-stream-{i}")
            served[i] = outs[-1]
        assert all(w.inflight == 0 for w in pool.workers.values())
        for w in pool.workers.values():
            s = await w.actor.stats.remote()
            assert s["free_blocks"] == s["num_blocks"] and s["running"] == 0

    _with_pool(body, health_interval_s=0)  # health checks driven by the test


def test_the_death_watch_replaces_a_dead_engine_without_polling():
    """``health_interval_s`` an hour: the pool never asks ``health``; only the pending
    ``watch_engine`` call (the worker checks its engine locally) reports the death."""
    import ray

    async def body(pool):
        w0, w1 = sorted(pool.workers)
        await pool.workers[w0].actor.set_faults.remote(["engine_death"])
        await _wait_retired(pool, w0)  # retired by the watch, within seconds
        await _wait_ready(pool, 2)  # and replaced
        assert w1 in pool.workers and len(pool.workers) == 2
        outs = await _run(pool, "after-watch")
        assert outs[-1].finished
        # a worker killed outright: the watch sees ActorDiedError and replaces it too
        victim = pool.workers[w1]
        ray.kill(victim.actor)
        await _wait_retired(pool, w1)
        await _wait_ready(pool, 2)

    _with_pool(body, health_interval_s=3600.0)


def test_a_router_killed_for_good_is_replaced_and_routing_is_cost_aware_again():
    # e.g. an older pool of the app, closing while this one started, killed the router this one
    # had just looked up by name: Ray never restarts it, and routing stayed on power of two
    import ray

    from actors.router import ROUTER_NAMESPACE, router_name

    async def body(pool):
        await _run(pool, "before")
        dead = pool._router_actor
        ray.kill(dead, no_restart=True)
        for _ in range(300):  # ray.kill only asks: wait until the actor is gone
            try:
                await asyncio.wait_for(dead.metrics.remote(), 5)
            except ray.exceptions.ActorDiedError:
                break
            except Exception:  # noqa: BLE001 - still going down
                pass
            await asyncio.sleep(0.1)
        for i in range(100):
            await _run(pool, f"after-{i}")  # served throughout (by the fallback until replaced)
            if pool._router_actor._actor_id != dead._actor_id and not pool._router_replacing:
                break
            await asyncio.sleep(0.1)
        new = ray.get_actor(router_name(pool.config.app or None), namespace=ROUTER_NAMESPACE)
        assert new._actor_id == pool._router_actor._actor_id != dead._actor_id
        # the new router knows the workers again and answers the pool's questions
        for _ in range(100):
            if set((await new.estimates.remote())["nodes"]) == set(pool.workers):
                break
            await asyncio.sleep(0.1)
        assert set((await new.estimates.remote())["nodes"]) == set(pool.workers)
        fallbacks = sum(n for k, n in pool.router.placements.items() if "fallback" in k)
        await _run(pool, "routed")
        assert sum(n for k, n in pool.router.placements.items() if "fallback" in k) == fallbacks

    _with_pool(body, health_interval_s=0.5, cost_aware=True)
