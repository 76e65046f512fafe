"""Print how kvmesh's router gave prefix groups their workers: the placement log.

The router keeps its last decisions other than "match" (``Placer.log``: place, spill, balance,
idle, each with every candidate's TTFT estimate, blocks held, prefix blocks of its pool and load);
the admin view of ``/kvmesh/workers`` shows it as ``placement_log`` and ``bench/cluster.py``
records it (``shared_prefix_router_estimates``, ``workloads.<name>.router_estimates``). This reads
either a cluster bench JSON or saved admin views (several, e.g. polled during a run: entries are
merged by time), prints one line per decision, and with ``--out`` writes the merged entries.

  python bench/placement_log.py bench/results/cluster.json [--config kvmesh]
  python bench/placement_log.py view0.json view1.json ... --out merged.json

A line: seconds since the first entry, the rule, the group (its leading blocks' key), the worker
chosen, the prompt's tokens and the prefill estimate, then per worker ``ttft/p<prefix blocks>/
l<blocks held>/q<queued tokens>`` and the pool's capacity in blocks.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def entries(doc: dict, config: str | None = None) -> list[dict]:
    """The placement-log entries in a cluster bench JSON (every kvmesh config, or ``config``) or in
    an admin view of ``/kvmesh/workers``."""
    if "placement_log" in doc:
        return list(doc["placement_log"] or [])
    out: list[dict] = []
    for name, res in (doc.get("configs") or {}).items():
        if config is not None and name != config:
            continue
        ests = [v for k, v in res.items() if k.endswith("_router_estimates")]
        ests += [w.get("router_estimates") for w in (res.get("workloads") or {}).values()]
        for est in ests:
            out += [dict(e, config=name) for e in (est or {}).get("placement_log") or []]
    return out


def merged(docs: list[dict], config: str | None = None) -> list[dict]:
    """Every entry once (logs read at different times overlap), oldest first."""
    seen = {}
    for d in docs:
        for e in entries(d, config):
            seen[(e.get("config"), e["t"], e["group"], e["kind"], e["worker"])] = e
    return sorted(seen.values(), key=lambda e: (e.get("config") or "", e["t"]))


def line(e: dict, t0: float) -> str:
    cands = " ".join(f'{w}:{c["ttft_s"]:.2f}s/p{c["prefix"]}/l{c["local"]}/q{int(c["load"])}'
                     for w, c in sorted(e["candidates"].items()))
    cap = {c["capacity"] for c in e["candidates"].values()}
    return (f'{e["t"] - t0:8.1f}s {e["kind"]:8s} {e["group"]} -> {e["worker"]}  {e["prompt_tokens"]} tok, '
            f'prefill {e["prefill_s"]:.2f}s | {cands} | pool {"/".join(map(str, sorted(cap)))}')


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--config", default=None, help="only this configuration of a cluster bench JSON")
    ap.add_argument("--out", type=Path, default=None, help="write the merged entries here")
    args = ap.parse_args(argv)
    docs = []
    for f in args.files:
        try:
            docs.append(json.loads(f.read_text()))
        except (OSError, ValueError) as e:
            print(f"skipped {f}: {e}")
    es = merged(docs, args.config)
    last, t0 = object(), 0.0
    for e in es:
        if e.get("config") != last:
            last, t0 = e.get("config"), e["t"]
            print(f"-- {last or 'admin view'}: {sum(1 for x in es if x.get('config') == last)} decisions")
        print(line(e, t0))
    if args.out:
        args.out.write_text(json.dumps({"placement_log": es}, indent=1))


if __name__ == "__main__":
    main()
