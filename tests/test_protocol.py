"""cluster.protocol without a server: the published request schemas and the models that parse
the routes' bodies agree (bodies generated from /openapi.json by schemathesis parse, or fail only
on a documented cross-field rule), and the field policy (unsupported / unknown / metadata)."""

import json

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from cluster.app import app
from cluster.protocol import (ApiError, ChatRequest, CompletionRequest, DetokenizeBody, TemplateBody, TokenizeBody,
                              parse_body)

ROUTES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatRequest, "/tokenize": TokenizeBody,
          "/detokenize": DetokenizeBody, "/v1/templates": TemplateBody}


@pytest.mark.parametrize("path", sorted(ROUTES))
def test_bodies_valid_for_the_published_schema_pass_field_validation(path):
    schema = schemathesis.openapi.from_dict(app.openapi())
    [op] = [r.ok() for r in schema.get_all_operations() if r.ok().path == path and r.ok().method == "post"]
    rejected = []

    @settings(max_examples=60, suppress_health_check=list(HealthCheck), deadline=None, database=None)
    @given(op.as_strategy())
    def check(case):
        try:
            parse_body(json.dumps(case.body).encode(), ROUTES[path])
        except ApiError as e:  # only cross-field rules (documented 400s) may refuse a schema-valid body
            if e.message.startswith(("invalid field", "unknown field")) or e.code == "unsupported_parameter":
                rejected.append((case.body, e.message))

    check()
    assert not rejected, rejected[:3]


def _parse(cls, body):
    try:
        parse_body(json.dumps(body).encode(), cls)
    except ApiError as e:
        return e
    return None


def test_field_policy():
    base = {"model": "m", "prompt": "x"}
    e = _parse(CompletionRequest, {**base, "suffix": "y"})
    assert e.param == "suffix" and e.code == "unsupported_parameter"
    assert _parse(CompletionRequest, {**base, "suffix": None, "priority": 0.0, "length_penalty": 1}) is None
    e = _parse(CompletionRequest, {**base, "frobnicate": 1})
    assert e.param == "frobnicate" and e.code == "unknown_parameter"
    assert _parse(CompletionRequest, {**base, "n": 2.0, "user": "u", "metadata": {"a": "b"}, "store": False}) is None
    assert _parse(CompletionRequest, {**base, "n": True}).param == "n"  # bools are not integers
    assert _parse(CompletionRequest, {**base, "logit_bias": {"x": 1}}).param.startswith("logit_bias")
    assert _parse(CompletionRequest, {**base, "stop": list("abcde")}).param == "stop"
    assert _parse(CompletionRequest, {**base, "best_of": 2, "n": 3}).param == "best_of"
    assert _parse(CompletionRequest, {**base, "max_tokens": 0}).param == "max_tokens"
    assert _parse(CompletionRequest, {**base, "max_tokens": 0, "echo": True}) is None
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert _parse(ChatRequest, {**chat, "echo": True}).param == "echo"
    assert _parse(ChatRequest, {**chat, "top_logprobs": 2}).param == "top_logprobs"
    assert _parse(ChatRequest, {**chat, "response_format": {"type": "json_schema"}}).param.startswith("response_format")
    assert _parse(ChatRequest, {**chat, "messages": [{"role": "tool", "content": "x"}]}).param == "messages.0.role"
    assert _parse(TokenizeBody, {"prompt": "x", "messages": chat["messages"]}).param == "prompt"


def test_stage_timings_split_the_time_to_first_token():
    from cluster.protocol import stage_timings

    t = stage_timings(received=10.0, built=10.01, first_at=10.5, lease_s=0.04, route_s=0.01, engine_ttft_s=0.4,
                      prefill_s=0.3)
    assert t["ttft_s"] == 0.5 and t["ingress_s"] == 0.01 and t["lease_s"] == 0.04 and t["route_s"] == 0.01
    assert t["engine_ttft_s"] == 0.4 and t["prefill_s"] == 0.3 and t["engine_queue_s"] == 0.1
    assert t["overhead_s"] == 0.05  # 0.5 - 0.01 - 0.04 - 0.4
    # what was not measured stays None, and nothing derived from it is made up
    t = stage_timings(10.0, 10.0, 10.2, None, None, None, None)
    assert t["ttft_s"] == 0.2 and t["lease_s"] is None and t["engine_queue_s"] is None and t["overhead_s"] is None
    # no lease (a Serve router chose the replica): the overhead is everything but the engine's
    t = stage_timings(10.0, 10.01, 10.5, None, None, 0.4, 0.3)
    assert t["lease_s"] is None and t["overhead_s"] == 0.09
    # clocks of two processes: a stage never reads negative
    t = stage_timings(10.0, 10.0, 10.2, 0.1, 0.05, 0.2, 0.25)
    assert t["overhead_s"] == 0.0 and t["engine_queue_s"] == 0.0
