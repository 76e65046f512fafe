"""How kvmesh's per-request routing work grows with the cluster: workers, KV pools, requests in flight.

Every request kvmesh routes costs CPU in three single-threaded places:
- the controller (``cluster.routing.CostAwareRouter.choose``): the prompt's chain hashes, the
  placement's shadow caches (``Placer.pending_tokens`` / ``decide``) and each worker's published
  load (the KV its requests in flight hold, ``policies.routing.kv_use``);
- the index actor: ``actors.prefix_index.PrefixIndex.lookup``;
- the router actor: ``actors.router.Router.batch`` (the buffered load reports, then
  ``CostModel.rank``).
Each of the three serves every request of the cluster in turn, so its time per request bounds the
cluster's request rate (1 / seconds per request), whatever the workers could serve.

This runs the real classes in one process, the two actors' objects behind in-process handles (no
Ray, no transport: only the work), on clusters of several sizes. Each worker's pool is filled
first (its groups' prefixes in the index and the router's shadow caches, the rest of the pool
with unshared blocks, as the pools of a loaded cluster are), and carries ``flights`` requests in
flight; then a Zipf(``--zipf``) shared-prefix workload is routed, each request storing its blocks
in its worker's pool (LRU, evictions reported to the index). Prints per request the CPU seconds
of each part (p50 / p99), the request rate each part alone allows, and the memory of the
router's placement state (``tracemalloc``, a second pass).

  python bench/router_scale.py                      # cpu and gpu profiles, 4 / 16 / 64 workers
  python bench/router_scale.py --workers 4,16,64,256 --profiles gpu
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# --tree=PATH: measure another checkout's code (``--baseline`` runs this script so on a revision)
TREE = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--tree=")), str(ROOT))
sys.path.insert(0, TREE)

from actors.prefix_index import PrefixIndex  # noqa: E402
from actors.router import Router, RouterClient  # noqa: E402
from bench.loadgen import percentile  # noqa: E402
from cluster.routing import ROUTER_FLUSH_S, CostAwareRouter  # noqa: E402
from cluster.types import InFlight, WorkerState  # noqa: E402
from engine.block_pool import prompt_chains  # noqa: E402
from engine.sequence import Request, SamplingParams  # noqa: E402
from policies.routing import CostConfig  # noqa: E402

try:
    from cluster.routing import MAX_CANDIDATES  # noqa: E402
except ImportError:  # a tree from before the router's short list ranks every worker
    MAX_CANDIDATES = None

MODEL = "scale"
BLOCK = 16


@dataclass(frozen=True)
class Profile:
    """One cluster shape: a worker's pool, requests in flight on each, and the workload's prompts."""

    name: str
    pool_blocks: int  # a worker's KV pool, in blocks of ``BLOCK`` tokens
    flights: int  # requests in flight on each worker (running; a quarter of them more queued)
    prefix_tokens: int  # a group's shared prefix
    question_tokens: int  # each request's own tail
    output_tokens: int
    groups_per_worker: int  # distinct prefixes, per worker of the cluster


PROFILES = {
    # the cluster bench's workers: 128-block pools, a few sequences each, 600-token prefixes
    "cpu": Profile("cpu", 128, 4, 600, 40, 16, 3),
    # a GPU worker: a 262k-token pool (e.g. an 8B model's KV in ~35 GB), 64 sequences in flight,
    # 2k-token system prompts, as many groups as a quarter of its pool holds
    "gpu": Profile("gpu", 16384, 64, 2048, 128, 128, 32),
}


class _Ref:
    """A finished call: what ``RouterClient`` and the index's ``_ask`` await."""

    def __init__(self, value):
        self._f = concurrent.futures.Future()
        self._f.set_result(value)

    def future(self):
        return self._f

    def __await__(self):
        return self._f.result()
        yield  # noqa: unreachable - makes this a generator


class _NullActor:
    """A worker's actor handle whose calls (a replication's prefetch) go nowhere."""

    def __getattr__(self, name):
        class _M:
            @staticmethod
            def remote(*args, **kwargs):
                return None
        return _M


class LocalHandle:
    """An actor handle whose ``method.remote(*args)`` runs ``obj.method(*args)`` here and adds its
    CPU seconds to ``spent``."""

    def __init__(self, obj):
        self.obj = obj
        self.spent = 0.0

    def __getattr__(self, name):
        fn = getattr(self.obj, name)
        handle = self

        class _M:
            @staticmethod
            def remote(*args):
                t = time.thread_time()
                value = fn(*args)
                handle.spent += time.thread_time() - t
                return _Ref(value)
        return _M


class Cluster:
    """``workers`` workers on ``workers // 4`` nodes (at least one), their pools as LRUs of block
    hashes mirrored into the index, and a router fed as ``cluster.pool`` feeds it."""

    def __init__(self, profile: Profile, workers: int, seed: int = 0, zipf: float = 1.0,
                 max_candidates: int | None = MAX_CANDIDATES):
        self.p = profile
        self.rng = random.Random(seed)
        self.ids = [f"w{i}" for i in range(workers)]
        self.index = PrefixIndex(BLOCK)
        self.router_obj = Router(CostConfig(block_size=BLOCK))
        self.index_h, self.router_h = LocalHandle(self.index), LocalHandle(self.router_obj)
        client = RouterClient(self.router_h, timeout_s=10.0, flush_s=ROUTER_FLUSH_S)
        short = {} if MAX_CANDIDATES is None else {"max_candidates": max_candidates}
        self.router = CostAwareRouter(MODEL, BLOCK, self.index_h, client, lambda w: self.states.get(w),
                                      timeout_s=10.0, **short)
        self.pools: dict[str, OrderedDict] = {w: OrderedDict() for w in self.ids}
        self.states: dict[str, WorkerState] = {}
        for i, w in enumerate(self.ids):
            node = f"n{i // 4}"
            self.router_obj.register(w, node)
            self.index.add_worker(w)
            for n in (64, 256, 1024):  # calibration: the prefill model's samples
                self.router_obj.report_prefill(w, n, 0.02 + n * 1e-4, 0)
            st = WorkerState(w, actor=_NullActor(), info={"num_blocks": profile.pool_blocks, "node_id": node})
            st.tpot_s, st.output_tokens = 0.03, float(profile.output_tokens)
            self.states[w] = st
        self.groups = workers * profile.groups_per_worker
        self.vocab = 49152
        self.prefixes = [[self.rng.randrange(self.vocab) for _ in range(profile.prefix_tokens)]
                         for _ in range(self.groups)]
        self.chains = [prompt_chains(tuple(p + [0]), BLOCK, MODEL, ["t0"])["t0"] for p in self.prefixes]
        weights = [1.0 / (k + 1) ** zipf for k in range(self.groups)]
        self.cum = [sum(weights[:k + 1]) for k in range(self.groups)]
        self.n = 0

    def prompt(self) -> tuple[int, ...]:
        g = min(self.groups - 1, self._bisect(self.rng.random() * self.cum[-1]))
        q = [self.rng.randrange(self.vocab) for _ in range(self.p.question_tokens)]
        return tuple(self.prefixes[g] + q)

    def _bisect(self, x: float) -> int:
        lo, hi = 0, len(self.cum)
        while lo < hi:
            mid = (lo + hi) // 2
            if self.cum[mid] < x:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def store(self, worker: str, prompt: tuple[int, ...]) -> None:
        """``worker`` computed (or reused) ``prompt``'s blocks: they enter its pool, the oldest
        leave it, and the index hears both."""
        pool, now = self.pools[worker], time.monotonic()
        chain = prompt_chains(prompt, BLOCK, MODEL, ["t0"])["t0"]
        parent = None
        for h in chain:
            if h in pool:
                pool.move_to_end(h)
            else:
                pool[h] = True
                self.index.stored(worker, h, parent, "t0", now)
            parent = h
        while len(pool) > self.p.pool_blocks:
            gone, _ = pool.popitem(last=False)
            if not isinstance(gone, tuple):
                self.index.removed(worker, gone)

    def fill(self) -> None:
        """Each worker's pool full: its share of the groups' prefixes (group g on worker g mod W),
        in the index and the router's shadow caches, then unshared blocks up to the pool's size;
        ``flights`` requests in flight on each (a quarter more queued)."""
        now = time.monotonic()
        for g, prefix in enumerate(self.prefixes):
            w = self.ids[g % len(self.ids)]
            self.store(w, tuple(prefix + [0]))
            self.router.placer.shadow(w, self.p.pool_blocks)
            self.router.placer.commit(w, self.chains[g], 0, now, "t0")
        for i, w in enumerate(self.ids):
            shadow = self.router.placer.shadow(w, self.p.pool_blocks)
            free = self.p.pool_blocks - len(shadow)
            if free > 0:
                shadow.touch([], free, now)
            pool = self.pools[w]
            while len(pool) < self.p.pool_blocks:
                pool[("private", self.n)] = True
                self.n += 1
            st = self.states[w]
            for k in range(self.p.flights + self.p.flights // 4):
                rid = f"{w}-f{k}"
                started = k < self.p.flights
                g = i + len(self.ids) * self.rng.randrange(self.p.groups_per_worker)  # one of its groups
                st.flights[rid] = InFlight("t0", w, self.p.prefix_tokens + self.p.question_tokens,
                                           self.p.output_tokens, output_tokens=k % self.p.output_tokens if started else 0,
                                           cached_tokens=self.p.prefix_tokens, blocks=tuple(self.chains[g]))
                if started:
                    st.flights[rid].started_at = now - self.rng.random()
                else:
                    st.queued[rid] = self.p.question_tokens
            st.running = self.p.flights

    async def route(self) -> tuple[str, float, float, float]:
        """One request: (worker, controller, index, router CPU seconds)."""
        self.n += 1
        req = Request(f"r{self.n}", self.prompt(), SamplingParams(max_tokens=self.p.output_tokens), tenant="t0")
        i0, r0 = self.index_h.spent, self.router_h.spent
        t = time.thread_time()
        choice = await self.router.choose(req, [self.states[w] for w in self.ids])
        total = time.thread_time() - t
        di, dr = self.index_h.spent - i0, self.router_h.spent - r0
        self.store(choice.worker_id, req.prompt_ids)
        return choice.worker_id, total - di - dr, di, dr


def _stats(xs: list[float]) -> dict:
    return {"p50_ms": round(1e3 * percentile(xs, 50), 3), "p99_ms": round(1e3 * percentile(xs, 99), 3),
            "mean_ms": round(1e3 * sum(xs) / len(xs), 3), "max_rate_per_s": round(len(xs) / sum(xs), 1)}


async def measure(profile: Profile, workers: int, requests: int, warmup: int, seed: int,
                  max_candidates: int) -> dict:
    c = Cluster(profile, workers, seed, max_candidates=max_candidates)
    t = time.perf_counter()
    c.fill()
    fill_s = time.perf_counter() - t
    for _ in range(warmup):
        await c.route()
    parts: dict[str, list[float]] = {"controller": [], "index": [], "router": []}
    per_worker: dict[str, int] = {}
    for _ in range(requests):
        w, ctl, idx, rtr = await c.route()
        parts["controller"].append(ctl)
        parts["index"].append(idx)
        parts["router"].append(rtr)
        per_worker[w] = per_worker.get(w, 0) + 1
    return {"profile": profile.name, "workers": workers, "max_candidates": max_candidates, "requests": requests,
            "fill_s": round(fill_s, 2),
            "index_blocks": len(c.index), "workers_used": len(per_worker),
            **{k: _stats(v) for k, v in parts.items()}}


async def placement_memory(profile: Profile, workers: int, requests: int, seed: int, max_candidates: int) -> dict:
    """Bytes the router's placement state (``policies/placement.py``), the cost model
    (``policies/routing.py``) and the index (``actors/prefix_index.py``) hold once the pools are
    full and ``requests`` more were routed (``tracemalloc``: allocations still alive, by file)."""
    tracemalloc.start()
    c = Cluster(profile, workers, seed, max_candidates=max_candidates)
    c.fill()
    for _ in range(requests):
        await c.route()
    snap = tracemalloc.take_snapshot()
    tracemalloc.stop()
    out = {}
    for name, path in (("placement", "policies/placement.py"), ("cost_model", "policies/routing.py"),
                       ("index", "actors/prefix_index.py")):
        stats = snap.filter_traces([tracemalloc.Filter(True, f"*{path}")]).statistics("filename")
        out[name + "_mib"] = round(sum(s.size for s in stats) / 2 ** 20, 2)
    del c
    return out


def baseline_rows(args) -> list[dict]:
    """This script's measurement of ``args.baseline``'s code (``git archive`` of it, run with
    ``--tree``), with the same short lists (a tree from before the short list ranks every
    worker): the rows it wrote."""
    with tempfile.TemporaryDirectory(prefix="router-scale-") as tmp:
        tree = Path(tmp) / "tree"
        tree.mkdir()
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.baseline], check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
        out = Path(tmp) / "rows.json"
        cmd = [sys.executable, __file__, f"--tree={tree}", "--workers", args.workers, "--profiles", args.profiles,
               "--max-candidates", args.max_candidates, "--requests", str(args.requests), "--warmup", str(args.warmup),
               "--seed", str(args.seed), "--json", str(out), "--memory" if args.memory else "--no-memory"]
        print(f"baseline {args.baseline}:", flush=True)
        subprocess.run(cmd, check=True)
        return json.loads(out.read_text())["rows"]


def speedups(base: list[dict], rows: list[dict]) -> list[dict]:
    """Per row, the baseline's time per request (p50, same profile, size and short list; a
    baseline without short lists: its row of every worker ranked) against this tree's."""
    ref = {(b["profile"], b["workers"], b["max_candidates"]): b for b in base}
    out = []
    for r in rows:
        b = ref.get((r["profile"], r["workers"], r["max_candidates"])) or ref.get((r["profile"], r["workers"], 0))
        if b is None:
            continue
        ctl = (b["controller"]["p50_ms"], r["controller"]["p50_ms"])
        rtr = (b["router"]["p50_ms"], r["router"]["p50_ms"])
        out.append({"profile": r["profile"], "workers": r["workers"], "max_candidates": r["max_candidates"],
                    "baseline_max_candidates": b["max_candidates"],
                    "controller_ms": ctl, "router_ms": rtr, "controller_x": round(ctl[0] / max(ctl[1], 1e-9), 2),
                    "router_x": round(rtr[0] / max(rtr[1], 1e-9), 2)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", default="4,16,64", help="cluster sizes, comma separated")
    ap.add_argument("--profiles", default="cpu,gpu", help=f"of {', '.join(PROFILES)}")
    ap.add_argument("--max-candidates", default=f"0,{MAX_CANDIDATES}",
                    help="workers ranked per request (the router's short list; 0: all), comma separated")
    ap.add_argument("--requests", type=int, default=400, help="timed requests per size")
    ap.add_argument("--warmup", type=int, default=100, help="requests routed before timing")
    ap.add_argument("--memory", action=argparse.BooleanOptionalAction, default=True,
                    help="measure the router's memory (a second pass under tracemalloc)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--baseline", default=None,
                    help="a git revision: measure its code the same way first (the same short lists, where it "
                         "has them) and print "
                         "this tree's time per request against it")
    ap.add_argument("--tree", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--json", default=str(ROOT / "bench/results/router_scale.json"))
    args = ap.parse_args()
    base = baseline_rows(args) if args.baseline else None
    rows = []
    for pname in args.profiles.split(","):
        profile = PROFILES[pname]
        for w in (int(x) for x in args.workers.split(",")):
            mcs = [int(x) for x in args.max_candidates.split(",")] if MAX_CANDIDATES is not None else [0]
            for mc in mcs:
                if mc >= w and 0 in mcs:
                    continue  # a list as long as the pool is all of it: the row of 0
                row = asyncio.run(measure(profile, w, args.requests, args.warmup, args.seed, mc))
                if args.memory:
                    row["memory"] = asyncio.run(placement_memory(profile, w, min(args.requests, 100), args.seed, mc))
                rows.append(row)
                c, i, r = row["controller"], row["index"], row["router"]
                print(f"{pname:>4} {w:>4} workers, {mc or 'all':>3} ranked: controller {c['p50_ms']:.2f} / "
                      f"{c['p99_ms']:.2f} ms (p50 / p99), index {i['p50_ms']:.2f} / {i['p99_ms']:.2f}, router "
                      f"{r['p50_ms']:.2f} / {r['p99_ms']:.2f}; at most {c['max_rate_per_s']:.0f} req/s by the "
                      f"controller, {r['max_rate_per_s']:.0f} by the router"
                      + (f"; memory {row['memory']}" if "memory" in row else ""), flush=True)
    doc = {"bench": "router_scale", "machine": {"cpus": os.cpu_count(),
                                                "processor": platform.processor(), "python": platform.python_version()},
           "tree": TREE, "args": vars(args), "profiles": {k: asdict(PROFILES[k]) for k in args.profiles.split(",")},
           "rows": rows}
    if base is not None:
        doc["baseline"] = {"revision": args.baseline, "rows": base, "speedup": speedups(base, rows)}
        for r in doc["baseline"]["speedup"]:
            print(f"{r['profile']:>4} {r['workers']:>4} workers, {r['max_candidates'] or 'all':>3} ranked against "
                  f"{args.baseline} ({r['baseline_max_candidates'] or 'all'} ranked): controller {r['controller_ms'][0]:.2f} -> {r['controller_ms'][1]:.2f}"
                  f" ms ({r['controller_x']:.1f}x), router {r['router_ms'][0]:.2f} -> {r['router_ms'][1]:.2f} ms "
                  f"({r['router_x']:.1f}x)", flush=True)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(doc, indent=1))
    print("wrote", args.json)


if __name__ == "__main__":
    main()
