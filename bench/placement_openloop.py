"""Open-loop replay of the cluster bench's shared-prefix stages through a router and a step-level
model of the workers (no model, no Ray): the placement trade-off behind issue 11's TTFT gap.

``bench/placement_sim.py`` replays a closed loop through one prefill server per worker; this
replays what ``bench/cluster.py`` drives: rate stages run one after the other (the next starts
when the last drained; the caches carry over), each with a fresh set of groups (inference-perf's
``shared_prefix``: ``groups`` x ``users`` prompts of a ``system_len``-token system prompt and a
``question_len``-token question, ``output_len`` output tokens) arriving as a Poisson process.

A worker is the engine's real ``BlockPool`` plus a model of its scheduler: each step carries one
row per decoding sequence, then prefill chunks (FIFO; a running prompt's chunk is at most
``long_prefill`` tokens while another prompt waits), admitting waiting prompts while the token budget and free
blocks allow (strict FIFO), and takes ``step_s + token_s * prefill tokens + row_s * rows``
seconds (a CPU step grows with its tokens and rows: decodes slow the prefill they share a step
with). A prompt's measured prefill is the step time attributed to its chunks by token share, as
``engine.llm_engine`` measures it. A prompt's full blocks enter the pool (and so the index that
routers see) as its chunks compute them, as ``engine.kv_manager`` commits them. A planned pull takes ``rtt + bytes / bandwidth`` (the slower end of the
two nodes' links; ``slow_workers`` sit behind a ``slow_Bps`` link) before the request joins the
worker's queue; blocks a holder lost meanwhile are recomputed.

The kvmesh router is fed as ``cluster.routing.CostAwareRouter`` is fed by ``cluster.pool``:
per worker ``WorkerLoad(waiting_tokens=prompt - the choice's cached tokens of each routed request
without a first token, running=requests past it)``, one prefill sample per request at its first
token, one transfer sample per pull, one seconds-per-output-token sample per ended request against
the mean sequences decoding beside it (the decode contention's ``row_s``), and the index = what
the pools hold.

Routers: kvmesh (``Placer`` over ``CostModel``), the baselines (affinity imitation, pow2, round
robin) and ``packed``, an oracle that knows each group's requests in the scored stages in advance
and gives each group one worker, packed evenly (``pack_groups``): the upper bound of placement on a
workload whose groups stay where they are put.

Scores per stage: TTFT p50/p90/p99, latency to the last token p50/p90 and seconds per output
token p50, completed requests/s (``n / max(drain, stage_s)``, as the
bench), hit tokens against one infinite cache (``bench.workloads.oracle_hits``), and per router the
throughput at equal p99 TTFT against the affinity imitation (``bench.cluster_report``).
``python bench/placement_openloop.py`` runs the sweep and writes
``bench/results/placement_sim_tradeoff.json``.
"""

from __future__ import annotations

import argparse
import heapq
import importlib.util
import inspect
import itertools
import json
import math
import random
import subprocess
import sys
import time
from collections import Counter, deque
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.cluster_report import Point, equal_p99_ratio  # noqa: E402
from bench.loadgen import percentile  # noqa: E402
from bench.placement_sim import _Affinity, baseline_route  # noqa: E402
from bench.workloads import (Oracle, TraceScale, Vocab, WorkItem, generate_mooncake, mooncake_items,  # noqa: E402
                             multi_tenant, multi_turn, shared_prefix)
from engine.block_pool import BlockPool, extra_key, hash_blocks, prompt_chains  # noqa: E402
from policies.eviction import TenantEvictionPolicy  # noqa: E402
from policies.placement import Placer, PlacementConfig, leading_key, shortlist  # noqa: E402
from policies.routing import ROW_FIT_WEIGHT, CostConfig, CostModel, DecodeModel, WorkerLoad  # noqa: E402

MODEL = "sim"
ROUTERS = ("kvmesh", "affinity", "pow2", "round_robin", "packed")


@dataclass(frozen=True)
class OpenConfig:
    workers: int = 4
    capacity_blocks: int = 128  # 2,048 tokens: the cluster bench's pool
    block_size: int = 16
    step_s: float = 0.3  # fixed cost of one engine step on a 0.4-core node
    token_s: float = 2.6 / 552  # per prefill token: a 552-token prompt alone ~3.2 s (2 steps)
    row_s: float = 0.15  # per decode row (TPOT ~0.5-0.65 s with 1-2 decoding, more with a chunk)
    budget: int = 512  # max_num_batched_tokens
    long_prefill: int = 256  # chunk cap while other prompts wait
    bytes_per_token: int = 46080
    fast_Bps: float = 125e6  # 1 Gbit/s
    slow_Bps: float = 12.5e6  # 100 Mbit/s
    slow_workers: int = 1
    rtt_s: float = 1e-3
    seed: int = 0
    speed_jitter: float = 0.0  # worker k's steps take (1 + u_k) x as long, u_k uniform in [-jitter, +jitter]
    cache_protect_s: float = 60.0  # the engines' eviction (EngineConfig.cache_protect_s, cache_seed_s)
    cache_seed_s: float = 120.0
    # the router ranks and weighs at most this many workers per request (``policies.placement.shortlist``,
    # as ``cluster.routing.CostAwareRouter`` does; 0: all)
    max_candidates: int = 0


@dataclass(frozen=True)
class Stage:
    rate: float
    items: tuple[WorkItem, ...]  # arrival times relative to the stage's start
    stage_s: float = 45.0
    warmup: bool = False  # not scored (``aggregate`` skips it)


def stages(rates: Sequence[float] = (0.4, 0.7, 1.0, 1.3), stage_s: float = 45.0, groups: int = 12, users: int = 5,
           system_len: int = 512, question_len: int = 40, output_len: int = 16, seed: int = 0,
           hot: bool = False, steady: bool = False, warmup_stages: int = 1,
           order: Sequence[int] | None = None, chat: bool = False,
           then_hot: Sequence[float] = (), trace: bool = False, others: bool = False) -> list[Stage]:
    """One stage per rate, fresh groups each (``hot``: one group, users enough that no prompt
    repeats, as the bench's hot-prefix variant); Poisson arrivals over ``stage_s``. ``steady``:
    the bench's ``--sweep steady``: one set of groups walked through a warm-up stage at the first
    rate and then every rate (users enough that no prompt repeats). ``warmup_stages`` > 1: the
    warm-up lasts whole stages until every group has been sent once, at most that many (as
    ``bench/cluster.py``'s warm-up since session 18). ``order`` (steady): the groups in the order
    inference-perf sends them (``bench.ipperf.group_order``); as inference-perf does, every stage
    walks that order from its start (its data generator restarts per stage), so each stage sends the
    same prompts in the same order, and a group that comes early and often in the order is that
    much hotter in every stage (the default size's first 35 requests hold group 0 nine times).
    ``chat``: the bench's multi-turn workload per stage (``bench.workloads.multi_turn``: 3-turn
    sessions starting at rate / 3 per second, turns 4 s apart, one 256-token system prompt per
    stage shared by its sessions, 32-token user turns, 16 output tokens). ``then_hot`` (steady): the
    bench's hot-prefix series after the steady one, as ``bench/cluster.py`` runs them: one new
    group, a warm-up stage at its first rate and then each rate, with the caches and the router's
    state carried over; only these stages are scored (the steady ones become warm-ups): how fast
    a group that turns hot while the others fade gets its holders. ``trace``: per stage a synthetic
    Mooncake trace of ``rate`` x ``stage_s`` requests at ``rate`` per second
    (``bench.workloads.generate_mooncake``, the generator of the bench's ``mooncake_small.jsonl``),
    read as the bench reads it (16 tokens per hash id, prompts of at most 1,024 tokens, at most
    ``output_len`` output tokens); each stage in its own domain, so stages share no prefix.
    ``others`` (with ``then_hot``): after the steady and hot series (warm-ups here), the bench's
    other workloads in its order, each a stage on the caches the previous ones left: multi-turn
    (rate 0.5), the multi-tenant mix (rate 0.8, three tenants in their own domains) and the
    Mooncake trace (rate 4: 32 records at half their timestamps). Seed 0 sends the bench's own
    items (``bench/cluster.py``'s seeds, ``bench/traces/mooncake_small.jsonl``), other seeds
    fresh ones of the same shape."""
    if others:
        first = stages(rates, stage_s, groups, users, system_len, question_len, output_len, seed,
                       warmup_stages=warmup_stages, order=order, then_hot=then_hot or (0.7, 1.3))
        return [replace(st, warmup=True) for st in first] + other_stages(seed, output_len)
    if then_hot:
        first = stages(rates, stage_s, groups, users, system_len, question_len, output_len, seed,
                       steady=True, warmup_stages=warmup_stages, order=order)
        hot = stages(then_hot, stage_s, groups, users, system_len, question_len, output_len, seed + 104729,
                     hot=True, steady=True)
        return [replace(st, warmup=True) for st in first] + \
            [replace(st, items=tuple(replace(it, group=f"hot{it.group}") for it in st.items)) for st in hot]
    if trace:
        scale = TraceScale(tokens_per_hash=16, max_input_tokens=1024, max_output_tokens=output_len)
        out = []
        for k, rate in enumerate(rates):
            recs = generate_mooncake(requests=max(1, round(rate * stage_s)), rate_per_s=rate, seed=seed * 7919 + 5000 + k)
            items = mooncake_items(recs, scale, tenant=f"t{k}")
            out.append(Stage(rate, tuple(replace(it, group=f"s{k}{it.group}") for it in items), stage_s))
        return out
    if chat:
        out = []
        for k, rate in enumerate(rates):
            items = multi_turn(sessions=max(1, round(rate * stage_s / 3)), turns=3, system_len=256, user_len=32,
                               output_len=output_len, rate_per_s=rate / 3, think_s=4.0, seed=seed * 7919 + 2000 + k)
            out.append(Stage(rate, tuple(replace(it, group=f"s{k}{it.session}") for it in items), stage_s))
        return out
    if steady:
        rates = [rates[0], *rates]
        if order is not None:
            rng0, vocab, seen = random.Random(seed * 7919 + 3000), Vocab(), Counter()
            systems = [vocab.tokens(rng0, system_len) for _ in range(groups)]
            prompts = []
            for g in order:  # user u of group g: the u-th time g comes in the order
                prompts.append(WorkItem(systems[g] + vocab.tokens(rng0, question_len), output_len, group=f"g{g}",
                                        session=f"g{g}u{seen[g]}"))
                seen[g] += 1
            n_groups = len(set(order))

            def walk():  # inference-perf restarts its walk every stage
                return iter(prompts)
        else:
            n_users = int((sum(rates) + rates[0] * (warmup_stages - 1)) * stage_s * 1.3 / (1 if hot else groups)) + 4
            pool = iter(shared_prefix(1 if hot else groups, n_users, system_len, question_len, output_len,
                                      seed=seed * 7919 + 3000))
            n_groups = 1 if hot else groups

            def walk():  # one walk through the users over every stage: no prompt repeats
                return pool
        out = []
        for k, rate in enumerate(rates):
            rng, src = random.Random(seed * 7919 + k), walk()
            t, items, span = 0.0, [], stage_s
            while True:
                while (t := t + rng.expovariate(rate)) <= span and (item := next(src, None)) is not None:
                    items.append(replace(item, at_s=t))
                t = span  # the next whole stage starts at its own clock; arrivals are memoryless
                if k or len({it.group for it in items}) >= n_groups or span >= warmup_stages * stage_s - 1e-9:
                    break
                span += stage_s
            out.append(Stage(rate, tuple(items), span, warmup=k == 0))
        return out
    out = []
    for k, rate in enumerate(rates):
        rng = random.Random(seed * 7919 + k)
        n_users = int(rate * stage_s) + 4 if hot else users
        pool = shared_prefix(1 if hot else groups, n_users, system_len, question_len, output_len,
                             seed=seed * 7919 + 1000 + k)
        t, items = 0.0, []
        for i in itertools.count():
            t += rng.expovariate(rate)
            if t > stage_s:
                break
            it = pool[i % len(pool)]
            items.append(replace(it, at_s=t, group=f"s{k}{it.group}"))
        out.append(Stage(rate, tuple(items), stage_s))
    return out


def other_stages(seed: int, output_len: int = 16) -> list[Stage]:
    """The cluster bench's multi-turn, multi-tenant and trace workloads (``bench/cluster.py``'s
    ``other_workloads``, without the template tenant's items), one stage each (see ``stages``)."""
    k = seed * 7919
    chat = multi_turn(sessions=6, turns=3, system_len=256, user_len=32, output_len=output_len, rate_per_s=0.5,
                      think_s=4.0, seed=1 + k, tenant="bench")
    mix = multi_tenant(requests=32, rate_per_s=0.8, output_len=output_len, seed=2 + k)
    scale = TraceScale(tokens_per_hash=16, time_scale=0.5, max_requests=32, max_input_tokens=1024,
                       max_output_tokens=output_len)
    recs = (generate_mooncake(requests=32, seed=k + 6000) if seed else
            [json.loads(line) for line in (ROOT / "bench/traces/mooncake_small.jsonl").read_text().splitlines()
             if line.strip()])
    trace = mooncake_items(recs, scale, tenant="bench")
    return [Stage(rate, tuple(replace(it, group=f"{name}:{it.group or it.session}") for it in items),
                  max(it.at_s for it in items))
            for name, rate, items in (("chat", 0.5, chat), ("mix", 0.8, mix), ("trace", 4.0, trace))]


@dataclass
class _Req:
    item: WorkItem
    rid: int
    arrival: float
    worker: str = ""
    chain: list = field(default_factory=list)
    pulls: list = field(default_factory=list)
    hit: int = 0
    computed: int = 0
    blocks: list = field(default_factory=list)
    prefill_s: float = 0.0
    first_at: float | None = None
    expected_s: float = 0.0  # the router's TTFT estimate of the chosen route (kvmesh)
    running_at: int = 0  # sequences decoding on the chosen worker when it was chosen
    decode_wait_s: float = 0.0
    route_kind: str = ""
    left: int = 0
    done_at: float | None = None
    rows_mark: float = 0.0  # its worker's running-sequence integral at its first token


class _Worker:
    def __init__(self, wid: str, cfg: OpenConfig, bandwidth: float):
        self.wid, self.cfg, self.bandwidth = wid, cfg, bandwidth
        self.now = 0.0
        self.pool = BlockPool(cfg.capacity_blocks, cfg.block_size,
                              TenantEvictionPolicy(protect_s=cfg.cache_protect_s, seed_s=cfg.cache_seed_s),
                              clock=lambda: self.now)
        self.waiting: deque[_Req] = deque()
        self.prefilling: list[_Req] = []
        self.decoding: list[_Req] = []
        self.busy = False
        self.queued: dict[int, int] = {}  # the pool's view: routed, no first token yet
        self.running = 0
        self.inflight = 0
        self.rows_int, self.rows_at = 0.0, 0.0  # integral of ``running`` over time, as the pool keeps it

    def tick(self, now: float) -> None:
        self.rows_int += self.running * max(0.0, now - self.rows_at)
        self.rows_at = max(self.rows_at, now)

    def holds(self, chain: Sequence[bytes]) -> int:
        k = 0
        while k < len(chain) and self.pool.get_cached_block(chain[k]) is not None:
            k += 1
        return k


def legacy_placer(rev: str) -> type:
    """``policies.placement.Placer`` as it was at git revision ``rev`` (the defaults this sweep
    compares against), loaded from ``git show`` without touching the working tree."""
    src = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:policies/placement.py"], check=True,
                         capture_output=True, text=True).stdout
    spec = importlib.util.spec_from_loader(f"_placement_{rev}", loader=None)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    exec(compile(src, f"{rev}:policies/placement.py", "exec"), mod.__dict__)
    return mod.Placer


def pack_groups(run: Sequence[Stage], wids: Sequence[str]) -> dict[str, str]:
    """An oracle's split of the groups over the workers (the ``packed`` router, an upper bound on
    what placement alone can do): each group's requests in the scored stages are known in advance,
    and the groups are packed largest first onto the worker with the fewest requests so far, at most
    ceil(groups / workers) groups per worker (more than that do not fit the pools together)."""
    traffic = Counter(it.group for st in run if not st.warmup for it in st.items)
    for st in run:
        for it in st.items:
            traffic.setdefault(it.group, 0)
    cap = -(-len(traffic) // len(wids))
    load, n, out = {w: 0 for w in wids}, {w: 0 for w in wids}, {}
    for g, c in sorted(traffic.items(), key=lambda kv: (-kv[1], kv[0])):
        w = min((w for w in wids if n[w] < cap), key=lambda w: (load[w], w))
        out[g], load[w], n[w] = w, load[w] + c, n[w] + 1
    return out


def simulate(run: Sequence[Stage], router: str, cfg: OpenConfig = OpenConfig(),
             placement: PlacementConfig | None = None, decode_step_s: float = 0.0,
             placer_cls: type = Placer, learn_decode: bool = False) -> dict:
    """Replay the stages through ``router``; figures per stage and overall. ``learn_decode``:
    the cost model learns its decode term from the outcomes (as the router actor does from the
    pool's reports), starting at ``decode_step_s``."""
    if router not in ROUTERS:
        raise ValueError(f"router must be one of {ROUTERS}")
    bs = cfg.block_size
    rng = random.Random(cfg.seed)
    wids = [f"w{i}" for i in range(cfg.workers)]
    slow = set(wids[cfg.workers - cfg.slow_workers:]) if cfg.slow_workers else set()
    workers = {w: _Worker(w, cfg, cfg.slow_Bps if w in slow else cfg.fast_Bps) for w in wids}
    jitter = random.Random(cfg.seed * 31 + 7)  # hosts are not equally fast (a real cluster's never are)
    slowness = {w: 1.0 + jitter.uniform(-cfg.speed_jitter, cfg.speed_jitter) for w in wids}
    cm = CostModel(CostConfig(block_size=bs, bytes_per_token=cfg.bytes_per_token, decode_step_s=decode_step_s,
                              learn_decode=learn_decode))
    for w in wids:
        cm.register(w, w)
    placer = placer_cls(placement) if placement is not None else placer_cls()
    for w in wids:
        placer.shadow(w, cfg.capacity_blocks)
    params = inspect.signature(placer.decide).parameters
    knows_running, knows_queued = "running" in params, "queued" in params
    knows_rows = "row_s" in params
    row_fit = DecodeModel(0.0, weight=ROW_FIT_WEIGHT)  # seconds per output token per sequence beside it, learned as the pool learns it
    affinity = _Affinity(wids, rng)
    rr = itertools.cycle(wids)
    events: list = []
    seq = itertools.count()
    now = 0.0
    counts: Counter[str] = Counter()

    def push(t: float, kind: str, payload) -> None:
        heapq.heappush(events, (t, next(seq), kind, payload))

    packed = pack_groups(run, wids) if router == "packed" else {}

    def route(r: _Req) -> str:
        it = r.item
        if router == "packed":
            return packed[it.group]
        chains = prompt_chains(it.prompt_ids, bs, MODEL, (it.domain, *it.read_domains))
        picked = baseline_route(router, chains[it.domain], len(it.prompt_ids), bs,
                                {w: workers[w].inflight for w in wids}, rr, rng, affinity)
        if picked is not None:
            return picked
        holdings = {w: k * bs for w in wids if (k := max(workers[w].holds(c) for c in chains.values()))}
        for w in wids:
            cm.observe_load(w, WorkerLoad(tuple(n for n in workers[w].queued.values() if n), workers[w].running))
        pend = placer.pending_tokens(chains, holdings, wids, len(it.prompt_ids), bs, now)
        ranked = wids
        if 0 < cfg.max_candidates < len(wids):
            key = leading_key(chains[it.domain], it.prompt_ids, placer.config.key_blocks)
            ranked = shortlist(wids, {w: max(holdings.get(w, 0), pend.get(w, 0)) for w in wids},
                               {w: len(workers[w].queued) + workers[w].running for w in wids}, key, cfg.max_candidates)
        ranking = cm.rank(len(it.prompt_ids), holdings, ranked, pend)
        loads = {w: float(sum(workers[w].queued.values())) for w in wids}
        extra = {"running": {w: workers[w].running for w in wids}} if knows_running else {}  # legacy placers do not
        if knows_queued:
            extra["queued"] = {w: len(workers[w].queued) for w in wids}
        if knows_rows:
            extra["row_s"] = row_fit.seconds
        placed = placer.decide(it.prompt_ids, it.max_tokens, bs, chains, it.domain, holdings, ranked, loads, ranking,
                               now, **extra)
        c = placed.candidate
        counts[placed.kind] += 1
        counts[c.kind] += 1
        workers[placed.worker].queued[r.rid] = max(0, len(it.prompt_ids) - c.cached_tokens)
        r.expected_s, r.running_at, r.route_kind = c.expected_ttft_s, workers[placed.worker].running, c.kind
        r.decode_wait_s = c.decode_wait_s
        if c.kind == "pulled":
            r.pulls = [(p.holder, p.start_block, p.end_block) for p in c.pulls]
        return placed.worker

    def pull_time(w: _Worker, r: _Req) -> float:
        worst = 0.0
        for holder, start, end in r.pulls:
            nbytes = (end - start) * bs * cfg.bytes_per_token
            worst = max(worst, cfg.rtt_s + nbytes / min(w.bandwidth, workers[holder].bandwidth))
        return worst

    def import_pulls(w: _Worker, r: _Req, seconds: float) -> None:
        got = w.holds(r.chain)
        for holder, start, end in r.pulls:
            h = workers[holder]
            nbytes = (end - start) * bs * cfg.bytes_per_token
            cm.links.observe_transfer(holder, w.wid, nbytes, seconds)
            for k in range(max(start, got), end):
                if h.pool.get_cached_block(r.chain[k]) is None or not w.pool.can_allocate(1):
                    return
                (blk,) = w.pool.allocate(1, r.item.tenant)
                w.pool.cache_full_block(blk, r.chain[k], r.chain[k - 1] if k else None, r.item.tenant, r.item.domain)
                w.pool.free([blk])
                got = k + 1
        r.pulls = []

    def admit(w: _Worker, r: _Req) -> bool:
        it = r.item
        usable = max(0, (len(it.prompt_ids) - 1) // bs)
        hit = min(w.holds(r.chain), usable)
        total = -(-(len(it.prompt_ids) + it.max_tokens) // bs)
        if total > cfg.capacity_blocks:
            raise ValueError(f"a request needs {total} blocks; a pool has {cfg.capacity_blocks}")
        hits = [w.pool.get_cached_block(h) for h in r.chain[:hit]]
        w.pool.touch(hits)
        if not w.pool.can_allocate(total - hit):
            w.pool.free(hits)
            return False
        r.blocks = hits + w.pool.allocate(total - hit, it.tenant)
        r.hit = r.computed = hit * bs
        return True

    def step(w: _Worker) -> None:
        if w.busy:
            return
        w.now = now
        rows = list(w.decoding)
        budget = cfg.budget - len(rows)
        chunks: list[tuple[_Req, int]] = []
        for r in w.prefilling:
            if budget <= 0:
                break
            cap = cfg.long_prefill if w.waiting else budget
            n = min(len(r.item.prompt_ids) - r.computed, budget, cap)
            chunks.append((r, n))
            budget -= n
        while w.waiting and budget > 0 and admit(w, w.waiting[0]):
            r = w.waiting.popleft()
            w.prefilling.append(r)
            n = min(len(r.item.prompt_ids) - r.computed, budget)  # an admission's chunk is not capped
            chunks.append((r, n))
            budget -= n
        if not rows and not chunks:
            return
        tokens = sum(n for _, n in chunks)
        dt = (cfg.step_s + cfg.token_s * tokens + cfg.row_s * len(rows)) * slowness[w.wid]
        w.busy = True
        push(now + dt, "step", (w, rows, chunks, dt))

    def finished(w: _Worker, r: _Req) -> None:
        r.done_at = now
        if r.item.max_tokens >= 2 and now > r.first_at:
            row_fit.observe((w.rows_int - r.rows_mark) / (now - r.first_at), (now - r.first_at) / (r.item.max_tokens - 1))

    def end_step(w: _Worker, decode: list[_Req], chunks: list[tuple[_Req, int]], dt: float) -> None:
        w.now = now
        w.tick(now)
        w.busy = False
        w.pool.take_events()  # nobody reads the pool's events here
        total = len(decode) + sum(n for _, n in chunks)
        for r in decode:
            r.left -= 1
            if r.left <= 0:
                w.decoding.remove(r)
                w.pool.free(r.blocks)
                w.running -= 1
                w.inflight -= 1
                finished(w, r)
        for r, n in chunks:
            r.computed += n
            r.prefill_s += dt * n / total
            for k in range(min(r.computed // bs, len(r.chain))):  # computed full blocks enter the pool
                w.pool.cache_full_block(r.blocks[k], r.chain[k], r.chain[k - 1] if k else None, r.item.tenant,
                                        r.item.domain)
            if r.computed >= len(r.item.prompt_ids):
                w.prefilling.remove(r)
                r.first_at = now
                cm.observe_prefill(w.wid, len(r.item.prompt_ids) - r.hit, r.prefill_s, r.hit)
                if r.route_kind in ("local", "recomputed"):
                    cm.observe_outcome(w.wid, r.running_at, r.expected_s, now - r.arrival, r.decode_wait_s)
                w.queued.pop(r.rid, None)
                w.running += 1
                r.rows_mark = w.rows_int
                r.left = r.item.max_tokens - 1
                if r.left <= 0:
                    w.pool.free(r.blocks)
                    w.running -= 1
                    w.inflight -= 1
                    r.done_at = now
                else:
                    w.decoding.append(r)
        step(w)

    per_stage, all_reqs = [], []
    oracle = Oracle(bs)  # one infinite cache over the whole run (a group warmed earlier is a hit)
    t0 = 0.0
    rid = itertools.count()
    for st in run:
        reqs = [_Req(it, next(rid), t0 + it.at_s) for it in st.items]
        for r in reqs:
            push(r.arrival, "arrive", r)
        while events:
            now, _, kind, payload = heapq.heappop(events)
            if kind == "arrive":
                r = payload
                r.chain = hash_blocks(r.item.prompt_ids, bs, extra_key(MODEL, r.item.domain))
                r.worker = route(r)
                w = workers[r.worker]
                w.inflight += 1
                if router != "kvmesh":
                    w.queued[r.rid] = len(r.item.prompt_ids)
                if r.pulls:
                    secs = pull_time(w, r)
                    push(now + secs, "pulled", (w, r, secs))
                else:
                    w.waiting.append(r)
                    step(w)
            elif kind == "pulled":
                w, r, secs = payload
                w.now = now
                import_pulls(w, r, secs)
                w.waiting.append(r)
                step(w)
            else:
                end_step(*payload)
        drained = max((r.done_at for r in reqs), default=t0)
        per_stage.append(_stage_figures(st, reqs, t0, drained, oracle))
        all_reqs += reqs
        t0 = drained + 1.0
    evictions = {w: sum(s.evictions for s in workers[w].pool.stats.values()) for w in wids}
    scored = [s for s in per_stage if not s["warmup"]]
    hits = sum(s["hit_tokens"] for s in scored)
    best = sum(s["oracle_hit_tokens"] for s in scored)
    reuse = getattr(getattr(placer, "reuse", None), "p", None) if router == "kvmesh" else None
    return {"router": router, "stages": per_stage, "hit_tokens": hits, "oracle_hit_tokens": best,
            "hit_vs_oracle": hits / best if best else 1.0, "evictions": evictions,
            "decisions": dict(counts), "reuse_p_end": reuse}


def _stage_figures(st: Stage, reqs: list[_Req], t0: float, drained: float, oracle: Oracle) -> dict:
    ttft = [r.first_at - r.arrival for r in reqs]
    latency = [r.done_at - r.arrival for r in reqs]
    tpot = [(r.done_at - r.first_at) / (r.item.max_tokens - 1) for r in reqs if r.item.max_tokens > 1]
    best = sum(oracle.observe(r.item) for r in reqs)
    hits = sum(r.hit for r in reqs)
    return {"rate": st.rate, "warmup": st.warmup, "requests": len(reqs),
            "throughput": len(reqs) / max(drained - t0, st.stage_s),
            "ttft_p50": percentile(ttft, 50), "ttft_p90": percentile(ttft, 90), "ttft_p99": percentile(ttft, 99),
            "latency_p50": percentile(latency, 50), "latency_p90": percentile(latency, 90),
            "tpot_p50": percentile(tpot, 50) if tpot else 0.0, "hit_tokens": hits, "oracle_hit_tokens": best,
            "per_worker": dict(sorted(Counter(r.worker for r in reqs).items())),
            "groups_per_worker": dict(sorted(Counter(w for w, _ in {(r.worker, r.item.group) for r in reqs}).items()))}


# -- the sweep ---------------------------------------------------------------------------------
BASELINE_REV = "76dceb6"  # main before this sweep's rule: its Placer is the "legacy" variant
# name -> (PlacementConfig fields, decode_step_s, placer: "new" | "legacy" | a git revision); a field
# of OpenConfig (the engines' eviction) among the fields sets the workers' instead
VARIANTS: dict[str, tuple[dict, float, str]] = {
    "legacy": ({}, 0.0, "legacy"),  # the defaults the cluster bench ran (p(reuse) 1, lexicographic place)
    "default": ({}, 0.0, "new"),  # this module's defaults: p(reuse) 1, victims held elsewhere not charged
    "p=1": ({"reuse_prob": 1.0, "discount_held_elsewhere": False}, 0.0, "new"),
    "p=0.5": ({"reuse_prob": 0.5, "discount_held_elsewhere": False}, 0.0, "new"),
    "p=0.25": ({"reuse_prob": 0.25, "discount_held_elsewhere": False}, 0.0, "new"),
    "p=0": ({"reuse_prob": 0.0, "discount_held_elsewhere": False}, 0.0, "new"),
    "measured": ({"reuse_prob": None, "discount_held_elsewhere": False}, 0.0, "new"),
    "measured+elsewhere": ({"reuse_prob": None}, 0.0, "new"),
    "legacy slack=0.5": ({"place_slack": 0.5}, 0.0, "legacy"),
    "legacy slack=0": ({"place_slack": 0.0}, 0.0, "legacy"),
    "legacy decode=0.25": ({}, 0.25, "legacy"),
    "p=1+elsewhere": ({"reuse_prob": 1.0}, 0.0, "new"),
    "p=0.5+elsewhere": ({"reuse_prob": 0.5}, 0.0, "new"),
    "p=1 decode=0.25": ({"reuse_prob": 1.0, "discount_held_elsewhere": False}, 0.25, "new"),
    "p=1 decode=0.5": ({"reuse_prob": 1.0, "discount_held_elsewhere": False}, 0.5, "new"),
    "measured+elsewhere decode=0.25": ({"reuse_prob": None}, 0.25, "new"),
    "p=1+elsewhere decode=0.5": ({"reuse_prob": 1.0}, 0.5, "new"),
    "measured+elsewhere decode=0.5": ({"reuse_prob": None}, 0.5, "new"),
    "any group spills": ({"spill_group_share": 0.0}, 0.0, "new"),  # the rule before session 9
    "queued count one": ({"idle_counts_queued": False}, 0.0, "new"),  # the idle rule's busy test before session 28
    "s10": ({}, 0.0, "20ae9bd"),  # main at the end of session 10 (before the balance rules)
    "s11": ({}, 0.0, "e982842"),  # main at the end of session 11 (share of the last 8 requests, balance on)
    "no balance": ({"balance_ratio": 0.0}, 0.0, "new"),
    "balance on": ({"balance_ratio": 2.0}, 0.0, "new"),  # session 11's overloaded-holder rule
    "group tau 10": ({"group_tau_s": 10.0}, 0.0, "new"),
    "group tau 15": ({"group_tau_s": 15.0}, 0.0, "new"),
    "group tau 60": ({"group_tau_s": 60.0}, 0.0, "new"),
    "place tie 0": ({"place_tie": 0.0}, 0.0, "new"),
    "place tie 0.25": ({"place_tie": 0.25}, 0.0, "new"),  # the default before session 19
    "place tie 0.5": ({"place_tie": 0.5}, 0.0, "new"),
    "place tie 1": ({"place_tie": 1.0}, 0.0, "new"),  # a new prefix: headroom decides within one prefill
    "place tie 2": ({"place_tie": 2.0, "place_slack": 2.0}, 0.0, "new"),
    "decode places": ({"place_counts_decode": True}, 0.0, "new"),
    "pull charge 1": ({"spill_pull_charge": 1.0}, 0.0, "new"),
    "pull charge 0": ({"spill_pull_charge": 0.0}, 0.0, "new"),
    "no idle spill": ({"idle_slack": 0.0}, 0.0, "new"),
    "match tie 0": ({"match_tie": 0.0}, 0.0, "new"),  # before session 29: holders within tie_ratio, by headroom
    "scaled prefill": ({}, 0.0, "c450ae0"),  # main before the full-prefill estimate (session 29): scaled by tokens
    "minor 1": ({"minor_spill_prefills": 1.0}, 0.0, "new"),  # the default before session 29 (on a prefill read 2-7x too long)
    "minor never": ({"minor_spill_prefills": None}, 0.0, "new"),
    "match tie 0.1": ({"match_tie": 0.1}, 0.0, "new"),
    "match tie 0.5": ({"match_tie": 0.5}, 0.0, "new"),
    "match tie 1": ({"match_tie": 1.0}, 0.0, "new"),
    "match tie 3": ({"match_tie": 3.0}, 0.0, "new"),  # before session 16: a hot group never takes an idle worker
    "any share spills": ({"spill_share_margin": None}, 0.0, "new"),  # before session 17: one of many groups spills too
    "share taken as exact": ({"spill_share_z": 0.0}, 0.0, "new"),  # no lower confidence bound on the share
    "share margin -0.25": ({"spill_share_margin": -0.25}, 0.0, "new"),
    "share margin -0.5": ({"spill_share_margin": -0.5}, 0.0, "new"),
    "no fill guard": ({"prefix_fill": 1.0}, 0.0, "new"),  # before session 24: a pool may fill with prefixes
    "fill 0.8": ({"prefix_fill": 0.8}, 0.0, "new"),
    "seed 0": ({"cache_seed_s": 0.0}, 0.0, "new"),  # the engines before session 30: a new chain is plain LRU
    "plain LRU": ({"cache_seed_s": 0.0, "cache_protect_s": 0.0}, 0.0, "new"),
    "no relief": ({"contention_weight": 0.0}, 0.0, "new"),  # before session 32: decode contention not weighed
    "contention 0.5": ({"contention_weight": 0.5}, 0.0, "new"),
    "contention 2": ({"contention_weight": 2.0}, 0.0, "new"),
    "relief copies free": ({"relief_copy_weight": 0.0}, 0.0, "new"),
    "relief copy 0.5": ({"relief_copy_weight": 0.5}, 0.0, "new"),
    "relief ignores fill": ({"relief_fill": False}, 0.0, "new"),
    "quiet domains count": ({"domain_idle_gaps": 0.0}, 0.0, "new"),  # before session 33: a tenant's prefixes count while it is silent
    # the router weighs at most N workers per request (its holders first, then the least busy,
    # ``policies.placement.shortlist``): on 4 workers (2, 3) what a short list costs placement (the
    # product's default, 16, is all of them there); 8-16 for --workers 16-64
    "shortlist 2": ({"max_candidates": 2}, 0.0, "new"),
    "shortlist 3": ({"max_candidates": 3}, 0.0, "new"),
    "shortlist 16": ({"max_candidates": 16}, 0.0, "new"),  # the product's default (--workers above 16)
    "shortlist 8": ({"max_candidates": 8}, 0.0, "new"),
    "shortlist 12": ({"max_candidates": 12}, 0.0, "new"),
    "relief copy 1.5": ({"relief_copy_weight": 1.5}, 0.0, "new"),
    "relief copy 2": ({"relief_copy_weight": 2.0}, 0.0, "new"),
    "relief copy 3": ({"relief_copy_weight": 3.0}, 0.0, "new"),
    "relief room 1": ({"relief_room": 1.0}, 0.0, "new"),  # before session 39: room for the copy alone
    "relief room 3": ({"relief_room": 3.0}, 0.0, "new"),
}


def run_variant(name: str, seeds: Sequence[int], hot: bool, cfg: OpenConfig, _cache: dict = {},
                steady: bool = False, rates: Sequence[float] | None = None, stage_s: float = 45.0,
                warmup_stages: int = 1, order: Sequence[int] | None = None, chat: bool = False,
                then_hot: Sequence[float] = (), trace: bool = False, others: bool = False,
                groups: int = 12) -> list[dict]:
    """``name``: a router, a ``VARIANTS`` key, or either with ``+learn`` (the decode term learned)."""
    base, learn = (name[: -len("+learn")], True) if name.endswith("+learn") else (name, False)
    fields, decode_s, kind = VARIANTS[base] if base in VARIANTS else ({}, 0.0, "new")
    router = name if name in ROUTERS else "kvmesh"
    rev = BASELINE_REV if kind == "legacy" else kind if kind != "new" else None
    if rev is not None and rev not in _cache:
        _cache[rev] = legacy_placer(rev)
    placer_cls = _cache[rev] if rev is not None else Placer
    legacy_cfg = sys.modules[placer_cls.__module__].PlacementConfig if rev is not None else PlacementConfig
    engines = {k: v for k, v in fields.items() if k in OpenConfig.__dataclass_fields__}
    fields = {k: v for k, v in fields.items() if k not in engines}
    rows = []
    for seed in seeds:
        run = stages(rates or (0.4, 0.7, 1.0, 1.3), stage_s=stage_s, seed=seed, hot=hot, steady=steady,
                     warmup_stages=warmup_stages, order=order, chat=chat, then_hot=then_hot, trace=trace,
                     others=others, groups=groups)
        res = simulate(run, router, replace(cfg, seed=seed, **engines), legacy_cfg(**fields),
                       decode_s, placer_cls, learn_decode=learn)
        rows.append({"seed": seed, **res})
    return rows


def run_closed(name: str, seeds: Sequence[int], _cache: dict = {}) -> dict:
    """``bench/placement_sim.py``'s closed-loop issue sizing (its defaults) under a variant's
    placement: the hit ratio it must keep."""
    from bench import placement_sim as ps

    fields, _, kind = VARIANTS[name] if name in VARIANTS else ({}, 0.0, "new")
    if kind == "legacy" and "legacy" not in _cache:
        _cache["legacy"] = legacy_placer(BASELINE_REV)
    cls = _cache["legacy"] if kind == "legacy" else Placer
    conf = sys.modules[cls.__module__].PlacementConfig(**fields)
    router = name if name in ps.ROUTERS else "kvmesh"
    saved, ps.Placer = ps.Placer, cls
    try:
        rows = []
        for seed in seeds:
            items, cfg = ps.issue_sizing(4, 4, 6, prefix_over_pool=3.5, rounds=3, seed=seed)
            rows.append(ps.simulate(items, router, cfg, conf))
    finally:
        ps.Placer = saved
    return {"hit_vs_oracle": sum(r["hit_vs_oracle"] for r in rows) / len(rows),
            "hit_vs_oracle_min": min(r["hit_vs_oracle"] for r in rows),
            "ttft_p90_s": sum(r["ttft_p90_s"] for r in rows) / len(rows), "seeds": len(rows)}


def aggregate(rows: list[dict]) -> dict:
    """Per rate: the mean over seeds of each stage figure; the curve's equal-p99 inputs."""
    rates = sorted({s["rate"] for r in rows for s in r["stages"] if not s["warmup"]})
    out = {}
    for rate in rates:
        ss = [s for r in rows for s in r["stages"] if s["rate"] == rate and not s["warmup"]]
        out[str(rate)] = {k: sum(s[k] for s in ss) / len(ss)
                          for k in ("throughput", "ttft_p50", "ttft_p90", "ttft_p99", "latency_p50", "latency_p90",
                                    "tpot_p50")}
        hits, oracle = sum(s["hit_tokens"] for s in ss), sum(s["oracle_hit_tokens"] for s in ss)
        out[str(rate)]["hit_vs_oracle"] = hits / oracle if oracle else 1.0
    hits, oracle = sum(r["hit_tokens"] for r in rows), sum(r["oracle_hit_tokens"] for r in rows)
    per_seed = {str(r["seed"]): {str(s["rate"]): [round(s[k], 4) for k in ("throughput", "ttft_p50", "ttft_p90",
                                                                          "ttft_p99")]
                                 for s in r["stages"] if not s["warmup"]}
                for r in rows}
    warm = [max((s.get("groups_per_worker") or {0: 0}).values()) for r in rows for s in r["stages"] if s["warmup"]]
    return {"per_rate": out, "hit_vs_oracle": hits / oracle if oracle else 1.0,
            # per seed, the most groups one worker served in the warm-up (12 groups, 4 workers: 3 is even)
            "warmup_max_groups": warm,
            "reuse_p_end": [r["reuse_p_end"] for r in rows], "seeds": len(rows),
            "per_seed": per_seed}  # seed -> rate -> [throughput, p50, p90, p99]


def paired(a: dict, b: dict) -> dict:
    """Per rate: mean and standard error over seeds of ``a`` - ``b`` (same seeds, same arrivals)
    for [throughput, p50, p90, p99]."""
    out = {}
    seeds = sorted(set(a["per_seed"]) & set(b["per_seed"]))
    for rate in a["per_rate"]:
        d = [[x - y for x, y in zip(a["per_seed"][s][rate], b["per_seed"][s][rate])] for s in seeds]
        n = len(d)
        mean = [sum(col) / n for col in zip(*d)]
        se = [math.sqrt(sum((v - m) ** 2 for v in col) / max(1, n - 1) / n) for col, m in zip(zip(*d), mean)]
        out[rate] = {"mean": [round(m, 4) for m in mean], "se": [round(e, 4) for e in se]}
    return out


def curve(agg: dict) -> list[Point]:
    return [Point(float(rate), v["throughput"], v["ttft_p50"], v["ttft_p90"], v["ttft_p99"])
            for rate, v in agg["per_rate"].items()]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", default=",".join([*ROUTERS[1:], *VARIANTS]),
                    help=f"comma list of {list(VARIANTS)} and baseline routers {ROUTERS[1:]}")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--workload", choices=("shared", "hot", "closed", "steady", "chat", "steady_hot", "trace", "others"),
                    default="shared",
                    help="shared: the cluster bench's stages; hot: one group; chat: multi-turn sessions sharing a "
                         "system prompt; closed: placement_sim's defaults; "
                         "steady: the bench's --sweep steady (one set of groups through a warm-up and every rate); "
                         "steady_hot: steady, then the bench's hot-prefix series (--hot-rates), only the latter scored; "
                         "trace: a synthetic Mooncake trace per stage, read as the bench reads its trace; "
                         "others: steady and hot (warm-ups), then the bench's multi-turn (@0.5), multi-tenant "
                         "(@0.8) and trace (@4.0) on the caches they left, as the bench runs them")
    ap.add_argument("--hot-rates", default="0.7,1.3", help="steady_hot: the hot series' rates (the bench's default)")
    ap.add_argument("--rates", default=None, help="offered rates (req/s), comma separated")
    ap.add_argument("--stage-s", type=float, default=45.0,
                    help="seconds per rate (the cluster bench's default: 30)")
    ap.add_argument("--warmup-stages", type=int, default=1,
                    help="steady: the warm-up lasts whole stages until every group was sent, at most this many "
                         "(the cluster bench since session 18: 4)")
    ap.add_argument("--ipperf-order", default=None,
                    help="steady: a JSON list of the groups in inference-perf's send order (bench.ipperf.group_order; "
                         "bench/traces/ipperf_order_default.json: the cluster bench's default size); every stage "
                         "walks it from the start, as inference-perf does")
    ap.add_argument("--token-s", type=float, default=OpenConfig.token_s,
                    help="seconds per prefill token (default ~1/212: one idle host; the cluster bench's hosts "
                         "measured ~1/40 under load in session 18: 0.025)")
    ap.add_argument("--speed-jitter", type=float, default=0.0,
                    help="worker k's steps take (1 + u_k) x as long, u_k uniform in [-x, +x] per seed "
                         "(the cluster's hosts measured 12.4-15.2 ms per prefill token, +-10%%)")
    ap.add_argument("--step-s", type=float, default=OpenConfig.step_s, help="fixed seconds of one engine step")
    ap.add_argument("--row-s", type=float, default=OpenConfig.row_s,
                    help="seconds per decode row in a step (the cluster bench's hosts in session 31: a one-row "
                         "step ~0.2 s, ~0.03 s more per row)")
    ap.add_argument("--fast-Bps", type=float, default=OpenConfig.fast_Bps,
                    help="bytes/s of a fast worker's link (the cluster bench's hosts measured 9-28 MB/s between "
                         "their object stores on 1 Gbit/s links, sessions 35-37)")
    ap.add_argument("--slow-Bps", type=float, default=OpenConfig.slow_Bps, help="bytes/s of a slow worker's link")
    ap.add_argument("--capacity-blocks", type=int, default=OpenConfig.capacity_blocks,
                    help="each worker's pool in blocks (128: the bench's pool ratio 3; 96: ratio 4)")
    ap.add_argument("--workers", type=int, default=OpenConfig.workers,
                    help="workers (the cluster bench's: 4); --groups scales the shared workload with them")
    ap.add_argument("--groups", type=int, default=12, help="shared / steady: prefix groups per stage (the bench's: 12)")
    ap.add_argument("--json", default=str(ROOT / "bench/results/placement_sim_tradeoff.json"),
                    help="merge the aggregated rows into this file (by workload and variant)")
    a = ap.parse_args(argv)
    cfg = OpenConfig(speed_jitter=a.speed_jitter, capacity_blocks=a.capacity_blocks, token_s=a.token_s,
                     step_s=a.step_s, row_s=a.row_s, workers=a.workers, fast_Bps=a.fast_Bps, slow_Bps=a.slow_Bps)
    path = Path(a.json)
    doc = json.loads(path.read_text()) if path.exists() else {}
    doc.setdefault("bench", "bench/placement_openloop.py")
    doc["config"] = asdict(cfg)
    doc.setdefault("stage_s", {})[a.workload] = a.stage_s
    doc["baseline_rev"] = BASELINE_REV
    res = doc.setdefault(a.workload, {})
    for name in a.variants.split(","):
        t = time.perf_counter()
        if a.workload == "closed":
            res[name] = agg = run_closed(name, range(a.seeds))
            print(f"closed {name:32s} hit {agg['hit_vs_oracle']:.3f} (min {agg['hit_vs_oracle_min']:.3f}) "
                  f"ttft p90 {agg['ttft_p90_s']:.3f} s", flush=True)
            continue
        rates = [float(x) for x in a.rates.split(",")] if a.rates else None
        agg = aggregate(run_variant(name, range(a.seeds), a.workload == "hot", cfg,
                                    steady=a.workload in ("steady", "steady_hot"), others=a.workload == "others",
                                    rates=rates, stage_s=a.stage_s, warmup_stages=a.warmup_stages,
                                    chat=a.workload == "chat", trace=a.workload == "trace",
                                    then_hot=[float(x) for x in a.hot_rates.split(",")]
                                    if a.workload in ("steady_hot", "others") else (),
                                    order=json.loads(Path(a.ipperf_order).read_text()) if a.ipperf_order else None,
                                    groups=a.groups))
        res[name] = agg
        pr = agg["per_rate"]
        print(f"{a.workload:6s} {name:32s} hit {agg['hit_vs_oracle']:.3f}  " + "  ".join(
            f"@{r}: {v['throughput']:.2f}/s p50 {v['ttft_p50']:.1f} p90 {v['ttft_p90']:.1f} p99 {v['ttft_p99']:.1f}"
            f" e2e p90 {v['latency_p90']:.1f} tpot {v['tpot_p50']:.2f}"
            for r, v in pr.items()) + (f"  warm-up max groups {Counter(agg['warmup_max_groups'])}"
                                       if a.workload in ("steady", "steady_hot") else "") + f"  ({time.perf_counter() - t:.0f} s)",
              flush=True)
    if "affinity" in res and a.workload != "closed":
        ref = curve(res["affinity"])
        for name, agg in res.items():
            agg["vs_affinity_equal_p99"] = equal_p99_ratio(curve(agg), ref)
    if "legacy" in res and a.workload != "closed":
        for name, agg in res.items():  # paired over seeds: [throughput, p50, p90, p99] minus legacy's
            agg["minus_legacy"] = paired(agg, res["legacy"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
