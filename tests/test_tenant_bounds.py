"""Per-tenant work on shared threads is bounded; one tenant cannot push out another's state."""

import random

import pytest

from policies.remap import GateConfig, GateState, QualityGate, ShadowSample, detect_template

AGREE = ShadowSample(True, 1.0, 0.0, 4)


def test_gate_keys_are_bounded_per_domain():
    gate, cfg = QualityGate(max_keys=3), GateConfig(samples=1, recheck_every=100)
    victim = ("alpha", "auto:victim")
    d = gate.decide(victim, cfg, 0.3)
    gate.record(victim, d.r, AGREE)
    assert gate.state(victim) == GateState.OPEN
    for i in range(50):  # beta floods the gate with fresh keys
        gate.decide(("beta", f"auto:{i}"), cfg, 0.3)
    assert gate.state(victim) == GateState.OPEN  # alpha's calibration survives
    assert sum(1 for k in gate.snapshot() if k.startswith("beta/")) == 3  # beta keeps only its own 3
    assert [k for k in gate.snapshot() if k.startswith("beta/")] == ["beta/auto:47", "beta/auto:48", "beta/auto:49"]


def test_detected_families_are_per_domain(tiny_model):
    from engine.approx import ApproxConfig, ApproxReuse
    from engine.slot_pool import Donor, seq_kv
    from engine.sequence import Request

    import torch

    ax = ApproxReuse(tiny_model.model, tiny_model.tokenizer, ApproxConfig(max_donors_per_domain=1))
    kv = seq_kv(torch.zeros(1, 4, 1, 2), torch.zeros(1, 4, 1, 2))
    mine = Donor("alpha", "alpha", (1, 2, 3, 4), kv)
    fam = ax._family(Request("r", (1, 2, 3, 5), tenant="alpha"), mine)
    for i in range(100):  # beta fills its own family map (bounded at 16 x 1 entries)
        ax._family(Request(f"b{i}", (9, i, 9, i), tenant="beta"), Donor("beta", "beta", (8, i, 8, i), kv))
    assert len(ax._families["beta"]) == 16 and len(ax._families["alpha"]) == 2
    assert ax._family(Request("r2", (1, 2, 3, 6), tenant="alpha"), mine) == fam
    # a donor read through a grant is not written into its owner's map
    ax._family(Request("g", (1, 2, 3, 7), tenant="beta"), mine)
    assert len(ax._families["alpha"]) == 3


def _unbounded_coverage(new, donors, min_run=4):
    from difflib import SequenceMatcher

    from policies.remap import common_prefix

    best = 0.0
    for ids in donors:
        sm = SequenceMatcher(a=new, b=ids, autojunk=False)
        got = set(range(common_prefix(new, ids)))
        for a, _, n in sm.get_matching_blocks():
            if n >= min_run:
                got.update(range(a, a + n))
        best = max(best, len(got) / len(new))
    return best


@pytest.mark.parametrize("seed", range(5))
def test_bounded_detection_finds_template_matches_and_plans_are_valid(seed):
    rng = random.Random(seed)
    donors = [[rng.randrange(50, 400) for _ in range(rng.randrange(40, 160))] for _ in range(12)]
    base = donors[rng.randrange(12)]
    new = list(base)
    for _ in range(3):  # change a few spans: the detected parameters
        at = rng.randrange(len(new) - 6)
        new[at:at + rng.randrange(1, 5)] = [rng.randrange(400, 500) for _ in range(rng.randrange(1, 5))]
    m = detect_template(new, donors)
    assert m is not None
    ref = _unbounded_coverage(new, donors)
    assert m.coverage >= ref - 0.05  # bounded work, nearly the unbounded alignment's coverage
    d = donors[m.donor_index]
    last = -1
    for i, j in enumerate(m.plan.src):
        if j is not None:
            assert new[i] == d[j] and j > last  # maps equal tokens, in order
            last = j


def test_detection_work_is_bounded_by_compares():
    calls = {"n": 0}
    import policies.remap as remap

    real = remap.SequenceMatcher

    class Counting(real):
        def __init__(self, *a, **k):
            calls["n"] += 1
            super().__init__(*a, **k)

    remap.SequenceMatcher = Counting
    try:
        base = list(range(100, 400))
        donors = [base[:150] + [7] * i + base[150:] for i in range(20)]  # 20 near-identical donors
        m = remap.detect_template(base[:200] + [9, 9] + base[202:], donors, max_compares=4)
        assert m is not None and calls["n"] <= 4
        calls["n"] = 0
        assert remap.detect_template([1, 2, 3, 4, 5, 6] * 50, donors) is None and calls["n"] == 0  # prefiltered
    finally:
        remap.SequenceMatcher = real
