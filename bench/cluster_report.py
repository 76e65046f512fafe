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
* ``bootstrap``: how far one run's ratios move with its requests alone. A stage of 60 requests
  has its p99 set by its slowest one or two, and the ratio at equal p99 is read at the baseline's
  saturated p99. Each replicate resamples every stage's requests with replacement and recomputes
  the ratios as ``summary`` does; the interval and the share of replicates that meet a target say
  whether the run can tell a ratio from its target at all. (Runs of the same command move more
  than that: sessions 24-29's default runs read kvmesh / affinity 0.60-1.48, and session 28's
  interval was 0.51-0.95: which worker each group lands on and which group goes cold differ
  between runs, not only which requests were slow.)
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass, field, replace
from typing import Sequence

from bench.loadgen import percentile

SUSTAIN = 0.85  # a rate is sustained when >= 85% of it comes out as completed requests per second
# a sweep stage whose p99 TTFT reaches this is saturated (``extends``): 2.5x the bench's 2-s TTFT SLO
EXTEND_BELOW_P99_S = 5.0
REPLICATES = 1000  # bootstrap resamples of a run's requests
TARGETS = {"hit_tokens_vs_oracle": 0.95, "kvmesh_vs_affinity": 1.3, "kvmesh_vs_pow2": 2.0,
           "ttft_p90_affinity_over_kvmesh": 3.0}


@dataclass(frozen=True)
class Point:
    rate: float  # offered requests/s (the stage's nominal rate)
    throughput: float  # completed requests/s
    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    errors: int = 0
    offered: float | None = None  # the rate the load generator really sent at (None: ``rate``)
    # TTFT of each request of the stage in send order (None: no first token), for ``bootstrap``
    samples: tuple[float | None, ...] = field(default=(), compare=False, repr=False)

    @property
    def sustained(self) -> bool:
        """Completed >= ``SUSTAIN`` x what was really offered: inference-perf's Poisson timer
        sends a stage's requests over a random span (a 0.4 req/s stage ran at 0.28 and at 0.51),
        so the nominal rate would call a stage that got less load unsustained."""
        return self.errors == 0 and self.throughput >= SUSTAIN * (self.offered or self.rate)


def extends(top: Point, below_p99_s: float | None = None) -> bool:
    """Whether a sweep whose highest stage so far is ``top`` goes on at a higher rate: nothing
    failed and its p99 TTFT is below ``below_p99_s`` (``EXTEND_BELOW_P99_S``), i.e. it has not
    saturated. A sweep that stops short of saturation can only give ``throughput_at`` a lower
    bound; one that stops where it saturates costs no stage it did not need (pow2, whose p99
    passes 20 s at 2 req/s here, is not driven harder). Completed / offered (``sustained``) is no
    test for this: a stage's completions include the last requests' decode, so an unsaturated
    2 req/s stage (p99 1.6 s) read 0.82 of what was offered."""
    return top.errors == 0 and top.ttft_p99 < (EXTEND_BELOW_P99_S if below_p99_s is None else below_p99_s)


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


def issue_ratios(curves: dict[str, list[Point]]) -> dict:
    """The issue's ratios over ``curves``: throughput at equal p99 TTFT against affinity and pow2
    (``equal_p99_ratio``'s detail each) and the TTFT p90 ratios at the highest common rate."""
    out: dict = {"equal_p99": {f"kvmesh_vs_{base}": equal_p99_ratio(curves["kvmesh"], curves[base])
                               for base in ("affinity", "pow2") if "kvmesh" in curves and base in curves}}
    rate, common = highest_common_rate({c: v for c, v in curves.items() if c in ("pow2", "affinity", "kvmesh")})
    out["ttft_p90_rate"] = {"rate": rate, "all_sustained": common}
    at = {c: at_rate(curves.get(c, []), rate) if rate is not None else None for c in ("kvmesh", "affinity", "pow2")}
    k = at["kvmesh"]
    for base in ("affinity", "pow2"):
        b = at[base]
        out[f"ttft_p90_{base}_over_kvmesh"] = b.ttft_p90 / k.ttft_p90 if k and b and k.ttft_p90 else None
    return out


def resampled(p: Point, picks: Sequence[int]) -> Point:
    """``p`` with its TTFT percentiles over the requests at ``picks`` (indices into ``p.samples``,
    repeats allowed): one bootstrap replicate of the stage. Its throughput stays as measured: the
    offered load was the same for every configuration (seeded arrivals) and what moves a ratio
    is the tail."""
    xs = [x for x in (p.samples[i] for i in picks) if x is not None]
    if not xs:
        return p
    return replace(p, ttft_p50=percentile(xs, 50), ttft_p90=percentile(xs, 90), ttft_p99=percentile(xs, 99))


def bootstrap(curves: dict[str, list[Point]], replicates: int = REPLICATES, seed: int = 0) -> dict:
    """Per ratio of ``issue_ratios`` (and its target in ``TARGETS``): the 5th, 50th and 95th percentile
    over ``replicates`` resamples of the run's requests, the share of replicates at or above the
    target, the share that are lower bounds (kvmesh's resampled curve never reached the
    baseline's p99) and the share without a value. A stage is resampled with the same request
    indices for every configuration where their stages sent as many requests (with seeded
    arrivals, the same prompts at the same times), otherwise each on its own. Empty when a curve
    has a stage without samples (a run written before they were kept)."""
    if not curves or any(not p.samples for c in curves.values() for p in c):
        return {}
    rng = random.Random(seed)
    sizes: dict[float, set[int]] = {}
    for c in curves.values():
        for p in c:
            sizes.setdefault(p.rate, set()).add(len(p.samples))
    paired = {r: next(iter(ns)) for r, ns in sorted(sizes.items()) if len(ns) == 1}  # rate -> requests
    vals: dict[str, list[float]] = {k: [] for k in TARGETS if k != "hit_tokens_vs_oracle"}
    lower = dict.fromkeys(vals, 0)
    for _ in range(replicates):
        picks = {r: [rng.randrange(n) for _ in range(n)] for r, n in paired.items()}
        rc = {name: [resampled(p, picks.get(p.rate) or [rng.randrange(len(p.samples)) for _ in p.samples])
                     for p in c] for name, c in curves.items()}
        rs = issue_ratios(rc)
        for key in vals:
            eq = rs["equal_p99"].get(key)
            v = eq["ratio"] if eq is not None else rs.get(key)
            if v is not None:
                vals[key].append(v)
            lower[key] += bool(eq and eq.get("lower_bound"))
    out: dict = {"replicates": replicates, "paired_stages": len(paired)}
    for key, xs in vals.items():
        if not xs:
            continue
        out[key] = {"p05": percentile(xs, 5), "p50": percentile(xs, 50), "p95": percentile(xs, 95),
                    "met_share": sum(x >= TARGETS[key] for x in xs) / replicates,
                    "lower_bound_share": lower[key] / replicates, "none_share": 1 - len(xs) / replicates}
    return out


def summary(curves: dict[str, list[Point]], hits: dict[str, float], oracle_hits: float) -> dict:
    """The ``summary`` block of ``cluster.json`` for the shared-prefix workload."""
    out: dict = {"hit_tokens_vs_oracle": {c: (h / oracle_hits if oracle_hits else None) for c, h in hits.items()}}
    out["hit_tokens_vs_oracle"]["oracle"] = 1.0
    rs = issue_ratios(curves)
    out["throughput_at_equal_p99_ttft"] = {k: v["ratio"] for k, v in rs["equal_p99"].items()}
    out["throughput_at_equal_p99_ttft_detail"] = rs["equal_p99"]
    out["ttft_p90_rate"] = rs["ttft_p90_rate"]
    out["ttft_p90_affinity_over_kvmesh"] = rs["ttft_p90_affinity_over_kvmesh"]
    out["ttft_p90_pow2_over_kvmesh"] = rs["ttft_p90_pow2_over_kvmesh"]
    boot = bootstrap(curves)
    if boot:
        out["bootstrap"] = boot
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


def targets(s: dict) -> dict:
    """Each target of issue 11 with its measured value and whether it is met."""
    vals = {"hit_tokens_vs_oracle": s["hit_tokens_vs_oracle"].get("kvmesh"),
            "kvmesh_vs_affinity": s["throughput_at_equal_p99_ttft"].get("kvmesh_vs_affinity"),
            "kvmesh_vs_pow2": s["throughput_at_equal_p99_ttft"].get("kvmesh_vs_pow2"),
            "ttft_p90_affinity_over_kvmesh": s.get("ttft_p90_affinity_over_kvmesh")}
    out = {k: {"value": v, "target": TARGETS[k], "met": v is not None and v >= TARGETS[k]} for k, v in vals.items()}
    for k, b in (s.get("bootstrap") or {}).items():
        if k in out:
            out[k].update(interval_90=[b["p05"], b["p95"]], met_share=b["met_share"])
    return out


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
