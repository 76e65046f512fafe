"""Engine step traces of a bench run, read back per worker and per time window.

The engines write them when ``KVMESH_STEP_TRACE_DIR`` is set (``engine/step_trace.py``: one
line per added request, per first token and per step; counts only). ``summarize`` answers, for
one window of wall-clock time (a stage of ``bench/cluster.py``), where a request's time went on
the worker that served it, the same way for every configuration (kvmesh workers and the
baselines' engine replicas run the same engine):

  * ``engine_ttft_s``: add -> first token on the engine (queue + prefill), p50/p90;
  * ``busy_at_add``: the share of requests that arrived at an engine already running or holding
    another request (what a load-aware placement avoids when another engine is idle), and
    ``idle_elsewhere_at_add``: the share that did so while some other engine of the run was idle;
  * ``prefill_tok_s``: prompt tokens computed per second of forward time in steps that carried
    prefill, and ``decode_step_s``: the mean forward time of pure decode steps;
  * ``decode_1row_s``: the median forward time of one-row decode steps, the same work in every
    configuration: the hosts' speed during the window (on this machine it drifts by up to 2x over
    a day, so configurations run one after another can meet different machines), and
    ``decode_1row_cpu_s`` the engine thread's CPU in them; ``step_cpu_over_wall``: the engine
    thread's CPU over the forward time of all steps (a 0.4-core host whose engine has its quota
    to itself reads ~0.4; less is time lost to the host's other processes or to the GIL);
  * ``per_engine``: requests added per engine;
  * ``busy_share``: per engine, its forward time over the window (how much of the stage it
    computed; engines left idle while requests queue elsewhere show here), and
    ``forward_s_per_request`` / ``decode_rows_mean``: forward time per request added and the mean
    rows of a decode step (batching: fewer, fuller steps cost less per request).

``python -m bench.steps <dir> [t0 t1]`` prints the summary of the traces under ``dir``.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

TRACE_DIR = "/tmp/kvmesh-steps"  # inside each bench host's private /tmp


def collect(host_tmps: dict[str, Path], dest: Path) -> list[Path]:
    """Move every host's traces (``<host tmp>/kvmesh-steps/steps-<pid>.jsonl``) to ``dest`` as
    ``<host>-steps-<pid>.jsonl`` (moved, so the next configuration's engines start empty)."""
    dest.mkdir(parents=True, exist_ok=True)
    out = []
    for host, tmp in host_tmps.items():
        for f in sorted((Path(tmp) / Path(TRACE_DIR).name).glob("steps-*.jsonl")):
            target = dest / f"{host}-{f.name}"
            shutil.move(str(f), target)
            out.append(target)
    return out


def read(files) -> dict[str, list[dict]]:
    """Records per engine (file stem), in file order; unreadable lines are skipped."""
    out: dict[str, list[dict]] = {}
    for f in files:
        recs = []
        for line in Path(f).read_text(errors="replace").splitlines():
            try:
                recs.append(json.loads(line))
            except ValueError:
                continue
        out[Path(f).stem] = recs
    return out


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _busy_spans(recs: list[dict]) -> list[tuple[float, float]]:
    """When the engine was busy: from each step's start to its end (steps closer than 50 ms
    merged), the engine's own view of its load."""
    spans: list[tuple[float, float]] = []
    for r in recs:
        if r.get("ev") != "step":
            continue
        a, b = r["t"], r["t"] + r["dt"]
        if spans and a - spans[-1][1] < 0.05:
            spans[-1] = (spans[-1][0], max(spans[-1][1], b))
        else:
            spans.append((a, b))
    return spans


def _busy(spans: list[tuple[float, float]], t: float) -> bool:
    return any(a <= t <= b for a, b in spans)


def summarize(engines: dict[str, list[dict]], t0: float = float("-inf"), t1: float = float("inf")) -> dict:
    """The window [t0, t1)'s figures (module docstring) over every engine's records."""
    ttft, busy, idle_elsewhere, adds_total = [], 0, 0, 0
    pre_tok = pre_s = dec_s = 0.0
    dec_n = 0
    per_engine: dict[str, int] = {}
    forward: dict[str, float] = {}
    dec_rows = 0
    one_row: list[float] = []
    one_row_cpu: list[float] = []
    wall_cpu = {"wall": 0.0, "cpu": 0.0}
    preempted = {"all": 0, "room": 0}  # preemptions in the window (cumulative counters in the steps)
    spans = {e: _busy_spans(recs) for e, recs in engines.items()}
    for e, recs in engines.items():
        adds = {}
        seen: dict[str, list[int]] = {}  # counter -> [first, last] value inside the window
        for r in recs:
            ev, t = r.get("ev"), r.get("t", 0.0)
            if ev == "add" and t0 <= t < t1:
                adds[r["n"]] = t
                adds_total += 1
                per_engine[e] = per_engine.get(e, 0) + 1
                if r.get("running", 0) + r.get("waiting", 0) > 0:
                    busy += 1
                    others = [o for o in engines if o != e]
                    if any(not _busy(spans[o], t) for o in others):
                        idle_elsewhere += 1
            elif ev == "first" and r.get("n") in adds:
                ttft.append(t - adds.pop(r["n"]))
            elif ev == "step" and t0 <= t < t1:
                forward[e] = forward.get(e, 0.0) + r["dt"]
                for k, name in (("preempted", "all"), ("room", "room")):
                    if k in r:
                        seen.setdefault(name, [r[k], r[k]])[1] = r[k]
                if "cpu" in r:
                    wall_cpu["wall"] += r["dt"]
                    wall_cpu["cpu"] += r["cpu"]
                tok, rows = sum(r["tok"].values()), sum(r["rows"].values())
                if tok > rows:
                    pre_tok += tok - rows
                    pre_s += r["dt"]
                elif rows:
                    dec_s += r["dt"]
                    dec_n += 1
                    dec_rows += rows
                    if rows == 1:
                        one_row.append(r["dt"])
                        if "cpu" in r:
                            one_row_cpu.append(r["cpu"])
        for name, (first, last) in seen.items():
            preempted[name] += last - first
    return {"requests": adds_total,
            "engine_ttft_s": {"p50": _pct(ttft, 0.5), "p90": _pct(ttft, 0.9)},
            "busy_at_add": busy / adds_total if adds_total else None,
            "idle_elsewhere_at_add": idle_elsewhere / adds_total if adds_total else None,
            "prefill_tok_s": pre_tok / pre_s if pre_s else None,
            "decode_step_s": dec_s / dec_n if dec_n else None,
            "decode_rows_mean": dec_rows / dec_n if dec_n else None,
            "decode_1row_s": _pct(one_row, 0.5), "decode_1row_steps": len(one_row),
            "decode_1row_cpu_s": _pct(one_row_cpu, 0.5),
            "step_cpu_over_wall": wall_cpu["cpu"] / wall_cpu["wall"] if wall_cpu["wall"] else None,
            "forward_s_per_request": sum(forward.values()) / adds_total if adds_total else None,
            "busy_share": ({e: forward.get(e, 0.0) / (t1 - t0) for e in engines}
                           if t1 - t0 < float("inf") and t1 > t0 else None),
            "per_engine": per_engine, "preemptions": preempted}


if __name__ == "__main__":
    d = Path(sys.argv[1])
    window = [float(x) for x in sys.argv[2:4]] or [float("-inf"), float("inf")]
    print(json.dumps(summarize(read(sorted(d.glob("*.jsonl"))), *window), indent=1))
