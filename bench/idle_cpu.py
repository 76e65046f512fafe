"""The control plane's CPU cost: kvmesh vs Ray Serve's PrefixCacheAffinityRouter, idle and under a
fixed small load, CPU-seconds per second per process role, and the Ray calls behind them.

One run measures both configurations one after the other, each in its own fresh local Ray
cluster on loopback (so Ray's own processes, ``ray_system``, are attributed to one
configuration): the same ``--workers`` engines (one CPU each, same model, same KV pool), one
ingress replica, then

  * an **idle** window (``--idle-s``): no request at all, after a short settle;
  * a **load** window: the same shared-prefix requests (``--groups`` x ``--users``, system prompt
    ``--system-len`` tokens + a ``--question-len``-token question, ``--output-len`` tokens out),
    open loop at ``--rate`` req/s.

Per window: CPU seconds per second of every process in the cluster's process tree, by role
(worker / engine replica, ingress, Serve proxy and controller, kvmesh controller, index, router,
the affinity router's ``prefix_tree`` actor, ``ray_system`` = gcs, raylet, agents, dashboard; ``ray_idle`` = Ray's pooled idle workers; the
driver running the load is not counted), per request under load, and the Ray tasks (actor calls)
executed per second by method, from Ray's task events (``ray.util.state.summarize_tasks``;
Serve's own request path runs with task events off, so it is not counted), and a py-spy profile
of one worker process during the load (``--profile-s``; where its Python time goes).

    nice -n 5 .venv/bin/python bench/idle_cpu.py     # ~6 min here
Writes bench/results/idle_cpu.json (``--out``). Loopback only; stops by itself.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

KEY = "sk-bench"
TENANT = "bench"
CONFIGS = ("kvmesh", "affinity")

# (substring of the process title / command line, role); first match wins
ROLES = (("ray::ServeController", "serve_controller"), ("ray::ProxyActor", "serve_proxy"),
         ("EngineReplica", "worker"), ("KvmeshIngress", "ingress"), ("BaselineIngress", "ingress"),
         ("ray::Worker", "worker"), ("ray::Controller", "controller"), ("ray::Router", "router"),
         ("ray::IndexActor", "index"), ("ray::PrefixTreeActor", "prefix_tree"), ("ray::IDLE", "ray_idle"))


def role_of(cmdline: list[str]) -> str:
    head = cmdline[0] if cmdline else ""
    for key, role in ROLES:
        if key in head:
            return role
    text = " ".join(cmdline)
    return "ray_system" if ("ray" in text or "gcs_server" in text or "raylet" in text) else "other"


def cpu_snapshot() -> dict[int, tuple[str, float]]:
    """pid -> (role, CPU seconds so far) of every descendant of this process (the local Ray
    cluster it started: gcs, raylet, agents, and the raylet's worker processes)."""
    import psutil

    out = {}
    for p in psutil.Process().children(recursive=True):
        try:
            with p.oneshot():
                t = p.cpu_times()
                out[p.pid] = (role_of(p.cmdline()), t.user + t.system)
        except psutil.Error:
            continue
    return out


def cpu_delta(a: dict, b: dict) -> dict[str, float]:
    """CPU seconds per role between two snapshots (processes present in both; new ones from 0)."""
    out: dict[str, float] = {}
    for pid, (role, t1) in b.items():
        t0 = a.get(pid, (role, 0.0))[1]
        out[role] = out.get(role, 0.0) + max(0.0, t1 - t0)
    return out


def task_counts() -> dict[str, int]:
    """Ray tasks / actor calls seen so far by name (every state), from the GCS task events."""
    from ray.util.state import summarize_tasks

    try:
        s = summarize_tasks(raise_on_missing_output=False)
    except Exception as e:  # noqa: BLE001 - the state API is best effort here
        print(f"summarize_tasks failed: {e!r}", flush=True)
        return {}
    summ = s.get("cluster", {}).get("summary", {})
    return {name: int(sum(v.get("state_counts", {}).values())) for name, v in summ.items()}


def window(measure_s: float | None, fn=None) -> dict:
    """CPU by role and Ray calls over ``fn()`` (or a sleep of ``measure_s``)."""
    n0, c0 = task_counts(), cpu_snapshot()
    t0 = time.monotonic()
    res = fn() if fn is not None else time.sleep(measure_s)
    wall = time.monotonic() - t0
    c1, n1 = cpu_snapshot(), task_counts()
    cpu = cpu_delta(c0, c1)
    calls = {k: n1.get(k, 0) - n0.get(k, 0) for k in n1}
    calls = {k: v for k, v in sorted(calls.items(), key=lambda kv: -kv[1]) if v > 0}
    return {"wall_s": round(wall, 2), "cpu_s": {k: round(v, 3) for k, v in sorted(cpu.items())},
            "cpu_s_per_s": {k: round(v / wall, 4) for k, v in sorted(cpu.items())},
            "cpu_s_per_s_total": round(sum(cpu.values()) / wall, 4),
            "calls_per_s": {k: round(v / wall, 3) for k, v in calls.items()},
            "calls_per_s_total": round(sum(calls.values()) / wall, 2), "result": res}


PY_SPY = Path(sys.executable).with_name("py-spy")


def start_profile(pid: int, seconds: float, path: Path):
    """``py-spy record`` of ``pid`` (non-blocking sampling, raw collapsed stacks) in the background."""
    import subprocess

    if not PY_SPY.exists():
        return None
    return subprocess.Popen([str(PY_SPY), "record", "--nonblocking", "--format", "raw", "-r", "50", "-d",
                             str(int(seconds)), "-p", str(pid), "-o", str(path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def summarize_profile(path: Path, top: int = 25) -> dict:
    """Samples by leaf frame (self) and by frame anywhere on the stack (inclusive), in % of the
    non-idle samples of the profiled process (all threads)."""
    self_c: dict[str, int] = {}
    incl: dict[str, int] = {}
    total = 0
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return {}
    for line in lines:
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        n = int(n)
        frames = [f.split(" (")[0] + " " + f.split("/")[-1].rstrip(")") if " (" in f else f for f in stack.split(";")[1:]]
        if not frames:
            continue
        total += n
        self_c[frames[-1]] = self_c.get(frames[-1], 0) + n
        for f in set(frames):
            incl[f] = incl.get(f, 0) + n

    def pct(d):
        return {k: round(100 * v / total, 1) for k, v in sorted(d.items(), key=lambda kv: -kv[1])[:top]}

    return {"samples": total, "self_pct": pct(self_c), "inclusive_pct": pct(incl)}


def app_for(config: str, args: dict):
    if config == "kvmesh":
        from cluster.app import build_app

        return build_app(args)
    from cluster.baselines import build_app

    return build_app({**args, "router": config})


def run_config(config: str, a, tenants_file: str, items) -> dict:
    import ray
    from ray import serve

    from bench import loadgen
    from cluster.loopback import start_serve
    from bench.workloads import Vocab, WorkItem

    ray.init(address="local", num_cpus=a.workers + 2, include_dashboard=True, log_to_driver=False)
    out: dict = {}
    try:
        port = start_serve()
        args = {"model": a.model, "tenants": tenants_file, "kv_cache_bytes": a.kv_mib << 20, "workers": a.workers,
                "max_workers": a.workers, "worker_num_cpus": 1}
        t0 = time.monotonic()
        serve.run(app_for(config, args), name=f"ic-{config}", route_prefix="/")
        base = f"http://127.0.0.1:{port}"
        vocab = Vocab() if a.model != "tiny-llama" else Vocab(vocab_size=259, low=3)
        import random

        warm = [WorkItem(vocab.tokens(random.Random(50 + i), 64), 4, 0.0, TENANT, TENANT) for i in range(2 * a.workers)]
        asyncio.run(loadgen.run(base, warm, {TENANT: KEY}, "default", mode="closed", concurrency=a.workers))
        out["deploy_s"] = round(time.monotonic() - t0, 1)
        print(f"{config}: ready in {out['deploy_s']} s; settling {a.settle_s} s", flush=True)
        time.sleep(a.settle_s)
        out["idle"] = window(a.idle_s)
        print(f"{config} idle: {out['idle']['cpu_s_per_s_total']} CPU-s/s {out['idle']['cpu_s_per_s']}", flush=True)

        def drive():
            rs = asyncio.run(loadgen.run(base, items, {TENANT: KEY}, "default", mode="open", rate_per_s=a.rate,
                                         timeout_s=300))
            return {"requests": len(rs), "ok": sum(r.ok for r in rs), "errors": [r.error for r in rs if r.error][:3],
                    "cached_tokens": sum(r.cached_tokens for r in rs),
                    "prompt_tokens": sum(r.prompt_tokens for r in rs),
                    "ttft_p50_s": loadgen.percentile([r.ttft_s for r in rs if r.ttft_s is not None], 50),
                    "routes": {k: sum(r.route == k for r in rs) for k in {r.route for r in rs}}}

        prof = None
        if a.profile_s > 0:
            workers = sorted(pid for pid, (role, _) in cpu_snapshot().items() if role == "worker")
            if workers:
                ppath = Path(tempfile.mkdtemp(prefix="ic-prof-")) / f"{config}.txt"
                prof = (start_profile(workers[0], a.profile_s, ppath), ppath)
        out["load"] = w = window(None, drive)
        if prof is not None and prof[0] is not None:
            try:
                prof[0].wait(timeout=a.profile_s + 30)
            except Exception:  # noqa: BLE001 - a stuck profiler: kill it, keep what it wrote
                prof[0].kill()
            out["load"]["worker_profile"] = summarize_profile(prof[1])
        ok = max(1, w["result"]["ok"])
        w["cpu_s_per_request"] = {k: round(v / ok, 4) for k, v in w["cpu_s"].items()}
        w["cpu_s_per_request_total"] = round(sum(w["cpu_s"].values()) / ok, 4)
        w["calls_per_request"] = {k: round(v * w["wall_s"] / ok, 2) for k, v in w["calls_per_s"].items()}
        print(f"{config} load: {w['result']['ok']}/{w['result']['requests']} ok, {w['cpu_s_per_request_total']} "
              f"CPU-s/request {w['cpu_s_per_request']}", flush=True)
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
    time.sleep(3)  # let the cluster's processes exit before the next one starts
    return out


def ratios(k: dict, b: dict) -> dict:
    def r(x, y):
        return round(x / y, 3) if y else None

    return {"idle_cpu_s_per_s": r(k["idle"]["cpu_s_per_s_total"], b["idle"]["cpu_s_per_s_total"]),
            "idle_calls_per_s": r(k["idle"]["calls_per_s_total"], b["idle"]["calls_per_s_total"]),
            "load_cpu_s_per_s": r(k["load"]["cpu_s_per_s_total"], b["load"]["cpu_s_per_s_total"]),
            "load_cpu_s_per_request": r(k["load"]["cpu_s_per_request_total"], b["load"]["cpu_s_per_request_total"]),
            "load_calls_per_s": r(k["load"]["calls_per_s_total"], b["load"]["calls_per_s_total"])}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--kv-mib", type=int, default=64)
    ap.add_argument("--idle-s", type=float, default=60.0)
    ap.add_argument("--settle-s", type=float, default=5.0)
    ap.add_argument("--rate", type=float, default=0.5, help="offered req/s of the load window")
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--users", type=int, default=6)
    ap.add_argument("--system-len", type=int, default=384)
    ap.add_argument("--question-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--profile-s", type=float, default=30.0,
                    help="py-spy one worker process for this long at the start of the load window (0: off)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "idle_cpu.json"))
    a = ap.parse_args(argv)

    import logging

    import yaml

    from bench.workloads import TINY_VOCAB, Vocab, shared_prefix

    logging.getLogger("httpx").setLevel(logging.WARNING)

    vocab = TINY_VOCAB if a.model == "tiny-llama" else Vocab()
    items = shared_prefix(a.groups, a.users, a.system_len, a.question_len, a.output_len, rate_per_s=a.rate, seed=7,
                          vocab=vocab, tenant=TENANT)
    doc = {"bench": "idle_cpu", "args": vars(a),
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_avg_start": os.getloadavg()},
           "configs": {}}
    with tempfile.TemporaryDirectory() as d:
        tenants = Path(d) / "tenants.yaml"
        tenants.write_text(yaml.safe_dump({"tenants": [{"name": TENANT, "api_keys": [KEY]}]}))
        for c in a.configs.split(","):
            doc["configs"][c] = run_config(c, a, str(tenants), items)
    doc["machine"]["load_avg_end"] = os.getloadavg()
    if {"kvmesh", "affinity"} <= set(doc["configs"]):
        doc["ratios_kvmesh_over_affinity"] = ratios(doc["configs"]["kvmesh"], doc["configs"]["affinity"])
    print(f"\nmachine: {doc['machine']}")
    for c, s in doc["configs"].items():
        for wname in ("idle", "load"):
            w = s[wname]
            print(f"{c:9s} {wname}: {w['cpu_s_per_s_total']:.3f} CPU-s/s {w['cpu_s_per_s']}")
            print(f"{'':9s} {wname}: {w['calls_per_s_total']:.1f} Ray calls/s; top "
                  f"{dict(list(w['calls_per_s'].items())[:8])}")
        print(f"{'':9s} load: {s['load']['cpu_s_per_request_total']:.3f} CPU-s/request {s['load']['cpu_s_per_request']}")
    if "ratios_kvmesh_over_affinity" in doc:
        print("kvmesh / affinity:", doc["ratios_kvmesh_over_affinity"])
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(doc, indent=1, default=str))
    print(f"wrote {a.out}")
    return doc


if __name__ == "__main__":
    main()
