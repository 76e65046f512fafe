"""Several runs of ``bench/cluster.py`` side by side: the spread of the issue-11 ratios.

One run's ``throughput_at_equal_p99_ttft`` is taken at the baseline's saturated p99, so it moves
with the baseline's own tail from run to run (affinity's p99 at 2 req/s ranged 1.8-34 s over
session 17's runs at the same settings). This reads the given ``cluster*.json`` files, recomputes
every run's shared-prefix summary with the current ``bench.cluster_report`` (so runs written by
older code are judged the same way), and prints per run and over all of them (min / median / max,
and how many runs met each target): hit tokens vs the oracle, kvmesh's throughput ratio to
affinity and pow2 at equal p99 TTFT (and, for runs that kept each request's TTFT, the 90% interval
of the ratio to affinity over resamples of the requests), TTFT p90 affinity/kvmesh at the highest common rate, each
configuration's p99 TTFT at its highest rate, and per configuration the request path outside the
engine at the lowest rate (client TTFT p50 minus the engines' own TTFT p50 from the step
traces, where the run recorded them).

    .venv/bin/python bench/cluster_runs.py bench/results/cluster_s17_default.json bench/results/cluster_s18_*.json
Writes bench/results/cluster_runs.json (``--out``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import cluster_report as report  # noqa: E402

KEY = "shared_prefix"
RATIOS = ("hit_tokens_vs_oracle", "kvmesh_vs_affinity", "kvmesh_vs_pow2", "ttft_p90_affinity_over_kvmesh")


def run_row(doc: dict, name: str) -> dict:
    """One run's figures (``None`` where the run lacks a configuration)."""
    from bench.cluster import series_summary

    s, cv = series_summary(doc, KEY)
    t = report.targets(s) if cv else {}
    row: dict = {"run": name, **{k: (t.get(k) or {}).get("value") for k in RATIOS}}
    row["p90_rate"] = (s.get("ttft_p90_rate") or {}).get("rate")
    # each ratio's 90% interval over resamples of the run's requests (runs that kept their samples)
    row["interval_90"] = {k: t[k]["interval_90"] for k in RATIOS if "interval_90" in (t.get(k) or {})}
    row["p99_at_top_rate"] = {}
    row["outside_engine_p50_s"] = {}
    for cfg, res in doc["configs"].items():
        stages = [st for st in res.get(KEY) or [] if st.get("ok")]
        if not stages:
            continue
        top = max(stages, key=lambda st: st["rate"])
        row["p99_at_top_rate"][cfg] = {"rate": top["rate"], "offered": top.get("offered_rate"),
                                       "throughput": top["request_throughput"], "p99_s": top["ttft_s"]["p99"]}
        low = min(stages, key=lambda st: st["rate"])
        eng = ((low.get("engine_steps") or {}).get("engine_ttft_s") or {}).get("p50")
        if eng is not None and low["ttft_s"].get("p50") is not None:
            row["outside_engine_p50_s"][cfg] = low["ttft_s"]["p50"] - eng
    return row


def spread(rows: list[dict]) -> dict:
    """Per ratio: min, median, max over the runs that have it, and runs that met its target."""
    out = {}
    for k in RATIOS:
        vals = [r[k] for r in rows if r[k] is not None]
        if vals:
            out[k] = {"runs": len(vals), "min": min(vals), "median": statistics.median(vals), "max": max(vals),
                      "met": sum(v >= report.TARGETS[k] for v in vals), "target": report.TARGETS[k]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="cluster*.json files written by bench/cluster.py")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "cluster_runs.json"))
    args = ap.parse_args()
    rows = []
    for path in args.runs:
        doc = json.loads(Path(path).read_text())
        if not any(r.get(KEY) for r in doc.get("configs", {}).values()):
            print(f"{path}: no {KEY} series, skipped")
            continue
        rows.append(run_row(doc, Path(path).name))
    f = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
    print(f"{'run':40s} {'hits':>5s} {'/aff':>5s} {'90% of resamples':>16s} {'/pow2':>5s} {'p90x':>5s}  "
          "p99 s at the top rate (req/s)")
    for r in rows:
        tops = ", ".join(f"{c} {v['p99_s']:.1f} ({v['throughput']:.2f})" for c, v in r["p99_at_top_rate"].items())
        iv = r["interval_90"].get("kvmesh_vs_affinity")
        print(f"{r['run']:40s} {f(r['hit_tokens_vs_oracle']):>5s} {f(r['kvmesh_vs_affinity']):>5s} "
              f"{(f(iv[0]) + '-' + f(iv[1])) if iv else '-':>16s} "
              f"{f(r['kvmesh_vs_pow2']):>5s} {f(r['ttft_p90_affinity_over_kvmesh']):>5s}  {tops}")
    sp = spread(rows)
    for k, v in sp.items():
        print(f"{k}: min {v['min']:.2f} median {v['median']:.2f} max {v['max']:.2f}; "
              f"target {v['target']} met in {v['met']} of {v['runs']} runs")
    outside = {}
    for r in rows:
        for c, v in r["outside_engine_p50_s"].items():
            outside.setdefault(c, []).append(v)
    for c, vs in outside.items():
        print(f"{c}: client TTFT p50 minus engine TTFT p50 at the lowest rate, median over {len(vs)} runs: "
              f"{statistics.median(vs) * 1000:.0f} ms")
    doc = {"bench": "cluster_runs", "runs": rows, "spread": sp,
           "outside_engine_p50_s_median": {c: statistics.median(vs) for c, vs in outside.items()}}
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
