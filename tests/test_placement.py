"""Cache-capacity-aware placement (policies/placement.py), the router that uses it
(cluster/routing.py, with fake actors) and the shared-prefix replay against the oracle
(bench/placement_sim.py). Pure: no Ray, no model."""

import asyncio
import math
from collections import Counter
from dataclasses import replace

import pytest

from bench.placement_sim import SimConfig, issue_sizing, simulate
from bench.workloads import shared_prefix
from engine.block_pool import prompt_chains
from policies.placement import (TTFT_ONLY, DomainActivity, PlacementConfig, Placer, ShadowCache, WorkerView, choose,
                                rendezvous_order, share_lower_bound)
from policies.routing import Candidate, CostConfig, CostModel, PrefillPrior, WorkerLoad
from tests.fakes import Handle

BS = 16


def view(w, ttft, local=0, eviction=(0, 0, 0.0), load=0.0, rank=0):
    return WorkerView(w, ttft, local, eviction, load, rank)


# -- the shadow cache -------------------------------------------------------------------------
def test_shadow_cache_is_bounded_lru_and_prefix_first_survives():
    s = ShadowCache(10)
    a = [b"a%d" % i for i in range(6)]
    s.touch(a, private_blocks=3, now=0.0)
    assert len(s) == 9 and s.match(a) == 6
    b = [b"b%d" % i for i in range(4)]
    s.touch(b, private_blocks=0, now=1.0)  # 13 > 10: the 3 oldest (a's private blocks) go first
    assert len(s) == 10 and s.evicted == 3 and s.match(a) == 6 and s.match(b) == 4
    s.touch(b, private_blocks=2, now=2.0)  # a's tail goes next, its head last
    assert s.match(a) == 4 and len(s) == 10


def test_eviction_cost_prefers_free_then_cold():
    s = ShadowCache(10)
    s.touch([b"x%d" % i for i in range(4)], 0, now=0.0)
    assert s.eviction_cost(5, 100.0, 30.0) == (0, 0, -1.0)  # fits, 1 block left
    assert s.eviction_cost(6, 100.0, 30.0) == (0, 0, 0.0)
    cold = s.eviction_cost(8, 100.0, 30.0)  # evicts 2 blocks used at t=0: cold at t=100
    assert cold[:2] == (0, 1)
    warm = s.eviction_cost(8, 10.0, 30.0)  # the same blocks are warm at t=10
    assert warm[:2] == (2, 1) and cold < warm
    assert s.eviction_cost(25, 10.0, 30.0)[0] == 4 + 15  # the whole cache and more


def test_shadow_cache_counts_the_prefix_blocks_it_holds():
    s = ShadowCache(10)
    a = [b"a%d" % i for i in range(6)]
    s.touch(a, private_blocks=3, now=0.0)
    assert s.shared == 6  # private blocks are room, not prefixes
    s.touch(a, private_blocks=0, now=1.0)  # the same blocks again: no new prefix
    assert s.shared == 6
    s.touch([b"b%d" % i for i in range(5)], private_blocks=0, now=2.0)  # evicts 3 private, 1 of a
    assert s.shared == 10 == len(s)
    s.reconcile(a, indexed_blocks=2, now=100.0, lag_s=5.0)  # the index shows 2 of a's blocks
    assert s.shared == sum(1 for k in s._lru if isinstance(k, bytes)) == 7


def test_reconcile_trusts_the_index_after_its_lag():
    s = ShadowCache(100)
    chain = [b"c%d" % i for i in range(8)]
    s.touch(chain, 0, now=0.0)
    s.reconcile(chain, indexed_blocks=0, now=1.0, lag_s=5.0)  # too young to be indexed: kept
    assert s.match(chain) == 8
    s.reconcile(chain, indexed_blocks=3, now=10.0, lag_s=5.0)  # the index shows 3: the rest is gone
    assert s.match(chain) == 3


def test_an_index_that_did_not_answer_does_not_purge_the_router_record():
    placer = Placer(PlacementConfig(index_lag_s=5.0))
    chain = [b"p%d" % i for i in range(8)]
    placer.commit("w0", chain, 0, now=0.0)
    assert placer.pending({"d": chain}, None, ["w0"], now=100.0) == {"w0": 8}  # lookup timed out: kept
    assert placer.pending({"d": chain}, {}, ["w0"], now=100.0) == {}  # the index answered "not held": gone


# -- the rules --------------------------------------------------------------------------------
def test_no_match_places_on_headroom_not_on_worker_order():
    views = [view("w0", 0.5, eviction=(40, 1, -1.0)), view("w1", 0.5, eviction=(0, 0, -3.0), rank=3),
             view("w2", 0.5, eviction=(0, 0, -9.0), rank=2)]
    p = choose(views, usable_blocks=39, prompt_prefill_s=0.5)
    assert p.kind == "place" and p.worker == "w2"  # most free left; w0 would evict a warm group
    # where it fits anyway, a queue outweighs free space (nothing is evicted either way)
    busy_roomy = view("w2", 0.9, eviction=(0, 0, -9.0), load=400.0)
    idle_tight = view("w1", 0.5, eviction=(0, 0, -3.0), load=0.0)
    assert choose([busy_roomy, idle_tight], 39, 0.5).worker == "w1"
    # equal headroom: rendezvous order, then load (not list order)
    tied = [view("w0", 0.5, rank=1), view("w1", 0.5, rank=0)]
    assert choose(tied, 39, 0.5).worker == "w1"
    assert choose([view("w0", 0.5, load=10, rank=0), view("w1", 0.5, rank=1)], 39, 0.5).worker == "w1"


def test_placement_spills_over_load_but_only_beyond_the_slack():
    free_busy = view("w0", 1.6, eviction=(0, 0, -5.0))  # room, but 1.1 s of queue
    full_idle = view("w1", 0.5, eviction=(30, 1, -1.0))
    assert choose([free_busy, full_idle], 39, 0.5).worker == "w1"  # 1.6 > 0.5 + 1.0 x 0.5: too slow
    free_bit_busy = view("w0", 0.9, eviction=(0, 0, -5.0))
    assert choose([free_bit_busy, full_idle], 39, 0.5).worker == "w0"  # within slack: headroom wins


def test_holder_keeps_its_group_near_a_tie_and_spills_when_clearly_slower():
    holder = view("w0", 0.40, local=37, eviction=(0, 0, -2.0))
    other = view("w1", 0.30, eviction=(30, 1, -1.0))
    assert choose([holder, other], 39, 0.6).kind == "match"  # 0.40 < 0.30 x 1.5 + 0.05
    hot = view("w0", 3.0, local=37)
    p = choose([hot, other], 39, 0.6)
    assert p.kind == "spill" and p.worker == "w1"
    # a plain TTFT choice when asked for
    assert choose([holder, other], 39, 0.6, TTFT_ONLY).worker == "w1"
    # the warm blocks a spill evicts count against it: a fast target that would evict a whole
    # group loses to a holder only a little slower than the margin alone allows
    # (pull options, which repeat no prefill, so that only the evictions differ)
    evicting = WorkerView("w1", 0.30, 0, (39, 1, -1.0), reused_blocks=37)
    slowish = view("w0", 0.60, local=37)
    assert choose([slowish, evicting], 39, 0.6).kind == "match"
    assert choose([slowish, WorkerView("w1", 0.30, 0, (0, 0, -40.0), reused_blocks=37)], 39, 0.6).kind == "spill"


def test_a_recompute_copy_is_charged_the_prefill_it_repeats_a_pull_is_not():
    # the holder waits 1.6 s; elsewhere the prompt takes 0.6 s to recompute (37 of its 39 blocks
    # again) or 0.6 s to pull: only the pull relieves the holder
    holder = view("w0", 1.6, local=37)
    recompute = WorkerView("w1", 0.6, 0, (0, 0, -40.0), reused_blocks=0)
    pull = WorkerView("w1", 0.6, 0, (0, 0, -40.0), reused_blocks=37)
    assert choose([holder, recompute], 39, 0.6).kind == "match"  # 1.6 < (0.6 + 0.57) x 1.5 + 0.05
    assert choose([holder, pull], 39, 0.6).kind == "spill"  # 1.6 > 0.6 x 1.5 + 0.05
    # without the charge (compute_weight 0) the recompute spills as before
    assert choose([holder, recompute], 39, 0.6, PlacementConfig(compute_weight=0.0)).kind == "spill"
    # a holder far enough behind still spills to a recompute
    assert choose([view("w0", 2.5, local=37), recompute], 39, 0.6).kind == "spill"


def test_a_spills_pull_is_charged_half_its_transfer_a_recompute_has_none_to_discount():
    """A copy made by pull serves the group's later requests locally: its transfer is paid once,
    so a dominant group's spill charges it at ``spill_pull_charge`` (0.5). On the cluster bench
    the hot group never reached the worker behind the 100 Mbit/s link (a 2 s pull) at full
    charge (session 13)."""
    holder = view("w0", 2.2, local=37)
    slow_pull = WorkerView("w1", 2.3, 0, (0, 0, -40.0), reused_blocks=37,
                           candidate=Candidate("w1", "pulled", 2.3, 0.0, 0.3, 2.0, 0, 592))
    assert choose([holder, slow_pull], 39, 0.6).kind == "spill"  # 2.2 > (2.3 - 1.0) x 1.5 + 0.05
    assert choose([holder, slow_pull], 39, 0.6, PlacementConfig(spill_pull_charge=1.0)).kind == "match"
    recompute = WorkerView("w1", 2.3, 0, (0, 0, -40.0), reused_blocks=37,
                           candidate=Candidate("w1", "recomputed", 2.3, 0.0, 2.3, 0.0, 0, 0))
    assert choose([holder, recompute], 39, 0.6).kind == "match"  # no transfer to discount


def test_new_groups_go_where_the_fewest_prefixes_live_not_to_a_slightly_faster_host():
    """A group brings its later requests: where the first lands decides the split of the load.
    Placing each new group on the fastest host (10% quicker) by its own TTFT stacked 4 groups on
    one worker and 2 on another where 3 each fit (the cluster bench, session 10: engines 63% and
    96% busy); options within ``place_tie`` x the prompt's prefill go by prefixes held."""
    fast_full = WorkerView("w0", 2.7, 0, (0, 0, -20.0), shared_blocks=64)
    slow_roomy = WorkerView("w1", 3.0, 0, (0, 1, -5.0), shared_blocks=32)  # evicts cold or private blocks only
    assert choose([fast_full, slow_roomy], 39, 3.0).worker == "w1"
    assert choose([fast_full, slow_roomy], 39, 3.0, PlacementConfig(place_tie=0.0)).worker == "w0"
    # beyond the tie the faster option wins, and a warm eviction still counts first
    assert choose([fast_full, replace(slow_roomy, ttft_s=4.0)], 39, 3.0).worker == "w0"
    assert choose([fast_full, replace(slow_roomy, eviction=(5, 1, -1.0))], 39, 3.0).worker == "w0"


BALANCE = PlacementConfig(balance_ratio=2.0)  # session 11's overloaded-holder rule (opt-in)


def test_an_overloaded_holder_spills_any_of_its_groups_and_without_the_margin():
    """Groups stay with their holder; only a dominant group spills on a queue (session 9). With
    ``balance_ratio`` set, a holder whose queue wait stays high on average (a persistent share of
    the load, not a burst) while another worker's stays low lets any of its groups spill, as soon
    as the option is faster. Off by default."""
    holder = WorkerView("w0", 6.0, 37, (0, 0, -2.0), group_share=1 / 3, wait_avg_s=8.0)
    pull = WorkerView("w1", 1.0, 0, (0, 0, -40.0), reused_blocks=37, wait_avg_s=0.5)
    p = choose([holder, pull], 39, 3.0, BALANCE)
    assert (p.worker, p.kind) == ("w1", "balance")
    busy_now = replace(holder, wait_avg_s=2.0)  # 2.0 <= 2 x 0.5 + 2: a queue now, not a share
    assert choose([busy_now, pull], 39, 3.0, BALANCE).kind == "match"
    assert choose([holder, pull], 39, 3.0).kind == "match"  # the default: one group of three stays
    # the margin: a dominant group's holder 1.2 s against a 1.0 s pull stays unless overloaded
    dominant = WorkerView("w0", 1.2, 37, (0, 0, -2.0), group_share=1.0, wait_avg_s=1.0)
    assert choose([dominant, pull], 39, 3.0, BALANCE).kind == "match"
    assert choose([replace(dominant, wait_avg_s=5.0), pull], 39, 3.0, BALANCE).kind == "balance"
    assert choose([replace(dominant, wait_avg_s=5.0), pull], 39, 3.0).kind == "match"
    assert choose([replace(dominant, ttft_s=2.0, wait_avg_s=5.0), pull], 39, 3.0, BALANCE).kind == "spill"
    # an overloaded worker is not where a new prefix goes when another is as fast
    fresh = [WorkerView("w0", 3.0, 0, (0, 0, -50.0), wait_avg_s=8.0), WorkerView("w1", 3.1, 0, (0, 0, -5.0),
                                                                           shared_blocks=60, wait_avg_s=0.5)]
    assert choose(fresh, 39, 3.0, BALANCE).worker == "w1"


def test_the_placer_averages_each_workers_queue_wait_over_time():
    placer = Placer(PlacementConfig(balance_tau_s=10.0))
    assert placer.observe_wait("w", 10.0, now=0.0) == 10.0
    assert placer.observe_wait("w", 0.0, now=10.0) == pytest.approx(10.0)  # 10 s held for 10 s
    assert placer.observe_wait("w", 0.0, now=20.0) == pytest.approx(10.0 * math.exp(-1))
    # a spike seen for 0.1 s barely moves the average
    placer.observe_wait("v", 0.0, now=0.0)
    placer.observe_wait("v", 100.0, now=10.0)
    assert placer.observe_wait("v", 0.0, now=10.1) == pytest.approx(100.0 * (1 - math.exp(-0.01)))
    placer.remove("w")
    assert placer.observe_wait("w", 3.0, now=30.0) == 3.0


def test_a_persistently_loaded_holder_hands_a_group_to_an_idle_worker():
    """With the balance rule on: three groups on w0, none on w1; w0's queue stays long for a
    minute: a request of one of its groups (no group dominant) moves to w1, by pull, and w1 then
    holds that group."""
    workers = ["w0", "w1"]
    cm, placer, (a, b, c) = _three_groups_on_w0(workers, users=8, config=BALANCE)
    idx = {"w0": 592}
    cm.observe_load("w0", WorkerLoad(waiting_tokens=(640,) * 8))  # ~5 s of queue
    assert _route(placer, cm, a[1], workers, idx, {"w0": 5120.0}, now=1.0).kind == "match"  # a queue, once
    for k, t in enumerate((20.0, 40.0)):  # the queue stays: its average rises
        assert _route(placer, cm, (b, c)[k][1], workers, idx, {"w0": 5120.0}, now=t).worker == "w0"
    p = _route(placer, cm, a[2], workers, idx, {"w0": 5120.0}, now=60.0)
    assert (p.worker, p.kind) == ("w1", "balance") and p.candidate.kind == "pulled"
    assert placer.shadow("w1").match(prompt_chains(a[3].prompt_ids, BS, "m", [a[3].domain])[a[3].domain]) >= 37


def test_a_groups_share_of_its_holders_traffic_fades_with_time():
    """The dominance test reads the holder's recent traffic: requests count with weights that
    decay with ``group_tau_s``, so a group that stopped coming stops holding a share (a new hot
    group is dominant within a few requests), and the frame the weights live in moves on without
    changing any share."""
    placer = Placer(PlacementConfig(group_tau_s=10.0))
    for k in range(8):
        placer.count_routed("w", b"old", float(k))
    assert placer.group_share("w", {b"new"}, 8.0) == 0.0
    for t in (60.0, 61.0, 62.0):  # six time constants later: the old group's 8 weigh < 0.02
        placer.count_routed("w", b"new", t)
    assert placer.group_share("w", {b"new"}, 62.0) > 0.99
    # equal traffic of three groups is a third each, however long it runs (the frame moves on)
    for k in range(300):
        placer.count_routed("v", (b"a", b"b", b"c")[k % 3], 1.0 * k)
    assert placer.group_share("v", {b"a"}, 299.0) == pytest.approx(1 / 3, abs=0.05)
    assert len(placer.recent["v"]) == 3
    # long silence: no evidence of other groups
    assert placer.group_share("v", {b"z"}, 299.0 + 200.0) == 1.0
    placer.remove("v")
    assert placer.group_share("v", {b"a"}, 600.0) == 1.0


def test_groups_per_worker_counts_the_groups_routed_there_lately():
    placer = Placer(PlacementConfig(group_tau_s=10.0))
    for k in range(6):
        placer.count_routed("w0", (b"a", b"b", b"c")[k % 3], float(k))
    placer.count_routed("w1", b"d", 0.0)
    assert placer.groups_per_worker(6.0) == {"w0": 3, "w1": 1}
    # at 12 s d's one request weighs e^-1.2 = 0.30; a, b and c, two requests each, 0.71-0.87
    assert placer.groups_per_worker(12.0) == {"w0": 3, "w1": 0}
    assert placer.groups_per_worker(60.0) == {"w0": 0, "w1": 0}


def test_small_matches_do_not_count_as_holders():
    tiny = view("w0", 0.45, local=2, eviction=(30, 1, -1.0))  # 2 of 39 blocks (a common header)
    free = view("w1", 0.5, eviction=(0, 0, -10.0))
    p = choose([tiny, free], 39, 0.5)
    assert p.kind == "place" and p.worker == "w1"


def test_ties_between_holders_go_by_headroom():
    a = view("w0", 0.30, local=37, eviction=(3, 1, -1.0), rank=0)
    b = view("w1", 0.301, local=37, eviction=(0, 0, -4.0), rank=1)
    assert choose([a, b], 39, 0.5).worker == "w1"


def test_holders_near_a_tie_go_to_the_one_with_the_fewest_requests_in_flight():
    """A hot prefix held by every worker: per-worker prefill fits differ by ~10% on identical
    hosts, so the holder fitted fastest took most requests while others idled (the cluster
    bench's hot prefix, session 28: 14 of 21 requests on one of three holders). Within
    ``match_tie`` of the fastest holder, the fewest requests in flight decide; a holder that would
    reuse fewer blocks (a chat turn's other holders have only the system prompt) is no tie."""
    fitted_fast = replace(view("w0", 0.60, local=34), running=2)
    idle = view("w1", 0.80, local=34)
    queued = replace(view("w2", 0.62, local=34, load=40.0), queued=1)
    assert choose([fitted_fast, idle, queued], 34, 0.9).worker == "w1"
    assert choose([fitted_fast, idle, queued], 34, 0.9, PlacementConfig(match_tie=0)).worker == "w0"
    assert choose([fitted_fast, replace(idle, ttft_s=0.95), queued], 34, 0.9).worker == "w2"  # 0.95 > 0.6 x 1.5
    system_only = WorkerView("w1", 0.70, 16, (0, 0, 0.0), reused_blocks=16)
    assert choose([fitted_fast, system_only], 34, 0.9).worker == "w0"


def test_rendezvous_is_stable_and_spreads_keys():
    ws = ["w0", "w1", "w2", "w3"]
    assert rendezvous_order(b"k", ws) == rendezvous_order(b"k", list(reversed(ws)))
    firsts = Counter(min(rendezvous_order(bytes([i, j]), ws), key=rendezvous_order(bytes([i, j]), ws).get)
                     for i in range(20) for j in range(20))
    assert set(firsts) == set(ws) and min(firsts.values()) > 50


def test_choose_needs_workers():
    with pytest.raises(ValueError):
        choose([], 10, 0.1)


# -- the placer with the cost model: in-flight prefixes, groups, spill -------------------------
def _cost_model(workers):
    cm = CostModel(CostConfig(block_size=BS, prefill_prior=PrefillPrior(a=0.02, b=1.0, c=0.0)))
    for w in workers:
        cm.register(w, w)
    return cm


def _route(placer, cm, item, workers, holdings, loads, now):
    chains = prompt_chains(item.prompt_ids, BS, "m", [item.domain])
    pend = placer.pending_tokens(chains, holdings, workers, len(item.prompt_ids), BS, now)
    ranking = cm.rank(len(item.prompt_ids), holdings, workers, pend)
    return placer.decide(item.prompt_ids, item.max_tokens, BS, chains, item.domain, holdings, workers, loads,
                         ranking, now)


def _three_groups_on_w0(workers, users, config=None):
    """A cost model and a placer that placed three groups on w0 (w1 made unattractive meanwhile,
    then idle again); the groups' items."""
    cm, placer = _cost_model(workers), Placer(config)
    by_group: dict[str, list] = {}
    for it in shared_prefix(groups=3, users=users, seed=11, shuffle=False):
        by_group.setdefault(it.group, []).append(it)
    groups = tuple(by_group.values())
    for g in groups:
        cm.observe_load("w1", WorkerLoad(waiting_tokens=(4000,)))
        assert _route(placer, cm, g[0], workers, {}, {}, now=0.0).worker == "w0"
    cm.observe_load("w1", WorkerLoad())
    return cm, placer, groups


def test_a_burst_of_one_group_stays_on_one_worker_before_anything_is_indexed():
    workers = ["w0", "w1", "w2", "w3"]
    cm, placer = _cost_model(workers), Placer()
    for w in workers:
        placer.shadow(w, 48)
    items = shared_prefix(groups=1, users=6, seed=3)
    chosen = [_route(placer, cm, it, workers, {}, {}, now=0.0) for it in items]
    assert {p.worker for p in chosen} == {chosen[0].worker}
    assert [p.kind for p in chosen] == ["place"] + ["match"] * 5
    assert all(p.candidate.kind == "local" and p.candidate.local_tokens == 592 for p in chosen[1:])
    # the log keeps the one decision that gave the group a worker, with every candidate as it was
    (entry,) = placer.log
    assert entry["kind"] == "place" and entry["worker"] == chosen[0].worker
    assert entry["prompt_tokens"] == len(items[0].prompt_ids) and set(entry["candidates"]) == set(workers)
    assert all(c["capacity"] == 48 and c["local"] == 0 and c["prefix"] == 0 for c in entry["candidates"].values())
    # a large pool's entry keeps the fastest candidates and the one chosen
    from policies.placement import DECISION_CANDIDATES, decision_record
    many = [WorkerView(f"v{i:02d}", 1.0 + i, 0, (0, 0, -10.0)) for i in range(20)]
    rec = decision_record("place", "v19", b"k", 64, 3, 0.5, many, now=0.0)
    assert list(rec["candidates"]) == [f"v{i:02d}" for i in range(DECISION_CANDIDATES)] + ["v19"]


def test_new_groups_spread_over_workers_sized_for_one_group_each():
    workers = ["w0", "w1", "w2", "w3"]
    cm, placer = _cost_model(workers), Placer()
    for w in workers:
        placer.shadow(w, 48)
    items = shared_prefix(groups=4, users=6, seed=5)  # shuffled: groups interleave
    where: dict[str, set] = {}
    for it in items:
        where.setdefault(it.group, set()).add(_route(placer, cm, it, workers, {}, {}, now=0.0).worker)
    assert all(len(ws) == 1 for ws in where.values())  # each group on one worker
    assert len(set().union(*where.values())) == 4  # the groups on four different workers
    # only blocks nobody shares were evicted (4 per request: 2 question blocks, 2 private);
    # every group's 37 shared blocks are still held by its worker
    assert sum(s.evicted for s in placer.shadows.values()) <= 4 * 6 * 4
    for it in items:
        (w,) = where[it.group]
        assert placer.shadow(w).match(prompt_chains(it.prompt_ids, BS, "m", [it.domain])[it.domain]) >= 37


def test_a_hot_group_under_load_spills_to_a_second_worker_by_pull_or_recompute():
    workers = ["w0", "w1"]
    cm, placer = _cost_model(workers), Placer()
    items = shared_prefix(groups=1, users=4, seed=7)
    first = _route(placer, cm, items[0], workers, {}, {}, now=0.0)
    h = first.worker
    other = "w1" if h == "w0" else "w0"
    idx = {h: 592}  # the index shows the prefix on the holder now
    light = _route(placer, cm, items[1], workers, idx, {h: 48.0}, now=1.0)
    assert (light.worker, light.kind) == (h, "match")
    cm.observe_load(h, WorkerLoad(waiting_tokens=(640,) * 4))  # a queue of 4 full prompts
    hot = _route(placer, cm, items[2], workers, idx, {h: 2560.0}, now=2.0)
    assert hot.worker == other and hot.kind == "spill" and hot.candidate.kind in ("pulled", "recomputed")


def test_a_holder_serving_several_groups_keeps_them_and_spills_only_its_dominant_one():
    """A copy of one group of several does not relieve their holder (the others stay), it only
    takes cache space elsewhere: with every group's prefixes filling 3/4 of the cluster, such
    copies evicted warm groups (placement_openloop --workload steady). A group that made most of
    the holder's recent requests (a hot prefix) still spills."""
    workers = ["w0", "w1"]
    cm, placer, (a, b, c) = _three_groups_on_w0(workers, users=4)
    idx = {"w0": 592}
    cm.observe_load("w0", WorkerLoad(waiting_tokens=(640,) * 4))  # the holder is clearly slower now
    assert placer.group_share("w1", {_key(a[1])}, 1.0) == 1.0  # nothing routed there yet: no evidence of other groups
    assert placer.group_share("w0", {_key(a[1])}, 1.0) == pytest.approx(1 / 3)
    p = _route(placer, cm, a[1], workers, idx, {"w0": 2560.0}, now=1.0)
    assert (p.worker, p.kind) == ("w0", "match")  # one group of three: it stays
    # the same queue, but the holder's traffic of the last minutes is group a's: it spills
    for k in range(12):
        placer.count_routed("w0", _key(a[2]), 10.0 + 10 * k)
    assert placer.group_share("w0", {_key(a[2])}, 120.0) > 0.9
    p = _route(placer, cm, a[2], workers, idx, {"w0": 2560.0}, now=120.0)
    assert (p.worker, p.kind) == ("w1", "spill")
    # spill_group_share 0 and no share of the cluster's traffic needed: any group may spill (the rule before)
    old = Placer(PlacementConfig(spill_group_share=0.0, spill_share_margin=None))
    for it in (a[0], b[0], c[0]):
        cm.observe_load("w0", WorkerLoad())
        cm.observe_load("w1", WorkerLoad(waiting_tokens=(4000,)))
        _route(old, cm, it, workers, {}, {}, now=0.0)
    cm.observe_load("w1", WorkerLoad())
    cm.observe_load("w0", WorkerLoad(waiting_tokens=(640,) * 4))
    assert _route(old, cm, a[1], workers, idx, {"w0": 2560.0}, now=1.0).kind == "spill"


def test_a_group_spills_only_with_its_holders_worth_of_the_clusters_traffic():
    """A holder's dominant group spills only while its share of the cluster's recent traffic x
    workers is at least its holders (``spill_share_margin`` 0): one of 12 equal groups that made
    most of its holder's requests lately by chance (Poisson bursts) stays, where its copy took the
    room of the resident groups' requests (the cluster bench, session 16: 4 prefixes on a worker
    sized for 4). A group with a quarter of 4 workers' traffic spills to a second holder, not a
    third. A minor group leaves only a swamped holder (four prefills beyond the spill margin)."""
    holder = WorkerView("w0", 1.2, 37, (0, 0, -10.0), group_share=0.9)  # 1.2 s > 0.4 x 1.5 + 0.05
    free = WorkerView("w1", 0.4, 0, (0, 0, -60.0), reused_blocks=37)
    others = [WorkerView(f"w{i}", 2.0, 0, (0, 0, -10.0)) for i in (2, 3)]
    views = [holder, free, *others]
    assert choose(views, 39, 0.6, cluster_share=1 / 12).kind == "match"
    assert choose(views, 39, 0.6, PlacementConfig(spill_share_margin=None), cluster_share=1 / 12).kind == "spill"
    assert choose(views, 39, 0.6, cluster_share=0.25).worker == "w1"  # one worker's worth, one holder
    assert choose(views, 39, 0.6).kind == "spill"  # the cluster's traffic unknown: the holder's share decides
    second = replace(others[0], local_blocks=37, ttft_s=1.2)
    assert choose([holder, free, second, others[1]], 39, 0.6, cluster_share=0.25).kind == "match"
    assert choose([holder, free, second, others[1]], 39, 0.6, cluster_share=0.5).worker == "w1"
    # a swamped holder (3.1 s > 0.65 s + four 0.6 s prefills) lets even a minor group go
    swamped = [replace(holder, ttft_s=3.1), free, *others]
    assert choose(swamped, 39, 0.6, cluster_share=1 / 12).worker == "w1"
    assert choose([replace(holder, ttft_s=2.9), free, *others], 39, 0.6, cluster_share=1 / 12).kind == "match"
    assert choose(swamped, 39, 0.6, PlacementConfig(minor_spill_prefills=None), cluster_share=1 / 12).kind == "match"
    # measured on few requests, a share must be sure: 4 of the last 15 (0.27, 1.07 workers' worth)
    # is at least 0.17 at one standard error (0.68 workers): a chance burst of one of 12 groups
    assert choose(views, 39, 0.6, cluster_share=4 / 15).kind == "spill"  # taken as exact
    assert choose(views, 39, 0.6, cluster_share=4 / 15, cluster_weight=15.0).kind == "match"
    assert choose(views, 39, 0.6, PlacementConfig(spill_share_z=0.0), cluster_share=4 / 15,
                  cluster_weight=15.0).kind == "spill"
    assert choose(views, 39, 0.6, cluster_share=1.0, cluster_weight=15.0).kind == "spill"  # a hot group


def test_a_shares_lower_bound_tightens_with_the_requests_it_is_measured_on():
    assert share_lower_bound(4 / 15, 15.0, 1.0) == pytest.approx(0.170, abs=1e-3)
    assert share_lower_bound(1.0, 39.0, 1.0) == pytest.approx(39 / 40)
    bounds = [share_lower_bound(0.3, n, 1.0) for n in (5.0, 20.0, 80.0, 320.0)]
    assert bounds == sorted(bounds) and all(b < 0.3 for b in bounds) and bounds[-1] > 0.27
    assert share_lower_bound(0.3, None, 1.0) == share_lower_bound(0.3, 20.0, 0.0) == 0.3
    assert share_lower_bound(0.0, 20.0, 1.0) == 0.0


def test_decoding_sequences_move_a_hot_group_but_do_not_decide_a_new_groups_home():
    """The cost model's decode term (learned, ``learn_decode``) prices how much longer a busy
    worker's steps are. It counts where a holder's dominant group is served: a hot holder whose
    cost is 8 decoding sequences (no queue) lets the group go once the term is learned (without
    it the hot group never left its holder on the cluster bench, session 12). A new prefix's home is chosen
    for the long run, on TTFTs without the term (``place_counts_decode`` counts it)."""
    workers = ["w0", "w1"]
    cm = CostModel(CostConfig(block_size=BS, prefill_prior=PrefillPrior(a=0.02, b=1.0, c=0.0), learn_decode=True))
    for w in workers:
        cm.register(w, w)
    placer = Placer()
    items = shared_prefix(groups=1, users=6, seed=7)
    h = _route(placer, cm, items[0], workers, {}, {}, now=0.0).worker
    other = "w1" if h == "w0" else "w0"
    idx = {h: 592}
    cm.observe_load(h, WorkerLoad(running=8))
    assert _route(placer, cm, items[1], workers, idx, {}, now=1.0).kind == "match"  # decoding is free until learned
    for i in range(24):
        running = (0, 2, 4, 8)[i % 4]
        cm.observe_outcome(h, running, 0.1, 0.1 + 0.3 * running)
    p = _route(placer, cm, items[2], workers, idx, {}, now=2.0)
    assert (p.worker, p.kind) == (other, "spill")
    # a new prefix: equal TTFTs but for w0's decode term; w0 holds fewer prefixes
    decoding_roomy = WorkerView("w0", 2.9, 0, (0, 0, -20.0), shared_blocks=0,
                                candidate=Candidate("w0", "recomputed", 2.9, 2.4, 0.5, 0.0, 0, 0, decode_wait_s=2.4))
    idle_fuller = WorkerView("w1", 0.5, 0, (0, 0, -20.0), shared_blocks=37)
    assert choose([decoding_roomy, idle_fuller], 39, 0.5).worker == "w0"
    assert choose([decoding_roomy, idle_fuller], 39, 0.5, PlacementConfig(place_counts_decode=True)).worker == "w1"


def test_a_hot_group_takes_an_idle_worker_even_behind_a_slow_link():
    """A hot group's busy holder (2 sequences decoding) and an idle worker whose only option is
    a 2 s pull (a slow link): the spill rule never moves the group (the pull is slower than the
    holder's queue), the idle rule does, and only while every condition holds."""
    busy = WorkerView("w0", 1.2, 39, (0, 0, -10.0), running=2, group_share=1.0)
    slow = WorkerView("w1", 2.3, 0, (0, 0, -60.0),
                      candidate=Candidate("w1", "pulled", 2.3, 0.0, 0.3, 2.0, 0, 592))
    p = choose([busy, slow], 39, 3.3, cluster_share=1.0)
    assert (p.worker, p.kind) == ("w1", "idle")
    assert choose([busy, slow], 39, 3.3, PlacementConfig(idle_slack=0.0), cluster_share=1.0).kind == "match"
    assert choose([busy, slow], 39, 3.3).kind == "match"  # the group's traffic unknown
    # one of twelve equal groups is not hot: 1/12 of the traffic is no worker's worth
    assert choose([busy, slow], 39, 3.3, cluster_share=1 / 12).kind == "match"
    # a holder with one sequence decoding is not busy; a queued prompt counts as one more
    assert choose([replace(busy, running=1), slow], 39, 3.3, cluster_share=1.0).kind == "match"
    assert choose([replace(busy, running=1, load=48.0), slow], 39, 3.3, cluster_share=1.0).kind == "idle"
    # prompts queued count one each where their number is known: a holder computing its first
    # prompt with more queued behind it is busy before anything decodes (a chat's first turns)
    assert choose([replace(busy, running=0, load=900.0), slow], 39, 3.3, cluster_share=1.0).kind == "match"
    assert choose([replace(busy, running=0, load=900.0, queued=3), slow], 39, 3.3, cluster_share=1.0).kind == "idle"
    assert choose([replace(busy, running=0, load=300.0, queued=1), slow], 39, 3.3, cluster_share=1.0).kind == "match"
    before = PlacementConfig(idle_counts_queued=False)  # the rule before session 28: queued prompts count one
    assert choose([replace(busy, running=0, load=900.0, queued=3), slow], 39, 3.3, before, cluster_share=1.0).kind == "match"
    # the worker must be idle, have room without evicting warm blocks, and cost <= one prefill more
    for other in (replace(slow, running=1), replace(slow, load=40.0), replace(slow, eviction=(3, 1, -5.0)),
                  replace(slow, ttft_s=1.2 + 3.3 + 0.1)):
        assert choose([busy, other], 39, 3.3, cluster_share=1.0).kind == "match"
    # a group not dominant on its holder keeps it (as the spill rule)
    assert choose([replace(busy, group_share=0.4), slow], 39, 3.3, cluster_share=1.0).kind == "match"


def test_a_busy_holder_of_a_short_prefix_is_relieved_by_a_worker_with_room():
    """Decode contention (``PlacementConfig.contention_weight``): a holder with four requests in
    flight and a worker with none that can pull the prompt's 5 blocks in 0.1 s more TTFT. Each
    request in flight costs 2 x 0.03 s x 15 output tokens = 0.9 s of decoding (the request's own
    and theirs), so the request goes where nothing decodes ("relieve"), paying the copy's room (2 x
    the prompt's 0.6 s prefill / 6 blocks per block added). Not with the term unknown, not onto a
    worker that would evict warm blocks, holds as many requests or has its pool filled with
    prefixes, and not for a long prefix, whose copy takes much room."""
    holder = WorkerView("w0", 0.6, 5, (0, 0, -50.0), running=3, queued=1, load=40.0)
    roomy = WorkerView("w1", 0.7, 0, (0, 0, -80.0), capacity=128, prefix_blocks=10,
                       candidate=Candidate("w1", "pulled", 0.7, 0.0, 0.6, 0.1, 0, 80))
    contention = 2 * 0.03 * 15
    p = choose([holder, roomy], 6, 0.6, contention_s=contention)
    assert (p.worker, p.kind) == ("w1", "relieve")
    assert choose([holder, roomy], 6, 0.6).kind == "match"  # no contention measured: TTFT alone
    assert choose([holder, roomy], 6, 0.6, PlacementConfig(contention_weight=0.0), contention_s=contention).kind == "match"
    for other in (replace(roomy, eviction=(2, 1, -5.0)), replace(roomy, running=4),
                  replace(roomy, prefix_blocks=120)):  # warm victims; as busy; no room for the copy
        assert choose([holder, other], 6, 0.6, contention_s=contention).kind == "match"
    # fewer requests in flight on the holder: the copy's room outweighs one request's contention
    assert choose([replace(holder, running=1, queued=0, load=0.0), roomy], 6, 0.6, contention_s=contention).kind == "match"
    # the steady sweep's 34-block prefix (3.3 s prefill): its copy's room (6.6 s) outweighs 4 in flight
    long_holder = replace(holder, local_blocks=34)
    long_roomy = replace(roomy, prefix_blocks=0)
    assert choose([long_holder, long_roomy], 34, 3.3, contention_s=contention).kind == "match"
    assert choose([long_holder, long_roomy], 34, 3.3, PlacementConfig(relief_copy_weight=0.0),
                  contention_s=contention).kind == "relieve"


def test_a_relief_copy_leaves_its_target_room_for_one_more_prefix_of_its_size():
    """``PlacementConfig.relief_room``: a relief copy is a second holder; it goes only to a worker
    whose prefixes stay within ``prefix_fill`` with room for another prefix as long, so that a
    group still to come is not left without room. The same worker with room for the copy alone
    takes it when the rule is off (``relief_room`` 1, the rule before session 39)."""
    holder = WorkerView("w0", 0.6, 5, (0, 0, -50.0), running=3, queued=1, load=40.0)
    target = WorkerView("w1", 0.7, 0, (0, 0, -80.0), capacity=128, prefix_blocks=10,
                        candidate=Candidate("w1", "pulled", 0.7, 0.0, 0.6, 0.1, 0, 80))
    contention = 2 * 0.03 * 15
    # 0.9 x 128 = 115.2 blocks of prefixes: 105 + 6 fits, 105 + 2 x 6 does not
    nearly_full = replace(target, prefix_blocks=105)
    assert choose([holder, target], 6, 0.6, contention_s=contention).kind == "relieve"
    assert choose([holder, nearly_full], 6, 0.6, contention_s=contention).kind == "match"
    p = choose([holder, nearly_full], 6, 0.6, PlacementConfig(relief_room=1.0), contention_s=contention)
    assert (p.worker, p.kind) == ("w1", "relieve")
    # blocks the target already holds need no room: 106 + 2 x 3 fits (106 + 2 x 6 would not)
    partly = replace(nearly_full, prefix_blocks=106, local_blocks=3)
    assert choose([holder, partly], 6, 0.6, contention_s=contention).kind == "relieve"


def test_decode_contention_scales_with_the_output_a_request_is_expected_to_produce():
    """``Placer.decide``: the contention term is 2 x ``row_s`` x (expected output - 1); a request
    capped at a few output tokens (``decode_tokens``) decodes too briefly to leave its holder."""
    workers = ["w0", "w1"]
    cm = _cost_model(workers)
    items = shared_prefix(groups=1, users=3, system_len=80, question_len=16, output_len=64, seed=5)
    placer = Placer(PlacementConfig(idle_slack=0.0))  # (one group is hot: the idle rule would take it)
    h = _route(placer, cm, items[0], workers, {}, {}, now=0.0).worker
    other = "w1" if h == "w0" else "w0"
    idx = {h: 80}
    cm.observe_load(h, WorkerLoad(running=4))

    def route(item, **kw):
        chains = prompt_chains(item.prompt_ids, BS, "m", [item.domain])
        pend = placer.pending_tokens(chains, idx, workers, len(item.prompt_ids), BS, 1.0)
        ranking = cm.rank(len(item.prompt_ids), idx, workers, pend)
        return placer.decide(item.prompt_ids, item.max_tokens, BS, chains, item.domain, idx, workers, {}, ranking,
                             1.0, reuse=False, running={h: 4, other: 0}, queued={h: 0, other: 0}, **kw)

    assert route(items[1]).kind == "match"  # nothing measured
    p = route(items[1], row_s=0.03)
    assert (p.worker, p.kind) == (other, "relieve")
    assert route(items[1], row_s=0.03, decode_tokens=2).kind == "match"
    assert placer.placements["relieve"] == 1


def test_the_pool_measures_how_much_each_sequence_beside_a_request_slows_its_tokens(monkeypatch):
    """The pool integrates each worker's decoding sequences over time; a request that ends reports
    the mean number that decoded beside it (itself included) with its seconds per output token to
    the router (``CostAwareRouter.observe_tpot``), whose fit (``row_s``) is the slope."""
    import types

    from cluster import pool as pool_mod
    from cluster.pool import PoolConfig, WorkerPool
    from cluster.routing import CostAwareRouter
    from cluster.types import WorkerState
    from engine.sequence import Request, SamplingParams

    seen = []

    class _Router(CostAwareRouter):
        def observe_tpot(self, rows, tpot_s):
            seen.append((round(rows, 6), round(tpot_s, 6)))
            super().observe_tpot(rows, tpot_s)

    cm = _cost_model(["w0"])
    router = _Router("m", BS, index=None, client=_FakeClient(cm), worker_lookup=lambda w: None, timeout_s=0.01)
    pool = WorkerPool(PoolConfig(), router=router)
    pool._ready.set()
    pool.workers["w0"] = WorkerState("w0", None, info={"num_blocks": 64})
    clock = types.SimpleNamespace(t=100.0)
    fake_time = types.SimpleNamespace(monotonic=lambda: clock.t, perf_counter=lambda: clock.t)

    def acquire(rid):
        asyncio.run(pool.acquire(Request(rid, tuple(range(1, 40)), SamplingParams(max_tokens=21), tenant="t")))

    def at(t, fn, *args, **kw):
        clock.t = t
        monkeypatch.setattr(pool_mod, "time", fake_time)
        try:
            fn(*args, **kw)
        finally:
            monkeypatch.undo()

    for rid in ("a", "b", "c"):
        acquire(rid)
    at(100.0, pool.mark_started, "a", "recomputed", 0.5)  # a decodes alone for 2 s: 20 tokens
    at(102.0, pool.release, "a", output_tokens=21)
    at(110.0, pool.mark_started, "b", "recomputed", 0.5)  # b and c decode together for 4 s
    at(110.0, pool.mark_started, "c", "recomputed", 0.5)
    at(114.0, pool.release, "b", output_tokens=21)
    at(114.0, pool.release, "c", output_tokens=21)
    assert seen == [(1.0, 0.1), (2.0, 0.2), (2.0, 0.2)]
    assert router.row_s > 0 and pool.workers["w0"].running == 0
    for _ in range(40):  # many more alike: the slope nears 0.1 s per token per sequence
        router.observe_tpot(1.0, 0.1)
        router.observe_tpot(2.0, 0.2)
    assert router.row_s == pytest.approx(0.1, rel=0.2)


def test_a_hot_groups_copies_follow_its_share_of_the_traffic():
    """A group gets another holder while its share of the cluster's traffic is worth more than
    the holders it has (share x workers >= holders + 0.5): half the traffic of 4 workers, 2."""
    def views(holders):
        return [WorkerView(f"w{i}", 1.0 if i < holders else 1.5, 39 if i < holders else 0, (0, 0, -10.0),
                           running=3 if i < holders else 0, group_share=1.0) for i in range(4)]

    assert choose(views(1), 39, 3.3, cluster_share=0.5).kind == "idle"
    assert choose(views(2), 39, 3.3, cluster_share=0.5).kind == "match"
    assert choose(views(3), 39, 3.3, cluster_share=1.0).kind == "idle"
    assert choose(views(1), 39, 3.3, cluster_share=0.3).kind == "match"  # 1.2 workers' worth: one holder


def test_the_placer_measures_a_groups_share_of_all_workers_traffic():
    placer = Placer(PlacementConfig(group_tau_s=10.0))
    assert placer.cluster_share({b"a"}, 0.0) is None  # nothing routed yet
    for k in range(6):
        placer.count_routed("w0", b"hot", float(k))
        placer.count_routed("w1", (b"hot", b"b")[k % 2], float(k))
    assert placer.cluster_share({b"hot"}, 6.0) == pytest.approx(9 / 12, abs=0.05)
    assert placer.cluster_share({b"b", b"z"}, 6.0) == pytest.approx(3 / 12, abs=0.05)  # the best of the keys
    for k in range(60):  # a minute of group b alone: hot's share fades
        placer.count_routed("w2", b"b", 10.0 + k)
    assert placer.cluster_share({b"hot"}, 70.0) < 0.01
    # the requests behind the share: 60 in the last minute, each weighing exp(-age / 10 s)
    assert placer.cluster_weight(70.0) == pytest.approx(sum(math.exp(-k / 10.0) for k in range(1, 61)), rel=0.02)
    assert Placer().cluster_weight(0.0) == 0.0


def test_a_hot_group_spreads_over_idle_workers_through_the_placer():
    """Through ``Placer.decide`` with the cost model: one group only, its holder decoding two
    sequences: the next request goes to an idle worker (it is then a holder there); with the
    holder decoding one, it stays."""
    workers = ["w0", "w1", "w2"]
    cm, placer = _cost_model(workers), Placer()
    items = shared_prefix(groups=1, users=6, seed=7)
    h = _route(placer, cm, items[0], workers, {}, {}, now=0.0).worker
    idx = {h: 592}

    def route(it, running, now):
        chains = prompt_chains(it.prompt_ids, BS, "m", [it.domain])
        pend = placer.pending_tokens(chains, idx, workers, len(it.prompt_ids), BS, now)
        ranking = cm.rank(len(it.prompt_ids), idx, workers, pend)
        return placer.decide(it.prompt_ids, it.max_tokens, BS, chains, it.domain, idx, workers, {}, ranking, now,
                             running=running)

    assert route(items[1], {h: 1}, 1.0).kind == "match"
    p = route(items[2], {h: 2}, 2.0)
    assert p.kind == "idle" and p.worker != h
    chain = prompt_chains(items[3].prompt_ids, BS, "m", [items[3].domain])[items[3].domain]
    assert placer.shadow(p.worker).match(chain) >= 37
    assert placer.placements["idle"] == 1


def _key(item):
    from policies.placement import leading_key

    chain = prompt_chains(item.prompt_ids, BS, "m", [item.domain])[item.domain]
    return leading_key(chain, item.prompt_ids, PlacementConfig().key_blocks)


def test_cost_model_counts_pending_as_local_never_as_a_pull_source():
    cm = _cost_model(["A", "B"])
    only_pending = cm.rank(640, {}, ["A", "B"], {"A": 592})
    best = {c.worker: c for c in only_pending}
    assert best["A"].kind == "local" and best["A"].local_tokens == 592
    assert best["B"].kind == "recomputed" and best["B"].pulls == ()  # nothing to pull from A yet


def test_the_count_of_workers_holding_a_block_follows_every_change_of_their_shadows():
    """A victim held elsewhere is not charged (``discount_held_elsewhere``); the Placer counts per
    block the shadows holding it instead of scanning them all per victim: the count and the answer
    stay those of a scan through touches, evictions, reconciles, resizes and removed workers; so
    do the holders of each chain's head, and the prompt holders found from them."""
    import random as _random

    from policies.placement import _private

    rng = _random.Random(5)
    placer = Placer(PlacementConfig())
    chains = [[bytes([g, i]) for i in range(12)] for g in range(6)]
    workers = ["a", "b", "c", "d"]
    for w in workers:
        placer.shadow(w, 20)

    def check():
        scan = Counter(k for s in placer.shadows.values() for k in s._lru if not _private(k))
        assert placer._holders == scan
        for w, own in placer.shadows.items():
            # a victim is held elsewhere iff another shadow holds it: the count's answer is the scan's
            def elsewhere(k, w=w):
                return any(k in s for v, s in placer.shadows.items() if v != w)
            for n in (1, 5, 12, 30):
                for warm_s in (3.0, 1e9):
                    assert (own.eviction_cost(n, float(step), warm_s, counted=True)
                            == own.eviction_cost(n, float(step), warm_s, elsewhere))
        # the chain heads' holders, by which a prompt's holders are found without visiting every shadow
        heads = {c[0]: {w for w, s in placer.shadows.items() if c[0] in s} for c in chains}
        assert placer._heads == {k: ws for k, ws in heads.items() if ws}
        for chain in chains:
            matched = {w: s.match(chain) for w, s in placer.shadows.items()}
            assert placer.pending({"t": chain}, None, workers, 0.0) == {w: n for w, n in matched.items() if n}

    for step in range(300):
        w = rng.choice(workers)
        op = rng.random()
        if op < 0.6:
            chain = rng.choice(chains)[:rng.randint(1, 12)]
            placer.commit(w, chain, rng.randint(0, 4), float(step), "t")
        elif op < 0.75 and w in placer.shadows:
            chain = rng.choice(chains)
            placer.shadows[w].reconcile(chain, rng.randint(0, len(chain)), float(step), 0.0)
        elif op < 0.9:
            placer.shadow(w, rng.choice([8, 20, 40]))
        else:
            placer.remove(w)
        check()


def test_a_short_list_keeps_the_prompts_holders_then_the_least_busy_drawn_per_group():
    from policies.placement import shortlist

    workers = [f"w{i}" for i in range(10)]
    assert shortlist(workers, {}, {}, b"k", 0) == workers and shortlist(workers, {}, {}, b"k", 10) == workers
    busy = {w: 3 for w in workers} | {"w7": 0, "w8": 1}
    short = shortlist(workers, {"w2": 4, "w5": 9}, busy, b"k", 4)
    assert short[:2] == ["w5", "w2"] and short[2:] == ["w7", "w8"]  # most held first, then the least busy
    # holders take at most 3/4 of the list: room stays for a spill or a relief
    many = shortlist(workers, {w: 5 for w in workers}, busy, b"k", 4)
    assert len(many) == 4 and many[:3] == ["w7", "w8", "w0"]
    # idle workers: each group draws its own (rendezvous order of its key), not the same few for all
    idle = {k: frozenset(shortlist(workers, {}, {}, bytes([k]), 3)) for k in range(40)}
    assert len(set(idle.values())) > 20
    assert all(len(v) == 3 for v in idle.values())


def test_the_router_ranks_and_places_over_a_short_list_that_keeps_the_groups_holder():
    """With ``max_candidates`` below the pool, a request's ranking and placement see only its short
    list: its group's holder stays on it (the group keeps its worker), and the router actor ranks
    only those workers."""
    from cluster.routing import CostAwareRouter
    from cluster.types import WorkerState

    states = [WorkerState(f"w{i}", None, info={"num_blocks": 48}) for i in range(6)]
    cm = _cost_model([w.worker_id for w in states])
    ranked = []

    class _Seen(_FakeClient):
        async def rank(self, prompt_tokens, holdings, workers, pending=None, shared=None):
            ranked.append(list(workers))
            return await super().rank(prompt_tokens, holdings, workers, pending, shared)
    router = CostAwareRouter("m", BS, index=None, client=_Seen(cm), worker_lookup=lambda w: None, timeout_s=0.01,
                             max_candidates=3)
    routed = _route_items(router, states, shared_prefix(groups=3, users=4, seed=4))
    where = _workers_by_group(routed)
    assert len(ranked) == len(routed) and all(c.worker_id in r for (_, c), r in zip(routed, ranked))
    assert all(len(r) == 3 for r in ranked)
    assert all(len(ws) == 1 for ws in where.values())  # every group stayed on its first worker


# -- the router in the pool, with fake index/router actors -------------------------------------
def _route_items(router, states, items, prefix="r"):
    """Route each item in turn (tenant "t"): [(item, RouteChoice)]."""
    from engine.sequence import Request, SamplingParams

    out = []
    for i, it in enumerate(items):
        req = Request(f"{prefix}{i}", it.prompt_ids, SamplingParams(max_tokens=it.max_tokens), tenant="t")
        out.append((it, asyncio.run(router.choose(req, states))))
    return out


def _workers_by_group(routed) -> dict[str, set]:
    where: dict[str, set] = {}
    for it, choice in routed:
        where.setdefault(it.group, set()).add(choice.worker_id)
    return where


class _FakeClient:
    def __init__(self, cm):
        self.cm, self.reports = cm, []

    async def rank(self, prompt_tokens, holdings, workers, pending=None, shared=None):
        return self.cm.rank(prompt_tokens, holdings, workers, pending, shared)

    def report(self, *args):
        self.reports.append(args)


def test_cost_aware_router_places_groups_and_counts_and_falls_back_without_actors():
    from cluster.routing import CostAwareRouter
    from cluster.types import WorkerState
    from engine.sequence import Request, SamplingParams

    states = [WorkerState(f"w{i}", None, info={"num_blocks": 48}) for i in range(4)]
    cm = _cost_model([w.worker_id for w in states])
    router = CostAwareRouter("m", BS, index=None, client=_FakeClient(cm), worker_lookup=lambda w: None,
                             timeout_s=0.01)
    items = shared_prefix(groups=4, users=3, seed=2)
    routed = _route_items(router, states, items)
    where = _workers_by_group(routed)
    assert all(c.placement in ("place", "match") for _, c in routed)
    assert all(len(ws) == 1 for ws in where.values()) and len(set().union(*where.values())) == 4
    assert router.placements == Counter({"place": 4, "match": 8})
    # without the router actor (rank answers None): placement on the pool's loads, same grouping
    class _Silent(_FakeClient):
        async def rank(self, *a, **k):
            return None
    lone = CostAwareRouter("m", BS, index=None, client=_Silent(cm), worker_lookup=lambda w: None, timeout_s=0.01)
    chosen = []
    for i, it in enumerate(items[:6]):
        req = Request(f"s{i}", it.prompt_ids, SamplingParams(max_tokens=it.max_tokens), tenant="t")
        chosen.append((it.group, asyncio.run(lone.choose(req, states))))
    by_group = {}
    for g, c in chosen:
        by_group.setdefault(g, set()).add(c.worker_id)
    assert all(len(ws) == 1 for ws in by_group.values())
    assert all(k.endswith("-fallback") for k in lone.placements)


# -- the replay against the oracle ------------------------------------------------------------
def test_simulated_issue_sizing_reaches_95_percent_of_the_oracle():
    """4 workers, 4 groups x 6 users (600-token system prompts, 40-token questions, 16 output
    tokens), 3 rounds, distinct prefixes = 3.5x one worker's pool: kvmesh's placement reaches
    >= 95% of an infinite cache's hit tokens, cache-blind routing does not come close."""
    items, cfg = issue_sizing(workers=4, prefix_over_pool=3.5, rounds=3, seed=0)
    res = {r: simulate(items, r, cfg) for r in ("kvmesh", "round_robin", "pow2", "affinity")}
    k = res["kvmesh"]
    assert k["hit_vs_oracle"] >= 0.95
    assert all(len(ws) == 1 for ws in k["groups"].values())  # each group on one worker
    assert len({w for ws in k["groups"].values() for w in ws}) == 4  # spread over the workers
    assert sum(k["evictions"].values()) * 5 < sum(res["round_robin"]["evictions"].values())
    assert res["round_robin"]["hit_vs_oracle"] < 0.5 and res["pow2"]["hit_vs_oracle"] < 0.5


@pytest.mark.parametrize("workers,groups", [(2, 4), (3, 6), (4, 8)])
def test_simulated_groups_partition_over_2_to_4_workers(workers, groups):
    """Pools sized for ``groups / workers`` groups each (+ a little): every group's requests go
    to one worker, the workers share the groups evenly, few evictions, >= 95% of the oracle."""
    per = groups // workers
    items, cfg = issue_sizing(workers=workers, groups=groups, prefix_over_pool=groups / (per * 1.15), rounds=2, seed=1)
    k = simulate(items, "kvmesh", cfg)
    assert k["hit_vs_oracle"] >= 0.95
    assert all(len(ws) == 1 for ws in k["groups"].values())
    homes = Counter(next(iter(ws)) for ws in k["groups"].values())
    assert sorted(homes.values()) == [per] * workers
    rr = simulate(items, "round_robin", cfg)
    assert sum(k["evictions"].values()) * 4 < sum(rr["evictions"].values())


def test_simulation_refuses_a_pool_smaller_than_one_request():
    items, cfg = issue_sizing(workers=4, prefix_over_pool=6.0)  # 1.5 pools per prefix: cannot be cached
    with pytest.raises(ValueError, match="blocks"):
        simulate(items, "kvmesh", SimConfig(**{**cfg.__dict__}))


def test_a_tenant_uses_its_own_and_the_shared_workers_and_idle_ones_of_other_tenants():
    """Issue 11's run: with one tenant whose demand asked for one worker, the pool sent every
    request to that worker and left the other idle. Own + shared workers are candidates; another
    tenant's worker is lent only while it is idle (session 20: 4 tenants on 4 workers were each
    confined to one, their KV elsewhere, while a tenant without a worker could use all four)."""
    from cluster.pool import PoolConfig, WorkerPool
    from cluster.types import WorkerState

    pool = WorkerPool(PoolConfig(lend_workers="idle"))
    for wid, tenant in (("w0", "acme"), ("w1", None), ("w2", "globex"), ("w3", None)):
        pool.workers[wid] = WorkerState(wid, None, info={}, tenant=tenant)

    def ids(tenant):
        return [w.worker_id for w in pool.candidates(tenant)]

    assert ids("acme") == ["w0", "w1", "w3", "w2"]  # globex's w2 idles: lent, after its own and the shared
    pool.workers["w2"].inflight = 1  # anyone's request there (its owner's, or a guest's): not lent
    assert ids("acme") == ["w0", "w1", "w3"] and ids("other") == ["w1", "w3", "w0"]
    pool.workers["w1"].tenant = pool.workers["w3"].tenant = "globex"
    pool.workers["w1"].inflight = pool.workers["w3"].inflight = 2
    assert ids("acme") == ["w0"]
    pool.workers["w2"].inflight = 0
    assert ids("acme") == ["w0", "w2"]  # globex's idle w2 is lent, its busy w1 and w3 are not
    pool.workers["w0"].inflight = pool.workers["w2"].inflight = 1
    assert ids("globex") == ["w1", "w2", "w3"]
    assert ids("other") == ["w0", "w1", "w2", "w3"]  # none of its own, shared or idle: any


def test_a_busy_workers_owner_lends_it_while_nobody_waits_there_for_a_first_token():
    """The default (``lend_workers`` "unqueued", session 22): another tenant's worker whose
    requests are all decoding is lent; one with a request waiting for its first token (the
    owner's or a guest's) is not, so at most one guest prefill is ahead of the owner's next
    request. "never" fences the others out."""
    from cluster.pool import PoolConfig, WorkerPool
    from cluster.types import WorkerState

    pool = WorkerPool(PoolConfig())
    for wid, tenant in (("w0", "acme"), ("w1", "globex")):
        pool.workers[wid] = WorkerState(wid, None, info={}, tenant=tenant)
    globex = pool.workers["w1"]

    def ids(tenant):
        return [w.worker_id for w in pool.candidates(tenant)]

    globex.inflight, globex.running = 3, 3  # three of globex's requests decoding, none waiting
    assert ids("acme") == ["w0", "w1"]
    globex.queued["g4"] = 500  # one of globex's own waits for its first token: not lent
    assert ids("acme") == ["w0"]
    del globex.queued["g4"]
    globex.queued["a9"] = 40  # a guest routed there waits: no second guest
    assert ids("acme") == ["w0"]
    del globex.queued["a9"]
    pool.config = PoolConfig(lend_workers="never")
    assert ids("acme") == ["w0"] and ids("other") == ["w0", "w1"]  # none of its own: any


class _FoundIndex:
    """The index actor's ``lookup``, answering ``found`` (tokens per worker) for any prompt."""

    def __init__(self, found):
        self.found = found

    def lookup(self, chains):
        return dict(self.found)


def test_a_worker_not_lent_takes_another_tenants_request_that_finds_its_prompt_there():
    """The cluster bench's multi-tenant mix (sessions 25-26): acme's prefix sat on a worker since
    assigned to another tenant, with a request waiting there (not lent, ``lend_workers``
    "unqueued"), so acme's next request recomputed its 400-token prefix elsewhere. A request
    that finds all but ``lend_hit_tokens`` of its prompt on such a worker may go there (a short
    prefill ahead of the owner's next request); one that would compute more may not."""
    from cluster.pool import PoolConfig, WorkerPool
    from cluster.routing import CostAwareRouter
    from cluster.types import HitLoan, WorkerState
    from engine.sequence import Request, SamplingParams

    prompt = list(range(1000, 1640))  # 640 tokens; the fenced worker holds 624 of them

    def run(found, lend_hit_tokens=64, mode="unqueued"):
        states = {"w0": WorkerState("w0", None, info={"num_blocks": 256}, tenant="acme"),
                  "w1": WorkerState("w1", None, info={"num_blocks": 256}, tenant="globex")}
        states["w1"].queued["g1"] = 40  # globex's own request waits there for its first token
        states["w1"].inflight = 1
        router = CostAwareRouter("m", BS, index=Handle(_FoundIndex(found)), client=_FakeClient(_cost_model(list(states))),
                                 worker_lookup=states.get, timeout_s=1.0)
        pool = WorkerPool(PoolConfig(lend_hit_tokens=lend_hit_tokens, lend_workers=mode), router=router)
        pool._ready.set()
        pool.workers.update(states)
        assert [w.worker_id for w in pool.candidates("acme")] == ["w0"]  # w1 is not lent
        req = Request("a1", prompt, SamplingParams(max_tokens=4), tenant="acme")
        ws, choice = asyncio.run(pool.acquire(req))
        return ws.worker_id, choice

    wid, choice = run({"w1": 624})
    assert wid == "w1" and choice.route == "local" and choice.cached_tokens == 624
    wid, choice = run({"w1": 624}, lend_hit_tokens=0)  # off: as before, on w0 (the prefix pulled there or recomputed)
    assert wid == "w0" and choice.route in ("pulled", "recomputed")
    wid, _ = run({"w1": 320})  # 320 tokens to compute there: more than a short prefill, not lent
    assert wid == "w0"
    wid, _ = run({"w1": 624}, mode="never")  # an assignment that fences the others out holds
    assert wid == "w0"
    loan = HitLoan((WorkerState("w1", None, info={}),), 64)
    assert [w.worker_id for w in loan.admits({"w1": 576}, 640)] == ["w1"]
    assert loan.admits({"w1": 575}, 640) == [] and loan.admits(None, 640) == []
    assert loan.covers(576, 640) and not loan.covers(0, 40) and not HitLoan((), 0).covers(640, 640)


# -- p(reuse): warm evictions charged at how often they are needed again ----------------------
def test_reuse_estimate_counts_ghosts_asked_before_their_deadline():
    from policies.placement import ReuseEstimate

    r = ReuseEstimate(warm_s=30.0, prior=(1.0, 1.0))
    assert r.p == 0.5
    for i in range(10):
        r.evicted(b"g%d" % i, last_used=0.0, now=5.0)  # warm when dropped: ghosts until t=30
    r.evicted(b"cold", last_used=0.0, now=40.0)  # cold when dropped: no loss, not a ghost
    r.evicted(("private", 7), last_used=5.0, now=5.0)  # nobody asks for a private block
    assert len(r) == 10
    r.asked([b"g0", b"g1", b"g2", b"other"], now=10.0)  # asked for again in time: reuses
    assert (r.reused, r.unused) == (3.0, 0.0) and len(r) == 7
    r.asked([b"g3"], now=31.0)  # past its deadline: g3..g9 resolve as not reused first
    assert (r.reused, r.unused) == (3.0, 7.0) and len(r) == 0
    assert r.p == pytest.approx(4 / 12)


def test_reuse_estimate_forgets_so_it_follows_the_workload():
    from policies.placement import ReuseEstimate

    r = ReuseEstimate(warm_s=1.0, prior=(1.0, 1.0), window=20.0)
    for i in range(100):  # nothing is ever asked again
        r.evicted(i, last_used=float(i), now=float(i))
        r.expire(float(i) + 2.0)
    low = r.p
    assert low < 0.1 and r.reused + r.unused <= 20.0 + 1e-9
    for i in range(100, 200):  # now every eviction is asked for again
        r.evicted(i, last_used=float(i), now=float(i))
        r.asked([i], now=float(i) + 0.5)
    assert r.p > 0.9
    with pytest.raises(ValueError):
        ReuseEstimate(1.0, prior=(0.0, 1.0))


def test_with_reuse_measured_low_a_new_prefix_evicts_on_an_idle_worker_rather_than_queue():
    # w0: room for the prompt but 1.0 s of queue (within the slack of one 0.6 s prefill);
    # w1: idle, but must evict 30 warm blocks (of 37) to take it
    busy_roomy = view("w0", 1.1, eviction=(0, 0, -5.0), load=600.0)
    idle_full = view("w1", 0.6, eviction=(30, 1, -1.0))
    assert choose([busy_roomy, idle_full], 37, 0.6, reuse_p=1.0).worker == "w0"  # evictions ~ certain loss
    assert choose([busy_roomy, idle_full], 37, 0.6).worker == "w0"  # p defaults to 1 without a measure
    p = choose([busy_roomy, idle_full], 37, 0.6, reuse_p=0.2)  # 0.6 + 0.2 x 30 x 0.6/37 < 1.1
    assert (p.kind, p.worker) == ("place", "w1")
    assert choose([busy_roomy, idle_full], 37, 0.6, PlacementConfig(reuse_prob=0.2)).worker == "w1"


def test_with_reuse_measured_low_a_hot_holder_spills_sooner():
    holder = view("w0", 1.2, local=37)  # 2 x the pull elsewhere, which evicts 37 warm blocks
    pull = WorkerView("w1", 0.6, 0, (37, 1, -1.0), reused_blocks=37)
    assert choose([holder, pull], 37, 0.6, reuse_p=1.0).kind == "match"  # 1.2 < (0.6 + 0.6) x 1.5 + 0.05
    assert choose([holder, pull], 37, 0.6).kind == "match"  # the default p(reuse) is 1
    s = choose([holder, pull], 37, 0.6, reuse_p=0.1)  # 1.2 > (0.6 + 0.06) x 1.5 + 0.05
    assert (s.kind, s.worker) == ("spill", "w1")


def test_warm_blocks_another_worker_holds_are_not_charged():
    s = ShadowCache(10)
    s.touch([b"x%d" % i for i in range(6)], private_blocks=2, now=0.0)  # LRU: 2 private, x5..x0
    assert s.eviction_cost(6, 1.0, 30.0)[0] == 2  # victims: 2 private (never asked for) + x5, x4 (warm)
    assert s.eviction_cost(6, 1.0, 30.0, held_elsewhere=lambda k: k == b"x5")[0] == 1
    placer = Placer()
    for w in ("w0", "w1"):
        placer.shadow(w, 10)
    chain = [b"x%d" % i for i in range(6)]
    placer.commit("w0", chain, 2, now=0.0)
    placer.commit("w1", chain[:5], 0, now=0.0)  # w1 holds x0..x4 too
    (v,) = placer.views(None, ["w0"], {}, 6, {}, b"k", now=1.0)
    assert v.eviction[0] == 1  # only x5 would be lost; x4 can be pulled back from w1
    no_discount = Placer(PlacementConfig(discount_held_elsewhere=False))
    for w in ("w0", "w1"):
        no_discount.shadow(w, 10)
    no_discount.commit("w0", chain, 2, now=0.0)
    no_discount.commit("w1", chain[:5], 0, now=0.0)
    assert no_discount.views(None, ["w0"], {}, 6, {}, b"k", now=1.0)[0].eviction[0] == 2


def test_the_placer_measures_reuse_from_its_own_evictions():
    """Fresh groups that never return (each stage of the cluster bench): the evicted warm blocks
    are never asked for again, so the measured p falls below the prior's 0.5; a group that
    keeps coming back after its eviction raises it."""
    workers = ["w0"]
    cm, placer = _cost_model(workers), Placer(PlacementConfig(warm_s=10.0))
    placer.shadow("w0", 48)
    t = 0.0
    for g in range(12):  # a new group every 2 s on a pool of one group: each evicts the last
        (it,) = shared_prefix(groups=1, users=1, seed=100 + g)
        _route(placer, cm, it, workers, {}, {}, now=t)
        t += 2.0
    placer.reuse.expire(t + 20.0)
    assert placer.reuse.p < 0.4
    fresh = Placer(PlacementConfig(warm_s=10.0))
    fresh.shadow("w0", 48)
    a, b = (shared_prefix(groups=1, users=8, seed=s) for s in (1, 2))
    for i in range(8):  # two groups alternate on a pool of one: each asks for what the other evicted
        _route(fresh, cm, a[i], workers, {}, {}, now=4.0 * i)
        _route(fresh, cm, b[i], workers, {}, {}, now=4.0 * i + 2.0)
    assert fresh.reuse.p > 0.6
    assert fresh.reuse_p == 1.0  # measured, but decisions use the configured p unless told otherwise
    assert Placer(PlacementConfig(reuse_prob=None)).reuse_p == 0.5  # the prior's mean before any ghost


def test_a_burst_of_new_prompts_ranked_at_once_spreads_over_the_workers():
    """Prompts that arrive together are ranked on the same loads (the router actor answers each
    before any is routed), so every ranking shows the same fastest worker. The placer adds the
    prompts routed meanwhile (the pool's queue since the ranking's loads) to each worker's TTFT:
    without that, all 8 here go to the fastest worker (the cluster bench's warm-up, session 25: 5
    of 8 on one)."""
    from cluster.pool import PoolConfig, WorkerPool
    from cluster.routing import CostAwareRouter
    from cluster.types import WorkerState
    from engine.sequence import Request, SamplingParams

    states = [WorkerState(f"w{i}", None, info={"num_blocks": 512}) for i in range(4)]  # room for all 8
    cm = _cost_model([w.worker_id for w in states])
    for n in (64, 128, 256, 512) * 8:  # w0 prefills about twice as fast: every ranking of an idle pool puts it first
        for w in states:
            cm.observe_prefill(w.worker_id, n, (0.5 if w.worker_id == "w0" else 1.0) * (0.02 + n / 1000))

    class _AllAtOnce(_FakeClient):  # every ranking is computed before any request is routed
        def __init__(self, cm, n):
            super().__init__(cm)
            self.n, self.arrived, self.go = n, 0, asyncio.Event()

        async def rank(self, *args, **kwargs):
            ranking = await super().rank(*args, **kwargs)
            self.arrived += 1
            if self.arrived == self.n:
                self.go.set()
            await self.go.wait()
            return ranking

        def report(self, method, *args):
            super().report(method, *args)
            if method == "report_load":
                self.cm.observe_load(*args)

    def burst(unranked: bool) -> Counter:
        client = _AllAtOnce(cm, 8)
        for w in states:
            w.queued.clear()
            cm.observe_load(w.worker_id, WorkerLoad())
        router = CostAwareRouter("m", BS, index=None, client=client, worker_lookup=lambda w: None, timeout_s=0.01)
        if not unranked:  # the placer as it was: the stale ranking only
            decide = router.placer.decide
            router.placer.decide = lambda *a, **k: decide(*a, **{**k, "unranked": None})
        pool = WorkerPool(PoolConfig(), router=router)
        pool._ready.set()
        for w in states:
            pool.workers[w.worker_id] = w
        items = shared_prefix(groups=8, users=1, system_len=400, question_len=16, seed=7)

        async def main():
            return await asyncio.gather(*(pool.acquire(Request(f"r{i}", it.prompt_ids, SamplingParams(max_tokens=4),
                                                               tenant="t")) for i, it in enumerate(items)))
        return Counter(ws.worker_id for ws, _ in asyncio.run(main()))

    spread = burst(unranked=True)
    assert len(spread) == 4 and max(spread.values()) <= 3
    assert max(burst(unranked=False).values()) >= 5  # what the stale ranking did


def test_a_workers_load_is_taken_again_when_its_requests_change_or_it_grew_stale(monkeypatch):
    """Every routed request publishes the candidates' loads; a worker's KV signal (``kv_use``
    over its requests in flight) is computed again only for a worker whose requests in flight
    changed, or once ``LOAD_REFRESH_S`` passed: the rest are the loads the router actor has. Which
    blocks each request holds (``kv_counted``) is taken again only when the requests change; a
    worker that leaves the pool leaves nothing with the router."""
    import cluster.routing as routing
    from cluster.routing import CostAwareRouter
    from cluster.types import InFlight, WorkerState

    taken, counted = [], []
    real, real_counted = routing.kv_use, routing.kv_counted

    def counting(flights, tpot_s, block_size, *rest):
        taken.append(len(flights))
        return real(flights, tpot_s, block_size, *rest)

    def counting_shares(flights):
        counted.append(len(flights))
        return real_counted(flights)
    monkeypatch.setattr(routing, "kv_use", counting)
    monkeypatch.setattr(routing, "kv_counted", counting_shares)
    clock = [100.0]
    monkeypatch.setattr(routing.time, "monotonic", lambda: clock[0])
    states = [WorkerState(f"w{i}", None, info={"num_blocks": 64}) for i in range(3)]
    for i, w in enumerate(states):
        w.tpot_s, w.output_tokens = 0.1, 16.0
        w.flights = {f"f{i}{k}": InFlight("t", w.worker_id, 100, 16, blocks=(b"x%d" % i,), started_at=99.0)
                     for k in range(2)}
        w.running = 2
    client = _FakeClient(None)
    router = CostAwareRouter("m", BS, index=None, client=client, worker_lookup=lambda w: None)

    def published():
        out = [a[1] for a in client.reports if a[0] == "report_load"]
        client.reports.clear()
        return out
    assert router._publish_loads(states, (b"x1",)) == {"w1": BS}
    assert len(taken) == 3 and published() == ["w0", "w1", "w2"]
    clock[0] += 0.05  # nothing changed: nothing taken, nothing sent, the same blocks held
    assert router._publish_loads(states, (b"x1",)) == {"w1": BS}
    assert len(taken) == 3 and published() == []
    states[1].flights["n"] = InFlight("t", "w1", 50, 16)  # a request routed to w1
    states[1].queued["n"] = 50
    router._publish_loads(states)
    assert len(taken) == 4 and published() == ["w1"] and router._published["w1"].waiting_tokens == (50,)
    assert counted == [2, 2, 2, 3]  # which blocks each request holds: taken for w1's new set of requests
    clock[0] += routing.LOAD_REFRESH_S  # stale: every signal taken again (their times moved on)
    router._publish_loads(states)
    assert len(taken) == 7 and published() == ["w0", "w1", "w2"]
    assert counted == [2, 2, 2, 3]  # ... but not for time alone: the same requests hold the same blocks
    states[0].queued.clear()
    states[0].flights["f00"].started_at = None  # (as if) f00 had not started: the order they are counted in changes
    states[0].running = 1
    router._publish_loads(states)
    assert counted == [2, 2, 2, 3, 2] and published() == ["w0"]
    router.remove("w2")  # the worker left the pool: nothing of it stays with the router
    assert all("w2" not in d for d in (router._published, router._kv_taken, router._kv_flights, router.placer.shadows))
    states.pop()
    router.forget_published()  # the router actor restarted: every load sent again
    router._publish_loads(states)
    assert published() == ["w0", "w1"]


def test_a_holder_whose_kv_pool_is_full_spills_its_group_and_the_pool_learns_what_memory_frees():
    """The router publishes each worker's KV memory from the requests the pool has in flight
    there (``WorkerState.flights``) once it knows the worker's seconds per output token, which
    the pool learns from requests that ended. A group's next request leaves a holder whose pool is
    full of other requests for seconds; a holder with room keeps it."""
    import time as _time

    from cluster.pool import PoolConfig, WorkerPool
    from cluster.routing import CostAwareRouter
    from cluster.types import InFlight, WorkerState
    from engine.sequence import Request, SamplingParams

    states = [WorkerState(f"w{i}", None, info={"num_blocks": 48}) for i in range(2)]  # 768 tokens each
    cm = _cost_model([w.worker_id for w in states])

    class _Loads(_FakeClient):  # the router actor applies published loads
        def report(self, method, *args):
            super().report(method, *args)
            if method == "report_load":
                self.cm.observe_load(*args)
    client = _Loads(cm)
    # (no idle spill: a hot group's spill to an idle worker is another rule, for busy holders with room)
    router = CostAwareRouter("m", BS, index=None, client=client, worker_lookup=lambda w: None, timeout_s=0.01,
                             placement=PlacementConfig(idle_slack=0.0))
    pool = WorkerPool(PoolConfig(), router=router)
    pool._ready.set()
    for w in states:
        pool.workers[w.worker_id] = w
    items = shared_prefix(groups=2, users=2, system_len=320, question_len=16, seed=3)

    def request(i, it, max_tokens=16):
        return Request(f"r{i}", it.prompt_ids, SamplingParams(max_tokens=max_tokens), tenant="t")

    # the pool learns seconds per output token and output size from a request that ended
    first = asyncio.run(pool.acquire(request(0, items[0])))[0]
    pool.mark_started("r0", "recomputed", 0.5)
    first.flights["r0"].started_at = _time.monotonic() - 1.5  # its first token came 1.5 s ago
    pool.release("r0", output_tokens=16)
    assert first.tpot_s == pytest.approx(0.1, rel=0.05) and first.output_tokens == 16
    assert first.flights == {} and first.inflight == 0

    # the group's holder (where r0 ran) with one other request decoding: room left, the group stays
    holder = first
    other = next(w for w in states if w is not holder)
    g0 = [it for it in items if it.group == items[0].group]
    now = _time.monotonic()
    holder.flights.update({"x0": InFlight("t", holder.worker_id, 330, 16, blocks=("other0",), started_at=now)})
    holder.running = 1
    assert asyncio.run(router.choose(request(1, g0[1]), states)).worker_id == holder.worker_id
    # a second one: full (768 tokens hold two 336-token requests, not three) for ~1.5 s more. With
    # the memory signal off (app argument router_kv_memory=false) the router does not see it
    holder.flights.update({"x1": InFlight("t", holder.worker_id, 330, 16, blocks=("other1",), started_at=now)})
    holder.running = 2
    router.kv_memory = False
    assert asyncio.run(router.choose(request(2, g0[1]), states)).worker_id == holder.worker_id
    assert cm.loads[holder.worker_id].kv_tokens == 0
    # on (the default): the group's next request goes where there is room
    router.kv_memory = True
    choice = asyncio.run(router.choose(request(3, g0[1]), states))
    load = cm.loads[holder.worker_id]
    assert load.kv_tokens == 768 and len(load.kv_running) == 2
    assert choice.worker_id == other.worker_id and choice.route == "recomputed"
    assert choice.options[holder.worker_id]["kv_wait_s"] > 1.0


def test_a_request_on_a_lent_worker_is_sent_there_as_a_guest():
    """``PoolConfig.guests_yield``: a request routed to a worker assigned to another tenant
    carries ``Request.guest`` to the worker (its engine schedules it below the owner's classes);
    on its own or a shared worker it does not; off (the default), nobody is a guest."""
    from cluster.pool import PoolConfig, WorkerPool, stream_outputs
    from cluster.types import LeastLoadedRouter, WorkerState
    from engine.sequence import Request, RequestOutput, SamplingParams

    sent = []

    class _Gen:
        def __init__(self, out):
            self.out = out

        def __aiter__(self):
            return self

        async def __anext__(self):
            if self.out is None:
                raise StopAsyncIteration
            out, self.out = self.out, None

            async def ref():
                return out
            return ref()

    class _Actor:
        class generate:  # noqa: N801 - a Ray method's shape: generate.remote(...)
            @staticmethod
            def remote(request, pulls, donor_pulls):
                sent.append(request)
                return _Gen(RequestOutput(request.request_id, [1], "x", True, "length", 4, 0, 1))

    def run(config, owner):
        pool = WorkerPool(config, router=LeastLoadedRouter())
        pool._ready.set()
        pool.workers["w0"] = WorkerState("w0", _Actor(), info={}, tenant=owner)
        req = Request(f"r{len(sent)}", (1, 2, 3, 4), SamplingParams(max_tokens=1), tenant="acme")

        async def go():
            ws, choice = await pool.acquire(req)
            outs = [o async for o in stream_outputs(ws.actor, ws.worker_id, req, choice)]
            pool.release(req.request_id)
            return choice, outs
        choice, outs = asyncio.run(go())
        assert outs and outs[-1].finished
        return choice.guest, sent[-1].guest

    on = PoolConfig(guests_yield=True)
    assert run(on, "globex") == (True, True)  # globex's worker, lent to acme
    assert run(on, "acme") == (False, False)  # its own
    assert run(on, None) == (False, False)  # shared
    assert run(PoolConfig(), "globex") == (False, False)


def test_a_new_worker_is_calibrated_before_it_is_routable_and_the_router_gets_the_samples(monkeypatch):
    """``PoolConfig.calibrate_prefill`` (default): between ``ready`` and becoming routable the pool
    asks the worker for its timed prefills and reports them to the router; a worker that cannot
    calibrate still serves; off, nobody is asked."""
    from cluster.pool import PoolConfig, WorkerPool
    from cluster.types import WorkerState

    def run(config, calibrate):
        pool = WorkerPool(config)
        seen = {}

        async def coro(v):
            return v

        class _Actor:
            class ready:  # noqa: N801 - a Ray method's shape
                @staticmethod
                def remote():
                    return coro({"node_id": "n", "block_size": 16})

        class _Calibrating(_Actor):
            class calibrate:  # noqa: N801
                @staticmethod
                def remote():
                    seen["routable_while_calibrating"] = ws.routable
                    if calibrate == "fails":
                        raise RuntimeError("engine loop died")
                    return coro([(32, 0.25), (256, 1.75)])

        ws = WorkerState("w0", _Calibrating() if calibrate else _Actor())
        pool.workers["w0"] = ws
        client = _FakeClient(None)

        async def join(w):
            pool._router_client = client
        monkeypatch.setattr(pool, "_join_cluster_routing", join)
        asyncio.run(pool._await_ready(ws))
        assert ws.routable
        return seen.get("routable_while_calibrating"), [r for r in client.reports if r[0] == "report_prefill"]

    cfg = PoolConfig(health_interval_s=0)
    routable, reports = run(cfg, True)
    assert routable is False  # not routed to while it calibrates
    assert reports == [("report_prefill", "w0", 32, 0.25, 0), ("report_prefill", "w0", 256, 1.75, 0)]
    assert run(cfg, "fails") == (False, [])  # no samples: the prior, as before
    assert run(cfg, False) == (None, [])  # a worker without the method (older): still serves
    assert run(PoolConfig(health_interval_s=0, calibrate_prefill=False), True) == (None, [])


def test_the_shadow_counts_prefixes_not_the_questions_asked_once():
    """``ShadowCache.prefix_blocks``: a new group's first prompt counts whole; a later prompt of
    the group adds only its matched blocks (already counted), not its new tail (a user's question,
    asked once), unless a later prompt asks for that tail too; a first prompt nobody repeats stops
    counting ``seed_s`` after it (a one-off); eviction and reconcile drop them."""
    s = ShadowCache(64, seed_s=30.0)
    system = [b"s%d" % i for i in range(8)]
    s.touch(system + [b"q0"], private_blocks=1, now=0.0)
    assert s.prefix_blocks(0.0) == 9 and s.shared == 9
    for i in range(1, 4):
        s.touch(system + [b"q%d" % i], private_blocks=1, now=float(i))
    assert s.prefix_blocks(4.0) == 9 and s.shared == 12  # three questions held, none a prefix
    s.touch(system + [b"q2", b"more"], private_blocks=0, now=5.0)  # q2 asked again (a second turn)
    assert s.prefix_blocks(5.0) == 10
    s.touch([b"once%d" % i for i in range(4)], private_blocks=0, now=20.0)  # a prompt matching nothing
    assert s.prefix_blocks(20.0) == 14
    # 30 s after each: q0 (the first prompt's tail) and the one-off are no prefix; the system
    # prompt and q2, asked for again, still are
    assert s.prefix_blocks(50.1) == 9 and s.shared == 17
    s.reconcile(system + [b"q2"], 8, now=100.0, lag_s=30.0)  # the index no longer shows q2
    assert s.prefix_blocks(100.0) == 8
    small = ShadowCache(10)
    small.touch(system, private_blocks=0, now=0.0)
    small.touch([b"x%d" % i for i in range(6)], private_blocks=0, now=1.0)  # evicts 4 of system
    assert small.prefix_blocks(1.0) == 10 and len(small) == 10


def test_a_tenant_that_stopped_sending_reserves_no_room():
    """``DomainActivity``: a domain is idle once nothing came from it for ``gaps`` x its mean
    interval (after ``min_requests``); ``ShadowCache.prefix_blocks`` leaves out the prefixes and
    first prompts of idle domains, and counts them again when the domain sends again. Through
    ``Placer``: a tenant's prompts fill w0 with prefixes; while it sends, another tenant's new
    group goes to the slower w1 (the fill guard); seconds after it stopped, to the faster w0."""
    act = DomainActivity(gaps=4.0, min_requests=4)
    for t in (0.0, 1.0, 2.0, 3.0):
        act.observe("mix", t)
    act.observe("once", 0.0)
    assert act.idle(6.9) == frozenset() and act.idle(7.1) == {"mix"}  # 4 x 1 s after its last
    act.observe("mix", 7.2)
    assert act.idle(7.3) == frozenset()
    assert DomainActivity(gaps=0.0).idle(1e9) == frozenset()

    s = ShadowCache(64, seed_s=100.0)
    s.touch([b"a%d" % i for i in range(6)], 0, now=0.0, domain="mix")  # seeded
    s.touch([b"b%d" % i for i in range(4)], 0, now=0.0, domain="mix")
    s.touch([b"b%d" % i for i in range(4)], 0, now=1.0, domain="mix")  # a prefix
    s.touch([b"c%d" % i for i in range(3)], 0, now=1.0, domain="bench")
    assert s.prefix_blocks(2.0) == 13 and s.prefix_blocks(2.0, {"mix"}) == 3
    assert s.resized(32).prefix_blocks(2.0, {"mix"}) == 3

    def placed(now: float, mix_sends_until: float) -> str:
        placer = Placer()
        for w in ("w0", "w1"):
            placer.shadow(w, 64)
        for k in range(16):  # one prompt a second, a new 3-block prefix each, all placed on w0
            t = float(k) * mix_sends_until / 15
            placer.domains.observe("mix", t)
            placer.commit("w0", [b"m%d-%d" % (k, i) for i in range(3)], 0, now=t, domain="mix")
        ranking = [Candidate("w0", "recomputed", 1.0, 0.0, 1.0, 0.0, 0, 0),
                   Candidate("w1", "recomputed", 1.6, 0.6, 1.0, 0.0, 0, 0)]
        return placer.decide(list(range(200)), 16, 16, {"bench": [b"x%d" % i for i in range(12)]}, "bench", {},
                             ["w0", "w1"], {"w0": 0.0, "w1": 0.0}, ranking, now=now).worker

    assert placed(16.0, 15.0) == "w1"  # 48 prefix blocks of 64: 12 more pass the fill line (57.6)
    assert placed(25.0, 15.0) == "w0"  # 10 s of silence after one prompt a second

    # a grantee's prompts, which may read the grantor's domain, keep it in use
    placer = Placer()
    for k in range(8):
        placer.decide(list(range(40)), 4, 16, {"grantee": [b"g%d" % k], "mix": [b"m%d" % k]}, "grantee", {},
                      ["w0"], {"w0": 0.0}, None, now=float(k))
    assert placer.domains.idle(9.0) == frozenset() and placer.domains.idle(20.0) == {"grantee", "mix"}


def test_a_placer_stops_counting_one_off_prompts_as_prefixes_after_prefix_seed_s():
    placer = Placer(PlacementConfig(prefix_seed_s=60.0))
    placer.shadow("w0", 48)
    placer.commit("w0", [b"a%d" % i for i in range(40)], 0, now=0.0)  # a prompt that matched nothing

    def prefixes(now):
        return {v.worker: v.prefix_blocks for v in placer.views(None, ["w0"], {}, 4, {}, b"k", now)}

    assert prefixes(59.0) == {"w0": 40} and prefixes(61.0) == {"w0": 0}
    placer.shadow("w0", 64)  # a resized shadow keeps what it knew
    placer.commit("w1", [b"b%d" % i for i in range(8)], 0, now=70.0)
    placer.commit("w1", [b"b%d" % i for i in range(8)] + [b"q"], 0, now=200.0)  # asked again: a prefix
    placer.shadow("w1", 64)
    assert {v.worker: v.prefix_blocks for v in placer.views(None, ["w1"], {}, 4, {}, b"k", 500.0)} == {"w1": 8}


def test_a_new_group_stays_off_a_worker_its_prefix_would_fill():
    """``prefix_fill``: a worker whose prefixes would take more than 90% of its pool after the new
    one is passed over for one with room, while that one is within ``fill_slack`` prefills of the
    fastest; beyond that, or with the guard off, the usual rule (fastest within the slack)."""
    def v(w, ttft, prefixes, rank):
        return WorkerView(w, ttft, 0, (0, 0, -10.0), 0.0, rank, prefix_blocks=prefixes, capacity=128)

    full, roomy = v("w0", 0.5, 96, 0), v("w1", 2.0, 64, 1)  # 96 + 34 > 115; 64 + 34 fits
    assert choose([full, roomy], 34, 1.0).worker == "w1"  # 1.5 s slower: within 4 prefills
    assert choose([full, v("w1", 6.0, 64, 1)], 34, 1.0).worker == "w0"  # 5.5 s slower: beyond them
    assert choose([full, roomy], 34, 1.0, PlacementConfig(prefix_fill=1.0)).worker == "w0"  # off
    assert choose([full, v("w1", 0.5, 96, 1)], 34, 1.0).worker in ("w0", "w1")  # nobody has room: as before
    unknown = WorkerView("w0", 0.5, 0, (0, 0, -10.0), 0.0, 0, prefix_blocks=96)  # capacity unknown: fits
    assert choose([unknown, roomy], 34, 1.0).worker == "w0"


def _with_copy_out(v: WorkerView, copy_out_s: float) -> WorkerView:
    return replace(v, candidate=Candidate(v.worker, "recomputed", v.ttft_s, 0.0, v.ttft_s, 0.0, 0, 0,
                                          copy_out_s=copy_out_s))


def test_a_new_group_goes_to_a_worker_whose_copies_out_are_quick_among_near_ties():
    """The cluster bench (session 28): a chat's first turn landed on the worker behind the
    100 Mbit/s link, the chat's later sessions pulled its system prompt from there at 2.5-5 s
    each. Among near ties a worker behind a slow link comes after the others, but it still takes
    a group when it holds fewer prefixes than they do (spreading groups comes first)."""
    slow = _with_copy_out(view("w0", 2.53, rank=0), 2.4)  # a little faster now, first by rendezvous
    fast = [_with_copy_out(view(w, 2.62, rank=i + 1), 0.2) for i, w in enumerate(("w1", "w2", "w3"))]
    assert choose([slow, *fast], 17, 2.3).worker == "w1"
    assert choose([slow, *fast], 17, 2.3, PlacementConfig(remote_ratio=0)).worker == "w0"
    full = [replace(v, shared_blocks=32) for v in fast]
    assert choose([slow, *full], 17, 2.3).worker == "w0"
    even = [_with_copy_out(view(w, 2.6, rank=i), 0.2 + 0.05 * i) for i, w in enumerate(("w0", "w1", "w2"))]
    assert choose(even, 17, 2.3).worker == "w0"  # links alike (within 2x): the usual order
    assert choose([view("a", 1.0, rank=1), view("b", 1.0, rank=0)], 17, 2.3).worker == "b"  # no estimates


def test_a_match_that_keeps_a_request_on_a_much_slower_holder_is_logged_with_the_rules_inputs():
    """``Placer.held``: a match whose holder's TTFT exceeds the fastest candidate's by the spill
    margin (a busy holder not relieved) is kept with every candidate and the rules' other inputs;
    a match on a holder about as fast as the rest is not."""
    workers = ["w0", "w1"]
    cm, placer = _cost_model(workers), Placer(PlacementConfig(spill_group_share=2.0))  # no group spills
    for w in workers:
        placer.shadow(w, 64)
    items = shared_prefix(groups=1, users=4, seed=3)
    first = _route(placer, cm, items[0], workers, {}, {}, now=0.0)
    holdings = {first.worker: len(items[0].prompt_ids) // BS * BS}
    assert _route(placer, cm, items[1], workers, holdings, {}, now=1.0).kind == "match"
    assert not placer.held  # the holder was the fastest
    cm.observe_load(first.worker, WorkerLoad(waiting_tokens=(40_000,)))  # its queue: ~40 prefills
    held = _route(placer, cm, items[2], workers, holdings, {}, now=2.0)
    assert (held.kind, held.worker) == ("match", first.worker)
    (entry,) = placer.held
    other = next(w for w in workers if w != first.worker)
    assert entry["kind"] == "match" and entry["worker"] == first.worker and set(entry["candidates"]) == set(workers)
    assert entry["candidates"][first.worker]["ttft_s"] > entry["candidates"][other]["ttft_s"] * 1.5 + 0.05
    assert entry["reuse_p"] == round(placer.reuse_p, 4) and entry["contention_s"] == 0.0 and entry["cluster_share"] == 1.0
    assert all(e["kind"] != "match" for e in placer.log)  # the placement log keeps its own


def test_a_request_whose_chosen_worker_died_while_the_router_chose_is_routed_again():
    """A dead worker's stream retires it at once, while other requests are being routed: a choice
    of it is made again among the workers left (a fault probe: 5 of 10 requests sent as a worker
    died were 503s "router chose unavailable worker")."""
    from cluster.pool import PoolConfig, WorkerPool, WorkerUnavailable
    from cluster.types import LeastLoadedRouter, RouteChoice, WorkerState
    from engine.sequence import Request, SamplingParams

    class _DiesWhileChosen(LeastLoadedRouter):
        """Chooses w0, which dies while the choice is on its way back, while ``deaths`` last."""

        def __init__(self, pool, deaths):
            self.pool, self.deaths, self.calls = pool, deaths, 0

        async def choose(self, request, candidates, loan=None):
            self.calls += 1
            if self.deaths and any(w.worker_id == "w0" for w in candidates):
                self.deaths -= 1
                self.pool.workers["w0"].dead = True
                return RouteChoice("w0")
            return await super().choose(request, candidates)

    def pool_with(deaths):
        pool = WorkerPool(PoolConfig())
        pool.router = _DiesWhileChosen(pool, deaths)
        pool._ready.set()
        for w in ("w0", "w1"):
            pool.workers[w] = WorkerState(w, None, info={"num_blocks": 64})
        return pool

    req = Request("r", tuple(range(1, 40)), SamplingParams(max_tokens=4), tenant="t")
    pool = pool_with(1)
    ws, choice = asyncio.run(pool.acquire(req))
    assert ws.worker_id == choice.worker_id == "w1" and pool.router.calls == 2 and ws.inflight == 1
    pool = pool_with(1)
    pool.workers["w1"].dead = True  # no worker left to route to: the request fails, nothing stays counted
    with pytest.raises(WorkerUnavailable):
        asyncio.run(pool.acquire(req))
    assert not pool._flights and all(w.inflight == 0 for w in pool.workers.values())
