"""No single request ends an engine step for the others; a dead engine loop is final and loud.

Faults are injected by monkeypatching the runner's forward, the approximate path or the
scheduler on a tiny-llama engine; each test checks that the other requests' outputs equal a
clean run and that the block pool's accounting is exact afterwards. (A request whose sampling
fails alone: engine/sampler.py's ``sample_isolated``, tested in test_sampling_features.py.)
"""

import asyncio

import pytest

import engine.llm_engine as llm_engine_mod
from engine.async_engine import AsyncEngine, EngineDead, EngineStepFailed
from engine.fault_isolation import forward_isolating
from engine.llm_engine import EngineBroken, EngineConfig, LLMEngine
from engine.sequence import Request, SamplingParams

CFG = EngineConfig(model="tiny-llama", num_blocks=64, max_num_batched_tokens=256)


def req(rid, n=30, max_tokens=6, seed=None, first=3):
    return Request(rid, tuple(range(first, first + n)),
                   SamplingParams(max_tokens=max_tokens, temperature=0 if seed is None else 1.0, seed=seed,
                                  ignore_eos=True))


def drain(eng: LLMEngine, errors: dict | None = None) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.error:
                assert o.finished
                if errors is not None:
                    errors[o.request_id] = o.error
                continue
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out


def clean_outputs(tiny_model, reqs):
    eng = LLMEngine(CFG, tiny_model)
    for r in reqs:
        eng.add_request(r)
    return drain(eng)


def assert_pool_idle(eng: LLMEngine):
    eng.pool.check_invariants()
    assert eng.pool.num_in_use() == 0 and not eng.seqs and not eng.scheduler.has_unfinished()
    assert eng.pool.num_free_blocks() == eng.pool.num_blocks


def test_forward_helper_isolates_the_failing_chunk():
    def forward(chunks):
        if 2 in chunks:
            raise RuntimeError("chunk 2")
        return [c * 10 for c in chunks]

    rows = forward_isolating(forward, [1, 2, 3], [True, True, False])
    assert rows[0] == 10 and isinstance(rows[1], RuntimeError) and rows[2] is None
    assert forward_isolating(lambda cs: [c for c in cs if c != 2], [1, 2, 3], [True, False, True]) == [1, None, 3]


def test_a_request_whose_forward_fails_fails_alone(tiny_model, monkeypatch):
    good = [req("a"), req("b", n=50, first=9)]
    want = clean_outputs(tiny_model, good)
    eng = LLMEngine(CFG, tiny_model)
    real = eng.runner.forward

    def forward(batch):
        if (batch.input_ids == 500).any():  # the poisoned prompt's token
            raise RuntimeError("kernel error")
        return real(batch)

    eng.runner.forward = forward
    for r in [good[0], Request("bad", (500,) * 20, SamplingParams(max_tokens=4, temperature=0)), good[1]]:
        eng.add_request(r)
    errors = {}
    got = drain(eng, errors)
    assert list(errors) == ["bad"] and "forward" in errors["bad"]
    assert {k: v for k, v in got.items() if k != "bad"} == want
    assert eng.stats()["failed_requests"] == 1
    assert_pool_idle(eng)


def test_every_request_failing_step_after_step_means_the_engine_is_broken(tiny_model):
    eng = LLMEngine(CFG, tiny_model)

    def forward(batch):
        raise RuntimeError("device lost")

    eng.runner.forward = forward
    errors = {}
    with pytest.raises(EngineBroken):
        for i in range(10):
            eng.add_request(req(f"r{i}"))
            for o in eng.step():
                errors[o.request_id] = o.error
    assert len(errors) == llm_engine_mod.MAX_FAILED_STEPS - 1 and all(errors.values())


def test_approximate_path_failure_runs_the_request_exactly(tiny_model, monkeypatch):
    eng = LLMEngine(CFG, tiny_model)
    base = list(range(3, 83))
    donor = Request("donor", tuple(base), SamplingParams(max_tokens=2, temperature=0), reuse="approximate")
    eng.add_request(donor)
    drain(eng)
    assert len(eng.approx.pool) == 1

    def broken(*a, **k):
        raise UnicodeEncodeError("utf-8", "\udc80", 0, 1, "surrogates not allowed")

    monkeypatch.setattr(eng.approx, "match", broken)
    new = Request("new", tuple(base[:60] + [200] * 4 + base[64:]), SamplingParams(max_tokens=4, temperature=0),
                  reuse="approximate")
    exact = clean_outputs(tiny_model, [Request("new", new.prompt_ids, new.params)])
    eng.add_request(new)
    got = drain(eng)
    assert got["new"] == exact["new"]
    assert eng.stats()["optional_failures"] == {"approximate": 1}
    assert_pool_idle(eng)


async def test_async_engine_delivers_the_failure_and_goes_on(tiny_model):
    eng = AsyncEngine(CFG, loaded=tiny_model)
    try:
        real = eng.engine.runner.forward

        def forward(batch):
            if (batch.input_ids == 500).any():
                raise RuntimeError("kernel error")
            return real(batch)

        eng.engine.runner.forward = forward

        async def collect(r):
            return [o async for o in eng.generate(r)]

        bad = Request("p", (500,) * 12, SamplingParams(max_tokens=4, temperature=0))
        good, failed = await asyncio.gather(collect(req("a")), collect(bad))
        assert good[-1].finished and not good[-1].error
        assert failed[-1].finished and failed[-1].error and "forward" in failed[-1].error
        assert (await collect(req("after")))[-1].finished
        assert eng.alive
    finally:
        eng.shutdown()


async def test_unattributed_step_failure_ends_requests_in_flight_then_goes_on(tiny_model):
    eng = AsyncEngine(CFG, loaded=tiny_model)
    try:
        calls = {"n": 0}
        real = eng.engine.scheduler.schedule

        def schedule():
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("scheduler bug")
            return real()

        eng.engine.scheduler.schedule = schedule
        with pytest.raises(EngineStepFailed):
            async for _ in eng.generate(req("victim", max_tokens=20)):
                pass
        outs = [o async for o in eng.generate(req("next"))]
        assert outs[-1].finished and eng.alive and eng.step_failures == 1
        assert await eng.call(lambda e: (e.pool.check_invariants(), e.pool.num_in_use())[1]) == 0
    finally:
        eng.shutdown()


async def test_dead_loop_fails_waiters_and_every_later_call_at_once(tiny_model):
    eng = AsyncEngine(CFG, loaded=tiny_model)
    try:
        stream = eng.generate(req("long", max_tokens=400))
        await stream.__anext__()
        eng.die(RuntimeError("simulated"))
        with pytest.raises(EngineDead):
            async for _ in stream:
                pass
        assert not eng.alive
        with pytest.raises(EngineDead):
            await asyncio.wait_for(eng.call(lambda e: e.stats()), 5)
        with pytest.raises(EngineDead):
            async for _ in eng.generate(req("later")):
                pass
    finally:
        eng.shutdown()


async def test_an_ordered_death_is_seen_at_once_and_fails_calls_queued_before_it(tiny_model):
    # CI saw health() answer "alive" right after die(): the loop ran the queued call before its
    # next kill check. A call queued behind a long step, then die(): the call must fail.
    eng = AsyncEngine(CFG, loaded=tiny_model)
    try:
        eng.stall(0.3)
        await asyncio.sleep(0.05)
        queued = eng.call(lambda e: e.stats())
        eng.die(RuntimeError("simulated"))
        assert not eng.alive and isinstance(eng.error, RuntimeError)
        with pytest.raises(EngineDead):
            await asyncio.wait_for(eng.call(lambda e: e.stats()), 5)
        with pytest.raises(EngineDead):
            await asyncio.wait_for(queued, 5)
    finally:
        eng.shutdown()
