"""Hostile and malformed HTTP input gets a 4xx OpenAI error, never a 500, and breaks nothing.

In-process (tests/ingress_harness.py: the real FastAPI ingress over one tiny-llama engine,
no Ray). After every case the worker still serves a normal request and the block pool's
accounting is exact.
"""

import json

import httpx
import pytest

from tests.ingress_harness import TINY, make_ingress, pool_idle

AUTH = {"Authorization": "Bearer sk-acme"}


def body(**kw):
    return {"model": TINY, "prompt": "hello", "max_tokens": 2, **kw}


def raw(s: str) -> bytes:
    return s.encode()


DEEP = b'{"model": "tiny-llama", "prompt": "x", "extra": ' + b"[" * 5000 + b"]" * 5000 + b"}"
CASES = {  # name -> (path, content bytes, expected status)
    "lone surrogate in prompt": ("/v1/completions", raw('{"model": "tiny-llama", "prompt": "a\\udc80b"}'), 400),
    "lone surrogate in chat": ("/v1/chat/completions",
                               raw('{"model": "tiny-llama", "messages": [{"role": "user", "content": "\\ud800"}]}'), 400),
    "lone surrogate in template id": ("/v1/completions", raw(
        '{"model": "tiny-llama", "prompt": "x", "kvmesh": {"reuse": "approximate", "template": "t\\udc80"}}'), 400),
    "lone surrogate in a key": ("/v1/completions", raw('{"model": "tiny-llama", "prompt": "x", "\\udc80": 1}'), 400),
    "5000-level nesting": ("/v1/completions", DEEP, 400),
    "deep nesting of a template body": ("/v1/templates", b"[" * 5000 + b"]" * 5000, 400),
    "seed 2**64": ("/v1/completions", json.dumps(body(seed=2 ** 64)).encode(), 400),
    "seed 10**30": ("/v1/completions", json.dumps(body(seed=10 ** 30)).encode(), 400),
    "seed below int64": ("/v1/completions", json.dumps(body(seed=-(2 ** 63) - 1)).encode(), 400),
    "negative token id": ("/v1/completions", json.dumps(body(prompt=[5, -1, 7])).encode(), 400),
    "token id past the vocabulary": ("/v1/completions", json.dumps(body(prompt=[5, 512])).encode(), 400),
    "giant token id": ("/v1/completions", json.dumps(body(prompt=[10 ** 30])).encode(), 400),
    "max_tokens 10**30": ("/v1/completions", json.dumps(body(max_tokens=10 ** 30)).encode(), 400),
    "negative max_tokens": ("/v1/completions", json.dumps(body(max_tokens=-5)).encode(), 400),
    "temperature 1e308": ("/v1/completions", json.dumps(body(temperature=1e308)).encode(), 400),
    "temperature 1e400": ("/v1/completions", raw('{"model": "tiny-llama", "prompt": "x", "temperature": 1e400}'), 400),
    "NaN literal": ("/v1/completions", raw('{"model": "tiny-llama", "prompt": "x", "temperature": NaN}'), 400),
    "Infinity literal": ("/v1/completions", raw('{"model": "tiny-llama", "prompt": "x", "top_p": -Infinity}'), 400),
    "5000-digit integer": ("/v1/completions", raw('{"model": "tiny-llama", "prompt": "x", "max_tokens": 1'
                                                  + "0" * 5000 + "}"), 400),
    "invalid UTF-8": ("/v1/completions", b'{"model": "tiny-llama", "prompt": "\xff\xfe\xfd"}', 400),
    "not JSON": ("/v1/completions", b"\x00\x01garbage", 400),
    "JSON array": ("/v1/completions", b"[1, 2]", 400),
    "wrong types": ("/v1/completions", json.dumps({"model": 5, "prompt": {"a": 1}}).encode(), 400),
    "huge body": ("/v1/completions", b'{"model": "tiny-llama", "prompt": "' + b"a" * (3 << 20) + b'"}', 413),
    "prompt beyond any context": ("/v1/completions", json.dumps(body(prompt="a" * 5000)).encode(), 400),
    "chat prompt beyond any context": ("/v1/chat/completions", json.dumps(
        {"model": TINY, "messages": [{"role": "user", "content": "b" * 5000}]}).encode(), 400),
    "empty token prompt": ("/v1/completions", json.dumps(body(prompt=[])).encode(), 400),
    "huge template": ("/v1/templates", json.dumps({"id": "t", "template": "x" * 70000}).encode(), 400),
    "template id with a surrogate": ("/v1/templates", raw('{"id": "a\\udc80", "template": "hi {x}"}'), 400),
}


@pytest.fixture
async def served(tiny_model, monkeypatch):
    app, ing, engine = make_ingress(tiny_model, monkeypatch, max_body_bytes=2 << 20)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app, raise_app_exceptions=False),
                                 base_url="http://test", timeout=60) as client:
        yield client, ing, engine
    engine.shutdown()


async def normal_request_works(client, engine):
    r = await client.post("/v1/completions", headers=AUTH, json=body(prompt="still serving?", max_tokens=3,
                                                                    temperature=0))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3
    assert await pool_idle(engine)


@pytest.mark.parametrize("name", sorted(CASES))
async def test_malformed_input_gets_a_4xx_openai_error(served, name):
    client, ing, engine = served
    path, content, status = CASES[name]
    r = await client.post(path, headers={**AUTH, "Content-Type": "application/json"}, content=content)
    assert r.status_code == status, (name, r.status_code, r.text[:300])
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    assert len(r.text) < 2000  # never echoes a large body back
    await normal_request_works(client, engine)


async def test_huge_body_is_refused_by_its_declared_length_without_reading_it(served):
    client, _, engine = served

    async def endless():
        for _ in range(10_000):
            yield b"a" * 4096

    r = await client.post("/v1/completions", headers={**AUTH, "Content-Length": str(40 << 20)}, content=endless())
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    await normal_request_works(client, engine)


async def test_template_quota_per_tenant(served, monkeypatch):
    import cluster.controller as controller_mod

    client, _, engine = served
    monkeypatch.setattr(controller_mod, "TEMPLATES_PER_TENANT", 3)
    for i in range(3):
        r = await client.post("/v1/templates", headers=AUTH, json={"id": f"t{i}", "template": "Q: {q}"})
        assert r.status_code == 200, r.text
    r = await client.post("/v1/templates", headers=AUTH, json={"id": "t3", "template": "Q: {q}"})
    assert r.status_code == 429 and r.json()["error"]["code"] == "template_quota_exceeded"
    r = await client.post("/v1/templates", headers=AUTH, json={"id": "t1", "template": "A: {q}"})  # replace: fine
    assert r.status_code == 200
    r = await client.post("/v1/templates", headers={"Authorization": "Bearer sk-globex"},
                          json={"id": "t0", "template": "Q: {q}"})  # another tenant's quota is its own
    assert r.status_code == 200


async def test_long_prompt_within_the_bound_is_tokenized_and_served(served):
    client, ing, engine = served
    n = ing.max_model_len - 8
    r = await client.post("/v1/completions", headers=AUTH, json=body(prompt="z" * n, max_tokens=2))
    assert r.status_code == 200, r.text  # > ENCODE_INLINE_CHARS: tokenized on a thread
    assert r.json()["usage"]["prompt_tokens"] == n  # byte tokenizer: one id per byte
    await normal_request_works(client, engine)


async def test_a_prompt_near_the_context_without_max_tokens_gets_the_room_left(served):
    # completions default to 16 new tokens; a prompt 3 short of the context got a 400 naming a
    # max_tokens of 16 the client never sent
    client, ing, engine = served
    n = ing.max_model_len - 3
    r = await client.post("/v1/completions", headers=AUTH, json={"model": TINY, "prompt": [5] * n, "temperature": 0,
                                                                "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3 and r.json()["choices"][0]["finish_reason"] == "length"
    await normal_request_works(client, engine)


def test_a_client_that_went_away_is_a_quiet_499_not_an_internal_error(caplog):
    # Serve's receive() raises TaskCancelledError, Starlette's body read ClientDisconnect: both
    # were 500 internal_error, logged at ERROR with a traceback
    import logging

    import ray
    from starlette.requests import ClientDisconnect

    from cluster.app import _as_api_error

    with caplog.at_level(logging.ERROR, logger="cluster.app"):
        for e in (ray.exceptions.TaskCancelledError(), ClientDisconnect()):
            err = _as_api_error(e)
            assert err.status == 499 and err.code == "client_closed_request"
        assert _as_api_error(RuntimeError("boom")).status == 500  # a real failure stays one, logged
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["request failed"]


async def test_a_schema_too_costly_to_compile_is_a_400_and_the_worker_goes_on(tiny_model, monkeypatch):
    from tests.test_grammar import _slow_schema

    app, _, engine = make_ingress(tiny_model, monkeypatch, grammar_compile_cpu_s=1, max_schema_chars=120_000)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app, raise_app_exceptions=False),
                                     base_url="http://test", timeout=120) as client:
            for schema, match in ((_slow_schema(), "too complex"), (_slow_schema(4000), "characters")):
                r = await client.post("/v1/chat/completions", headers=AUTH, json={
                    "model": TINY, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
                    "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": json.loads(schema)}}})
                assert r.status_code == 400, r.text[:300]
                err = r.json()["error"]
                assert err["param"] == "response_format" and match in err["message"], err
            await normal_request_works(client, engine)
    finally:
        engine.shutdown()
