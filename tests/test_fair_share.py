"""Tenants of one priority class share a worker's admissions fairly (virtual token counters).

The policy (``policies.fair_share.FairShare``) as a plain class, then on a tiny-llama engine whose
sequence limit makes requests wait: another tenant's request is admitted at the next free slot,
not after every request a flooding tenant queued before it.
"""

import random

import pytest

from engine.llm_engine import EngineConfig, LLMEngine
from engine.sequence import Request, SamplingParams
from policies.eviction import TenantQuota
from policies.fair_share import FairShare


def tenant_of(item):
    return item[0]


def one(item):
    return 1


def test_order_alternates_tenants_with_equal_counters_and_keeps_each_tenants_arrival_order():
    fs = FairShare()
    items = [("a", 1), ("a", 2), ("a", 3), ("b", 1), ("a", 4), ("b", 2)]
    assert fs.order(items, tenant_of, one) == [("a", 1), ("b", 1), ("a", 2), ("b", 2), ("a", 3), ("a", 4)]
    assert fs.order(items[:3], tenant_of, one) == items[:3]  # one tenant: unchanged


def test_the_tenant_that_received_fewer_tokens_goes_first_and_cost_counts():
    fs = FairShare()
    fs.charge("a", 10)
    items = [("a", 1), ("a", 2), ("b", 1), ("b", 2), ("b", 3)]
    # b is 10 tokens behind: its requests (cost 4 each) go until it has caught up
    assert fs.order(items, tenant_of, lambda it: 4) == [("b", 1), ("b", 2), ("b", 3), ("a", 1), ("a", 2)]
    assert fs.order(items, tenant_of, lambda it: 6) == [("b", 1), ("b", 2), ("a", 1), ("b", 3), ("a", 2)]
    assert fs.counters == {"a": 10}  # order simulates; only charge records


def test_join_lifts_a_returning_tenant_to_the_active_floor_and_banks_no_idle_credit():
    fs = FairShare()
    fs.join("a", [])
    fs.charge("a", 100)
    fs.join("b", ["a"])  # b was idle: it starts where a is, not 100 tokens ahead of it
    assert fs.counters["b"] == 100
    fs.charge("b", 50)
    fs.join("c", ["a", "b"])
    assert fs.counters["c"] == 100  # the smallest active counter
    fs.charge("a", 200)
    fs.join("b", ["a", "c"])  # b left ahead of the floor (150 > 100) and keeps its counter
    assert fs.counters["b"] == 150
    fs.join("d", ["a"])  # b and c left below the floor 300: dropped (a later join lifts them to it)
    assert fs.counters == {"a": 300, "d": 300}
    fs.join("e", [])  # nothing else has work: nothing to be fair against
    assert fs.counters == {"e": 0.0}


def test_order_is_a_permutation_that_keeps_each_tenants_order():
    rng = random.Random(7)
    fs = FairShare()
    for t in "abc":
        fs.charge(t, rng.randint(0, 50))
    for _ in range(200):
        items = [(rng.choice("abcd"), i) for i in range(rng.randint(0, 30))]
        out = fs.order(items, tenant_of, lambda it: rng.randint(1, 20))
        assert sorted(out) == sorted(items)
        for t in "abcd":
            assert [i for i in out if i[0] == t] == [i for i in items if i[0] == t]


def engine(tiny_model, fair=True, quotas=None, max_num_seqs=2):
    cfg = EngineConfig(model="tiny-llama", num_blocks=200, max_num_batched_tokens=256, max_num_seqs=max_num_seqs,
                       tenant_quotas=quotas or {}, approx=None, fair_share=fair)
    return LLMEngine(cfg, tiny_model)


def req(rid, tenant, n=8, max_tokens=3, first=3):
    ids = tuple((first + i) % 250 + 3 for i in range(n))
    return Request(rid, ids, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), tenant=tenant)


def first_outputs(eng, add_at=None):
    """Request ids in the order of their first output; ``add_at``: {step: [requests]} added before that step."""
    order, step = [], 0
    add_at = add_at or {}
    while eng.has_unfinished() or any(k >= step for k in add_at):
        for r in add_at.get(step, ()):
            eng.add_request(r)
        for o in eng.step():
            if o.num_output_tokens == 1:
                order.append(o.request_id)
        step += 1
    return order


@pytest.mark.parametrize("fair", [True, False])
def test_a_flooding_tenant_does_not_put_another_tenants_request_behind_its_whole_queue(tiny_model, fair):
    eng = engine(tiny_model, fair=fair)
    flood = [req(f"a{i}", "a", first=i * 11) for i in range(10)]
    order = first_outputs(eng, {0: flood, 1: [req("b0", "b", first=200)]})
    assert order[:2] == ["a0", "a1"]  # the two slots the flood took first
    if fair:
        assert order.index("b0") == 2  # the next free slot
    else:
        assert order[-1] == "b0"  # arrival order: behind all ten
    eng.pool.check_invariants()
    assert eng.pool.num_in_use() == 0


def test_two_backlogged_tenants_take_turns_and_a_late_one_gets_no_burst(tiny_model):
    eng = engine(tiny_model, max_num_seqs=1)
    a = [req(f"a{i}", "a", first=i * 7) for i in range(6)]
    b = [req(f"b{i}", "b", first=100 + i * 7) for i in range(3)]
    # a runs alone for a while; b then queues three: b does not get all three ahead of a's rest
    order = first_outputs(eng, {0: a, 8: b})
    assert order[:2] == ["a0", "a1"]
    rest = order[2:]
    assert [r for r in rest if r.startswith("b")] == ["b0", "b1", "b2"]
    # strict turns once both wait: never two of b in a row while a still waits
    for x, y in zip(rest, rest[1:]):
        if x.startswith("b") and y.startswith("b"):
            assert all(not r.startswith("a") for r in rest[rest.index(y):])
    assert rest.index("b0") <= 1 and rest.index("b1") <= 3 and rest.index("b2") <= 5


def test_priority_classes_still_come_first(tiny_model):
    eng = engine(tiny_model, quotas={"hi": TenantQuota(priority=1)})
    eng.add_request(req("x", "lo", first=50))
    eng.add_request(req("y", "lo", first=60))
    assert {o.request_id for o in eng.step()} == {"x", "y"}  # both admitted (two slots)
    for i in range(3):
        eng.add_request(req(f"lo{i}", "lo2", first=i * 9))
    eng.add_request(req("hi0", "hi", first=120))  # joins at lo2's counter, arrives after lo2's queue
    assert first_outputs(eng) == ["hi0", "lo0", "lo1", "lo2"]


@pytest.mark.parametrize("fair", [True, False])
def test_a_tenant_leaves_the_reserved_slots_to_the_others(tiny_model, fair):
    eng = engine(tiny_model, fair=fair, max_num_seqs=8)  # reserve min(4, 8 // 4) = 2 slots
    for i in range(10):
        eng.add_request(req(f"a{i}", "a", first=i * 11))
    eng.step()
    assert len(eng.scheduler.running) == (6 if fair else 8)
    eng.add_request(req("b0", "b", first=200))
    outs = {o.request_id for o in eng.step()}
    assert ("b0" in outs) is fair  # a free slot at once; without the reserve it waits for a's to finish
    rest = first_outputs(eng)
    assert rest == (["a6", "a7", "a8", "a9"] if fair else ["a8", "a9", "b0"])
    eng.pool.check_invariants()
    assert eng.pool.num_in_use() == 0


def record_preemptions(eng):
    """Request ids of the sequences ``eng``'s scheduler preempts, in order."""
    victims = []
    preempt = eng.scheduler._preempt

    def spy(seq):
        victims.append(seq.request.request_id)
        preempt(seq)

    eng.scheduler._preempt = spy
    return victims


def small_pool(tiny_model, fair=True, quotas=None, num_blocks=10, preempt=True):
    cfg = EngineConfig(model="tiny-llama", num_blocks=num_blocks, max_num_batched_tokens=256, max_num_seqs=8,
                       tenant_quotas=quotas or {}, approx=None, fair_share=fair, fair_preempt=preempt)
    return LLMEngine(cfg, tiny_model)


@pytest.mark.parametrize("fair,preempt", [(True, True), (False, True), (True, False)])
def test_a_full_pool_preempts_the_tenant_that_holds_most_of_it_not_the_light_tenants_only_request(tiny_model, fair,
                                                                                                   preempt):
    # three of a's sequences and one of b's grow past the pool (4 x 3 blocks > 10): someone waits
    eng = small_pool(tiny_model, fair=fair, preempt=preempt)
    fair = fair and preempt
    victims = record_preemptions(eng)
    order = first_outputs(eng, {0: [req(f"a{i}", "a", n=16, max_tokens=30, first=i * 17) for i in range(3)],
                                1: [req("b0", "b", n=8, max_tokens=30, first=200)]})
    assert sorted(order) == ["a0", "a1", "a2", "b0"]
    assert victims  # the pool was too small for all four at once
    # arrival order takes the most recently admitted: b's only request; fair share takes a's
    assert ("b0" in victims) is (not fair)
    eng.pool.check_invariants()
    assert eng.pool.num_in_use() == 0


@pytest.mark.parametrize("fair", [True, False])
def test_a_full_pool_preempts_a_lower_priority_class_first(tiny_model, fair):
    eng = small_pool(tiny_model, fair=fair, quotas={"hi": TenantQuota(priority=1)})
    victims = record_preemptions(eng)
    first_outputs(eng, {0: [req("hi0", "hi", n=16, max_tokens=30, first=5)],
                        1: [req(f"lo{i}", "lo", n=16, max_tokens=30, first=40 + i * 17) for i in range(3)]})
    assert victims and "hi0" not in victims  # admitted first: arrival order would spare it too
    eng2 = small_pool(tiny_model, fair=fair, quotas={"hi": TenantQuota(priority=1)})
    victims = record_preemptions(eng2)
    first_outputs(eng2, {0: [req(f"lo{i}", "lo", n=16, max_tokens=30, first=40 + i * 17) for i in range(3)],
                         1: [req("hi0", "hi", n=16, max_tokens=30, first=5)]})
    assert victims and "hi0" not in victims  # admitted last, still kept: lower classes go first
    eng2.pool.check_invariants()
    assert eng2.pool.num_in_use() == 0


@pytest.mark.parametrize("fair,preempt", [(True, True), (False, True), (True, False)])
def test_a_tenant_short_of_its_share_of_a_full_pool_preempts_the_tenant_holding_it(tiny_model, fair, preempt):
    # a's two prompts of 88 tokens hold all 12 blocks; b's 40-token prompt needs 3
    eng = small_pool(tiny_model, fair=fair, num_blocks=12, preempt=preempt)
    fair = fair and preempt
    victims = record_preemptions(eng)
    order = first_outputs(eng, {0: [req(f"a{i}", "a", n=88, max_tokens=6, first=i * 17) for i in range(2)],
                                1: [req("b0", "b", n=40, max_tokens=6, first=200)]})
    if fair:
        assert victims == ["a1"]  # a's most recently admitted, for b's request at the next step
        assert eng.scheduler.num_room_preemptions == 1
    else:
        assert victims == [] and eng.scheduler.num_room_preemptions == 0  # b waited for a's to end
    assert sorted(order) == ["a0", "a1", "b0"]
    eng.pool.check_invariants()
    assert eng.pool.num_in_use() == 0


def test_no_preemption_for_room_when_the_holder_would_run_fewer_than_the_waiting_tenant(tiny_model):
    # a runs one sequence holding the whole pool: taking it from a would only swap who waits
    eng = small_pool(tiny_model, num_blocks=12)
    victims = record_preemptions(eng)
    order = first_outputs(eng, {0: [req("a0", "a", n=180, max_tokens=6)], 1: [req("b0", "b", n=40, max_tokens=6)]})
    assert victims == [] and order == ["a0", "b0"]
    eng.pool.check_invariants()
