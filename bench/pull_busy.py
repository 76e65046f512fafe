"""A pull from a busy holder: how long it takes, before and after exports left the engine thread.

A pull's holder is usually busy: that is why the router sends the prompt elsewhere and pulls its
prefix. Until session 8 the holder exported on its engine thread, so every chunk waited for the
step in progress, and the target asked its own engine thread three times before the transfer and
once per chunk after. This bench measures that path on this machine, for two code trees side by
side in one run (each in its own process, the same workload):

* two workers (default model, one torch thread each) on one Ray node on loopback;
* the holder caches ``--prefixes`` distinct prefixes of ``--prefix-len`` tokens, then serves a
  steady load (``--busy`` concurrent streams of fresh ``--busy-len``-token prompts with
  ``--busy-tokens`` output tokens each, restarted as they end);
* each trial the target gets a ``max_tokens=1`` request on one of those prefixes plus 8 fresh
  tokens, with a pull of the whole prefix from the holder; its TTFT is the wall time of that
  call (the request is computed on the idle target); one recompute of the same shape is timed
  per trial as the reference.

Run:  .venv/bin/python bench/pull_busy.py --before /path/to/old/tree   (about 3 min)
Writes bench/results/pull_busy.json.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
sys.path.insert(0, str(ROOT))
from bench import tree_arms  # noqa: E402


def measure(args) -> dict:
    """One code tree (the one on ``sys.path``): pull and recompute TTFT under a busy holder."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    from actors.worker import Pull, worker_actor_class
    from engine.llm_engine import EngineConfig
    from engine.sequence import Request, SamplingParams

    rng = random.Random(args.seed)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        W = worker_actor_class(num_gpus=0, num_cpus=0)
        cfg = EngineConfig(model=args.model, kv_cache_bytes=args.kv_mb << 20, num_threads=1, approx=None)
        holder, target = W.remote("holder", cfg), W.remote("target", cfg)
        info = ray.get([holder.ready.remote(), target.ready.remote()])
        bs, vocab = info[0]["block_size"], info[0]["vocab_size"]

        def fresh(n: int) -> tuple[int, ...]:
            return tuple(rng.randrange(100, vocab - 100) for _ in range(n))

        one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        prefixes = [fresh(args.prefix_len) for _ in range(args.prefixes)]
        ray.get([holder.generate_all.remote(Request(f"warm{i}", p + fresh(4), one)) for i, p in enumerate(prefixes)])
        blocks = args.prefix_len // bs

        stop = threading.Event()
        busy_done = [0]

        def busy_stream(k: int) -> None:
            j = 0
            while not stop.is_set():
                params = SamplingParams(max_tokens=args.busy_tokens, temperature=0, ignore_eos=True)
                ray.get(holder.generate_all.remote(Request(f"busy{k}-{j}", fresh(args.busy_len), params, reuse="none")))
                busy_done[0] += 1
                j += 1

        threads = [threading.Thread(target=busy_stream, args=(k,), daemon=True) for k in range(args.busy)]
        for t in threads:
            t.start()
        time.sleep(args.settle_s)
        pulls, recomputes, pulled = [], [], []
        for i, p in enumerate(prefixes[: args.trials]):
            prompt = p + fresh(8)
            t0 = time.perf_counter()
            outs = ray.get(target.generate_all.remote(Request(f"pull{i}", prompt, one),
                                                      (Pull(holder, "local", 0, blocks, timeout_s=60.0),)))
            pulls.append(time.perf_counter() - t0)
            pulled.append(outs[-1].pulled_tokens)
            t0 = time.perf_counter()
            ray.get(target.generate_all.remote(Request(f"re{i}", fresh(args.prefix_len + 8), one, reuse="none")))
            recomputes.append(time.perf_counter() - t0)
            print(f"  trial {i}: pull {pulls[-1]:.2f} s ({pulled[-1]} tokens pulled), recompute {recomputes[-1]:.2f} s",
                  flush=True)
        stop.set()
        for t in threads:
            t.join(timeout=120)
        return {"pull_ttft_s": pulls, "recompute_ttft_s": recomputes, "pulled_tokens": pulled,
                "busy_requests_served": busy_done[0],
                "pull_ttft_median_s": statistics.median(pulls),
                "recompute_ttft_median_s": statistics.median(recomputes),
                "pulls_landed_whole": sum(1 for n in pulled if n == blocks * bs)}
    finally:
        ray.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    tree_arms.add_arguments(ap)
    ap.add_argument("--model", default="default")
    ap.add_argument("--kv-mb", type=int, default=256)
    ap.add_argument("--prefix-len", type=int, default=512)
    ap.add_argument("--prefixes", type=int, default=8)
    ap.add_argument("--trials", type=int, default=8)
    ap.add_argument("--busy", type=int, default=3, help="concurrent streams on the holder")
    ap.add_argument("--busy-len", type=int, default=384)
    ap.add_argument("--busy-tokens", type=int, default=24)
    ap.add_argument("--settle-s", type=float, default=3.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(RESULTS / "pull_busy.json"))
    args = ap.parse_args()
    if args.arm:
        tree_arms.enter_arm()
        tree_arms.print_result(measure(args))
        return
    out = {"bench": "pull_busy", "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
           "args": {k: v for k, v in vars(args).items() if k != "arm"},
           "arms": tree_arms.run_arms(__file__, args, env={"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"})}
    for name, r in out["arms"].items():
        print(f"{name:>7}: pull TTFT median {r['pull_ttft_median_s']:.2f} s, recompute {r['recompute_ttft_median_s']:.2f} s, "
              f"{r['pulls_landed_whole']}/{len(r['pull_ttft_s'])} pulls whole, holder served {r['busy_requests_served']}")
    if "before" in out["arms"]:
        b, a = out["arms"]["before"], out["arms"]["after"]
        out["pull_ttft_before_over_after"] = b["pull_ttft_median_s"] / a["pull_ttft_median_s"]
        print(f"pull TTFT before / after (medians): {out['pull_ttft_before_over_after']:.2f}x "
              f"on {os.cpu_count()} cores ({platform.machine()})")
    tree_arms.write(out, args.out)


if __name__ == "__main__":
    main()
