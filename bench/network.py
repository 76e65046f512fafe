"""Raw object-store bandwidth over shaped links, and what the router's link model learns from it.

Builds a ``bench.netlab`` lab (Ray head + driver in the root namespace, one Ray node behind a
100 Mbit/s link and one behind a 1 Gbit/s link), then for each link:
  * probes: round trips of a no-op actor call on the remote node (-> RTT samples);
  * transfers (after one unrecorded 1 MB warm-up fetch): a task on the remote node makes a numpy array; once it is sealed there, the driver
    times ``ray.get`` of it (bytes / seconds = raw bandwidth of that transfer);
  * feeds every probe and transfer to ``policies.routing.LinkModel`` exactly as workers report
    them to the router, and compares the learned EWMA bandwidth with the raw figures;
  * asks ``CostModel`` where a 2048-token SmolLM2 prompt cached behind that link would go when its
    holder is busy (pull over the fast link, recompute over the slow one is the expected outcome).

Run as root:  nice -n 5 .venv/bin/python bench/network.py [--sizes-mb 8 32] [--reps 3]
Writes bench/results/network.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.netlab import LinkSpec, leftovers, netlab  # noqa: E402  (sets RAY_AUTH_MODE before ray)

import numpy as np  # noqa: E402
import ray  # noqa: E402

from policies.routing import CostConfig, CostModel, LinkModel, PrefillPrior, WorkerLoad  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "network.json"


@ray.remote(num_cpus=0)
def make_array(nbytes: int) -> np.ndarray:
    return np.random.default_rng(nbytes).integers(0, 255, nbytes, dtype=np.uint8)


@ray.remote(num_cpus=0)
class Pinger:
    def ping(self) -> int:
        return 0


def measure_link(lab, name: str, sizes_mb: list[int], reps: int, links: LinkModel) -> dict:
    node = lab.nodes[name]
    where = {"resources": {node.resource: 0.001}}
    pinger = Pinger.options(**where).remote()
    ray.get(pinger.ping.remote())
    rtts = []
    for _ in range(20):
        t = time.perf_counter()
        ray.get(pinger.ping.remote())
        rtts.append(time.perf_counter() - t)
        links.observe_rtt(name, "head", rtts[-1])
    warm = make_array.options(**where).remote(1 << 20)  # first fetch from a node opens its connection
    ray.wait([warm], fetch_local=False)
    ray.get(warm)
    transfers = []
    for rep in range(reps):
        for mb in sizes_mb:
            nbytes = mb << 20
            ref = make_array.options(**where).remote(nbytes)
            ray.wait([ref], fetch_local=False)
            t = time.perf_counter()
            arr = ray.get(ref)
            dt = time.perf_counter() - t
            assert arr.nbytes == nbytes
            del arr, ref
            links.observe_transfer(name, "head", nbytes, dt)
            transfers.append({"bytes": nbytes, "seconds": dt, "MBps": nbytes / dt / 1e6})
            print(f"  {name:5s} {mb:4d} MB  {dt:7.3f} s  {nbytes / dt / 1e6:8.2f} MB/s", flush=True)
    ray.kill(pinger)
    est = links.estimate(name, "head")
    raw_total = sum(t["bytes"] for t in transfers) / sum(t["seconds"] for t in transfers)
    return {
        "rate_mbit": node.rate_mbit, "link_Bps": node.rate_mbit * 1e6 / 8,
        "rtt_probe_s": {"median": statistics.median(rtts), "min": min(rtts)},
        "transfers": transfers,
        "raw_Bps": raw_total,
        "raw_vs_link": raw_total / (node.rate_mbit * 1e6 / 8),
        "learned_Bps": est.bandwidth_Bps, "learned_rtt_s": est.rtt_s,
        "learned_vs_raw": est.bandwidth_Bps / raw_total,
    }


def decisions(links: LinkModel, names: list[str], prefill_s_per_1k: float) -> dict:
    """Where would a 2048-token prompt go if its only holder sits behind each link and is busy?
    Prefill speed is assumed (``prefill_s_per_1k``), not measured here; KV is SmolLM2-135M's."""
    out = {}
    for name in names:
        cm = CostModel(CostConfig(prefill_prior=PrefillPrior(a=0.02, b=prefill_s_per_1k, c=0.05)))
        cm.links = links
        cm.register("holder", name)
        cm.register("idle", "head")
        cm.observe_load("holder", WorkerLoad(extra_wait_s=5.0))
        d = cm.decide(2048, {"holder": 2048})
        out[name] = {"kind": d.kind, "worker": d.worker, "expected_ttft_s": d.chosen.expected_ttft_s,
                     "options": [{"worker": c.worker, "kind": c.kind, "ttft_s": c.expected_ttft_s}
                                 for c in cm.candidates(2048, {"holder": 2048})]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes-mb", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--slow-mbit", type=float, default=100)
    ap.add_argument("--fast-mbit", type=float, default=1000)
    ap.add_argument("--prefill-s-per-1k", type=float, default=1.0, help="assumed, for the decisions")
    args = ap.parse_args()
    specs = [LinkSpec("slow", args.slow_mbit), LinkSpec("fast", args.fast_mbit)]
    t0 = time.time()
    links = LinkModel()
    with netlab(specs) as lab:
        boot_s = time.time() - t0
        print(f"lab up in {boot_s:.1f}s: " + ", ".join(f"{n.name}={n.ip}@{n.rate_mbit:g}Mbit"
                                                        for n in lab.nodes.values()), flush=True)
        per_link = {s.name: measure_link(lab, s.name, args.sizes_mb, args.reps, links) for s in specs}
    left = leftovers()
    result = {
        "machine": {"cpus": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version(),
                    "ray": ray.__version__},
        "args": vars(args), "boot_s": boot_s, "links": per_link, "decisions": decisions(links, list(per_link), args.prefill_s_per_1k),
        "leftover_namespaces_and_links": left,
    }
    print("\nlink   tbf MB/s   raw ray.get MB/s (x link)   learned EWMA MB/s (x raw)   probe RTT ms   decision")
    for name, r in per_link.items():
        print(f"{name:5s} {r['link_Bps'] / 1e6:9.1f}   {r['raw_Bps'] / 1e6:10.2f} ({r['raw_vs_link']:.2f}x)"
              f"        {r['learned_Bps'] / 1e6:10.2f} ({r['learned_vs_raw']:.2f}x)"
              f"         {r['rtt_probe_s']['median'] * 1e3:6.2f}     {result['decisions'][name]['kind']}")
    print(f"left over: {left}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
