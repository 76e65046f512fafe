"""A lower-priority tenant's long prefill is chunked small while a higher-priority tenant contends.

Exact token counts per sequence per step on a tiny-llama engine (budget 128 tokens per step,
``low_priority_prefill_tokens`` 32). The scheduler's clock is a fake one, so the hold window
(``priority_hold_s``) is exact too.
"""

import pytest

from engine.llm_engine import EngineConfig, LLMEngine
from engine.scheduler import SchedulerConfig
from engine.sequence import Request, SamplingParams
from policies.eviction import TenantQuota
from policies.prefill_priority import PriorityContention, throttled

BS = 16
QUOTAS = {"hi": TenantQuota(priority=2), "lo": TenantQuota(priority=0), "lo2": TenantQuota(priority=0)}


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def engine(tiny_model, quotas=QUOTAS, budget=128, hold=2.0, **kw):
    """(engine, its fake clock, the plan of every step); ``kw``: more EngineConfig fields."""
    cfg = EngineConfig(model="tiny-llama", num_blocks=200, max_num_batched_tokens=budget, tenant_quotas=quotas,
                       approx=None, low_priority_prefill_tokens=32, priority_hold_s=hold, **kw)
    eng = LLMEngine(cfg, tiny_model)
    eng.scheduler.clock = clock = Clock()
    plans = []  # per step: {request_id: tokens scheduled}
    schedule = eng.scheduler.schedule

    def recording():
        out = schedule()
        plans.append({s.request_id: n for s, n in out})
        return out

    eng.scheduler.schedule = recording
    return eng, clock, plans


def req(rid, n, tenant, max_tokens=2, first=3):
    ids = tuple((first + i) % 250 + 3 for i in range(n))
    return Request(rid, ids, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), tenant=tenant)


def step(eng, toks):
    for o in eng.step():
        toks.setdefault(o.request_id, []).extend(o.new_token_ids)


def outputs(eng, toks=None):
    toks = {} if toks is None else toks
    while eng.has_unfinished():
        step(eng, toks)
    eng.pool.check_invariants()
    assert eng.pool.num_in_use() == 0
    return toks


def test_contention_rule():
    c = PriorityContention(hold_s=2.0)
    assert c.observe(0.0, [0, 0]) is None  # one class alone: nobody throttled
    assert c.observe(1.0, [2]) == 2 and throttled(0, 2) and not throttled(2, 2)
    assert c.observe(2.9, [0]) == 2  # 2 last seen at 1.0: still within the hold
    assert c.observe(3.1, [0]) is None  # 2.1 s ago: dropped
    assert not throttled(0, None)
    with pytest.raises(ValueError):
        PriorityContention(-1)
    with pytest.raises(ValueError):
        SchedulerConfig(low_priority_prefill_tokens=0)


def test_a_guarded_class_contends_at_all_times():
    c = PriorityContention(hold_s=2.0)
    assert c.observe(0.0, [], guarded=[2]) is None  # the guarded class alone: nobody to throttle
    assert c.observe(0.0, [2], guarded=[2]) is None  # ... even while it has work
    assert c.observe(100.0, [0], guarded=[2]) == 2  # lo with work, hi idle for ages: still capped
    assert c.observe(200.0, [1], guarded=[2]) == 2  # (0 dropped after its hold; 1 is below 2 too)
    assert c.observe(300.0, [0], guarded=[]) is None  # the guard removed (tenants file): the hold rule alone


def test_latency_guard_caps_a_lower_class_alone_and_only_it(tiny_model):
    quotas = {**QUOTAS, "hi": TenantQuota(priority=2, latency_guard=True)}
    eng, clock, plans = engine(tiny_model, quotas=quotas)
    eng.add_request(req("lo", 10 * BS, "lo", first=1))
    outputs(eng)
    # hi never sent anything: lo's 160-token prompt still goes 32 tokens per step
    assert [p["lo"] for p in plans if p.get("lo", 0) > 1] == [32] * 5
    clock.t = 1000.0
    first = len(plans)
    eng.add_request(req("hi", 10 * BS, "hi", first=40))
    outputs(eng)
    assert plans[first] == {"hi": 128}  # the guarded class alone: whole steps
    assert eng.scheduler.contention.top() is None
    # applied without a restart: guard off -> lo alone gets whole steps again (once hi's hold ran out)
    eng.set_tenant_policies({"hi": TenantQuota(priority=2)})
    clock.t = 2000.0
    eng.add_request(req("lo-b", 10 * BS, "lo", first=7))
    outputs(eng)
    assert [p["lo-b"] for p in plans if p.get("lo-b", 0) > 1] == [128, 32]


def test_one_tenant_alone_keeps_full_chunks(tiny_model):
    eng, clock, plans = engine(tiny_model)
    eng.add_request(req("lo-a", 40 * BS, "lo", first=1))
    eng.add_request(req("lo2-b", 20 * BS, "lo2", first=60))  # same priority class: no throttling
    outputs(eng)
    prefill = [p for p in plans if sum(p.values()) > 2]
    # 960 tokens of prompt: full 128-token steps (the first one shared with lo2-b's admission: no cap)
    assert [sum(p.values()) for p in prefill[:-1]] == [128] * len(prefill[:-1])
    assert all(n != 32 for p in plans for n in p.values())
    assert eng.scheduler.contention.top() is None


def test_low_priority_prefill_is_capped_and_high_priority_goes_first(tiny_model):
    eng, clock, plans = engine(tiny_model)
    eng.add_request(req("lo", 60 * BS, "lo", first=1))
    eng.step()
    assert plans[-1] == {"lo": 128}  # alone: the whole budget
    eng.add_request(req("hi", 40, "hi", first=80))
    eng.step()
    assert plans[-1] == {"lo": 32, "hi": 40}  # hi waiting: lo's chunk is capped, hi admitted whole
    eng.step()
    # hi decodes (1 token); lo is still capped: hi contended within the hold window
    assert plans[-1] == {"hi": 1, "lo": 32}
    eng.step()  # hi finishes
    clock.t = 1.9
    eng.step()
    assert plans[-1] == {"lo": 32}
    clock.t = 2.1  # hi idle for longer than priority_hold_s: full chunks again
    eng.step()
    assert plans[-1] == {"lo": 128}
    outputs(eng)


def test_high_priority_long_prefill_never_starves_low_priority_work(tiny_model):
    alone, _, _ = engine(tiny_model)
    alone.add_request(req("lo", 20 * BS, "lo", max_tokens=6, first=1))
    alone.add_request(req("lo-dec", 20, "lo", max_tokens=12, first=33))
    want = outputs(alone)

    eng, clock, plans = engine(tiny_model)
    toks = {}
    eng.add_request(req("lo-dec", 20, "lo", max_tokens=12, first=33))
    step(eng, toks)  # lo-dec prefilled alone; decodes from now on
    eng.add_request(req("hi", 30 * BS, "hi", max_tokens=2, first=7))
    eng.add_request(req("lo", 20 * BS, "lo", max_tokens=6, first=1))
    step(eng, toks)
    # hi admitted first with the budget left after lo-dec's decode; lo admitted capped
    assert plans[-1] == {"lo-dec": 1, "hi": 95, "lo": 32}
    step(eng, toks)
    # both prefilling, nobody waiting: lo had the last step, so this one is hi's (after the decode)
    assert plans[-1] == {"lo-dec": 1, "hi": 127}
    step(eng, toks)
    # then decode first, lo's capped chunk reserved, hi takes the rest
    assert plans[-1] == {"lo-dec": 1, "hi": 95, "lo": 32}
    got = outputs(eng, toks)
    hi_prefill = [p for p in plans if p.get("hi", 0) > 1]
    assert [p["hi"] for p in hi_prefill] == [95, 127, 95, 127, 36]  # hi's whole 480-token prompt
    assert [p.get("lo") for p in hi_prefill] == [32, None, 32, None, 32]  # lo: every other step
    assert [p.get("lo-dec") for p in plans[1:12]] == [1] * 11  # decodes every step
    # a throttled prefill computes the same tokens as an unthrottled one
    assert got["lo"] == want["lo"] and got["lo-dec"] == want["lo-dec"]


def test_a_higher_request_arriving_during_a_lower_step_gets_the_next_step_alone(tiny_model):
    quotas = {**QUOTAS, "hi": TenantQuota(priority=2, latency_guard=True)}
    eng, clock, plans = engine(tiny_model, quotas=quotas)
    eng.add_request(req("lo", 20 * BS, "lo", first=1))
    eng.step()
    assert plans[-1] == {"lo": 32}  # guarded: capped although hi is idle
    eng.add_request(req("hi", 40, "hi", first=80))
    eng.step()
    assert plans[-1] == {"hi": 40}  # lo had the last step: hi's prefill is not shared
    eng.step()
    assert plans[-1] == {"hi": 1, "lo": 32}  # hi decodes (no prefill work): lo's chunk as before
    outputs(eng)


def test_without_alternation_a_lower_chunk_shares_the_higher_step(tiny_model):
    cfg = EngineConfig(model="tiny-llama", num_blocks=200, max_num_batched_tokens=128, approx=None,
                       tenant_quotas={**QUOTAS, "hi": TenantQuota(priority=2, latency_guard=True)},
                       alternate_low_prefill=False)
    eng = LLMEngine(cfg, tiny_model)
    eng.add_request(req("lo", 20 * BS, "lo", first=1))
    assert [n for _, n in eng.scheduler.schedule()] == [32]
    eng.add_request(req("hi", 40, "hi", first=80))
    assert sorted((s.request_id, n) for s, n in eng.scheduler.schedule()) == [("hi", 40), ("lo", 32)]


def test_lower_classes_share_one_capped_chunk_per_step(tiny_model):
    eng, clock, plans = engine(tiny_model)
    eng.add_request(req("lo-a", 12 * BS, "lo", first=1))
    eng.add_request(req("lo-b", 10 * BS, "lo2", first=50))
    eng.step()
    assert plans[-1] == {"lo-a": 128}  # alone (one class): the whole budget, FIFO
    eng.add_request(req("hi", 40, "hi", first=80))
    eng.step()
    assert plans[-1] == {"lo-a": 32, "hi": 40}  # lo-a and lo-b together get 32 tokens (lo-b: none)
    eng.step()
    assert plans[-1] == {"hi": 1, "lo-a": 32}  # lo-a's last 32 prompt tokens; lo-b still waits
    eng.step()
    assert plans[-1] == {"lo-a": 1, "lo-b": 32}  # hi done; lo-a decodes, lo-b gets the lower share
    outputs(eng)
    lo_steps = [p for p in plans[1:] if p.get("lo-a", 0) > 1 or p.get("lo-b", 0) > 1]
    # while hi contends (the fake clock stays within the hold), every step's lower-class prefill is <= 32
    assert lo_steps and all(p.get("lo-a", 0) * (p.get("lo-a", 0) > 1) + p.get("lo-b", 0) * (p.get("lo-b", 0) > 1)
                            <= 32 for p in lo_steps)


def test_a_guest_on_a_lent_worker_yields_to_the_owner_of_equal_priority(tiny_model):
    """``Request.guest`` (sent to a worker another tenant was assigned): below every tenant's own
    class, so the owner's request arriving during the guest's long prefill caps it, as a higher
    priority would; the same two tenants as equals share the budget (the running prefill's chunk
    is only halved while a request waits)."""
    quotas = {"owner": TenantQuota(priority=0), "visitor": TenantQuota(priority=0)}
    for guest, expect in ((True, {"guest": 32, "own": 40}), (False, {"guest": 64, "own": 40})):
        eng, clock, plans = engine(tiny_model, quotas=quotas)
        g = req("guest", 60 * BS, "visitor", first=1)
        eng.add_request(Request(g.request_id, g.prompt_ids, g.params, tenant=g.tenant, guest=guest))
        eng.step()
        assert plans[-1] == {"guest": 128}  # alone: the whole budget either way
        eng.add_request(req("own", 40, "owner", first=80))
        eng.step()
        assert plans[-1] == expect
        outputs(eng)


def test_request_class_puts_guests_below_every_tenants_own_class():
    from policies.prefill_priority import GUEST_BELOW, request_class

    assert request_class(5) == 5 and request_class(5, guest=True) == 5 - GUEST_BELOW
    assert request_class(100, guest=True) < request_class(-100)  # below any configured class
    assert request_class(2, guest=True) > request_class(1, guest=True)  # guests keep their order
