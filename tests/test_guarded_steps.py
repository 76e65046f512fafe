"""A guarded (``latency_guard``) tenant's prefill steps carry no lower-class work, and a lower-class
step in progress is abandoned between layers when a guarded request arrives (issue 13 section 4).

Exact plans per step on a tiny-llama engine (budget 128, ``low_priority_prefill_tokens`` 32) and
exact tokens against runs without the new rules; the fake clock keeps the hold window exact.
"""

import asyncio
import threading

from engine.async_engine import AsyncEngine
from engine.llm_engine import EngineConfig, LLMEngine
from engine.step_interrupt import ArrivalSignal
from policies.eviction import TenantQuota
from policies.prefill_priority import may_interrupt

from tests.test_prefill_priority import BS, QUOTAS, outputs, req, step
from tests.test_prefill_priority import engine as priority_engine

GUARDED = {**QUOTAS, "hi": TenantQuota(priority=2, latency_guard=True)}


def engine(tiny_model, quotas=GUARDED, **kw):
    eng, _, plans = priority_engine(tiny_model, quotas, **kw)
    return eng, plans


def reference(tiny_model, requests):
    """Tokens of ``requests`` on an engine without priorities (nothing throttled or interrupted)."""
    eng = LLMEngine(EngineConfig(model="tiny-llama", num_blocks=200, max_num_batched_tokens=128, approx=None),
                    tiny_model)
    for r in requests:
        eng.add_request(r)
    return outputs(eng)


def test_a_guarded_prefill_step_carries_no_lower_class_decode_rows(tiny_model):
    eng, plans = engine(tiny_model)
    toks = {}
    eng.add_request(req("lo-dec", 20, "lo", max_tokens=8, first=33))
    step(eng, toks)  # prefilled (capped: guarded class configured)
    step(eng, toks)
    assert plans[-1] == {"lo-dec": 1}  # decoding; no lower-class prefill in the last step
    eng.add_request(req("hi", 40, "hi", first=80))
    step(eng, toks)
    assert plans[-1] == {"hi": 40}  # the guarded prefill alone, although lo's last step had no prefill
    step(eng, toks)
    assert plans[-1] == {"lo-dec": 1, "hi": 1}  # no guarded prefill left: the decode runs again
    got = outputs(eng, toks)
    assert got == reference(tiny_model, [req("lo-dec", 20, "lo", max_tokens=8, first=33), req("hi", 40, "hi", first=80)])


def test_without_the_rule_the_decode_row_rides_along(tiny_model):
    eng, plans = engine(tiny_model, guarded_steps_alone=False)
    eng.add_request(req("lo-dec", 20, "lo", max_tokens=8, first=33))
    eng.step()
    eng.step()
    eng.add_request(req("hi", 40, "hi", first=80))
    eng.step()
    assert plans[-1] == {"lo-dec": 1, "hi": 40}
    outputs(eng)


def test_a_long_guarded_prefill_alternates_and_lower_classes_progress(tiny_model):
    eng, plans = engine(tiny_model)
    toks = {}
    eng.add_request(req("lo-dec", 20, "lo", max_tokens=12, first=33))
    step(eng, toks)
    eng.add_request(req("hi", 30 * BS, "hi", max_tokens=2, first=7))
    eng.add_request(req("lo", 10 * BS, "lo", max_tokens=4, first=1))
    got = outputs(eng, toks)
    hi_prefill = [p for p in plans if p.get("hi", 0) > 1]
    # alone steps (hi only) and shared steps (lower decode + the lower classes' capped chunk) alternate
    assert [set(p) for p in hi_prefill[:4]] == [{"hi"}, {"hi", "lo-dec", "lo"}, {"hi"}, {"hi", "lo-dec", "lo"}]
    assert all(p.get("lo", 0) <= 32 for p in hi_prefill)
    assert sum(p["hi"] for p in hi_prefill) == 30 * BS
    assert got == reference(tiny_model, [req("lo-dec", 20, "lo", max_tokens=12, first=33),
                                         req("hi", 30 * BS, "hi", max_tokens=2, first=7),
                                         req("lo", 10 * BS, "lo", max_tokens=4, first=1)])


def test_the_rule_needs_a_guarded_top_class(tiny_model):
    eng, plans = engine(tiny_model, quotas=QUOTAS)  # hi has priority but no latency_guard
    eng.add_request(req("lo-dec", 20, "lo", max_tokens=8, first=33))
    eng.step()
    eng.add_request(req("hi", 40, "hi", first=80))
    eng.step()
    assert plans[-1] == {"lo-dec": 1, "hi": 40}
    outputs(eng)


def test_interrupt_rule():
    assert may_interrupt(0, frozenset({2}), interrupted_last=False)
    assert not may_interrupt(0, frozenset({2}), interrupted_last=True)  # never two in a row
    assert not may_interrupt(2, frozenset({2}), interrupted_last=False)  # a guarded sequence in the step
    assert not may_interrupt(3, frozenset({2}), interrupted_last=False)  # above the guarded class
    assert not may_interrupt(0, frozenset(), interrupted_last=False)  # nobody guarded


def test_arrival_signal_counts_per_priority():
    a = ArrivalSignal()
    assert a.top is None and not a.above(-1)
    a.note(2)
    a.note(2)
    a.note(1)
    assert a.top == 2 and a.above(1) and not a.above(2)
    a.done(2)
    assert a.top == 2
    a.done(2)
    assert a.top == 1
    a.done(1)
    assert a.top is None


def test_a_lower_step_is_abandoned_for_a_guarded_arrival_and_recomputed_exactly(tiny_model):
    eng, plans = engine(tiny_model)
    lo = req("lo", 10 * BS, "lo", max_tokens=6, first=1)
    eng.add_request(lo)
    toks = {}
    step(eng, toks)
    seq = eng.seqs["lo"]
    done_before = seq.num_computed
    calls = []
    real = eng.arrivals.above
    eng.arrivals.above = lambda p: calls.append(p) or len(calls) >= 1 and real(p)  # asked between layers
    eng.arrivals.note(2)  # a guarded request is on its way
    assert eng.step() == []
    assert eng.num_interrupted_steps == 1 and calls == [0]  # stopped after the first of 2 layers
    assert seq.num_computed == done_before  # nothing of the abandoned step was applied
    step(eng, toks)  # the arrival's add is late: the next lower step is not interrupted (never twice in a row)
    assert eng.num_interrupted_steps == 1 and seq.num_computed == done_before + 32
    hi = req("hi", 40, "hi", first=80)
    eng.add_request(hi)
    eng.arrivals.done(2)
    eng.arrivals.note(2)  # another one on its way while hi's own step runs: not interrupted (hi is in it)
    step(eng, toks)
    assert plans[-1] == {"hi": 40} and eng.num_interrupted_steps == 1
    eng.arrivals.done(2)
    got = outputs(eng, toks)
    assert eng.stats()["interrupted_steps"] == 1
    assert got == reference(tiny_model, [req("lo", 10 * BS, "lo", max_tokens=6, first=1),
                                         req("hi", 40, "hi", first=80)])


def test_no_interrupt_without_a_guarded_class_or_with_the_knob_off(tiny_model):
    for quotas, kw in ((QUOTAS, {}), (GUARDED, {"interrupt_for_guarded": False})):
        eng, _ = engine(tiny_model, quotas=quotas, **kw)
        eng.add_request(req("lo", 10 * BS, "lo", first=1))
        eng.arrivals.note(2)
        eng.step()
        assert eng.num_interrupted_steps == 0 and eng.seqs["lo"].num_computed > 0
        eng.arrivals.done(2)
        outputs(eng)


async def test_async_generate_of_a_guarded_request_interrupts_a_lower_step(tiny_model):
    cfg = EngineConfig(model="tiny-llama", num_blocks=200, max_num_batched_tokens=128, tenant_quotas=GUARDED,
                       approx=None, low_priority_prefill_tokens=32)
    eng = AsyncEngine(cfg, loaded=tiny_model)
    runner = eng.engine.runner
    real_forward = runner.forward
    held = threading.Event()

    def forward(batch, hidden_rows=None, interrupt=None):  # as ModelRunner.forward
        if interrupt is not None and not held.is_set():  # the first lower step: wait for the arrival
            held.set()
            for _ in range(1000):
                if interrupt():
                    break
                threading.Event().wait(0.01)
        return real_forward(batch, hidden_rows, interrupt)

    runner.forward = forward

    async def collect(r):
        return [t async for o in eng.generate(r) for t in o.new_token_ids]

    try:
        lo_task = asyncio.ensure_future(collect(req("lo", 10 * BS, "lo", max_tokens=4, first=1)))
        for _ in range(500):
            if held.is_set():
                break
            await asyncio.sleep(0.01)
        assert held.is_set()
        hi = await asyncio.wait_for(collect(req("hi", 40, "hi", max_tokens=3, first=80)), 30)
        lo = await asyncio.wait_for(lo_task, 30)
        assert eng.engine.num_interrupted_steps == 1
        assert eng.engine.arrivals.top is None  # the note was cleared once hi was added
        want = reference(tiny_model, [req("lo", 10 * BS, "lo", max_tokens=4, first=1),
                                      req("hi", 40, "hi", max_tokens=3, first=80)])
        assert lo == want["lo"] and hi == want["hi"]
        assert await eng.call(lambda e: e.pool.num_in_use()) == 0
    finally:
        eng.shutdown()
