"""Tenant-aware autoscaling: the pure policy, then the worker pool on Ray with tiny-llama workers."""

import asyncio
import os

import pytest

from policies.autoscale import AutoscaleConfig, ScaleDecision, TenantAutoscaler, TenantDemand, TenantShare, allocate

CFG = AutoscaleConfig(min_workers=1, max_workers=4, target_tokens_per_worker=100, downscale_delay_s=10)


def d(tokens):
    return TenantDemand(queued_tokens=tokens)


def test_idle_pool_keeps_guaranteed_workers_and_the_minimum():
    dec = allocate({}, {"a": TenantShare(0, 3), "b": TenantShare(1)}, CFG)
    assert dec == ScaleDecision(1, (("b", 1),))
    assert allocate({}, {"a": TenantShare(0)}, CFG) == ScaleDecision(1, ())


def test_demand_sizes_workers_in_token_units_capped_by_tenant_max():
    shares = {"a": TenantShare(0, 2), "b": TenantShare(0)}
    assert allocate({"a": d(150)}, shares, CFG).allocation == (("a", 2),)
    assert allocate({"a": d(10_000)}, shares, CFG).allocation == (("a", 2),)  # tenant cap
    assert allocate({"b": d(10_000)}, shares, CFG).allocation == (("b", 4),)  # pool cap
    assert allocate({"b": TenantDemand(50, 60)}, shares, CFG).allocation == (("b", 2),)  # queued + running


def test_a_burst_never_takes_another_tenants_guarantee():
    shares = {"a": TenantShare(0), "b": TenantShare(1), "c": TenantShare(1)}
    dec = allocate({"a": d(10_000)}, shares, CFG)
    assert dec.target == 4 and dec.allocation == (("a", 2), ("b", 1), ("c", 1))


def test_contended_extra_workers_go_max_min_fair():
    shares = {"a": TenantShare(0), "b": TenantShare(0)}
    dec = allocate({"a": d(10_000), "b": d(10_000)}, shares, CFG)
    assert dec.allocation == (("a", 2), ("b", 2))
    dec = allocate({"a": d(10_000), "b": d(150)}, shares, CFG)
    assert dec.allocation == (("a", 2), ("b", 2))
    dec = allocate({"a": d(10_000), "b": d(50)}, shares, CFG)
    assert dec.allocation == (("a", 3), ("b", 1))


def test_guarantees_that_do_not_fit_are_a_config_error():
    with pytest.raises(ValueError, match="exceed"):
        TenantAutoscaler(CFG, {"a": TenantShare(3), "b": TenantShare(2)})
    with pytest.raises(ValueError):
        AutoscaleConfig(min_workers=3, max_workers=2)


def test_hysteresis_up_after_delay_down_after_delay_to_window_peak():
    s = TenantAutoscaler(AutoscaleConfig(1, 4, 100, upscale_delay_s=1, downscale_delay_s=10), {})
    assert s.decide(1, {"a": d(400)}, now=0).target == 1  # wants 4, waits upscale_delay
    assert s.decide(1, {"a": d(400)}, now=1).target == 4
    assert s.decide(4, {"a": d(150)}, now=2).target == 4  # wants 2: wait
    assert s.decide(4, {}, now=5).target == 4
    dec = s.decide(4, {}, now=12)
    assert dec.target == 2  # the peak wanted during the window
    assert dec.allocation == ()  # allocation follows demand at once
    assert s.decide(2, {}, now=13).target == 2
    assert s.decide(2, {}, now=23).target == 1
    # a renewed burst cancels a pending downscale
    assert s.decide(1, {"a": d(400)}, now=24).target == 1
    assert s.decide(1, {"a": d(400)}, now=25).target == 4


# -- the pool on Ray ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ray_local():
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    if started:
        ray.shutdown()


def _req(rid, tenant, n_prompt=40, max_tokens=120):
    from engine.sequence import Request, SamplingParams

    ids = tuple(3 + (i * 7 + len(rid)) % 250 for i in range(n_prompt))
    return Request(rid, ids, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), tenant=tenant)


async def _drain(pool, req, seen):
    async for ws, _, out in pool.generate(req):
        seen[req.request_id] = ws.worker_id
    return out


@pytest.mark.ray
async def test_burst_scales_up_within_bounds_keeps_guarantee_and_scales_back(ray_local):
    from cluster.pool import PoolConfig, WorkerPool
    from engine.llm_engine import EngineConfig

    cfg = PoolConfig(engine=EngineConfig(model="tiny-llama", kv_cache_bytes=8 << 20, max_num_seqs=8),
                     autoscale=AutoscaleConfig(min_workers=1, max_workers=3, target_tokens_per_worker=256,
                                               downscale_delay_s=5.0, interval_s=0.05),
                     shares=(("burst", TenantShare(0, 2)), ("steady", TenantShare(1))),
                     # lent only while idle, the rule the bound below is about: with the default
                     # ("unqueued") a guest follows another once the first has its first token, so
                     # how many land there depends on the machine's speed (lending: test_placement)
                     worker_num_cpus=0, lend_workers="idle")
    pool = WorkerPool(cfg)
    await pool.start(autoscale=False)
    try:
        assert await pool.wait_ready(120)
        assert len(pool.active()) == 1 and pool.assignment() == {"steady": ["w0"]}
        seen: dict[str, str] = {}
        # wave 1: the burst arrives while only the steady tenant's worker exists
        wave1 = [asyncio.create_task(_drain(pool, _req(f"b1-{i}", "burst"), seen)) for i in range(6)]
        while sum(f.started for f in pool._flights.values()) < 1:
            await asyncio.sleep(0.01)
        dec = await pool.autoscale_once(now=100.0)
        assert dec.target == 3 and dict(dec.allocation) == {"burst": 2, "steady": 1}  # pool max, not 6x
        assert len(pool.active()) == 3
        assignment = pool.assignment()
        assert assignment["steady"] == ["w0"] and sorted(assignment["burst"]) == ["w1", "w2"]
        while sum(w.info is not None for w in pool.active()) < 3:
            await asyncio.sleep(0.05)
        # wave 2 of the burst lands on the burst tenant's workers (steady's only while idle); steady keeps its worker
        wave2 = [asyncio.create_task(_drain(pool, _req(f"b2-{i}", "burst"), seen)) for i in range(4)]
        steady = asyncio.create_task(_drain(pool, _req("s-0", "steady", max_tokens=20), seen))
        dec = await pool.autoscale_once(now=101.0)
        assert dec.target == 3 and len(pool.active()) == 3  # still within bounds under more demand
        burst_owned = set(pool.assignment().get("burst", []))
        outs = await asyncio.gather(*wave1, *wave2, steady)
        assert all(o.finished and o.finish_reason == "length" for o in outs)
        # the burst's own workers, and steady's only while it was idle: one request at most
        assert sum(seen[f"b2-{i}"] not in ("w1", "w2") for i in range(4)) <= 1
        # steady runs on its own worker or a shared one (spare capacity), never on burst's
        assert seen["s-0"] not in burst_owned and pool.assignment()["steady"] == ["w0"]
        # after the burst: no scale-down before the delay, then back to the steady guarantee
        assert (await pool.autoscale_once(now=102.0)).target == 3
        dec = await pool.autoscale_once(now=108.0)
        assert dec.target == 1 and dict(dec.allocation) == {"steady": 1}
        assert sorted(pool.workers) == ["w0"] and pool.assignment() == {"steady": ["w0"]}
        assert all(w.inflight == 0 for w in pool.workers.values())
    finally:
        await pool.close()
