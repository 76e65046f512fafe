"""Fuzz every route of the served OpenAPI schema with schemathesis: never a 5xx.

The in-process ingress (tests/ingress_harness.py) over one tiny-llama engine; requests carry a
valid API key. For each operation that ``/openapi.json`` declares, schemathesis generates a
bounded number of cases from the declared parameters and request body (routes whose bodies are
not declared get cases without one); every answer must be < 500, and afterwards a normal request
is served and the block pool's accounting is exact.
"""

import asyncio

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from tests.ingress_harness import TINY, make_ingress

EXAMPLES = 25  # per operation: the suite stays in seconds


def test_no_route_answers_5xx(tiny_model, monkeypatch):
    from starlette.testclient import TestClient

    app, ing, engine = make_ingress(tiny_model, monkeypatch)
    try:
        with TestClient(app, raise_server_exceptions=False) as client:
            spec = client.get("/openapi.json").json()
            schema = schemathesis.openapi.from_dict(spec)
            ops = [r.ok() for r in schema.get_all_operations()]
            assert {"/v1/completions", "/v1/chat/completions"} <= {op.path for op in ops}
            failures, counts = [], {}
            def fuzz(op):
                @settings(max_examples=EXAMPLES, deadline=None, database=None,
                          suppress_health_check=list(HealthCheck))
                @given(op.as_strategy())
                def check(case):
                    headers = {**(case.headers or {}), "Authorization": "Bearer sk-acme"}
                    kw = {"headers": headers, "params": case.query}
                    if not isinstance(case.body, schemathesis.core.NotSet):
                        kw["json"] = case.body
                    r = client.request(op.method.upper(), case.formatted_path, **kw)
                    counts[(op.method, op.path)] = counts.get((op.method, op.path), 0) + 1
                    if r.status_code >= 500:
                        failures.append((op.method, op.path, r.status_code, r.text[:200], str(case.body)[:200]))

                check()

            for op in ops:
                fuzz(op)
            assert not failures, failures[:5]
            assert len(counts) == len(ops)
            r = client.post("/v1/completions", headers={"Authorization": "Bearer sk-acme"},
                            json={"model": TINY, "prompt": "after the fuzz", "max_tokens": 2})
            assert r.status_code == 200, r.text

            def idle(e):
                e.pool.check_invariants()
                return e.pool.num_in_use() == 0 and not e.seqs

            async def ask():
                return await engine.call(idle)

            assert asyncio.run(ask())
    finally:
        engine.shutdown()
