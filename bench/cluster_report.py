"""The figures of ``bench/cluster.py``: curves, throughput at equal p99 TTFT, the summary, the PNG.

Pure (plotting aside), tested in ``tests/test_cluster_bench.py``. A *curve* is one configuration's
rate sweep: ``Point``s in the order the rates were offered.

* ``throughput_at(curve, y)``: the request throughput at which the curve's p99 TTFT reaches
  ``y``, linearly interpolated between the two sweep points around the first crossing; a curve
  whose p99 stays below ``y`` gives its highest throughput, marked as a lower bound; one already
  above ``y`` at its first point gives ``None``.
* ``equal_p99_ratio(a, b)``: ``throughput_at(a, y) / throughput_at(b, y)`` at ``y`` = ``b``'s
  p99 at ``b``'s highest-throughput point (where the baseline saturates), so the ratio says how
  much more load ``a`` carries at the latency the baseline has when it is fully loaded.
* ``highest_common_rate``: the highest offered rate every configuration sustains (request
  throughput >= ``SUSTAIN`` x the rate really offered, no errors); TTFT p90 ratios are taken there.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace

SUSTAIN = 0.85  # a rate is sustained when >= 85% of it comes out as completed requests per second


@dataclass(frozen=True)
class Point:
    rate: float  # offered requests/s (the stage's nominal rate)
    throughput: float  # completed requests/s
    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    errors: int = 0
    offered: float | None = None  # the rate the load generator really sent at (None: ``rate``)

    @property
    def sustained(self) -> bool:
        """Completed >= ``SUSTAIN`` x what was really offered: inference-perf's Poisson timer
        sends a stage's requests over a random span (a 0.4 req/s stage ran at 0.28 and at 0.51),
        so the nominal rate would call a stage that got less load unsustained."""
        return self.errors == 0 and self.throughput >= SUSTAIN * (self.offered or self.rate)


@dataclass(frozen=True)
class AtLatency:
    throughput: float | None
    lower_bound: bool  # the curve never reached the latency: its highest throughput


def monotone(curve: list[Point]) -> list[Point]:
    """The curve in offered-rate order with each p99 raised to the highest p99 at any lower rate:
    more load never lowers the tail, so a lower p99 at a higher rate is noise (a short stage).
    Without it a noisy curve can start above its own saturated p99 and read as never reaching it."""
    out: list[Point] = []
    for p in sorted(curve, key=lambda p: p.rate):
        out.append(replace(p, ttft_p99=max(p.ttft_p99, out[-1].ttft_p99)) if out else p)
    return out


def throughput_at(curve: list[Point], y: float) -> AtLatency:
    """Throughput at p99 TTFT ``y``, interpolated on the monotone curve (``monotone``)."""
    curve = monotone(curve)
    if not curve:
        return AtLatency(None, False)
    if curve[0].ttft_p99 > y:
        return AtLatency(None, False)
    for a, b in zip(curve, curve[1:]):
        if a.ttft_p99 <= y < b.ttft_p99:
            f = (y - a.ttft_p99) / (b.ttft_p99 - a.ttft_p99)
            return AtLatency(a.throughput + f * (b.throughput - a.throughput), False)
    best = max(p.throughput for p in curve)
    return AtLatency(best, True)


def equal_p99_ratio(a: list[Point], b: list[Point]) -> dict:
    """``a``'s throughput over ``b``'s at ``b``'s saturated p99 TTFT (see the module docstring)."""
    if not a or not b:
        return {"ratio": None, "p99_ttft_s": None}
    ref = max(monotone(b), key=lambda p: p.throughput)
    y = ref.ttft_p99
    ta, tb = throughput_at(a, y), throughput_at(b, y)
    ratio = ta.throughput / tb.throughput if ta.throughput and tb.throughput else None
    return {"ratio": ratio, "p99_ttft_s": y, "throughput": ta.throughput, "baseline_throughput": tb.throughput,
            "lower_bound": ta.lower_bound}


def highest_common_rate(curves: dict[str, list[Point]]) -> tuple[float | None, bool]:
    """(rate, True) for the highest offered rate all curves sustain; (lowest rate, False) if none."""
    rates = sorted({p.rate for c in curves.values() for p in c})
    ok = [r for r in rates if all(any(p.rate == r and p.sustained for p in c) for c in curves.values())]
    if ok:
        return ok[-1], True
    return (rates[0] if rates else None), False


def at_rate(curve: list[Point], rate: float) -> Point | None:
    return next((p for p in curve if p.rate == rate), None)


def summary(curves: dict[str, list[Point]], hits: dict[str, float], oracle_hits: float) -> dict:
    """The ``summary`` block of ``cluster.json`` for the shared-prefix workload."""
    out: dict = {"hit_tokens_vs_oracle": {c: (h / oracle_hits if oracle_hits else None) for c, h in hits.items()}}
    out["hit_tokens_vs_oracle"]["oracle"] = 1.0
    eq = {}
    for base in ("affinity", "pow2"):
        if "kvmesh" in curves and base in curves:
            eq[f"kvmesh_vs_{base}"] = equal_p99_ratio(curves["kvmesh"], curves[base])
    out["throughput_at_equal_p99_ttft"] = {k: v["ratio"] for k, v in eq.items()}
    out["throughput_at_equal_p99_ttft_detail"] = eq
    rate, common = highest_common_rate({c: v for c, v in curves.items() if c in ("pow2", "affinity", "kvmesh")})
    out["ttft_p90_rate"] = {"rate": rate, "all_sustained": common}
    ka = at_rate(curves.get("kvmesh", []), rate) if rate is not None else None
    aa = at_rate(curves.get("affinity", []), rate) if rate is not None else None
    pa = at_rate(curves.get("pow2", []), rate) if rate is not None else None
    out["ttft_p90_affinity_over_kvmesh"] = aa.ttft_p90 / ka.ttft_p90 if ka and aa and ka.ttft_p90 else None
    out["ttft_p90_pow2_over_kvmesh"] = pa.ttft_p90 / ka.ttft_p90 if ka and pa and ka.ttft_p90 else None
    return out


def host_speed(stage_steps: dict[str, list[float | None]]) -> dict[str, float | None]:
    """Per configuration: the median over its stages of ``decode_1row_s`` (``bench/steps.py``, the
    forward time of a one-row decode step: the same work for every configuration), i.e. how fast
    the hosts were while that configuration ran; None without step traces."""
    return {name: statistics.median(xs) if (xs := [v for v in vals if v]) else None
            for name, vals in stage_steps.items()}


def speed_adjusted(ratios: dict[str, float | None], speed: dict[str, float | None]) -> dict[str, float | None]:
    """``kvmesh_vs_<base>`` ratios as if both configurations had met the same hosts' speed: each
    ratio x (kvmesh's one-row decode step / the baseline's). An estimate beside the measured ratio
    (a compute-bound throughput scales with the hosts' speed), not a replacement for it: a
    configuration whose own overhead slowed its steps would be credited for it."""
    out: dict[str, float | None] = {}
    for key, r in ratios.items():
        base = key.removeprefix("kvmesh_vs_")
        k, b = speed.get("kvmesh"), speed.get(base)
        out[key] = r * k / b if r is not None and k and b else None
    return out


TARGETS = {"hit_tokens_vs_oracle": 0.95, "kvmesh_vs_affinity": 1.3, "kvmesh_vs_pow2": 2.0,
           "ttft_p90_affinity_over_kvmesh": 3.0}


def targets(s: dict) -> dict:
    """Each target of issue 11 with its measured value and whether it is met."""
    vals = {"hit_tokens_vs_oracle": s["hit_tokens_vs_oracle"].get("kvmesh"),
            "kvmesh_vs_affinity": s["throughput_at_equal_p99_ttft"].get("kvmesh_vs_affinity"),
            "kvmesh_vs_pow2": s["throughput_at_equal_p99_ttft"].get("kvmesh_vs_pow2"),
            "ttft_p90_affinity_over_kvmesh": s.get("ttft_p90_affinity_over_kvmesh")}
    return {k: {"value": v, "target": TARGETS[k], "met": v is not None and v >= TARGETS[k]} for k, v in vals.items()}


def plot(curves: dict[str, list[Point]], hit_ratios: dict[str, dict[str, float | None]], path) -> None:
    """Left: p99 and p90 TTFT vs request throughput per configuration (shared prefix); right:
    cluster hit tokens vs the oracle per workload and configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.8))
    configs = sorted({c for w in hit_ratios.values() for c in w} | {n.split(" (")[0] for n in curves})
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    color = {c: palette[i % len(palette)] for i, c in enumerate(configs)}  # one colour per configuration, both panels
    for name, c in curves.items():
        if not c:
            continue
        col = color[name.split(" (")[0]]
        style = ":" if name.endswith("(hot)") else "-"
        ax.plot([p.throughput for p in c], [p.ttft_p99 for p in c], "o" + style, color=col, label=f"{name} p99")
        ax.plot([p.throughput for p in c], [p.ttft_p90 for p in c], "s--", color=col, alpha=0.6,
                label=f"{name} p90")
    ax.set_xlabel("completed requests/s")
    ax.set_ylabel("TTFT (s)")
    ax.set_yscale("log")
    ax.set_title("shared prefix (inference-perf): TTFT vs throughput")
    ax.legend(fontsize=7)
    workloads = list(hit_ratios)
    configs = [c for c in configs if any(c in w for w in hit_ratios.values())]
    width = 0.8 / max(1, len(configs))
    for i, c in enumerate(configs):
        xs = [j + i * width for j in range(len(workloads))]
        bx.bar(xs, [hit_ratios[w].get(c) or 0.0 for w in workloads], width, label=c, color=color[c])
    bx.axhline(0.95, color="k", lw=0.8, ls=":")
    bx.set_xticks([j + 0.4 - width / 2 for j in range(len(workloads))], workloads, fontsize=8)
    bx.set_ylabel("cluster hit tokens / oracle")
    bx.set_title("prefix reuse vs one infinite cache")
    bx.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
