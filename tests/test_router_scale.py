"""bench/router_scale.py: the router's work per request on a filled cluster, in one process."""

import asyncio

from bench.router_scale import PROFILES, Cluster, measure, speedups


def test_a_filled_cluster_routes_and_each_part_is_timed():
    row = asyncio.run(measure(PROFILES["cpu"], 6, requests=30, warmup=5, seed=0, max_candidates=4))
    assert row["workers"] == 6 and row["max_candidates"] == 4 and row["requests"] == 30
    assert row["index_blocks"] > 0 and row["workers_used"] >= 2
    for part in ("controller", "index", "router"):
        assert 0 < row[part]["p50_ms"] <= row[part]["p99_ms"] and row[part]["max_rate_per_s"] > 0


def test_the_fill_puts_each_workers_groups_in_its_pool_the_index_and_its_shadow():
    c = Cluster(PROFILES["cpu"], 4, seed=1)
    c.fill()
    for g, chain in enumerate(c.chains):
        w = c.ids[g % 4]
        assert c.index.lookup({"t0": chain}).get(w, 0) >= len(chain) * 16
        assert c.router.placer.shadows[w].match(chain) == len(chain)
    for w in c.ids:
        assert len(c.pools[w]) == PROFILES["cpu"].pool_blocks == len(c.router.placer.shadows[w])
        assert c.states[w].running == PROFILES["cpu"].flights


def test_speedups_pair_each_row_with_the_baselines_of_its_size():
    row = {"profile": "gpu", "workers": 16, "max_candidates": 0,
           "controller": {"p50_ms": 2.0}, "router": {"p50_ms": 1.0}}
    base = [{**row, "controller": {"p50_ms": 16.0}, "router": {"p50_ms": 3.0}},
            {**row, "workers": 4, "controller": {"p50_ms": 1.0}, "router": {"p50_ms": 1.0}}]
    (s,) = speedups(base, [row, {**row, "workers": 64}])
    assert s["controller_x"] == 8.0 and s["router_x"] == 3.0 and s["controller_ms"] == (16.0, 2.0)
    # a short list is paired with the baseline's same list, else (a tree without them) with every worker ranked
    short = {**row, "max_candidates": 8, "controller": {"p50_ms": 1.0}}
    (a,) = speedups(base, [short])
    assert a["controller_ms"] == (16.0, 1.0) and a["baseline_max_candidates"] == 0
    (b,) = speedups(base + [{**short, "controller": {"p50_ms": 4.0}}], [short])
    assert b["controller_ms"] == (4.0, 1.0) and b["baseline_max_candidates"] == 8
