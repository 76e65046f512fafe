"""The HTTP front end to end: Ray Serve on 127.0.0.1, driven by the real ``openai`` client.

Most tests use the tiny random model (byte tokenizer, instant); one test checks determinism on
the default model against HF transformers' greedy ``generate``.
"""

import time

import httpx
import openai
import pytest
from tests.serving import local_serve

pytestmark = pytest.mark.ray

TINY = "tiny-llama"
TENANTS = {"admin_keys": ["sk-admin"], "tenants": [
    {"name": "acme", "api_keys": ["sk-acme"], "share_with": ["globex"]},
    {"name": "globex", "api_keys": ["sk-globex"]},
    {"name": "solo", "api_keys": ["sk-solo"]},
    {"name": "plain", "api_keys": ["sk-plain"], "reuse": "none"},
    {"name": "limited", "api_keys": ["sk-limited"], "limits": {"requests_per_s": 0.001, "burst": 1}},
]}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from cluster.app import build_app

    with local_serve(TENANTS, tmp_path_factory.mktemp("tenants")) as (base, tenants, serve):
        serve.run(build_app({"model": TINY, "tenants": str(tenants), "kv_cache_bytes": 16 << 20,
                             "worker_num_cpus": 0}), name="tiny", route_prefix="/")
        yield {"base": base, "tenants": str(tenants), "serve": serve}


def client(server, key="sk-acme", prefix=""):
    return openai.OpenAI(base_url=f"{server['base']}{prefix}/v1", api_key=key, max_retries=0, timeout=120)


def http(server):
    return httpx.Client(base_url=server["base"], timeout=120)


def _cached(resp) -> int:
    return resp.usage.prompt_tokens_details.cached_tokens


def test_health_and_models(server):
    assert http(server).get("/health").json()["status"] == "ok"
    models = client(server).models.list()
    assert [m.id for m in models.data] == [TINY]


def test_completion_reports_cached_tokens_on_repeat_and_kvmesh_object(server):
    c = client(server)
    prompt = "The quick brown fox jumps over the lazy dog; " * 3
    r1 = c.completions.create(model=TINY, prompt=prompt, max_tokens=8, temperature=0)
    r2 = c.completions.create(model=TINY, prompt=prompt, max_tokens=8, temperature=0)
    assert r1.usage.prompt_tokens == len(prompt.encode()) and r1.usage.completion_tokens == 8
    assert _cached(r1) == 0
    assert _cached(r2) > 0 and _cached(r2) == r2.usage.prompt_tokens // 16 * 16
    assert r2.choices[0].text == r1.choices[0].text
    kv = r2.model_extra["kvmesh"]
    assert kv["route"] == "local" and kv["exact_cached_tokens"] == _cached(r2)
    assert kv["approx_cached_tokens"] == 0 and kv["pulled_tokens"] == 0 and kv["worker"]
    # why: the first went where a new prefix is placed; the repeat to the worker that holds it,
    # by the router's record of where it sent the first (the index shows it too once published)
    first = r1.model_extra["kvmesh"]
    assert first["placement"] == "place" and not first["routed_holders"]
    assert kv["placement"] == "match" and kv["routed_holders"][kv["worker"]] >= _cached(r2)
    assert first["planned_route"] == "recomputed" and kv["planned_route"] == "local"
    assert first["pull_outcome"] is None and kv["pull_outcome"] is None  # no pulls
    assert kv["index_holders"] is None or set(kv["index_holders"]) <= {kv["worker"]}
    if kv["options"] is not None:  # the ranking it chose from (None: the router did not answer in time)
        assert kv["worker"] in kv["options"] and kv["options"][kv["worker"]]["kind"] == "local"
    # where the time to first token went: every stage measured, the parts within the whole
    for t in (first["timings"], kv["timings"]):
        assert all(t[f"{k}_s"] is not None and t[f"{k}_s"] >= 0 for k in
                   ("ttft", "ingress", "lease", "route", "engine_ttft", "engine_queue", "prefill", "overhead"))
        assert t["route_s"] <= t["lease_s"] and t["prefill_s"] <= t["engine_ttft_s"]
        assert t["ingress_s"] + t["lease_s"] + t["engine_ttft_s"] <= t["ttft_s"] + 1e-3
    # the repeat's prefill computes the tokens after its cached blocks only
    assert kv["timings"]["prefill_s"] > 0 and first["timings"]["prefill_s"] > 0


def test_grants_and_isolation(server):
    prompt = "System: you are a helpful assistant for the acme corporation. " * 2
    a = client(server, "sk-acme").completions.create(model=TINY, prompt=prompt, max_tokens=2, temperature=0)
    assert _cached(a) == 0
    g = client(server, "sk-globex").completions.create(model=TINY, prompt=prompt, max_tokens=2, temperature=0)
    assert _cached(g) > 0  # acme.share_with: [globex]
    s = client(server, "sk-solo").completions.create(model=TINY, prompt=prompt, max_tokens=2, temperature=0)
    assert _cached(s) == 0  # no grant: isolated
    why = s.model_extra["kvmesh"]  # nor does the routing explanation show acme's copy
    assert not why["index_holders"] and not why["routed_holders"] and why["placement"] == "place"
    other = "globex's own system prompt, never granted to anyone at all. " * 2
    client(server, "sk-globex").completions.create(model=TINY, prompt=other, max_tokens=2, temperature=0)
    back = client(server, "sk-acme").completions.create(model=TINY, prompt=other, max_tokens=2, temperature=0)
    assert _cached(back) == 0  # grants are one way


def test_reuse_mode_from_request_and_tenant_default(server):
    prompt = "Reuse modes decide whether cached KV may be used at all. " * 2
    c = client(server)
    c.completions.create(model=TINY, prompt=prompt, max_tokens=2, temperature=0)
    r = c.completions.create(model=TINY, prompt=prompt, max_tokens=2, temperature=0, extra_body={"kvmesh": {"reuse": "none"}})
    assert _cached(r) == 0 and r.model_extra["kvmesh"]["reuse"] == "none"
    p = client(server, "sk-plain")
    p.completions.create(model=TINY, prompt=prompt, max_tokens=2, temperature=0)
    r = p.completions.create(model=TINY, prompt=prompt, max_tokens=2, temperature=0)
    assert _cached(r) == 0 and r.model_extra["kvmesh"]["reuse"] == "none"  # the tenant's default
    for _ in range(2):  # reuse "none" neither reads nor (in this engine) writes the prefix cache
        r = p.completions.create(model=TINY, prompt=prompt, max_tokens=2, temperature=0,
                                 extra_body={"kvmesh": {"reuse": "exact"}})
    assert _cached(r) > 0 and r.model_extra["kvmesh"]["reuse"] == "exact"


def test_streaming_completion_equals_non_streaming(server):
    c = client(server)
    prompt = "Streaming and non-streaming must agree at temperature zero."
    whole = c.completions.create(model=TINY, prompt=prompt, max_tokens=12, temperature=0)
    chunks = list(c.completions.create(model=TINY, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                       stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == whole.choices[0].text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12 and _cached(chunks[-1]) > 0


def test_chat_completion_streaming_and_not(server):
    c = client(server)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]
    whole = c.chat.completions.create(model=TINY, messages=msgs, max_tokens=10, temperature=0)
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    assert whole.usage.completion_tokens == 10 and "kvmesh" in whole.model_extra
    chunks = list(c.chat.completions.create(model=TINY, messages=msgs, max_tokens=10, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks)
    assert text == whole.choices[0].message.content
    again = c.chat.completions.create(model=TINY, messages=msgs, max_tokens=10, temperature=0)
    assert _cached(again) > 0


def test_sse_ends_with_done(server):
    with http(server).stream("POST", "/v1/completions", headers={"Authorization": "Bearer sk-acme"},
                             json={"model": TINY, "prompt": "sse", "max_tokens": 3, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)


def test_bad_or_missing_key_is_401(server):
    with pytest.raises(openai.AuthenticationError) as e:
        client(server, "sk-wrong").completions.create(model=TINY, prompt="x", max_tokens=1)
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    for headers in ({}, {"Authorization": "sk-acme"}, {"Authorization": "Basic sk-acme"}):
        r = http(server).post("/v1/chat/completions", headers=headers, json={"model": TINY, "messages": []})
        assert r.status_code == 401 and set(r.json()["error"]) >= {"message", "type", "code"}
    assert http(server).get("/v1/models").status_code == 401
    assert http(server).get(f"/v1/models/{TINY}").status_code == 401


def test_models_list_and_retrieve(server):
    c = client(server)
    assert [m.id for m in c.models.list().data] == [TINY]
    assert c.models.retrieve(TINY).id == TINY
    with pytest.raises(openai.NotFoundError) as e:
        c.models.retrieve("no-such/model")
    assert e.value.body["code"] == "model_not_found"


BAD = [
    ("malformed json", "/v1/completions", b'{"model": "tiny-llama", "prompt": ', 400),
    ("not an object", "/v1/completions", b'[1, 2]', 400),
    ("wrong type", "/v1/completions", {"model": TINY, "prompt": "x", "max_tokens": "ten"}, 400),
    ("wrong prompt type", "/v1/completions", {"model": TINY, "prompt": {"a": 1}}, 400),
    ("missing prompt", "/v1/completions", {"model": TINY}, 400),
    ("unknown model", "/v1/completions", {"model": "gpt-9", "prompt": "x"}, 404),
    ("prompt too long", "/v1/completions", {"model": TINY, "prompt": "x" * 1100}, 400),
    ("max_tokens too large", "/v1/completions", {"model": TINY, "prompt": "x", "max_tokens": 5000}, 400),
    ("max_tokens zero", "/v1/completions", {"model": TINY, "prompt": "x", "max_tokens": 0}, 400),
    ("bad stop", "/v1/completions", {"model": TINY, "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400),
    ("empty stop", "/v1/completions", {"model": TINY, "prompt": "x", "stop": ""}, 400),
    ("stop wrong type", "/v1/completions", {"model": TINY, "prompt": "x", "stop": 7}, 400),
    ("temperature", "/v1/completions", {"model": TINY, "prompt": "x", "temperature": 9}, 400),
    ("n too large", "/v1/completions", {"model": TINY, "prompt": "x", "n": 65}, 400),
    ("bad reuse", "/v1/completions", {"model": TINY, "prompt": "x", "kvmesh": {"reuse": "maybe"}}, 400),
    ("empty prompt", "/v1/completions", {"model": TINY, "prompt": ""}, 400),
    ("no messages", "/v1/chat/completions", {"model": TINY, "messages": []}, 400),
    ("bad role", "/v1/chat/completions", {"model": TINY, "messages": [{"role": "robot", "content": "x"}]}, 400),
    ("chat too long", "/v1/chat/completions", {"model": TINY, "messages": [{"role": "user", "content": "y" * 1100}]}, 400),
]


@pytest.mark.parametrize("name, path, body, status", BAD, ids=[b[0] for b in BAD])
def test_bad_inputs_get_openai_error_bodies(server, name, path, body, status):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = http(server).post(path, headers={"Authorization": "Bearer sk-acme", "Content-Type": "application/json"}, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"] and "type" in err and "code" in err


def test_openai_client_sees_4xx_as_exceptions(server):
    c = client(server)
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=TINY, prompt="x" * 1100)
    assert e.value.body["code"] == "context_length_exceeded"


def test_rate_limit_is_429_with_retry_after(server):
    c = client(server, "sk-limited")
    c.completions.create(model=TINY, prompt="first", max_tokens=1)
    with pytest.raises(openai.RateLimitError) as e:
        c.completions.create(model=TINY, prompt="second", max_tokens=1)
    assert e.value.status_code == 429 and int(e.value.response.headers["Retry-After"]) >= 1
    assert e.value.body["code"] == "rate_limit_exceeded"


def _worker_engines(server):  # pool-wide counts: the admin view (a tenant sees only its own state)
    """Every worker's engine stats; ``engine`` None where a worker did not answer the pool's
    stats call in time (its state is then unknown, not idle)."""
    r = http(server).get("/kvmesh/workers", headers={"Authorization": "Bearer sk-admin"})
    return [w["engine"] for w in r.json()["workers"]]


def test_client_disconnect_mid_stream_frees_blocks(server):
    body = {"model": TINY, "prompt": "a long generation that the client abandons", "max_tokens": 900,
            "ignore_eos": True, "stream": True}
    with http(server).stream("POST", "/v1/completions", headers={"Authorization": "Bearer sk-solo"}, json=body) as r:
        assert r.status_code == 200
        it = r.iter_lines()
        got = [next(it) for _ in range(4)]
        assert any(line.startswith("data: {") for line in got)
    deadline = time.monotonic() + 60
    while True:
        engines = _worker_engines(server)
        if engines and all(e is not None and e["running"] == 0 and e["waiting"] == 0 for e in engines):
            break
        assert time.monotonic() < deadline, engines
        time.sleep(0.2)
    solo = [e["tenants"].get("solo") for e in engines if "solo" in e["tenants"]]
    # the engine counts output tokens only for requests that finished: 0 means it was aborted
    assert solo and all(t["output_tokens"] < 900 for t in solo)
    assert all(e["free_blocks"] == e["num_blocks"] for e in engines)


def test_metrics_per_tenant(server):
    c = client(server, "sk-globex")
    c.completions.create(model=TINY, prompt="metrics " * 8, max_tokens=2)
    c.completions.create(model=TINY, prompt="metrics " * 8, max_tokens=2)
    text = http(server).get("/metrics").text
    samples = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
               if line and not line.startswith("#")}
    assert samples['kvmesh_prompt_tokens_total{tenant="globex"}'] > 0
    assert samples['kvmesh_cached_tokens_total{tenant="globex"}'] > 0
    assert samples['kvmesh_ttft_seconds_count{tenant="globex"}'] >= 2
    for stage in ("ttft", "ingress", "lease", "route", "engine_queue", "prefill", "overhead"):
        assert samples[f'kvmesh_request_stage_seconds_count{{stage="{stage}",tenant="globex"}}'] >= 2
    assert 'kvmesh_queue_depth{tenant="globex"}' in samples
    # probes ask with HEAD first (aiperf's /metrics check, load balancers' /health): no 405
    head = http(server).head("/metrics")
    assert head.status_code == 200 and head.content == b"" and head.headers["content-type"].startswith("text/plain")
    assert http(server).head("/health").status_code == 200
    assert samples['kvmesh_requests_total{code="401",endpoint="completions",tenant="-"}'] >= 1


def test_controller_failures_are_openai_errors_and_counted(server):
    import ray

    from cluster.app import build_app
    from cluster.controller import NAMESPACE, controller_name

    class _FailingController:  # local: Ray pickles it by value (actors cannot import this module)
        """Stands in for an app's controller: replicas attach, then every controller call fails."""

        def __init__(self):
            self.metrics_calls = 0

        def attach(self, *args):
            return 3600.0  # heartbeat interval: none during the test

        def heartbeat(self, *args):
            return True

        def detach(self, *args):
            return None

        def wait_ready(self, timeout_s):
            return {"max_model_len": 1024}

        def health(self):
            return {"workers": 1, "ready": 1, "error": None}

        def template(self, tenant, template_id):
            raise TimeoutError("the controller is too slow")

        def register_template(self, *args):
            from cluster.controller import ControllerClosing

            raise ControllerClosing("the controller is stopping")

        def workers_view(self):
            raise RuntimeError("boom")

        def metrics_snapshot(self):
            from cluster.pool import WorkerUnavailable

            self.metrics_calls += 1
            if self.metrics_calls == 1:
                raise WorkerUnavailable("the kvmesh controller is unavailable")
            return {"queue_depth": {}, "inflight": {}, "states": {"ready": 1, "starting": 0, "draining": 0},
                    "assigned": {}, "router": None}

    stub = ray.remote(num_cpus=0)(_FailingController).options(
        name=controller_name("failing"), namespace=NAMESPACE, lifetime="detached").remote()
    assert ray.get(stub.health.remote(), timeout=60)["ready"]  # registered under the name before replicas look
    try:
        server["serve"].run(build_app({"model": TINY, "tenants": server["tenants"], "worker_num_cpus": 0}),
                            name="failing", route_prefix="/failing")
        h, auth = http(server), {"Authorization": "Bearer sk-acme"}

        def error(r, status, code):
            assert r.status_code == status, r.text
            err = r.json()["error"]
            assert err["code"] == code and err["type"] == "server_error" and err["message"], err

        body = {"model": TINY, "prompt": "x", "max_tokens": 1, "kvmesh": {"template": "t", "params": {}}}
        error(h.post("/failing/v1/completions", headers=auth, json=body), 503, "controller_timeout")
        error(h.post("/failing/v1/templates", headers=auth, json={"id": "t", "template": "hi {x}"}), 503,
              "controller_unavailable")
        error(h.get("/failing/kvmesh/workers", headers=auth), 500, "internal_error")
        error(h.get("/failing/metrics"), 503, "worker_unavailable")
        text = h.get("/failing/metrics").text
        assert 'kvmesh_requests_total{code="503",endpoint="completions",tenant="acme"} 1.0' in text
    finally:
        server["serve"].delete("failing")
        ray.kill(stub)


@pytest.mark.model
def test_greedy_http_completions_equal_hf_generate(server):
    """temperature 0 + reuse exact over HTTP == HF greedy generate, with and without cache hits."""
    import torch

    from cluster.app import build_app
    from engine.model_loader import load_model

    server["serve"].run(build_app({"model": "default", "tenants": server["tenants"], "kv_cache_bytes": 64 << 20,
                                   "worker_num_cpus": 0}), name="smol", route_prefix="/smol")
    loaded = load_model("default")
    tok, model = loaded.tokenizer, loaded.model
    c = client(server, prefix="/smol")
    prompts = ["The capital of France is", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
               "Once upon a time, in a small village by the sea, there lived an old fisherman who"]
    for prompt in prompts:
        ids = tok(prompt, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**ids, max_new_tokens=20, do_sample=False)
        want = tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
        for _ in range(2):  # the second run hits the prefix cache
            r = c.completions.create(model=loaded.name, prompt=prompt, max_tokens=20, temperature=0,
                                     extra_body={"kvmesh": {"reuse": "exact"}})
            assert r.choices[0].text == want
        assert _cached(r) == r.usage.prompt_tokens // 16 * 16
