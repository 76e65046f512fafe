"""Compare kvmesh runs of the cluster bench's kvmesh-loadgen workloads (``bench/cluster.py
--workloads ...``), grouped by label: hits against the oracle, TTFT percentiles, how planned pulls
ended (the responses' ``planned_route`` / ``route`` / ``pull_outcome``) and the workers' pull and
import-hold counters. For A/B runs made back to back on one machine (e.g. a knob on and off
through ``--kvmesh-args``), where one run is too noisy to read.

    python bench/mt_compare.py --workload multi_tenant --out bench/results/ab.json \\
        new=bench/results/run_new_*.json old=bench/results/run_old_*.json
"""

from __future__ import annotations

import argparse
import glob
import json
import platform
import statistics
from pathlib import Path


def run_summary(path: str, workload: str, config: str = "kvmesh") -> dict:
    """One run: hits, TTFT, per-route medians, planned pulls and how they ended, worker counters."""
    data = json.loads(Path(path).read_text())
    w = data["configs"][config]["workloads"][workload]
    rows = w.get("per_request") or []
    planned = [r for r in rows if r.get("planned_route") == "pulled"]
    outcomes: dict[str, int] = {}
    for r in planned:
        key = r.get("pull_outcome") or "unrecorded"
        outcomes[key] = outcomes.get(key, 0) + 1

    def med(rs):
        xs = [r["ttft_s"] for r in rs if r.get("ttft_s") is not None]
        return round(statistics.median(xs), 3) if xs else None

    est = w.get("router_estimates") or {}
    # the router's prediction: measured / expected TTFT per request (client-side TTFT, so it
    # includes the ingress), and how many responses priced a wait for room in some worker's KV pool
    ratios = sorted(r["ttft_s"] / r["expected_ttft_s"] for r in rows
                    if r.get("ttft_s") is not None and r.get("expected_ttft_s"))

    def total(table: dict | None) -> dict:
        out: dict[str, int] = {}
        for counters in (table or {}).values():
            for k, v in (counters or {}).items():
                out[k] = out.get(k, 0) + v
        return out

    return {"file": path, "hits_vs_oracle": w["hit"]["vs_oracle"], "ttft_s": w["ttft_s"],
            "planned_pulls": len(planned), "planned_pulls_served_pulled": sum(r["route"] == "pulled" for r in planned),
            "planned_pulls_run_as_recompute": sum(r["route"] == "recomputed" for r in planned),
            "pull_outcomes": outcomes,
            "median_ttft_s_by_route": {k: med([r for r in rows if r.get("route") == k])
                                       for k in ("local", "pulled", "recomputed")},
            "misses": sum(1 for r in rows if (r.get("cached") or 0) < (r.get("oracle") or 0)),
            "actual_over_expected_ttft": {"p50": _pct(ratios, 0.5), "p90": _pct(ratios, 0.9)} if ratios else None,
            "priced_kv_wait": sum(1 for r in rows if any("kv_wait_s" in o for o in (r.get("options") or {}).values())),
            "stages_s": stages(rows),
            "worker_pulls": total(est.get("pulls")), "worker_holds": total(est.get("holds"))}


STAGES = ("ttft", "ingress", "lease", "route", "engine_queue", "prefill", "overhead")


def stages(rows: list[dict]) -> dict:
    """Per stage of the time to first token (the responses' ``kvmesh.timings``): p50 and p90."""
    out = {}
    for st in STAGES:
        xs = sorted(r["timings"][f"{st}_s"] for r in rows
                    if r.get("timings") and r["timings"].get(f"{st}_s") is not None)
        if xs:
            out[st] = {"p50": _pct(xs, 0.5), "p90": _pct(xs, 0.9)}
    return out


def _pct(xs: list[float], q: float) -> float:
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 3)


def group_summary(runs: list[dict]) -> dict:
    def stat(xs):
        xs = [x for x in xs if x is not None]
        if not xs:
            return None
        return {"mean": round(statistics.fmean(xs), 3), "min": round(min(xs), 3), "max": round(max(xs), 3),
                "sd": round(statistics.stdev(xs), 3) if len(xs) > 1 else None}

    return {"runs": len(runs), "hits_vs_oracle": stat([r["hits_vs_oracle"] for r in runs]),
            **{f"ttft_{p}_s": stat([(r["ttft_s"] or {}).get(p) for r in runs]) for p in ("p50", "p90", "p99")},
            "planned_pulls": sum(r["planned_pulls"] for r in runs),
            "planned_pulls_run_as_recompute": sum(r["planned_pulls_run_as_recompute"] for r in runs),
            **{f"actual_over_expected_{p}": stat([(r["actual_over_expected_ttft"] or {}).get(p) for r in runs])
               for p in ("p50", "p90")},
            "priced_kv_wait": sum(r["priced_kv_wait"] for r in runs),
            "stages_s": {st: {p: stat([(r.get("stages_s") or {}).get(st, {}).get(p) for r in runs])["mean"]
                              for p in ("p50", "p90")}
                         for st in STAGES if any(st in (r.get("stages_s") or {}) for r in runs)}}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("groups", nargs="+", help="label=glob (one label per arm)")
    ap.add_argument("--workload", default="multi_tenant")
    ap.add_argument("--config", default="kvmesh")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    res = {"bench": "mt_compare", "workload": args.workload, "machine": {"python": platform.python_version()},
           "groups": {}}
    for spec in args.groups:
        label, _, pattern = spec.partition("=")
        files = sorted(glob.glob(pattern))
        if not files:
            raise SystemExit(f"{label}: no file matches {pattern!r}")
        runs = [run_summary(f, args.workload, args.config) for f in files]
        res["groups"][label] = {"summary": group_summary(runs), "runs": runs}
    labels = list(res["groups"])
    print(f"{'arm':8} {'runs':>4} {'hits mean (min-max)':>22} {'p50 s':>7} {'p90 s':>7} {'p99 s':>7} {'pulls':>6}"
          f" {'->recomp':>8} {'act/exp p50':>11} {'p90':>5} {'kv wait':>7}")
    for label in labels:
        s = res["groups"][label]["summary"]
        h = s["hits_vs_oracle"]
        ae = [(s[f"actual_over_expected_{p}"] or {}).get("mean") for p in ("p50", "p90")]
        print(f"{label:8} {s['runs']:>4} {h['mean']:>8.3f} ({h['min']:.3f}-{h['max']:.3f})"
              f" {s['ttft_p50_s']['mean']:>7.2f} {s['ttft_p90_s']['mean']:>7.2f} {s['ttft_p99_s']['mean']:>7.2f}"
              f" {s['planned_pulls']:>6} {s['planned_pulls_run_as_recompute']:>8}"
              f" {ae[0] if ae[0] is not None else '-':>11} {ae[1] if ae[1] is not None else '-':>5} {s['priced_kv_wait']:>7}")
    for label in labels:
        st = res["groups"][label]["summary"]["stages_s"]
        if st:
            print(f"{label:8} time to first token by stage, p50 / p90 s (mean over runs): "
                  + ", ".join(f"{k} {v['p50']:.3f} / {v['p90']:.3f}" for k, v in st.items()))
    if len(labels) == 2:
        a, b = (res["groups"][x]["summary"] for x in labels)
        res["ratios"] = {f"hits {labels[0]}/{labels[1]}": round(a["hits_vs_oracle"]["mean"] / b["hits_vs_oracle"]["mean"], 3),
                         **{f"ttft {p} {labels[1]}/{labels[0]}": round(b[f"ttft_{p}_s"]["mean"] / a[f"ttft_{p}_s"]["mean"], 3)
                            for p in ("p50", "p90", "p99")}}
        print("ratios:", json.dumps(res["ratios"]))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
