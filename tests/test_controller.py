"""Ingress scale-out: two Serve ingress replicas share one controller actor and one set of workers.

Tiny model on Ray Serve (127.0.0.1). The tests run in order on one app: sharing, a vanished
client's lease reclaimed, a disconnect mid-stream, a configuration mismatch, then deleting the
app stops the controller and its workers.
"""

import asyncio
import dataclasses
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import yaml

pytestmark = pytest.mark.ray

TINY = "tiny-llama"
APP = "scaled"
TTL_S = 3.0
TENANTS = {"tenants": [
    {"name": "acme", "api_keys": ["sk-acme"]},
    {"name": "solo", "api_keys": ["sk-solo"]},
    {"name": "ghost", "api_keys": ["sk-ghost"], "limits": {"max_concurrent": 1}},
]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    import ray
    from ray import serve

    from cluster.app import AppSettings, KvmeshIngress
    from cluster.controller import NAMESPACE, controller_name

    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    path = tmp_path_factory.mktemp("tenants") / "tenants.yaml"
    path.write_text(yaml.safe_dump(TENANTS))
    settings = AppSettings.from_args({"model": TINY, "tenants": str(path), "kv_cache_bytes": 16 << 20,
                                      "worker_num_cpus": 0, "client_ttl_s": TTL_S})
    serve.run(KvmeshIngress.options(num_replicas=2).bind(dataclasses.asdict(settings), TENANTS),
              name=APP, route_prefix="/")
    ctl = ray.get_actor(controller_name(APP), namespace=NAMESPACE)
    state = {"base": f"http://127.0.0.1:{port}", "settings": settings, "ctl": ctl, "ray": ray, "serve": serve}
    yield state
    serve.shutdown()
    if started:
        ray.shutdown()


def http(cluster):
    return httpx.Client(base_url=cluster["base"], timeout=120)


def snapshot(cluster) -> dict:
    return cluster["ray"].get(cluster["ctl"].snapshot.remote(), timeout=30)


def complete(cluster, prompt, key="sk-acme", max_tokens=4):
    return http(cluster).post("/v1/completions", headers={"Authorization": f"Bearer {key}"},
                              json={"model": TINY, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})


def wait_until(pred, what, timeout_s=60.0):
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


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
    assert len(snap["clients"]) == 2  # both ingress replicas attached to the one controller
    assert all(c["begun"] > 0 for c in snap["clients"].values())  # and both served requests
    assert len(snap["workers"]) == 1  # workers: 1 in the app args, not 1 per replica
    r = http(cluster).get("/kvmesh/workers", headers={"Authorization": "Bearer sk-acme"})
    assert len(r.json()["workers"]) == 1
    assert all(w["inflight"] == 0 for w in snap["workers"].values()) and not any(snap["admitted"].values())


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


def _engines(cluster):
    r = http(cluster).get("/kvmesh/workers", headers={"Authorization": "Bearer sk-acme"})
    return [w["engine"] for w in r.json()["workers"] if w["engine"]]


def test_client_disconnect_mid_stream_frees_blocks_and_the_lease(cluster):
    body = {"model": TINY, "prompt": "a long generation that the client abandons", "max_tokens": 900,
            "ignore_eos": True, "stream": True}
    with http(cluster).stream("POST", "/v1/completions", headers={"Authorization": "Bearer sk-solo"}, json=body) as r:
        assert r.status_code == 200
        it = r.iter_lines()
        assert any(next(it).startswith("data: {") for _ in range(4))
    wait_until(lambda: all(e["running"] == 0 and e["waiting"] == 0 for e in _engines(cluster)), "the abort")
    engines = _engines(cluster)
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


def test_deleting_the_app_stops_the_controller_and_its_workers(cluster):
    ray = cluster["ray"]
    from cluster.controller import NAMESPACE, controller_name

    worker = cluster["worker"]
    assert ray.get(worker.ready.remote(), timeout=30)
    cluster["serve"].delete(APP)

    def gone() -> bool:
        try:
            ray.get_actor(controller_name(APP), namespace=NAMESPACE)
            return False
        except ValueError:
            return True

    wait_until(gone, "the controller to exit")
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(worker.ready.remote(), timeout=30)
