"""The stalls a big Python heap puts into the index actor and the controller: CPython's full
garbage collections (with and without ``actors.heap.HeapFreezer``, the heap frozen out of them)
and the rehash of one big dict (the index's nodes, ``actors.prefix_index._Shards``).

Two processes of a kvmesh cluster hold heaps that grow with the cluster: the index actor's trie
(one tracked node per cached block of every worker) and the controller's placement state (a
shadow cache per worker). A full collection scans all of it and stops the process meanwhile; a
dict of millions of keys stops it while it rehashes (as it grows, and under churn each time its
inserts use up the room deletes left). Each part runs in its own fresh process, once with the
product's default (frozen every ``freeze_every``) and once with the freezer off, and records
every collection (``gc.callbacks``) and every call's time:

* ``index``: the real ``IndexActor`` (no Ray: its methods awaited in one event loop) holding the
  pools of ``--workers`` GPU-sized workers (``bench/router_scale.py``'s gpu profile: 16,384-block
  pools, 32 groups of 2,048-token prefixes per worker, the rest of each pool private 128-token
  questions and 128-token answers), fed as workers feed it (msgpack batches): first the pools
  fill, 512 blocks from each worker in turn with a lookup after each (a cluster's first minutes,
  or an index rebuilt after a restart), then per request a lookup of its prompt and its worker's batch (the question's and answer's blocks
  stored, the pool's oldest private blocks removed). Then one worker leaves (``remove_worker``):
  its time, and the longest the actor answered nothing meanwhile (the longest gap between turns
  of a coroutine yielding to the actor's event loop all along).
* ``controller``: ``bench/router_scale.py``'s cluster (``CostAwareRouter`` with the index and the
  router actor in process), ``--controller-workers`` GPU-sized workers, requests routed one after
  the other. The index's nodes share this process here (not in a cluster); the full collection
  of the controller's heap alone is timed at the end with the index dropped.

Per mode: time per request p50 / p99 / p99.9 / max, the collections of each generation (count,
total and longest pause), the freezer's own time, a full collection timed at the end
(``gc.collect()`` over what is not frozen), and the cyclic garbage the frozen heap kept
(``gc.unfreeze(); gc.collect()``'s count: what a freeze leaks).

  .venv/bin/python bench/heap_stalls.py                     # index at 64 and 256 workers, controller at 64
  .venv/bin/python bench/heap_stalls.py --workers 64 --requests 50000
  .venv/bin/python bench/heap_stalls.py --tree /tmp/old      # another checkout's code (e.g. a git worktree)
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import random
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# --tree PATH: measure another checkout's code (one from before the freezer runs it plain)
TREE = next((sys.argv[i + 1] for i, a in enumerate(sys.argv[:-1]) if a == "--tree"), str(ROOT))
sys.path.insert(0, TREE)

BLOCK = 16


class Pauses:
    """Every collection while active: generation -> [seconds]."""

    def __init__(self):
        self.by_gen: dict[int, list[float]] = {0: [], 1: [], 2: []}
        self._t = 0.0
        gc.callbacks.append(self._cb)

    def _cb(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        else:
            self.by_gen[info["generation"]].append(time.perf_counter() - self._t)

    def stop(self) -> dict:
        gc.callbacks.remove(self._cb)
        return {f"gen{g}": {"count": len(v), "total_s": round(sum(v), 4), "max_ms": round(1e3 * max(v, default=0.0), 2)}
                for g, v in self.by_gen.items()}


def _latency(xs: list[float]) -> dict:
    s = sorted(xs)

    def q(p: float) -> float:
        return round(1e3 * s[min(len(s) - 1, int(p / 100 * len(s)))], 3)
    return {"p50_ms": q(50), "p99_ms": q(99), "p999_ms": q(99.9), "max_ms": round(1e3 * s[-1], 2),
            "over_100ms": sum(1 for x in xs if x > 0.1)}


def _end(freezer) -> dict:
    """A full collection timed now, then the cyclic garbage the frozen heap kept."""
    stats = freezer.stats() if freezer is not None else None
    t = time.perf_counter()
    gc.collect()
    full_s = time.perf_counter() - t
    gc.unfreeze()
    leaked = gc.collect()
    return {"full_collect_at_end_s": round(full_s, 4), "cyclic_garbage_frozen": leaked, "freezer": stats}


async def run_index(workers: int, requests: int, freeze: bool, seed: int, fill_batch: int = 512) -> dict:
    from actors.index_actor import IndexActor
    from actors.index_publisher import encode_batch
    from engine.block_pool import BlockEvent

    pool, groups_per, prefix_blocks, own_blocks = 16384, 32, 2048 // BLOCK, (128 + 128) // BLOCK
    rng = random.Random(seed)
    try:
        actor = IndexActor(BLOCK, freeze_every=20_000 if freeze else 0)
    except TypeError:  # a tree from before the freezer
        actor = IndexActor(BLOCK)
    ids = [f"w{i}" for i in range(workers)]
    # tuples of bytes, which the collector stops tracking: the bench's own data is not what it scans
    prefixes = [tuple(rng.randbytes(16) for _ in range(prefix_blocks)) for _ in range(workers * groups_per)]
    private: dict[str, deque] = {w: deque() for w in ids}  # per worker: its private chains, oldest first

    def own_chain(g: int) -> tuple[bytes, ...]:
        return tuple(rng.randbytes(16) for _ in range(own_blocks))

    # what each worker's pool will hold: its groups' prefixes, then private chains up to its size
    contents: dict[str, list] = {}
    for i, w in enumerate(ids):
        mine, events = range(i, len(prefixes), workers), []
        for g in mine:
            p = prefixes[g]
            events += [(h, p[k - 1] if k else None) for k, h in enumerate(p)]
        for k in range((pool - len(events)) // own_blocks):
            g = mine[k % len(mine)]
            c = own_chain(g)
            private[w].append(c)
            events += [(h, c[j - 1] if j else prefixes[g][-1]) for j, h in enumerate(c)]
        contents[w] = events
    for w in ids:
        assert (await actor.publish(encode_batch(w, 0, BLOCK, [], [])))["ok"]
    # the pools fill (a cluster's first minutes, or an index rebuilt after a restart): batches of
    # ``fill_batch`` blocks from each worker in turn, a lookup after each
    seq = {w: 1 for w in ids}
    gc.collect()
    pauses, lat, t0 = Pauses(), [], time.perf_counter()
    for start in range(0, pool, fill_batch):
        for w in ids:
            t = time.perf_counter()
            events = [BlockEvent("stored", h, p, "t0") for h, p in contents[w][start:start + fill_batch]]
            assert (await actor.publish(encode_batch(w, seq[w], BLOCK, events)))["ok"]
            await actor.lookup({"t0": list(prefixes[rng.randrange(len(prefixes))])})
            lat.append(time.perf_counter() - t)
            seq[w] += 1
    build_s = time.perf_counter() - t0
    fill = {"per_call": _latency(lat), "collections": pauses.stop(), "seconds": round(build_s, 1)}
    del contents
    weights = [1.0 / (k + 1) for k in range(len(prefixes))]
    picks = rng.choices(range(len(prefixes)), weights, k=requests)
    gc.collect()
    pauses, lat = Pauses(), []
    for g in picks:
        w = ids[g % workers]
        c = own_chain(g)
        t = time.perf_counter()
        await actor.lookup({"t0": [*prefixes[g], *c[: own_blocks // 2]]})
        gone = private[w].popleft()
        events = [BlockEvent("stored", h, c[k - 1] if k else prefixes[g][-1], "t0") for k, h in enumerate(c)]
        events += [BlockEvent("removed", h) for h in gone]
        assert (await actor.publish(encode_batch(w, seq[w], BLOCK, events)))["ok"]
        lat.append(time.perf_counter() - t)
        seq[w] += 1
        private[w].append(c)
    blocks = len(actor.index)
    # a worker leaves: the removal's time, and the longest the actor stopped answering meanwhile
    # (the longest gap between turns of a coroutine yielding to its event loop all along)
    gaps, done = [], []

    async def probe():
        t = time.perf_counter()
        while not done:
            await asyncio.sleep(0)
            now = time.perf_counter()
            gaps.append(now - t)
            t = now
    prober = asyncio.get_running_loop().create_task(probe())
    await asyncio.sleep(0)
    t = time.perf_counter()
    n = await actor.remove_worker(ids[0])
    removal = {"blocks": n, "seconds": round(time.perf_counter() - t, 4),
               "longest_stall_ms": round(1e3 * max(gaps, default=time.perf_counter() - t), 2)}
    done.append(True)
    await prober
    return {"part": "index", "workers": workers, "freeze": freeze, "requests": requests, "blocks": blocks,
            "worker_removal": removal,
            "nodes_made": getattr(actor.index, "created", None), "tracked": len(gc.get_objects()), "fill": fill,
            "per_request": _latency(lat), "collections": pauses.stop(), **_end(getattr(actor, "heap", None))}


async def run_controller(workers: int, requests: int, freeze: bool, seed: int) -> dict:
    from bench.router_scale import PROFILES, Cluster

    c = Cluster(PROFILES["gpu"], workers, seed, max_candidates=16)
    if hasattr(c.router, "heap"):
        c.router.heap.enabled = freeze
    c.fill()
    for _ in range(100):
        await c.route()
    gc.collect()
    pauses = Pauses()
    lat = []
    for _ in range(requests):
        t = time.perf_counter()
        await c.route()
        lat.append(time.perf_counter() - t)
    coll = pauses.stop()
    tracked = len(gc.get_objects())
    c.index._nodes.clear()
    c.index._orphans.clear()
    c.index = c.index_h = c.router.index = None
    gc.collect()  # the index's nodes go (what the controller's process does not hold)
    return {"part": "controller", "workers": workers, "freeze": freeze, "requests": requests, "tracked": tracked,
            "tracked_without_index": len(gc.get_objects()), "per_request": _latency(lat), "collections": coll,
            **_end(getattr(c.router, "heap", None))}


def child(args) -> None:
    fn = run_index if args.part == "index" else run_controller
    row = asyncio.run(fn(args.n, args.requests, args.freeze, args.seed))
    print(json.dumps(row))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", default="64,256", help="index part: cluster sizes, comma separated")
    ap.add_argument("--requests", type=int, default=100_000,
                    help="index part: requests per size and mode after the pools filled (at 256 workers the "
                         "one-dict index rehashes after ~87k)")
    ap.add_argument("--controller-workers", default="64", help="controller part: sizes ('' skips it)")
    ap.add_argument("--controller-requests", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tree", default=None, help="measure this checkout's code instead of this one's")
    ap.add_argument("--json", default=str(ROOT / "bench/results/heap_stalls.json"))
    ap.add_argument("--part", choices=("index", "controller"), help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--freeze", action=argparse.BooleanOptionalAction, default=True, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.part:
        return child(args)
    runs = [("index", int(w), args.requests) for w in args.workers.split(",") if w] + \
        [("controller", int(w), args.controller_requests) for w in args.controller_workers.split(",") if w]
    rows = []
    for part, n, reqs in runs:
        for freeze in (False, True):
            cmd = [sys.executable, __file__, "--tree", TREE, "--part", part, "--n", str(n), "--requests", str(reqs),
                   "--seed", str(args.seed), "--freeze" if freeze else "--no-freeze"]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            row = json.loads(out.strip().splitlines()[-1])
            rows.append(row)
            g2, lat = row["collections"]["gen2"], row["per_request"]
            if "fill" in row:
                f2, fl = row["fill"]["collections"]["gen2"], row["fill"]["per_call"]
                print(f"{part:>10} {n:>4} workers, {'frozen' if freeze else 'plain '}: the pools filling: per call p50 "
                      f"{fl['p50_ms']:.2f} p99.9 {fl['p999_ms']:.1f} max {fl['max_ms']:.0f} ms, {fl['over_100ms']} over "
                      f"100 ms; full collections {f2['count']} (longest {f2['max_ms']:.0f} ms, {f2['total_s']:.2f} s in all)",
                      flush=True)
            if "worker_removal" in row:
                rm = row["worker_removal"]
                print(f"{part:>10} {n:>4} workers, {'frozen' if freeze else 'plain '}: a worker's removal "
                      f"({rm['blocks']} blocks) {1e3 * rm['seconds']:.0f} ms, the index answering nothing for at most "
                      f"{rm['longest_stall_ms']:.1f} ms of it", flush=True)
            print(f"{part:>10} {n:>4} workers, {'frozen' if freeze else 'plain '}: per request p50 {lat['p50_ms']:.3f} "
                  f"p99 {lat['p99_ms']:.3f} p99.9 {lat['p999_ms']:.3f} max {lat['max_ms']:.1f} ms; full collections "
                  f"{g2['count']} (longest {g2['max_ms']:.0f} ms, {g2['total_s']:.2f} s in all); a full collection at "
                  f"the end {1e3 * row['full_collect_at_end_s']:.0f} ms; cyclic garbage kept frozen "
                  f"{row['cyclic_garbage_frozen']}", flush=True)
    pairs = []
    for plain, frozen in zip(rows[::2], rows[1::2]):
        a, b = plain["collections"]["gen2"], frozen["collections"]["gen2"]
        pairs.append({"part": plain["part"], "workers": plain["workers"],
                      "longest_full_ms": (a["max_ms"], b["max_ms"]),
                      "fill_max_call_ms": (plain["fill"]["per_call"]["max_ms"], frozen["fill"]["per_call"]["max_ms"])
                      if "fill" in plain else None,
                      "max_request_ms": (plain["per_request"]["max_ms"], frozen["per_request"]["max_ms"]),
                      "full_collect_at_end_ms": (round(1e3 * plain["full_collect_at_end_s"], 1),
                                                 round(1e3 * frozen["full_collect_at_end_s"], 1))})
        print(f"{plain['part']:>10} {plain['workers']:>4} workers: longest request {pairs[-1]['max_request_ms'][0]:.0f} -> "
              f"{pairs[-1]['max_request_ms'][1]:.0f} ms; a full collection {pairs[-1]['full_collect_at_end_ms'][0]:.0f} -> "
              f"{pairs[-1]['full_collect_at_end_ms'][1]:.0f} ms (plain -> frozen)", flush=True)
    doc = {"bench": "heap_stalls", "tree": TREE, "machine": {"cpus": os.cpu_count(), "processor": platform.processor(),
                                             "python": platform.python_version()},
           "args": {k: v for k, v in vars(args).items() if k not in ("part", "n", "freeze", "tree")}, "rows": rows,
           "pairs": pairs}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(doc, indent=1))
    print("wrote", args.json)


if __name__ == "__main__":
    main()
