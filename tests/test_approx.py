"""Approximate (Oneiros) reuse in the engine: donors, remapped admission, no poisoning, isolation.

Tiny model (byte tokenizer, one token per character) unless marked; a reference output comes
from a fresh engine with reuse ``none`` (full prefill, same numerics as HF: see test_engine).
"""

import pytest
import torch

from engine.llm_engine import EngineConfig, LLMEngine
from engine.manual_forward import SeqKV
from engine.sequence import InvalidRequest, Request, SamplingParams
from engine.slot_pool import Donor, SlotPool

BS = 16
T = ("Please classify the review below as positive or negative.\nReview: {text}\n"
     "Think about the words used by the writer, the tone, and the overall impression. Label:")
A, B, C = "I loved this film a lot.", "The food was cold, sadly", "Great value for a price."  # same length bucket


def greedy(n: int = 6) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def engine(loaded, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=loaded.name, block_size=BS, num_blocks=96, max_num_batched_tokens=256, **kw),
                     loaded=loaded)


def treq(eng, rid, text, tenant="acme", reuse="approximate", template="sent", **kw) -> Request:
    prompt = T.replace("{text}", text)
    return Request(rid, tuple(eng.encode(prompt)), greedy(), tenant=tenant, reuse=reuse, template=template,
                   template_text=T if template else None, template_params={"text": text} if template else None, **kw)


def run(eng, *reqs):
    """Run to completion; per request: (output ids, last output)."""
    outs = eng.generate(list(reqs))
    return {rid: ([t for o in os_ for t in o.new_token_ids], os_[-1]) for rid, os_ in outs.items()}


def reference(loaded, prompt) -> list[int]:
    eng = engine(loaded, enable_prefix_caching=False)
    (ids, _), = run(eng, Request("ref", tuple(prompt), greedy(), reuse="none")).values()
    return ids


def assert_clean(eng: LLMEngine) -> None:
    assert not eng.has_unfinished()
    eng.pool.check_invariants()
    assert eng.pool.num_in_use() == 0 and eng.pool.num_free_blocks() == eng.pool.num_blocks
    eng.approx.pool.check_invariants()


def test_approximate_after_donor(tiny_model):
    eng = engine(tiny_model)
    first = run(eng, treq(eng, "a", A))["a"][1]
    assert first.num_approx_tokens == 0 and len(eng.approx.pool) == 1  # no donor yet: ran exactly, donated
    ids, out = run(eng, treq(eng, "b", B))["b"]
    assert out.finished and len(ids) == 6
    assert out.num_approx_tokens > 0
    assert out.num_cached_tokens >= out.num_approx_tokens  # cached = exact + approximate
    assert out.num_cached_tokens < out.num_prompt_tokens
    assert_clean(eng)


def test_auto_detected_template(tiny_model):
    eng = engine(tiny_model)
    run(eng, treq(eng, "a", A, template=None))
    _, out = run(eng, treq(eng, "b", "Something else entirely, but longer than A.", template=None))["b"]
    assert out.num_approx_tokens > 0
    assert_clean(eng)


def test_no_poisoning_of_exact_requests(tiny_model):
    eng = engine(tiny_model)
    run(eng, treq(eng, "a", A))
    res = run(eng, treq(eng, "b", B), treq(eng, "c", C))
    assert all(out.num_approx_tokens > 0 for _, out in res.values())
    for i, text in enumerate((B, C)):
        prompt = eng.encode(T.replace("{text}", text))
        # the approximate blocks were never registered: only the exact prefix shared with the donor hits
        (ids, out), = run(eng, Request(f"x{i}", tuple(prompt), greedy(), tenant="acme", reuse="exact")).values()
        common = next(j for j, (p, q) in enumerate(zip(prompt, eng.encode(T.replace("{text}", A)))) if p != q)
        assert out.num_approx_tokens == 0 and out.num_cached_tokens <= common // BS * BS
        assert ids == reference(tiny_model, prompt)
    assert_clean(eng)


@pytest.mark.parametrize("reuse", ["exact", "none"])
def test_exact_and_none_never_get_approximate_kv(tiny_model, reuse):
    eng = engine(tiny_model)
    run(eng, treq(eng, "a", A))
    ids, out = run(eng, treq(eng, "b", B, reuse=reuse))["b"]
    assert out.num_approx_tokens == 0 and eng.approx.stats["approx_requests"] == 0
    assert ids == reference(tiny_model, eng.encode(T.replace("{text}", B)))


def test_slot_pool_tenant_isolation(tiny_model):
    eng = engine(tiny_model)
    run(eng, treq(eng, "a", A, tenant="acme"))
    _, out = run(eng, treq(eng, "b", B, tenant="globex"))["b"]
    assert out.num_approx_tokens == 0  # globex may not read acme's donors
    _, out = run(eng, treq(eng, "c", C, tenant="globex", read_domains=("acme",)))["c"]
    assert out.num_approx_tokens > 0  # granted
    assert {d.domain for d in eng.approx.pool} == {"acme", "globex"}
    assert_clean(eng)


def test_registered_template_and_request_overrides(tiny_model):
    eng = engine(tiny_model)
    eng.register_template("acme", "sent", T)
    mk = lambda rid, text, **kw: Request(rid, tuple(eng.encode(T.replace("{text}", text))), greedy(), tenant="acme",  # noqa: E731
                                         reuse="approximate", template="sent", template_params={"text": text}, **kw)
    run(eng, mk("a", A))
    _, out = run(eng, mk("b", "short", remap_policy="identity", recompute_ratio=0.0))["b"]  # identity: any length
    assert out.num_approx_tokens > 0
    with pytest.raises(InvalidRequest):
        eng.add_request(mk("bad", B, recompute_ratio=1.5))
    with pytest.raises(InvalidRequest):
        eng.add_request(mk("bad2", B, remap_policy="magic"))
    assert_clean(eng)


def test_slot_pool_lru_bytes():
    kv = lambda n: SeqKV(torch.zeros(2, n, 1, 4), torch.zeros(2, n, 1, 4), torch.arange(n))  # noqa: E731
    per = kv(10).k.nbytes * 2
    pool = SlotPool(bytes_per_domain=3 * per)
    for i in range(5):
        assert pool.put(Donor("acme", "acme", (i,) * 10, kv(10)))
    pool.put(Donor("globex", "globex", (9,) * 10, kv(10)))
    assert [d.token_ids[0] for d in pool.candidates(("acme",))] == [4, 3, 2]
    assert pool.domain_bytes("acme") == 3 * per and pool.evictions == 2
    assert [d.token_ids[0] for d in pool.candidates(("globex",))] == [9]
    assert not pool.put(Donor("acme", "acme", (7,) * 40, kv(40)))  # larger than the bound
    pool.check_invariants()


def test_default_model_chat_template(default_model):
    eng = LLMEngine(EngineConfig(block_size=BS, num_blocks=128, max_num_batched_tokens=512), loaded=default_model)
    tmpl = ("Translate the sentence into French. Keep names unchanged, keep numbers as they are, and "
            "answer with the translation only, without notes or explanations.\nSentence: {s}\n"
            "Remember: one line, French only, the same meaning as the original sentence.")
    tok = default_model.tokenizer

    def mk(rid, s, reuse="approximate"):
        text = tok.apply_chat_template([{"role": "user", "content": tmpl.replace("{s}", s)}],
                                       add_generation_prompt=True, tokenize=False)
        return Request(rid, tuple(eng.encode(text)), greedy(8), tenant="acme", reuse=reuse, template="fr",
                       template_text=tmpl, template_params={"s": s})

    assert eng.approx.instance(mk("probe", "The weather is nice today.")) is not None
    run(eng, mk("a", "The weather is nice today."))
    ids, out = run(eng, mk("b", "The museum opens at nine."))["b"]
    assert out.finished and out.num_approx_tokens > 0
    ids2, out2 = run(eng, mk("c", "The museum opens at nine.", reuse="exact"))["c"]
    assert out2.num_approx_tokens == 0
    ref = LLMEngine(EngineConfig(block_size=BS, num_blocks=128, enable_prefix_caching=False), loaded=default_model)
    (want, _), = run(ref, Request("r", mk("c", "The museum opens at nine.").prompt_ids, greedy(8), reuse="none")).values()
    assert ids2 == want  # no poisoning on the default model either
    assert_clean(eng)


# -- HTTP ----------------------------------------------------------------------------------------
@pytest.mark.ray
def test_http_approximate_reuse_reports_approx_cached_tokens(tmp_path):
    import httpx

    from cluster.app import build_app
    from tests.serving import local_serve

    tenants_data = {"tenants": [
        {"name": "acme", "api_keys": ["sk-acme"], "reuse": "approximate", "templates": {"sent": T},
         "remap": {"policy": "hash", "recompute_ratio": 0.3, "gate": False}},  # opted out of the quality gate
        {"name": "globex", "api_keys": ["sk-globex"]},
    ]}
    with local_serve(tenants_data, tmp_path) as (url, tenants, serve):
        serve.run(build_app({"model": "tiny-llama", "tenants": str(tenants), "kv_cache_bytes": 16 << 20,
                             "worker_num_cpus": 0}), name="approx", route_prefix="/")
        c = httpx.Client(base_url=url, timeout=120)
        acme, globex = {"Authorization": "Bearer sk-acme"}, {"Authorization": "Bearer sk-globex"}

        def complete(text, headers=acme, template="sent", reuse=None):
            kv = {"template": template, "params": {"text": text}} if template else {}
            if reuse:
                kv["reuse"] = reuse
            r = c.post("/v1/completions", headers=headers, json={
                "model": "tiny-llama", "prompt": T.replace("{text}", text), "max_tokens": 4, "temperature": 0,
                "kvmesh": kv})
            return r

        first = complete(A).json()
        assert first["kvmesh"]["approx_cached_tokens"] == 0
        second = complete(B).json()
        approx = second["kvmesh"]["approx_cached_tokens"]
        assert approx > 0
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == approx + second["kvmesh"]["exact_cached_tokens"]
        exact = complete(B, reuse="exact").json()
        assert exact["kvmesh"]["approx_cached_tokens"] == 0
        assert complete(A, template="nope").status_code == 400
        r = c.post("/v1/templates", headers=globex, json={"id": "g", "template": T})
        assert r.status_code == 200 and r.json()["params"] == ["text"]
        assert complete(C, headers=globex, template="g").json()["kvmesh"]["approx_cached_tokens"] == 0  # reuse exact default
        assert c.post("/v1/templates", json={"id": "g", "template": T}).status_code == 401


def test_remapped_admission_respects_the_tenants_sequence_cap(tiny_model):
    """fair_share: a tenant runs at most max_num_seqs - reserve sequences (here 4 - 1), whichever
    path admits them; a remapped request of a full tenant waits and is remapped once a slot frees."""
    eng = engine(tiny_model, max_num_seqs=4)
    run(eng, treq(eng, "a", A))  # the donor
    for i in range(3):
        eng.add_request(Request(f"x{i}", tuple(eng.encode(f"{i}{i}{i} exact request of acme")),
                                SamplingParams(max_tokens=4 + 4 * i, temperature=0.0, ignore_eos=True),
                                tenant="acme"))
    eng.step()
    assert len(eng.scheduler.running) == 3 and eng.scheduler.tenant_full("acme")
    eng.add_request(treq(eng, "b", B))
    outs = {}
    while eng.has_unfinished():
        for o in eng.step():
            outs.setdefault(o.request_id, []).append(o)
        assert sum(s.request.tenant == "acme" for s in eng.scheduler.running) <= 3
    assert outs["b"][-1].num_approx_tokens > 0  # remapped once x0 had finished
    assert_clean(eng)
