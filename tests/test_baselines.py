"""The baselines a user would deploy instead of kvmesh (``cluster/baselines.py``): the same engine
as Serve replicas behind kvmesh's OpenAI ingress, routed by Serve's power-of-two router and by
Ray's real ``PrefixCacheAffinityRouter``. Tiny model, 2 replicas, Ray on loopback."""


import httpx
import pytest
from tests.serving import local_serve

pytestmark = pytest.mark.ray

TINY = "tiny-llama"
TENANTS = {"tenants": [{"name": "acme", "api_keys": ["sk-acme"]}]}
KEY = {"Authorization": "Bearer sk-acme"}


@pytest.fixture(scope="module")
def serve_base(tmp_path_factory):
    with local_serve(TENANTS, tmp_path_factory.mktemp("tenants")) as (base, tenants, serve):
        yield {"base": base, "tenants": str(tenants), "serve": serve, "deployed": set()}


def _deploy(env, router: str) -> str:
    """Deploy the baseline app for ``router`` once per module (its base URL)."""
    from cluster.baselines import build_app

    prefix = f"/{router}"
    if prefix not in env["deployed"]:
        env["serve"].run(build_app({"model": TINY, "tenants": env["tenants"], "kv_cache_bytes": 8 << 20,
                                    "workers": 2, "worker_num_cpus": 0, "router": router}),
                         name=f"baseline-{router}", route_prefix=prefix)
        env["deployed"].add(prefix)
    return env["base"] + prefix


def _complete(c: httpx.Client, prompt: str, **kw) -> dict:
    r = c.post("/v1/completions", headers=KEY, json={"model": TINY, "prompt": prompt, "max_tokens": 4,
                                                       "temperature": 0, **kw})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("router", ["pow2", "affinity"])
def test_baseline_serves_completions_with_usage_and_worker(serve_base, router):
    base = _deploy(serve_base, router)
    with httpx.Client(base_url=base, timeout=120) as c:
        body = _complete(c, "Once upon a time in a land far away, " * 4)
        assert body["choices"][0]["text"] is not None
        assert body["usage"]["prompt_tokens"] > 0
        assert "cached_tokens" in body["usage"]["prompt_tokens_details"]
        assert body["kvmesh"]["worker"] and body["kvmesh"]["route"] in ("local", "recomputed")
        # streaming chat through the same front end
        with c.stream("POST", "/v1/chat/completions", headers=KEY,
                      json={"model": TINY, "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 3,
                            "temperature": 0, "stream": True}) as r:
            lines = [ln for ln in r.iter_lines() if ln]
        assert r.status_code == 200 and lines[-1] == "data: [DONE]"
        # the same OpenAI errors
        assert c.post("/v1/completions", json={"model": TINY, "prompt": "x"}).status_code == 401
        bad = c.post("/v1/completions", headers=KEY, json={"model": TINY, "prompt": "x", "max_tokens": "many"})
        assert bad.status_code == 400 and "error" in bad.json()
        metrics = c.get("/metrics").text
        assert "kvmesh_router_routed" in metrics


def test_affinity_router_sends_a_repeated_prompt_to_the_same_replica_and_hits(serve_base):
    """Ray's PrefixCacheAffinityRouter keys on the prompt text the replica call carries: the same
    prompt lands on the same replica (and hits its cache) every time; prompts that share nothing
    go to the replica with the smaller tree, so both replicas get work."""
    base = _deploy(serve_base, "affinity")
    with httpx.Client(base_url=base, timeout=120) as c:
        a = "Alpha system prompt for tenant group one. " * 6
        b = "Zulu: a completely different instruction block. " * 6
        first_a = _complete(c, a)
        first_b = _complete(c, b)
        again = [_complete(c, a + f" question {i}") for i in range(3)]
        again_b = [_complete(c, b + f" question {i}") for i in range(3)]
    assert {r["kvmesh"]["worker"] for r in again} == {first_a["kvmesh"]["worker"]}
    assert {r["kvmesh"]["worker"] for r in again_b} == {first_b["kvmesh"]["worker"]}
    assert first_a["kvmesh"]["worker"] != first_b["kvmesh"]["worker"]
    assert all(r["usage"]["prompt_tokens_details"]["cached_tokens"] > 0 for r in again + again_b)
