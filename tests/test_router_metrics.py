"""Router decisions on /metrics: decisions by planned route, placement rules and requests per
worker come from the controller's pool (they show even when the router actor is slow), bytes
pulled from the router actor. Over HTTP with 2 tiny workers, Ray on loopback."""


import httpx
import pytest

from cluster.metrics import Metrics

TINY = "tiny-llama"


def _value(text: str, name: str, **labels) -> float | None:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(f"{name}{{{want}}} ") or (not labels and line.startswith(f"{name} ")):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_render_shows_routing_counts():
    m = Metrics(["acme"])
    text = m.render({}, {}, {"ready": 2}, {}, {"decisions": {"local": 3, "recomputed": 2},
                                             "placements": {"match": 3, "place": 2},
                                             "routed": {"kv-w0": 4, "kv-w1": 1}, "bytes_pulled": 1024,
                                             "pull_failures": 0, "ttft_error": {},
                                             "groups": {"kv-w0": 3, "kv-w1": 1}, "decode_row_s": 0.03}).decode()
    assert _value(text, "kvmesh_router_decisions", kind="local") == 3
    assert _value(text, "kvmesh_router_decode_row_seconds") == 0.03
    assert _value(text, "kvmesh_router_placements", kind="place") == 2
    assert _value(text, "kvmesh_router_routed", worker="kv-w0") == 4
    assert _value(text, "kvmesh_router_groups", worker="kv-w1") == 1
    # a worker with no group lately (or gone) reads 0, not its last count
    later = m.render({}, {}, {"ready": 2}, {}, {"groups": {"kv-w0": 2}}).decode()
    assert (_value(later, "kvmesh_router_groups", worker="kv-w0"), _value(later, "kvmesh_router_groups", worker="kv-w1")) == (2, 0)
    assert _value(text, "kvmesh_router_bytes_pulled") == 1024


def test_router_reports_the_signed_ttft_error_next_to_the_absolute_one():
    from actors.router import Router

    r = Router()
    r.report_outcome("local", 1.0, 3.0)  # predicted 1 s, took 3 s
    r.report_outcome("local", 2.0, 1.0)
    r.report_outcome("pulled", 0.5, 0.5)
    err = r.metrics()["ttft_error"]
    assert err["local"]["mean_abs_s"] == 1.5 and err["local"]["mean_signed_s"] == -0.5
    assert err["pulled"]["mean_signed_s"] == 0.0
    text = Metrics(["acme"]).render({}, {}, {}, {}, {"ttft_error": err}).decode()
    assert _value(text, "kvmesh_router_ttft_bias_seconds", kind="local") == -0.5
    assert _value(text, "kvmesh_router_ttft_error_seconds", kind="local") == 1.5


@pytest.mark.ray
def test_metrics_over_http_show_router_decisions_with_two_workers(tmp_path):
    from cluster.app import build_app
    from tests.serving import local_serve

    with local_serve({"tenants": [{"name": "acme", "api_keys": ["sk-acme"]}]}, tmp_path) as (url, tenants, serve):
        serve.run(build_app({"model": TINY, "tenants": str(tenants), "kv_cache_bytes": 8 << 20, "workers": 2,
                             "worker_num_cpus": 0}), name="rm", route_prefix="/")
        prompts = ["shared system prompt number one, " * 4 + f"q{i}" for i in range(3)]
        prompts += ["another group's system prompt text! " * 4 + f"q{i}" for i in range(3)]
        with httpx.Client(base_url=url, timeout=120) as c:
            workers = []
            for p in prompts:
                r = c.post("/v1/completions", headers={"Authorization": "Bearer sk-acme"},
                           json={"model": TINY, "prompt": p, "max_tokens": 2, "temperature": 0})
                assert r.status_code == 200, r.text
                workers.append(r.json()["kvmesh"]["worker"])
            text = c.get("/metrics").text
        routed = {w: _value(text, "kvmesh_router_routed", worker=w) for w in set(workers)}
        assert routed == {w: float(workers.count(w)) for w in set(workers)}
        decisions = sum(_value(text, "kvmesh_router_decisions", kind=k) or 0 for k in ("local", "pulled", "recomputed"))
        assert decisions == len(prompts)
        placements = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                         if line.startswith("kvmesh_router_placements{"))
        assert placements == len(prompts)  # the cost-aware router placed every one
        assert _value(text, "kvmesh_router_bytes_pulled") is not None
        # one request at a time: nothing decoded beside another, no contention measured
        assert _value(text, "kvmesh_router_decode_row_seconds") == 0
        # each group stays on one worker (placement, not request order)
        assert len(set(workers[:3])) == 1 and len(set(workers[3:])) == 1
        # two groups, each on its worker (or both on one): the gauge counts them there
        groups = {w: _value(text, "kvmesh_router_groups", worker=w) for w in set(workers)}
        assert groups == {w: float(len({i // 3 for i, x in enumerate(workers) if x == w})) for w in set(workers)}
