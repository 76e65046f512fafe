"""Isolation over HTTP (Ray Serve on 127.0.0.1, tiny model): cache_salt, no cross-tenant hits
(engine and index counters), what /kvmesh/workers shows to whom, /metrics behind an admin key,
and a grant revoked by redeploying with a changed tenants file (no restart).

The tests run in order on one app; the last one redeploys it.
"""

import time

import httpx
import pytest
import yaml
from tests.serving import local_serve

pytestmark = pytest.mark.ray

TINY = "tiny-llama"
APP = "iso"
TENANTS = {"admin_keys": ["sk-admin"], "tenants": [
    {"name": "acme", "api_keys": ["sk-acme"], "share_with": ["globex"], "reuse": "approximate"},
    {"name": "globex", "api_keys": ["sk-globex"]},
    {"name": "solo", "api_keys": ["sk-solo"]},
]}
PROMPT = "The committee met on Tuesday to review the quarterly budget and the hiring plan. " * 3


def _args(path) -> dict:
    return {"model": TINY, "tenants": str(path), "kv_cache_bytes": 16 << 20, "worker_num_cpus": 0,
            "metrics_auth": "admin"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    import ray

    from cluster.app import build_app

    d = tmp_path_factory.mktemp("tenants")
    with local_serve(TENANTS, d) as (base, path, serve):
        serve.run(build_app(_args(path)), name=APP, route_prefix="/")
        yield {"base": base, "dir": d, "serve": serve, "ray": ray, "build_app": build_app}


def http(server):
    return httpx.Client(base_url=server["base"], timeout=120)


def complete(server, key, prompt=PROMPT, **kw):
    body = {"model": TINY, "prompt": prompt, "max_tokens": 2, "temperature": 0, **kw}
    return http(server).post("/v1/completions", headers={"Authorization": f"Bearer {key}"}, json=body)


def cached(server, key, prompt=PROMPT, **kw) -> int:
    r = complete(server, key, prompt, **kw)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def workers(server, key) -> dict:
    r = http(server).get("/kvmesh/workers", headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text
    return r.json()


def engine_cross_reads(server) -> dict:
    out: dict = {}
    for w in workers(server, "sk-admin")["workers"]:
        for k, n in ((w["engine"] or {}).get("cross_tenant_reads") or {}).items():
            out[k] = out.get(k, 0) + n
    return out


def index_cross_reads(server) -> dict:
    from actors.index_actor import get_index

    return server["ray"].get(get_index().read_stats.remote(), timeout=30)["cross_tenant_reads"]


def wait_indexed(server, key: str, domain: str, prompt: str = PROMPT, timeout_s: float = 30.0) -> None:
    """Wait until the index shows a worker holding every reusable block of ``prompt`` (as ``key``'s
    tenant sends it) under ``domain``. The workers publish their blocks in the background (10 Hz):
    a lookup made before a chain is published finds nothing and counts no read. (Waiting for the
    index's block count to grow is not enough: an earlier request's blocks may be what arrives.)
    The probe reads ``domain`` as its own tenant: it counts no cross-tenant read."""
    from actors.index_actor import get_index
    from engine.block_pool import prompt_chains

    ray, index = server["ray"], get_index()
    r = http(server).post("/tokenize", headers={"Authorization": f"Bearer {key}"}, json={"model": TINY, "prompt": prompt})
    assert r.status_code == 200, r.text
    handles = ray.get(index.worker_handles.remote(), timeout=30)
    info = ray.get(next(iter(handles.values())).ready.remote(), timeout=30)  # model id and block size
    chains = prompt_chains(r.json()["tokens"], info["block_size"], info["model_id"], [domain])
    want = len(chains[domain]) * info["block_size"]
    assert want > 0
    deadline = time.monotonic() + timeout_s
    while max(ray.get(index.lookup.remote(chains), timeout=30).values(), default=0) < want:
        assert time.monotonic() < deadline, f"the index never showed {domain}'s blocks of the prompt"
        time.sleep(0.05)


def test_cache_salt_narrows_sharing_and_is_validated(server):
    p = "salted prompt for two users of one tenant, long enough for blocks. " * 2
    assert cached(server, "sk-solo", p, cache_salt="alice") == 0
    assert cached(server, "sk-solo", p, cache_salt="alice") > 0
    assert cached(server, "sk-solo", p, cache_salt="bob") == 0
    assert cached(server, "sk-solo", p) == 0  # unsalted: not alice's domain
    chat = {"messages": [{"role": "user", "content": p}], "max_tokens": 1}
    r = http(server).post("/v1/chat/completions", headers={"Authorization": "Bearer sk-solo"},
                          json={"model": TINY, "cache_salt": "carol", **chat})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    for bad in ("", "x" * 257, 5, ["a"]):
        r = complete(server, "sk-solo", p, cache_salt=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text
    assert engine_cross_reads(server) == {} and index_cross_reads(server) == {}


def test_no_tenant_reads_another_without_a_grant(server):
    p = "solo's private prompt about the merger with a company nobody has heard of yet. " * 2
    assert cached(server, "sk-solo", p) == 0
    assert cached(server, "sk-solo", p) > 0  # cached: the next tenants could hit it
    assert cached(server, "sk-globex", p) == 0  # (before acme: globex may read acme's blocks)
    assert cached(server, "sk-acme", p, kvmesh={"reuse": "approximate"}) == 0
    assert engine_cross_reads(server) == {} and index_cross_reads(server) == {}
    # the grant acme -> globex is the only way across, and both counters see it
    assert cached(server, "sk-acme", PROMPT) == 0
    wait_indexed(server, "sk-acme", "acme")  # else globex's lookup may precede acme's publish
    assert cached(server, "sk-globex", PROMPT) > 0
    assert engine_cross_reads(server).keys() == {"globex<-acme"}
    assert index_cross_reads(server).keys() == {"globex<-acme"}


def test_workers_view_shows_a_tenant_only_its_own_state(server):
    for text in ("Review: good film. Label:", "Review: bad food. Label:"):  # acme is approximate by default
        assert complete(server, "sk-acme", text * 3).status_code == 200
    solo = workers(server, "sk-solo")
    assert solo["scope"] == "tenant:solo"
    text = str(solo)
    assert "acme" not in text and "globex" not in text and "auto:" not in text
    eng = solo["workers"][0]["engine"]
    assert set(eng["tenants"]) == {"solo"} and "free_blocks" not in eng and "inflight" not in solo["workers"][0]
    acme = workers(server, "sk-acme")
    assert set(acme["workers"][0]["engine"]["tenants"]) == {"acme"}
    gates = acme["workers"][0]["engine"].get("approx", {}).get("gate", {})
    assert all(k.startswith("acme/") for k in gates)
    assert "router" not in acme and "router" not in solo  # the router's estimates move with everyone's load
    admin = workers(server, "sk-admin")
    assert admin["scope"] == "admin"
    router = admin["router"]  # its estimates: what its pull-or-recompute choices are priced with
    ids = {w["worker_id"] for w in admin["workers"]}
    assert router["prefill"] and set(router["prefill"]) <= ids and set(router["wait_s"]) <= ids
    assert all(set(f) == {"fixed_s", "per_1k_tokens_s", "per_1k2_attention_s"} for f in router["prefill"].values())
    assert all(f["per_1k_tokens_s"] > 0 for f in router["prefill"].values())
    assert {"acme", "globex", "solo"} <= set(admin["workers"][0]["engine"]["tenants"])
    assert "free_blocks" in admin["workers"][0]["engine"]
    r = complete(server, "sk-admin")
    assert r.status_code == 403 and r.json()["error"]["code"] == "permission_denied"
    r = http(server).get("/kvmesh/workers", headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401


def test_metrics_need_the_admin_key(server):
    h = http(server)
    assert h.get("/metrics").status_code == 401
    assert h.get("/metrics", headers={"Authorization": "Bearer sk-acme"}).status_code == 401
    r = h.get("/metrics", headers={"Authorization": "Bearer sk-admin"})
    assert r.status_code == 200 and 'kvmesh_prompt_tokens_total{tenant="solo"}' in r.text


def test_redeploy_with_a_changed_tenants_file_revokes_a_grant_without_a_restart(server):
    from cluster.controller import NAMESPACE, controller_name

    ray = server["ray"]
    ctl = ray.get_actor(controller_name(APP), namespace=NAMESPACE)
    before = {w["worker_id"] for w in workers(server, "sk-admin")["workers"]}
    assert cached(server, "sk-globex", PROMPT) > 0  # granted: reads acme's cached blocks
    new = {"admin_keys": ["sk-admin"], "tenants": [
        {"name": "acme", "api_keys": ["sk-acme"], "reuse": "approximate"},  # grant revoked
        {"name": "globex", "api_keys": ["sk-globex", "sk-globex-2"]},  # a key added
        {"name": "solo", "api_keys": ["sk-solo-2"], "limits": {"max_concurrent": 4}},  # key rotated, limit
    ]}
    path = server["dir"] / "tenants-v2.yaml"
    path.write_text(yaml.safe_dump(new))
    server["serve"].run(server["build_app"](_args(path)), name=APP, route_prefix="/")
    # the same controller (no restart) now runs the new file; every replica authenticates with it
    assert ray.get(ctl.tenants_state.remote(), timeout=30)["data"] == new
    assert {w["worker_id"] for w in workers(server, "sk-admin")["workers"]} == before
    assert cached(server, "sk-acme", PROMPT) > 0  # acme's blocks are still cached ...
    assert cached(server, "sk-globex", PROMPT) == 0  # ... and unreadable for globex at once
    assert cached(server, "sk-globex-2", PROMPT) > 0  # globex's own blocks, through its new key
    deadline = time.monotonic() + 30  # old replicas (if any still serve) sync on their heartbeat
    while complete(server, "sk-solo").status_code != 401:
        assert time.monotonic() < deadline, "the rotated key still works"
        time.sleep(0.5)
    assert complete(server, "sk-solo-2").status_code == 200
    assert ray.get(ctl.snapshot.remote(), timeout=30)["closing"] is False
