"""float32 vs bfloat16 through the served app (`make serve`'s config, one worker, loopback).

For each dtype: `cluster/serve.yaml` with `dtype:` set and its own port is started with
`python -m cluster.serve_cli run` (Ray local), then ``--prompts`` fresh ~480-token prompts are
sent one at a time, each twice (cold, then a full prefix hit), greedy, 8 output tokens. Reported
per dtype: TTFT and engine prefill medians (``kvmesh.timings``) of the cold and the hit requests
(the first prompt is a warm-up and not counted) and how many hit answers equal their cold one.
bench/dtype.py measures the engine alone.

    .venv/bin/python bench/dtype_served.py          # ~3 min here
Writes bench/results/dtype_served.json. Loopback only; stops the apps it started.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
WORDS = "river stone cloud music garden window silver paper orange winter candle forest letter bridge".split()


def serve(dtype: str, port: int) -> subprocess.Popen:
    text = (ROOT / "cluster/serve.yaml").read_text()
    text = text.replace("port: 8000", f"port: {port}").replace("      block_size: 16", f"      block_size: 16\n      dtype: {dtype}")
    cfg = Path(tempfile.mkdtemp()) / f"serve-{dtype}.yaml"
    cfg.write_text(text)
    log = open(cfg.with_suffix(".log"), "w")
    return subprocess.Popen([sys.executable, "-m", "cluster.serve_cli", "run", str(cfg)], cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT, env={**os.environ, "RAY_ADDRESS": "local"})


def probe(port: int, prompts: int) -> dict:
    c = httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": "Bearer sk-demo"}, timeout=120)
    deadline = time.monotonic() + 300
    while True:
        try:
            if c.get("/health").json().get("status") == "ok":
                break
        except (httpx.HTTPError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("the app did not become healthy in 300 s")
        time.sleep(2)
    rng = random.Random(0)
    rows = []
    for i in range(prompts + 1):
        text = " ".join(rng.choice(WORDS) for _ in range(480))
        pair = {}
        for kind in ("cold", "hit"):
            j = c.post("/v1/completions", json={"model": "SmolLM2-135M-Instruct", "prompt": text, "max_tokens": 8,
                                                "temperature": 0}).json()
            t = j["kvmesh"]["timings"]
            pair[kind] = {"ttft_s": t["ttft_s"], "prefill_s": t["prefill_s"], "text": j["choices"][0]["text"],
                          "cached_tokens": j["usage"].get("prompt_tokens_details", {}).get("cached_tokens")}
        if i:  # the first pair warms the worker up
            rows.append(pair)
    med = {f"{kind}_{k}": statistics.median(r[kind][k] for r in rows) for kind in ("cold", "hit")
           for k in ("ttft_s", "prefill_s")}
    return {**med, "hit_equals_cold": sum(r["hit"]["text"] == r["cold"]["text"] for r in rows), "pairs": len(rows),
            "rows": rows}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--out", default="bench/results/dtype_served.json")
    args = ap.parse_args()
    res = {}
    for n, dtype in enumerate(("float32", "bfloat16")):
        port = 8790 + n
        proc = serve(dtype, port)
        try:
            res[dtype] = probe(port, args.prompts)
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
        r = res[dtype]
        print(f"{dtype:9s} cold TTFT p50 {r['cold_ttft_s']:.3f} s (prefill {r['cold_prefill_s']:.3f}), hit TTFT p50 "
              f"{r['hit_ttft_s']:.3f} s; hit answer = cold answer in {r['hit_equals_cold']} of {r['pairs']}", flush=True)
    f32, b16 = res["float32"], res["bfloat16"]
    ratios = {k: f32[k] / b16[k] for k in ("cold_ttft_s", "hit_ttft_s")}
    print(f"ratio float32 / bfloat16: cold TTFT {ratios['cold_ttft_s']:.2f}x, hit TTFT {ratios['hit_ttft_s']:.2f}x "
          f"(machine: {os.cpu_count()} cpus)")
    Path(args.out).write_text(json.dumps({"bench": "dtype_served", "machine": {"cpus": os.cpu_count()},
                                          "ratio_f32_over_bf16": ratios, "by_dtype": res}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
