"""Replay a workload through a router and a model of the workers' block pools (no model, no Ray).

Each simulated worker has the engine's real ``BlockPool`` (LRU eviction, refcounts) of
``capacity_blocks`` blocks and one prefill server: a request waits for the server (and for free
blocks), reuses the leading blocks its pool holds when its prefill starts, computes the rest in
``a + b * new_tokens`` seconds, registers its prompt blocks at the end of its prefill (only then
does the "index" that routers see show them) and decodes ``step_s`` per output token without
holding the server. Clients are closed-loop (``concurrency``), like inference-perf's.

Routers: ``kvmesh`` (``policies.placement.Placer`` over ``policies.routing.CostModel``, the
exact decision code of ``cluster.routing.CostAwareRouter``), ``round_robin``, ``pow2`` (Serve's
default: the fewer in-flight of two random workers) and ``affinity`` (an imitation of Ray's
``PrefixCacheAffinityRouter``: a prefix tree of routed prompts per replica, highest match when
it is >= 10% of the prompt, else the replica with the smallest tree; the least loaded of those).
The score is the cluster's hit tokens against ``bench.workloads.oracle_hits`` (one infinite
cache). ``python bench/placement_sim.py`` prints the table for the issue's sizing. Its open-loop
sibling, ``bench/placement_openloop.py``, replays the cluster bench's rate stages through a
step-level model of the engine (Poisson arrivals, decode rows, pulls priced by bandwidth).
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import random
import sys
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.workloads import WorkItem, oracle_hits, shared_prefix  # noqa: E402
from engine.block_pool import BlockPool, extra_key, hash_blocks, prompt_chains  # noqa: E402
from policies.placement import Placer, PlacementConfig  # noqa: E402
from policies.routing import CostConfig, CostModel, PrefillPrior, WorkerLoad  # noqa: E402

MODEL = "sim"
ROUTERS = ("kvmesh", "round_robin", "pow2", "affinity")


@dataclass(frozen=True)
class SimConfig:
    workers: int = 4
    capacity_blocks: int = 48
    block_size: int = 16
    concurrency: int = 2
    prefill_a_s: float = 0.02
    prefill_b_s: float = 1e-3  # per new token
    step_s: float = 0.02  # per output token
    seed: int = 0


@dataclass
class _Req:
    index: int
    item: WorkItem
    worker: str = ""
    hit: int = 0
    ttft_s: float = 0.0
    blocks: list = field(default_factory=list)
    expected_new: int = 0
    pulls: list = field(default_factory=list)  # (holder, start block, end block) planned by the router
    pull_s: float = 0.0


class _Worker:
    def __init__(self, wid: str, cfg: SimConfig):
        self.wid = wid
        self.pool = BlockPool(cfg.capacity_blocks, cfg.block_size, clock=lambda: self.now)
        self.now = 0.0
        self.queue: deque[_Req] = deque()
        self.busy = False
        self.inflight = 0
        self.queued_tokens: dict[int, int] = {}
        self.running = 0

    def holds(self, chain: Sequence[bytes]) -> int:
        k = 0
        while k < len(chain) and self.pool.get_cached_block(chain[k]) is not None:
            k += 1
        return k


class _Affinity:
    """Ray's PrefixCacheAffinityRouter, imitated at block granularity: per replica the set of
    routed prompt blocks (never evicted; the tree has no view of the replicas' caches)."""

    def __init__(self, workers: Sequence[str], rng: random.Random, threshold: float = 0.1):
        self.tree = {w: set() for w in workers}
        self.rng, self.threshold = rng, threshold

    def choose(self, chain: Sequence[bytes], prompt_tokens: int, bs: int, inflight: dict[str, int]) -> str:
        match = {}
        for w, seen in self.tree.items():
            k = 0
            while k < len(chain) and chain[k] in seen:
                k += 1
            match[w] = k
        best = max(match.values())
        if best * bs / prompt_tokens >= self.threshold:
            pick = [w for w, k in match.items() if k == best]
        else:
            small = min(len(s) for s in self.tree.values())
            pick = [w for w, s in self.tree.items() if len(s) == small]
        low = min(inflight[w] for w in pick)
        w = self.rng.choice([w for w in pick if inflight[w] == low])
        self.tree[w].update(chain)
        return w


def baseline_route(router: str, chain: Sequence[bytes], prompt_tokens: int, bs: int, inflight: dict[str, int],
                   rr, rng: random.Random, affinity: _Affinity) -> str | None:
    """The worker a baseline router picks (``round_robin`` from the cycle ``rr``, ``pow2`` over
    ``inflight``, in its order, ``affinity`` on the prompt's own ``chain``); None for kvmesh."""
    if router == "round_robin":
        return next(rr)
    if router == "pow2":
        wids = list(inflight)
        a, b = rng.sample(wids, 2) if len(wids) > 1 else (wids[0], wids[0])
        return b if inflight[b] < inflight[a] else a
    if router == "affinity":
        return affinity.choose(chain, prompt_tokens, bs, inflight)
    return None


def simulate(items: Sequence[WorkItem], router: str, cfg: SimConfig = SimConfig(),
             placement: PlacementConfig | None = None) -> dict:
    """Replay ``items`` (closed loop, in order) through ``router``; figures per run."""
    if router not in ROUTERS:
        raise ValueError(f"router must be one of {ROUTERS}")
    bs = cfg.block_size
    rng = random.Random(cfg.seed)
    wids = [f"w{i}" for i in range(cfg.workers)]
    workers = {w: _Worker(w, cfg) for w in wids}
    cm = CostModel(CostConfig(block_size=bs, prefill_prior=PrefillPrior(a=cfg.prefill_a_s, b=cfg.prefill_b_s * 1024,
                                                                         c=0.0)))
    for w in wids:
        cm.register(w, w)
    placer = Placer(placement)
    for w in wids:
        placer.shadow(w, cfg.capacity_blocks)
    affinity = _Affinity(wids, rng)
    rr = itertools.cycle(wids)
    events: list = []
    seq = itertools.count()
    now = 0.0
    done: list[_Req] = []
    pending_items = deque(range(len(items)))

    def push(t: float, kind: str, payload) -> None:
        heapq.heappush(events, (t, next(seq), kind, payload))

    def route(r: _Req) -> str:
        it = r.item
        chains = prompt_chains(it.prompt_ids, bs, MODEL, (it.domain, *it.read_domains))
        picked = baseline_route(router, chains[it.domain], len(it.prompt_ids), bs,
                                {w: workers[w].inflight for w in wids}, rr, rng, affinity)
        if picked is not None:
            return picked
        holdings = {}
        for w in wids:
            k = max(workers[w].holds(c) for c in chains.values())
            if k:
                holdings[w] = k * bs
        for w in wids:
            cm.observe_load(w, WorkerLoad(tuple(n for n in workers[w].queued_tokens.values() if n), workers[w].running))
        pend = placer.pending_tokens(chains, holdings, wids, len(it.prompt_ids), bs, now)
        ranking = cm.rank(len(it.prompt_ids), holdings, wids, pend)
        loads = {w: float(sum(workers[w].queued_tokens.values())) for w in wids}
        placed = placer.decide(it.prompt_ids, it.max_tokens, bs, chains, it.domain, holdings, wids, loads, ranking, now)
        c = placed.candidate
        r.expected_new = len(it.prompt_ids) - (c.cached_tokens if c else 0)
        if c is not None and c.kind == "pulled":
            r.pulls = [(p.holder, p.start_block, p.end_block) for p in c.pulls]
            r.pull_s = c.pull_s
        return placed.worker

    def import_pulls(w: _Worker, r: _Req, chain: list) -> float:
        """Copy the planned blocks from their holders into ``w``'s pool (as a KV pull does);
        blocks a holder no longer has are recomputed. Returns the planned pull seconds."""
        got = w.holds(chain)
        for holder, start, end in r.pulls:
            h = workers[holder]
            for k in range(max(start, got), end):
                if h.pool.get_cached_block(chain[k]) is None or not w.pool.can_allocate(1):
                    return r.pull_s
                (blk,) = w.pool.allocate(1, r.item.tenant)
                w.pool.cache_full_block(blk, chain[k], chain[k - 1] if k else None, r.item.tenant, r.item.domain)
                w.pool.free([blk])
                got = k + 1
        return r.pull_s

    def start_next(w: _Worker) -> None:
        if w.busy or not w.queue:
            return
        r = w.queue[0]
        it = r.item
        chain = hash_blocks(it.prompt_ids, bs, extra_key(MODEL, it.domain))
        pull_s = import_pulls(w, r, chain) if r.pulls else 0.0
        r.pulls = []
        usable = max(0, (len(it.prompt_ids) - 1) // bs)
        hit = min(w.holds(chain), usable)
        for d in it.read_domains:
            hit = max(hit, min(w.holds(hash_blocks(it.prompt_ids, bs, extra_key(MODEL, d))), usable))
        total = -(-(len(it.prompt_ids) + it.max_tokens) // bs)
        own_hit = min(w.holds(chain), usable)
        need = total - own_hit
        w.now = now
        if total > cfg.capacity_blocks:
            raise ValueError(f"a request needs {total} blocks; a pool has {cfg.capacity_blocks}")
        hits = [w.pool.get_cached_block(h) for h in chain[:own_hit]]
        w.pool.touch(hits)
        if not w.pool.can_allocate(need):
            w.pool.free(hits)
            return  # waits for blocks: retried when a request on this worker finishes
        w.queue.popleft()
        r.blocks = hits + w.pool.allocate(need, it.tenant)
        r.hit = hit * bs
        w.busy = True
        dur = pull_s + cfg.prefill_a_s + cfg.prefill_b_s * (len(it.prompt_ids) - r.hit)
        push(now + dur, "prefilled", (w, r, chain, dur))

    def arrive(i: int) -> None:
        r = _Req(i, items[i])
        r.ttft_s = now
        r.worker = route(r)
        w = workers[r.worker]
        w.inflight += 1
        w.queued_tokens[i] = max(0, r.expected_new or len(r.item.prompt_ids))
        w.queue.append(r)
        start_next(w)

    for _ in range(min(cfg.concurrency, len(items))):
        arrive(pending_items.popleft())
    while events:
        now, _, kind, payload = heapq.heappop(events)
        if kind == "prefilled":
            w, r, chain, dur = payload
            w.now = now
            parent = None
            for k, h in enumerate(chain):  # prompt blocks enter the cache (and the index) now
                w.pool.cache_full_block(r.blocks[k], h, parent, r.item.tenant, r.item.domain)
                parent = h
            cm.observe_prefill(w.wid, len(r.item.prompt_ids) - r.hit, dur - r.pull_s, r.hit)
            r.ttft_s = now - r.ttft_s
            w.busy = False
            w.queued_tokens.pop(r.index, None)
            w.running += 1
            push(now + cfg.step_s * r.item.max_tokens, "finished", (w, r))
            start_next(w)
        else:
            w, r = payload
            w.now = now
            w.pool.free(r.blocks)
            w.inflight -= 1
            w.running -= 1
            done.append(r)
            start_next(w)
            if pending_items:
                arrive(pending_items.popleft())
    oracle = sum(oracle_hits(items, bs))
    hits = sum(r.hit for r in done)
    groups: dict[str, Counter] = {}
    for r in done:
        groups.setdefault(r.item.group, Counter())[r.worker] += 1
    evictions = {w: sum(s.evictions for s in workers[w].pool.stats.values()) for w in wids}
    ttft = sorted(r.ttft_s for r in done)
    return {"router": router, "requests": len(done), "hit_tokens": hits, "oracle_hit_tokens": oracle,
            "hit_vs_oracle": hits / oracle if oracle else 1.0, "evictions": evictions,
            "per_worker": dict(Counter(r.worker for r in done)), "groups": {g: dict(c) for g, c in groups.items()},
            "ttft_p50_s": ttft[len(ttft) // 2] if ttft else None, "ttft_p90_s": ttft[int(len(ttft) * 0.9)] if ttft else None,
            "makespan_s": now, "placements": dict(placer.placements) if router == "kvmesh" else {}}


def issue_sizing(workers: int = 4, groups: int = 4, users: int = 6, system_len: int = 600, question_len: int = 40,
                 output_len: int = 16, prefix_over_pool: float = 3.5, rounds: int = 1, seed: int = 0,
                 block_size: int = 16) -> tuple[list[WorkItem], SimConfig]:
    """The issue's shared-prefix workload with pools sized so the distinct prefixes need
    ``prefix_over_pool`` x one worker's pool (3-6x in the issue); ``rounds`` repeats it."""
    items = []
    for r in range(rounds):
        batch = shared_prefix(groups, users, system_len, question_len, output_len, seed=seed)
        rng = random.Random(seed * 1000 + r)
        if r:
            rng.shuffle(batch)
        items += batch
    distinct_blocks = groups * -(-(system_len + question_len + output_len) // block_size)
    capacity = max(1, int(distinct_blocks / prefix_over_pool))
    return items, SimConfig(workers=workers, capacity_blocks=capacity, block_size=block_size, seed=seed)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--users", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prefix-over-pool", type=float, default=3.5)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--json", default=None, help="write the rows here")
    a = ap.parse_args(argv)
    rows = []
    for seed in range(a.seeds):
        items, cfg = issue_sizing(a.workers, a.groups, a.users, prefix_over_pool=a.prefix_over_pool, rounds=a.rounds,
                                  seed=seed)
        cfg = SimConfig(**{**cfg.__dict__, "concurrency": a.concurrency})
        for router in ROUTERS:
            rows.append({"seed": seed, **simulate(items, router, cfg)})
    print(f"shared prefix: {a.groups} groups x {a.users} users x {a.rounds} rounds, {a.workers} workers, "
          f"distinct prefixes = {a.prefix_over_pool}x one pool ({cfg.capacity_blocks} blocks), "
          f"concurrency {a.concurrency}, {a.seeds} seeds")
    print(f"{'router':12s} {'hit/oracle':>10s} {'min':>6s} {'evictions':>10s} {'ttft p90 s':>10s}")
    for router in ROUTERS:
        rs = [r for r in rows if r["router"] == router]
        ratio = sum(r["hit_vs_oracle"] for r in rs) / len(rs)
        ev = sum(sum(r["evictions"].values()) for r in rs) / len(rs)
        p90 = sum(r["ttft_p90_s"] for r in rs) / len(rs)
        print(f"{router:12s} {ratio:10.3f} {min(r['hit_vs_oracle'] for r in rs):6.3f} {ev:10.1f} {p90:10.3f}")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
