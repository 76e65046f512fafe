"""Where kvmesh's control actors run: on the head node, as Serve's own controller does.

The app's controller, the global index and the router actor ask for no CPU (``num_cpus=0``), so
Ray may place them on any node. In the cluster bench (worker hosts held to 0.4 core each, a head
without CPUs for Ray) and in ``bench/faults.py`` they landed on worker nodes, next to an engine:
there they take that node's CPU from its engine and are throttled by its quota themselves, while
every request waits on them (lease, index lookup, ranking). They ask for a sliver of the
resource Ray gives the head node only (``node:__internal_head__``), Ray's own way to pin an actor
to the head. (A *soft* ``NodeAffinitySchedulingStrategy`` to the head did not hold them there:
with a head that offers no CPUs Ray placed them on the worker nodes anyway,
``tests/test_head_affinity.py``.) The head is where the GCS lives; a cluster that loses it
loses Ray itself, so nothing is lost by not placing them elsewhere.

The HTTP ingress replicas (``KvmeshIngress``, and ``BaselineIngress`` of the Serve-router
baselines) ask for no CPU either and went to worker nodes too (the cluster bench, session 27:
both configurations' ingress on a worker host, inside its CPU quota, next to an engine; the
ingress stage then took 0.06-0.15 s per request against 0.013-0.026 s on the head). They run where
Serve's proxy runs (``proxy_location: HeadOnly``): ``ingress_actor_options``. A deployment's own
``ray_actor_options`` in the Serve config still override it (e.g. to spread many ingress replicas
with ``proxy_location: EveryNode``).
"""

from __future__ import annotations

import ray

HEAD_RESOURCE = "node:__internal_head__"  # the resource Ray gives the head node only


def head_node_id() -> str | None:
    """The live head node's id, None if there is none (blocking GCS call)."""
    for node in ray.nodes():
        if node.get("Alive") and HEAD_RESOURCE in (node.get("Resources") or {}):
            return node["NodeID"]
    return None


def on_head() -> dict:
    """Actor options that place the actor on the head node; ``{}`` when Ray has no head (then
    it goes where Ray puts it, as before)."""
    return {"resources": {HEAD_RESOURCE: 0.001}} if head_node_id() else {}


def ingress_actor_options() -> dict:
    """``ray_actor_options`` of an HTTP ingress deployment: no CPU, and on the head node when Ray
    is up and has one (the application builders run in a Ray task; without Ray: no placement)."""
    return {"num_cpus": 0, **(on_head() if ray.is_initialized() else {})}
