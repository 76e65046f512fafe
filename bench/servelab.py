"""The kvmesh Serve app on a ``bench.netlab`` lab, and the processes Ray reports for it.

``start_app`` runs Serve's proxy on the head only (127.0.0.1, a free port) and the app with
``num_replicas`` ingress replicas; ``processes`` lists the app's actors by role with their PIDs
and nodes (``ray.util.state``); ``worker_handles`` gets the worker actor handles the index actor
knows (the workers are the controller's unnamed children).
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import sys
import tempfile
from pathlib import Path
import time

import ray
from ray import serve

from actors.index_actor import INDEX_NAME, NAMESPACE
from actors.router import router_name
from cluster.app import AppSettings, KvmeshIngress
from cluster.controller import controller_name
from cluster.loopback import start_serve


@contextlib.contextmanager
def lab_with_retries(specs, attempts: int = 6, **kwargs):
    """``bench.netlab.netlab(specs, **kwargs)``, retried when the Ray head or a node fails to
    start (seen on the shared machine under load 20-30; each failed try cleans up after itself)."""
    import bench.netlab as netlab_mod
    from bench.netlab import netlab

    wrapper = Path(tempfile.mkdtemp(prefix="kvm-i13-")) / "ray"
    wrapper.write_text(f"#!/bin/sh\nexec {sys.executable} {Path(__file__).with_name('ray_patient.py')} \"$@\"\n")
    wrapper.chmod(0o755)
    netlab_mod.RAY_BIN = str(wrapper)  # node starts wait for a slow raylet (see bench/ray_patient.py)
    try:
        for i in range(attempts):
            cm = netlab(specs, **kwargs)
            try:
                lab = cm.__enter__()
                break
            except (RuntimeError, TimeoutError) as e:
                if i == attempts - 1:
                    raise
                print(f"netlab start failed ({e}); retrying", flush=True)
        try:
            yield lab
        except BaseException:
            if not cm.__exit__(*sys.exc_info()):
                raise
        else:
            cm.__exit__(None, None, None)
    finally:
        shutil.rmtree(wrapper.parent, ignore_errors=True)


def start_app(app: str, settings: dict, tenants_data: dict, num_replicas: int = 1,
              replica_resources: dict | None = None) -> str:
    """Deploy the app; returns its base URL once every replica is up (workers ready).
    ``replica_resources`` pins the ingress replicas (e.g. ``{"node:<head ip>": 0.001}``; the
    controller, created by a replica, then starts on that node too)."""
    port = start_serve(proxy_location="HeadOnly")
    s = AppSettings(**settings)
    opts = {"num_cpus": 0, **({"resources": replica_resources} if replica_resources else {})}
    serve.run(KvmeshIngress.options(num_replicas=num_replicas, ray_actor_options=opts)
              .bind(dataclasses.asdict(s), tenants_data), name=app, route_prefix="/")
    return f"http://127.0.0.1:{port}"


def _pid_node(handle, timeout_s: float = 15.0) -> tuple[int, str] | None:
    from bench.procinfo import pid_and_node

    try:
        return tuple(ray.get(handle.__ray_call__.remote(pid_and_node), timeout=timeout_s))
    except Exception:  # noqa: BLE001 - dead or unreachable
        return None


def processes(app: str) -> dict[str, list[dict]]:
    """role -> [{"name", "pid", "node_id"}] of the app's live actors: workers (from the index),
    controller, index, router, ingress replicas, the engine replicas of a ``cluster.baselines``
    app, Serve's controller and proxies (named actors; no dashboard needed)."""
    out: dict[str, list[dict]] = {}
    named = ray.util.list_named_actors(all_namespaces=True)
    for entry in named:
        name, ns = entry["name"], entry["namespace"]
        replica = name.startswith("SERVE_REPLICA::")
        role = ("controller" if name == controller_name(app) else "index" if name == INDEX_NAME
                else "router" if name == router_name(app)
                else "ingress" if replica and (f"{app}#KvmeshIngress" in name or f"{app}#BaselineIngress" in name)
                else "engine_replica" if replica and f"{app}#EngineReplica" in name
                else "serve_controller" if name == "SERVE_CONTROLLER_ACTOR"
                else "serve_proxy" if name.startswith("SERVE_CONTROLLER_ACTOR:") or "PROXY" in name.upper() else None)
        if role is None:
            continue
        try:
            h = ray.get_actor(name, namespace=ns)
        except ValueError:
            continue
        pn = _pid_node(h)
        if pn:
            out.setdefault(role, []).append({"name": name, "pid": pn[0], "node_id": pn[1]})
    try:
        handles = worker_handles()
    except Exception:  # noqa: BLE001 - index restarting
        handles = {}
    for wid, h in handles.items():
        pn = _pid_node(h)
        if pn:
            out.setdefault("worker", []).append({"name": wid, "pid": pn[0], "node_id": pn[1]})
    return out


def replica_names(app: str) -> list[str]:
    """Names of the app's live ingress replica actors (a GCS call, cheap)."""
    return sorted(e["name"] for e in ray.util.list_named_actors(all_namespaces=True)
                  if e["name"].startswith("SERVE_REPLICA::") and f"{app}#KvmeshIngress" in e["name"])


def index_handle():
    return ray.get_actor(INDEX_NAME, namespace=NAMESPACE)


def controller_handle(app: str):
    return ray.get_actor(controller_name(app), namespace="kvmesh")


def worker_handles(timeout_s: float = 5.0) -> dict[str, object]:
    """worker id -> actor handle, as registered in the index (by the workers' snapshots)."""
    return ray.get(index_handle().worker_handles.remote(), timeout=timeout_s)


def drain(handles: dict[str, object], timeout_s: float = 90.0) -> dict[str, dict]:
    """Wait until no worker runs or queues a request, then each worker's block books
    (``Worker.pool_accounting``; an entry ``{"error": ...}`` for a worker that did not answer)."""
    deadline = time.monotonic() + timeout_s
    books: dict[str, dict] = {}
    while True:
        books = {}
        for wid, h in handles.items():
            try:
                books[wid] = ray.get(h.pool_accounting.remote(), timeout=10)
            except Exception as e:  # noqa: BLE001 - dead or unreachable: reported
                books[wid] = {"error": type(e).__name__}
        busy = [w for w, b in books.items() if "error" not in b and (b["running"] or b["waiting"] or b["in_use"])]
        if not busy or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    for b in books.values():
        if "error" not in b:
            b["exact"] = (b["free"] + b["cached_idle"] + b["in_use"] == b["total"] and b["in_use"] == 0
                          and b["invariants"] is None)
    return books
