"""Where a victim request of bench/flood.py waits: per-stage times from the trace marks.

A profiling aid, not part of the app. ``trace.patch`` (next to this file; against the commit
that added it) adds ``kvtrace.py`` and wall-clock marks along the victim's path: ingress entry,
body read, parsed, built; the lease sent/received; the controller's ``begin`` in/out; the
worker's ``generate`` in; the engine thread running its add command; every engine step (start,
duration, tokens per tenant); the worker's and the ingress's first output. Then:

  git apply bench/flood_trace/trace.patch
  KVMESH_TRACE_DIR=/tmp/trace python bench/flood.py --out /tmp/flood.json
  python bench/flood_trace/stages.py /tmp/trace /tmp/flood.json flood [summary.json]   # or: alone
  git apply -R bench/flood_trace/trace.patch

Stages (ms): proxy_in = client send -> ingress handler (Serve proxy + routing); body, parse,
build; to_ctrl / ctrl / ctrl_to_rep = the begin call out / in the controller / back; to_worker;
to_engine = worker generate -> the engine thread runs the add (it waits for the step in
progress); engine_wait = add -> the victim's first step starts; step = that step (with the other
tenants' tokens in it); to_worker_first / to_rep_first / to_client = the first output back.
"""
import glob, json, sys
from pathlib import Path
import numpy as np

tdir, res = sys.argv[1], json.load(open(sys.argv[2]))
phase = sys.argv[3] if len(sys.argv) > 3 else "flood"
recs = [json.loads(l) for f in glob.glob(f"{tdir}/trace-*.jsonl") for l in open(f)]
by = {}
steps = sorted([r for r in recs if r["stage"] == "step"], key=lambda r: r["t0"])
for r in recs:
    if "rid" in r and r["stage"] != "step":
        by.setdefault(r["rid"], {})[r["stage"]] = r
samples = res["victim_samples"][phase]
ing = sorted([d for d in by.values() if "ingress" in d], key=lambda d: d["ingress"]["t_in"])
rows = []
for sent, ttft in samples:
    # the first ingress record after the send
    d = next((d for d in ing if d["ingress"]["t_in"] >= sent), None)
    if d is None or d["ingress"]["t_in"] - sent > 30:
        continue
    rid = d["ingress"]["rid"]
    i = d["ingress"]
    st = [s for s in steps if rid in s["victim"]]
    if not st or any(k not in d for k in ("begin_in", "begin_out", "lease", "worker_in", "engine_add", "worker_first", "ingress_first")):
        continue
    s = st[0]
    s_end = s["t0"] + s["dt"]
    # steps the victim waited through after engine_add
    before = [x for x in steps if x["t0"] + x["dt"] > d["engine_add"]["t"] and x["t0"] < s["t0"]]
    row = {
        "ttft": ttft,
        "proxy_in": (i["t_in"] - sent) * 1e3,
        "body": (i["t_body"] - i["t_in"]) * 1e3,
        "parse": (i["t_parsed"] - i["t_body"]) * 1e3,
        "build": (i["t_built"] - i["t_parsed"]) * 1e3,
        "to_ctrl": (d["begin_in"]["t"] - i["t_built"]) * 1e3,
        "ctrl": (d["begin_out"]["t"] - d["begin_in"]["t"]) * 1e3,
        "ctrl_to_rep": (d["lease"]["t"] - d["begin_out"]["t"]) * 1e3,
        "to_worker": (d["worker_in"]["t"] - d["lease"]["t"]) * 1e3,
        "to_engine": (d["engine_add"]["t"] - d["worker_in"]["t"]) * 1e3,
        "engine_wait": (s["t0"] - d["engine_add"]["t"]) * 1e3,
        "steps_waited": len(before),
        "step": s["dt"] * 1e3,
        "step_other_tokens": sum(sum(v) for k, v in s["tokens"].items() if k != "victim"),
        "step_victim_tokens": sum(s["tokens"].get("victim", [])),
        "to_worker_first": (d["worker_first"]["t"] - s_end) * 1e3,
        "to_rep_first": (d["ingress_first"]["t"] - d["worker_first"]["t"]) * 1e3,
        "to_client": (sent + ttft / 1e3 - d["ingress_first"]["t"]) * 1e3,
    }
    # aggregates: the HTTP/control path before the engine, and the first output's way back
    row["path_in"] = sum(row[k] for k in ("proxy_in", "body", "parse", "build", "to_ctrl", "ctrl", "ctrl_to_rep",
                                          "to_worker"))
    row["path_out"] = row["to_worker_first"] + row["to_rep_first"] + row["to_client"]
    rows.append(row)
keys = list(rows[0]) if rows else []
print(f"{phase}: {len(rows)} of {len(samples)} victim requests joined")
print("stage".ljust(18), "p50".rjust(8), "p90".rjust(8), "max".rjust(8), "mean".rjust(8))
for k in keys:
    v = np.array([r[k] for r in rows])
    print(k.ljust(18), *(f"{x:8.0f}" for x in (np.quantile(v, .5), np.quantile(v, .9), v.max(), v.mean())))
# the slowest 5 requests in detail
print("slowest:")
for r in sorted(rows, key=lambda r: -r["ttft"])[:6]:
    print({k: round(v) for k, v in r.items()})
# step durations by content
fl = [x for x in steps if "flooder" in x["tokens"]]
print(f"steps: {len(steps)}; with flooder tokens: {len(fl)}; dt p50/max of those: "
      f"{np.quantile([x['dt'] for x in fl], .5)*1e3 if fl else 0:.0f}/{max([x['dt'] for x in fl], default=0)*1e3:.0f} ms; "
      f"flooder tokens per such step p50 {np.quantile([sum(x['tokens']['flooder']) for x in fl], .5) if fl else 0:.0f}")
summary = {k: {"p50": round(float(np.quantile([r[k] for r in rows], .5)), 1),
                "p90": round(float(np.quantile([r[k] for r in rows], .9)), 1),
                "max": round(float(max(r[k] for r in rows)), 1),
                "mean": round(float(np.mean([r[k] for r in rows])), 1)} for k in keys}
out = sys.argv[4] if len(sys.argv) > 4 else None
if out:
    d = json.load(open(out)) if Path(out).exists() else {}
    d[phase] = {"joined": len(rows), "stages_ms": summary,
                "slowest": sorted(rows, key=lambda r: -r["ttft"])[:5],
                "steps": {"n": len(steps), "with_flooder_tokens": len(fl),
                          "dt_ms_with_flooder": {"p50": round(float(np.quantile([x['dt'] for x in fl], .5)) * 1e3, 1) if fl else None,
                                                 "max": round(max([x['dt'] for x in fl], default=0) * 1e3, 1)},
                          "flooder_tokens_per_step_max": max([sum(x['tokens']['flooder']) for x in fl], default=0)}}
    json.dump(d, open(out, "w"), indent=1)
