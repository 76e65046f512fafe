"""Quality gate for approximate reuse: the policy's rules (pure) and the engine's shadow checks.

The engine tests use the tiny model (byte tokenizer) and the template of tests/test_approx.py;
values of one length so that every request finds a donor.
"""

import pytest

import engine.approx as approx_mod
from engine.approx import ApproxConfig, teacher_forced_agreement
from engine.llm_engine import EngineConfig, LLMEngine
from engine.manual_forward import greedy_continue
from engine.sequence import Request, SamplingParams
from policies.remap import GateConfig, GateState, QualityGate, ShadowSample, detected_family_key

AGREE, DISAGREE = ShadowSample(True), ShadowSample(False, 0.5, 0.1, 2)
K = ("acme", "sent")


def calibrate(gate: QualityGate, key, cfg: GateConfig, r0: float, samples) -> list:
    """Decide one request per sample and record the sample at the decided r; the decisions."""
    out = []
    for s in samples:
        d = gate.decide(key, cfg, r0)
        out.append(d)
        if d.shadow:
            gate.record(key, d.r, s)
    return out


# -- the policy ----------------------------------------------------------------------------------
def test_rungs_start_at_the_tenants_r():
    cfg = GateConfig(ladder=(0.7, 0.5, 0.2))
    assert cfg.rungs(0.3) == (0.3, 0.5, 0.7)
    assert cfg.rungs(0.6) == (0.6, 0.7)
    assert cfg.rungs(0.9) == (0.9,)


def test_calibrating_serves_exactly_and_opens_after_n_agreeing_samples():
    gate, cfg = QualityGate(), GateConfig(samples=3, recheck_every=100)
    ds = calibrate(gate, K, cfg, 0.3, [AGREE, AGREE])
    assert all(not d.approximate and d.shadow and d.r == 0.3 for d in ds)
    assert gate.state(K) == GateState.CALIBRATING
    assert gate.record(K, 0.3, AGREE) == GateState.OPEN
    d = gate.decide(K, cfg, 0.3)
    assert d.approximate and not d.shadow and d.r == 0.3


def test_a_disagreement_escalates_to_the_next_rung_with_a_fresh_window():
    gate, cfg = QualityGate(), GateConfig(samples=2)
    calibrate(gate, K, cfg, 0.3, [AGREE, DISAGREE])
    assert gate.state(K) == GateState.CALIBRATING and gate.r(K) == 0.5
    assert gate.record(K, 0.3, AGREE) is None  # stale: measured at the old r
    assert gate.snapshot()["acme/sent"]["samples"] == 0
    calibrate(gate, K, cfg, 0.3, [AGREE])
    assert gate.state(K) == GateState.CALIBRATING  # one fresh sample is not a window
    calibrate(gate, K, cfg, 0.3, [AGREE])
    assert gate.state(K) == GateState.OPEN and gate.r(K) == 0.5


def test_min_agreement_below_one_tolerates_that_share_of_disagreements():
    cfg = GateConfig(samples=4, min_agreement=0.75)
    gate = QualityGate()
    calibrate(gate, K, cfg, 0.3, [AGREE, DISAGREE, AGREE, AGREE])
    assert gate.state(K) == GateState.OPEN and gate.r(K) == 0.3
    gate = QualityGate()
    calibrate(gate, K, cfg, 0.3, [DISAGREE, AGREE, DISAGREE])
    assert gate.state(K) == GateState.CALIBRATING and gate.r(K) == 0.5  # cannot pass any more: escalated early


def test_max_kl_bounds_the_windows_mean_first_token_kl():
    cfg = GateConfig(samples=2, max_kl=0.05)
    gate = QualityGate()
    calibrate(gate, K, cfg, 0.3, [ShadowSample(True, 1.0, 0.02), ShadowSample(True, 1.0, 0.2)])
    assert gate.state(K) == GateState.CALIBRATING and gate.r(K) == 0.5  # all agreed, mean KL 0.11 too high
    calibrate(gate, K, cfg, 0.3, [ShadowSample(True, 1.0, 0.02), ShadowSample(True, 1.0, 0.04)])
    assert gate.state(K) == GateState.OPEN and gate.r(K) == 0.5


def test_open_rechecks_every_nth_request_and_a_failed_recheck_escalates():
    gate, cfg = QualityGate(), GateConfig(samples=1, recheck_every=3)
    calibrate(gate, K, cfg, 0.3, [AGREE])
    kinds = []
    for _ in range(6):
        d = gate.decide(K, cfg, 0.3)
        kinds.append("approx" if d.approximate else "check" if d.shadow else "exact")
        if d.shadow:
            gate.record(K, d.r, AGREE)
    assert kinds == ["approx", "approx", "check"] * 2
    assert gate.state(K) == GateState.OPEN
    for _ in range(2):
        gate.decide(K, cfg, 0.3)
    d = gate.decide(K, cfg, 0.3)
    assert d.shadow and gate.record(K, d.r, DISAGREE) == GateState.CALIBRATING and gate.r(K) == 0.5
    assert not gate.decide(K, cfg, 0.3).approximate  # recalibrating: served exactly again


def test_past_the_ladder_the_key_closes_then_retries_after_a_doubling_back_off():
    gate, cfg = QualityGate(), GateConfig(samples=1, ladder=(0.5,), backoff_requests=2)
    calibrate(gate, K, cfg, 0.3, [DISAGREE, DISAGREE])
    assert gate.state(K) == GateState.CLOSED and gate.r(K) is None
    assert not gate.wants(K, 0.5) and gate.record(K, 0.5, AGREE) is None
    for _ in range(2):
        d = gate.decide(K, cfg, 0.3)
        assert not d.approximate and not d.shadow and d.r is None
    d = gate.decide(K, cfg, 0.3)  # back-off over: recalibrate at the last (most conservative) rung
    assert d.shadow and d.r == 0.5 and gate.state(K) == GateState.CALIBRATING
    gate.record(K, d.r, DISAGREE)
    assert gate.state(K) == GateState.CLOSED
    ds = [gate.decide(K, cfg, 0.3) for _ in range(5)]
    assert [d.shadow for d in ds] == [False] * 4 + [True]  # back-off doubled to 4
    gate.record(K, ds[-1].r, AGREE)
    assert gate.state(K) == GateState.OPEN and gate.decide(K, cfg, 0.3).approximate


def test_keys_are_isolated():
    gate, cfg = QualityGate(), GateConfig(samples=1, ladder=())
    calibrate(gate, K, cfg, 0.3, [DISAGREE])
    calibrate(gate, ("acme", "other"), cfg, 0.3, [AGREE])
    calibrate(gate, ("globex", "sent"), cfg, 0.3, [AGREE])
    assert gate.state(K) == GateState.CLOSED
    assert gate.state(("acme", "other")) == gate.state(("globex", "sent")) == GateState.OPEN
    assert gate.record(("acme", "missing"), 0.3, AGREE) is None and gate.state(("acme", "missing")) is None
    snap = gate.snapshot()
    assert snap["acme/sent"]["state"] == "closed" and snap["globex/sent"]["agreement"] == 1.0


@pytest.mark.parametrize("bad", [dict(min_agreement=0), dict(min_agreement=1.5), dict(samples=0),
                                 dict(samples=True), dict(max_kl=-1.0), dict(recheck_every=0),
                                 dict(ladder=(1.5,)), dict(backoff_requests=10, max_backoff_requests=5)])
def test_gate_config_rejects_bad_values(bad):
    with pytest.raises(ValueError):
        GateConfig(**bad)


# -- the engine ----------------------------------------------------------------------------------
BS = 16
T = ("Please classify the review below as positive or negative.\nReview: {text}\n"
     "Think about the words used by the writer, the tone, and the overall impression. Label:")
TEXTS = ["I loved this film a lot.", "The food was cold, sadly", "Great value for a price.",
         "Never again, truly awful", "What a lovely little spot", "It broke after two days!",
         "Staff were kind and fast", "Too loud to hear myself."]


def engine(loaded, gate: GateConfig | None, r: float = 0.5, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=loaded.name, block_size=BS, num_blocks=96, max_num_batched_tokens=256,
                                  approx=ApproxConfig(policy="identity", recompute_ratio=r, gate=gate, **kw)),
                     loaded=loaded)


def treq(eng, rid, text, reuse="approximate", params=None, template="sent") -> Request:
    return Request(rid, tuple(eng.encode(T.replace("{text}", text))),
                   params or SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), tenant="acme",
                   reuse=reuse, template=template, template_text=T if template else None,
                   template_params={"text": text} if template else None)


def run(eng, req):
    outs = eng.generate([req])[req.request_id]
    return [t for o in outs for t in o.new_token_ids], outs[-1]


def assert_clean(eng: LLMEngine) -> None:
    assert not eng.has_unfinished() and not eng._shadow_jobs
    eng.pool.check_invariants()
    assert eng.pool.num_in_use() == 0 and eng.pool.num_free_blocks() == eng.pool.num_blocks
    eng.approx.pool.check_invariants()


def test_agreeing_template_opens_then_serves_approximately(tiny_model):
    eng = engine(tiny_model, GateConfig(samples=2, recheck_every=100))
    approx = [run(eng, treq(eng, f"r{i}", t))[1].num_approx_tokens for i, t in enumerate(TEXTS[:5])]
    g = eng.stats()["approx"]["gate"]["acme/sent"]
    # r0: no donor yet (the gate is not asked); r1, r2: calibration, served exactly; then open
    assert approx[:3] == [0, 0, 0] and all(a > 0 for a in approx[3:])
    assert g["state"] == "open" and g["r"] == 0.5 and g["checks"] == 2 and g["agreement"] == 1.0
    assert g["approx_served"] == 2 and g["exact_served"] == 2
    assert eng.approx.stats["shadow_checks"] == 2 and eng.approx.stats["approx_requests"] == 2
    assert_clean(eng)


def test_forced_disagreement_escalates_closes_and_backs_off(tiny_model, monkeypatch):
    monkeypatch.setattr(approx_mod, "teacher_forced_agreement", lambda *a, **k: ShadowSample(False, 0.0, 1.0, 1))
    eng = engine(tiny_model, GateConfig(samples=2, ladder=(0.5, 0.7), backoff_requests=2), r=0.3)
    seen = []
    for i, t in enumerate(TEXTS[:7]):
        _, out = run(eng, treq(eng, f"r{i}", t))
        assert out.num_approx_tokens == 0  # never served approximately
        g = eng.approx.gate.snapshot().get("acme/sent", {})
        seen.append((g.get("state"), g.get("r")))
    # r0: no donor (the gate is not asked); r1-r3: checks at 0.3, 0.5, 0.7 fail; r4, r5: back-off of 2
    # without checks; r6: a retry at 0.7, which fails too
    assert seen == [(None, None), ("calibrating", 0.5), ("calibrating", 0.7)] + [("closed", None)] * 4
    assert eng.approx.stats["shadow_checks"] == 4 and eng.approx.stats["approx_requests"] == 0
    g = eng.approx.gate.snapshot()["acme/sent"]
    assert g["closings"] == 2 and g["escalations"] == 2 and g["exact_served"] == 6
    assert_clean(eng)


@pytest.mark.parametrize("reuse", ["exact", "none"])
def test_exact_and_none_requests_never_touch_the_gate(tiny_model, reuse):
    eng = engine(tiny_model, GateConfig(samples=1))
    run(eng, treq(eng, "donor", TEXTS[0]))
    for i, t in enumerate(TEXTS[1:4]):
        _, out = run(eng, treq(eng, f"x{i}", t, reuse=reuse))
        assert out.num_approx_tokens == 0
    assert eng.approx.gate.snapshot() == {} and eng.approx.stats["shadow_checks"] == 0
    assert_clean(eng)


def test_shadow_check_equals_approximate_greedy_exact_match(tiny_model, monkeypatch):
    """The teacher-forced check agrees iff greedy decoding from the approximate KV reproduces the
    exact output; the engine records one exact argmax per output step."""
    jobs = []
    real = approx_mod.ApproxReuse.shadow_check
    monkeypatch.setattr(approx_mod.ApproxReuse, "shadow_check", lambda self, job: jobs.append(job) or real(self, job))
    eng = engine(tiny_model, GateConfig(samples=8), r=0.0)
    for i, t in enumerate(TEXTS[:4]):
        run(eng, treq(eng, f"r{i}", t))
    sampled = SamplingParams(max_tokens=5, temperature=1.0, seed=3, ignore_eos=True)
    run(eng, treq(eng, "sampled", TEXTS[4], params=sampled))
    assert len(jobs) == 4
    outcomes = set()
    for job in jobs:
        assert len(job.exact_argmax) == len(job.output_ids)
        res = eng.approx._remap(job.request, job.match)
        sample = teacher_forced_agreement(eng.loaded.model, res.logits, res.kv, job.output_ids, job.exact_argmax,
                                          job.first_logits)
        if job.request.params.greedy:
            assert job.exact_argmax == job.output_ids
            greedy = greedy_continue(eng.loaded.model, res.logits, res.kv, len(job.output_ids))
            assert sample.agree == (greedy == job.output_ids)
            outcomes.add(sample.agree)
        assert sample.positions == len(job.output_ids) and sample.first_kl >= 0.0
    assert outcomes == {True, False}  # on this model r=0 changes a greedy output, r=0.5 does not
    assert eng.approx.stats["shadow_checks"] == 4 and eng.approx.stats["shadow_disagreements"] == 1
    assert_clean(eng)


def test_detected_templates_are_gated_per_family(tiny_model):
    eng = engine(tiny_model, GateConfig(samples=2, recheck_every=100))
    for i, t in enumerate(TEXTS[:5]):
        run(eng, treq(eng, f"r{i}", t, template=None))
    snap = eng.approx.gate.snapshot()
    first = tuple(eng.encode(T.replace("{text}", TEXTS[0])))
    assert list(snap) == [f"acme/{detected_family_key(first)}"]
    assert snap[f"acme/{detected_family_key(first)}"]["checks"] >= 1
    assert_clean(eng)


def test_ungated_engine_serves_approximately_at_once(tiny_model):
    eng = engine(tiny_model, None)
    run(eng, treq(eng, "a", TEXTS[0]))
    assert run(eng, treq(eng, "b", TEXTS[1]))[1].num_approx_tokens > 0
    assert eng.approx.gate.snapshot() == {}
    assert_clean(eng)


def test_tenant_gates_override_the_default(tiny_model):
    eng = LLMEngine(EngineConfig(model=tiny_model.name, block_size=BS, num_blocks=96, max_num_batched_tokens=256,
                                 approx=ApproxConfig(policy="identity", recompute_ratio=0.5, gate=GateConfig(),
                                                     tenant_gates={"acme": None})), loaded=tiny_model)
    run(eng, treq(eng, "a", TEXTS[0]))
    assert run(eng, treq(eng, "b", TEXTS[1]))[1].num_approx_tokens > 0  # acme is ungated
    assert eng.approx.gate.snapshot() == {}


def test_a_failing_shadow_check_never_kills_the_engine(tiny_model, monkeypatch):
    """A bug in the best-effort check (any exception type) is counted and logged; the engine
    keeps serving and the key simply stays calibrating."""
    def boom(*a, **k):
        raise KeyError("boom")

    monkeypatch.setattr(approx_mod, "teacher_forced_agreement", boom)
    eng = engine(tiny_model, GateConfig(samples=2))
    for i, t in enumerate(TEXTS[:3]):
        run(eng, treq(eng, f"r{i}", t))
    assert eng.approx.stats["shadow_errors"] == 2
    assert eng.approx.gate.state(K) == GateState.CALIBRATING
    assert_clean(eng)


def test_gate_keeps_at_most_max_keys_and_a_forgotten_key_recalibrates():
    gate, cfg = QualityGate(max_keys=2), GateConfig(samples=1, recheck_every=100)
    a, b, c = ("acme", "a"), ("acme", "b"), ("acme", "c")
    calibrate(gate, a, cfg, 0.3, [AGREE])
    assert gate.state(a) == GateState.OPEN
    calibrate(gate, b, cfg, 0.3, [AGREE])
    gate.decide(a, cfg, 0.3)  # a is now the most recently used
    calibrate(gate, c, cfg, 0.3, [AGREE])  # evicts b
    assert gate.state(b) is None and gate.state(a) == GateState.OPEN and gate.state(c) == GateState.OPEN
    assert not gate.decide(b, cfg, 0.3).approximate  # forgotten: calibrates again, never opens unchecked
    with pytest.raises(ValueError):
        QualityGate(max_keys=0)


def test_a_request_the_exact_cache_serves_spends_no_gate_turn(tiny_model):
    """A repeat of a cached prompt is served by the exact prefix cache: the gate is not asked
    (no calibration or recheck turn is used up on a request that could not be approximate)."""
    eng = engine(tiny_model, GateConfig(samples=2))
    run(eng, treq(eng, "a", TEXTS[0]))  # the donor
    run(eng, treq(eng, "a2", TEXTS[0]))  # the same prompt again
    assert "acme/sent" not in eng.approx.gate.snapshot() and eng.approx.stats["gate_exact"] == 0
    run(eng, treq(eng, "b", TEXTS[1]))  # another value: the gate's first calibration turn
    assert eng.approx.gate.snapshot()["acme/sent"]["exact_served"] == 1
    assert_clean(eng)
