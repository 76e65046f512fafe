"""Property test of the engine entry points (hypothesis, tiny-llama).

Random requests with random sampling parameters and approximate-reuse fields go through
``SamplingParams.from_dict`` and ``LLMEngine.add_request`` (which validates): each is either
refused with InvalidRequest, leaving the pool untouched, or served to the end by ``step``,
which never raises. After every batch the pool's accounting is exact and nothing is in use.
"""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.llm_engine import EngineConfig, LLMEngine
from engine.sequence import InvalidRequest, Request, SamplingParams
from policies.eviction import TenantQuota

_ENGINE: list = []


def engine(tiny_model) -> LLMEngine:
    if not _ENGINE:
        _ENGINE.append(LLMEngine(EngineConfig(model="tiny-llama", num_blocks=48, max_num_batched_tokens=96,
                                              tenant_quotas={"alpha": TenantQuota(min_blocks=8),
                                                             "beta": TenantQuota(max_blocks=20)}), tiny_model))
    return _ENGINE[0]


text = st.lists(st.characters(codec="utf-8") | st.sampled_from(["\udc80", "\ud800", "{", "}"]), max_size=12).map(
    "".join) | st.sampled_from(["{x}", "Q: {x} A:"])
ints = st.integers(-3, 600) | st.integers(-2 ** 70, 2 ** 70)
number = st.none() | st.integers(-5, 2 ** 70) | st.floats(allow_nan=True) | st.booleans() | st.text(max_size=3)
params = st.fixed_dictionaries({}, optional={
    "max_tokens": number | st.integers(1, 4), "temperature": number | st.floats(0, 2), "top_p": number,
    "top_k": number, "seed": number | st.integers(-2, 2 ** 65), "ignore_eos": st.booleans() | number,
    "stop": st.none() | text | st.lists(text, max_size=5), "bogus": number})
request = st.fixed_dictionaries({
    "prompt": st.lists(st.integers(3, 500), min_size=0, max_size=90) | st.lists(ints, max_size=8),
    "params": params,
    "tenant": st.sampled_from(["alpha", "beta", "gamma"]),
    "reuse": st.sampled_from(["exact", "none", "approximate", "bogus"]),
    "template": st.none() | text,
    "template_text": st.none() | text,
    "template_params": st.none() | st.dictionaries(text, text | ints, max_size=2),
    "remap_policy": st.none() | st.sampled_from(["hash", "identity", "learnable", "nope"]),
    "recompute_ratio": st.none() | number | st.floats(0, 1),
})


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(st.lists(request, min_size=1, max_size=4))
def test_random_requests_are_refused_cleanly_or_served(tiny_model, reqs):
    eng = engine(tiny_model)
    accepted = []
    for i, r in enumerate(reqs):
        before = (eng.pool.num_free_blocks(), eng.pool.num_in_use(), len(eng.seqs), len(eng.scheduler.waiting))
        try:
            p = SamplingParams.from_dict(r["params"])
            req = Request(f"q{len(_ENGINE)}-{i}-{id(r)}", tuple(r["prompt"]), p, tenant=r["tenant"], reuse=r["reuse"],
                          template=r["template"], template_text=r["template_text"],
                          template_params=r["template_params"], remap_policy=r["remap_policy"],
                          recompute_ratio=r["recompute_ratio"])
            eng.add_request(req)
        except InvalidRequest:
            after = (eng.pool.num_free_blocks(), eng.pool.num_in_use(), len(eng.seqs), len(eng.scheduler.waiting))
            assert after == before, "a refused request changed the engine"
            continue
        except TypeError as e:  # Request/SamplingParams constructors with impossible types
            pytest.fail(f"constructor raised {e!r} instead of InvalidRequest")
        accepted.append(req)
    finished, failed, steps = set(), {}, 0
    while eng.has_unfinished():
        for out in eng.step():
            if out.error:
                failed[out.request_id] = out.error
            elif out.finished:
                finished.add(out.request_id)
        steps += 1
        assert steps < 2000
    assert not failed, failed  # nothing a client can send makes a request fail inside the step
    for req in accepted:
        assert req.request_id in finished
    eng.pool.check_invariants()
    assert eng.pool.num_in_use() == 0 and not eng.seqs and not eng.scheduler.has_unfinished()
    assert eng.pool.num_free_blocks() == eng.pool.num_blocks
    if eng.approx is not None:
        eng.approx.pool.check_invariants()
