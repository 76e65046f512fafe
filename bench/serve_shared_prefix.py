"""The issue-11 reproduction on one machine: shared-prefix groups against kvmesh and the baselines.

Deploys each configuration in turn on loopback (Ray ``address="local"``, Serve on 127.0.0.1):
``kvmesh`` (cluster/app.py), ``pow2`` and ``affinity`` (cluster/baselines.py: Serve's
power-of-two router and Ray's PrefixCacheAffinityRouter over the same engine as Serve replicas),
drives ``bench.workloads.shared_prefix`` with ``bench.loadgen`` (closed loop, streaming), and
prints per configuration: cluster hit tokens vs the infinite-cache oracle, requests per worker,
TTFT p50/p90, and (kvmesh) the router's decisions from ``/metrics``. Writes
``bench/results/serve_shared_prefix.json``. Not the whole-cluster benchmark (``bench/cluster.py``:
namespaced nodes, shaped links, sweeps); a quick check of placement on the real engine.

    .venv/bin/python bench/serve_shared_prefix.py --workers 2 --kv-mib 64      # the issue's run
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

import httpx  # noqa: E402
import yaml  # noqa: E402

from bench import loadgen  # noqa: E402
from bench.workloads import TINY_VOCAB, Vocab, oracle_hits, shared_prefix  # noqa: E402
from cluster.loopback import start_serve  # noqa: E402

KEY = "sk-bench"


def _metric_lines(text: str, prefix: str) -> dict[str, float]:
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith(prefix)}


def run_config(config: str, args, tenants: str, items, base: str, serve) -> dict:
    from cluster.app import build_app as kvmesh_app
    from cluster.baselines import build_app as baseline_app

    app_args = {"model": args.model, "tenants": tenants, "kv_cache_bytes": args.kv_mib << 20,
                "workers": args.workers, "worker_num_cpus": 1}
    name = f"sp-{config}"
    app = kvmesh_app(app_args) if config == "kvmesh" else baseline_app({**app_args, "router": config})
    t = time.perf_counter()
    serve.run(app, name=name, route_prefix=f"/{config}")
    print(f"[{config}] deployed in {time.perf_counter() - t:.0f}s; {len(items)} requests, "
          f"concurrency {args.concurrency}", flush=True)
    model = "default" if args.model == "default" else args.model
    done = []

    def progress(r):
        done.append(r)
        print(f"\r[{config}] {len(done)}/{len(items)}", end="", flush=True)

    t = time.perf_counter()
    res = asyncio.run(loadgen.run(f"{base}/{config}", items, lambda _t: KEY, model, mode="closed",
                                  concurrency=args.concurrency, timeout_s=600, progress=progress))
    wall = time.perf_counter() - t
    print()
    metrics = httpx.get(f"{base}/{config}/metrics", timeout=60).text
    serve.delete(name)
    summary = loadgen.summarize(res, wall_s=wall)
    return {"config": config, "summary": summary,
            "router": _metric_lines(metrics, "kvmesh_router_"),
            "errors": [r.error for r in res if not r.ok][:5]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default="kvmesh,pow2,affinity")
    ap.add_argument("--model", default="default")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--kv-mib", type=int, default=64)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--users", type=int, default=6)
    ap.add_argument("--system-len", type=int, default=600)
    ap.add_argument("--question-len", type=int, default=40)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "serve_shared_prefix.json"))
    a = ap.parse_args(argv)
    import ray
    from ray import serve

    vocab = TINY_VOCAB if a.model == "tiny-llama" else Vocab()
    items = shared_prefix(a.groups, a.users, a.system_len, a.question_len, a.output_len, seed=a.seed, vocab=vocab)
    oracle = sum(oracle_hits(items, 16))
    ray.init(address="local", num_cpus=a.workers + 2, include_dashboard=False, log_to_driver=False)
    rows = []
    try:
        port = start_serve()
        with tempfile.TemporaryDirectory() as d:
            tenants = Path(d) / "tenants.yaml"
            tenants.write_text(yaml.safe_dump({"tenants": [{"name": "bench", "api_keys": [KEY]}]}))
            for config in a.configs.split(","):
                rows.append(run_config(config, a, str(tenants), items, f"http://127.0.0.1:{port}", serve))
    finally:
        serve.shutdown()
        ray.shutdown()
    print(f"\nshared prefix {a.groups} groups x {a.users} users, system {a.system_len} + question {a.question_len} "
          f"tokens, {a.output_len} out; {a.workers} workers x {a.kv_mib} MiB KV; model {a.model}; "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; oracle hit tokens {oracle}")
    print(f"{'config':10s} {'hit tokens':>10s} {'vs oracle':>9s} {'TTFT p50':>9s} {'p90':>7s}  per worker")
    for r in rows:
        s = r["summary"]
        print(f"{r['config']:10s} {s['cached_tokens']:10d} {s['cached_tokens'] / oracle:9.3f} "
              f"{s['ttft_s']['p50'] or 0:9.3f} {s['ttft_s']['p90'] or 0:7.3f}  {sorted(s['per_worker'].values())}"
              + (f"  errors {s['errors']}" if s["errors"] else ""))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"oracle_hit_tokens": oracle, "args": vars(a), "rows": rows,
                                       "machine": {"cpus": os.cpu_count(), "platform": platform.platform()}},
                                      indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
