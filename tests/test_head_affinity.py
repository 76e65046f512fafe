"""kvmesh's zero-CPU control actors (index, router; the controller uses the same options) and the
HTTP ingress deployments (kvmesh's and the Serve-router baselines') run on the head node, not next
to an engine on a worker node."""

import os

import pytest

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402
from ray.util.state import list_actors  # noqa: E402

from actors.head_affinity import head_node_id, ingress_actor_options, on_head  # noqa: E402
from actors.index_actor import get_or_create_index  # noqa: E402
from actors.router import get_or_create_router  # noqa: E402

pytestmark = pytest.mark.ray


def node_of(handle) -> str:
    actor_id = handle._actor_id.hex()
    for a in list_actors(filters=[("actor_id", "=", actor_id)]):
        return a.node_id
    raise AssertionError(f"actor {actor_id} not listed")


def test_control_actors_prefer_the_head_even_when_it_offers_no_cpus():
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})  # as in the cluster bench
    try:
        for _ in range(2):
            c.add_node(num_cpus=2)
        c.wait_for_nodes()
        ray.init(address=c.address, namespace="kvmesh-test", log_to_driver=False)
        head = head_node_id()
        assert head is not None and on_head() == {"resources": {"node:__internal_head__": 0.001}}
        handles = [get_or_create_index()] + [get_or_create_router(app=f"app{i}") for i in range(6)]
        ray.get([h.__ray_ready__.remote() for h in handles], timeout=60)
        assert {node_of(h) for h in handles} == {head}
        # the ingress deployments ask for the same head resource (Serve places a replica as Ray
        # places its actor); built as `serve run`/`serve deploy` builds them, in a Ray process
        from cluster import baselines
        from cluster.app import build_app

        for app in (build_app({"model": "tiny-llama"}), baselines.build_app({"model": "tiny-llama",
                                                                               "router": "affinity"})):
            assert app._bound_deployment.ray_actor_options == {"num_cpus": 0, **on_head()}
    finally:
        ray.shutdown()
        c.shutdown()
    assert ingress_actor_options() == {"num_cpus": 0}  # no Ray: no placement asked
