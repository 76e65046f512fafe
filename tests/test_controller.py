"""Ingress scale-out: two Serve ingress replicas share one controller actor and one set of workers.

Tiny model on Ray Serve (127.0.0.1). The tests run in order on one app: sharing, a vanished
client's lease reclaimed, a disconnect mid-stream, a configuration mismatch, then deleting the
app stops the controller and its workers. Before them, pool-level tests with fake worker actors
(no Ray cluster): an unreachable worker is kept, close waits for its killed actors to be dead,
stats are asked concurrently, the GPU count is resolved by the controller only.
"""

import asyncio
import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from tests.serving import local_serve

pytestmark = pytest.mark.ray

TINY = "tiny-llama"
APP = "scaled"
TTL_S = 3.0
TENANTS = {"admin_keys": ["sk-admin"], "tenants": [
    {"name": "acme", "api_keys": ["sk-acme"]},
    {"name": "solo", "api_keys": ["sk-solo"]},
    {"name": "ghost", "api_keys": ["sk-ghost"], "limits": {"max_concurrent": 1}},
]}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    import ray

    from cluster.app import AppSettings, KvmeshIngress
    from cluster.controller import NAMESPACE, controller_name

    with local_serve(TENANTS, tmp_path_factory.mktemp("tenants")) as (base, path, serve):
        settings = AppSettings.from_args({"model": TINY, "tenants": str(path), "kv_cache_bytes": 16 << 20,
                                          "worker_num_cpus": 0, "client_ttl_s": TTL_S})
        serve.run(KvmeshIngress.options(num_replicas=2).bind(dataclasses.asdict(settings), TENANTS),
                  name=APP, route_prefix="/")
        ctl = ray.get_actor(controller_name(APP), namespace=NAMESPACE)
        yield {"base": base, "settings": settings, "ctl": ctl, "ray": ray, "serve": serve}


def http(cluster):
    return httpx.Client(base_url=cluster["base"], timeout=120)


def snapshot(cluster) -> dict:
    return cluster["ray"].get(cluster["ctl"].snapshot.remote(), timeout=30)


def complete(cluster, prompt, key="sk-acme", max_tokens=4):
    return http(cluster).post("/v1/completions", headers={"Authorization": f"Bearer {key}"},
                              json={"model": TINY, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})


def wait_until(pred, what, timeout_s=60.0):
    """Poll ``pred`` until it returns something truthy (bounded); returns that value."""
    deadline = time.monotonic() + timeout_s
    while not (got := pred()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
    return got


def _controller_gone(ray, app: str) -> bool:
    from cluster.controller import NAMESPACE, controller_name

    try:
        ray.get_actor(controller_name(app), namespace=NAMESPACE)
        return False
    except ValueError:
        return True


# -- pool-level: fake worker actors, no cluster ----------------------------------------------------
class _Method:
    def __init__(self, fn):
        self.remote = fn


class _Refs:
    """A worker's streaming generator whose next ref raises ``error`` when awaited."""

    def __init__(self, error: Exception):
        self.error = error

    def __aiter__(self):
        return self

    async def __anext__(self):
        async def ref():
            raise self.error
        return ref()


class _FakeWorker:
    def __init__(self, error: Exception):
        self.generate = _Method(lambda *args: _Refs(error))
        self.abort = _Method(lambda request_id: None)


def _request(rid: str):
    from engine.sequence import Request, SamplingParams

    return Request(rid, tuple(range(3, 23)), SamplingParams(max_tokens=4, temperature=0), tenant="acme")


async def _drain(stream) -> None:
    async for _ in stream:
        pass


async def test_an_unreachable_worker_fails_the_request_with_503_but_stays_in_the_pool(monkeypatch):
    import ray

    from cluster.app import _as_api_error
    from cluster.pool import PoolConfig, WorkerDied, WorkerPool, WorkerState, WorkerUnavailable

    killed = []
    monkeypatch.setattr(ray, "kill", lambda actor, **kw: killed.append(actor))  # fakes: no Ray needed
    monkeypatch.setattr(ray, "cancel", lambda ref, **kw: None)
    pool = WorkerPool(PoolConfig(app="t", cost_aware_routing=False))
    ws = WorkerState("t-w0", _FakeWorker(ray.exceptions.ActorUnavailableError("network blip", None)), info={})
    pool.workers[ws.worker_id] = ws
    pool._ready.set()
    with pytest.raises(WorkerUnavailable) as e:
        await _drain(pool.generate(_request("blip")))
    assert not isinstance(e.value, WorkerDied) and _as_api_error(e.value).status == 503
    assert pool.workers == {"t-w0": ws} and ws.routable and ws.inflight == 0  # kept, lease ended
    assert killed == []
    ws.actor = _FakeWorker(ray.exceptions.ActorDiedError())
    with pytest.raises(WorkerDied):
        await _drain(pool.generate(_request("died")))
    assert pool.workers == {} and ws.dead and killed == [ws.actor]  # only a dead worker leaves the pool


async def test_close_returns_only_once_the_killed_workers_and_router_fail_a_call(monkeypatch):
    """``ray.kill`` only asks for the kill; the controller exits right after ``close``, so close
    waits until each killed actor fails a call with ``ActorDiedError`` (fakes: no Ray needed)."""
    import ray

    from cluster.pool import PoolConfig, WorkerPool, WorkerState

    killed = []
    monkeypatch.setattr(ray, "kill", lambda actor, **kw: killed.append(actor))

    class _Dying:  # answers ``answers`` calls after its kill, then is dead
        def __init__(self, answers: int):
            self.answers, self.asked = answers, 0
            self.__ray_ready__ = _Method(self._ready)

        def _ready(self):
            self.asked += 1

            async def answer():
                if self.asked > self.answers:
                    raise ray.exceptions.ActorDiedError()
                return True
            return answer()

    pool = WorkerPool(PoolConfig(app="t", cost_aware_routing=False))
    worker, router = _Dying(2), _Dying(3)
    pool.workers["t-w0"] = WorkerState("t-w0", worker, info={})
    pool._router_actor = router
    await pool.close()
    assert killed == [worker, router] and pool.workers == {} and pool._router_actor is None
    assert (worker.asked, router.asked) == (3, 4)  # asked until the call failed, not once


async def test_worker_stats_are_asked_concurrently():
    from cluster.pool import PoolConfig, WorkerPool, WorkerState

    n, asked, everyone = 4, [], asyncio.Event()

    def stats():  # answers only once every worker was asked: a sequential poll times out
        asked.append(1)
        if len(asked) == n:
            everyone.set()

        async def answer():
            await everyone.wait()
            return {"running": 0}
        return answer()

    pool = WorkerPool(PoolConfig(cost_aware_routing=False))
    for i in range(n):
        pool.workers[f"w{i}"] = WorkerState(f"w{i}", type("W", (), {"stats": _Method(stats)})(), info={})
    got = await pool.stats(timeout_s=1.0)
    assert [w["engine"] for w in got] == [{"running": 0}] * n


def test_replicas_send_the_gpu_count_unresolved_and_the_controller_resolves_it(monkeypatch):
    import ray

    from cluster.app import AppSettings, pool_config
    from cluster.pool import resolve_pool_config
    from policies.tenancy import Tenants

    tenants, settings = Tenants.from_dict(TENANTS), AppSettings(model=TINY)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})
    first = pool_config(settings, tenants, APP)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0, "GPU": 1.0})
    assert pool_config(settings, tenants, APP) == first  # a replica started after a GPU node joined matches
    gpu, cpu = resolve_pool_config(first, cluster_gpus=1), resolve_pool_config(first, cluster_gpus=0)
    assert (gpu.worker_num_gpus, gpu.engine.device, gpu.engine.dtype) == (1, "cuda", "bfloat16")
    assert (cpu.worker_num_gpus, cpu.engine.device, cpu.engine.dtype) == (0, "cpu", "float32")
    fixed = pool_config(AppSettings(model=TINY, worker_num_gpus=0, dtype="bfloat16"), tenants)
    assert resolve_pool_config(fixed, cluster_gpus=1).engine.device == "cpu"  # given args are kept
    assert resolve_pool_config(fixed, cluster_gpus=1).engine.dtype == "bfloat16"


# -- one Serve app, two ingress replicas ------------------------------------------------------------
def _pool_config(cluster):
    from cluster.app import pool_config
    from policies.tenancy import Tenants

    return pool_config(cluster["settings"], Tenants.from_dict(TENANTS))


def test_two_replicas_share_one_controller_and_one_worker(cluster):
    with ThreadPoolExecutor(4) as ex:
        codes = list(ex.map(lambda i: complete(cluster, f"request number {i} to either replica").status_code,
                            range(24)))
    assert codes == [200] * 24
    snap = snapshot(cluster)
    # a replica's response ends only once the controller has ended its lease: a client's next
    # request, to either replica, never finds the last one still open
    assert not any(c["leases"] for c in snap["clients"].values())
    assert len(snap["clients"]) == 2  # both ingress replicas attached to the one controller
    assert all(c["begun"] > 0 for c in snap["clients"].values())  # and both served requests
    assert len(snap["workers"]) == 1  # workers: 1 in the app args, not 1 per replica
    assert list(snap["workers"]) == [f"{APP}-w0"]  # ids unique per app: the shared index keys by them
    from actors.router import ROUTER_NAME, ROUTER_NAMESPACE, router_name

    cluster["ray"].get_actor(router_name(APP), namespace=ROUTER_NAMESPACE)  # the app's own router
    with pytest.raises(ValueError):
        cluster["ray"].get_actor(ROUTER_NAME, namespace=ROUTER_NAMESPACE)  # no router shared by all apps
    r = http(cluster).get("/kvmesh/workers", headers={"Authorization": "Bearer sk-acme"})
    assert len(r.json()["workers"]) == 1 and "placement_log" not in r.json()  # a tenant: not the router's log
    admin = http(cluster).get("/kvmesh/workers", headers={"Authorization": "Bearer sk-admin"}).json()
    assert admin["placement_log"] and {e["worker"] for e in admin["placement_log"]} == {f"{APP}-w0"}
    assert all(set(e["candidates"]) == {f"{APP}-w0"} for e in admin["placement_log"])
    assert all(w["inflight"] == 0 for w in snap["workers"].values()) and not any(snap["admitted"].values())


def test_back_to_back_requests_at_the_concurrency_limit_are_admitted_by_either_replica(cluster):
    # ghost may run 1 request at a time; each request starts right after the previous response,
    # and the proxy spreads them over both replicas: none may find the previous lease still open
    with http(cluster) as c:
        codes = [c.post("/v1/completions", headers={"Authorization": "Bearer sk-ghost"},
                        json={"model": TINY, "prompt": f"one at a time {i}", "max_tokens": 2}).status_code
                 for i in range(16)]
    assert codes == [200] * 16


def test_lease_of_a_vanished_client_is_reclaimed(cluster):
    ray = cluster["ray"]
    config = _pool_config(cluster)

    @ray.remote(num_cpus=0)
    class Vanishing:
        async def lease(self, app, config, tenants, ttl_s):
            from cluster.controller import ControllerClient
            from engine.sequence import Request, SamplingParams

            self.client = ControllerClient(app, config, tenants, ttl_s)
            await self.client.connect()
            params = SamplingParams(max_tokens=900, temperature=0, ignore_eos=True)
            req = Request("vanish-1", tuple(range(3, 23)), params, tenant="ghost")
            self.stream = self.client.generate(req)
            lease, _, _ = await self.stream.__anext__()  # holds the lease, never ends it
            return self.client.client_id, lease.actor

    v = Vanishing.remote()
    client_id, worker = ray.get(v.lease.remote(APP, config, TENANTS, TTL_S), timeout=120)
    cluster["worker"] = worker
    snap = snapshot(cluster)
    assert snap["clients"][client_id]["leases"] == ["vanish-1"] and snap["admitted"]["ghost"] == 1
    r = complete(cluster, "ghost is at its concurrency limit", key="sk-ghost")
    assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
    ray.kill(v)  # the client dies without ending its lease
    wait_until(lambda: client_id not in snapshot(cluster)["clients"], "the vanished client to be reaped")
    snap = snapshot(cluster)
    assert snap["admitted"]["ghost"] == 0 and all(w["inflight"] == 0 for w in snap["workers"].values())
    assert complete(cluster, "ghost may run again", key="sk-ghost").status_code == 200
    assert len(snap["clients"]) == 2  # the live replicas stay attached


def _idle_engines(cluster) -> list | None:  # pool-wide counts: the admin view (a tenant sees only its own)
    """The engines' stats once every worker answered (one slower than the pool's stats timeout
    shows ``engine`` None: then nothing is known yet) and none runs or queues a request; else None."""
    r = http(cluster).get("/kvmesh/workers", headers={"Authorization": "Bearer sk-admin"})
    engines = [w["engine"] for w in r.json()["workers"]]
    if engines and all(e is not None and e["running"] == 0 and e["waiting"] == 0 for e in engines):
        return engines
    return None


def test_client_disconnect_mid_stream_frees_blocks_and_the_lease(cluster):
    body = {"model": TINY, "prompt": "a long generation that the client abandons", "max_tokens": 900,
            "ignore_eos": True, "stream": True}
    with http(cluster).stream("POST", "/v1/completions", headers={"Authorization": "Bearer sk-solo"}, json=body) as r:
        assert r.status_code == 200
        it = r.iter_lines()
        assert any(next(it).startswith("data: {") for _ in range(4))
    engines = wait_until(lambda: _idle_engines(cluster), "the abort")
    solo = [e["tenants"]["solo"] for e in engines if "solo" in e["tenants"]]
    assert solo and all(t["output_tokens"] < 900 for t in solo)  # 0: aborted, never finished
    assert all(e["free_blocks"] == e["num_blocks"] for e in engines)
    wait_until(lambda: not any(c["leases"] for c in snapshot(cluster)["clients"].values()), "the lease to end")
    snap = snapshot(cluster)
    assert all(w["inflight"] == 0 for w in snap["workers"].values()) and snap["admitted"].get("solo", 0) == 0


def test_a_replica_with_another_configuration_is_refused(cluster):
    from cluster.controller import ConfigMismatch, ControllerClient

    other = dataclasses.replace(_pool_config(cluster), worker_num_cpus=0.5)
    with pytest.raises(ConfigMismatch, match="worker_num_cpus"):
        asyncio.run(ControllerClient(APP, other, TENANTS, TTL_S).connect())
    assert len(snapshot(cluster)["clients"]) == 2


def test_a_controller_whose_pool_fails_to_start_exits(cluster):
    from cluster.controller import ControllerClient

    bad = dataclasses.replace(_pool_config(cluster), worker_num_cpus=-1.0)  # the worker class refuses it
    with pytest.raises(ValueError, match="negative"):
        asyncio.run(ControllerClient("doomed", bad, TENANTS, client_ttl_s=600.0).connect(timeout_s=60))
    wait_until(lambda: _controller_gone(cluster["ray"], "doomed"), "the controller to exit", timeout_s=30)
    assert len(snapshot(cluster)["clients"]) == 2  # the other app is untouched


def test_an_app_deployed_again_with_other_args_right_after_its_deletion_gets_a_fresh_controller(cluster):
    """``serve delete`` then a deploy with changed args: the deleted app's controller lingers for
    ``client_ttl_s`` (a redeploy's replica may come back), but a replica with another configuration
    finding none attached stops it and starts a fresh one at once (it was a ConfigMismatch telling
    the user to delete the app, for ``client_ttl_s``)."""
    ray = cluster["ray"]
    from cluster.controller import ControllerClient

    cfg = _pool_config(cluster)
    changed = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, max_num_seqs=8))

    async def scenario():
        old = ControllerClient("again", cfg, TENANTS, client_ttl_s=600.0)  # would linger 600 s
        await old.connect(timeout_s=60)
        await old.close()  # the app was deleted: its last replica detached
        new = ControllerClient("again", changed, TENANTS, client_ttl_s=TTL_S)
        await new.connect(timeout_s=60)
        try:
            assert new.handle._actor_id != old.handle._actor_id
            assert (await new.handle.health.remote())["workers"] == 1
        finally:
            await new.close()

    asyncio.run(scenario())
    wait_until(lambda: _controller_gone(ray, "again"), "the fresh controller to stop after its last replica left")
    assert len(snapshot(cluster)["clients"]) == 2  # the other app is untouched


def test_deleting_the_app_stops_the_controller_and_its_workers(cluster):
    ray = cluster["ray"]
    from actors.router import ROUTER_NAMESPACE, router_name

    worker = cluster["worker"]
    assert ray.get(worker.ready.remote(), timeout=30)
    router = ray.get_actor(router_name(APP), namespace=ROUTER_NAMESPACE)
    cluster["serve"].delete(APP)
    wait_until(lambda: _controller_gone(ray, APP), "the controller to exit")
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(worker.ready.remote(), timeout=30)
    with pytest.raises(ray.exceptions.RayActorError):  # the app's router died with its controller
        ray.get(router.metrics.remote(), timeout=30)
