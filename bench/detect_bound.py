"""Auto-detection cost on the engine thread: ``detect_template`` against 32 donors, bounded.

One tenant's ``reuse: approximate`` request without a template makes the engine compare its
prompt with up to ``ApproxConfig.detect_max_candidates`` donors (issue 13). This times the
bounded matcher against the unbounded difflib loop it replaced, on worst cases of several
kinds (4,000-token prompt, 32 donors of 1,400 tokens): uniform random ids, Zipf-distributed ids
(frequent tokens, difflib's quadratic case), one repeated token, and a real template match
(the new prompt is a donor with spans changed, which must still be found).

    PYTHONPATH=. python bench/detect_bound.py [--repeat 3] [--skip-old]

Prints seconds per case (median of ``--repeat``), the speed-up, whether both found the same
donor and coverage; writes bench/results/detect_bound.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from difflib import SequenceMatcher
from pathlib import Path

import numpy as np

from policies.remap import RemapPlan, common_prefix, detect_template


def unbounded(new_ids, cached, min_run=4, min_coverage=0.5):
    """The matcher before issue 13: difflib against every candidate, whole sequences."""
    best = None
    for d, ids in enumerate(cached):
        sm = SequenceMatcher(a=list(new_ids), b=list(ids), autojunk=False)
        blocks = tuple((a, b, n) for a, b, n in sm.get_matching_blocks() if n >= min_run)
        pre = common_prefix(new_ids, ids)
        src = [None] * len(new_ids)
        for a, b, n in blocks:
            for k in range(n):
                src[a + k] = b + k
        for i in range(pre):
            src[i] = i
        cov = sum(s is not None for s in src) / max(1, len(new_ids))
        if cov >= min_coverage and (best is None or cov > best[1]):
            best = (d, cov, RemapPlan(tuple(src), pre))
    return best


def cases(rng):
    def zipf(n):
        return [int(x) for x in np.minimum(rng.zipf(1.3, n), 5000)]

    def uni(n):
        return [int(x) for x in rng.integers(0, 49152, n)]

    out = {"uniform": (uni(4000), [uni(1400) for _ in range(32)]),
           "zipf": (zipf(4000), [zipf(1400) for _ in range(32)]),
           "one token": ([7] * 4000, [[7] * 1400 for _ in range(32)])}
    donors = [uni(1400) for _ in range(32)]
    base = donors[17]
    new = base[:300] + uni(12) + base[312:900] + uni(30) + base[930:] + uni(40)
    out["template match"] = (new, donors)
    zd = [zipf(1400) for _ in range(32)]
    zb = zd[5]
    out["template match, zipf"] = (zb[:500] + zipf(10) + zb[510:] + zipf(20), zd)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--skip-old", action="store_true", help="skip the unbounded matcher (minutes on zipf)")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    rows = []
    for name, (new, donors) in cases(rng).items():
        t_new, found = [], None
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            found = detect_template(new, donors)
            t_new.append(time.perf_counter() - t0)
        row = {"case": name, "prompt_tokens": len(new), "donors": len(donors), "donor_tokens": len(donors[0]),
               "bounded_s": statistics.median(t_new),
               "bounded": None if found is None else {"donor": found.donor_index, "coverage": round(found.coverage, 4)}}
        if not args.skip_old:
            t0 = time.perf_counter()
            old = unbounded(new, donors)
            row["unbounded_s"] = time.perf_counter() - t0
            row["unbounded"] = None if old is None else {"donor": old[0], "coverage": round(old[1], 4)}
            row["speedup"] = row["unbounded_s"] / max(row["bounded_s"], 1e-9)
            row["same_donor"] = (old is None) == (found is None) and (old is None or old[0] == found.donor_index)
        rows.append(row)
        print(f"{name:22s} bounded {row['bounded_s']*1e3:8.1f} ms"
              + ("" if args.skip_old else f"   unbounded {row['unbounded_s']*1e3:9.1f} ms   x{row['speedup']:.0f}"
                 f"   same donor: {row['same_donor']}")
              + f"   found: {row['bounded']}" + ("" if args.skip_old else f" / {row['unbounded']}"), flush=True)
    out = {"machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                       "python": platform.python_version(), "note": "shared 2-core machine (other jobs running)"},
           "rows": rows}
    path = Path(__file__).parent / "results" / "detect_bound.json"
    path.write_text(json.dumps(out, indent=2))
    print("wrote", path)


if __name__ == "__main__":
    main()
