"""Global prefix index: lookups/s for 2,048-token prompts against 1M indexed blocks, memory/block.

    nice -n 5 .venv/bin/python bench/index.py [--blocks 1000000] [--lookups 20000]

In-process (no Ray): the index is built the way the actor builds it, from msgpack event batches
(decode + apply), so keys are owned by the index and the memory figure is honest. Memory per
block = tracemalloc'd bytes of the built index / its blocks. Lookups are timed for a full
128-block hit (the slowest case: every position is walked), a partial hit, a miss, and a full
hit through two readable domains (own + grant). The caller's cost of hashing the prompt
(sha256 chain, not part of the index) is printed next to it. Target: >= 50k lookups/s.
Writes bench/results/index.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actors.index_publisher import decode_batch, encode_batch  # noqa: E402
from actors.prefix_index import PrefixIndex, prompt_chains  # noqa: E402
from engine.block_pool import BlockEvent  # noqa: E402

BS = 16
PROMPT_BLOCKS = 2048 // BS  # 128
TARGET = 50_000


def machine() -> dict:
    cpu = platform.processor()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "platform": platform.platform(), "loadavg_1m": round(os.getloadavg()[0], 2)}


def workload(num_blocks: int, workers: int, domains: int, seed: int = 0):
    """Chains of 128 blocks: a 32-block "system prompt" head shared within a domain and
    a unique tail; each chain is held by 1-3 workers under one domain."""
    rng = random.Random(seed)
    # a chain hash covers the domain, so each domain has its own heads (4 system prompts each)
    heads = {f"tenant{d}": [[rng.randbytes(16) for _ in range(32)] for _ in range(4)] for d in range(domains)}
    chains, placed, total = [], {f"w{i}": [] for i in range(workers)}, 0
    seen = set()
    while total < num_blocks:
        dom = f"tenant{rng.randrange(domains)}"
        chain = rng.choice(heads[dom]) + [rng.randbytes(16) for _ in range(PROMPT_BLOCKS - 32)]
        chains.append((dom, chain))
        for w in rng.sample(sorted(placed), rng.randint(1, 3)):
            placed[w].append((dom, chain))
        new = [h for h in chain if h not in seen]
        seen.update(new)
        total += len(new)
    return chains, placed, len(seen)


def payloads(placed: dict, batch_events: int = 4096) -> list[bytes]:
    out = []
    for w, items in placed.items():
        events = [BlockEvent("stored", h, chain[i - 1] if i else None, dom)
                  for dom, chain in items for i, h in enumerate(chain)]
        for seq, start in enumerate(range(0, len(events), batch_events)):
            out.append(encode_batch(w, seq, BS, events[start : start + batch_events], [] if seq == 0 else None))
    return out


def build(data: list[bytes]) -> PrefixIndex:
    idx = PrefixIndex(BS)
    for p in data:
        assert idx.apply_batch(decode_batch(p))
    return idx


def rate(fn, args_list, min_s: float = 1.0) -> tuple[float, float]:
    """(calls per wall second, calls per CPU second of this process). On a shared, loaded
    machine the CPU-time rate is the figure that reflects the code."""
    n, t0, c0 = 0, time.perf_counter(), time.process_time()
    while True:
        for a in args_list:
            fn(a)
        n += len(args_list)
        cpu = time.process_time() - c0
        if cpu >= min_s:
            return n / (time.perf_counter() - t0), n / cpu


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=1_000_000)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--domains", type=int, default=16)
    ap.add_argument("--lookups", type=int, default=5_000, help="distinct prompts per case")
    args = ap.parse_args()
    rng = random.Random(1)

    chains, placed, unique = workload(args.blocks, args.workers, args.domains)
    data = payloads(placed)
    n_events = sum(len(v) for v in placed.values()) * PROMPT_BLOCKS

    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    idx = build(data)
    gc.collect()
    mem = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    del idx
    gc.collect()

    t0 = time.process_time()
    idx = build(data)
    ingest_s = time.process_time() - t0
    assert len(idx) == unique

    def rand_chain(k):
        return [rng.randbytes(16) for _ in range(k)]

    picks = [rng.choice(chains) for _ in range(args.lookups)]
    cases = {
        "full_hit_128": [{d: c} for d, c in picks],
        "partial_hit": [{d: (c[: (k := rng.randrange(1, PROMPT_BLOCKS))] + rand_chain(PROMPT_BLOCKS - k))}
                        for d, c in picks],
        "miss": [{d: rand_chain(PROMPT_BLOCKS)} for d, _ in picks[: 1000]],
        "full_hit_2_domains": [{"other": rand_chain(PROMPT_BLOCKS), d: c} for d, c in picks],
    }
    expect = idx.lookup(cases["full_hit_128"][0])
    assert expect and max(expect.values()) == 2048, expect
    lookups = {name: rate(idx.lookup, qs) for name, qs in cases.items()}

    prompts = [[rng.randrange(50_000) for _ in range(2048 + 1)] for _ in range(50)]
    hash_rate = rate(lambda t: prompt_chains(t, BS, "model", ["t"]), prompts)

    t0 = time.process_time()
    dropped = idx.remove_worker("w0")
    remove_s = time.process_time() - t0

    res = {
        "machine": machine(),
        "blocks": unique, "workers": args.workers, "domains": args.domains, "prompt_tokens": 2048,
        "bytes_per_block": round(mem / unique, 1), "index_mib": round(mem / 2**20, 1),
        "ingest_events_per_s": round(n_events / ingest_s),
        "lookups_per_cpu_s": {k: round(v[1]) for k, v in lookups.items()},
        "lookups_per_wall_s": {k: round(v[0]) for k, v in lookups.items()},
        "target_lookups_per_s": TARGET,
        "caller_prompt_hash_per_cpu_s": round(hash_rate[1]),
        "remove_worker_s": round(remove_s, 3), "remove_worker_blocks": dropped,
    }
    m = res["machine"]
    print(f"machine: {m['cpu']} ({m['cores']} cores), Python {m['python']}, load average {m['loadavg_1m']} at the end")
    print(f"index: {unique:,} blocks, {args.workers} workers, {args.domains} domains; "
          f"{res['bytes_per_block']} B/block ({res['index_mib']} MiB); "
          f"ingest {res['ingest_events_per_s']:,} events/CPU-s (msgpack decode + apply)")
    print(f"{'lookup case (2,048-token prompt)':32s} {'lookups/CPU-s':>14s} {'vs target 50k':>14s} "
          f"{'lookups/wall-s':>15s}")
    for k, (wall, cpu) in lookups.items():
        print(f"{k:32s} {cpu:14,.0f} {cpu / TARGET:13.2f}x {wall:15,.0f}")
    print(f"caller-side chain hashing of a 2,048-token prompt: {hash_rate[1]:,.0f} prompts/CPU-s "
          f"({hash_rate[1] / lookups['full_hit_128'][1]:.3f}x the full-hit lookup rate; not in the index)")
    print(f"remove_worker (sweep of {unique:,} blocks, {dropped:,} held): {remove_s:.3f} CPU-s")
    out = Path(__file__).resolve().parent / "results" / "index.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
