"""One tenant's costly ``response_format`` schema against another tenant's stream, two code trees.

xgrammar's compile time is not bounded by a schema's size (a 98 KB schema of 2,000 optional
string properties took 204 CPU-seconds with the default model's tokenizer). Until session 43 the
engine compiled on its engine thread, between two steps, so no request on that worker got a
token until the compile ended. Now a child process compiles the schema first within a CPU budget
(``grammar_compile_cpu_s``, default 10; past it the request is refused) and the worker then
compiles it on a thread of its own at low priority: the engine thread keeps stepping.

Per arm (one process per code tree, the same workload; default model, one torch thread, pinned
to ``--cpus`` cores as a worker with that many CPUs; the compile child inherits the pinning):

* a victim request streams ``--victim-tokens`` tokens (``ignore_eos``, greedy);
* after its 10th token an attacker sends one request whose schema has ``--optional`` optional
  string properties (``--optional 0``: none, a plain request), and waits for its answer;
* reported: the victim's inter-token gaps before the attack (its step time), the longest gap
  and its tokens per second while the attacker's request was in flight, the attacker's outcome
  and latency, and the victim's whole stream time.

Run:  .venv/bin/python bench/grammar_stall.py --before /path/to/old/tree   (about 3 min)
Writes bench/results/grammar_stall.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
sys.path.insert(0, str(ROOT))
from bench import tree_arms  # noqa: E402


def optional_schema(n: int) -> dict:
    return {"type": "object", "properties": {f"field_{i}_{'x' * (i % 7)}": {"type": "string", "maxLength": 20}
                                             for i in range(n)}}


async def measure(args) -> dict:
    """One code tree (the one on ``sys.path``)."""
    import torch

    from engine.async_engine import AsyncEngine
    from engine.llm_engine import EngineConfig
    from engine.model_loader import load_model
    from engine.sequence import GrammarSpec, InvalidRequest, Request, SamplingParams

    torch.set_num_threads(1)
    eng = AsyncEngine(EngineConfig(model=args.model, kv_cache_bytes=args.kv_mb << 20), loaded=load_model(args.model))
    try:
        prompt = tuple(eng.engine.encode("Write a long story about a lighthouse keeper and the sea."))

        async def drain(req):
            return [o async for o in eng.generate(req)]

        # warm-up: the grammar compiler's tokenizer info (and, in the new tree, its child process)
        await drain(Request("warm", prompt, SamplingParams(max_tokens=2, grammar=GrammarSpec("json_object"))))
        times: list[float] = []

        async def victim():
            async for out in eng.generate(Request("victim", prompt, SamplingParams(
                    max_tokens=args.victim_tokens, ignore_eos=True, temperature=0.0), tenant="victim")):
                times.extend([time.perf_counter()] * len(out.new_token_ids))

        v0 = time.perf_counter()
        task = asyncio.create_task(victim())
        while len(times) < 10:
            await asyncio.sleep(0.005)
        spec = GrammarSpec("json_schema", json.dumps(optional_schema(args.optional))) if args.optional else None
        a0 = time.perf_counter()
        try:
            outs = await drain(Request("attack", prompt, SamplingParams(max_tokens=4, grammar=spec), tenant="attacker"))
            outcome = "served" if outs and outs[-1].error is None else f"failed: {outs[-1].error if outs else '?'}"
        except InvalidRequest as e:
            outcome = f"refused: {e}"
        a1 = time.perf_counter()
        await task
        v1 = time.perf_counter()
        gaps = [(t, t - s) for s, t in zip(times, times[1:]) if t > s]  # one entry per step
        before = [g for t, g in gaps if t < a0]
        during = [g for t, g in gaps if a0 <= t <= a1]
        # the gap that spans the attack's start ends inside it or after it: the longest gap ending after a0
        spanning = [g for t, g in gaps if t >= a0 and t - g <= a1]
        return {"attacker_latency_s": a1 - a0, "attacker_outcome": outcome[:200],
                "victim_step_s_before_median": statistics.median(before) if before else None,
                "victim_longest_gap_during_s": max(spanning) if spanning else None,
                "victim_tokens_during": sum(1 for t in times if a0 <= t <= a1),
                "victim_tokens_per_s_during": sum(1 for t in times if a0 <= t <= a1) / max(a1 - a0, 1e-9),
                "victim_steps_during": len(during), "victim_stream_s": v1 - v0, "victim_tokens": len(times)}
    finally:
        eng.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    tree_arms.add_arguments(ap)
    ap.add_argument("--model", default="default")
    ap.add_argument("--kv-mb", type=int, default=256)
    ap.add_argument("--optional", type=int, default=700, help="optional properties in the attacker's schema")
    ap.add_argument("--victim-tokens", type=int, default=300)
    ap.add_argument("--cpus", type=int, default=1, help="cores each arm is pinned to (0: no pinning)")
    ap.add_argument("--out", default=str(RESULTS / "grammar_stall.json"))
    args = ap.parse_args()
    if args.arm:
        tree_arms.enter_arm()
        if args.cpus:
            os.sched_setaffinity(0, set(sorted(os.sched_getaffinity(0))[:args.cpus]))
        tree_arms.print_result(asyncio.run(measure(args)))
        return
    out = {"bench": "grammar_stall", "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                                                "processor": platform.processor() or platform.machine()},
           "args": {k: v for k, v in vars(args).items() if k != "arm"},
           "arms": tree_arms.run_arms(__file__, args, env={"HF_HUB_OFFLINE": "1"}, timeout=1800)}
    print(f"attacker: one request with {args.optional} optional string properties; victim: {args.victim_tokens} "
          f"tokens; {args.cpus or 'all'} core(s) per arm")
    for name, r in out["arms"].items():
        print(f"{name:>7}: victim step {r['victim_step_s_before_median']:.3f} s before the attack, longest gap "
              f"{r['victim_longest_gap_during_s']:.2f} s and {r['victim_tokens_per_s_during']:.2f} tokens/s while the "
              f"attacker waited {r['attacker_latency_s']:.1f} s ({r['attacker_outcome'][:90]}); victim stream "
              f"{r['victim_stream_s']:.1f} s")
    if "before" in out["arms"]:
        b, a = out["arms"]["before"], out["arms"]["after"]
        out["longest_gap_before_over_after"] = b["victim_longest_gap_during_s"] / a["victim_longest_gap_during_s"]
        out["victim_stream_before_over_after"] = b["victim_stream_s"] / a["victim_stream_s"]
        print(f"victim's longest gap before / after: {out['longest_gap_before_over_after']:.1f}x; its whole stream "
              f"{out['victim_stream_before_over_after']:.2f}x; {os.cpu_count()} cores here ({platform.machine()})")
    tree_arms.write(out, args.out)


if __name__ == "__main__":
    main()
