"""Soak: the kvmesh app at saturation for ``--minutes`` with a mixed multi-tenant load.

Cluster as in ``bench/faults.py`` (``bench.netlab``: the head plus one Ray node in a network
namespace; the Serve app with 2 ingress replicas and ``--workers`` workers). Tenants come from a
generated tenants file:

  exact    reuse exact, grants its KV to ``grantee`` (``share_with``)
  grantee  reads exact's KV (prompts over exact's shared prefixes)
  approx   reuse approximate over two templates of its own (quality gate on, 4 calibration checks)
  limited  2 requests/s, burst 2, 2 in flight: meant to get 429s (client-caused)

``--concurrency`` client loops pick a tenant at random (weights ``--weights``), send a streaming
greedy completion and, with probability ``--disconnect-p``, hang up after 1-3 chunks. At the
end (no new requests, drain): outcomes by tenant and kind, split into client-caused (429, the
client's own disconnects, other 4xx) and server (5xx, cut streams, hangs); block books of every
worker; per process (workers, controller, index, router, ingress replicas, Serve's controller
and proxy; PIDs from Ray, ``psutil`` for RSS and open fds) RSS samples every ``--sample-s``,
growth after warm-up (the first ``--warmup-frac`` of the run) and a linear slope; open fds at
warm-up and at the end; objects left in Ray's object store (``memory_summary``).

RSS by kind (``rss_by_kind``, from /proc/<pid>/status): ``anon`` (heap, the KV pool, donors),
``file`` (the model's weights: mmapped from the safetensors cache, shared between processes
through the page cache) and ``shmem`` (pages of Ray's object store mapped into the process: KV
pulled from or exported to peers; bounded by the store's size). Only ``anon`` growing after
warm-up would be memory the process keeps. Per worker also (``workers``): the KV pool's bytes
(committed when the engine is built: in RSS from the first sample on, see
tests/test_kv_commit.py), the approximate-reuse donor pool's bytes over time (bounded per tenant,
``engine.slot_pool``), and its RSS growth after warm-up less the donor pool's growth.

Run as root:  sudo nice -n 5 .venv/bin/python bench/soak.py [--minutes 10]
Writes bench/results/soak.json and bench/results/soak_rss.png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.netlab import LinkSpec, leftovers  # noqa: E402  (sets RAY_AUTH_MODE before ray)

import httpx  # noqa: E402
import psutil  # noqa: E402
import ray  # noqa: E402

from bench import servelab  # noqa: E402
from bench.stream_load import WORDS, make_prompts, stream_one, summarize  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
APP = "soak"
KEYS = {"exact": "sk-soak-exact", "grantee": "sk-soak-grantee", "approx": "sk-soak-approx", "limited": "sk-soak-limited"}
TEMPLATES = {
    "review": "Read the review and answer with one word, positive or negative.\n\nReview of {product}: {text}\n\n"
              "Rules: answer with exactly one word; do not explain; if unsure, answer negative.\nSentiment:",
    "fr": "Translate into French.\n\nText: {text}\n\nGuidelines: keep names unchanged; keep numbers; answer with "
          "the translation only, on one line.\nFrench:",
}
CLIENT_KINDS = ("error:429", "cancelled", "error:400", "error:401", "error:404")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def tenants_data() -> dict:
    lim = {"requests_per_s": 10000, "burst": 10000, "max_concurrent": 1024}
    return {"tenants": [
        {"name": "exact", "api_keys": [KEYS["exact"]], "reuse": "exact", "share_with": ["grantee"], "limits": lim,
         "cache": {"min_blocks": 16}},
        {"name": "grantee", "api_keys": [KEYS["grantee"]], "reuse": "exact", "limits": lim},
        {"name": "approx", "api_keys": [KEYS["approx"]], "reuse": "approximate", "limits": lim,
         "templates": TEMPLATES, "remap": {"calibration_samples": 4}},
        {"name": "limited", "api_keys": [KEYS["limited"]], "reuse": "exact",
         "limits": {"requests_per_s": 2, "burst": 2, "max_concurrent": 2}},
    ]}


class Soak:
    def __init__(self, url: str, args):
        self.url, self.args = url, args
        self.rng = random.Random(args.seed)
        self.prompts = make_prompts(args.prefixes, args.questions, args.prefix_words, args.seed)
        self.client = httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=args.concurrency + 8))
        self.outs: list = []
        self.rss: dict[str, list[tuple[float, float]]] = {}  # "role:name" -> [(t, MiB)]
        self.fds: dict[str, list[tuple[float, int]]] = {}
        self.kinds: dict[str, dict[str, list[tuple[float, float]]]] = {}  # key -> anon|file|shmem -> [(t, MiB)]
        self.donors: dict[str, list[tuple[float, float]]] = {}  # worker id -> [(t, donor pool MiB)]
        self.handles: dict[str, object] = {}
        self.t0 = time.monotonic()

    def body(self, tenant: str) -> tuple[dict, int]:
        a, rng = self.args, self.rng
        b = {"model": "default", "max_tokens": a.max_tokens, "temperature": 0, "stream": True}
        if tenant == "approx":
            tid = rng.choice(sorted(TEMPLATES))
            params = {"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12)))}
            if tid == "review":
                params["product"] = rng.choice(["a kettle", "the lamp", "this phone", "a bicycle", "the chair"])
            text = TEMPLATES[tid]
            for k, v in params.items():
                text = text.replace("{" + k + "}", v)
            b["prompt"] = text
            b["kvmesh"] = {"template": tid, "params": params}
            return b, -1
        ix = rng.randrange(len(self.prompts))
        b["prompt"] = self.prompts[ix]
        return b, ix

    async def loop(self, stop_at: float) -> None:
        a, rng = self.args, self.rng
        names, weights = list(KEYS), a.weights
        while time.monotonic() < stop_at:
            tenant = rng.choices(names, weights)[0]
            body, ix = self.body(tenant)
            cut = rng.randint(1, 3) if rng.random() < a.disconnect_p else None
            o = await stream_one(self.client, f"{self.url}/v1/completions", KEYS[tenant], body, tenant, ix,
                                 a.deadline_s, disconnect_after_chunks=cut)
            self.outs.append(o)
            if o.status == "error" and o.http_status == 429:
                await asyncio.sleep(min(2.0, float(o.extra.get("retry_after") or 1)) * rng.random())

    def sample(self) -> None:
        t = time.monotonic() - self.t0
        for role, procs in servelab.processes(APP).items():
            for p in procs:
                key = f"{role}:{p['name']}"
                try:
                    ps = psutil.Process(p["pid"])
                    self.rss.setdefault(key, []).append((t, ps.memory_info().rss / 2**20))
                    self.fds.setdefault(key, []).append((t, ps.num_fds()))
                    for kind, mib in rss_kinds(p["pid"]).items():
                        self.kinds.setdefault(key, {}).setdefault(kind, []).append((t, mib))
                except (psutil.Error, OSError):
                    pass
        try:
            self.handles = self.handles or servelab.worker_handles()
            for wid, h in self.handles.items():
                st = ray.get(h.stats.remote(), timeout=10)
                self.donors.setdefault(wid, []).append((t, st.get("approx", {}).get("donor_bytes", 0) / 2**20))
        except Exception:  # noqa: BLE001 - a worker busy or gone: this sample has no donor figure
            pass

    async def sampler(self, stop_at: float) -> None:
        while time.monotonic() < stop_at:
            await asyncio.to_thread(self.sample)
            await asyncio.sleep(self.args.sample_s)

    async def run(self) -> None:
        stop_at = time.monotonic() + self.args.minutes * 60
        await asyncio.gather(self.sampler(stop_at), *(self.loop(stop_at) for _ in range(self.args.concurrency)))
        await asyncio.to_thread(self.sample)
        await self.client.aclose()


def rss_kinds(pid: int) -> dict[str, float]:
    """RssAnon / RssFile / RssShmem of ``pid`` in MiB (/proc/<pid>/status)."""
    text = Path(f"/proc/{pid}/status").read_text()
    out = {}
    for kind, field in (("anon", "RssAnon"), ("file", "RssFile"), ("shmem", "RssShmem")):
        m = re.search(rf"^{field}:\s+(\d+) kB", text, re.M)
        if m:
            out[kind] = int(m.group(1)) / 1024
    return out


def at(series: list[tuple[float, float]], t: float) -> float | None:
    """The first value at or after ``t`` (the last one if none)."""
    return next((v for ts, v in series if ts >= t), series[-1][1] if series else None)


def worker_report(s: "Soak", warm_t: float, info: dict) -> dict:
    """Per worker: KV pool bytes, RSS by kind at start / after warm-up / end, donor pool growth."""
    out = {}
    for key, kinds in s.kinds.items():
        if not key.startswith("worker:"):
            continue
        wid = key.split(":", 1)[1]
        i = info.get(wid, {})
        pool = i.get("num_blocks", 0) * i.get("block_size", 0) * i.get("kv_bytes_per_token", 0) / 2**20
        d = s.donors.get(wid, [])
        rss = s.rss.get(key, [])
        grow = (rss[-1][1] - at(rss, warm_t)) if rss else None
        dgrow = (d[-1][1] - at(d, warm_t)) if d else None
        out[wid] = {"kv_pool_mib": round(pool, 1),
                    "rss_by_kind_start": {k: round(v[0][1], 1) for k, v in kinds.items()},
                    "rss_by_kind_after_warmup": {k: round(at(v, warm_t), 1) for k, v in kinds.items()},
                    "rss_by_kind_end": {k: round(v[-1][1], 1) for k, v in kinds.items()},
                    "donor_pool_mib_after_warmup": round(at(d, warm_t), 1) if d else None,
                    "donor_pool_mib_end": round(d[-1][1], 1) if d else None,
                    "rss_growth_after_warmup_mib": round(grow, 1) if grow is not None else None,
                    "rss_growth_after_warmup_less_donors_mib":
                        round(grow - dgrow, 1) if grow is not None and dgrow is not None else None}
    return out


def growth(series: list[tuple[float, float]], warm_t: float) -> dict:
    post = [(t, v) for t, v in series if t >= warm_t]
    if len(post) < 2:
        return {"samples": len(series)}
    n = len(post)
    mt, mv = sum(t for t, _ in post) / n, sum(v for _, v in post) / n
    var = sum((t - mt) ** 2 for t, _ in post)
    slope = sum((t - mt) * (v - mv) for t, v in post) / var if var else 0.0
    first, last = post[0][1], post[-1][1]
    return {"samples": len(series), "start_mib": round(series[0][1], 1), "after_warmup_mib": round(first, 1),
            "end_mib": round(last, 1), "growth_after_warmup_mib": round(last - first, 1),
            "growth_after_warmup_pct": round(100 * (last - first) / first, 2) if first else None,
            "slope_mib_per_min": round(slope * 60, 3), "max_mib": round(max(v for _, v in series), 1)}


def object_store() -> dict:
    """Objects Ray still holds, from ``memory_summary`` (no dashboard needed)."""
    from ray._private.internal_api import memory_summary

    try:
        text = memory_summary(address=ray.get_runtime_context().gcs_address, stats_only=True)
    except Exception as e:  # noqa: BLE001 - reported
        return {"error": repr(e)}
    out = {"summary": text.strip().splitlines()[-12:]}
    m = re.search(r"Plasma memory usage (\d+) MiB, (\d+) objects", text)
    if m:
        out["plasma_mib"], out["plasma_objects"] = int(m.group(1)), int(m.group(2))
    return out


def plot(rss: dict, path: Path, warm_t: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 5.5))
    for key, s in sorted(rss.items()):
        ax.plot([t / 60 for t, _ in s], [v for _, v in s], label=key.split(":")[0] + ":" + key.split(":")[-1][-18:])
    ax.axvline(warm_t / 60, color="grey", ls="--", lw=1)
    ax.set_xlabel("minutes")
    ax.set_ylabel("RSS (MiB)")
    ax.set_title("kvmesh soak: RSS per process (dashed: end of warm-up)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


async def amain(args) -> dict:
    settings = {"model": args.model, "workers": args.workers, "kv_cache_bytes": args.kv_cache_mb << 20,
                "client_ttl_s": 10.0, "max_num_seqs": 32}
    t0 = time.time()
    url = await asyncio.to_thread(servelab.start_app, APP, settings, tenants_data(), args.replicas)
    log(f"app up in {time.time() - t0:.0f}s at {url}; soaking {args.minutes} min")
    s = Soak(url, args)
    await s.run()
    log(f"load done: {len(s.outs)} requests")
    handles = await asyncio.to_thread(servelab.worker_handles)
    info = {}
    for wid, h in handles.items():
        try:
            info[wid] = await asyncio.wait_for(h.ready.remote(), 10)
        except Exception:  # noqa: BLE001 - reported as missing
            pass
    books = await asyncio.to_thread(servelab.drain, handles)
    await asyncio.sleep(2)
    await asyncio.to_thread(s.sample)
    store = await asyncio.to_thread(object_store)
    warm_t = args.minutes * 60 * args.warmup_frac
    per_tenant = {t: summarize([o for o in s.outs if o.tag == t]) for t in KEYS}
    kinds: dict[str, int] = {}
    for o in s.outs:
        if o.status != "ok":
            k = f"{o.status}:{o.http_status}" if o.status == "error" and o.http_status else f"{o.status}"
            full = f"{o.status}:{o.kind}"
            kinds[full] = kinds.get(full, 0) + 1
    client = {k: v for k, v in kinds.items() if k.startswith(("error:429", "cancelled", "error:400", "error:401",
                                                                "error:404"))}
    server = {k: v for k, v in kinds.items() if k not in client}
    rss = {k: growth(v, warm_t) for k, v in s.rss.items()}
    rss_by_kind = {k: {kind: growth(ser, warm_t) for kind, ser in kinds.items()} for k, kinds in s.kinds.items()}
    fds = {k: {"after_warmup": next((n for t, n in v if t >= warm_t), v[0][1]), "end": v[-1][1], "max": max(n for _, n in v)}
           for k, v in s.fds.items()}
    png = RESULTS / "soak_rss.png"
    plot(s.rss, png, warm_t)
    ok = [o for o in s.outs if o.status == "ok"]
    return {"requests": len(s.outs), "ok": len(ok), "requests_per_s": round(len(s.outs) / (args.minutes * 60), 2),
            "completion_tokens_hint": args.max_tokens, "errors_client": client, "errors_server": server,
            "server_errors_total": sum(server.values()), "per_tenant": per_tenant,
            "books_after_drain": books, "books_exact": all(b.get("exact") for b in books.values()),
            "rss": rss, "rss_by_kind": rss_by_kind, "workers": worker_report(s, warm_t, info),
            "donor_samples": {k: [(round(t, 1), round(v, 1)) for t, v in ser] for k, ser in s.donors.items()},
            "rss_samples": {k: [(round(t, 1), round(v, 1)) for t, v in ser] for k, ser in s.rss.items()},
            "fds": fds, "object_store_after": store, "plot": str(png), "warmup_s": warm_t}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--model", default="default")
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--prefixes", type=int, default=4)
    ap.add_argument("--questions", type=int, default=16)
    ap.add_argument("--prefix-words", type=int, default=110)
    ap.add_argument("--weights", type=float, nargs=4, default=[4, 2, 2, 1], help="exact grantee approx limited")
    ap.add_argument("--disconnect-p", type=float, default=0.1)
    ap.add_argument("--kv-cache-mb", type=int, default=160)
    ap.add_argument("--deadline-s", type=float, default=120.0)
    ap.add_argument("--sample-s", type=float, default=10.0)
    ap.add_argument("--warmup-frac", type=float, default=0.2)
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--out", default=str(RESULTS / "soak.json"))
    args = ap.parse_args()
    if os.nice(0) < 5:
        os.nice(5 - os.nice(0))
    load0, t0 = os.getloadavg(), time.time()
    loads = []
    with servelab.lab_with_retries([LinkSpec("soak", 1000, num_cpus=2)], head_cpus=2, head_object_store_mb=512,
                boot_timeout_s=300) as lab:
        log(f"lab up in {time.time() - t0:.0f}s")
        try:
            out = asyncio.run(amain(args))
        finally:
            loads.append(os.getloadavg())
            try:
                from ray import serve

                serve.shutdown()
            except Exception:  # noqa: BLE001 - the lab's teardown kills the rest
                pass
    result = {"bench": "soak", "args": vars(args), "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
              "loadavg_start": load0, "loadavg_end_of_load": loads[0] if loads else None,
              "note": "2 cores shared with other engineers' jobs; nice 5"},
              "wall_s": round(time.time() - t0, 1), **out, "leftover_namespaces_and_links": leftovers()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    print(f"requests {out['requests']} ok {out['ok']} ({out['requests_per_s']}/s)")
    print(f"client-caused: {out['errors_client']}")
    print(f"server errors: {out['errors_server']} (total {out['server_errors_total']})")
    print(f"books exact on every worker after drain: {out['books_exact']}")
    print("RSS growth after warm-up (MiB, slope MiB/min):")
    for k, g in sorted(out["rss"].items()):
        print(f"  {k[:60]:<60} {g.get('after_warmup_mib')} -> {g.get('end_mib')}  "
              f"{g.get('growth_after_warmup_mib')}  {g.get('slope_mib_per_min')}")
    print("RSS growth after warm-up by kind (MiB: anon / file / shmem):")
    for k, kinds in sorted(out["rss_by_kind"].items()):
        print(f"  {k[:60]:<60} " + " / ".join(f"{kinds.get(x, {}).get('growth_after_warmup_mib')}"
                                               for x in ("anon", "file", "shmem")))
    for wid, w in sorted(out["workers"].items()):
        print(f"  {wid}: KV pool {w['kv_pool_mib']} MiB (committed at start); RSS start {w['rss_by_kind_start']} "
              f"end {w['rss_by_kind_end']}; donors {w['donor_pool_mib_after_warmup']} -> {w['donor_pool_mib_end']} MiB; "
              f"growth after warm-up {w['rss_growth_after_warmup_mib']}, less donors "
              f"{w['rss_growth_after_warmup_less_donors_mib']}")
    print(f"fds: {out['fds']}")
    print(f"object store after: {out['object_store_after'].get('plasma_objects')} objects "
          f"{out['object_store_after'].get('plasma_mib')} MiB")
    print(f"loadavg start {load0} end {result['machine']['loadavg_end_of_load']}; leftovers "
          f"{result['leftover_namespaces_and_links']}; wrote {args.out}")


if __name__ == "__main__":
    main()
