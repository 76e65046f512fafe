"""Isolation without Ray: cache_salt domains, tenants without a grant, every reuse path, the
isolation counters, the per-tenant introspection view.

Paths covered here: exact prefix blocks (engine), approximate donors / template slots (engine,
slot pool, donor import), pulls (export/import), and the router's choices (index lookups,
donor offers, replication) through ``CostAwareRouter`` over the real pure index and router
policy behind fake actor handles. Tiny model.
"""

import asyncio
import random

import pytest

from actors.prefix_index import PrefixIndex
from actors.router import Router, RouterClient
from actors.slot_registry import SlotKey, SlotRegistry
from engine.block_pool import prompt_chains
from engine.llm_engine import EngineConfig, LLMEngine
from engine.sequence import Request, SamplingParams
from policies.introspection import tenant_view
from policies.tenancy import (MAX_CACHE_SALT_CHARS, Tenants, TenantsError, domain_tenant, read_label,
                              salted_domain)
from tests.fakes import Handle

BS = 16
T = ("Please classify the review below as positive or negative.\nReview: {text}\n"
     "Think about the words used by the writer, the tone, and the overall impression. Label:")
A_TEXT, B_TEXT = "I loved this film a lot.", "The food was cold, sadly"
TENANTS = {"admin_keys": ["sk-admin"], "tenants": [
    {"name": "acme", "api_keys": ["sk-acme"], "share_with": ["globex"]},
    {"name": "globex", "api_keys": ["sk-globex"]},
    {"name": "solo", "api_keys": ["sk-solo"]},
]}


def greedy(n: int = 4) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def tokens(seed: int, n: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(3, 259) for _ in range(n))


def req(tenants: Tenants, rid: str, prompt, tenant: str, salt: str | None = None, **kw) -> Request:
    """A request as the ingress builds it (share and read domains from the tenants file)."""
    domain, read = tenants.request_domains(tenant, salt)
    return Request(rid, tuple(prompt), kw.pop("params", greedy()), tenant=tenant, share_domain=domain,
                   read_domains=read, **kw)


def cached(eng: LLMEngine, r: Request) -> int:
    return eng.generate([r])[r.request_id][-1].num_cached_tokens


@pytest.fixture(scope="module")
def tenants():
    return Tenants.from_dict(TENANTS)


# -- the tenants file: salts, admin keys ----------------------------------------------------------
def test_salted_domains_are_per_tenant_and_salt_and_read_nothing_else(tenants):
    assert tenants.request_domains("globex") == ("globex", ("acme",))  # the grant
    d1, r1 = tenants.request_domains("globex", "user-1")
    d2, _ = tenants.request_domains("globex", "user-2")
    assert r1 == () and len({d1, d2, "globex", salted_domain("acme", "user-1")}) == 4
    assert "user-1" not in d1 and domain_tenant(d1) == "globex"  # the salt itself never shows
    assert d1 == tenants.request_domains("globex", "user-1")[0]  # stable
    assert read_label(d1, d1) == "own" and read_label(d1, "globex") == "salt"
    assert read_label("globex", "acme") == "tenant:acme"
    for bad in ("", "x" * (MAX_CACHE_SALT_CHARS + 1), 7, None):
        with pytest.raises(ValueError, match="cache_salt"):
            salted_domain("acme", bad)


@pytest.mark.parametrize("data, words", [
    ({"tenants": [{"name": "a#b", "api_keys": ["k"]}]}, "must not contain"),
    ({"tenants": [{"name": "a/b", "api_keys": ["k"]}]}, "must not contain"),
    ({"admin_keys": ["k"], "tenants": [{"name": "a", "api_keys": ["k"]}]}, "admin key"),
    ({"admin_keys": "k", "tenants": [{"name": "a", "api_keys": ["k1"]}]}, "admin_keys"),
])
def test_bad_names_and_admin_keys_are_rejected(data, words):
    with pytest.raises(TenantsError, match=words):
        Tenants.from_dict(data)


def test_admin_keys_are_not_tenants(tenants):
    assert tenants.is_admin("sk-admin") and tenants.authenticate("sk-admin") is None
    assert not tenants.is_admin("sk-acme") and not tenants.is_admin(None) and not tenants.is_admin("")


# -- exact prefix blocks --------------------------------------------------------------------------
def test_exact_blocks_are_never_shared_across_salts_or_tenants_without_a_grant(tiny_model, tenants):
    eng = LLMEngine(EngineConfig(model=tiny_model.name, block_size=BS, num_blocks=96), loaded=tiny_model)
    p = tokens(1, 100)
    full = (len(p) - 1) // BS * BS
    assert cached(eng, req(tenants, "a0", p, "acme")) == 0
    assert cached(eng, req(tenants, "a1", p, "acme")) == full  # one tenant's users share
    assert cached(eng, req(tenants, "s1", p, "acme", "u1")) == 0  # salted: not the unsalted domain
    assert cached(eng, req(tenants, "s1b", p, "acme", "u1")) == full  # same salt shares
    assert cached(eng, req(tenants, "s2", p, "acme", "u2")) == 0  # another salt: nothing
    assert cached(eng, req(tenants, "o", p, "solo")) == 0  # another tenant, no grant
    assert cached(eng, req(tenants, "gs", p, "globex", "u1")) == 0  # granted tenant, but salted
    assert eng.stats()["cross_tenant_reads"] == {}  # nothing so far crossed a domain
    assert cached(eng, req(tenants, "g", p, "globex")) == full  # the grant, unsalted
    st = eng.stats()
    assert st["cross_tenant_reads"] == {"globex<-acme": full}
    assert st["tenants"]["acme"]["reads"]["exact"] == {"own": 2 * full}
    assert st["tenants"]["solo"]["reads"]["exact"] == {}
    # the unsalted tenant cannot read its users' salted blocks either
    q = tokens(2, 60)
    cached(eng, req(tenants, "s3", q, "acme", "u3"))
    assert cached(eng, req(tenants, "a3", q, "acme")) == 0
    assert "acme<-salt" not in eng.stats()["cross_tenant_reads"]
    eng.pool.check_invariants()


# -- pulls ----------------------------------------------------------------------------------------
def test_pulls_export_nothing_to_another_tenant_or_salt(tiny_model, tenants):
    cfg = EngineConfig(model=tiny_model.name, block_size=BS, num_blocks=64)
    a, b = LLMEngine(cfg, loaded=tiny_model), LLMEngine(cfg, loaded=tiny_model)
    p = tokens(3, 80)
    a.generate([req(tenants, "w", p, "acme", "u1")])
    for tenant, salt in (("solo", None), ("acme", None), ("acme", "u2"), ("globex", None)):
        chains = b.prompt_chains(req(tenants, "x", p, tenant, salt))
        assert a.export_prefix(chains, 0, 4) is None, (tenant, salt)
    own = b.prompt_chains(req(tenants, "y", p, "acme", "u1"))
    data = a.export_prefix(own, 0, 4)
    assert data.num_blocks == 4
    with pytest.raises(ValueError, match="hash chain"):  # another salt's chain cannot import them
        b.import_prefix(data, 0, b.prompt_chains(req(tenants, "z", p, "acme", "u2")), "acme")
    assert b.import_prefix(data, 0, own, "acme") == 64


# -- approximate donors / template slots ----------------------------------------------------------
def treq(tenants, tok, rid, text, tenant="acme", salt=None):
    return req(tenants, rid, tok.encode(T.replace("{text}", text), add_special_tokens=False), tenant, salt,
               params=greedy(6), reuse="approximate", template="sent", template_text=T,
               template_params={"text": text})


def test_approximate_donors_are_never_used_across_salts_or_tenants(tiny_model, tenants):
    from engine.approx import ApproxConfig

    cfg = EngineConfig(model=tiny_model.name, block_size=BS, num_blocks=96, approx=ApproxConfig(gate=None))
    eng = LLMEngine(cfg, loaded=tiny_model)
    tok = eng.tokenizer

    def approx_tokens(r):
        return eng.generate([r])[r.request_id][-1].num_approx_tokens

    assert approx_tokens(treq(tenants, tok, "donor", A_TEXT, salt="u1")) == 0  # donates (salted domain)
    assert approx_tokens(treq(tenants, tok, "t1", B_TEXT, "solo")) == 0
    assert approx_tokens(treq(tenants, tok, "t4", B_TEXT, "globex")) == 0  # granted reader, salted donor
    assert approx_tokens(treq(tenants, tok, "t3", B_TEXT, "acme", "u2")) == 0  # another salt
    assert approx_tokens(treq(tenants, tok, "t2", B_TEXT, "acme")) == 0  # the tenant, unsalted
    assert eng.stats()["cross_tenant_reads"] == {}
    assert approx_tokens(treq(tenants, tok, "t5", B_TEXT, "acme", "u1")) > 0  # the same salt: reused
    assert eng.stats()["tenants"]["acme"]["reads"]["approx"].keys() == {"own"}
    # donor export/import: a donor of salt u1 is unreadable for any other request's domains
    donor = next(d for d in eng.approx.pool if d.domain == salted_domain("acme", "u1"))
    payload = eng.export_donor(donor.slot_id)
    other = LLMEngine(cfg, loaded=tiny_model)
    for tenant, salt in (("acme", None), ("acme", "u2"), ("globex", None), ("solo", None)):
        r = treq(tenants, tok, "imp", B_TEXT, tenant, salt)
        with pytest.raises(ValueError, match="not readable"):
            other.import_donor(payload, (r.domain, *r.read_domains))
    assert len(other.approx.pool) == 0


def test_slot_registry_lookups_follow_the_domains(tenants):
    reg = SlotRegistry()
    salted = salted_domain("acme", "u1")
    reg.register(SlotKey("sent", "c1", "acme"), "w1", "s-acme", 40)
    reg.register(SlotKey("sent", "c1", salted), "w1", "s-salted", 40)

    def found(tenant, salt=None):
        d, r = tenants.request_domains(tenant, salt)
        return {e.slot_id for _, e in reg.lookup_template("sent", (d, *r))}

    assert found("acme") == {"s-acme"} and found("acme", "u1") == {"s-salted"}
    assert found("acme", "u2") == set() and found("solo") == set() and found("globex", "x") == set()
    assert found("globex") == {"s-acme"}  # the grant


# -- the router's choices -------------------------------------------------------------------------
class _Index:
    """The index actor's queries over the real pure index and slot registry."""

    def __init__(self):
        self.index, self.slots = PrefixIndex(BS), SlotRegistry()

    def lookup(self, chains):
        return self.index.lookup(chains)

    def lookup_template(self, template_id, domains):
        return [{"worker_id": e.worker_id, "slot_id": e.slot_id, "slot_class": k.slot_class, "domain": k.domain,
                 "num_tokens": e.num_tokens} for k, e in self.slots.lookup_template(template_id, domains)]


class _Worker:
    def __init__(self):
        self.prefetched = []

    def prefetch(self, request, pulls):
        self.prefetched.append(request.request_id)


def test_router_offers_no_pull_donor_or_replication_across_domains(tenants):
    from cluster.pool import WorkerState
    from cluster.routing import CostAwareRouter
    from policies.replication import ReplicationConfig
    from policies.routing import CostConfig

    model = "tiny"
    idx = _Index()
    p = tokens(4, 200)
    holder_chain = prompt_chains(p, BS, model, ["acme"])["acme"]
    for i, h in enumerate(holder_chain):
        idx.index.stored("wa", h, holder_chain[i - 1] if i else None, "acme")
    idx.slots.register(SlotKey("sent", "c1", "acme"), "wa", "slot-a", 40)
    workers = {w: _Worker() for w in ("wa", "wb", "wc")}
    info = {"node_id": "n1", "model_id": model}
    states = {w: WorkerState(w, Handle(workers[w]), {**info, "node_id": f"n-{w}"}) for w in workers}
    states["wa"].inflight, states["wa"].inflight_tokens = 1, 10 ** 7
    states["wa"].queued["load"] = 10 ** 7  # the holder is busy (its queue is the router's load signal): pulls pay off
    router_policy = Router(CostConfig(block_size=BS, bytes_per_token=1000))
    for w in workers:
        router_policy.register(w, f"n-{w}")
    router = CostAwareRouter(model, BS, Handle(idx), RouterClient(Handle(router_policy), timeout_s=5.0),
                             states.get, timeout_s=5.0, replication=ReplicationConfig(threshold=1))
    cands = [states["wa"], states["wb"]]

    def choose(tenant, salt=None, **kw):
        return asyncio.run(router.choose(req(tenants, "r", p, tenant, salt, **kw), cands))

    for tenant, salt in (("solo", None), ("acme", "u1"), ("globex", "u1")):
        c = choose(tenant, salt, reuse="approximate", template="sent")
        assert c.pulls == () and c.donor_pulls == () and c.route != "pulled", (tenant, salt, c)
    assert router.replication.replications == 0 and not any(w.prefetched for w in workers.values())
    granted = choose("globex", reuse="approximate", template="sent")  # the grant: pull + donor offer
    assert granted.worker_id == "wb" and granted.pulls and [d.slot_id for d in granted.donor_pulls] == ["slot-a"]
    own = choose("acme")
    assert own.pulls and own.route == "pulled"


# -- introspection --------------------------------------------------------------------------------
def test_tenant_view_holds_only_the_tenants_own_state():
    salted = salted_domain("acme", "u1")
    engine = {"free_blocks": 10, "num_blocks": 64, "running": 2, "waiting": 1, "preemptions": 0,
              "tenants": {"acme": {"requests": 3, "reads": {}}, "globex": {"requests": 5, "reads": {}}},
              "cross_tenant_reads": {"globex<-acme": 32, "acme<-salt": 0},
              "approx": {"donors": 3, "gate": {"acme/sent": {"state": "open"}, f"{salted}/auto:0123456789ab": {},
                                               "globex/auto:ba9876543210": {"state": "calibrating"},
                                               "acmex/sent": {}}}}
    view = {"workers": [{"worker_id": "w0", "tenant": "globex", "ready": True, "draining": False, "inflight": 4,
                         "engine": engine}, {"worker_id": "w1", "tenant": None, "ready": False, "draining": False,
                                             "inflight": 0, "engine": None}],
            "target": 2, "allocation": {"globex": 1}}
    v = tenant_view(view, "acme")
    w0 = v["workers"][0]
    assert v["scope"] == "tenant:acme" and v["allocation"] == {} and w0["assigned_to_you"] is False
    assert w0["engine"]["tenants"] == {"acme": {"requests": 3, "reads": {}}}
    assert set(w0["engine"]["approx"]["gate"]) == {"acme/sent", f"{salted}/auto:0123456789ab"}
    assert w0["engine"]["cross_tenant_reads"] == {"acme<-salt": 0}
    assert "globex" not in str(v) and "inflight" not in w0 and "free_blocks" not in w0["engine"]
    assert v["workers"][1]["engine"] is None
    g = tenant_view(view, "globex")
    assert g["allocation"] == {"globex": 1} and g["workers"][0]["assigned_to_you"]
    assert set(g["workers"][0]["engine"]["approx"]["gate"]) == {"globex/auto:ba9876543210"}
    assert "acme" not in str(g["workers"][0]["engine"]["approx"]) and "ba98" not in str(tenant_view(view, "solo"))



# -- a changed tenants file at run time -------------------------------------------------------------
def test_admission_update_keeps_inflight_and_applies_new_limits():
    from policies.tenancy import Admission

    old = Tenants.from_dict({"tenants": [{"name": "a", "api_keys": ["k"], "limits": {"max_concurrent": 1}},
                                         {"name": "b", "api_keys": ["kb"]}]})
    adm = Admission(old)
    assert adm.admit("a", 0.0).ok and not adm.admit("a", 0.0).ok  # at its limit
    new = Tenants.from_dict({"tenants": [{"name": "a", "api_keys": ["k2"], "limits": {"max_concurrent": 2}}]})
    adm.update(new)
    assert adm.inflight["a"] == 1  # the request admitted before still counts ...
    assert adm.admit("a", 0.0).ok and not adm.admit("a", 0.0).ok  # ... against the new limit
    adm.release("a")
    adm.release("a")
    assert adm.inflight["a"] == 0


def test_without_tenants_ignores_only_the_tenant_derived_pool_fields():
    import dataclasses

    from cluster.app import AppSettings, pool_config
    from cluster.controller import _diff, without_tenants

    s = AppSettings(model="tiny-llama")
    a = pool_config(s, Tenants.from_dict(TENANTS))
    changed = dict(TENANTS, tenants=[dict(TENANTS["tenants"][0], cache={"min_blocks": 7}, workers={"max": 2}),
                                     *TENANTS["tenants"][1:]])
    b = pool_config(s, Tenants.from_dict(changed))
    assert _diff(a, b) and not _diff(without_tenants(a), without_tenants(b))
    c = dataclasses.replace(b, worker_num_cpus=0.5)
    assert _diff(without_tenants(a), without_tenants(c)) == ["worker_num_cpus"]
