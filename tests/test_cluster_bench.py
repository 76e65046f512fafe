"""The pieces of bench/cluster.py that need neither root nor SSH: the generated ray-up and Serve
configs, the KV sizing, the throughput-at-equal-p99 interpolation, the summary keys, the metrics
and inference-perf report parsing."""

import json
import time
from pathlib import Path

import pytest
import yaml

from bench import cluster_report as report
from bench import cluster_setup as setup
from bench import ipperf, rayup

SHAPE = setup.ModelShape(layers=30, kv_heads=3, head_dim=64)


@pytest.fixture(autouse=True)
def _ray_auth_mode_kept():
    """``bench.cluster`` imports ``bench.netlab``, which sets ``RAY_AUTH_MODE=token`` for its
    drivers; left set, a later test's local ``ray.init`` in this process failed to reach its own
    GCS (``pytest tests/test_cluster_bench.py tests/test_router_metrics.py``). Restored after
    each test here."""
    import os

    before = os.environ.get("RAY_AUTH_MODE")
    yield
    if before is None:
        os.environ.pop("RAY_AUTH_MODE", None)
    else:
        os.environ["RAY_AUTH_MODE"] = before


def test_sibling_ray_up_config_changes_only_what_the_run_needs():
    shipped = rayup.load_shipped()
    cfg = rayup.sibling_config(shipped, cluster_name="kvmesh-bench-x", head_ip="10.9.1.2",
                               worker_ips=["10.9.2.2", "10.9.3.2"], key=Path("/k/id"), venv=Path("/v"))
    assert cfg["provider"] == {**shipped["provider"], "head_ip": "10.9.1.2", "worker_ips": ["10.9.2.2", "10.9.3.2"]}
    assert cfg["auth"] == {"ssh_user": "root", "ssh_private_key": "/k/id"} and cfg["max_workers"] == 2
    assert cfg["file_mounts"] == shipped["file_mounts"] and cfg["rsync_exclude"][:-1] == shipped["rsync_exclude"]
    head = " ".join(cfg["head_start_ray_commands"])
    assert "--node-ip-address=10.9.1.2" in head and shipped["provider"]["head_ip"] not in head
    assert "--num-cpus=0" in head and "RAY_enable_autoscaler_v2=0" in head
    worker = cfg["worker_start_ray_commands"][-1]
    assert "--num-cpus=1" in worker and "--address=$RAY_HEAD_IP:6379" in worker
    assert all(f"--{k}={v}" in worker for k, v in rayup.FIXED_PORTS.items())
    assert cfg["setup_commands"] == ["mkdir -p ~/kvmesh && ln -sfn /v ~/kvmesh/.venv"]
    assert shipped["cluster_name"] != cfg["cluster_name"] and shipped == rayup.load_shipped()  # not mutated


def test_shipped_ray_up_config_names_the_head_address_in_its_start_command():
    shipped = rayup.load_shipped()
    assert f"--node-ip-address={shipped['provider']['head_ip']}" in " ".join(shipped["head_start_ray_commands"])


def test_kv_pool_sized_so_prefixes_need_the_ratio():
    b = setup.kv_cache_bytes(12 * 512, 3.0, SHAPE)
    assert SHAPE.kv_bytes_per_token == 46080
    assert b == 128 * 16 * 46080 and setup.pool_ratio(12 * 512, b, SHAPE) == pytest.approx(3.0)
    assert 3.0 <= setup.pool_ratio(1000, setup.kv_cache_bytes(1000, 3.0, SHAPE), SHAPE) < 3.2  # whole blocks
    with pytest.raises(ValueError):
        setup.kv_cache_bytes(0, 3.0, SHAPE)


@pytest.mark.parametrize("name", setup.CONFIGS)
def test_serve_configs_are_the_shipped_ones_with_the_users_edits(name):
    from ray.serve.schema import ServeDeploySchema

    cfg = setup.serve_config(name, host="10.9.1.2", port=8000, workers=4, kv_bytes=12345, tenants_path="/t.yaml")
    ServeDeploySchema.model_validate(cfg)
    shipped = yaml.safe_load(setup.SHIPPED_SERVE[name].read_text())
    app, ship = cfg["applications"][0], shipped["applications"][0]
    assert cfg["http_options"] == {"host": "10.9.1.2", "port": 8000}
    assert app["import_path"] == ship["import_path"]
    assert app["args"]["workers"] == 4 and app["args"]["kv_cache_bytes"] == 12345 and app["args"]["tenants"] == "/t.yaml"
    assert app["args"]["worker_num_cpus"] == 1
    if name.startswith("kvmesh"):
        assert app["args"]["max_workers"] == 4
    else:
        assert [d["num_replicas"] for d in app["deployments"]] == [4]
        assert ("request_router_config" in app["deployments"][0]) == (name == "affinity")
    if name == "affinity":
        assert app["deployments"][0]["request_router_config"]["request_router_class"].endswith(
            "prefix_aware_router:PrefixCacheAffinityRouter")
    with pytest.raises(ValueError):
        setup.serve_config("roundrobin", host="h", port=1, workers=1, kv_bytes=1, tenants_path="/t")


def test_tenants_file_parses_and_only_approx_serves_the_template_approximately():
    from bench.workloads import multi_tenant_tenants
    from policies.tenancy import Tenants

    for name in setup.CONFIGS:
        data = setup.tenants_file(name, multi_tenant_tenants(), "Say {x} now")
        t = Tenants.from_dict(data)
        tmpl = t.authenticate(f"sk-{setup.TEMPLATE_TENANT}")
        assert tmpl.reuse == ("approximate" if name == "kvmesh+approx" else "exact")
        assert dict(tmpl.templates) == {setup.TEMPLATE_ID: "Say {x} now"}
        assert t.authenticate("sk-bench").name == "bench" and t.authenticate("sk-globex").name == "globex"


def P(rate, thr, p99, p90=None, errors=0):
    return report.Point(rate, thr, p99 / 2, p90 if p90 is not None else p99 * 0.8, p99, errors)


def test_throughput_at_latency_interpolates_on_the_curve():
    curve = [P(1, 1.0, 0.5), P(2, 2.0, 1.5), P(3, 2.4, 5.5)]
    assert report.throughput_at(curve, 1.0).throughput == pytest.approx(1.5)
    assert report.throughput_at(curve, 3.5).throughput == pytest.approx(2.2)
    top = report.throughput_at(curve, 10.0)
    assert top.throughput == 2.4 and top.lower_bound
    assert report.throughput_at(curve, 0.1).throughput is None


def test_equal_p99_ratio_is_taken_at_the_baselines_saturated_latency():
    kv = [P(1, 1.0, 0.3), P(2, 2.0, 0.6), P(3, 3.0, 2.0)]
    base = [P(1, 1.0, 0.8), P(2, 1.5, 1.3)]  # saturates at 1.5 req/s with p99 1.3 s
    r = report.equal_p99_ratio(kv, base)
    assert r["p99_ttft_s"] == 1.3 and r["baseline_throughput"] == 1.5
    assert r["throughput"] == pytest.approx(2.0 + (1.3 - 0.6) / 1.4) and not r["lower_bound"]
    assert r["ratio"] == pytest.approx(r["throughput"] / 1.5)


def test_summary_has_the_contract_keys_and_p90_at_the_highest_common_sustained_rate():
    curves = {"kvmesh": [P(1, 1.0, 0.3, 0.2), P(2, 2.0, 0.6, 0.4), P(3, 2.9, 0.9, 0.5)],
              "affinity": [P(1, 1.0, 1.0, 0.8), P(2, 1.9, 3.0, 2.0), P(3, 2.0, 9.0, 6.0)],
              "pow2": [P(1, 1.0, 2.0, 1.6), P(2, 1.8, 6.0, 4.0), P(3, 1.9, 20.0, 12.0)]}
    s = report.summary(curves, {"kvmesh": 950, "affinity": 600, "pow2": 300}, 1000)
    assert s["hit_tokens_vs_oracle"] == {"kvmesh": 0.95, "affinity": 0.6, "pow2": 0.3, "oracle": 1.0}
    assert set(s["throughput_at_equal_p99_ttft"]) == {"kvmesh_vs_affinity", "kvmesh_vs_pow2"}
    assert s["ttft_p90_rate"] == {"rate": 2, "all_sustained": True}  # at 3 req/s affinity/pow2 fall behind
    assert s["ttft_p90_affinity_over_kvmesh"] == pytest.approx(2.0 / 0.4)
    t = report.targets(s)
    assert t["hit_tokens_vs_oracle"]["met"] and t["ttft_p90_affinity_over_kvmesh"]["met"]
    assert set(t) == {"hit_tokens_vs_oracle", "kvmesh_vs_affinity", "kvmesh_vs_pow2", "ttft_p90_affinity_over_kvmesh"}


def S(rate, thr, samples):
    """A stage with each request's TTFT (``samples``), its percentiles computed from them."""
    from bench.loadgen import percentile

    ok = [x for x in samples if x is not None]
    return report.Point(rate, thr, percentile(ok, 50), percentile(ok, 90), percentile(ok, 99), samples=tuple(samples))


def test_bootstrap_resamples_the_same_requests_for_every_configuration():
    """Two configurations that measured the same: paired resamples (the same request indices in
    each stage) give the ratio 1 every time; independent resamples would spread it."""
    curve = [S(1, 1.0, [0.3 + 0.01 * i for i in range(20)]), S(2, 1.6, [0.5 + 0.1 * i for i in range(20)])]
    b = report.bootstrap({"kvmesh": curve, "affinity": list(curve)}, replicates=200)
    assert b["paired_stages"] == 2 and b["replicates"] == 200
    ka = b["kvmesh_vs_affinity"]
    assert ka["p05"] == pytest.approx(1.0) and ka["p95"] == pytest.approx(1.0) and ka["met_share"] == 0.0
    assert b["ttft_p90_affinity_over_kvmesh"]["p50"] == pytest.approx(1.0)


def test_bootstrap_shows_a_ratio_set_by_one_slow_request():
    """kvmesh carries more (1.8 against 1.5 req/s) but one request of its top stage took 30 s
    (a recompute): the measured ratio is below 1; in the resamples without that request (about
    (19/20)^20 = 36% of them) kvmesh's p99 never reaches affinity's and the ratio is its top
    throughput over affinity's, a lower bound."""
    kv = [S(1, 1.0, [0.5] * 20), S(2, 1.8, [1.0] * 19 + [30.0])]
    aff = [S(1, 1.0, [0.5] * 20), S(2, 1.5, [1.0] * 19 + [2.0])]
    curves = {"kvmesh": kv, "affinity": aff}
    s = report.summary(curves, {"kvmesh": 1, "affinity": 1}, 1)
    assert s["throughput_at_equal_p99_ttft"]["kvmesh_vs_affinity"] < 0.8
    b = s["bootstrap"]["kvmesh_vs_affinity"]
    assert b["p05"] < 0.8 and b["p95"] == pytest.approx(1.8 / 1.5) and b["met_share"] == 0.0
    assert 0.25 < b["lower_bound_share"] < 0.47 and b["none_share"] == 0.0
    t = report.targets(s)["kvmesh_vs_affinity"]
    assert t["interval_90"] == [b["p05"], b["p95"]] and t["met_share"] == 0.0


def test_bootstrap_needs_every_stages_samples_and_skips_failed_requests():
    assert report.bootstrap({"kvmesh": [P(1, 1.0, 0.5)], "affinity": [P(1, 1.0, 0.6)]}) == {}
    assert "bootstrap" not in report.summary({"kvmesh": [P(1, 1.0, 0.5)], "affinity": [P(1, 1.0, 0.6)]},
                                             {"kvmesh": 1, "affinity": 1}, 1)
    p = S(1, 1.0, [0.2, None, 0.4])
    assert report.resampled(p, [1, 1, 2]).ttft_p99 == pytest.approx(0.4)  # the failed one counts for nothing
    assert report.resampled(p, [1, 1]) == p  # nothing but failures: the stage as measured


def test_a_stage_is_sustained_against_the_rate_really_offered():
    """inference-perf's Poisson stages send over a random span: a stage that really got 0.28 req/s
    of a nominal 0.4 and completed 0.26 kept up; one that got 0.51 and completed 0.40 did not."""
    assert report.Point(0.4, 0.26, 1.0, 2.0, 3.0, offered=0.28).sustained
    assert not report.Point(0.4, 0.26, 1.0, 2.0, 3.0).sustained  # against the nominal rate
    assert not report.Point(0.4, 0.40, 1.0, 2.0, 3.0, offered=0.51).sustained


def test_prometheus_parsing_and_decision_deltas():
    from bench.cluster import decisions, metrics_delta, parse_prometheus

    a = parse_prometheus('kvmesh_routes_total{route="local",tenant="bench"} 3\n# HELP x\n'
                         'kvmesh_router_bytes_pulled 100\nkvmesh_ttft_seconds_bucket{le="1"} 4\n')
    b = parse_prometheus('kvmesh_routes_total{route="local",tenant="bench"} 5\n'
                         'kvmesh_routes_total{route="pulled",tenant="bench"} 2\n'
                         'kvmesh_router_bytes_pulled 4196\nkvmesh_router_decisions{kind="pull"} 2\n')
    b["kvmesh_router_groups{worker=\"w0\"}"] = 3.0
    d = decisions(metrics_delta(a, b), b)
    assert d["routes"] == {"local": 2, "pulled": 2} and d["bytes_pulled"] == 4096
    assert d["router_decisions"] == {"pull": 2}
    assert d["groups_per_worker"] == {"w0": 3.0}  # a gauge: its value now, not a delta
    assert d["stage_means_s"] == {}  # no stage histogram in these scrapes


def test_stage_means_from_histogram_deltas_over_tenants():
    from bench.cluster import metrics_delta, parse_prometheus, stage_means

    def scrape(n_a, sum_a, n_b, sum_b):
        return parse_prometheus(
            f'kvmesh_request_stage_seconds_bucket{{le="0.1",stage="lease",tenant="a"}} {n_a}\n'
            f'kvmesh_request_stage_seconds_count{{stage="lease",tenant="a"}} {n_a}\n'
            f'kvmesh_request_stage_seconds_sum{{stage="lease",tenant="a"}} {sum_a}\n'
            f'kvmesh_request_stage_seconds_count{{stage="lease",tenant="b"}} {n_b}\n'
            f'kvmesh_request_stage_seconds_sum{{stage="lease",tenant="b"}} {sum_b}\n'
            'kvmesh_request_stage_seconds_count{stage="prefill",tenant="a"} 7\n'
            'kvmesh_request_stage_seconds_sum{stage="prefill",tenant="a"} 9.0\n')

    # between the scrapes: 2 requests of a (0.2 s) and 2 of b (0.6 s) leased; nothing prefilled
    m = stage_means(metrics_delta(scrape(3, 0.3, 1, 0.1), scrape(5, 0.5, 3, 0.7)))
    assert m == {"lease": 0.2}


def test_inference_perf_reports_become_results_with_usage_and_prompts(tmp_path):
    entries = [{"start_time": 10.0 + i, "end_time": 11.0 + i, "request": json.dumps({"prompt": f"p{i}"}),
                "info": {"response_metrics": {"server_usage": {"prompt_tokens": 100, "completion_tokens": 16,
                                                               "prompt_tokens_details": {"cached_tokens": 64 * i}}}},
                "computed_metrics": {"time_to_first_token": 0.1 * (i + 1), "request_latency": 1.0,
                                     "time_per_output_token": 0.05}, "error": None} for i in range(3)]
    (tmp_path / "per_request_lifecycle_metrics.json").write_text(json.dumps(entries[::-1]))
    (tmp_path / "stage_0_lifecycle_metrics.json").write_text(json.dumps({"load_summary": {"count": 3}}))
    (rs,), (ps,) = ipperf.results(tmp_path, 1)
    assert ps == ["p0", "p1", "p2"] and [r.cached_tokens for r in rs] == [0, 64, 128]
    assert [r.sent_s for r in rs] == [0.0, 1.0, 2.0] and rs[2].ttft_s == pytest.approx(0.3) and all(r.ok for r in rs)
    # two stages (one run of the steady sweep), wall-clock start times kept
    (tmp_path / "stage_0_lifecycle_metrics.json").write_text(json.dumps({"load_summary": {"count": 1}}))
    (tmp_path / "stage_1_lifecycle_metrics.json").write_text(json.dumps({"load_summary": {"count": 2}}))
    (r0, r1), (p0, p1) = ipperf.results(tmp_path, 2, relative=False)
    assert (p0, p1) == (["p0"], ["p1", "p2"]) and [r.sent_s for r in r0 + r1] == [10.0, 11.0, 12.0]


def test_inference_perf_config_uses_its_shared_prefix_generator_and_a_poisson_sweep(tmp_path):
    spec = ipperf.SharedPrefixSpec(12, 8, 512, 40, 16, seed=3)
    c = ipperf.config(spec, [0.5, 1.0], 30, "http://10.9.1.2:8000", "sk-bench", "m", "/tok", tmp_path)
    assert c["data"]["type"] == "shared_prefix" and c["data"]["shared_prefix"]["num_groups"] == 12
    assert c["load"]["type"] == "poisson" and [s["rate"] for s in c["load"]["stages"]] == [0.5, 1.0]
    assert c["server"]["api_key"] == "sk-bench" and c["api"]["streaming"]
    assert spec.distinct_prefix_tokens == 12 * 512 and spec.prompts == 96


def test_inference_perf_stages_may_have_their_own_durations(tmp_path):
    spec = ipperf.SharedPrefixSpec(12, 8, 512, 40, 16, seed=3)
    c = ipperf.config(spec, [0.5, 0.5, 1.0], [48, 30, 30], "http://10.9.1.2:8000", "sk", "m", "/tok", tmp_path)
    assert [(s["rate"], s["duration"]) for s in c["load"]["stages"]] == [(0.5, 48), (0.5, 30), (1.0, 30)]
    with pytest.raises(ValueError):
        ipperf.config(spec, [0.5, 1.0], [30], "http://10.9.1.2:8000", "sk", "m", "/tok", tmp_path)


def test_seeded_arrivals_run_inference_perf_through_the_seeding_wrapper():
    exe = Path("/venv/bin/inference-perf")
    assert ipperf.command(exe, Path("c.yaml")) == ["/venv/bin/inference-perf", "--config_file", "c.yaml"]
    cmd = ipperf.command(exe, Path("c.yaml"), arrival_seed=4000)
    assert cmd[0] == "/venv/bin/python" and cmd[1].endswith("bench/ipperf_seeded.py") and Path(cmd[1]).exists()
    assert cmd[2:] == ["--config_file", "c.yaml"]


def test_the_warm_up_lasts_until_every_group_was_sent_within_its_bounds(tmp_path, monkeypatch):
    from bench import cluster as cb

    assert ipperf.requests_to_cover([7, 8, 7, 1, 8, 0, 1, 3, 0]) == 8
    assert ipperf.requests_to_cover([2, 2]) == 1
    spec = ipperf.SharedPrefixSpec(4, 10, 512, 40, 16, seed=3)

    class FakeCluster:
        base_url = "http://127.0.0.1:1"

    order = [0, 1, 0, 1, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 3]  # group 3 first at request 15
    monkeypatch.setattr(cb.ipperf, "group_order", lambda exe, path: order)
    assert cb.warmup_stage(spec, 0.5, 10, 40, "exe", tmp_path, FakeCluster(), "/m") == \
        (30, "15 requests, every group by request 15")
    assert cb.warmup_stage(spec, 0.5, 10, 20, "exe", tmp_path, FakeCluster(), "/m") == \
        (20, "10 requests, 15 needed to show every group")  # capped
    assert cb.warmup_stage(spec, 2.0, 10, 40, "exe", tmp_path, FakeCluster(), "/m")[0] == 10  # at least a stage
    assert cb.warmup_stage(spec, 0.5, 10, 0, "exe", tmp_path, FakeCluster(), "/m") == (10, "one stage")

    def broken(exe, path):
        raise RuntimeError("no venv")

    monkeypatch.setattr(cb.ipperf, "group_order", broken)
    secs, why = cb.warmup_stage(spec, 0.5, 10, 40, "exe", tmp_path, FakeCluster(), "/m")
    assert secs == 10 and "no venv" in why


def _stage(rate, thr, p99, cached, oracle):
    return {"rate": rate, "ok": 10, "requests": 10, "errors": 0, "request_throughput": thr,
            "output_token_throughput": thr * 16, "goodput": thr, "ttft_s": {"p50": p99 / 2, "p90": p99 * 0.8, "p99": p99},
            "tpot_s": {"p50": 0.1}, "hit": {"cached_tokens": cached, "oracle_cached_tokens": oracle,
                                            "vs_oracle": cached / oracle}}


def test_finish_summarises_the_hot_prefix_series_apart_from_the_shared_prefix_one(tmp_path):
    from bench.cluster import finish

    doc = {"machine": {}, "load_avg": {}, "configs": {
        "kvmesh": {"shared_prefix": [_stage(1, 1.0, 1.0, 90, 100), _stage(2, 1.8, 2.0, 95, 100)],
                   "hot_prefix": [_stage(1, 1.0, 0.5, 100, 100), _stage(2, 2.0, 1.0, 100, 100)]},
        "affinity": {"shared_prefix": [_stage(1, 1.0, 1.5, 100, 100), _stage(2, 1.6, 4.0, 100, 100)],
                     "hot_prefix": [_stage(1, 1.0, 1.0, 100, 100), _stage(2, 1.0, 8.0, 100, 100)]}}}
    finish(doc, tmp_path / "cluster.json")
    s = json.loads((tmp_path / "cluster.json").read_text())["summary"]
    assert s["hit_tokens_vs_oracle"] == {"kvmesh": 0.925, "affinity": 1.0, "oracle": 1.0}
    hot = s["hot_prefix"]
    assert hot["hit_tokens_vs_oracle"] == {"kvmesh": 1.0, "affinity": 1.0, "oracle": 1.0}
    # affinity saturates at 1.0 req/s (p99 8 s); kvmesh reaches 2.0 req/s at p99 1 s
    assert hot["throughput_at_equal_p99_ttft"]["kvmesh_vs_affinity"] == pytest.approx(2.0)
    assert s["throughput_at_equal_p99_ttft"]["kvmesh_vs_affinity"] != hot["throughput_at_equal_p99_ttft"]["kvmesh_vs_affinity"]
    assert (tmp_path / "cluster.png").exists()


def _reports(d: Path, stages: list[list[float]]) -> None:
    """inference-perf's reports of one steady sweep whose stages' requests had these TTFTs."""
    d.mkdir(parents=True)
    ttfts = [t for st in stages for t in st]
    entries = [{"start_time": 10.0 + i, "end_time": 11.0 + i, "request": json.dumps({"prompt": f"p{i}"}),
                "info": {"response_metrics": {"server_usage": {"prompt_tokens": 100, "completion_tokens": 16}}},
                "computed_metrics": {"time_to_first_token": t, "request_latency": 1.0, "time_per_output_token": 0.05},
                "error": None} for i, t in enumerate(ttfts)]
    (d / "per_request_lifecycle_metrics.json").write_text(json.dumps(entries))
    for k, st in enumerate(stages):
        (d / f"stage_{k}_lifecycle_metrics.json").write_text(json.dumps({"load_summary": {"count": len(st)}}))


def test_resummarize_fills_in_a_written_runs_samples_from_its_reports(tmp_path):
    """A run written before stages kept their requests' TTFTs gets them from inference-perf's
    reports in its run directory (a paired run's under <configuration>/cluster_run), checked
    against the p99 it recorded, and its summary gains the bootstrap intervals."""
    from bench.cluster import resummarize

    kv, aff = [[0.1], [0.2, 0.3], [0.4, 0.9]], [[0.1], [0.3, 0.5], [0.6, 2.0]]  # warm-up first
    _reports(tmp_path / "run" / "kvmesh-shared-steady" / "reports", kv)
    _reports(tmp_path / "run" / "affinity" / "cluster_run" / "affinity-shared-steady" / "reports", aff)

    def stages(ttfts):
        out = []
        for rate, st in zip((1, 2), ttfts[1:]):
            x = _stage(rate, 0.9 * rate, max(st), 90, 100)
            x["requests"] = len(st)
            x["ttft_s"]["p99"] = st[0] + 0.99 * (st[1] - st[0])
            out.append(x)
        return out

    doc = {"machine": {}, "load_avg": {}, "configs": {"kvmesh": {"shared_prefix": stages(kv)},
                                                      "affinity": {"shared_prefix": stages(aff)}}}
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(doc))
    resummarize(path, tmp_path / "run")
    out = json.loads(path.read_text())
    assert [st["ttft_samples_s"] for st in out["configs"]["kvmesh"]["shared_prefix"]] == kv[1:]
    assert [st["ttft_samples_s"] for st in out["configs"]["affinity"]["shared_prefix"]] == aff[1:]
    assert out["summary"]["bootstrap"]["kvmesh_vs_affinity"]["p50"] > 0
    assert "interval_90" in out["targets"]["kvmesh_vs_affinity"]
    # reports that do not give the recorded figures stop it, the document untouched
    doc["configs"]["kvmesh"]["shared_prefix"][1]["ttft_s"]["p99"] = 5.0
    path.write_text(json.dumps(doc))
    with pytest.raises(SystemExit, match="does not match"):
        resummarize(path, tmp_path / "run")
    assert json.loads(path.read_text()) == doc


def test_ratios_adjusted_to_the_speed_each_configuration_met():
    # kvmesh's stages met hosts 20% slower (one-row decode steps 0.24 s against 0.20 s)
    speed = report.host_speed({"kvmesh": [0.24, None, 0.22, 0.26], "affinity": [0.20, 0.19, 0.21], "pow2": [None]})
    assert speed == {"kvmesh": pytest.approx(0.24), "affinity": pytest.approx(0.20), "pow2": None}
    adj = report.speed_adjusted({"kvmesh_vs_affinity": 1.0, "kvmesh_vs_pow2": 1.5}, speed)
    assert adj == {"kvmesh_vs_affinity": pytest.approx(1.2), "kvmesh_vs_pow2": None}  # no pow2 speed: no estimate
    assert report.speed_adjusted({"kvmesh_vs_affinity": None}, speed) == {"kvmesh_vs_affinity": None}


def test_finish_and_host_speed_report_the_speed_adjusted_ratio(tmp_path):
    from bench import host_speed
    from bench.cluster import finish

    def stage(k, rate, p99, step):
        return dict(_stage(k, rate, p99, 100, 100), engine_steps={"decode_1row_s": step})

    doc = {"machine": {}, "load_avg": {}, "configs": {
        "kvmesh": {"shared_prefix": [stage(1, 1.0, 1.0, 0.24), stage(2, 1.8, 2.0, 0.24)]},
        "affinity": {"shared_prefix": [stage(1, 1.0, 1.5, 0.2), stage(2, 1.6, 4.0, 0.2)]}}}
    finish(doc, tmp_path / "cluster.json")
    s = json.loads((tmp_path / "cluster.json").read_text())["summary"]
    raw = s["throughput_at_equal_p99_ttft"]["kvmesh_vs_affinity"]
    assert s["host_speed_decode_1row_s"] == {"kvmesh": pytest.approx(0.24), "affinity": pytest.approx(0.2)}
    assert s["throughput_at_equal_p99_ttft_speed_adjusted"]["kvmesh_vs_affinity"] == pytest.approx(raw * 1.2)
    # a run recorded without decode_1row_s: read from the step traces over each stage's window
    for st in doc["configs"]["kvmesh"]["shared_prefix"] + doc["configs"]["affinity"]["shared_prefix"]:
        del st["engine_steps"]
    doc["configs"]["kvmesh"]["shared_prefix"][0]["wall_clock"] = [100.0, 200.0]
    (tmp_path / "old.json").write_text(json.dumps(doc))
    steps_dir = tmp_path / "steps" / "kvmesh"
    steps_dir.mkdir(parents=True)
    recs = [{"ev": "step", "t": 150.0, "dt": 0.3, "tok": {"b": 1}, "rows": {"b": 1}},
            {"ev": "step", "t": 250.0, "dt": 9.0, "tok": {"b": 1}, "rows": {"b": 1}}]  # outside the stage
    (steps_dir / "w1-steps-1.jsonl").write_text("\n".join(json.dumps(r) for r in recs))
    (row,) = host_speed.main([str(tmp_path / "old.json"), "--steps", str(tmp_path / "steps")])
    assert row["shared_prefix"]["stage_decode_1row_s"]["kvmesh"] == [0.3, None]
    assert row["shared_prefix"]["host_speed_decode_1row_s"] == {"kvmesh": 0.3, "affinity": None}
    host_speed.main([str(tmp_path / "old.json"), "--steps", str(tmp_path / "steps"), "--update"])
    s = json.loads((tmp_path / "old.json").read_text())["summary"]  # redone with the speeds written in
    assert s["host_speed_decode_1row_s"] == {"kvmesh": 0.3, "affinity": None}
    assert s["throughput_at_equal_p99_ttft_speed_adjusted"] == {"kvmesh_vs_affinity": None}
    assert (tmp_path / "old.png").exists()


def test_group_traffic_counts_each_stages_requests_per_system_prompt():
    from bench.cluster import group_traffic

    a, b = "a" * 64, "b" * 64
    g = group_traffic([a + " q1", b + " q2", a + " q3", a + " q4"])
    assert g == {"groups": 2, "top_share": 0.75, "counts": [3, 1]}
    assert group_traffic([]) == {"groups": 0, "top_share": None, "counts": []}


def test_worker_cpu_share_is_worker_cores_over_the_hosts_capacity():
    from bench.cluster import worker_cpu_share

    stage = dict(_stage(1, 1.0, 1.0, 90, 100), run_s=50.0, cpu={"cpu_s": {"worker": 40.0, "router": 5.0}})
    doc = {"args": {"workers": 4, "node_cpus": 0.4}, "configs": {"kvmesh": {"shared_prefix": [stage, _stage(2, 1.8, 2.0, 95, 100)]}}}
    assert worker_cpu_share(doc) == {"kvmesh": [{"rate": 1, "worker_cores": 0.8, "share": 0.5}]}
    doc["args"]["node_cpus"] = 0  # hosts share the machine's cores: no capacity to divide by
    assert worker_cpu_share(doc)["kvmesh"][0]["share"] is None


def test_a_noisy_curve_whose_p99_falls_with_load_still_gets_a_ratio():
    # affinity's p99 at its higher rate came out below the one at its lower rate (short stages):
    # its saturated p99 is its curve's highest so far, 2.23 s, not 1.98 s it never "reached"
    base = [P(0.7, 0.69, 2.23), P(1.3, 1.09, 1.98)]
    kv = [P(0.7, 0.55, 1.84), P(1.3, 1.29, 4.34)]
    r = report.equal_p99_ratio(kv, base)
    assert r["p99_ttft_s"] == pytest.approx(2.23) and r["baseline_throughput"] == pytest.approx(1.09)
    assert r["throughput"] == pytest.approx(0.55 + (2.23 - 1.84) / (4.34 - 1.84) * (1.29 - 0.55))
    assert [p.ttft_p99 for p in report.monotone(base)] == [2.23, 2.23]


def test_cpu_quota_is_cpus_times_period_with_the_kernel_floor():
    from bench import cpuquota

    assert cpuquota.quota_us(0.4, 20_000) == 8_000
    assert cpuquota.quota_us(0.01, 20_000) == 1_000  # the kernel refuses quotas under 1 ms
    with pytest.raises(ValueError):
        cpuquota.quota_us(0, 20_000)


def _cgroups_writable() -> bool:
    import os

    from bench import cpuquota

    try:
        root, _ = cpuquota.cgroup_root()
    except (RuntimeError, OSError):
        return False
    return os.geteuid() == 0 and os.access(root, os.W_OK)


@pytest.mark.skipif(not _cgroups_writable(), reason="needs root and a writable cgroup cpu controller")
def test_a_process_started_in_a_host_cgroup_is_held_to_its_quota_and_the_cgroup_is_removed():
    import subprocess
    import uuid

    from bench import cpuquota

    name = f"kvtest-{uuid.uuid4().hex[:8]}"
    with cpuquota.cpu_cgroup(name, 0.1) as cg:
        # the same wrapper sshhosts uses: the shell enters the cgroup, then execs the host command
        spin = ["python3", "-c", "import time\nt=time.time()\nwhile time.time()-t<0.5: pass"]
        p = subprocess.run(["sh", "-c", f'{cpuquota.enter_command(cg)} && exec "$@"', "sh", *spin], timeout=60)
        assert p.returncode == 0
        stats = cpuquota.throttled(cg)
        assert stats["periods"] > 0 and stats["throttled"] > 0  # a busy loop over 0.1 core is throttled
    assert not cg.exists()


def test_kvmesh_args_are_parsed_as_yaml_values():
    from bench.cluster import parse_args

    a = parse_args(["--kvmesh-args", "router_learn_decode=false,max_num_seqs=8"])
    assert a.kvmesh_args == {"router_learn_decode": False, "max_num_seqs": 8}
    assert parse_args([]).kvmesh_args == {}


def test_sampler_cuts_a_run_at_wall_clock_times():
    """bench/cluster.Sampler.at: the first sample at or after a time, else the last."""
    from bench.cluster import Sampler

    s = Sampler.__new__(Sampler)
    s.samples = [(1.0, {"worker": 0.0}, {}), (6.0, {"worker": 2.0}, {}), (11.0, {"worker": 5.0}, {})]
    assert s.at(0.5)[0] == 1.0 and s.at(6.0)[0] == 6.0 and s.at(6.1)[0] == 11.0 and s.at(99.0)[0] == 11.0


def test_step_traces_tell_where_a_request_waited(tmp_path):
    """bench/steps.py over two engines' traces: engine-side TTFT (add -> first token), requests that
    arrived at a busy engine while the other was idle, and the window's bounds."""
    from bench import steps

    a = [{"ev": "add", "t": 10.0, "n": 0, "running": 0, "waiting": 0},
         {"ev": "step", "t": 10.0, "dt": 2.0, "tok": {"b": 512}, "rows": {"b": 1}},
         {"ev": "first", "t": 12.0, "n": 0},
         {"ev": "add", "t": 12.5, "n": 1, "running": 1, "waiting": 0},  # arrives while n=0 decodes
         {"ev": "step", "t": 12.1, "dt": 0.5, "cpu": 0.15, "tok": {"b": 1}, "rows": {"b": 1}, "preempted": 2, "room": 0},
         {"ev": "step", "t": 12.6, "dt": 2.4, "cpu": 0.9, "tok": {"b": 513}, "rows": {"b": 2}, "preempted": 5,
          "room": 1},
         {"ev": "first", "t": 15.0, "n": 1},
         {"ev": "add", "t": 30.0, "n": 2, "running": 0, "waiting": 0}]  # outside the window
    b = [{"ev": "add", "t": 20.0, "n": 0, "running": 0, "waiting": 0},
         {"ev": "step", "t": 20.0, "dt": 1.0, "tok": {"b": 256}, "rows": {"b": 1}},
         {"ev": "first", "t": 21.0, "n": 0}]
    for name, recs in (("w1-steps-1", a), ("w2-steps-2", b)):
        (tmp_path / f"{name}.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\nnot json\n")
    s = steps.summarize(steps.read(sorted(tmp_path.glob("*.jsonl"))), 0.0, 25.0)
    assert s["requests"] == 3 and s["per_engine"] == {"w1-steps-1": 2, "w2-steps-2": 1}
    # cumulative preemption counters (newer traces): their growth inside the window
    assert s["preemptions"] == {"all": 3, "room": 1}
    assert s["engine_ttft_s"] == {"p50": 2.0, "p90": 2.5}
    assert s["busy_at_add"] == pytest.approx(1 / 3) and s["idle_elsewhere_at_add"] == pytest.approx(1 / 3)
    assert s["prefill_tok_s"] == pytest.approx((511 + 511 + 255) / 5.4)
    assert s["decode_step_s"] == pytest.approx(0.5)
    assert s["decode_rows_mean"] == 1.0 and s["forward_s_per_request"] == pytest.approx(5.9 / 3)
    assert s["decode_1row_s"] == 0.5 and s["decode_1row_steps"] == 1  # the hosts' speed: one-row decode
    # the engine thread's CPU, where traced (older traces have none): one-row steps, all steps
    assert s["decode_1row_cpu_s"] == 0.15 and s["step_cpu_over_wall"] == pytest.approx(1.05 / 2.9)
    assert s["busy_share"] == {"w1-steps-1": pytest.approx(4.9 / 25), "w2-steps-2": pytest.approx(1.0 / 25)}
    assert steps.summarize(steps.read(sorted(tmp_path.glob("*.jsonl"))))["busy_share"] is None


class _FakeCluster:
    """What ``bench/cluster.shared_prefix_steady`` reads of a ``Cluster``: its run directory and URL."""

    def __init__(self, out: Path):
        self.out, self.base_url = out, "http://127.0.0.1:1"


class _FakeSampler:
    """A ``Sampler`` whose sample at any time t reads CPU seconds = t and local routes = t."""

    def __init__(self, cl):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def at(self, t):
        return t, {"worker": t}, {'kvmesh_routes_total{route="local",tenant="bench"}': t}


class _WordTok:
    """A tokenizer of one token per word (equal words, equal tokens)."""

    def encode(self, text, add_special_tokens=True):
        return [sum(map(ord, w)) for w in text.split()]


def test_steady_sweep_is_one_inference_perf_run_cut_into_stages(tmp_path, monkeypatch):
    """bench/cluster.shared_prefix_steady with inference-perf and the cluster faked: one run of a
    warm-up plus every rate over one set of groups, cut into stages by inference-perf's per-stage
    counts; hits against one oracle over the whole run (a group warmed earlier is a hit); the
    offered rate inference-perf reports; CPU and routing counts cut from the sampler at the
    stage's wall-clock window (inference-perf stamps perf_counter())."""
    import argparse
    import time as _time

    from bench import cluster as cb

    prefix = " ".join(["alpha"] * 40)
    prompts = [f"{prefix} q{i}" for i in range(5)]  # one group: every prompt after the first hits
    configs = []

    def fake_run(exe, config_path, log, timeout_s, arrival_seed=None):
        cfg = yaml.safe_load(Path(config_path).read_text())
        configs.append({**cfg, "arrival_seed": arrival_seed})
        out = Path(cfg["storage"]["local_storage"]["path"])
        out.mkdir(parents=True, exist_ok=True)
        t_perf = _time.perf_counter()  # the "run": requests sent every 0.1 s, 0.05 s each
        entries = [{"start_time": t_perf + 0.1 * i, "end_time": t_perf + 0.1 * i + 0.05,
                    "request": json.dumps({"prompt": p}),
                    "info": {"response_metrics": {"server_usage": {
                        "prompt_tokens": 60, "completion_tokens": 4, "prompt_tokens_details": {"cached_tokens": 32 * (i > 0)}}}},
                    "computed_metrics": {"time_to_first_token": 0.01, "request_latency": 0.05,
                                         "time_per_output_token": 0.01}, "error": None} for i, p in enumerate(prompts)]
        (out / "per_request_lifecycle_metrics.json").write_text(json.dumps(entries))
        for k, (n, rate) in enumerate(((1, 0.5), (2, 0.4), (2, 1.9))):
            (out / f"stage_{k}_lifecycle_metrics.json").write_text(
                json.dumps({"load_summary": {"count": n, "achieved_rate": rate}}))
        return 0

    monkeypatch.setattr(cb.ipperf, "run", fake_run)
    monkeypatch.setattr(cb, "Sampler", _FakeSampler)

    # inference-perf's prompt order: every group sent by the 7th request -> a 14-s warm-up at 0.5 req/s
    order = [0, 0, 1, 0, 1, 0, 2, 1, 2]
    monkeypatch.setattr(cb.ipperf, "group_order", lambda exe, path: order)
    args = argparse.Namespace(stage_s=10, groups=3, system_len=512, question_len=40, output_len=16, ttft_slo=2.0,
                              warmup_max_s=40, seeded_arrivals=True, data_seed=0)
    stages = cb.shared_prefix_steady(_FakeCluster(tmp_path), "kvmesh", args, "exe", "/m", _WordTok(), [0.5, 1.5],
                                     lambda m: None)
    cfg = configs[0]
    assert [s["rate"] for s in cfg["load"]["stages"]] == [0.5, 0.5, 1.5]  # warm-up + each rate, one run
    assert [s["duration"] for s in cfg["load"]["stages"]] == [14, 10, 10]
    assert cfg["arrival_seed"] == cfg["data"]["shared_prefix"]["seed"]  # same arrivals for every configuration
    assert stages[0]["warmup_cover"] == "7 requests, every group by request 7"
    assert cfg["data"]["shared_prefix"]["seed"] == 4000  # --data-seed 0: the seed of the runs before it
    assert [s["groups_sent"] for s in stages][1] == {"groups": 1, "top_share": 1.0, "counts": [2]}
    assert cfg["data"]["shared_prefix"]["num_groups"] == 3
    assert cfg["data"]["shared_prefix"]["num_prompts_per_group"] * 3 >= (0.5 + 0.5 + 1.5) * 10  # no repeats
    assert [s["warmup"] for s in stages] == [True, False, False] and [s["requests"] for s in stages] == [1, 2, 2]
    assert [s["offered_rate"] for s in stages] == [0.5, 0.4, 1.9]
    assert [s["ttft_samples_s"] for s in stages] == [[0.01], [0.01, 0.01], [0.01, 0.01]]  # in send order
    assert stages[0]["hit"]["oracle_cached_tokens"] == 0 and stages[1]["hit"]["oracle_cached_tokens"] > 0
    for s in stages:  # wall-clock windows, around now (not perf_counter's epoch)
        t0, t1 = s["wall_clock"]
        # wall-clock seconds (~1.8e9) hold ~2.4e-7 s: compare the span to that, not to 1e-6 relative
        assert abs(t0 - _time.time()) < 60 and t1 - t0 == pytest.approx(0.05 + 0.1 * (s["requests"] - 1), abs=1e-5)
        # cut from the samples at the window's ends
        assert s["cpu"]["cpu_s"]["worker"] == pytest.approx(t1 - t0, abs=0.01)
        assert s["kvmesh_metrics"]["routes"]["local"] == pytest.approx(t1 - t0, abs=1e-5)


def test_mt_compare_groups_runs_and_reads_how_planned_pulls_ended(tmp_path):
    from bench import mt_compare

    def run(name, hits, p50, rows):
        d = {"configs": {"kvmesh": {"workloads": {"multi_tenant": {
            "hit": {"vs_oracle": hits}, "ttft_s": {"p50": p50, "p90": 2 * p50, "p99": 3 * p50},
            "per_request": rows,
            "router_estimates": {"pulls": {"w0": {"holder_missing": 1}, "w1": {"holder_missing": 2}},
                                 "holds": {"w0": {"taken": 3}}}}}}}}
        (tmp_path / name).write_text(json.dumps(d))

    pulled = {"planned_route": "pulled", "route": "pulled", "pull_outcome": "landed", "ttft_s": 2.0, "cached": 400,
              "oracle": 400, "expected_ttft_s": 1.0, "options": {"w0": {"kind": "pulled", "kv_wait_s": 0.5}},
              "timings": {"ttft_s": 1.9, "lease_s": 0.05, "engine_queue_s": None}}
    lost = {"planned_route": "pulled", "route": "recomputed", "pull_outcome": "holder_missing", "ttft_s": 6.0,
            "cached": 0, "oracle": 400}
    run("a_1.json", 0.9, 1.0, [pulled, lost])
    run("a_2.json", 0.8, 3.0, [pulled])
    run("b_1.json", 0.5, 4.0, [lost])
    res = mt_compare.main([f"a={tmp_path}/a_*.json", f"b={tmp_path}/b_*.json", "--out", str(tmp_path / "o.json")])
    a = res["groups"]["a"]
    assert a["summary"]["runs"] == 2 and a["summary"]["hits_vs_oracle"]["mean"] == pytest.approx(0.85)
    assert a["summary"]["planned_pulls"] == 3 and a["summary"]["planned_pulls_run_as_recompute"] == 1
    first = a["runs"][0]
    assert first["pull_outcomes"] == {"landed": 1, "holder_missing": 1} and first["misses"] == 1
    assert first["median_ttft_s_by_route"] == {"local": None, "pulled": 2.0, "recomputed": 6.0}
    assert first["worker_pulls"] == {"holder_missing": 3} and first["worker_holds"] == {"taken": 3}
    # the router's prediction error (rows with an expected TTFT) and responses priced with a KV-pool wait
    assert first["actual_over_expected_ttft"] == {"p50": 2.0, "p90": 2.0} and first["priced_kv_wait"] == 1
    assert a["summary"]["priced_kv_wait"] == 2 and a["summary"]["actual_over_expected_p50"]["mean"] == 2.0
    assert res["groups"]["b"]["runs"][0]["actual_over_expected_ttft"] is None
    # where the time went, from the responses that carry timings (stages not measured left out)
    assert first["stages_s"] == {"ttft": {"p50": 1.9, "p90": 1.9}, "lease": {"p50": 0.05, "p90": 0.05}}
    assert a["summary"]["stages_s"]["lease"] == {"p50": 0.05, "p90": 0.05}
    assert res["groups"]["b"]["runs"][0]["stages_s"] == {}
    assert res["ratios"]["hits a/b"] == pytest.approx(1.7) and res["ratios"]["ttft p50 b/a"] == pytest.approx(2.0)
    assert json.loads((tmp_path / "o.json").read_text())["ratios"] == res["ratios"]


def test_placement_log_merges_overlapping_reads_in_time_order(tmp_path, capsys):
    from bench import placement_log

    def entry(t, group, worker):
        return {"t": t, "kind": "place", "worker": worker, "group": group, "prompt_tokens": 552, "usable_blocks": 34,
                "prefill_s": 3.0, "candidates": {w: {"ttft_s": 3.0, "local": 0, "evict": 0, "prefix": 0, "capacity": 128,
                                                     "load": 0.0, "running": 0, "wait_avg_s": 0.0, "share": 1.0}
                                                 for w in ("w0", "w1")}}

    early = {"placement_log": [entry(1.0, "aa", "w0"), entry(2.0, "bb", "w1")]}  # an admin view
    later = {"placement_log": [entry(2.0, "bb", "w1"), entry(3.0, "cc", "w0")]}  # the log read again
    assert [e["group"] for e in placement_log.merged([later, early])] == ["aa", "bb", "cc"]
    bench = {"configs": {"kvmesh": {"shared_prefix_router_estimates": later,
                                    "workloads": {"trace": {"router_estimates": early}}},
                         "affinity": {"workloads": {"trace": {"router_estimates": None}}}}}
    assert [(e["config"], e["group"]) for e in placement_log.merged([bench])] == \
        [("kvmesh", "aa"), ("kvmesh", "bb"), ("kvmesh", "cc")]
    (tmp_path / "run.json").write_text(json.dumps(bench))
    placement_log.main([str(tmp_path / "run.json"), "--out", str(tmp_path / "log.json")])
    out = capsys.readouterr().out
    assert "-- kvmesh: 3 decisions" in out and "cc -> w0" in out
    assert len(json.loads((tmp_path / "log.json").read_text())["placement_log"]) == 3


def test_paired_runs_meet_at_each_workload_and_never_wait_for_one_that_left(tmp_path):
    """bench/cluster.Barrier: a process waits at a workload until every paired process reached it;
    a process that skips the workload or has stopped does not hold the others."""
    import threading

    from bench.cluster import Barrier

    spec = f"{tmp_path / 'b'}:2"
    arrived = []

    def late():
        time.sleep(0.8)
        arrived.append(time.monotonic())
        Barrier(spec).meet("shared_prefix", "kvmesh")

    t = threading.Thread(target=late)
    t.start()
    Barrier(spec).meet("shared_prefix", "affinity")
    done = time.monotonic()
    t.join()
    assert arrived and done >= arrived[0]  # affinity went on only once kvmesh had come
    Barrier(spec).skip(["multi_turn"], "kvmesh+approx")  # a name with '+' and a skipped workload
    assert Barrier(spec).meet("multi_turn", "affinity") < 0.5
    Barrier(spec).leave(["kvmesh"])
    assert Barrier(spec).meet("trace", "affinity") < 0.5  # kvmesh stopped: nobody waits for it
    assert Barrier(f"{tmp_path / 'c'}:2", timeout_s=0.3).meet("x", "a") >= 0.3  # bounded even if the peer hangs
    assert Barrier(None).meet("x", "a") == 0.0  # no --barrier: a sequential run never waits
    same = f"{tmp_path / 'd'}:2"  # one configuration, two settings: each process counts (its run tag)
    Barrier(same, run="kpa").skip(["y"], "kvmesh")
    assert Barrier(same, run="kpb").meet("y", "kvmesh") < 0.5
    assert Barrier(same, timeout_s=0.3, run="kpb").meet("z", "kvmesh") >= 0.3


def test_paired_run_passes_its_defaults_unless_given_and_merges_one_document(tmp_path):
    from bench import cluster_paired
    from bench.cluster import finish

    args = cluster_paired.child_args(["--rates=0.5,1", "--data-seed", "2"], 0.2)
    assert "--rates=0.5,1" in args and not any(a.startswith("--rates=0.25") for a in args)
    assert "--node-cpus=0.2" in args and "--step-trace" in args
    assert f"--stage-s={cluster_paired.PAIRED_DEFAULTS['--stage-s']}" in args
    assert cluster_paired.child_args(["--node-cpus=0.3"], 0.2).count("--node-cpus=0.3") == 1
    docs = {"affinity": {"machine": {}, "load_avg": {}, "args": {"configs": ["affinity"]},
                         "configs": {"affinity": {"shared_prefix": [_stage(1, 1.0, 1.5, 100, 100),
                                                                    _stage(2, 1.6, 4.0, 100, 100)]}}},
            "kvmesh": {"machine": {}, "load_avg": {}, "args": {"configs": ["kvmesh"]},
                       "configs": {"kvmesh": {"shared_prefix": [_stage(1, 1.0, 1.0, 95, 100),
                                                                _stage(2, 1.8, 2.0, 95, 100)]}}},
            "pow2": {}}  # its process failed before it wrote anything
    doc = cluster_paired.merge(docs, {"affinity": {"rc": 0}, "kvmesh": {"rc": 0}, "pow2": {"rc": 1, "error": "boom"}})
    assert doc["args"]["configs"] == ["affinity", "kvmesh", "pow2"]
    assert doc["configs"]["pow2"] == {"error": "boom"}
    finish(doc, tmp_path / "paired.json")
    s = json.loads((tmp_path / "paired.json").read_text())["summary"]
    assert s["throughput_at_equal_p99_ttft"]["kvmesh_vs_affinity"] > 1.0
    assert s["hit_tokens_vs_oracle"] == {"affinity": 1.0, "kvmesh": 0.95, "oracle": 1.0}


def test_a_sweep_goes_on_at_higher_rates_until_it_saturates(tmp_path, monkeypatch):
    """bench/cluster.shared_prefix_steady with ``extend``: after the main run, each extension rate is
    one more inference-perf run of the same data (same groups, prompts and seeded arrivals), one
    stage and no warm-up, while the highest stage so far has a p99 TTFT below the saturation
    line; the extension's prompts count against an oracle that saw the main run's. A sweep that
    saturated within the main run is not driven harder."""
    import argparse
    import time as _time

    from bench import cluster as cb

    prefix = " ".join(["alpha"] * 40)
    configs = []

    def fake_run(exe, config_path, log, timeout_s, arrival_seed=None):
        cfg = yaml.safe_load(Path(config_path).read_text())
        configs.append({**cfg, "arrival_seed": arrival_seed})
        out = Path(cfg["storage"]["local_storage"]["path"])
        out.mkdir(parents=True, exist_ok=True)
        t_perf = _time.perf_counter()
        entries, k = [], 0
        for j, st in enumerate(cfg["load"]["stages"]):  # 2 requests per stage, TTFT 2 s per req/s offered
            for i in range(2):
                entries.append({"start_time": t_perf + 0.1 * k, "request": json.dumps({"prompt": f"{prefix} q{i}"}),
                                "info": {"response_metrics": {"server_usage": {"prompt_tokens": 42, "completion_tokens": 4}}},
                                "computed_metrics": {"time_to_first_token": 2.0 * st["rate"], "request_latency": 2.0 * st["rate"] + 0.1},
                                "error": None})
                k += 1
            (out / f"stage_{j}_lifecycle_metrics.json").write_text(json.dumps({"load_summary": {"count": 2, "achieved_rate": st["rate"]}}))
        (out / "per_request_lifecycle_metrics.json").write_text(json.dumps(entries))
        return 0

    monkeypatch.setattr(cb.ipperf, "run", fake_run)
    monkeypatch.setattr(cb, "Sampler", _FakeSampler)
    args = argparse.Namespace(stage_s=10, groups=3, system_len=512, question_len=40, output_len=16, ttft_slo=2.0,
                              warmup_max_s=0, seeded_arrivals=True, data_seed=0, extend_below_p99=5.0)
    stages = cb.shared_prefix_steady(_FakeCluster(tmp_path), "kvmesh", args, "exe", "/m", _WordTok(), [0.5, 1.5],
                                     lambda m: None, extend=[3.0, 4.0])
    # 1.5 req/s: p99 3 s, below 5 -> on at 3 req/s: p99 6 s -> saturated, 4 req/s is not run
    assert [s["rate"] for s in stages] == [0.5, 0.5, 1.5, 3.0] and len(configs) == 2
    assert [bool(s.get("extension")) for s in stages] == [False, False, False, True]
    assert [bool(s["warmup"]) for s in stages] == [True, False, False, False]
    main, ext = configs
    assert [s["rate"] for s in ext["load"]["stages"]] == [3.0]
    assert ext["data"] == main["data"] and ext["arrival_seed"] == main["arrival_seed"]  # same prompts, same arrivals
    assert ext["storage"]["local_storage"]["path"] != main["storage"]["local_storage"]["path"]
    # its prompts were sent in the main run: the oracle has them cached (whole blocks but the last token)
    assert stages[3]["hit"]["oracle_cached_tokens"] == 2 * 32
    assert stages[3]["ttft_samples_s"] == [6.0, 6.0]

    # a sweep already saturated at its top stage (p99 6 s at 3 req/s) runs no extension
    configs.clear()
    stages = cb.shared_prefix_steady(_FakeCluster(tmp_path), "pow2", args, "exe", "/m", _WordTok(), [0.5, 3.0],
                                     lambda m: None, extend=[4.0])
    assert [s["rate"] for s in stages] == [0.5, 0.5, 3.0] and len(configs) == 1


def test_extends_while_the_top_stage_is_below_the_saturation_line():
    from bench.cluster_report import EXTEND_BELOW_P99_S, Point, extends

    assert extends(Point(2.0, 1.6, 0.8, 1.5, 2.8))
    assert not extends(Point(2.0, 0.9, 17.0, 28.0, 35.0))  # pow2 at 2 req/s
    assert not extends(Point(2.0, 1.6, 0.8, 1.5, 2.8, errors=1))  # a failed request: no harder load
    assert not extends(Point(2.0, 1.6, 0.8, 1.5, EXTEND_BELOW_P99_S))
    assert extends(Point(2.0, 1.6, 0.8, 1.5, 6.0), below_p99_s=10.0)


def test_extension_args_default_to_one_more_rate_except_quick_and_paired_runs():
    from bench import cluster as cb

    assert cb.parse_args([]).extend_rates == [3.0]
    assert cb.parse_args(["--quick"]).extend_rates == []
    assert cb.parse_args(["--barrier", "/tmp/x:2"]).extend_rates == []
    assert cb.parse_args(["--extend-rates", "3,4"]).extend_rates == [3.0, 4.0]
    assert cb.parse_args(["--extend-rates", ""]).extend_rates == []


def test_an_extended_curve_is_read_at_the_baselines_saturated_p99_not_as_a_lower_bound():
    """kvmesh's sweep went on at 3 req/s (its 2 req/s p99 was below the line), affinity's saturated
    at 2 req/s: the ratio is interpolated on kvmesh's extended curve; the bootstrap resamples the
    stage only kvmesh ran on its own."""
    from bench.cluster_report import Point, bootstrap, equal_p99_ratio, highest_common_rate

    s = lambda n, x: tuple([x] * n)  # noqa: E731
    kv = [Point(0.5, 0.5, 0.5, 0.7, 0.8, samples=s(15, 0.6)), Point(1, 0.9, 0.5, 0.8, 0.9, samples=s(30, 0.6)),
          Point(2, 1.8, 0.8, 1.5, 2.0, samples=s(60, 2.0)), Point(3, 2.4, 1.5, 7.0, 10.0, samples=s(90, 10.0))]
    af = [Point(0.5, 0.5, 0.5, 0.7, 0.8, samples=s(15, 0.6)), Point(1, 0.9, 0.5, 0.8, 0.9, samples=s(30, 0.6)),
          Point(2, 1.5, 2.0, 5.0, 6.0, samples=s(60, 6.0))]
    eq = equal_p99_ratio(kv, af)
    assert eq["p99_ttft_s"] == 6.0 and not eq["lower_bound"]
    assert eq["throughput"] == pytest.approx(1.8 + (6.0 - 2.0) / (10.0 - 2.0) * 0.6)
    assert eq["ratio"] == pytest.approx(2.1 / 1.5)
    assert equal_p99_ratio(kv[:3], af)["lower_bound"]  # without the extension: a lower bound
    assert highest_common_rate({"kvmesh": kv, "affinity": af})[0] == 1  # 3 req/s is no common rate
    boot = bootstrap({"kvmesh": kv, "affinity": af}, replicates=20)
    assert boot["paired_stages"] == 4 and boot["kvmesh_vs_affinity"]["lower_bound_share"] == 0.0
