"""Prefix sharing through the engine: exact outputs, tenant isolation, quotas, and exact accounting.

Small pools of 16-token blocks on the tiny model make every eviction visible; ``cached_prefix``
asks the prefix cache what a prompt would hit without touching anything.
"""

import random

import pytest

from engine.llm_engine import EngineConfig, LLMEngine
from engine.sequence import InvalidRequest, Request, SamplingParams, Sequence
from policies.eviction import TenantQuota

BS = 16


def greedy(n: int = 6) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def tokens(seed: int, n: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(3, 259) for _ in range(n))


def engine(loaded, num_blocks: int = 64, quotas=None, **kw) -> LLMEngine:
    kw.setdefault("max_num_batched_tokens", 256)
    cfg = EngineConfig(model=loaded.name, block_size=BS, num_blocks=num_blocks, tenant_quotas=quotas or {}, **kw)
    return LLMEngine(cfg, loaded=loaded)


def run(eng: LLMEngine, requests: list[Request]) -> dict[str, tuple[list[int], int]]:
    """Run to completion; per request: (output ids, cached prompt tokens)."""
    outs = eng.generate(requests)
    return {rid: ([t for o in os_ for t in o.new_token_ids], os_[-1].num_cached_tokens) for rid, os_ in outs.items()}


def cached_prefix(eng: LLMEngine, prompt, tenant: str, read_domains=()) -> int:
    """Prompt tokens a request would take from the prefix cache now (read-only probe)."""
    req = Request("probe", tuple(prompt), tenant=tenant, read_domains=tuple(read_domains))
    return len(eng.kv.find_prefix(Sequence(request=req, tokens=list(prompt), num_prompt=len(prompt)))) * BS


def assert_drained(eng: LLMEngine) -> None:
    """After all requests: every block free or cached-evictable, refcounts 0, accounting exact."""
    assert not eng.has_unfinished()
    eng.pool.check_invariants()
    assert all(b.ref_cnt == 0 for b in eng.pool.blocks)
    assert eng.pool.num_in_use() == 0
    assert eng.pool.num_free_blocks() == eng.pool.num_blocks


# -- exactness ------------------------------------------------------------------------------
def shared_prefix_batch(prefix_len: int, tag: str) -> list[Request]:
    prefix = tokens(1, prefix_len)
    suffixes = [tokens(10 + i, n) for i, n in enumerate([1, 9, 16, 23, 40])] + [()]  # () = the prefix itself
    return [Request(f"{tag}{i}", prefix + s, greedy(), tenant="acme") for i, s in enumerate(suffixes)]


@pytest.mark.parametrize("prefix_len", [64, 70])  # on a block boundary and mid-block
def test_outputs_identical_with_and_without_cache_hits(tiny_model, prefix_len):
    ref = run(engine(tiny_model, enable_prefix_caching=False), shared_prefix_batch(prefix_len, "r"))
    assert all(c == 0 for _, c in ref.values())

    eng = engine(tiny_model)
    together = run(eng, shared_prefix_batch(prefix_len, "t"))  # one batch: joins the first one's prefill
    later = run(eng, shared_prefix_batch(prefix_len, "l"))  # every prefix cached by now
    for i in range(6):
        assert together[f"t{i}"][0] == ref[f"r{i}"][0]
        assert later[f"l{i}"][0] == ref[f"r{i}"][0]
    full = (prefix_len // BS) * BS
    for i, r in enumerate(shared_prefix_batch(prefix_len, "l")):
        # everything cached except at least the last prompt token (its logits are needed)
        assert later[f"l{i}"][1] == (len(r.prompt_ids) - 1) // BS * BS
        assert later[f"l{i}"][1] >= min(full, (len(r.prompt_ids) - 1) // BS * BS)
    assert_drained(eng)


def test_reuse_none_recomputes_and_registers_nothing(tiny_model):
    eng = engine(tiny_model)
    batch = shared_prefix_batch(50, "w")
    warm = run(eng, batch)
    held = eng.stats()["tenants"]["acme"]["blocks_held"]
    base = [Request(f"n{i}", r.prompt_ids, greedy(), tenant="acme", reuse="none") for i, r in enumerate(batch)]
    out = run(eng, base)
    assert all(c == 0 for _, c in out.values())
    assert [out[f"n{i}"][0] for i in range(6)] == [warm[f"w{i}"][0] for i in range(6)]
    assert eng.stats()["tenants"]["acme"]["blocks_held"] == held
    assert_drained(eng)


@pytest.mark.model
def test_outputs_identical_with_and_without_cache_hits_default_model(default_model):
    tok = default_model.tokenizer
    system = tok.encode("You are a careful assistant for a hardware store. Answer briefly and politely, "
                        "quote prices in dollars, and never invent products that are not in stock. ", add_special_tokens=False)
    questions = ["Do you sell hammers?", "What is the price of nails?", "Are you open on Sunday?"]
    prompts = [tuple(system + tok.encode(q, add_special_tokens=False)) for q in questions]
    cfg = dict(model=default_model.name, block_size=BS, num_blocks=64, max_num_batched_tokens=512)
    ref = run(LLMEngine(EngineConfig(**cfg, enable_prefix_caching=False), loaded=default_model),
              [Request(f"r{i}", p, greedy(8)) for i, p in enumerate(prompts)])
    eng = LLMEngine(EngineConfig(**cfg), loaded=default_model)
    run(eng, [Request("warm", prompts[0], greedy(1))])
    out = run(eng, [Request(f"c{i}", p, greedy(8)) for i, p in enumerate(prompts)])
    assert all(out[f"c{i}"][1] >= len(system) // BS * BS for i in range(3))
    assert [out[f"c{i}"][0] for i in range(3)] == [ref[f"r{i}"][0] for i in range(3)]
    assert_drained(eng)


# -- isolation ------------------------------------------------------------------------------
def test_other_tenant_reuses_nothing_without_a_grant_and_the_prefix_with_one(tiny_model):
    eng = engine(tiny_model)
    prompt = tokens(2, 100)
    a = run(eng, [Request("a", prompt, greedy(), tenant="A")])
    shared = (len(prompt) - 1) // BS * BS  # 96

    b = run(eng, [Request("b", prompt, greedy(), tenant="B")])  # A's exact prompt, no grant
    assert b["b"][1] == 0
    assert b["b"][0] == a["a"][0]

    eng2 = engine(tiny_model)
    run(eng2, [Request("a", prompt, greedy(), tenant="A")])
    g = run(eng2, [Request("g", prompt, greedy(), tenant="B", read_domains=("A",))])
    assert g["g"][1] == shared
    assert g["g"][0] == a["a"][0]
    # a grant is one-way: A cannot read B's blocks, C has no grant at all
    run(eng2, [Request("b2", tokens(3, 40), greedy(), tenant="B")])
    assert cached_prefix(eng2, tokens(3, 40), "A") == 0
    assert cached_prefix(eng2, tokens(3, 40), "B") == 32
    assert cached_prefix(eng2, prompt, "C") == 0
    assert eng2.stats()["tenants"]["B"]["cached_tokens"] == shared
    assert_drained(eng)
    assert_drained(eng2)


def test_users_of_one_tenant_share_and_a_grant_continues_the_chain(tiny_model):
    eng = engine(tiny_model)
    system = tokens(4, 48)
    run(eng, [Request("u1", system + tokens(5, 20), greedy(), tenant="A")])
    u2 = run(eng, [Request("u2", system + tokens(6, 20), greedy(), tenant="A")])
    assert u2["u2"][1] == 48
    # B extends A's prefix under its own domain: B's later request hits A's blocks then B's own
    long = system + tokens(7, 40)
    run(eng, [Request("b1", long, greedy(), tenant="B", read_domains=("A",))])
    assert cached_prefix(eng, long + (1,), "B", ("A",)) == 80
    assert cached_prefix(eng, long + (1,), "A") == 48  # B's blocks stay B's
    assert_drained(eng)


# -- in-flight prefix join (engine/scheduler.py) -----------------------------------------------
def burst(prefix, tenants, n_suffix: int = 8) -> list[Request]:
    """One request per (tenant, read_domains) in ``tenants``: ``prefix`` + its own suffix."""
    return [Request(f"b{i}", prefix + tokens(300 + i, n_suffix), greedy(), tenant=t, read_domains=rd)
            for i, (t, rd) in enumerate(tenants)]


@pytest.mark.parametrize("join", [True, False])
def test_a_burst_with_one_new_prefix_computes_it_once(tiny_model, join):
    """Three requests with one uncached 96-token prefix sent together, 32-token steps: the
    first prefills the prefix in chunks; with the join the other two wait for its blocks and
    take all 96 tokens as hits; without it the second starts as soon as the budget allows and
    computes the blocks not registered yet itself. Outputs equal the uncached reference either way."""
    prefix = tokens(90, 96)
    reqs = burst(prefix, [("acme", ())] * 3)
    ref = run(engine(tiny_model, enable_prefix_caching=False, max_num_batched_tokens=32), reqs)
    eng = engine(tiny_model, max_num_batched_tokens=32, join_inflight_prefill=join)
    out = run(eng, reqs)
    assert [out[r.request_id][0] for r in reqs] == [ref[r.request_id][0] for r in reqs]
    assert out["b0"][1] == 0
    if join:
        assert out["b1"][1] == out["b2"][1] == 96
        assert eng.stats()["prefill_joins"] == 2
    else:
        assert out["b1"][1] < 96  # b1 started beside b0 and computed blocks b0 was computing
        assert eng.stats()["prefill_joins"] == 0
    assert_drained(eng)


def test_a_burst_joins_only_prefills_it_may_read_and_not_a_lower_priority_one(tiny_model):
    prefix = tokens(91, 96)
    eng = engine(tiny_model, max_num_batched_tokens=32, quotas={"hi": TenantQuota(priority=1)})
    # B has no grant: it must not wait for A's blocks (a timing channel) and cannot use them
    out = run(eng, burst(prefix, [("A", ()), ("B", ())]))
    assert out["b1"][1] == 0 and eng.stats()["prefill_joins"] == 0
    # G reads A's domain: it waits for A's prefill and hits it
    prefix2 = tokens(92, 96)
    out = run(eng, burst(prefix2, [("A", ()), ("G", ("A",))]))
    assert out["b1"][1] == 96 and eng.stats()["prefill_joins"] == 1
    # hi outranks lo: it does not wait behind lo's prefill, which a contending higher class throttles
    prefix3 = tokens(93, 96)
    out = run(eng, burst(prefix3, [("lo", ()), ("hi", ("lo",))]))
    assert out["b1"][1] < 96 and eng.stats()["prefill_joins"] == 1
    assert_drained(eng)


def test_a_joined_request_goes_ahead_when_the_prefill_it_waits_for_is_aborted(tiny_model):
    prefix = tokens(94, 96)
    eng = engine(tiny_model, max_num_batched_tokens=32)
    for r in burst(prefix, [("acme", ())] * 2):
        eng.add_request(r)
    eng.step()
    eng.step()  # b0 is prefilling; b1 waits for it
    assert eng.stats()["prefill_joins"] == 1 and eng.stats()["waiting"] == 1
    eng.abort("b0")
    outs: list = []
    while eng.has_unfinished():
        outs += eng.step()
    done = [o for o in outs if o.request_id == "b1" and o.finished]
    # the blocks b0 registered before the abort: 32 tokens in its first step (the whole budget),
    # 16 in its second (a running prefill's chunk is half the budget while a request waits)
    assert done and done[0].num_cached_tokens == 48
    assert_drained(eng)


# -- eviction policy through the engine -----------------------------------------------------
def warm_and_release(eng, tenant, prompt, rid):
    """Run one request to completion; its full prompt blocks stay cached (evictable)."""
    run(eng, [Request(rid, prompt, greedy(1), tenant=tenant)])


def test_lru_evicts_the_least_recently_used_prefix(tiny_model):
    eng = engine(tiny_model, num_blocks=12)
    p1, p2, p3 = tokens(20, 49), tokens(21, 49), tokens(22, 49)  # 3 full blocks + 1 partial each
    warm_and_release(eng, "A", p1, "1")
    warm_and_release(eng, "A", p2, "2")
    warm_and_release(eng, "A", p1, "1b")  # p1 used again: p2 is now the least recent
    assert cached_prefix(eng, p1, "A") == 48 and cached_prefix(eng, p2, "A") == 48
    warm_and_release(eng, "A", p3, "3")  # 12 blocks: 6 cached, p3 takes 4 of the 6 free ones
    warm_and_release(eng, "A", tokens(23, 49), "4")  # 2 free + 2 evictions
    assert cached_prefix(eng, p1, "A") == 48  # recently used: kept
    assert cached_prefix(eng, p2, "A") < 48  # least recently used: evicted (tail first)
    assert eng.stats()["tenants"]["A"]["evictions"] > 0
    assert_drained(eng)


def test_cap_limits_a_tenants_cached_blocks(tiny_model):
    eng = engine(tiny_model, quotas={"A": TenantQuota(max_blocks=2)})
    prompt = tokens(30, 81)  # 5 full blocks
    warm_and_release(eng, "A", prompt, "a")
    warm_and_release(eng, "B", prompt, "b")
    st = eng.stats()["tenants"]
    assert st["A"]["blocks_held"] == 2 and st["A"]["evictions"] == 3
    assert st["B"]["blocks_held"] == 5 and st["B"]["evictions"] == 0
    assert cached_prefix(eng, prompt, "A") == 32  # the chain's head survives
    assert_drained(eng)


def test_ttl_drops_a_tenants_blocks_after_it_expires(tiny_model):
    eng = engine(tiny_model, quotas={"A": TenantQuota(ttl_s=30.0)})
    now = [1000.0]
    eng.pool.clock = lambda: now[0]
    prompt = tokens(40, 49)
    warm_and_release(eng, "A", prompt, "a")
    warm_and_release(eng, "B", prompt, "b")
    now[0] += 29.0
    eng.step()
    assert cached_prefix(eng, prompt, "A") == 48
    now[0] += 1.0
    eng.step()  # every step sweeps expired blocks
    assert cached_prefix(eng, prompt, "A") == 0
    assert cached_prefix(eng, prompt, "B") == 48  # no TTL for B
    assert eng.stats()["tenants"]["A"]["evictions"] == 3
    assert_drained(eng)


def test_low_priority_demand_never_evicts_high_priority_blocks_while_it_has_its_own(tiny_model):
    eng = engine(tiny_model, num_blocks=10, quotas={"hi": TenantQuota(priority=1)})
    p_hi, p_lo = tokens(50, 49), tokens(51, 49)
    warm_and_release(eng, "hi", p_hi, "h")  # older
    warm_and_release(eng, "lo", p_lo, "l")
    # 10 blocks: 6 cached, 4 free; lo needs 7 -> 3 evictions, all from lo's class
    warm_and_release(eng, "lo", tokens(52, 100), "l2")
    assert cached_prefix(eng, p_hi, "hi") == 48
    assert eng.stats()["tenants"]["hi"]["evictions"] == 0
    assert eng.stats()["tenants"]["lo"]["evictions"] == 3
    assert_drained(eng)


def test_minimum_guarantee_protects_a_tenant_from_others_demand(tiny_model):
    eng = engine(tiny_model, num_blocks=10, quotas={"A": TenantQuota(min_blocks=3)})
    p_a, p_c = tokens(60, 49), tokens(61, 49)
    warm_and_release(eng, "A", p_a, "a")  # older: plain LRU would evict it first
    warm_and_release(eng, "C", p_c, "c")
    warm_and_release(eng, "B", tokens(62, 100), "b")  # needs 7 of 10: 4 free + 3 evictions
    assert cached_prefix(eng, p_a, "A") == 48
    assert cached_prefix(eng, p_c, "C") == 0
    assert eng.stats()["tenants"]["A"]["blocks_held"] == 3
    assert_drained(eng)


def test_a_request_that_could_only_fit_by_taking_others_minimums_is_refused_not_deadlocked(tiny_model):
    from engine.sequence import InvalidRequest

    eng = engine(tiny_model, num_blocks=11, quotas={"A": TenantQuota(min_blocks=8)})
    warm_and_release(eng, "A", tokens(70, 129), "a")  # A holds its 8 guaranteed blocks
    with pytest.raises(InvalidRequest, match="may hold at most 3"):  # needs 6 blocks; B's share is 3
        eng.add_request(Request("b", tokens(71, 80), greedy(8), tenant="B"))
    assert not eng.has_unfinished() and eng.stats()["tenants"]["A"]["blocks_held"] == 8
    assert_drained(eng)


def test_per_tenant_metrics(tiny_model):
    eng = engine(tiny_model)
    prompt = tokens(80, 40)
    run(eng, [Request("x", prompt, greedy(3), tenant="A")])
    run(eng, [Request("y", prompt, greedy(4), tenant="A"), Request("z", prompt, greedy(5), tenant="B")])
    st = eng.stats()["tenants"]
    assert st["A"] == {"requests": 2, "prompt_tokens": 80, "cached_tokens": 32, "output_tokens": 7,
                       "blocks_held": 2, "evictions": 0, "reads": {"exact": {"own": 32}, "approx": {}}}
    assert st["B"] == {"requests": 1, "prompt_tokens": 40, "cached_tokens": 0, "output_tokens": 5,
                       "blocks_held": 2, "evictions": 0, "reads": {"exact": {}, "approx": {}}}
    assert eng.stats()["cross_tenant_reads"] == {}


# -- accounting -----------------------------------------------------------------------------
def test_no_leak_after_finish_abort_and_preemption_in_a_tiny_pool(tiny_model):
    prefix = tokens(90, 40)
    reqs = [Request(f"q{i}", prefix + tokens(100 + i, 5 + 7 * i), greedy(20), tenant="AB"[i % 2],
                    read_domains=("A",) if i % 2 else ()) for i in range(6)]
    ref = run(engine(tiny_model, enable_prefix_caching=False), reqs)

    eng = engine(tiny_model, num_blocks=12, max_num_seqs=6)
    for r in reqs:
        eng.add_request(r)
    extra = [Request(f"x{i}", prefix + tokens(200 + i, 30), greedy(30), tenant="A") for i in range(3)]
    for r in extra:
        eng.add_request(r)
    outs: dict[str, list[int]] = {}
    aborted = set()
    steps = 0
    while eng.has_unfinished():
        for o in eng.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
        steps += 1
        if steps == 3:
            aborted.add("x0") if eng.abort("x0") else None  # running or waiting
        if steps == 12:
            aborted.update(r for r in ("x1", "x2") if eng.abort(r))
        eng.pool.check_invariants()
        assert steps < 2000
    assert eng.stats()["preemptions"] > 0  # the tiny pool forced recomputes
    assert aborted
    for r in reqs:
        assert outs[r.request_id] == ref[r.request_id][0]  # preempted, recomputed, identical
    assert_drained(eng)
    # the aborts and preemptions left no stray references: a full-pool request still fits
    out = run(eng, [Request("all", tokens(300, 12 * BS - 8), greedy(8), tenant="C")])
    assert len(out["all"][0]) == 8
    assert_drained(eng)
