"""Fit the Learnable remap policy on calibration prompts (issue 6).

For every task, calibration prompts (a seed disjoint from the harness's evaluation prompts) are
aligned with a donor from the harness's donor pool; the donor's KV, re-rotated to the new
positions, is compared with the prompt's own KV at every layer. A reused token's priority is the
mean over calibration of its deviation summed over layers, ||ΔK|| + ||ΔV||, keyed by
(template piece, token index within the piece). At serving time the top-r tokens by priority are
recomputed: no early-layer pass is needed to choose them (unlike CacheBlend's selector), and the
deep layers, which decide the output, drive the ranking.

    nice -n 10 .venv/bin/python bench/fit_learnable_remap.py   # ~2 min on 2 shared CPU cores
Writes bench/results/learnable_remap.json (read by bench/remap.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.remap_tasks import make_instances  # noqa: E402
from engine.manual_forward import full_prefill  # noqa: E402
from engine.model_loader import load_model  # noqa: E402
from engine.remap import gather_donor  # noqa: E402
from policies.remap import IdentityRemap, LearnableRemap, piece_keys  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def fit_task(model, tok, task: str, n_calib: int, n_donors: int) -> tuple[LearnableRemap, int]:
    donors = make_instances(tok, task, n_donors, seed=1)
    calib = make_instances(tok, task, n_calib, seed=3, uid0=500)
    donor_kv = {d.uid: full_prefill(model, list(d.token_ids))[1] for d in donors}
    sums: dict[tuple[int, int], float] = {}
    counts: dict[tuple[int, int], int] = {}
    policy = IdentityRemap()
    pairs = 0
    for inst in calib:
        ids = list(inst.token_ids)
        _, fresh = full_prefill(model, ids)
        donor = policy.choose_donor(inst, donors)
        plan = policy.plan(inst, donor)
        given = gather_donor(model, donor_kv[donor.uid], plan, torch.arange(len(ids)))
        dev = ((fresh.k - given.k).norm(dim=(-2, -1)) + (fresh.v - given.v).norm(dim=(-2, -1))).sum(0)  # [n]
        keys = piece_keys(inst)
        for i, s in enumerate(plan.src):
            if s is None or i < plan.exact_prefix:
                continue
            sums[keys[i]] = sums.get(keys[i], 0.0) + float(dev[i])
            counts[keys[i]] = counts.get(keys[i], 0) + 1
        pairs += 1
    return LearnableRemap({k: sums[k] / counts[k] for k in sums}), pairs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calib", type=int, default=6, help="calibration prompts per task")
    ap.add_argument("--donors", type=int, default=5, help="must match bench/remap.py --donors")
    ap.add_argument("--tasks", default="fewshot,translate,form")
    ap.add_argument("--out", default=str(RESULTS / "learnable_remap.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    loaded = load_model("default")
    t0 = time.perf_counter()
    out = {"model": loaded.name, "args": vars(args), "tasks": {}}
    for task in args.tasks.split(","):
        pol, pairs = fit_task(loaded.model, loaded.tokenizer, task, args.calib, args.donors)
        out["tasks"][task] = pol.to_json() | {"pairs": pairs}
        top = sorted(pol.priority.items(), key=lambda kv: -kv[1])[:5]
        print(f"[{time.perf_counter() - t0:5.0f}s] {task}: {pairs} pairs, {len(pol.priority)} keys, top {top}", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
