"""The cluster bench with its configurations side by side in time: one twin cluster each, driven at once.

    sudo nice -n 5 .venv/bin/python bench/cluster_paired.py           # affinity and kvmesh, ~20 min
    sudo nice -n 5 .venv/bin/python bench/cluster_paired.py --configs pow2,affinity,kvmesh -- --rates 0.2,0.4,0.8

Why: ``bench/cluster.py`` runs its configurations one after another (about 9 minutes each), and
this machine's speed drifts: the same one-row decode step took 0.14-0.32 s over a day, and within
one run the configurations' hosts differed by up to 20% (``bench/host_speed.py``), as much as the
ratios being measured. Here every configuration runs at the same time on its own hosts, so they
meet the same machine.

How: one ``bench/cluster.py`` process per configuration, each with its own SSH hosts (namespaces,
tag prefix ``kp<i>``), Ray cluster (``ray up``/``ray down``) and results directory, and the same
seeded workload (inference-perf's prompts and arrival times). Every worker host gets ``--node-cpus``
= 0.8 x this machine's cores / (workers x configurations): the CPU one host had in the sequential
run, split between the twins; the default rates are scaled to what the twins then serve
(``PAIRED_DEFAULTS``) and the stages are longer. The processes meet at a
``cluster.Barrier`` before each workload (``--barrier``). Then their documents are merged into one
(``configs`` side by side, each process's ``cluster`` section under ``paired.clusters``) and
summarized as ``bench/cluster.py`` does (``cluster.finish``: JSON, PNG and the table).

Arguments after ``--`` go to every ``bench/cluster.py`` (they override the defaults above, e.g.
``--workloads multi_turn`` to add a loadgen workload or ``--data-seed 2``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import cluster  # noqa: E402

# Rates for twin clusters at 0.2 core per worker host on 2 cores: two clusters' Ray processes share
# the machine, and in a trial (2026-12-05 23:02-23:16 UTC) both configurations saturated at ~0.6
# req/s (the sequential run at 0.4 core: 1.5-1.8), the engines getting ~0.65 of their hosts' quota;
# the last rate is past that. Stages are longer than the sequential run's 30 s, to hold about as
# many requests.
PAIRED_DEFAULTS = {"--rates": "0.2,0.4,0.6,0.8", "--stage-s": "90", "--hot-rates": "", "--workloads": ""}


def child_args(rest: list[str], node_cpus: float) -> list[str]:
    """``rest`` (the caller's cluster.py arguments) plus the paired defaults it does not set."""
    given = {a.split("=", 1)[0] for a in rest if a.startswith("--")}
    out = list(rest)
    for k, v in {**PAIRED_DEFAULTS, "--node-cpus": f"{node_cpus:g}"}.items():
        if k not in given:
            out.append(f"{k}={v}")
    if "--step-trace" not in given:  # the hosts' speed per configuration: the check that pairing worked
        out.append("--step-trace")
    return out


def merge(docs: dict[str, dict], procs: dict[str, dict]) -> dict:
    """One cluster.py document from the per-configuration ones (each ran one configuration)."""
    first = next((d for d in docs.values() if d), {})
    doc = {k: v for k, v in first.items() if k not in ("configs", "summary", "targets", "hit_ratios", "leftovers")}
    doc["args"] = dict(first.get("args") or {}, configs=list(docs))
    doc["configs"] = {}
    for name, d in docs.items():
        doc["configs"][name] = (d.get("configs") or {}).get(name) or {"error": procs[name].get("error") or
                                                                          "no result"}
    doc["paired"] = {"configs": list(docs), "processes": procs,
                     "clusters": {n: d.get("cluster") for n, d in docs.items()},
                     "load_avg": {n: d.get("load_avg") for n, d in docs.items()}}
    doc["leftovers"] = {k: [x for d in docs.values() for x in (d.get("leftovers") or {}).get(k) or []]
                        for k in ("namespaces_and_links", "host_processes")}
    return doc


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="affinity,kvmesh")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--stagger-s", type=float, default=20.0,
                    help="start the processes this far apart (their ray up and model loads do not collide; the "
                         "barrier lines their workloads up again)")
    ap.add_argument("--out", default=str(cluster.RESULTS / "cluster_paired.json"))
    ap.add_argument("--merge-only", action="store_true",
                    help="run nothing: merge and summarize the per-configuration results an earlier run of the "
                         "same --out left (again, e.g. after a change to the summary)")
    ap.add_argument("rest", nargs=argparse.REMAINDER, help="-- then bench/cluster.py arguments")
    a = ap.parse_args(argv)
    a.configs = [c for c in a.configs.split(",") if c]
    a.rest = a.rest[1:] if a.rest[:1] == ["--"] else a.rest
    return a


def main(argv=None) -> dict:
    args = parse_args(argv)
    out = Path(args.out)
    run = out.parent / f"cluster_run_{out.stem}"  # ignored by git (bench/results/cluster_run*/)
    if args.merge_only:
        prev = json.loads(out.read_text()) if out.exists() else {}
        info = (prev.get("paired") or {}).get("processes") or {
            n: {"out": str(run / n.replace("+", "-") / "cluster.json")} for n in args.configs}
        return summarize(info, out, prev.get("paired", {}).get("node_cpus"), prev.get("wall_s"))
    if os.geteuid() != 0:
        raise SystemExit("bench/cluster_paired.py needs root (network namespaces, tc, sshd)")
    barrier = run / "barrier"
    if barrier.exists():
        for f in barrier.iterdir():
            f.unlink()
    node_cpus = round(0.8 * (os.cpu_count() or 1) / (args.workers * len(args.configs)), 3)
    rest = child_args([*args.rest, f"--workers={args.workers}"], node_cpus)
    procs: dict[str, subprocess.Popen] = {}
    logs = []
    info: dict[str, dict] = {}

    def stop(signum, frame):  # each child cleans up its own hosts on SIGTERM
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    t0 = time.monotonic()
    try:
        for i, name in enumerate(args.configs):
            d = run / name.replace("+", "-")
            d.mkdir(parents=True, exist_ok=True)
            cmd = [sys.executable, str(Path(__file__).with_name("cluster.py")), f"--configs={name}", *rest,
                   f"--tag-prefix=kp{i}", f"--barrier={barrier}:{len(args.configs)}", f"--out={d / 'cluster.json'}"]
            logs.append(open(d / "log.txt", "w"))
            procs[name] = subprocess.Popen(cmd, stdout=logs[-1], stderr=subprocess.STDOUT)
            info[name] = {"cmd": cmd[1:], "log": str(d / "log.txt"), "out": str(d / "cluster.json"),
                          "pid": procs[name].pid}
            print(f"[{time.strftime('%H:%M:%S', time.gmtime())}] {name}: pid {procs[name].pid}, log {d / 'log.txt'}",
                  flush=True)
            if i + 1 < len(args.configs):
                time.sleep(args.stagger_s)
        for name, p in procs.items():
            info[name]["rc"] = p.wait()
    finally:
        stop(None, None)
        for p in procs.values():
            p.wait()
        for f in logs:
            f.close()
    return summarize(info, out, node_cpus, round(time.monotonic() - t0, 1))


def summarize(info: dict[str, dict], out: Path, node_cpus: float | None, wall_s: float | None) -> dict:
    """Read each process's document (``info[name]["out"]``), merge, and write ``out`` as
    ``bench/cluster.py`` would (JSON, PNG, the table)."""
    docs = {}
    for name, p in info.items():
        try:
            docs[name] = json.loads(Path(p["out"]).read_text())
        except (OSError, ValueError) as e:
            p["error"] = f"{type(e).__name__}: {e}"
            docs[name] = {}
    doc = merge(docs, info)
    doc["paired"]["node_cpus"] = node_cpus
    doc["wall_s"] = wall_s
    cluster.finish(doc, out)
    return doc


if __name__ == "__main__":
    main()
