"""Unit tests of TenantEvictionPolicy: each rule has a test that fails if the rule were missing.

The policy is driven the way the block pool drives it: ``on_cached`` when a block gets a hash,
``on_released`` when its refcount drops to 0 (evictable), ``on_acquired`` on a hit, and
``on_dropped`` once the pool has evicted it.
"""

import pytest

from policies.eviction import TenantEvictionPolicy, TenantQuota


def cached(policy, tenant, blocks, released_at=None):
    """Register ``blocks`` for ``tenant``; release them (oldest first) when ``released_at`` is given."""
    for i, b in enumerate(blocks):
        policy.on_cached(b, tenant)
        if released_at is not None:
            policy.on_released(b, released_at + i)


def drain(policy, requester, now=100.0, **kw):
    """Pop victims until the policy gives none; drop each (as the pool would)."""
    out = []
    while (v := policy.pop_victim(requester, now, **kw)) is not None:
        policy.on_dropped(v)
        out.append(v)
    return out


# -- LRU ------------------------------------------------------------------------------------
def test_lru_oldest_release_first_within_a_tenant():
    p = TenantEvictionPolicy()
    for b, t in [(3, 10.0), (1, 11.0), (2, 12.0)]:
        p.on_cached(b, "a")
        p.on_released(b, t)
    assert drain(p, "a") == [3, 1, 2]  # release order, not block-id order


def test_lru_hit_moves_block_to_the_back():
    p = TenantEvictionPolicy()
    cached(p, "a", [0, 1, 2], released_at=0.0)
    p.on_acquired(0)  # a hit: in use again
    p.on_released(0, 10.0)
    assert drain(p, "a") == [1, 2, 0]


def test_lru_across_tenants_of_one_class_is_global():
    p = TenantEvictionPolicy()
    p.on_cached(0, "a"), p.on_released(0, 5.0)
    p.on_cached(1, "b"), p.on_released(1, 1.0)
    p.on_cached(2, "a"), p.on_released(2, 3.0)
    assert drain(p, "c") == [1, 0, 2]  # oldest head of any tenant first


# -- in use ---------------------------------------------------------------------------------
def test_in_use_blocks_are_never_victims():
    p = TenantEvictionPolicy({"a": TenantQuota(max_blocks=1, ttl_s=1.0)})
    cached(p, "a", [0, 1, 2])  # cached but never released: in use, over cap
    assert p.pop_victim("b", now=1e9) is None
    assert p.pop_expired(1e9) == [] and p.pop_over_cap("a") == []
    assert p.num_evictable() == 0 and p.held["a"] == 3
    p.on_released(1, 0.0)
    p.on_acquired(1)  # hit again before anyone asked
    assert p.pop_victim("b", now=1e9) is None


# -- TTL ------------------------------------------------------------------------------------
def test_ttl_expired_block_goes_before_an_older_unexpiring_one():
    p = TenantEvictionPolicy({"a": TenantQuota(ttl_s=10.0)})
    cached(p, "b", [0], released_at=0.0)  # oldest, no TTL
    cached(p, "a", [1], released_at=5.0)
    assert p.pop_victim("c", now=14.0) == 0  # a's block not expired yet: plain LRU
    p.on_dropped(0)
    cached(p, "b", [0], released_at=0.0)
    assert p.pop_victim("c", now=15.0) == 1  # expired (15 - 5 >= 10): first, although younger


def test_ttl_beats_priority_and_minimum():
    p = TenantEvictionPolicy({"a": TenantQuota(priority=9, min_blocks=5, ttl_s=1.0)})
    cached(p, "a", [0], released_at=0.0)
    cached(p, "low", [1], released_at=0.5)
    assert p.pop_victim("low", now=2.0) == 0


def test_pop_expired_returns_exactly_the_expired_blocks():
    p = TenantEvictionPolicy({"a": TenantQuota(ttl_s=10.0), "b": TenantQuota(ttl_s=100.0)})
    cached(p, "a", [0, 1, 2], released_at=0.0)  # released at 0, 1, 2
    cached(p, "b", [3], released_at=0.0)
    cached(p, "c", [4], released_at=0.0)  # no TTL
    assert sorted(p.pop_expired(11.0)) == [0, 1]
    assert p.pop_expired(11.0) == []
    assert p.evictable("a") == 1 and p.evictable("b") == 1 and p.evictable("c") == 1


# -- priority -------------------------------------------------------------------------------
def test_low_priority_demand_takes_its_own_class_before_older_high_priority_blocks():
    p = TenantEvictionPolicy({"hi": TenantQuota(priority=1)})
    cached(p, "hi", [0, 1], released_at=0.0)  # older
    cached(p, "lo", [2, 3], released_at=10.0)
    assert drain(p, "lo")[:2] == [2, 3]  # plain LRU would take 0 and 1 first


def test_low_priority_demand_takes_high_priority_blocks_only_when_nothing_else_is_left():
    p = TenantEvictionPolicy({"hi": TenantQuota(priority=1), "mid": TenantQuota(priority=0), "lo": TenantQuota(priority=-1)})
    cached(p, "hi", [0], released_at=0.0)
    cached(p, "mid", [1], released_at=1.0)
    cached(p, "lo", [2], released_at=2.0)
    assert drain(p, "mid") == [2, 1, 0]


# -- guaranteed minimum ---------------------------------------------------------------------
def test_minimum_protects_blocks_from_other_tenants():
    p = TenantEvictionPolicy({"a": TenantQuota(min_blocks=2)})
    cached(p, "a", [0, 1, 2], released_at=0.0)  # older than b's
    cached(p, "b", [3], released_at=10.0)
    assert drain(p, "b") == [0, 3]  # a keeps 2 blocks; without the minimum: [0, 1, 2, 3]
    assert p.held["a"] == 2 and p.num_evictable() == 2


def test_minimum_counts_in_use_blocks():
    p = TenantEvictionPolicy({"a": TenantQuota(min_blocks=2)})
    cached(p, "a", [0, 1])  # in use
    cached(p, "a", [2, 3], released_at=0.0)
    assert drain(p, "b") == [2, 3]  # held 4 > 2: both evictable ones may go
    assert p.held["a"] == 2


def test_tenant_recycles_its_own_guarantee():
    p = TenantEvictionPolicy({"a": TenantQuota(min_blocks=2)})
    cached(p, "a", [0, 1], released_at=0.0)
    assert p.pop_victim("b", 100.0) is None
    assert drain(p, "a") == [0, 1]


def test_last_resort_ignores_minimums_lowest_priority_first():
    p = TenantEvictionPolicy({"a": TenantQuota(min_blocks=5, priority=1), "b": TenantQuota(min_blocks=5)})
    cached(p, "a", [0], released_at=0.0)
    cached(p, "b", [1], released_at=1.0)
    assert p.pop_victim("c", 100.0) is None
    assert drain(p, "c", last_resort=True) == [1, 0]


@pytest.mark.parametrize("requester,expected", [("a", 3 + 1 + 1), ("b", 1 + 2 + 1), ("c", 1 + 1 + 1), ("d", 3)])
def test_num_evictable_for_counts_exactly_what_pop_victim_gives(requester, expected):
    p = TenantEvictionPolicy({"a": TenantQuota(min_blocks=2), "b": TenantQuota(min_blocks=1)})
    cached(p, "a", [0, 1, 2], released_at=0.0)
    cached(p, "b", [3, 4], released_at=0.0)
    cached(p, "c", [5], released_at=0.0)
    assert p.num_evictable() == 6
    assert p.num_evictable_for(requester) == expected
    assert len(drain(p, requester)) == expected


# -- cap ------------------------------------------------------------------------------------
def test_over_cap_tenant_is_evicted_first():
    p = TenantEvictionPolicy({"a": TenantQuota(priority=5, max_blocks=2)})
    cached(p, "b", [0], released_at=0.0)  # oldest, lowest priority
    cached(p, "a", [1, 2, 3], released_at=10.0)  # 3 > cap 2
    assert p.pop_victim("b", 100.0) == 1  # without the cap rule: block 0 (LRU, lower priority)
    p.on_dropped(1)
    assert p.pop_victim("b", 100.0) == 0  # back at the cap: ordinary rules


def test_pop_over_cap_drops_oldest_down_to_the_cap_never_in_use():
    p = TenantEvictionPolicy({"a": TenantQuota(max_blocks=2)})
    cached(p, "a", [0, 1])  # in use
    cached(p, "a", [2, 3, 4], released_at=0.0)
    victims = p.pop_over_cap("a")
    assert victims == [2, 3, 4]  # held 5, cap 2, only the 3 evictable ones can go
    for v in victims:
        p.on_dropped(v)
    assert p.held["a"] == 2 and p.pop_over_cap("a") == []


# -- quota validation -------------------------------------------------------------------------
@pytest.mark.parametrize("kw", [dict(min_blocks=-1), dict(min_blocks=3, max_blocks=2), dict(ttl_s=0)])
def test_quota_rejects_nonsense(kw):
    with pytest.raises(ValueError):
        TenantQuota(**kw)


def test_policy_module_imports_no_torch_or_ray():
    import ast
    import inspect

    import policies.eviction as mod

    names = {a.name.split(".")[0] for n in ast.walk(ast.parse(inspect.getsource(mod)))
             if isinstance(n, (ast.Import, ast.ImportFrom)) for a in getattr(n, "names", [])}
    mods = {n.module.split(".")[0] for n in ast.walk(ast.parse(inspect.getsource(mod)))
            if isinstance(n, ast.ImportFrom) and n.module}
    assert not ({"torch", "ray"} & (names | mods))



# -- tails before reused prefixes ------------------------------------------------------------
def _request(p, prefix, tail, released, hit=True):
    """A request of one tenant: ``prefix`` blocks (a chain; hit, i.e. reused, when ``hit``, else
    computed now), then its own ``tail`` blocks continuing it; all released at ``released``,
    tail first (as the pool frees)."""
    parent = None
    for b in prefix:
        if hit:
            p.on_acquired(b)
            p.on_hit(b)
        else:
            p.on_cached(b, "a", parent=parent)
        parent = b
    for b in tail:
        p.on_cached(b, "a", parent=parent)
        parent = b
    for b in reversed(list(prefix) + list(tail)):
        p.on_released(b, released)


def _two_groups(protect_s):
    p = TenantEvictionPolicy(protect_s=protect_s)
    _request(p, [0, 1], [], released=0.0, hit=False)  # group A computed ...
    _request(p, [0, 1], [], released=1.0)  # ... and reused
    _request(p, [10, 11], [], released=2.0, hit=False)  # group B computed ...
    _request(p, [10, 11], [12, 13], released=5.0)  # ... reused by a request with a question/answer
    return p


def test_unshared_tails_go_before_a_recently_reused_prefix():
    # plain LRU takes group A's deepest block first (released longest ago) although the tail
    # blocks 12-13 will never be asked for again; tail-first takes them first, then LRU
    assert drain(_two_groups(0.0), "a", now=10.0) == [1, 0, 13, 12, 11, 10]
    assert drain(_two_groups(60.0), "a", now=10.0) == [13, 12, 1, 0, 11, 10]
    # a reused prefix released protect_s ago is plain LRU again (a workload that moved on)
    assert drain(_two_groups(60.0), "a", now=61.5) == [1, 0, 13, 12, 11, 10]


def test_a_new_chain_is_no_tail_and_a_hit_tail_is_a_prefix():
    p = TenantEvictionPolicy(protect_s=60.0)
    _request(p, [0, 1], [], released=0.0, hit=False)
    _request(p, [0, 1], [], released=1.0)  # A reused
    _request(p, [20, 21], [], released=2.0, hit=False)  # a new group, never reused yet: LRU order,
    assert drain(p, "a", now=10.0) == [1, 0, 21, 20]  # not sacrificed to protect A
    p = TenantEvictionPolicy(protect_s=60.0)
    _request(p, [0, 1], [], released=0.0, hit=False)
    _request(p, [0, 1], [2], released=1.0)  # 2 continues a reused prefix: a tail ...
    _request(p, [0, 1, 2], [], released=2.0)  # ... until a request reuses it (a multi-turn history)
    assert p.tail_ids() == set()
    assert drain(p, "a", now=10.0) == [2, 1, 0]


def _new_group_behind_a_reused_one(p, one_offs=0):
    """``one_offs`` one-off prompts computed and dropped; group A computed and reused; group B's
    first prompt (20-21, its prefix's only copy); a request on A with a question (tails 2-3)."""
    for i in range(one_offs):
        _request(p, [30 + i], [], released=0.0, hit=False)
    assert drain(p, "a", now=0.0) == list(range(30, 30 + one_offs))
    _request(p, [0, 1], [], released=0.0, hit=False)
    _request(p, [0, 1], [], released=1.0)
    _request(p, [20, 21], [], released=2.0, hit=False)
    _request(p, [0, 1], [2, 3], released=5.0)
    return p


def test_a_new_groups_first_prompt_goes_after_tails_while_new_chains_are_reused_more():
    # A's first prompt was reused (new chains: 2 of 2 blocks reused), no tail was yet: B's first
    # prompt, the oldest block, outlives the tails (plain LRU took it first: sessions 28-29)
    p = _new_group_behind_a_reused_one(TenantEvictionPolicy(protect_s=60.0, seed_s=120.0))
    assert p.reuse_rates("a") == {"tail": 0.5, "seed": 0.75}
    assert drain(p, "a", now=10.0) == [3, 2, 21, 20, 1, 0]
    # the rule is off at seed_s 0, and a new chain released seed_s ago is plain LRU again
    assert drain(_new_group_behind_a_reused_one(TenantEvictionPolicy(seed_s=0.0)), "a", now=10.0) == [21, 20, 3, 2, 1, 0]
    assert drain(_new_group_behind_a_reused_one(TenantEvictionPolicy(seed_s=120.0)), "a", now=125.0) == [21, 20, 3, 2, 1, 0]


def test_new_chains_keep_lru_order_where_they_are_reused_less_than_tails():
    # four one-off prompts dropped unused: new chains are reused 2 of 6 times, less than tails'
    # prior, so B's first prompt is one more prompt nobody may ask for again
    p = _new_group_behind_a_reused_one(TenantEvictionPolicy(seed_s=120.0), one_offs=4)
    assert p.reuse_rates("a")["seed"] == 3 / 8
    assert drain(p, "a", now=10.0) == [21, 20, 3, 2, 1, 0]
    # a chat: histories (tails) reused at each next turn, more than new chains
    p = TenantEvictionPolicy(seed_s=120.0)
    _request(p, [0], [], released=0.0, hit=False)
    for turn in range(1, 5):
        _request(p, list(range(turn)), [turn], released=float(turn))  # the history + one block
    assert p.reuse_rates("a") == {"tail": 4 / 5, "seed": 2 / 3}


def test_reuse_outcomes_are_counted_per_tenant_and_decay():
    p = TenantEvictionPolicy()
    p.on_cached(0, "a"), p.on_cached(1, "b")
    p.on_hit(0)  # block 0 is in use: a concurrent request reuses it
    p.on_released(1, 0.0), p.on_acquired(1), p.on_released(1, 0.0)
    assert p.pop_victim("b", now=0.0) == 1
    p.on_dropped(1)
    assert p.reuse_rates("a")["seed"] == 2 / 3 and p.reuse_rates("b")["seed"] == 1 / 3
    assert p.reuse_rates("c") == {"tail": 0.5, "seed": 0.5}
    for i in range(2, 2000):  # a long run of new chains dropped: the early reuse fades, counts stay bounded
        p.on_cached(i, "a"), p.on_released(i, 0.0)
        assert p.pop_victim("a", now=0.0) == i
        p.on_dropped(i)
    assert p.reuse_rates("a")["seed"] < 0.01 and sum(p._outcomes["a"]["seed"]) <= p._DECAY_AT


def test_tail_state_is_forgotten_with_the_block():
    p = _two_groups(60.0)
    assert p.tail_ids() == {12, 13}
    assert drain(p, "a", now=10.0)[:2] == [13, 12]
    assert p.tail_ids() == set() and not p._hit and not p._tail and not p._seeded


def test_a_tail_hit_while_still_in_use_becomes_a_prefix():
    # n > 1 choices or a concurrent request: a tail block is hit before it was ever released
    p = TenantEvictionPolicy(protect_s=60.0)
    _request(p, [0], [], released=0.0, hit=False)
    p.on_acquired(0), p.on_hit(0)
    p.on_cached(1, "a", parent=0)  # in use, never released
    p.on_hit(1)
    p.on_released(1, 1.0), p.on_released(0, 1.0)
    assert p.tail_ids() == set() and drain(p, "a", now=5.0) == [1, 0]


@pytest.mark.parametrize("seed_s, kept", [(120.0, True), (0.0, False)])
def test_a_cold_groups_prefix_outlives_the_hot_groups_tails_in_the_engine(seed_s, kept):
    # the real engine (tiny random Llama): two hot groups reused, a cold group's first prompt, then
    # 40 s of hot requests whose questions and answers overflow the pool; the cold group's second
    # prompt finds its prefix only if new chains go after tails (bench/eviction_scan.py, "cold")
    from types import SimpleNamespace

    from bench.eviction_scan import Policy, run_cold

    a = SimpleNamespace(groups=2, system_len=128, question_len=40, output_len=4, concurrency=2,
                        step_s=0.4, cold_gap_s=40.0)
    r = run_cold(Policy("p", 60.0, seed_s), 0.75, a, seed=0)
    assert r["evictions"] > 0  # the pool was full: tails had to go, or the prefix
    assert r["cold_cached_tokens"] == (128 if kept else 0)
