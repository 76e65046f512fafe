"""The request path's own cost: kvmesh vs the plain Serve deployment, one worker each, same engine.

Both apps run at once on loopback (default model on CPU, one worker / one engine replica each,
one CPU thread each) and get the same requests interleaved one at a time, so the machine's load
is the same for both: a fixed prompt (every request after the first is a full prefix hit),
``--max-tokens`` output tokens, streamed. Per configuration: TTFT, time per output token and
latency (p50/p90), and the CPU seconds each of the app's processes used per request (ingress,
Serve proxy share, controller, router, index, worker), then the same processes' CPU while idle
(``--idle-s``): background loops (heartbeats, health checks, index publishing, autoscaling).
What the kvmesh path adds over Serve's (controller lease, index lookup, router ranking, the
worker actor's stream) shows up as the TTFT difference on identical hits and as the extra
processes' CPU.

    .venv/bin/python bench/request_path.py            # about 3 min here
Writes bench/results/request_path.json. Loopback only; stops by itself.
"""

from __future__ import annotations

import argparse
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

import numpy as np  # noqa: E402

KEY = "sk-bench"
CONFIGS = ("kvmesh", "pow2")


def stream_once(client, path: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": "default", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    times, cached = [], None
    with client.stream("POST", f"{path}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            d = json.loads(line[6:])
            if d.get("choices") and d["choices"][0].get("text") is not None:
                times.append(time.perf_counter() - t0)
            if d.get("usage"):
                cached = (d["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
    end = time.perf_counter() - t0
    tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
    return {"ttft_s": times[0] if times else None, "tpot_s": tpot, "latency_s": end, "cached": cached}


# the processes of each configuration (``bench.servelab.processes`` roles; the Serve proxy, shared
# by both apps, is counted on its own)
ROLES = {"kvmesh": ("ingress", "controller", "router", "index", "worker"), "pow2": ("ingress", "engine_replica")}


def app_pids(app: str, config: str) -> dict[str, list[int]]:
    from bench.servelab import processes

    procs = processes(app)
    return {role: [p["pid"] for p in procs.get(role, [])] for role in ROLES[config]}


def cpu_s(pids: dict[str, list[int]]) -> dict[str, float]:
    import psutil

    out = {}
    for role, ps in pids.items():
        t = 0.0
        for pid in ps:
            try:
                c = psutil.Process(pid).cpu_times()
                t += c.user + c.system
            except psutil.Error:
                pass
        out[role] = t
    return out


def pct(xs, q):
    xs = [x for x in xs if x is not None]
    return float(np.percentile(xs, q)) if xs else None


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=30, help="per configuration, after 2 warm-up requests")
    ap.add_argument("--prompt-tokens", type=int, default=552)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--idle-s", type=float, default=20.0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "request_path.json"))
    a = ap.parse_args(argv)

    import httpx
    import ray
    import yaml
    from ray import serve

    from bench.servelab import processes
    from cluster.loopback import start_serve
    from cluster.app import build_app as kvmesh_app
    from cluster.baselines import build_app as baseline_app

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    rows: dict = {c: [] for c in CONFIGS}
    try:
        port = start_serve()
        with tempfile.TemporaryDirectory() as d:
            tenants = Path(d) / "tenants.yaml"
            tenants.write_text(yaml.safe_dump({"tenants": [{"name": "bench", "api_keys": [KEY]}]}))
            args = {"model": "default", "tenants": str(tenants), "kv_cache_bytes": 64 << 20, "workers": 1,
                    "worker_num_cpus": 1}
            serve.run(kvmesh_app(args), name="rp-kvmesh", route_prefix="/kvmesh")
            serve.run(baseline_app({**args, "router": "pow2"}), name="rp-pow2", route_prefix="/pow2")
            client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600)
            prompt = [(37 * i) % 40000 + 100 for i in range(a.prompt_tokens)]
            for c in CONFIGS:  # warm-up: the first computes the prefix, the second hits it
                for _ in range(2):
                    stream_once(client, f"/{c}", prompt, a.max_tokens)
            pids = {c: app_pids(f"rp-{c}", c) for c in CONFIGS}
            proxy = [p["pid"] for p in processes("rp-kvmesh").get("serve_proxy", [])]
            busy = {c: 0.0 for c in CONFIGS}
            cpu = {c: {} for c in CONFIGS}
            for i in range(a.requests):
                for c in (CONFIGS if i % 2 == 0 else CONFIGS[::-1]):  # alternate who goes first
                    c0, p0 = cpu_s(pids[c]), cpu_s({"serve_proxy": proxy})
                    t = time.perf_counter()
                    rows[c].append(stream_once(client, f"/{c}", prompt, a.max_tokens))
                    busy[c] += time.perf_counter() - t
                    c1, p1 = cpu_s(pids[c]), cpu_s({"serve_proxy": proxy})
                    for k in c1:
                        cpu[c][k] = cpu[c].get(k, 0.0) + c1[k] - c0.get(k, 0.0)
                    cpu[c]["serve_proxy"] = cpu[c].get("serve_proxy", 0.0) + p1["serve_proxy"] - p0["serve_proxy"]
            idle0 = {c: cpu_s(pids[c]) for c in CONFIGS}
            time.sleep(a.idle_s)
            idle1 = {c: cpu_s(pids[c]) for c in CONFIGS}
    finally:
        serve.shutdown()
        ray.shutdown()

    out = {"bench": "request_path", "args": vars(a), "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                                                                "load_avg_end": os.getloadavg()},
           "configs": {}}
    for c in CONFIGS:
        r = rows[c]
        out["configs"][c] = {
            "requests": len(r), "all_hits": all((x["cached"] or 0) > 0 for x in r),
            "ttft_s": {"p50": pct([x["ttft_s"] for x in r], 50), "p90": pct([x["ttft_s"] for x in r], 90)},
            "tpot_s": {"p50": pct([x["tpot_s"] for x in r], 50), "p90": pct([x["tpot_s"] for x in r], 90)},
            "latency_s": {"p50": pct([x["latency_s"] for x in r], 50)},
            "cpu_s_per_request": {k: round(v / len(r), 4) for k, v in sorted(cpu[c].items())},
            "idle_cpu_s_per_s": {k: round((idle1[c][k] - idle0[c].get(k, 0.0)) / a.idle_s, 4) for k in idle1[c]},
        }
    k, p = out["configs"]["kvmesh"], out["configs"]["pow2"]
    out["ratios"] = {"ttft_p50_kvmesh_over_pow2": k["ttft_s"]["p50"] / p["ttft_s"]["p50"],
                     "tpot_p50_kvmesh_over_pow2": k["tpot_s"]["p50"] / p["tpot_s"]["p50"],
                     "cpu_per_request_kvmesh_over_pow2": sum(k["cpu_s_per_request"].values())
                     / max(1e-9, sum(p["cpu_s_per_request"].values()))}
    print(f"\nmachine: {out['machine']}; {a.requests} requests each, interleaved, {a.prompt_tokens}-token prompt "
          f"(hits), {a.max_tokens} tokens out")
    for c, s in out["configs"].items():
        print(f"{c:7s} TTFT p50 {s['ttft_s']['p50'] * 1e3:7.1f} ms  TPOT p50 {s['tpot_s']['p50'] * 1e3:6.1f} ms  "
              f"latency p50 {s['latency_s']['p50'] * 1e3:7.1f} ms  all hits {s['all_hits']}")
        print(f"        CPU s/request {s['cpu_s_per_request']}")
        print(f"        idle CPU s/s  {s['idle_cpu_s_per_s']}")
    print("ratios:", {k: round(v, 3) for k, v in out["ratios"].items()})
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {a.out}")
    return out


if __name__ == "__main__":
    main()
