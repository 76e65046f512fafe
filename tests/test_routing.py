"""Cost model of the network-aware router (policies/routing.py): pure, no Ray."""

import asyncio
from dataclasses import replace
import random
import time

import pytest

from policies.routing import (CostConfig, CostModel, LinkModel, LinkPrior, PrefillModel, PrefillPrior,
                              WorkerLoad, power_of_two)

BS = 16
BPT = 46080  # SmolLM2-135M K+V bytes per token in float32
GBIT = 125e6


def model(*workers, prior=None, learn_decode=False) -> CostModel:
    cm = CostModel(CostConfig(block_size=BS, bytes_per_token=BPT, prefill_prior=prior or PrefillPrior(),
                              learn_decode=learn_decode))
    for w, node in workers:
        cm.register(w, node)
    return cm


def teach_link(cm: CostModel, src: str, dst: str, bps: float, rtt: float = 1e-3, n: int = 5) -> None:
    for _ in range(n):
        nbytes = 32 << 20
        cm.links.observe_rtt(src, dst, rtt)
        cm.links.observe_transfer(src, dst, nbytes, rtt + nbytes / bps)


def covered(ranges) -> list[int]:
    return sorted(b for r in ranges for b in range(r.start_block, r.end_block))


# -- decisions -------------------------------------------------------------------------------
def test_high_bandwidth_pulls_to_idle_worker_when_holder_is_loaded():
    cm = model(("A", "n1"), ("B", "n2"))
    teach_link(cm, "n1", "n2", 10 * GBIT / 8 * 8)  # 10 Gbit/s
    cm.observe_load("A", WorkerLoad(extra_wait_s=5.0))
    d = cm.decide(2048, {"A": 2048})
    assert d.worker == "B" and d.kind == "pulled"
    assert d.chosen.pulled_tokens == 2032 and d.chosen.local_tokens == 0  # never the last block
    assert covered(d.chosen.pulls) == list(range(127))
    assert {r.holder for r in d.chosen.pulls} == {"A"}


def test_low_bandwidth_recomputes_rather_than_pulls():
    cm = model(("A", "n1"), ("B", "n2"))
    teach_link(cm, "n1", "n2", 100e6 / 8)  # 100 Mbit/s: 94 MB of KV takes ~7.5 s
    cm.observe_load("A", WorkerLoad(extra_wait_s=5.0))
    d = cm.decide(2048, {"A": 2048})
    assert d.worker == "B" and d.kind == "recomputed" and d.chosen.pulled_tokens == 0


def test_a_ranked_recompute_shows_the_pull_it_was_preferred_to():
    """Why a worker with a holder in the index recomputed: its best pull's TTFT rides along."""
    cm = model(("A", "n1"), ("B", "n2"))
    teach_link(cm, "n1", "n2", 100e6 / 8)
    cm.observe_load("A", WorkerLoad(extra_wait_s=5.0))
    by = {c.worker: c for c in cm.rank(2048, {"A": 2048})}
    b_pull = [c for c in cm.candidates(2048, {"A": 2048}) if c.worker == "B" and c.kind == "pulled"]
    assert by["B"].kind == "recomputed" and by["B"].pull_option_ttft_s == min(c.expected_ttft_s for c in b_pull)
    assert by["B"].pull_option_ttft_s > by["B"].expected_ttft_s
    assert by["A"].kind == "local" and by["A"].pull_option_ttft_s is None  # nothing to pull: it holds it all
    teach_link(cm, "n1", "n2", 10 * GBIT, n=20)
    b = next(c for c in cm.rank(2048, {"A": 2048}) if c.worker == "B")
    assert b.kind == "pulled" and b.pull_option_ttft_s is None


@pytest.mark.parametrize("overlap", [True, False])
def test_a_pull_to_a_busy_worker_transfers_while_the_request_waits_its_turn(overlap):
    """The request is queued while its KV arrives (actors/worker.py): on a worker with a queue
    the transfer costs only what it outlasts the wait. The holder A 30 s deep, B 10 s deep and
    100 Mbit/s from A (~7.5 s for 2048 tokens): B pulls only when the transfer overlaps its wait."""
    cm = CostModel(CostConfig(block_size=BS, bytes_per_token=BPT, pull_overlaps_wait=overlap))
    cm.register("A", "n1")
    cm.register("B", "n2")
    teach_link(cm, "n1", "n2", 100e6 / 8)
    cm.observe_load("A", WorkerLoad(extra_wait_s=30.0))
    cm.observe_load("B", WorkerLoad(extra_wait_s=10.0))
    b = {c.worker: c for c in cm.rank(2048, {"A": 2048})}["B"]
    pull = min((c for c in cm.candidates(2048, {"A": 2048}) if c.worker == "B" and c.kind == "pulled"),
               key=lambda c: c.expected_ttft_s)
    assert pull.pull_s < pull.wait_s == 10.0
    assert pull.expected_ttft_s == pytest.approx(pull.wait_s + pull.prefill_s + (0 if overlap else pull.pull_s))
    assert pull.exposed_pull_s == pytest.approx(0 if overlap else pull.pull_s)
    assert b.kind == ("pulled" if overlap else "recomputed")


def test_low_bandwidth_routes_to_idle_holder():
    cm = model(("A", "n1"), ("B", "n2"))
    teach_link(cm, "n1", "n2", 100e6 / 8)
    d = cm.decide(2048, {"A": 2048})
    assert d.worker == "A" and d.kind == "local" and d.chosen.local_tokens == 2032


def test_switches_from_recompute_to_pull_as_bandwidth_is_learned():
    cm = model(("A", "n1"), ("B", "n2"))
    cm.observe_load("A", WorkerLoad(extra_wait_s=5.0))
    teach_link(cm, "n1", "n2", 100e6 / 8)
    assert cm.decide(2048, {"A": 2048}).kind == "recomputed"
    teach_link(cm, "n1", "n2", 10e9 / 8, n=20)
    assert cm.decide(2048, {"A": 2048}).kind == "pulled"


def test_loaded_holders_split_pull_across_nodes():
    cm = model(("A", "n1"), ("C", "n3"), ("B", "n2"))
    for src in ("n1", "n3"):
        teach_link(cm, src, "n2", 1e9 / 8)
    for w in ("A", "C"):
        cm.observe_load(w, WorkerLoad(extra_wait_s=10.0))
    d = cm.decide(4096, {"A": 4096, "C": 2048})
    assert d.worker == "B" and d.kind == "pulled"
    assert covered(d.chosen.pulls) == list(range(255))  # each block exactly once
    assert {r.holder for r in d.chosen.pulls} == {"A", "C"}
    for r in d.chosen.pulls:
        held = {"A": 4096, "C": 2048}[r.holder] // BS
        assert r.end_block <= held  # only blocks the holder has
    # parallel: the makespan is below pulling everything from the faster holder alone
    single = cm.plan_pull("B", 0, 255, {"A": 256})[0]
    assert d.chosen.pull_s < single


def test_pull_only_missing_suffix_and_prefer_deeper_holder_on_same_node():
    cm = model(("A", "n1"), ("A2", "n1"), ("B", "n2"))
    teach_link(cm, "n1", "n2", 10e9 / 8)
    cm.observe_load("A", WorkerLoad(extra_wait_s=5.0))
    cm.observe_load("A2", WorkerLoad(extra_wait_s=5.0))
    d = cm.decide(2048, {"A": 2048, "A2": 1024, "B": 512})
    assert d.worker == "B" and d.kind == "pulled"
    assert d.chosen.local_tokens == 512 and d.chosen.pulled_tokens == 2032 - 512
    assert covered(d.chosen.pulls) == list(range(32, 127))
    assert {r.holder for r in d.chosen.pulls} == {"A"}  # one source per node: the deepest


def test_workers_on_one_node_get_the_pull_plan_each_would_get_alone():
    """The ranking plans a pull once per node and depth (a target holds nothing deeper than its
    own prefix, so the plan is its node's): every target's pulls are what ``plan_pull`` gives it."""
    cm = model(("A", "n1"), ("A2", "n1"), ("B", "n2"), ("B2", "n2"), ("B3", "n2"), ("C", "n3"))
    for src, dst in (("n1", "n2"), ("n3", "n2"), ("n1", "n3"), ("n3", "n1")):
        teach_link(cm, src, dst, (1 + len(dst)) * GBIT)
    holdings = {"A": 2048, "C": 1024, "B2": 512}
    held = {w: cm.usable_tokens(2048, t) // BS for w, t in holdings.items()}
    pulls = [c for c in cm.candidates(2048, holdings) if c.kind == "pulled"]
    assert {c.worker for c in pulls} >= {"B", "B3", "B2", "C", "A2"}
    for c in pulls:
        level = (c.local_tokens + c.pulled_tokens) // BS
        assert (c.pull_s, c.pulls) == cm.plan_pull(c.worker, c.local_tokens // BS, level, held)
    by_worker = {c.worker: c for c in cm.rank(2048, holdings)}
    assert by_worker["B"].copy_out_s == by_worker["B3"].copy_out_s == cm.copy_out_s("B", sorted(set(cm.nodes.values())),
                                                                                    2032 * BPT)


def test_same_node_holder_uses_local_link_prior():
    cm = model(("A", "n1"), ("B", "n1"))
    cm.observe_load("A", WorkerLoad(extra_wait_s=5.0))
    d = cm.decide(2048, {"A": 2048})
    assert d.worker == "B" and d.kind == "pulled"


def test_no_holder_means_least_loaded_recompute():
    cm = model(("A", "n1"), ("B", "n2"))
    cm.observe_load("A", WorkerLoad(waiting_tokens=(1000,)))
    d = cm.decide(100, {})
    assert d.worker == "B" and d.kind == "recomputed"
    assert [c.worker for c in d.ranking] == ["B", "A"]
    assert cm.decide(100, {}, workers=[]) is None


def test_short_prompt_never_pulls_its_only_block():
    cm = model(("A", "n1"), ("B", "n2"))
    cm.observe_load("A", WorkerLoad(extra_wait_s=5.0))
    assert cm.decide(16, {"A": 16}).chosen.cached_tokens == 0


def test_rank_is_one_best_candidate_per_worker():
    cm = model(("A", "n1"), ("B", "n2"), ("C", "n3"))
    r = cm.rank(2048, {"A": 2048})
    assert sorted(c.worker for c in r) == ["A", "B", "C"]
    assert [c.expected_ttft_s for c in r] == sorted(c.expected_ttft_s for c in r)


def test_candidates_carry_the_whole_prompts_prefill_and_the_prefill_without_their_pulls():
    """A prefill has a fixed cost, so a 40-token question's prefill scaled by tokens misreads the
    whole prompt's (placement prices evictions, repeated compute and its margins in whole-prompt
    prefills; the router prices recomputing a failed pull's tokens): every candidate carries its
    worker's prefill of the whole prompt with nothing cached and of the prompt after its own prefix."""
    from policies.placement import full_prefill_s

    cm = model(("A", "n1"), ("B", "n2"), prior=PrefillPrior(a=0.3, b=4.0))
    cm.observe_load("A", WorkerLoad(extra_wait_s=5.0))  # a busy holder: B pulls
    ranking = cm.rank(552, {"A": 544})
    whole = cm.prefill_s("A", 552, 0)
    for c in ranking:
        assert c.full_prefill_s == pytest.approx(cm.prefill_s(c.worker, 552, 0))
        assert c.own_prefill_s == pytest.approx(cm.prefill_s(c.worker, 552 - c.local_tokens, c.local_tokens))
    pull = next(c for c in ranking if c.kind == "pulled")
    assert pull.worker == "B" and pull.own_prefill_s == pytest.approx(whole)  # B holds nothing of its own
    assert pull.prefill_s * 552 / (552 - pull.cached_tokens) > 3 * whole  # what scaling read
    assert full_prefill_s(ranking, 552) == pytest.approx(whole)
    assert full_prefill_s([replace(c, full_prefill_s=0.0) for c in ranking], 552) > 3 * whole  # without it


# -- estimators --------------------------------------------------------------------------------
def test_prefill_fit_converges_to_linear_plus_quadratic():
    a, b, c = 0.01, 0.3, 0.1  # seconds, per 1024 tokens, per 1024**2 attention units
    truth = lambda n, p: a + b * n / 1024 + c * (n / 1024) * (n / 1024 + 2 * p / 1024)
    rng = random.Random(0)
    m = PrefillModel(PrefillPrior(a=0.5, b=2.0, c=0.0))
    for _ in range(100):
        n, p = rng.randint(16, 4096), rng.choice([0, 0, 512, 2048])
        m.observe(n, truth(n, p) * rng.uniform(0.98, 1.02), cached_tokens=p)
    for n, p in [(64, 0), (1000, 0), (4000, 0), (1000, 2048)]:
        assert m.predict(n, p) == pytest.approx(truth(n, p), rel=0.05, abs=0.015)


def test_prefill_prior_before_data_and_monotone_with_noisy_data():
    m = PrefillModel(PrefillPrior(a=0.02, b=0.5, c=0.05))
    assert m.predict(1024) == pytest.approx(0.57)
    assert m.predict(0) == 0.0
    rng = random.Random(1)
    for _ in range(50):  # flat, noisy: an unconstrained fit could bend downwards
        m.observe(rng.randint(1, 4096), 0.1 + rng.uniform(-0.05, 0.05))
    assert min(m.coefficients) >= 0
    preds = [m.predict(n) for n in range(1, 8192, 256)]
    assert preds == sorted(preds) and preds[0] >= 0


def test_prefill_window_forgets_old_behaviour():
    m = PrefillModel(window=20)
    for _ in range(40):
        m.observe(1024, 2.0)
    for _ in range(20):
        m.observe(1024, 0.2)
    assert m.predict(1024) == pytest.approx(0.2, rel=0.1)


def test_new_worker_fit_is_pulled_toward_its_peers_not_the_prior():
    """Partial pooling: a worker that has only run small prompts predicts a large one like its
    peers measured (pooled fit), not like the fixed prior (which is 5x too slow here)."""
    truth = lambda n: 0.01 + 0.1 * n / 1024  # noqa: E731 - every worker runs at this speed
    cost = CostModel(CostConfig(prefill_prior=PrefillPrior(a=0.02, b=0.5, c=0.05)))
    rng = random.Random(3)
    for _ in range(40):  # the established worker A sees every size
        n = rng.randint(64, 4096)
        cost.observe_prefill("A", n, truth(n))
    for n in (32, 48, 64):  # the new worker B: three short prompts
        cost.observe_prefill("B", n, truth(n))
    assert cost.prefill_s("B", 4096) == pytest.approx(truth(4096), rel=0.15)
    assert cost.prefill_s("A", 4096) == pytest.approx(truth(4096), rel=0.05)


def test_own_fit_still_separates_a_slower_worker():
    truth = {"A": lambda n: 0.01 + 0.1 * n / 1024, "B": lambda n: 0.01 + 0.3 * n / 1024}
    cost = CostModel()
    rng = random.Random(4)
    for _ in range(30):
        for w in ("A", "B"):
            n = rng.randint(64, 4096)
            cost.observe_prefill(w, n, truth[w](n))
    for w in ("A", "B"):
        assert cost.prefill_s(w, 2048) == pytest.approx(truth[w](2048), rel=0.1)


@pytest.mark.parametrize("before,after", [(3.125e6, 125e6), (125e6, 3.125e6)])
def test_link_estimate_follows_a_reshaped_link_both_ways(before, after):
    """25 Mbit/s <-> 1 Gbit/s: two transfers after the change put the estimate within 2x of the
    new rate, in either direction (a mean of seconds per byte needs ~10 when the link speeds up)."""
    links = LinkModel(LinkPrior(alpha=0.3))
    nbytes = 32 << 20
    for _ in range(10):
        links.observe_transfer("x", "y", nbytes, nbytes / before)
    assert links.estimate("x", "y").bandwidth_Bps == pytest.approx(before, rel=0.01)
    for _ in range(2):
        links.observe_transfer("x", "y", nbytes, nbytes / after)
    assert after / 2 <= links.estimate("x", "y").bandwidth_Bps <= after * 2


def test_link_estimate_is_not_thrown_by_ordinary_noise():
    links = LinkModel(LinkPrior(alpha=0.3))
    nbytes = 32 << 20
    for _ in range(10):
        links.observe_transfer("x", "y", nbytes, nbytes / 12.5e6)
    links.observe_transfer("x", "y", nbytes, nbytes / 12.5e6 * 1.4)  # one slower transfer: noise
    assert links.estimate("x", "y").bandwidth_Bps == pytest.approx(12.5e6 * 1.4 ** -0.3, rel=0.01)
    links.observe_transfer("x", "y", nbytes, nbytes / 12.5e6 * 2)  # one at half speed
    assert links.estimate("x", "y").bandwidth_Bps >= 12.5e6 / 1.5


def test_link_ewma_converges_and_separates_rtt():
    links = LinkModel(LinkPrior(alpha=0.3))
    assert links.estimate("x", "y").samples == 0
    rng = random.Random(2)
    for _ in range(30):
        links.observe_transfer("x", "y", 1000, 0.004)  # small: an RTT probe
        nbytes = rng.randint(8 << 20, 64 << 20)
        links.observe_transfer("x", "y", nbytes, 0.004 + nbytes / 12.5e6 * rng.uniform(0.95, 1.05))
    e = links.estimate("x", "y")
    assert e.rtt_s == pytest.approx(0.004)
    assert e.bandwidth_Bps == pytest.approx(12.5e6, rel=0.05)
    assert links.estimate("y", "x").bandwidth_Bps == e.bandwidth_Bps  # reverse borrows
    assert links.estimate("x", "x").bandwidth_Bps == LinkPrior().local_bandwidth_Bps


def test_link_ignores_garbage_samples():
    links = LinkModel()
    links.observe_transfer("x", "y", 1 << 20, 0.0)
    links.observe_transfer("x", "y", 0, 1.0)
    links.observe_transfer("x", "y", 1 << 20, float("nan"))
    assert links.estimate("x", "y").samples == 0


def test_worker_borrows_pooled_fit_until_it_has_its_own():
    cm = model(("A", "n1"), ("B", "n2"))
    for _ in range(10):
        cm.observe_prefill("A", 1024, 3.0)
    assert cm.prefill_s("B", 1024) == pytest.approx(3.0, rel=0.1)
    for _ in range(10):
        cm.observe_prefill("B", 1024, 1.0)
    assert cm.prefill_s("B", 1024) == pytest.approx(1.0, rel=0.1)


def test_power_of_two_picks_less_loaded():
    rng = random.Random(0)
    assert power_of_two([], {}) is None
    assert power_of_two(["a"], {}) == "a"
    picks = [power_of_two(["a", "b"], {"a": 5.0, "b": 1.0}, rng) for _ in range(10)]
    assert set(picks) == {"b"}


# -- the actor shell ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ray_local():
    import os
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    import ray
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


async def test_router_actor_decides_and_client_falls_back(ray_local):
    from actors.router import ROUTER_NAME, ROUTER_NAMESPACE, RouterClient, get_or_create_router
    ray = ray_local
    h = get_or_create_router(CostConfig(block_size=BS, bytes_per_token=BPT))
    assert get_or_create_router() is not None  # same name: the existing actor
    ray.get([h.register.remote("A", "n1"), h.register.remote("B", "n2"),
             h.report_load.remote("A", WorkerLoad(extra_wait_s=5.0))])
    for _ in range(5):
        h.report_transfer.remote("n1", "n2", 32 << 20, (32 << 20) / 1.25e9)
    client = RouterClient(h, timeout_s=30)
    d = await client.decide(2048, {"A": 2048})
    assert d.worker == "B" and d.kind == "pulled"
    m = ray.get(h.metrics.remote())
    assert m["decisions"] == {"pulled": 1} and m["bytes_pulled"] == 5 * (32 << 20)
    # an unanswerable router (timeout) -> None, and choose() falls back to power of two choices
    slow = RouterClient(h, timeout_s=1e-6)
    assert await slow.decide(2048, {"A": 2048}) is None
    assert await slow.choose(2048, {"A": 2048}, ["A", "B"], {"A": 9.0, "B": 0.0}) == "B"
    gone = RouterClient(None, timeout_s=1.0)
    gone._handle = None
    ray.kill(h)
    deadline = time.monotonic() + 30  # ray.kill only asks for the kill: wait until the name is gone
    while True:
        try:
            ray.get_actor(ROUTER_NAME, namespace=ROUTER_NAMESPACE)
        except ValueError:
            break
        assert time.monotonic() < deadline, "the killed router actor is still registered"
        await asyncio.sleep(0.05)
    assert await gone.decide(10, {}) is None


def test_pending_prefix_counts_as_the_workers_own_and_is_never_pulled_from():
    """A prefix routed to A but not yet indexed (``pending``) makes A a local holder in the
    ranking; no other worker plans a pull from A for it (its blocks may not exist yet)."""
    cm = model(("A", "n1"), ("B", "n2"))
    ranked = {c.worker: c for c in cm.rank(640, {}, ["A", "B"], pending={"A": 592})}
    assert ranked["A"].kind == "local" and ranked["A"].local_tokens == 592
    assert ranked["B"].kind == "recomputed" and ranked["B"].pulls == ()
    assert ranked["A"].expected_ttft_s < ranked["B"].expected_ttft_s
    # with the index showing it on A too, B may pull; pending never lowers what the index shows
    both = {c.worker: c for c in cm.candidates(640, {"A": 592}, ["A", "B"], pending={"A": 16})}
    assert both["A"].local_tokens == 592
    assert any(c.kind == "pulled" for c in cm.candidates(640, {"A": 592}, ["B"]))


def test_a_pull_may_take_twice_its_estimate_or_as_long_as_recomputing_never_less_than_the_floor():
    from policies.routing import pull_deadline_s

    assert pull_deadline_s(0.2, 0.1) == 1.0  # the floor: a busy holder answers after its step
    assert pull_deadline_s(2.0, 1.0) == 4.0  # twice the expected transfer
    assert pull_deadline_s(0.5, 3.0) == 3.0  # as long as recomputing those tokens would take
    assert pull_deadline_s(-1.0, -1.0, floor_s=0.5) == 0.5


# -- the decode term, learned from outcomes ----------------------------------------------------
def test_a_busy_holders_decode_wait_is_learned_and_moves_the_next_request_off_it():
    """Requests to a holder start later the more sequences decode there (0.3 s each, plus 0.5 s
    whatever the load); the measured TTFTs teach the per-sequence term, and with 8 decoding the
    next request on that prefix is pulled to the idle worker instead of piling onto the holder."""
    cm = model(("A", "n1"), ("B", "n2"), learn_decode=True)
    teach_link(cm, "n1", "n2", 10 * GBIT)
    cm.observe_load("A", WorkerLoad(running=8))
    before = cm.decide(544, {"A": 544})
    assert before.worker == "A" and before.kind == "local" and cm.decode_s("A") == 0.0
    for i in range(24):
        running = (0, 2, 4, 8)[i % 4]
        cm.observe_outcome("A", running, 0.1, 0.1 + 0.5 + 0.3 * running)
    pooled = 0.3 * 210 / (210 + 16)  # the slope over all workers, ridge-pulled toward the prior (0)
    assert cm.decode_s("A") == pytest.approx((0.3 * 210 + 16 * pooled) / (210 + 16))  # A's, pulled toward that
    assert cm.wait_s("A") == pytest.approx(8 * cm.decode_s("A"))  # the 0.5 s intercept is not charged
    after = cm.decide(544, {"A": 544})
    assert after.worker == "B" and after.kind == "pulled"
    assert cm.decode_s("B") == pytest.approx(pooled)  # B has no samples: the pooled estimate
    for i in range(200):  # later predictions include the term; it is learned against the rest: no runaway
        running = (0, 2, 4, 8)[i % 4]
        cm.observe_load("A", WorkerLoad(running=running))
        a = next(c for c in cm.rank(544, {"A": 544}) if c.worker == "A")
        assert a.decode_wait_s == pytest.approx(running * cm.decode_s("A"))
        cm.observe_outcome("A", running, a.expected_ttft_s, a.prefill_s + 0.5 + 0.3 * running, a.decode_wait_s)
    assert 0.29 < cm.decode_s("A") < 0.3


def test_the_decode_term_charges_only_what_grows_with_decoding_never_negative_and_can_be_off():
    cm = model(("A", "n1"), learn_decode=True)
    for i in range(40):
        cm.observe_outcome("A", i % 5, 1.0, 6.0)  # 5 s late whatever the load: not per sequence
    assert cm.decode_s("A") == 0.0
    for i in range(40):
        cm.observe_outcome("A", i % 5, 2.0, 2.0 - 0.2 * (i % 5))  # faster the busier: never below 0
    assert cm.decode_s("A") == 0.0
    cm = model(("A", "n1"), learn_decode=True)
    for i in range(40):
        cm.observe_outcome("A", i % 5, 0.1, 0.1 + 0.1 * (i % 5))
    clean = cm.decode_s("A")
    cm.observe_outcome("A", 4, 0.1, 4000.0)  # one stalled request: capped at 30 s
    assert clean < cm.decode_s("A") < clean + 1.0  # uncapped it would add ~77 s per sequence
    cm.observe_outcome("ghost", 4, 0.1, 50.0)  # not a registered worker: ignored
    assert "ghost" not in cm._decode
    fixed = CostModel(CostConfig(decode_step_s=0.05))  # learning is off by default
    fixed.register("A", "n1")
    for i in range(10):
        fixed.observe_outcome("A", i, 0.1, 5.0 * i)
    assert fixed.decode_s("A") == 0.05


def test_the_router_actor_learns_the_decode_term_from_routes_without_pulls_only():
    from actors.router import Router

    r = Router(CostConfig(block_size=BS, bytes_per_token=BPT, learn_decode=True))
    r.register("A", "n1")
    for i in range(10):
        r.report_outcome("pulled", 0.1, 0.1 + i, "A", i)  # a pull's error is the link's
    assert r.estimates()["decode_s"]["A"] == 0.0
    for i in range(10):
        r.report_outcome("local", 0.1, 0.1 + 0.2 * i, "A", i)
    r.report_outcome("local", 0.1, 0.9)  # a client that does not name the worker: only the error counts
    pooled = 0.2 * 82.5 / (82.5 + 16)  # slope 0.2 s per sequence, ridge-pulled toward 0 (pooled)
    assert r.estimates()["decode_s"]["A"] == pytest.approx((0.2 * 82.5 + 16 * pooled) / (82.5 + 16))
    assert r.metrics()["ttft_error"]["local"]["count"] == 11


# -- KV memory: a full pool admits nothing until running requests end -----------------------------
def test_kv_admission_waits_for_enough_running_requests_to_end_first_come_first_served():
    from policies.routing import kv_admission_s
    # room now: no wait, whatever runs
    assert kv_admission_s(1000, [(400, 5.0)], [], 500) == 0.0
    # 800 held: 300 more needs the first of the two to end (the earlier, 2 s)
    assert kv_admission_s(1000, [(400, 6.0), (400, 2.0)], [], 300) == pytest.approx(2.0)
    # needs both gone: the later end
    assert kv_admission_s(1000, [(400, 6.0), (400, 2.0)], [], 700) == pytest.approx(6.0)
    # a waiting request goes first: admitted at 2 s it holds 500 until 2 + 3 s; the new one (300)
    # then waits for the 6 s end (400 + 500 + 300 > 1000 until then)
    assert kv_admission_s(1000, [(400, 6.0), (400, 2.0)], [(500, 3.0)], 300) == pytest.approx(5.0)
    # a request larger than the pool is admitted alone; no pool, no memory term
    assert kv_admission_s(1000, [(400, 1.0)], [], 5000) == pytest.approx(1.0)
    assert kv_admission_s(0, [(400, 9.0)], [], 500) == 0.0


def test_kv_use_counts_shared_blocks_once_and_ages_running_requests():
    from policies.routing import KvFlight, kv_use
    p = tuple(f"p{i}" for i in range(30))  # a 480-token prefix (30 blocks of 16)
    flights = [KvFlight(520, 480, p + ("a", "b"), 16, running_s=None),     # waits; shares p with the next
               KvFlight(500, 0, p + ("c",), 16, running_s=0.5),            # computed p: 5 tokens out at 0.1 s
               KvFlight(300, 0, tuple(f"q{i}" for i in range(18)), 16),    # another prefix, waits
               KvFlight(200, 0, (), 100, running_s=20.0)]                  # no blocks, past its expected end (10 s)
    running, waiting, held = kv_use(flights, 0.1, 16)
    # running ones hold first (the one that computed p holds it), then waiting ones in order; in
    # whole blocks of 16 tokens: 506 tokens take 32 blocks, 521 - 480 shared take 3
    assert running == ((32 * 16, pytest.approx(1.1)), (19 * 16, pytest.approx(0.1 * 25)))  # past its end: 100/4 more
    assert waiting == ((3 * 16, 40, pytest.approx(1.6)), (19 * 16, 300, pytest.approx(1.6)))
    assert held == set(p) | {"a", "b", "c"} | {f"q{i}" for i in range(18)}


def test_held_prefix_counts_leading_chain_blocks_like_a_scan():
    import random

    from policies.routing import held_prefix

    rng = random.Random(7)
    for _ in range(300):
        # prompts of a few groups: chains that share a leading run and then diverge for good
        chains = []
        for _ in range(rng.randint(0, 6)):
            g, n, k = rng.randrange(3), rng.randint(0, 40), rng.randint(0, 40)
            shared = tuple(f"g{g}-{i}" for i in range(min(n, k)))
            chains.append(shared + tuple(f"u{rng.random()}-{i}" for i in range(n - len(shared))))
        held = set().union(*chains) if chains else set()
        g = rng.randrange(3)
        new = tuple(f"g{g}-{i}" for i in range(rng.randint(0, 45))) + ("tail",)
        scan = next((i for i, b in enumerate(new) if b not in held), len(new))
        assert held_prefix(new, held) == scan
    assert held_prefix((), {"x"}) == 0 and held_prefix(("a", "b"), {"a", "b"}) == 2


def test_a_holder_whose_kv_pool_is_full_loses_to_a_recompute_on_a_worker_with_room():
    # A holds the prefix but its pool is full of requests decoding for 8 more seconds; its queue
    # alone (nothing waiting) says "no wait"
    cm = model(("A", "n1"), ("B", "n2"))
    full = WorkerLoad(running=4, kv_tokens=2048, kv_running=((500, 8.0),) * 4)
    cm.observe_load("A", full)
    cm.observe_load("B", WorkerLoad(kv_tokens=2048))
    by = {c.worker: c for c in cm.rank(544, {"A": 528}, ["A", "B"])}
    assert by["A"].kv_wait_s == pytest.approx(8.0) and by["A"].memory_bound
    assert by["A"].wait_s == pytest.approx(8.0)
    assert by["B"].kv_wait_s == 0.0 and not by["B"].memory_bound
    assert cm.rank(544, {"A": 528}, ["A", "B"])[0].worker == "B"
    # the prefix is held by a request in flight on A (shared): the request needs room only for its
    # own 16 tokens + 1, which the full pool has (2048 - 2000 = 48)
    a = {c.worker: c for c in cm.rank(544, {"A": 528}, ["A", "B"], shared={"A": 528})}["A"]
    assert a.kv_wait_s == 0.0 and a.kind == "local"
    # without a published pool size there is no memory term (as before)
    cm.observe_load("A", WorkerLoad(running=4))
    assert cm.rank(544, {"A": 528}, ["A", "B"])[0].worker == "A"


def test_a_full_pools_running_requests_count_down_from_when_their_signal_came():
    """A KV signal's times are seconds until each running request ends as of when it was sent;
    the controller sends an unchanged worker's again only now and then, so the cost model counts
    them down from when it got the signal (not within ``LOAD_AGE_MIN_S``: a signal and the ranking
    it rides on come together)."""
    from policies.routing import LOAD_AGE_MIN_S

    now = [50.0]
    cm = CostModel(CostConfig(block_size=BS, bytes_per_token=BPT), clock=lambda: now[0])
    for w, node in (("A", "n1"), ("B", "n2")):
        cm.register(w, node)
    cm.observe_load("A", WorkerLoad(running=4, kv_tokens=2048, kv_running=((500, 8.0),) * 4))
    cm.observe_load("B", WorkerLoad(kv_tokens=2048))

    def kv_wait():
        return {c.worker: c for c in cm.rank(544, {"A": 528}, ["A", "B"])}["A"].kv_wait_s
    assert kv_wait() == pytest.approx(8.0)
    now[0] += LOAD_AGE_MIN_S / 2
    assert kv_wait() == pytest.approx(8.0)
    now[0] += 3.0 - LOAD_AGE_MIN_S / 2
    assert kv_wait() == pytest.approx(5.0)
    now[0] += 10.0  # past their ends: room now
    assert kv_wait() == 0.0
    cm.observe_load("A", WorkerLoad(running=4, kv_tokens=2048, kv_running=((500, 8.0),) * 4))  # a new signal
    assert kv_wait() == pytest.approx(8.0)


def test_copy_out_is_the_median_time_to_send_the_prompt_from_a_worker_to_the_others():
    """A worker behind a slow link (n4 at 100 Mbit/s, the others at 1 Gbit/s between them) is the
    slow source of every copy of a prefix placed there; one node alone has nobody to copy to."""
    cm = model(("w1", "n1"), ("w2", "n2"), ("w3", "n3"), ("w4", "n4"))
    for a in ("n1", "n2", "n3"):
        for b in ("n1", "n2", "n3"):
            if a != b:
                teach_link(cm, a, b, GBIT)
        teach_link(cm, "n4", a, 100e6 / 8)
        teach_link(cm, a, "n4", 100e6 / 8)
    by = {c.worker: c for c in cm.rank(512, {})}
    nbytes = 496 * BPT  # the usable blocks: never the prompt's last token
    assert by["w4"].copy_out_s == pytest.approx(1e-3 + nbytes / (100e6 / 8), rel=0.05)
    assert by["w1"].copy_out_s == pytest.approx(1e-3 + nbytes / GBIT, rel=0.05)  # median of 1, 1 and 0.1 Gbit/s
    assert all(c.copy_out_s == by[c.worker].copy_out_s for c in cm.candidates(512, {"w1": 256}))
    alone = model(("a", "n1"), ("b", "n1"))
    assert {c.copy_out_s for c in alone.rank(512, {})} == {0.0}
