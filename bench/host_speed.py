"""The hosts' speed while each configuration of a cluster run ran, and the throughput ratios
adjusted to equal speed, for runs recorded before ``bench/cluster.py`` put them in its summary.

On this machine the same engine step (one decode row) takes 0.15-0.30 s at different hours, and
``bench/cluster.py`` runs its configurations one after another, so two configurations of one run
can meet hosts of different speed. The engines' step traces (``--step-trace``) time a one-row
decode step in every configuration: ``bench/steps.py``'s ``decode_1row_s`` over each stage's
wall-clock window, its median over the stages (``cluster_report.host_speed``), and each
``kvmesh_vs_<base>`` ratio x (kvmesh's step / the baseline's) (``cluster_report.speed_adjusted``,
an estimate beside the measured ratio, not a replacement for it).

    python bench/host_speed.py bench/results/cluster_s26_default.json [...] \\
        [--steps bench/results/cluster_run/steps] [--out bench/results/host_speed.json] [--update]

Step traces are read from ``<steps>/<configuration>/`` (where ``bench/cluster.py`` leaves them;
every run's files stay there, each stage reads only the records inside its window).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import cluster_report as report  # noqa: E402
from bench import steps as steptrace  # noqa: E402

SERIES = ("shared_prefix", "hot_prefix")


def stage_speeds(doc: dict, steps_dir: Path) -> dict[str, dict[str, list[float | None]]]:
    """Per series and configuration: each stage's ``decode_1row_s``, from the JSON when it has
    it, else from the step traces over the stage's window."""
    out: dict[str, dict[str, list[float | None]]] = {}
    cache: dict[str, dict] = {}
    for name, res in doc.get("configs", {}).items():
        for key in SERIES:
            for st in res.get(key) or []:
                v = (st.get("engine_steps") or {}).get("decode_1row_s")
                if v is None and st.get("wall_clock"):
                    d = steps_dir / name.replace("+", "-")
                    if name not in cache:
                        cache[name] = steptrace.read(sorted(d.glob("*.jsonl"))) if d.is_dir() else {}
                    v = steptrace.summarize(cache[name], *st["wall_clock"]).get("decode_1row_s")
                out.setdefault(key, {}).setdefault(name, []).append(v)
    return out


def analyse(path: Path, steps_dir: Path) -> dict:
    doc = json.loads(path.read_text())
    row: dict = {"file": path.name}
    for key, speeds in stage_speeds(doc, steps_dir).items():
        summary = doc.get("summary") or {}
        summary = summary.get("hot_prefix", {}) if key == "hot_prefix" else summary
        ratios = summary.get("throughput_at_equal_p99_ttft") or {}
        speed = report.host_speed(speeds)
        row[key] = {"host_speed_decode_1row_s": speed, "stage_decode_1row_s": speeds,
                    "throughput_at_equal_p99_ttft": ratios,
                    "throughput_at_equal_p99_ttft_speed_adjusted": report.speed_adjusted(ratios, speed)}
    return row


def update(path: Path, row: dict) -> None:
    """Each stage's ``engine_steps.decode_1row_s`` from ``row`` into the run's JSON, then
    ``bench.cluster.finish`` (summary with the hosts' speed, table, PNG)."""
    from bench.cluster import finish

    doc = json.loads(path.read_text())
    for key in SERIES:
        for name, speeds in ((row.get(key) or {}).get("stage_decode_1row_s") or {}).items():
            for st, v in zip(doc["configs"][name].get(key) or [], speeds):
                st.setdefault("engine_steps", {})["decode_1row_s"] = v
    finish(doc, path)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--steps", type=Path, default=ROOT / "bench" / "results" / "cluster_run" / "steps")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--update", action="store_true",
                    help="also write each stage's decode_1row_s into the run's JSON and redo its summary, "
                         "table and PNG (bench/cluster.py's finish), as a run made now would have them")
    a = ap.parse_args(argv)
    rows = [analyse(f, a.steps) for f in a.files]
    if a.update:
        for f, row in zip(a.files, rows):
            update(f, row)
    f = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
    for r in rows:
        s = r.get("shared_prefix") or {}
        sp = s.get("host_speed_decode_1row_s") or {}
        raw, adj = s.get("throughput_at_equal_p99_ttft") or {}, s.get("throughput_at_equal_p99_ttft_speed_adjusted") or {}
        print(f"{r['file']}: one-row decode step " + " ".join(f"{n} {f(v)}" for n, v in sp.items())
              + " | kvmesh/affinity " + f"{f(raw.get('kvmesh_vs_affinity'))} -> {f(adj.get('kvmesh_vs_affinity'))}"
              + " | kvmesh/pow2 " + f"{f(raw.get('kvmesh_vs_pow2'))} -> {f(adj.get('kvmesh_vs_pow2'))}")
    if a.out:
        a.out.write_text(json.dumps({"bench": "host_speed", "machine": {"platform": platform.platform()},
                                     "runs": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()
