"""A noisy neighbour of equal priority: does another tenant's TTFT survive 200 requests sent at once?

Two tenants of one priority class, neither with ``limits`` (as the shipped ``demo`` tenant):
``noisy`` sends ``--flood`` completions at once (short fresh prompts, ``--flood-max-tokens``
outputs each); ``victim`` sends one short stream every ``--victim-interval-s`` from the same
moment. The same served app (loopback, default model on CPU, by default the shipped
``cluster/serve.yaml``'s one worker with 256 MiB of KV) runs with the
app argument ``fair_share`` off (arrival order across tenants in each worker's waiting queue) and
on (virtual token counters, ``policies/fair_share.py``), alternating, ``--rounds`` times each, in
one run. Before each flood the victim sends the same streams alone.

Reports per mode the victim's TTFT p50/p90/max alone and under the flood, the flood's makespan
(first send to last response) and served tokens per second, and the ratios on/off; writes
``bench/results/fair_share.json`` and a PNG of the victim's TTFT against its send time.

    nice -n 5 python bench/fair_share.py      # ~6 min here
    nice -n 5 python bench/fair_share.py --engine   # the engine alone, no HTTP front: ~2 min

``--engine`` drives one ``LLMEngine`` (default model, one thread, 256 MiB of KV) directly: the same
200 requests added at once, a victim request added before steps 3, 10 and 20, off and on
alternating twice; it reports each victim's TTFT, the steps and the total time, and writes
``bench/results/fair_share_engine.json``. Loopback only; stops by itself.

Where the KV pool rather than the sequence limit is full (session 42): ``--flip fair_preempt``
turns that app argument off and on instead (with ``fair_share`` on), and ``--flood-prompt-words``
/ ``--victim-prompt-words`` lengthen the prompts (filler words after a distinct head, so nothing
is a prefix hit), e.g. with ``--kv-cache-bytes 67108864 --flood 12 --flood-prompt-words 150
--flood-max-tokens 100 --victims 8 --victim-interval-s 4 --victim-prompt-words 120
--victim-max-tokens 8`` (~11 min). The served mode also reports each victim stream's whole time,
the engine mode each victim request's whole time and the engine's preemptions.
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

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from cluster.loopback import start_serve  # noqa: E402

TENANTS = {"admin_keys": ["sk-fair-admin"], "tenants": [
    {"name": "victim", "api_keys": ["sk-victim"]},
    {"name": "noisy", "api_keys": ["sk-noisy"]},
]}


MODEL = {"id": None}  # the served model's id, from /v1/models


async def stream_ttft(client, key: str, prompt: str, max_tokens: int) -> tuple[int, float | None, dict | None, float]:
    """(status, seconds to the first streamed token or None, the response's ``kvmesh.timings``,
    seconds to the end of the stream)."""
    body = {"model": MODEL["id"], "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    t0 = time.perf_counter()
    async with client.stream("POST", "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as r:
        if r.status_code != 200:
            await r.aread()
            return r.status_code, None, None, time.perf_counter() - t0
        first, timings = None, None
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: {") and '"text"' in line:
                first = time.perf_counter() - t0
            if line.startswith("data: {") and '"timings"' in line:
                timings = json.loads(line[6:]).get("kvmesh", {}).get("timings")
        return 200, first, timings, time.perf_counter() - t0


async def complete(client, key: str, prompt: str, max_tokens: int) -> tuple[int, float, int]:
    """(status, seconds to the whole response, completion tokens)."""
    t0 = time.perf_counter()
    r = await client.post("/v1/completions", headers={"Authorization": f"Bearer {key}"},
                          json={"model": MODEL["id"], "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    toks = r.json().get("usage", {}).get("completion_tokens", 0) if r.status_code == 200 else 0
    return r.status_code, time.perf_counter() - t0, toks


def filler(words: int) -> str:
    return "".join(f" word{j}" for j in range(words))


def victim_prompt(head: str, words: int) -> str:
    return f"{head}:{filler(words)} name a colour."


def flood_prompt(head: str, i: int, words: int) -> str:
    return f"{head} {i}: write about the number {i}.{filler(words)}"


async def victims(client, n: int, interval_s: float, tag: str, words: int = 0,
                  max_tokens: int = 4) -> list[tuple[float, int, float | None]]:
    """``n`` victim streams ``interval_s`` apart: (sent at, status, TTFT, server-side stages, whole stream)."""
    async def one(i):
        await asyncio.sleep(i * interval_s)
        code, ttft, timings, total = await stream_ttft(client, "sk-victim", victim_prompt(f"{tag} question {i}", words),
                                                       max_tokens)
        return i * interval_s, code, ttft, timings, total

    return list(await asyncio.gather(*(one(i) for i in range(n))))


async def phase(base: str, args, round_no: int) -> dict:
    import httpx

    async with httpx.AsyncClient(base_url=base, timeout=600,
                                 limits=httpx.Limits(max_connections=args.flood + 64)) as c:
        models = await c.get("/v1/models", headers={"Authorization": "Bearer sk-victim"})
        MODEL["id"] = models.json()["data"][0]["id"]
        vargs = (args.victim_prompt_words, args.victim_max_tokens)
        alone = await victims(c, args.victims, args.victim_interval_s, f"r{round_no} alone", *vargs)
        t0 = time.perf_counter()
        flood = [asyncio.create_task(complete(c, "sk-noisy", flood_prompt(f"r{round_no} flood", i, args.flood_prompt_words),
                                              args.flood_max_tokens)) for i in range(args.flood)]
        under = await victims(c, args.victims, args.victim_interval_s, f"r{round_no} flood", *vargs)
        done = await asyncio.gather(*flood)
        makespan = time.perf_counter() - t0
    return {"alone": alone, "flood_victims": under, "flood_status": sorted({str(d[0]) for d in done}),
            "flood_ok": sum(d[0] == 200 for d in done), "flood_n": len(done), "flood_makespan_s": makespan,
            "flood_tokens_per_s": sum(d[2] for d in done) / makespan,
            "flood_latency_p50_s": float(np.median([d[1] for d in done]))}


def stats(samples: list, at: int = 2) -> dict:
    t = [s[at] for s in samples if s[1] == 200 and s[2] is not None]
    return {"n": len(t), "failed": len(samples) - len(t),
            "p50_s": float(np.quantile(t, .5)) if t else None, "p90_s": float(np.quantile(t, .9)) if t else None,
            "max_s": max(t) if t else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    # the shipped cluster/serve.yaml: one worker of one CPU with 256 MiB of KV
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--worker-num-cpus", type=float, default=1.0)
    ap.add_argument("--kv-cache-bytes", type=int, default=256 << 20)
    ap.add_argument("--flood", type=int, default=200, help="noisy requests sent at once")
    ap.add_argument("--flood-max-tokens", type=int, default=8)
    ap.add_argument("--flood-prompt-words", type=int, default=0, help="filler words added to each flood prompt")
    ap.add_argument("--victims", type=int, default=16)
    ap.add_argument("--victim-prompt-words", type=int, default=0, help="filler words added to each victim prompt")
    ap.add_argument("--victim-max-tokens", type=int, default=4)
    ap.add_argument("--flip", choices=("fair_share", "fair_preempt"), default="fair_share",
                    help="the app argument turned off and on (fair_preempt: with fair_share on)")
    ap.add_argument("--victim-interval-s", type=float, default=0.5)
    ap.add_argument("--rounds", type=int, default=2, help="rounds of (off, on)")
    ap.add_argument("--engine", action="store_true", help="the engine alone (no Ray, no HTTP)")
    ap.add_argument("--out", default=None, help="default bench/results/fair_share.json (_engine.json with --engine)")
    args = ap.parse_args()
    if args.engine:
        engine_only(args)
        return
    args.out = args.out or str(ROOT / "bench/results/fair_share.json")

    import ray
    import yaml
    from ray import serve

    from cluster.app import build_app

    t_start = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="kvmesh-fair-"))
    (tmp / "tenants.yaml").write_text(yaml.safe_dump(TENANTS))
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    port = start_serve()
    base = f"http://127.0.0.1:{port}"
    runs: list[dict] = []
    try:
        for rnd in range(args.rounds):
            for fair in (False, True):
                print(f"round {rnd + 1}/{args.rounds}, {args.flip} {fair}: deploying", flush=True)
                serve.run(build_app({"model": args.model, "tenants": str(tmp / "tenants.yaml"),
                                     "workers": args.workers, "max_workers": args.workers,
                                     "worker_num_cpus": args.worker_num_cpus,
                                     "kv_cache_bytes": args.kv_cache_bytes, "fair_share": True, args.flip: fair}),
                          name="fair", route_prefix="/")
                r = asyncio.run(phase(base, args, rnd))
                r.update(round=rnd, knob=args.flip, on=fair)
                runs.append(r)
                a, f = stats(r["alone"]), stats(r["flood_victims"])
                print(f"  victim TTFT alone p50 {a['p50_s']:.2f} s; under the flood p50 {f['p50_s']:.2f} p90 "
                      f"{f['p90_s']:.2f} max {f['max_s']:.2f} s; flood {r['flood_ok']}/{args.flood} in "
                      f"{r['flood_makespan_s']:.1f} s ({r['flood_tokens_per_s']:.1f} tokens/s)", flush=True)
                serve.delete("fair")
    finally:
        serve.shutdown()
        ray.shutdown()

    summary = {}
    for fair in (False, True):
        rs = [r for r in runs if r["on"] is fair]
        key = "on" if fair else "off"
        summary[key] = {"victim_alone": stats([s for r in rs for s in r["alone"]]),
                        "victim_flood": stats([s for r in rs for s in r["flood_victims"]]),
                        "victim_flood_whole_stream": stats([s for r in rs for s in r["flood_victims"]], at=4),
                        "flood_makespan_s": float(np.mean([r["flood_makespan_s"] for r in rs])),
                        "flood_tokens_per_s": float(np.mean([r["flood_tokens_per_s"] for r in rs])),
                        "flood_failed": sum(args.flood - r["flood_ok"] for r in rs)}
    on, off = summary["on"], summary["off"]
    summary["victim_flood_p90_off_over_on"] = off["victim_flood"]["p90_s"] / on["victim_flood"]["p90_s"]
    summary["victim_flood_p50_off_over_on"] = off["victim_flood"]["p50_s"] / on["victim_flood"]["p50_s"]
    summary["flood_tokens_per_s_on_over_off"] = on["flood_tokens_per_s"] / off["flood_tokens_per_s"]
    machine = {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()}
    res = {"summary": summary, "runs": runs, "args": vars(args), "machine": machine,
           "seconds": time.monotonic() - t_start}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    plot(runs, out.with_suffix(".png"))
    print(f"\nmachine: {machine}; {res['seconds']:.0f} s")
    for key in ("off", "on"):
        s = summary[key]
        print(f"{args.flip} {key:3}: victim TTFT alone p50 {s['victim_alone']['p50_s']:.2f} s | under the flood "
              f"p50 {s['victim_flood']['p50_s']:.2f} p90 {s['victim_flood']['p90_s']:.2f} "
              f"max {s['victim_flood']['max_s']:.2f} s, whole stream p50 {s['victim_flood_whole_stream']['p50_s']:.2f} s"
              f" | flood makespan {s['flood_makespan_s']:.1f} s, "
              f"{s['flood_tokens_per_s']:.1f} tokens/s, failed {s['flood_failed']}")
    print(f"victim TTFT under the flood, off / on: p50 {summary['victim_flood_p50_off_over_on']:.2f}x, "
          f"p90 {summary['victim_flood_p90_off_over_on']:.2f}x; flood tokens/s on / off "
          f"{summary['flood_tokens_per_s_on_over_off']:.2f}")
    print(f"wrote {out} and {out.with_suffix('.png')}")


def engine_only(args) -> None:
    """The scheduler's part alone: one engine, the flood and three victims, off / on twice."""
    import torch

    from engine.llm_engine import EngineConfig, LLMEngine
    from engine.model_loader import load_model
    from engine.sequence import Request, SamplingParams

    torch.set_num_threads(1)
    loaded = load_model(args.model)

    def req(rid, text, tenant, max_tokens):
        return Request(rid, tuple(loaded.tokenizer.encode(text)),
                       SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), tenant=tenant)

    runs = []
    for rnd in range(2):
        for fair in (False, True):
            eng = LLMEngine(EngineConfig(model=loaded.name, num_threads=1, kv_cache_bytes=args.kv_cache_bytes,
                                         **{"fair_share": True, args.flip: fair}), loaded=loaded)
            for i in range(args.flood):
                eng.add_request(req(f"f{i}", flood_prompt("flood", i, args.flood_prompt_words), "noisy",
                                    args.flood_max_tokens))
            t0, sent, ttft, done, steps = time.perf_counter(), {}, {}, {}, 0
            while eng.has_unfinished():
                if steps in (3, 10, 20):
                    eng.add_request(req(f"v{steps}", victim_prompt(f"victim {steps}", args.victim_prompt_words),
                                        "victim", args.victim_max_tokens))
                    sent[f"v{steps}"] = time.perf_counter()
                for o in eng.step():
                    if o.request_id in sent and o.num_output_tokens == 1:
                        ttft[o.request_id] = time.perf_counter() - sent[o.request_id]
                    if o.request_id in sent and o.finished:
                        done[o.request_id] = time.perf_counter() - sent[o.request_id]
                steps += 1
            runs.append({"round": rnd, "knob": args.flip, "on": fair, "victim_ttft_s": ttft, "victim_done_s": done,
                         "steps": steps, "seconds": time.perf_counter() - t0,
                         "preemptions": eng.scheduler.num_preemptions,
                         "room_preemptions": eng.scheduler.num_room_preemptions})
            print(f"round {rnd + 1}, {args.flip} {fair}: victim TTFT "
                  f"{ {k: round(v, 2) for k, v in ttft.items()} }, whole request "
                  f"{ {k: round(v, 2) for k, v in done.items()} }, {steps} steps, {runs[-1]['seconds']:.1f} s, "
                  f"{runs[-1]['preemptions']} preemptions ({runs[-1]['room_preemptions']} for room)", flush=True)
    machine = {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()}
    summary = {}
    for fair in (False, True):
        rs = [r for r in runs if r["on"] is fair]
        t = [v for r in rs for v in r["victim_ttft_s"].values()]
        d = [v for r in rs for v in r["victim_done_s"].values()]
        summary["on" if fair else "off"] = {"victim_ttft_p50_s": float(np.median(t)), "victim_ttft_max_s": max(t),
                                            "victim_done_p50_s": float(np.median(d)), "victim_done_max_s": max(d),
                                            "seconds_mean": float(np.mean([r["seconds"] for r in rs])),
                                            "steps": [r["steps"] for r in rs]}
    summary["victim_ttft_p50_off_over_on"] = summary["off"]["victim_ttft_p50_s"] / summary["on"]["victim_ttft_p50_s"]
    summary["victim_done_p50_off_over_on"] = summary["off"]["victim_done_p50_s"] / summary["on"]["victim_done_p50_s"]
    summary["seconds_on_over_off"] = summary["on"]["seconds_mean"] / summary["off"]["seconds_mean"]
    out = Path(args.out or ROOT / "bench/results/fair_share_engine.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"summary": summary, "runs": runs, "args": vars(args), "machine": machine}, indent=2))
    print(f"\nmachine: {machine}")
    print(f"{args.flip}: victim TTFT p50 off {summary['off']['victim_ttft_p50_s']:.2f} s, on "
          f"{summary['on']['victim_ttft_p50_s']:.2f} s ({summary['victim_ttft_p50_off_over_on']:.1f}x); whole victim "
          f"request p50 off {summary['off']['victim_done_p50_s']:.2f} s, on {summary['on']['victim_done_p50_s']:.2f} s "
          f"({summary['victim_done_p50_off_over_on']:.1f}x); the whole flood's time on / off {summary['seconds_on_over_off']:.2f}")
    print(f"wrote {out}")


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in runs:
        pts = [(s[0], s[2]) for s in r["flood_victims"] if s[2] is not None]
        ax.plot(*zip(*pts), "o-" if r["on"] else "x--", color="C0" if r["on"] else "C3",
                label=f"{r['knob']} {'on' if r['on'] else 'off'} (round {r['round'] + 1})", alpha=.8)
    ax.set_xlabel("victim request sent at (s after the flood began)")
    ax.set_ylabel("victim TTFT (s)")
    ax.set_title(f"another tenant sends {runs[0]['flood_n']} requests at once")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
