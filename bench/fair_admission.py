"""Head-of-line blocking and guaranteed minimums on the shipped pool size (issue 13).

The shipped config (cluster/serve.yaml: 256 MiB of KV for SmolLM2-135M) gives a worker 364
blocks of 16 tokens; cluster/tenants.yaml guarantees acme 64 of them. Scheduling does not
depend on the weights, so this drives the engine with a random 2-layer model with an 8k context
on CPU (the step counts are what the real model would see; the wall times are not). Scenario:

1. acme caches 68 blocks (a 1,100-token prompt, finished): its guarantee is held.
2. globex sends a long prompt (4,700 tokens: 294 blocks + 1 for its outputs), demo then sends
   8 short requests (100 tokens, 8 outputs each) while an acme request is decoding (holds
   blocks), so the long prompt does not fit yet.
   Reported: steps until each short request's first token, until the long one's.
3. globex sends a 5,000-token prompt on the idle pool (needs 314 blocks; 300 are globex's share).
   Reported: whether it was refused, and acme's cached blocks afterwards (64 guaranteed).

Run against a tree on PYTHONPATH (to compare, once with a checkout of main, once with this
branch) and label the output:

    git archive main | tar -x -C /tmp/main && cp bench/fair_admission.py /tmp/main/bench/
    python /tmp/main/bench/fair_admission.py --label before && cp /tmp/main/bench/results/fair_admission_before.json bench/results/
    python bench/fair_admission.py --label after && python bench/fair_admission.py --compare

Writes bench/results/fair_admission_<label>.json; --compare prints both side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tree under test, before bench/
RESULTS = Path(__file__).resolve().parent / "results"


def run(label: str) -> dict:
    from engine.llm_engine import EngineConfig, LLMEngine
    from engine.model_loader import tiny_llama
    from engine.sequence import InvalidRequest, Request, SamplingParams
    from policies.eviction import TenantQuota

    loaded = tiny_llama(max_positions=8192)
    eng = LLMEngine(EngineConfig(model="tiny-llama", num_blocks=364, max_num_batched_tokens=512,
                                 tenant_quotas={"acme": TenantQuota(priority=1, min_blocks=64)}, approx=None), loaded)

    def req(rid, n, max_tokens, tenant, first):
        ids = tuple((first * 7 + i) % 250 + 3 for i in range(n))
        return Request(rid, ids, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), tenant=tenant)

    step = {"n": 0}
    first_token: dict[str, int] = {}

    def drive(until=None):
        while eng.has_unfinished():
            for o in eng.step():
                if o.num_output_tokens == 1:
                    first_token.setdefault(o.request_id, step["n"])
            step["n"] += 1
            if until is not None and until():
                return

    eng.add_request(req("acme-cache", 1100, 1, "acme", 1))
    drive()
    held_before = eng.pool.eviction.held.get("acme", 0)
    t0 = time.perf_counter()
    eng.add_request(req("acme-decode", 200, 120, "acme", 2))  # holds blocks while the rest arrives
    drive(until=lambda: "acme-decode" in first_token)
    start = step["n"]
    eng.add_request(req("globex-long", 4700, 16, "globex", 3))
    for i in range(8):
        eng.add_request(req(f"demo-{i}", 100, 8, "demo", 10 + i))
    drive()
    wall = time.perf_counter() - t0
    short = [first_token[f"demo-{i}"] - start for i in range(8)]
    long_steps = first_token["globex-long"] - start
    evicted_before = eng.pool.stats["acme"].evictions if "acme" in eng.pool.stats else 0
    refused, msg = False, None
    try:
        eng.add_request(req("globex-5000", 5000, 16, "globex", 4))
    except InvalidRequest as e:
        refused, msg = True, str(e)
    drive()
    return {
        "label": label, "num_blocks": 364, "block_size": 16, "acme_min_blocks": 64,
        "acme_blocks_cached_at_start": held_before,
        "short_first_token_steps": short, "short_first_token_steps_max": max(short),
        "long_first_token_steps": long_steps, "steps_total": step["n"] - start, "wall_s": wall,
        "bypasses": getattr(eng.scheduler, "num_bypasses", None),
        "acme_evictions_during_load": evicted_before,
        "globex_5000_refused": refused, "refusal": msg,
        "acme_blocks_cached_at_end": eng.pool.eviction.held.get("acme", 0),
        "acme_evictions_total": eng.pool.stats["acme"].evictions if "acme" in eng.pool.stats else 0,
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "note": "shared, loaded 2-core machine; step counts are exact, wall times noisy"},
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", default="after")
    ap.add_argument("--compare", action="store_true")
    args = ap.parse_args()
    if args.compare:
        rows = {p.stem.split("_")[-1]: json.loads(p.read_text()) for p in sorted(RESULTS.glob("fair_admission_*.json"))}
        keys = ["short_first_token_steps_max", "long_first_token_steps", "steps_total", "bypasses",
                "acme_evictions_total", "acme_blocks_cached_at_end", "globex_5000_refused", "wall_s"]
        for k in keys:
            print(f"{k:32s} " + "  ".join(f"{lab}: {r.get(k)}" for lab, r in rows.items()))
        return
    out = run(args.label)
    for k, v in out.items():
        if k != "machine":
            print(f"{k:32s} {v}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"fair_admission_{args.label}.json").write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
