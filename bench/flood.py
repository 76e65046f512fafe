"""Quotas under a flood: a hostile tenant floods a served kvmesh app (loopback, default model on
CPU); does a guaranteed, higher-priority tenant keep its TTFT and its cached blocks?

Tenants: ``victim`` (priority 2, ``cache.min_blocks`` guaranteed) and ``flooder`` (priority 0,
``limits`` on rate and concurrency). Phases:
  1. the victim warms its system prompt (a shared prefix) and records the blocks it holds;
  2. victim alone: ``--victim-requests`` requests (system prompt + a fresh question, 1 output
     token, one every ``--victim-interval-s``), TTFT at the client;
  3. the same victim load while ``--flood-clients`` threads send fresh long prompts as fast as they
     can, ignoring Retry-After (bounded by ``--flood-requests`` and the phase's duration). The
     flooders run in their own process (``--flooder``, started with ``subprocess`` and ended by its
     PID), so they share neither the GIL of the client that measures the victim's TTFT nor the
     Ray driver's;
  4. the victim's blocks held after the flood, and whether its system prompt still hits.
Reports the victim's TTFT p50/p90/p99 alone and under the flood (target: p99 within 1.5x), its
blocks before/after, the flooder's 200s and 429s (with Retry-After), and the engine's evictions;
load averages and the CPU seconds each process of the app (proxy, ingress replica, controller,
worker, ...) and the flooder process used in each phase (``psutil``, descendants of this process).

  python bench/flood.py          # ~3 min here
Writes bench/results/flood.json. Loopback only; stops by itself.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from cluster.loopback import start_serve  # noqa: E402


def tenants(args) -> dict:
    return {"admin_keys": ["sk-flood-admin"], "tenants": [
        {"name": "victim", "api_keys": ["sk-victim"], "priority": 2, "latency_guard": args.latency_guard,
         "cache": {"min_blocks": args.victim_min_blocks}},
        {"name": "flooder", "api_keys": ["sk-flooder"], "priority": 0,
         "limits": {"requests_per_s": args.flood_rate, "burst": args.flood_burst,
                    "max_concurrent": args.flood_concurrency}},
    ]}


def stream_ttft(client, key: str, prompt: list[int], max_tokens: int, model: str) -> tuple[int, float, dict]:
    """(status, seconds to the first token event or to the error, headers)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    t0 = time.perf_counter()
    with client.stream("POST", "/v1/completions", headers={"Authorization": f"Bearer {key}"}, json=body) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, time.perf_counter() - t0, dict(r.headers)
        t = None
        for line in r.iter_lines():
            if t is None and line.startswith("data: {"):
                t = time.perf_counter() - t0
        return 200, t if t is not None else float("nan"), {}


def victim_phase(client, model, system, rng, vocab, n, interval_s, deadline, sent: list | None = None) -> list[float]:
    """TTFTs (s) of the victim's sequential requests; ``sent`` gets each one's wall-clock send time."""
    out = []
    for _ in range(n):
        if time.monotonic() > deadline:
            break
        t_next = time.monotonic() + interval_s
        q = [rng.randrange(100, vocab - 100) for _ in range(32)]
        wall = time.time()
        code, t, _ = stream_ttft(client, "sk-victim", system + q, 1, model)
        if code == 200:
            out.append(t)
            if sent is not None:
                sent.append(wall)
        else:
            print(f"  victim got HTTP {code}", flush=True)
        time.sleep(max(0.0, t_next - time.monotonic()))
    return out


def pct(xs, q) -> float:
    return 1e3 * float(np.quantile(np.asarray(xs), q)) if xs else float("nan")


def victim_state(client) -> dict:
    r = client.get("/kvmesh/workers", headers={"Authorization": "Bearer sk-flood-admin"}).json()
    out = {"blocks_held": 0, "evictions": 0, "flooder_blocks_held": 0, "flooder_evictions": 0, "num_blocks": 0,
           "steps": 0, "interrupted_steps": 0, "flooder_requests": 0, "flooder_output_tokens": 0}
    for w in r["workers"]:
        e = w.get("engine") or {}
        out["num_blocks"] += e.get("num_blocks", 0)
        out["steps"] += e.get("steps", 0)
        out["interrupted_steps"] += e.get("interrupted_steps", 0)
        t = e.get("tenants", {})
        out["blocks_held"] += t.get("victim", {}).get("blocks_held", 0)
        out["evictions"] += t.get("victim", {}).get("evictions", 0)
        out["flooder_blocks_held"] += t.get("flooder", {}).get("blocks_held", 0)
        out["flooder_evictions"] += t.get("flooder", {}).get("evictions", 0)
        out["flooder_requests"] += t.get("flooder", {}).get("requests", 0)
        out["flooder_output_tokens"] += t.get("flooder", {}).get("output_tokens", 0)
    return out


def flooder_main(args) -> None:
    """The flooder process: ``--flood-clients`` threads, each sending fresh ``--flood-tokens``-token
    prompts back to back and ignoring Retry-After, until SIGTERM, ``--flood-deadline-s`` or
    ``--flood-requests`` attempts; prints its counts as one JSON line on stdout at the end."""
    import httpx

    if args.flooder_nice:
        os.nice(args.flooder_nice)  # models clients on another machine: their CPU is not the server's
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    t_begin = time.monotonic()
    deadline = t_begin + args.flood_deadline_s
    flood = {"ok": 0, "429": 0, "other": 0, "retry_after": [], "attempts": 0, "hit_attempt_bound": False}
    lock = threading.Lock()

    def flooder(seed):
        frng = random.Random(seed)
        c = httpx.Client(base_url=args.flood_url, timeout=300)
        while not stop.is_set() and time.monotonic() < deadline:
            with lock:
                if flood["attempts"] >= args.flood_requests:
                    flood["hit_attempt_bound"] = True
                    return
                flood["attempts"] += 1
            p = [frng.randrange(100, args.flood_vocab - 100) for _ in range(args.flood_tokens)]
            try:
                code, _, headers = stream_ttft(c, "sk-flooder", p, args.flood_max_tokens, args.flood_model)
            except httpx.HTTPError:
                code, headers = -1, {}
            with lock:
                if code == 200:
                    flood["ok"] += 1
                elif code == 429:
                    flood["429"] += 1
                    flood["retry_after"].append(headers.get("retry-after"))
                else:
                    flood["other"] += 1
            if code == 429:
                time.sleep(0.01)  # hostile: ignores Retry-After (a tiny pause keeps the client loop sane)

    threads = [threading.Thread(target=flooder, args=(args.seed + i,), daemon=True)
               for i in range(args.flood_clients)]
    for t in threads:
        t.start()
    while not stop.is_set() and time.monotonic() < deadline and any(t.is_alive() for t in threads):
        stop.wait(0.2)
    stop.set()
    for t in threads:
        t.join(timeout=30)
    with lock:
        flood["elapsed_s"] = time.monotonic() - t_begin
        print(json.dumps(flood), flush=True)


def start_flooders(args, base: str, vocab: int, model: str) -> subprocess.Popen:
    cmd = [sys.executable, __file__, "--flooder", "--flood-url", base, "--flood-vocab", str(vocab),
           "--flood-model", model, "--flood-deadline-s", str(args.phase_s + 30),
           "--flood-clients", str(args.flood_clients), "--flood-requests", str(args.flood_requests),
           "--flood-tokens", str(args.flood_tokens), "--flood-max-tokens", str(args.flood_max_tokens),
           "--seed", str(args.seed), "--flooder-nice", str(args.flooder_nice)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)


def stop_flooders(proc: subprocess.Popen) -> dict:
    """SIGTERM the flooder process by its PID, wait (bounded), SIGKILL if it lingers; its counts."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate(timeout=10)
    line = (out or "").strip().splitlines()
    return json.loads(line[-1]) if line else {"ok": 0, "429": 0, "other": 0, "retry_after": [], "attempts": 0,
                                              "hit_attempt_bound": False, "lost": True}


def cpu_by_process(extra: dict[str, int] | None = None) -> dict[str, float]:
    """CPU seconds (user + system) so far of every descendant of this process (the Ray cluster it
    started: gcs, raylet, Serve proxy and replica, controller, workers) plus ``extra`` {name: pid},
    keyed by "name[pid]" (the name: the process title up to its first '.', e.g. ``ray::Worker``)."""
    import psutil

    me = psutil.Process()
    named = {pid: name for name, pid in (extra or {}).items()}
    named[me.pid] = "bench"
    out = {}
    for p in [me, *me.children(recursive=True)]:
        try:
            name = named.get(p.pid)
            if name is None:
                cmd = p.cmdline()
                title = cmd[0].split(" ")[0] if cmd else ""
                name = title.split(".")[0] if title.startswith("ray::") else p.name()
            t = p.cpu_times()
            out[f"{name}[{p.pid}]"] = t.user + t.system
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    out["machine_busy"] = machine_busy_s()
    return out


def machine_busy_s() -> float:
    """CPU seconds the whole machine spent busy so far (all cores, /proc/stat; 0.0 elsewhere)."""
    try:
        f = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError):
        return 0.0
    idle = f[3] + (f[4] if len(f) > 4 else 0)
    return (sum(f[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def cpu_delta(a: dict[str, float], b: dict[str, float], seconds: float) -> dict[str, dict]:
    """Per process: CPU seconds between snapshots ``a`` and ``b`` and the share of one core."""
    out = {}
    for k, v in b.items():
        d = v - a.get(k, 0.0)
        if d >= 0.05 or k == "machine_busy":
            out[k] = {"cpu_s": round(d, 2), "cores": round(d / seconds, 3)}
    ours = sum(v["cpu_s"] for k, v in out.items() if k != "machine_busy")
    if "machine_busy" in out:  # what processes outside this benchmark used meanwhile
        other = out["machine_busy"]["cpu_s"] - ours
        out["outside_this_benchmark"] = {"cpu_s": round(other, 2), "cores": round(other / seconds, 3)}
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["cpu_s"]))


def trace_summary(tdir: Path, samples: list) -> dict:
    """Per victim sample (send time, TTFT) from the engine's step trace: client send -> worker
    ``generate`` (``path_in``), -> the engine thread adds it (``to_engine``: waiting out the step
    in progress), -> its first step starts (``engine_wait``), that step (``step``, with the other
    tenants' rows in it), the rest (``path_out``); p50/p90/max and the five slowest requests."""
    recs = [json.loads(line) for f in sorted(tdir.glob("steps-*.jsonl")) for line in f.read_text().splitlines()]
    recs.sort(key=lambda r: r["t"])
    gens = [r["t"] for r in recs if r["ev"] == "gen" and r["tenant"] == "victim"]
    adds = [r["t"] for r in recs if r["ev"] == "add" and r["tenant"] == "victim"]
    steps = [r for r in recs if r["ev"] == "step"]
    rows = []
    for sent, ttft in samples:
        g = next((t for t in gens if t >= sent), None)
        a = next((t for t in adds if g is not None and t >= g), None)
        st = next((r for r in steps if a is not None and r["t"] >= a and "victim" in r["tok"]
                   and not r["interrupted"]), None)
        if g is None or a is None or st is None or g - sent > 5:
            continue
        running = next((r for r in reversed(steps) if r["t"] <= g), None)  # the step in progress at arrival
        d = {"ttft": ttft, "path_in": 1e3 * (g - sent), "to_engine": 1e3 * (a - g), "engine_wait": 1e3 * (st["t"] - a),
             "step": 1e3 * st["dt"]}
        d["path_out"] = ttft - sum(d[k] for k in ("path_in", "to_engine", "engine_wait", "step"))
        d["step_others"] = {k: v for k, v in st["tok"].items() if k != "victim"}
        d["in_progress"] = ({"tok": running["tok"], "dt": 1e3 * running["dt"], "interrupted": running["interrupted"]}
                            if running else None)
        rows.append(d)
    keys = ("ttft", "path_in", "to_engine", "engine_wait", "step", "path_out")
    out = {k: {"p50": pct([r[k] / 1e3 for r in rows], .5), "p90": pct([r[k] / 1e3 for r in rows], .9),
               "max": max((r[k] for r in rows), default=float("nan"))} for k in keys}
    flood_steps = [r for r in steps if "victim" not in r["tok"]]
    out["n"] = len(rows)
    out["slowest"] = [{k: (round(v, 1) if isinstance(v, float) else v) for k, v in r.items()}
                      for r in sorted(rows, key=lambda r: -r["ttft"])[:5]]
    out["lower_class_steps"] = {"n": len(flood_steps), "interrupted": sum(r["interrupted"] for r in flood_steps),
                                "dt_ms_p50": pct([r["dt"] for r in flood_steps if not r["interrupted"]], .5),
                                "dt_ms_max": 1e3 * max((r["dt"] for r in flood_steps), default=float("nan"))}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--kv-cache-bytes", type=int, default=48 << 20, help="small: the flood must overflow it")
    ap.add_argument("--system-tokens", type=int, default=256)
    ap.add_argument("--victim-min-blocks", type=int, default=24)
    ap.add_argument("--victim-requests", type=int, default=40)
    ap.add_argument("--victim-interval-s", type=float, default=0.5)
    ap.add_argument("--flood-clients", type=int, default=6)
    ap.add_argument("--flood-requests", type=int, default=20000, help="bound on the flooder's attempts")
    ap.add_argument("--flood-tokens", type=int, default=384)
    ap.add_argument("--flood-max-tokens", type=int, default=8)
    ap.add_argument("--flood-rate", type=float, default=4.0)
    ap.add_argument("--flood-burst", type=int, default=4)
    ap.add_argument("--flood-concurrency", type=int, default=2)
    ap.add_argument("--phase-s", type=float, default=60.0, help="bound on each victim phase")
    ap.add_argument("--flooder-nice", type=int, default=0,
                    help="niceness added to the flooder process (0: it competes with the server for the CPU as "
                         "on one machine; 10: roughly a client elsewhere)")
    ap.add_argument("--latency-guard", action=argparse.BooleanOptionalAction, default=True,
                    help="the victim's tenants-file latency_guard (lower classes' prefill capped at all times)")
    ap.add_argument("--reject-delay-s", type=float, default=1.0,
                    help="app argument reject_delay_s (a 429 of a tenant retrying inside Retry-After is held this long)")
    ap.add_argument("--engine-nice", type=int, default=0,
                    help="app argument engine_thread_nice (e.g. -5: the engine thread before the HTTP front end; root)")
    ap.add_argument("--low-prefill-tokens", type=int, default=None,
                    help="app argument low_priority_prefill_tokens (default: the app's, 32)")
    ap.add_argument("--guarded-alone", action=argparse.BooleanOptionalAction, default=True,
                    help="app argument guarded_steps_alone (a guarded prefill step carries no lower-class decodes)")
    ap.add_argument("--interrupt", action=argparse.BooleanOptionalAction, default=True,
                    help="app argument interrupt_for_guarded (a lower-class step is abandoned for a guarded arrival)")
    ap.add_argument("--step-trace", action="store_true",
                    help="engine per-step trace (engine/step_trace.py): where each flooded victim request waited")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "bench/results/flood.json"))
    # the flooder process's own arguments (set by start_flooders)
    ap.add_argument("--flooder", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--flood-url", help=argparse.SUPPRESS)
    ap.add_argument("--flood-vocab", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--flood-model", help=argparse.SUPPRESS)
    ap.add_argument("--flood-deadline-s", type=float, default=120.0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.flooder:
        flooder_main(args)
        return

    import httpx
    import ray
    import yaml
    from ray import serve

    from cluster.app import build_app, load_tokenizer

    t_start = time.monotonic()
    rng = random.Random(args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="kvmesh-flood-"))
    (tmp / "tenants.yaml").write_text(yaml.safe_dump(tenants(args)))
    if args.step_trace:  # inherited by the Ray workers this driver starts
        os.environ["KVMESH_STEP_TRACE_DIR"] = str(tmp / "trace")
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    port = start_serve()
    try:
        serve.run(build_app({"model": args.model, "tenants": str(tmp / "tenants.yaml"),
                             "kv_cache_bytes": args.kv_cache_bytes, "worker_num_cpus": 1,
                             "reject_delay_s": args.reject_delay_s, "engine_thread_nice": args.engine_nice,
                             "guarded_steps_alone": args.guarded_alone, "interrupt_for_guarded": args.interrupt,
                             **({"low_priority_prefill_tokens": args.low_prefill_tokens}
                                if args.low_prefill_tokens is not None else {})}),
                  name="flood", route_prefix="/")
        base = f"http://127.0.0.1:{port}"
        client = httpx.Client(base_url=base, timeout=300)
        model = client.get("/v1/models", headers={"Authorization": "Bearer sk-victim"}).json()["data"][0]["id"]
        tok = load_tokenizer(args.model)[1]
        vocab = int(getattr(tok, "vocab_size", 0) or len(tok))
        system = [rng.randrange(100, vocab - 100) for _ in range(args.system_tokens)]
        # the cost scale of the flood: one flood-sized prompt alone (prefill of flood_tokens); first,
        # so that these fresh prompts do not push the victim's own system prompt out of its cache
        flood_alone = [stream_ttft(client, "sk-victim", [rng.randrange(100, vocab - 100)
                                                         for _ in range(args.flood_tokens)], 1, model)[1]
                       for _ in range(5)]
        # the same prompts as the flooder (priority 0): what the latency guard costs a lower class alone
        flooder_alone = [stream_ttft(client, "sk-flooder", [rng.randrange(100, vocab - 100)
                                                            for _ in range(args.flood_tokens)], 1, model)
                         for _ in range(3)]
        flooder_alone = [t for code, t, _ in flooder_alone if code == 200]
        for _ in range(3):  # warm-up + the system prompt cached
            stream_ttft(client, "sk-victim", system + [rng.randrange(100, vocab - 100) for _ in range(32)], 1, model)
        before = victim_state(client)
        print(f"victim holds {before['blocks_held']} of {before['num_blocks']} blocks; alone phase", flush=True)
        load = {"alone_start": os.getloadavg()}
        cpu0, t0 = cpu_by_process(), time.monotonic()
        sent_alone, sent_flood = [], []
        alone = victim_phase(client, model, system, rng, vocab, args.victim_requests, args.victim_interval_s,
                             time.monotonic() + args.phase_s, sent_alone)
        cpu = {"alone": cpu_delta(cpu0, cpu_by_process(), time.monotonic() - t0)}
        load["alone_end"] = os.getloadavg()
        mid = victim_state(client)

        proc = start_flooders(args, base, vocab, model)
        try:
            time.sleep(2.0)  # the flood is established
            print(f"under the flood (flooder process pid {proc.pid})", flush=True)
            load["flood_start"] = os.getloadavg()
            cpu1, t1 = cpu_by_process({"flooder": proc.pid}), time.monotonic()
            flooded = victim_phase(client, model, system, rng, vocab, args.victim_requests, args.victim_interval_s,
                                   time.monotonic() + args.phase_s, sent_flood)
            cpu2, t2 = cpu_by_process({"flooder": proc.pid}), time.monotonic()
            load["flood_end"] = os.getloadavg()
        finally:
            flood = stop_flooders(proc)
        cpu["flood"] = cpu_delta(cpu1, cpu2, t2 - t1)
        after = victim_state(client)
        code, _, _ = stream_ttft(client, "sk-victim", system + [5] * 32, 1, model)
        r = client.post("/v1/completions", headers={"Authorization": "Bearer sk-victim"},
                        json={"model": model, "prompt": system + [7] * 32, "max_tokens": 1})
        system_hit = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    finally:
        serve.shutdown()
        ray.shutdown()

    ratio = pct(flooded, 0.99) / pct(alone, 0.99)
    retry = [int(x) for x in flood["retry_after"] if x is not None]
    res = {
        "victim_ttft_ms": {"alone": {"n": len(alone), "p50": pct(alone, .5), "p90": pct(alone, .9), "p99": pct(alone, .99)},
                           "flood": {"n": len(flooded), "p50": pct(flooded, .5), "p90": pct(flooded, .9),
                                     "p99": pct(flooded, .99)}},
        "flood_sized_prompt_ttft_alone_ms": {"p50": pct(flood_alone, .5), "n": len(flood_alone)},
        "flood_sized_prompt_ttft_alone_as_flooder_ms": {"p50": pct(flooder_alone, .5), "n": len(flooder_alone)},
        "p99_ratio_flood_over_alone": ratio, "target_p99_ratio": 1.5, "meets_target": ratio <= 1.5,
        "victim_blocks": {"before": before["blocks_held"], "after": after["blocks_held"],
                          "min_blocks": args.victim_min_blocks, "evictions": after["evictions"]},
        "victim_system_prompt_cached_tokens_after": system_hit,
        "engine_steps": {"alone": {"steps": mid["steps"] - before["steps"],
                                   "interrupted": mid["interrupted_steps"] - before["interrupted_steps"]},
                         "flood": {"steps": after["steps"] - mid["steps"],
                                   "interrupted": after["interrupted_steps"] - mid["interrupted_steps"],
                                   "flooder_requests_engine": after["flooder_requests"] - mid["flooder_requests"],
                                   "flooder_output_tokens_engine": (after["flooder_output_tokens"]
                                                                    - mid["flooder_output_tokens"])}},
        "victim_samples": {"alone": [[round(a, 3), round(1e3 * b, 1)] for a, b in zip(sent_alone, alone)],
                           "flood": [[round(a, 3), round(1e3 * b, 1)] for a, b in zip(sent_flood, flooded)],
                           "columns": ["sent_unix_s", "ttft_ms"]},
        "load_average_1_5_15": load, "cpu_by_process": cpu,
        "flooder": {"attempts": flood["attempts"], "ok": flood["ok"], "rejected_429": flood["429"],
                    "elapsed_s": flood.get("elapsed_s"),
                    "ok_per_s": flood["ok"] / flood["elapsed_s"] if flood.get("elapsed_s") else None,
                    "tokens_per_s": (flood["ok"] * (args.flood_tokens + args.flood_max_tokens) / flood["elapsed_s"]
                                     if flood.get("elapsed_s") else None),
                    "attempts_per_s": flood["attempts"] / flood["elapsed_s"] if flood.get("elapsed_s") else None,
                    "hit_attempt_bound": flood.get("hit_attempt_bound"), "separate_process": True,
                    "other_errors": flood["other"], "all_429_had_retry_after": len(retry) == flood["429"],
                    "retry_after_s_min": min(retry) if retry else None,
                    "blocks_held_after": after["flooder_blocks_held"], "evictions": after["flooder_evictions"]},
        "args": vars(args), "seconds": time.monotonic() - t_start,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
    }
    if args.step_trace:
        res["step_trace"] = {ph: trace_summary(tmp / "trace", res["victim_samples"][ph]) for ph in ("alone", "flood")}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2))
    v = res["victim_ttft_ms"]
    print(f"\nmachine: {res['machine']}; {res['seconds']:.0f} s")
    print(f"victim TTFT ms   alone: p50 {v['alone']['p50']:.0f} p90 {v['alone']['p90']:.0f} p99 {v['alone']['p99']:.0f}"
          f"  (n={v['alone']['n']})")
    print(f"                 flood: p50 {v['flood']['p50']:.0f} p90 {v['flood']['p90']:.0f} p99 {v['flood']['p99']:.0f}"
          f"  (n={v['flood']['n']})")
    print(f"one {args.flood_tokens}-token prompt alone: TTFT p50 {pct(flood_alone, .5):.0f} ms (the flood's step scale)")
    print(f"  as the flooder (priority 0; latency_guard {args.latency_guard}): TTFT p50 {pct(flooder_alone, .5):.0f} ms")
    fl = res["flooder"]
    if fl["ok_per_s"] is not None:
        print(f"flooder throughput: {fl['ok_per_s']:.2f} served/s, {fl['tokens_per_s']:.0f} tokens/s, "
              f"{fl['attempts_per_s']:.1f} attempts/s over {fl['elapsed_s']:.0f} s")
    print(f"p99 flood/alone: {ratio:.2f}x (target <= 1.5x: {'met' if ratio <= 1.5 else 'MISSED'})")
    print(f"victim blocks before/after: {before['blocks_held']}/{after['blocks_held']} (min {args.victim_min_blocks},"
          f" evictions {after['evictions']}); system prompt cached after: {system_hit} tokens")
    print(f"flooder: {flood['attempts']} attempts, {flood['ok']} served, {flood['429']} x 429 "
          f"(Retry-After on all: {len(retry) == flood['429']}), {flood['other']} other errors")
    es = res["engine_steps"]
    print(f"engine steps alone {es['alone']['steps']} (interrupted {es['alone']['interrupted']}); flood "
          f"{es['flood']['steps']} (interrupted {es['flood']['interrupted']}; interrupt_for_guarded {args.interrupt}, "
          f"guarded_steps_alone {args.guarded_alone})")
    print(f"load average (1/5/15 min): {load}")
    for phase, procs in cpu.items():
        top = ", ".join(f"{k} {v['cores']:.2f}" for k, v in list(procs.items())[:8])
        print(f"CPU cores used, {phase}: {top}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
