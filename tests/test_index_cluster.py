"""The index actor on a 3-node Ray cluster on loopback: holders, dead workers, index restart."""

import asyncio
import os
import time

import pytest

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from actors.index_actor import get_or_create_index, lookup_with_timeout  # noqa: E402
from actors.prefix_index import prompt_chains  # noqa: E402
from actors.worker import worker_actor_class  # noqa: E402
from engine.llm_engine import EngineConfig  # noqa: E402
from engine.sequence import Request, SamplingParams  # noqa: E402

pytestmark = pytest.mark.ray
BS = 16
WAIT_S = 60.0


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        c.add_node(num_cpus=1, resources={"node_a": 1})
        c.add_node(num_cpus=1, resources={"node_b": 1})
        c.wait_for_nodes()
        ray.init(address=c.address, namespace="kvmesh-test", log_to_driver=False)
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


def poll(fn, want, wait_s=WAIT_S):
    """Call fn until it returns ``want`` (bounded); returns the last value."""
    deadline, got = time.monotonic() + wait_s, None
    while time.monotonic() < deadline:
        try:
            got = fn()
        except ray.exceptions.RayError:
            got = "error"
        if got == want:
            return got
        time.sleep(0.2)
    return got


def test_index_tracks_workers_across_nodes_and_restarts(cluster):
    # freezing its heap every 4 new nodes (``actors.heap``), in the actor's own Ray process
    index = get_or_create_index(BS, liveness_s=0.2, stale_s=60.0, freeze_every=4)
    W = worker_actor_class(num_gpus=0, num_cpus=1)
    cfg = EngineConfig(model="tiny-llama", num_blocks=64, max_num_batched_tokens=256)
    wa = W.options(resources={"node_a": 1}).remote("wa", cfg)
    wb = W.options(resources={"node_b": 1}).remote("wb", cfg)
    info_a, info_b = ray.get([wa.ready.remote(), wb.ready.remote()], timeout=120)
    assert info_a["node_id"] != info_b["node_id"]  # pinned to different nodes
    ray.get([w.start_index_publisher.remote(0.05, 0.2) for w in (wa, wb)], timeout=60)

    shared = [(7 * i) % 256 for i in range(70)]
    only_a = [(11 * i + 3) % 256 for i in range(50)]
    only_b = [(13 * i + 5) % 256 for i in range(50)]
    p = SamplingParams(max_tokens=2, temperature=0.0)
    runs = [(wa, "s-a", shared), (wb, "s-b", shared), (wa, "a", only_a), (wb, "b", only_b)]
    ray.get([w.generate_all.remote(Request(rid, tuple(t), p, tenant="t1")) for w, rid, t in runs], timeout=120)

    model_id = info_a["model_id"]

    def look(tokens, domains=("t1",)):
        return ray.get(index.lookup.remote(prompt_chains(tokens, BS, model_id, domains)), timeout=10)

    # 70 prompt tokens + 1 computed output token -> 4 full blocks; 50 (+1) -> 3 blocks
    assert poll(lambda: look(shared), {"wa": 64, "wb": 64}) == {"wa": 64, "wb": 64}
    assert poll(lambda: look(only_a), {"wa": 48}) == {"wa": 48}
    assert poll(lambda: look(only_b), {"wb": 48}) == {"wb": 48}
    assert look(shared[:40] + only_a) == {"wa": 32, "wb": 32}  # diverges inside block 2
    assert look(shared, ("t2",)) == {}  # another tenant's domain never matches
    chains = prompt_chains(shared, BS, model_id, ["t1"])
    assert asyncio.run(lookup_with_timeout(index, chains, timeout_s=10.0)) == {"wa": 64, "wb": 64}
    stats = ray.get(index.stats.remote())
    assert stats["workers"] == 2 and stats["blocks"] == 4 + 3 + 3
    assert stats["heap"]["freezes"] >= 1 and stats["heap"]["frozen"] > 0  # and every answer above was right

    # a dead worker's entries are dropped (liveness check on its actor handle)
    ray.kill(wb)
    assert poll(lambda: look(shared), {"wa": 64}) == {"wa": 64}
    assert poll(lambda: look(only_b), {}) == {}

    # kill the index: it restarts (max_restarts=-1) and rebuilds from the workers' snapshots
    ray.kill(index, no_restart=False)
    assert poll(lambda: ray.get(index.stats.remote(), timeout=10)["epoch"] != stats["epoch"], True) is True
    assert poll(lambda: look(shared), {"wa": 64}) == {"wa": 64}
    assert look(only_a) == {"wa": 48} and look(only_b) == {}
    assert ray.get(index.stats.remote(), timeout=10)["workers"] == 1
    assert ray.get(index.stats.remote(), timeout=10)["heap"]["freezes"] >= 1  # restarted with the same settings
    ray.kill(wa)
    ray.kill(index)


def test_dead_worker_dropped_and_restarted_index_rebuilt_by_death_watches_alone(cluster):
    """No pings and no heartbeats within the test: the index's liveness loop never runs
    (``liveness_s`` an hour) and the worker's heartbeat backs off from 10 minutes, so only the
    death watches can drop the killed worker (the index's ``until_exit`` call on it fails) and
    rebuild the restarted index (the worker's call on the index fails, it resends its snapshot)."""
    index = get_or_create_index(BS, liveness_s=3600.0, stale_s=3600.0)
    W = worker_actor_class(num_gpus=0, num_cpus=1)
    cfg = EngineConfig(model="tiny-llama", num_blocks=64, max_num_batched_tokens=256)
    wa = W.options(resources={"node_a": 1}).remote("wa", cfg)
    wb = W.options(resources={"node_b": 1}).remote("wb", cfg)
    info = ray.get(wa.ready.remote(), timeout=120)
    ray.get(wb.ready.remote(), timeout=120)
    ray.get([w.start_index_publisher.remote(0.05, 600.0, 600.0) for w in (wa, wb)], timeout=60)
    tokens = [(17 * i + 1) % 256 for i in range(40)]  # 40 + 1 tokens: 2 full blocks
    p = SamplingParams(max_tokens=2, temperature=0.0)
    ray.get([w.generate_all.remote(Request(f"dw-{i}", tuple(tokens), p, tenant="t1")) for i, w in enumerate((wa, wb))],
            timeout=120)
    chains = prompt_chains(tokens, BS, info["model_id"], ["t1"])

    def look():
        return ray.get(index.lookup.remote(chains), timeout=10)

    assert poll(look, {"wa": 32, "wb": 32}) == {"wa": 32, "wb": 32}
    ray.kill(wb)
    assert poll(look, {"wa": 32}) == {"wa": 32}
    assert ray.get(index.stats.remote(), timeout=10)["dropped_workers"] == 1
    epoch = ray.get(index.stats.remote(), timeout=10)["epoch"]
    ray.kill(index, no_restart=False)
    assert poll(lambda: ray.get(index.stats.remote(), timeout=10)["epoch"] != epoch, True) is True
    assert poll(look, {"wa": 32}) == {"wa": 32}  # rebuilt from wa's snapshot
    ray.kill(wa)
    ray.kill(index)
