"""Tenants file, API keys, grants, default reuse modes, rate and concurrency limits (pure)."""

from pathlib import Path

import pytest
import yaml

from policies.autoscale import TenantShare
from policies.eviction import TenantQuota
from policies.remap import GateConfig
from policies.tenancy import (Admission, Tenants, TenantsError, TokenBucket, read_tenants_file,
                              tenants_path)

EXAMPLE = Path(__file__).resolve().parents[1] / "cluster" / "tenants.yaml"


def tenants(*entries, **top):
    return Tenants.from_dict({"tenants": list(entries), **top})


def test_example_file_loads():
    t = Tenants.from_dict(read_tenants_file(EXAMPLE))
    assert t.authenticate("sk-acme-demo").name == "acme"


def test_minimal_contract_fields_and_defaults():
    t = tenants({"name": "acme", "api_keys": ["k1", "k2"], "share_with": ["globex"]},
                {"name": "globex", "api_keys": ["k3"]})
    acme = t.authenticate("k2")
    assert acme.name == "acme" and acme.reuse == "exact" and acme.cache == TenantQuota()
    assert acme.workers == TenantShare() and acme.limits.requests_per_s is None
    assert t.authenticate("k3").name == "globex"


@pytest.mark.parametrize("key", [None, "", "nope", "K1", "k1 "])
def test_missing_or_unknown_key_is_no_tenant(key):
    assert tenants({"name": "a", "api_keys": ["k1"]}).authenticate(key) is None


def test_grants_give_read_domains_one_way():
    t = tenants({"name": "acme", "api_keys": ["a"], "share_with": ["globex", "initech"]},
                {"name": "globex", "api_keys": ["g"], "share_with": ["initech"]},
                {"name": "initech", "api_keys": ["i"]})
    assert [t.share_domain(n) for n in ("acme", "globex", "initech")] == ["acme", "globex", "initech"]
    assert t.read_domains("acme") == ()
    assert t.read_domains("globex") == ("acme",)
    assert t.read_domains("initech") == ("acme", "globex")


def test_optional_fields_parse_into_policy_objects():
    t = tenants({"name": "acme", "api_keys": ["a"], "reuse": "none", "priority": 2,
                 "cache": {"min_blocks": 4, "max_blocks": 10, "ttl_s": 5},
                 "limits": {"requests_per_s": 2, "burst": 3, "max_concurrent": 1},
                 "workers": {"min": 1, "max": 2}}, defaults={"reuse": "approximate"})
    a = t["acme"]
    assert a.reuse == "none"
    assert t.eviction_quotas()["acme"] == TenantQuota(priority=2, min_blocks=4, max_blocks=10, ttl_s=5)
    assert t.worker_shares()["acme"] == TenantShare(1, 2)
    assert a.limits.capacity == 3
    b = tenants({"name": "b", "api_keys": ["b"]}, defaults={"reuse": "approximate"})["b"]
    assert b.reuse == "approximate"
    assert not t.eviction_quotas()["acme"].latency_guard
    g = tenants({"name": "g", "api_keys": ["g"], "priority": 3, "latency_guard": True}).eviction_quotas()["g"]
    assert g == TenantQuota(priority=3, latency_guard=True)


@pytest.mark.parametrize("data, words", [
    ({"tenants": []}, "no tenants"),
    ({"tenants": [{"name": "a"}]}, "api_keys"),
    ({"tenants": [{"name": "a", "api_keys": ["k"]}, {"name": "a", "api_keys": ["j"]}]}, "duplicate"),
    ({"tenants": [{"name": "a", "api_keys": ["k"]}, {"name": "b", "api_keys": ["k"]}]}, "also used"),
    ({"tenants": [{"name": "a", "api_keys": ["k"], "share_with": ["zz"]}]}, "unknown tenant"),
    ({"tenants": [{"name": "a", "api_keys": ["k"], "share_with": ["a"]}]}, "itself"),
    ({"tenants": [{"name": "a", "api_keys": ["k"], "reuse": "maybe"}]}, "reuse"),
    ({"tenants": [{"name": "a", "api_keys": ["k"], "shrae_with": []}]}, "unknown fields"),
    ({"tenants": [{"name": "a", "api_keys": ["k"], "limits": {"requests_per_s": 0}}]}, "requests_per_s"),
    ({"tenants": [{"name": "a", "api_keys": ["k"], "cache": {"min_blocks": -1}}]}, "min_blocks"),
    ({"tenants": [{"name": "a", "api_keys": ["k"], "workers": {"min": 2, "max": 1}}]}, "workers.max"),
    ({"users": []}, "tenants"),
    ({"tenants": [{"name": "a", "api_keys": ["k"], "latency_guard": "yes"}]}, "latency_guard"),
    ({"tenants": [{"name": "a", "api_keys": ["k"], "cache": {"latency_guard": True}}]}, "tenant fields"),
    ({"tenants": [{"name": "a", "api_keys": ["k"], "cache": {"priority": 1}}]}, "tenant fields"),
])
def test_malformed_files_are_rejected_with_a_clear_message(data, words):
    with pytest.raises(TenantsError, match=words):
        Tenants.from_dict(data)


def test_remap_quality_gate_knob_parses_per_tenant():
    t = tenants({"name": "acme", "api_keys": ["a"], "reuse": "approximate",
                 "remap": {"policy": "learnable", "recompute_ratio": 0.15, "min_agreement": 0.75,
                           "calibration_samples": 8, "max_kl": 0.05, "recheck_every": 4, "ladder": [0.3, 0.5],
                           "backoff_requests": 2000}},
                {"name": "globex", "api_keys": ["g"], "remap": {"gate": False}},
                {"name": "initech", "api_keys": ["i"]})
    g = t.quality_gates()
    assert g["acme"] == GateConfig(min_agreement=0.75, samples=8, max_kl=0.05, recheck_every=4, ladder=(0.3, 0.5),
                                   backoff_requests=2000, max_backoff_requests=2000)
    assert t["acme"].remap_policy == "learnable" and t["acme"].recompute_ratio == 0.15
    assert g["globex"] is None  # explicitly ungated
    assert g["initech"] == GateConfig()  # gated with the defaults unless switched off


@pytest.mark.parametrize("remap, words", [
    ({"min_agreement": 1.5}, "remap.min_agreement must be in"),
    ({"min_agreement": 0}, "remap.min_agreement"),
    ({"calibration_samples": 0}, "remap.calibration_samples must be an integer"),
    ({"calibration_samples": 2.5}, "remap.calibration_samples"),
    ({"max_kl": -0.1}, "remap.max_kl"),
    ({"recheck_every": 0}, "remap.recheck_every"),
    ({"ladder": 0.5}, "remap.ladder must be a list"),
    ({"ladder": [0.5, "x"]}, "remap.ladder"),
    ({"backoff_requests": 0}, "remap.backoff_requests"),
    ({"gate": "yes"}, "remap.gate must be true or false"),
    ({"gate": False, "min_agreement": 0.9}, "gate is false but"),
    ({"samples": 4}, "remap must be a mapping"),
])
def test_remap_quality_gate_knob_rejects_bad_values(remap, words):
    with pytest.raises(TenantsError, match=words):
        tenants({"name": "a", "api_keys": ["k"], "remap": remap})


def test_env_var_selects_the_file(tmp_path, monkeypatch):
    f = tmp_path / "t.yaml"
    f.write_text(yaml.safe_dump({"tenants": [{"name": "x", "api_keys": ["kx"]}]}))
    monkeypatch.delenv("KVMESH_TENANTS", raising=False)
    assert tenants_path(EXAMPLE) == EXAMPLE
    monkeypatch.setenv("KVMESH_TENANTS", str(f))
    assert tenants_path(EXAMPLE) == f
    assert Tenants.from_dict(read_tenants_file(tenants_path(EXAMPLE))).names() == ["x"]
    with pytest.raises(TenantsError, match="not found"):
        read_tenants_file(tmp_path / "missing.yaml")


def test_token_bucket_refills_at_its_rate():
    b = TokenBucket(rate=2.0, capacity=2.0, updated=0.0)
    assert b.take(0.0) == 0.0 and b.take(0.0) == 0.0
    assert b.take(0.0) == pytest.approx(0.5)  # empty: one token in 0.5 s
    assert b.take(0.25) == pytest.approx(0.25)
    assert b.take(0.5) == 0.0
    assert b.take(100.0) == 0.0 and b.take(100.0) == 0.0 and b.take(100.0) > 0  # capped at capacity


def test_admission_rate_limit_refuses_with_retry_after_and_consumes_nothing():
    t = tenants({"name": "a", "api_keys": ["k"], "limits": {"requests_per_s": 0.5, "burst": 1}},
                {"name": "b", "api_keys": ["j"]})
    adm = Admission(t)
    assert adm.admit("a", 0.0).ok
    d = adm.admit("a", 0.0)
    assert not d.ok and d.reason == "rate" and d.retry_after_s == pytest.approx(2.0) and d.retry_after_header == "2"
    assert adm.inflight["a"] == 1  # the refusal took no slot
    assert all(adm.admit("b", 0.0).ok for _ in range(100))  # another tenant is not limited
    assert adm.admit("a", 2.0).ok


def test_admission_concurrency_limit_and_release():
    t = tenants({"name": "a", "api_keys": ["k"], "limits": {"max_concurrent": 2}})
    adm = Admission(t)
    assert adm.admit("a", 0).ok and adm.admit("a", 0).ok
    d = adm.admit("a", 0)
    assert not d.ok and d.reason == "concurrency" and d.retry_after_header == "1"
    adm.release("a")
    assert adm.admit("a", 0).ok
    adm.release("a"), adm.release("a")
    with pytest.raises(RuntimeError):
        adm.release("a")
