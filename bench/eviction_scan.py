"""Prefix hits of one engine whose pool the shared prefixes fill: plain LRU against tail-first eviction.

The cluster bench at ``--pool-ratio 4`` (bench/results/cluster_s15_pool4.json: 12 groups of
512-token system prompts, each worker's pool 1,536 tokens, i.e. exactly 3 groups per worker) read
0.76-0.87 of the oracle's hit tokens for kvmesh *and* affinity: every finished request left its
question and answer blocks cached (~3 blocks nobody asks for again) and LRU evicted the oldest
group's deepest prefix blocks for them. ``policies/eviction.py`` now passes over reused prefix
blocks for such tail blocks (``EngineConfig.cache_protect_s``; 0 = plain LRU).

This drives the real ``LLMEngine`` (a random 2-layer Llama: eviction does not depend on the
weights) with that workload on one worker: ``--groups`` system prompts of ``--system-len`` tokens,
requests drawn uniformly over them (seeded), each with a ``--question-len``-token unique question
and ``--output-len`` output tokens, ``--concurrency`` requests in flight (continuous batching), a
pool of (groups x prefix blocks) / fill blocks for each of ``--fills``. Reported per
policy and fill: prompt tokens served from cache over the oracle's (an infinite cache: every
request after its group's first reuses the block-aligned system prompt), and evictions. A second
scenario checks that protection does not lock new groups out: phase 1 uses groups A, phase 2 a new
set B on the same pool; phase 2's hits are reported for both policies. A third, multi-turn chat
(``run_chat``), is the case tail-first eviction could hurt: a conversation's history is a tail
until its next turn reuses it.

    .venv/bin/python bench/eviction_scan.py            # ~1 min on 2 cores
Writes bench/results/eviction_scan.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
RESULTS = Path(__file__).resolve().parent / "results"
BLOCK = 16


class Clock:
    """The pool's clock: engine steps advance it by ``step_s`` (so ``protect_s`` means seconds
    of a serving engine, not of this fast replay)."""

    def __init__(self, step_s: float):
        self.t, self.step_s = 0.0, step_s

    def __call__(self) -> float:
        return self.t


@dataclass(frozen=True)
class Policy:
    """An eviction policy: the engine's ``cache_protect_s`` and ``cache_seed_s``."""

    name: str
    protect_s: float
    seed_s: float


def _engine(num_blocks: int, policy: Policy, step_s: float, max_positions: int):
    """A tiny-llama engine of ``num_blocks`` whose pool runs on a ``Clock`` of ``step_s`` per step."""
    from engine.llm_engine import EngineConfig, LLMEngine
    from engine.model_loader import tiny_llama

    eng = LLMEngine(EngineConfig(model="tiny-llama", num_blocks=num_blocks, max_num_batched_tokens=1024,
                                 cache_protect_s=policy.protect_s, cache_seed_s=policy.seed_s, approx=None),
                    tiny_llama(max_positions=max_positions))
    clock = Clock(step_s)
    eng.pool.clock = clock
    return eng, clock


def _row(scenario: str, fill: float, policy: Policy, runs: list[dict], counted: list[dict]) -> dict:
    """One policy at one fill over the seeds' ``runs`` (hits summed over ``counted``), printed."""
    row = {"scenario": scenario, "fill": fill, "policy": policy.name, "protect_s": policy.protect_s,
           "seed_s": policy.seed_s, "num_blocks": runs[0]["num_blocks"],
           "vs_oracle": sum(p["cached_tokens"] for p in counted) / max(1, sum(p["oracle_cached_tokens"] for p in counted)),
           "evictions": sum(r["evictions"] for r in runs) / len(runs), "runs": runs}
    if "cold_cached_tokens" in runs[0]:
        row["cold_vs_oracle"] = sum(r["cold_cached_tokens"] for r in runs) / max(1, sum(r["cold_oracle_tokens"] for r in runs))
    cold = f"  cold group's 2nd prompt {row['cold_vs_oracle']:.3f}" if "cold_vs_oracle" in row else ""
    print(f"{scenario:6s} fill {fill:4.2f} ({row['num_blocks']:3d} blocks) {policy.name:18s}"
          f" hits/oracle {row['vs_oracle']:.3f}  evictions {row['evictions']:.0f}{cold}", flush=True)
    return row


def _finished(eng, clock, inflight: dict) -> list:
    """One engine step (the clock advances ``step_s``): the requests of ``inflight`` it finished."""
    done = [o for o in eng.step() if o.finished and o.request_id in inflight]
    clock.t += clock.step_s
    return done


def run(policy: Policy, fill: float, a, phases: list[list[int]], seed: int) -> dict:
    from engine.sequence import Request, SamplingParams

    prefix_blocks = a.system_len // BLOCK
    groups_in_use = max(len(p) for p in phases)
    num_blocks = int(round(groups_in_use * prefix_blocks / fill))
    eng, clock = _engine(num_blocks, policy, a.step_s, 2048)
    rng = random.Random(seed)
    system = {g: tuple(rng.randrange(3, 250) for _ in range(a.system_len)) for p in phases for g in p}
    out = []
    n = 0
    for groups in phases:
        seen: set[int] = set()
        cached = oracle = prompt = 0
        todo = a.requests
        inflight: dict[str, int] = {}
        while todo or inflight:
            while todo and len(inflight) < a.concurrency:
                g = rng.choice(groups)
                q = tuple(rng.randrange(3, 250) for _ in range(a.question_len))
                rid = f"r{n}"
                n += 1
                eng.add_request(Request(rid, system[g] + q, SamplingParams(max_tokens=a.output_len, temperature=0,
                                                                           ignore_eos=True), tenant="t"))
                inflight[rid] = g
                oracle += prefix_blocks * BLOCK if g in seen else 0
                seen.add(g)
                todo -= 1
            for o in _finished(eng, clock, inflight):
                del inflight[o.request_id]
                cached += o.num_cached_tokens
                prompt += o.num_prompt_tokens
        out.append({"groups": len(groups), "requests": a.requests, "cached_tokens": cached,
                    "oracle_cached_tokens": oracle, "vs_oracle": cached / oracle if oracle else None,
                    "prompt_tokens": prompt})
    eng.pool.check_invariants()
    ev = sum(s.evictions for s in eng.pool.stats.values())
    return {"fill": fill, "num_blocks": num_blocks, "phases": out, "evictions": ev}


def run_cold(policy: Policy, fill: float, a, seed: int) -> dict:
    """A cold group on a worker its hot groups keep busy (the cluster bench's group ``5fc1e283``,
    sessions 28-29): ``--groups`` hot system prompts, each computed and reused once; then a cold
    group's first prompt; then ``--cold-gap-s`` of requests over the hot groups (``--concurrency``
    in flight, each with a unique question); then the cold group's second prompt. The pool holds
    the hot and cold prefixes / fill. Reported: all requests' hits against the oracle's, and the
    cold group's second prompt's."""
    from engine.sequence import Request, SamplingParams

    prefix_blocks = a.system_len // BLOCK
    num_blocks = int(round((a.groups + 1) * prefix_blocks / fill))
    eng, clock = _engine(num_blocks, policy, a.step_s, 2048)
    rng = random.Random(seed)
    system = [tuple(rng.randrange(3, 250) for _ in range(a.system_len)) for _ in range(a.groups + 1)]
    cold = a.groups
    params = SamplingParams(max_tokens=a.output_len, temperature=0, ignore_eos=True)
    cached = oracle = 0
    n = 0

    def send(g: int) -> str:
        nonlocal n
        rid = f"r{n}"
        n += 1
        eng.add_request(Request(rid, system[g] + tuple(rng.randrange(3, 250) for _ in range(a.question_len)),
                                params, tenant="t"))
        return rid

    def serve(rids: dict[str, bool], hot_until: float = 0.0) -> list:
        """Step until ``rids`` (request -> whether the oracle reuses its prefix) finish, keeping
        ``--concurrency`` hot requests in flight until the clock reads ``hot_until``; the
        finished outputs."""
        nonlocal cached, oracle
        done = []
        while rids or clock.t < hot_until:
            while clock.t < hot_until and len(rids) < a.concurrency:
                rids[send(rng.randrange(a.groups))] = True
            for o in _finished(eng, clock, rids):
                oracle += prefix_blocks * BLOCK if rids.pop(o.request_id) else 0
                cached += o.num_cached_tokens
                done.append(o)
        return done

    for g in range(a.groups):  # each hot group computed, then reused
        serve({send(g): False})
        serve({send(g): True})
    serve({send(cold): False})
    serve({}, hot_until=clock.t + a.cold_gap_s)
    second = serve({send(cold): True})[0]
    eng.pool.check_invariants()
    return {"fill": fill, "num_blocks": num_blocks, "cached_tokens": cached, "oracle_cached_tokens": oracle,
            "vs_oracle": cached / oracle if oracle else None, "requests": n,
            "cold_cached_tokens": second.num_cached_tokens, "cold_oracle_tokens": prefix_blocks * BLOCK,
            "evictions": sum(s.evictions for s in eng.pool.stats.values())}


def run_chat(policy: Policy, fill: float, a, seed: int) -> dict:
    """Multi-turn chat, where tail-first eviction could hurt: ``--chats`` conversations behind
    one shared system prompt, each turn's prompt the conversation so far plus a new question
    (its history is a tail until the next turn reuses it); turns go round-robin over the
    conversations, ``--concurrency`` in flight. The pool holds the system prompt and the
    conversations' final histories / fill. The oracle reuses each turn's whole previous context
    (block-aligned) and the system prompt after its first use."""
    from engine.sequence import Request, SamplingParams

    turns, chats = a.turns, a.chats
    final = a.chat_system_len + turns * (a.question_len + a.output_len)
    num_blocks = int(round((a.chat_system_len + chats * (final - a.chat_system_len)) / BLOCK / fill))
    eng, clock = _engine(num_blocks, policy, a.step_s, 4096)
    rng = random.Random(seed)
    system = tuple(rng.randrange(3, 250) for _ in range(a.chat_system_len))
    history = {c: system for c in range(chats)}
    queue = [(t, c) for t in range(turns) for c in range(chats)]
    cached = oracle = 0
    inflight: dict[str, tuple[int, tuple]] = {}
    n = 0
    system_seen = False
    while queue or inflight:
        busy = {c for c, _ in inflight.values()}
        while queue and len(inflight) < a.concurrency and queue[0][1] not in busy:
            t, c = queue.pop(0)
            prompt = history[c] + tuple(rng.randrange(3, 250) for _ in range(a.question_len))
            rid = f"c{c}t{t}"
            eng.add_request(Request(rid, prompt, SamplingParams(max_tokens=a.output_len, temperature=0,
                                                                ignore_eos=True), tenant="t"))
            prev = len(history[c]) if t else (a.chat_system_len if system_seen else 0)
            oracle += (prev // BLOCK) * BLOCK
            system_seen = True
            inflight[rid] = (c, prompt)
            busy.add(c)
            n += 1
        for o in eng.step():
            if o.request_id in inflight:
                c, prompt = inflight[o.request_id]
                inflight[o.request_id] = (c, prompt + tuple(o.new_token_ids))
                if o.finished:
                    cached += o.num_cached_tokens
                    history[c] = inflight.pop(o.request_id)[1]
        clock.t += clock.step_s
    eng.pool.check_invariants()
    return {"fill": fill, "num_blocks": num_blocks, "cached_tokens": cached,
            "oracle_cached_tokens": oracle, "vs_oracle": cached / oracle if oracle else None,
            "evictions": sum(s.evictions for s in eng.pool.stats.values())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--groups", type=int, default=3)
    ap.add_argument("--system-len", type=int, default=512)
    ap.add_argument("--question-len", type=int, default=40)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--requests", type=int, default=90)
    ap.add_argument("--concurrency", type=int, default=3)
    ap.add_argument("--fills", default="0.75,0.9,1.0,1.2", help="prefix blocks in use / pool blocks")
    ap.add_argument("--step-s", type=float, default=0.4, help="seconds one engine step stands for")
    ap.add_argument("--protect-s", type=float, default=60.0)
    ap.add_argument("--seed-s", type=float, default=120.0)
    ap.add_argument("--cold-gap-s", type=float, default=100.0,
                    help="seconds of hot traffic between the cold group's two prompts")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--chats", type=int, default=8, help="conversations of the multi-turn scenario")
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--chat-system-len", type=int, default=256)
    ap.add_argument("--scenarios", default="steady,shift,cold,chat")
    ap.add_argument("--out", default=str(RESULTS / "eviction_scan.json"))
    a = ap.parse_args()
    scenarios = [x for x in a.scenarios.split(",") if x]
    t0 = time.time()
    fills = [float(x) for x in a.fills.split(",")]
    policies = [Policy("plain LRU", 0.0, 0.0), Policy("tail-first", a.protect_s, 0.0),
                Policy("tail-first + seeded", a.protect_s, a.seed_s)]
    g = a.groups
    phased = {"steady": [list(range(g))], "shift": [list(range(g)), list(range(g, 2 * g))]}
    rows = []
    for name in scenarios:
        for fill in fills:
            for policy in policies:
                if name in phased:
                    runs = [run(policy, fill, a, phased[name], seed) for seed in range(a.seeds)]
                    rows.append(_row(name, fill, policy, runs, [r["phases"][-1] for r in runs]))
                else:
                    runs = [(run_cold if name == "cold" else run_chat)(policy, fill, a, seed) for seed in range(a.seeds)]
                    rows.append(_row(name, fill, policy, runs, runs))
    summary = {}
    for name in scenarios:
        for fill in fills:
            by = {r["policy"]: r for r in rows if r["scenario"] == name and r["fill"] == fill}
            lru = by["plain LRU"]["vs_oracle"]
            summary[f"{name}@{fill}"] = entry = {p.name: by[p.name]["vs_oracle"] for p in policies}
            entry["ratios_vs_plain_lru"] = {p.name: by[p.name]["vs_oracle"] / lru if lru else None for p in policies[1:]}
            if name == "cold":
                entry["cold_second_prompt"] = {p.name: by[p.name]["cold_vs_oracle"] for p in policies}
            print(f"{name:6s} fill {fill:4.2f}: hits/oracle " + " / ".join(f"{by[p.name]['vs_oracle']:.3f}" for p in policies)
                  + f" ({' / '.join(p.name for p in policies)})"
                  + (" cold group's 2nd prompt " + " / ".join(f"{by[p.name]['cold_vs_oracle']:.2f}" for p in policies)
                     if name == "cold" else ""))
    res = {"bench": "eviction_scan", "compares": "tail-first eviction (cache_protect_s) and new chains after tails "
                                                 "(cache_seed_s) vs plain LRU, one engine",
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
           "args": vars(a), "summary": summary, "rows": rows, "wall_s": round(time.time() - t0, 1)}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(f"wrote {a.out} in {res['wall_s']} s")


if __name__ == "__main__":
    main()
