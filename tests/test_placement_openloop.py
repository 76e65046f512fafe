"""The open-loop, step-level replay of the cluster bench's shared-prefix stages
(bench/placement_openloop.py). Pure: no Ray, no model; small stages so each run takes a second."""

from collections import Counter
from dataclasses import replace

import pytest

from bench.placement_openloop import OpenConfig, Stage, pack_groups, simulate, stages
from bench.workloads import WorkItem, oracle_hits


def _small(seed=0, rates=(0.5, 0.9), hot=False):
    return stages(rates, stage_s=20.0, groups=6, users=4, seed=seed, hot=hot)


@pytest.mark.parametrize("router", ["kvmesh", "affinity", "pow2", "round_robin"])
def test_every_request_completes_and_hits_never_beat_the_oracle(router):
    run = _small()
    res = simulate(run, router, OpenConfig())
    for st, fig in zip(run, res["stages"]):
        assert fig["requests"] == len(st.items) > 0
        assert sum(fig["per_worker"].values()) == len(st.items)
        assert fig["hit_tokens"] <= fig["oracle_hit_tokens"] == sum(oracle_hits(st.items))
        assert fig["ttft_p50"] >= OpenConfig().step_s  # nothing comes out faster than one step
        assert fig["ttft_p50"] <= fig["ttft_p90"] <= fig["ttft_p99"]


def test_stages_bring_fresh_groups_at_the_offered_rate():
    run = stages((0.4, 1.3), stage_s=45.0, seed=3)
    a, b = ({it.prompt_ids[:512] for it in st.items} for st in run)
    assert not a & b  # no system prompt of one stage comes back in the next
    assert 8 <= len(run[0].items) <= 30 and 40 <= len(run[1].items) <= 80
    assert all(0 < it.at_s <= 45.0 for st in run for it in st.items)


def test_a_steady_warm_up_lasts_whole_stages_until_every_group_was_sent():
    """As the cluster bench's warm-up since session 18: one 10-s stage at 0.5 req/s shows few of
    12 groups; with up to 8 stages it goes on, a whole stage at a time, until all 12 were sent."""
    short = stages((0.5, 1.0), stage_s=10.0, seed=3, steady=True)
    assert short[0].warmup and short[0].stage_s == 10.0 and len({it.group for it in short[0].items}) < 12
    run = stages((0.5, 1.0), stage_s=10.0, seed=3, steady=True, warmup_stages=8)
    warm = run[0]
    assert warm.warmup and len({it.group for it in warm.items}) == 12
    assert warm.stage_s % 10.0 == 0 and 10.0 < warm.stage_s <= 80.0
    assert all(it.at_s <= warm.stage_s for it in warm.items)
    assert len({it.group for it in warm.items if it.at_s <= warm.stage_s - 10.0}) < 12  # no stage too many
    assert [st.stage_s for st in run[1:]] == [10.0, 10.0] and not any(st.warmup for st in run[1:])


def test_an_inference_perf_order_is_walked_from_its_start_in_every_stage():
    """inference-perf restarts its data generator per stage: each stage sends the first prompts of
    one seeded order, the same prompts again, so a group early and often in it is hot everywhere."""
    order = [0, 0, 1, 0, 2, 0, 1, 2, 0, 1, 2, 0] * 5
    run = stages((0.5, 1.0), stage_s=10.0, seed=1, steady=True, warmup_stages=3, order=order, groups=3)
    for st in run:
        assert [it.group for it in st.items] == [f"g{g}" for g in order[:len(st.items)]]
        assert [it.prompt_ids for it in st.items] == [it.prompt_ids for it in run[-1].items[:len(st.items)]]
    assert len({it.group for it in run[0].items}) == 3
    first = {it.group: it.prompt_ids[:512] for st in run for it in st.items}
    assert len(set(first.values())) == 3  # one system prompt per group


def test_the_packed_oracle_splits_known_traffic_evenly_and_routes_each_group_to_one_worker():
    """The ``packed`` router (the upper bound of placement: each group's traffic known in advance)
    packs the heaviest groups first onto the least-loaded worker, at most ceil(groups/workers) each;
    warm-up traffic does not count, and a group seen only there still gets a worker."""
    def items(*groups):
        return tuple(WorkItem((1, 2, 3), 1, group=g) for g in groups)
    warm = Stage(0.5, items("z", "a"), warmup=True)
    scored = Stage(1.0, items(*["a"] * 5 + ["b"] * 3 + ["c"] * 2 + ["d"] * 3 + ["e"] * 2))
    split = pack_groups([warm, scored], ["w0", "w1", "w2"])
    assert set(split) == {"a", "b", "c", "d", "e", "z"} and set(split.values()) <= {"w0", "w1", "w2"}
    load = {w: sum(n for g, n in {"a": 5, "b": 3, "c": 2, "d": 3, "e": 2}.items() if split[g] == w)
            for w in ("w0", "w1", "w2")}
    assert sorted(load.values()) == [5, 5, 5]
    assert max(list(split.values()).count(w) for w in ("w0", "w1", "w2")) == 2
    run = _small(seed=2)
    res = simulate(run, "packed", OpenConfig())
    split = pack_groups(run, [f"w{i}" for i in range(OpenConfig().workers)])
    for fig, st in zip(res["stages"], run):
        assert fig["groups_per_worker"] == dict(sorted(Counter(split[g] for g in {it.group for it in st.items}).items()))


def test_decode_rows_slow_the_prefill_they_share_steps_with():
    run = _small(rates=(0.9,))
    slow = simulate(run, "round_robin", OpenConfig(row_s=0.3))["stages"][0]
    fast = simulate(run, "round_robin", OpenConfig(row_s=0.0))["stages"][0]
    assert slow["ttft_p50"] > fast["ttft_p50"]


def test_a_hot_group_is_pulled_to_other_workers_under_load():
    res = simulate(_small(rates=(1.0,), hot=True), "kvmesh", OpenConfig())
    assert res["decisions"].get("spill", 0) >= 1 and res["decisions"].get("pulled", 0) >= 1
    assert len(res["stages"][0]["per_worker"]) >= 2


def test_kvmesh_keeps_the_hit_ratio_and_bad_arguments_are_refused():
    # (the bench's "legacy" variant reads an old revision with git show: not tested here, a CI
    # checkout may be shallow)
    run = _small(seed=1)
    assert simulate(run, "kvmesh", OpenConfig())["hit_vs_oracle"] >= 0.9
    with pytest.raises(ValueError):
        simulate(run, "nope", OpenConfig())
    with pytest.raises(ValueError, match="blocks"):
        simulate(run, "kvmesh", replace(OpenConfig(), capacity_blocks=16))


def test_chat_stages_are_sessions_whose_turns_extend_one_conversation():
    """--workload chat: per stage, 3-turn sessions sharing the stage's system prompt; each turn's
    prompt extends the session's previous one, and every router serves all of them."""
    run = stages((0.3, 0.6), stage_s=20.0, seed=2, chat=True)
    for st in run:
        by_session: dict[str, list] = {}
        for it in st.items:
            by_session.setdefault(it.group, []).append(it)
        assert len(by_session) == max(1, round(st.rate * 20.0 / 3)) and all(len(v) == 3 for v in by_session.values())
        for turns in by_session.values():
            assert all(b.prompt_ids[:len(a.prompt_ids)] == a.prompt_ids and b.at_s > a.at_s
                       for a, b in zip(turns, turns[1:]))
        assert len({it.prompt_ids[:256] for it in st.items}) == 1  # one system prompt per stage
    assert run[0].items[0].prompt_ids[:256] != run[1].items[0].prompt_ids[:256]
    for router in ("kvmesh", "pow2"):
        res = simulate(run, router, OpenConfig())
        assert [f["requests"] for f in res["stages"]] == [len(st.items) for st in run]


def test_trace_stages_share_prefixes_within_a_stage_only():
    """--workload trace: per stage a synthetic Mooncake trace at the stage's rate, read as the
    bench reads its trace (16 tokens per hash id, at most 1,024 prompt and ``output_len`` output
    tokens), in a domain of its own: requests share prefixes within a stage, never across."""
    run = stages((1.0, 2.0), stage_s=20.0, seed=4, output_len=16, trace=True)
    assert [len(st.items) for st in run] == [20, 40]
    for k, st in enumerate(run):
        assert {it.domain for it in st.items} == {f"t{k}"}
        assert all(len(it.prompt_ids) <= 1024 and 1 <= it.max_tokens <= 16 for it in st.items)
        assert sum(oracle_hits(st.items)) > 0
    chains = [{it.prompt_ids[:16] for it in st.items} for st in run]
    assert chains[0] & chains[1]  # the same generator's hash ids: equal tokens, told apart by domain only


def test_a_busy_holder_sheds_decoding_to_idle_workers_when_contention_is_measured():
    """The trace at a rate where a few prefixes' holders would carry most of the decoding: with the
    decode contention learned from the replayed requests (``PlacementConfig.contention_weight``),
    kvmesh "relieves" busy holders and the requests' latency to their last token (p90) drops, at a
    few hits' cost; with the term off it keeps its holders."""
    from policies.placement import PlacementConfig

    cfg = OpenConfig(step_s=0.17, row_s=0.03, token_s=0.006)
    run = stages((2.4,), stage_s=30.0, seed=0, trace=True)
    on = simulate(run, "kvmesh", cfg)
    off = simulate(run, "kvmesh", cfg, PlacementConfig(contention_weight=0.0))
    assert on["decisions"].get("relieve", 0) > 0 and off["decisions"].get("relieve", 0) == 0
    assert on["stages"][0]["latency_p90"] < off["stages"][0]["latency_p90"]
    assert on["hit_vs_oracle"] > 0.8


def test_the_other_workloads_run_in_the_benchs_order_on_the_caches_left_before_them():
    """--workload others: the steady sweep and the hot series as warm-ups, then multi-turn, the
    multi-tenant mix and the trace, one scored stage each; seed 0 sends the bench's own items (its
    trace file's first 32 records at half their timestamps), other seeds fresh ones."""
    import json
    from pathlib import Path

    order = json.loads((Path(__file__).resolve().parents[1] / "bench/traces/ipperf_order_default.json").read_text())
    run = stages((0.5, 1.0), stage_s=30.0, seed=0, warmup_stages=4, order=order, others=True)
    scored = [st for st in run if not st.warmup]
    assert [st.rate for st in scored] == [0.5, 0.8, 4.0] and len(run) > 3
    chat, mix, trace = scored
    assert len(chat.items) == 18 and {it.domain for it in chat.items} == {"bench"}
    assert len(mix.items) == 32 and {it.tenant for it in mix.items} == {"acme", "globex", "initech"}
    assert len(trace.items) == 32 and trace.items[-1].at_s == pytest.approx((15.600 - 0.259) * 0.5)
    other = [st for st in stages((0.5, 1.0), stage_s=30.0, seed=1, warmup_stages=4, order=order, others=True)
             if not st.warmup][2]
    assert [it.prompt_ids for it in other.items] != [it.prompt_ids for it in trace.items]


def test_a_pool_filled_by_a_tenant_that_stopped_sending_takes_the_next_workload():
    """The bench's order, seed 0: the multi-tenant mix leaves one worker's pool full of its
    tenants' prefixes and first prompts (116 blocks of 128), and the trace, another tenant's,
    comes seconds later. Counting them against every copy (as before session 33) leaves that
    worker without a single trace request while the others decode; with the mix's tenants read
    as idle (``PlacementConfig.domain_idle_gaps``), all four serve it."""
    import json
    from pathlib import Path

    from policies.placement import PlacementConfig

    order = json.loads((Path(__file__).resolve().parents[1] / "bench/traces/ipperf_order_default.json").read_text())
    run = stages((0.5, 1.0, 2.0, 3.0), stage_s=30.0, seed=0, warmup_stages=4, order=order, others=True)
    cfg = OpenConfig(step_s=0.17, row_s=0.03, token_s=0.006)
    new = simulate(run, "kvmesh", cfg, PlacementConfig(), learn_decode=True)["stages"][-1]
    old = simulate(run, "kvmesh", cfg, PlacementConfig(domain_idle_gaps=0.0), learn_decode=True)["stages"][-1]
    assert len(old["per_worker"]) == 3 and len(new["per_worker"]) == 4
