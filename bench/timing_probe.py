"""Prompt-cache timing side channel, after Gu et al., "Auditing Prompt Caching in Language Model
APIs" (ICML 2025), against a kvmesh app served on loopback (default model on CPU).

Per trial a victim sends a fresh random prompt once (``max_tokens`` 1); then, in each condition,
an attacker sends either a prompt sharing the victim's first 95% ("hit" arm) or a fresh random
prompt of the same length ("miss" arm), the arm drawn at random per trial and condition, the
conditions in random order; TTFT is measured at the client (first SSE token event, ``stream``,
``max_tokens`` 1). Over the trials: a one-sided two-sample KS test (H1: hit TTFTs are smaller)
and the ROC AUC of "TTFT below a threshold => hit", with a bootstrap upper bound.

Conditions (each attacker its own principal):
  control    same tenant as the victim (one tenant's users share): the channel must be found
             (KS p < 1e-6), otherwise the run is invalid (too noisy to say anything);
  no_grant   another tenant without a grant: target KS p >= 0.01 and AUC <= 0.55;
  salt       the victim's tenant, another ``cache_salt`` (the victim sends with its own salt):
             same target;
  grant      a tenant the victim's tenant granted (``share_with``): the channel exists by design.
A second set of trials shares only a 16-token prefix (one block) of a short prompt.
At the end the engine's and the index's isolation counters are read (admin key): the attackers
of no_grant and salt must have 0 tokens read from another domain.

  python bench/timing_probe.py                  # ~10 min here; --trials / --short-trials scale it
Writes bench/results/timing_probe.json. Loopback only; stops by itself (bounded trials and time).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from cluster.loopback import start_serve  # noqa: E402

CONDITIONS = ("control", "no_grant", "salt", "grant")
TENANTS = {"admin_keys": ["sk-probe-admin"], "tenants": [
    {"name": "victim", "api_keys": ["sk-victim"], "share_with": ["granted"]},
    {"name": "other", "api_keys": ["sk-other"]},
    {"name": "granted", "api_keys": ["sk-granted"]},
]}
# condition -> (victim request: key, salt), (attacker request: key, salt)
PRINCIPALS = {
    "control": (("sk-victim", None), ("sk-victim", None)),
    "no_grant": (("sk-victim", None), ("sk-other", None)),
    "salt": (("sk-victim", "user-victim"), ("sk-victim", "user-attacker")),
    "grant": (("sk-victim", None), ("sk-granted", None)),
}


def ttft(client, key: str, prompt: list[int], salt: str | None, model: str) -> float:
    """Seconds from sending the request to the first token event (client side)."""
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": True,
            "kvmesh": {"reuse": "exact"}}
    if salt is not None:
        body["cache_salt"] = salt
    t0 = time.perf_counter()
    with client.stream("POST", "/v1/completions", headers={"Authorization": f"Bearer {key}"}, json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:300]!r}")
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                t = time.perf_counter() - t0
                for _ in lines:  # drain to [DONE]
                    pass
                return t
    raise RuntimeError("the stream ended without a token")


def auc(hit: np.ndarray, miss: np.ndarray) -> float:
    """P(miss TTFT > hit TTFT) + P(tie)/2: the ROC AUC of classifying fast as hit."""
    h, m = hit[:, None], miss[None, :]
    return float((m > h).mean() + 0.5 * (m == h).mean())


def analyse(hit: list[float], miss: list[float], rng: np.random.Generator, boots: int = 2000) -> dict:
    from scipy.stats import ks_2samp

    h, m = np.asarray(hit), np.asarray(miss)
    # alternative "greater": the hit arm's CDF lies above the miss arm's (hits are faster)
    ks = ks_2samp(h, m, alternative="greater")
    a = auc(h, m)
    bs = [auc(rng.choice(h, len(h)), rng.choice(m, len(m))) for _ in range(boots)]
    return {"n_hit": len(h), "n_miss": len(m), "ks_stat": float(ks.statistic), "ks_p": float(ks.pvalue),
            "auc": a, "auc_boot_upper95": float(np.quantile(bs, 0.95)), "auc_boot_lower05": float(np.quantile(bs, 0.05)),
            "ttft_hit_median_ms": 1e3 * float(np.median(h)), "ttft_miss_median_ms": 1e3 * float(np.median(m)),
            "ttft_hit_p10_ms": 1e3 * float(np.quantile(h, 0.1)), "ttft_miss_p10_ms": 1e3 * float(np.quantile(m, 0.1))}


def balanced_arms(n_trials: int, rng: random.Random) -> list[str]:
    """``n_trials`` arms, each consecutive pair one "hit" and one "miss" in random order: a run
    that the time budget cuts short after any trial is still balanced within one trial."""
    arms: list[str] = []
    for _ in range((n_trials + 1) // 2):
        pair = ["hit", "miss"]
        rng.shuffle(pair)
        arms += pair
    return arms[:n_trials]


def run_trials(client, model: str, vocab: int, n_trials: int, length: int, shared: int, rng: random.Random,
               deadline: float, conditions: tuple[str, ...] = CONDITIONS) -> dict[str, dict[str, list[float]]]:
    """Per condition, per arm, the attacker's TTFTs."""
    out = {c: {"hit": [], "miss": []} for c in conditions}
    arms = {c: balanced_arms(n_trials, rng) for c in conditions}

    def fresh(n):
        return [rng.randrange(100, vocab - 100) for _ in range(n)]

    t0 = time.monotonic()
    for i in range(n_trials):
        if time.monotonic() > deadline:
            print(f"  time budget reached after {i} trials", flush=True)
            break
        secret = fresh(length)
        sent = set()
        conds = list(conditions)
        rng.shuffle(conds)
        for c in conds:
            (vkey, vsalt), (akey, asalt) = PRINCIPALS[c]
            if (vkey, vsalt) not in sent:  # the victim sends its prompt once per domain
                ttft(client, vkey, secret, vsalt, model)
                sent.add((vkey, vsalt))
            arm = arms[c][i]
            probe = secret[:shared] + fresh(length - shared) if arm == "hit" else fresh(length)
            out[c][arm].append(ttft(client, akey, probe, asalt, model))
        if (i + 1) % 20 == 0:
            print(f"  {i + 1}/{n_trials} trials ({time.monotonic() - t0:.0f} s)", flush=True)
    return out


def counters(client, ray) -> dict:
    from actors.index_actor import get_index

    r = client.get("/kvmesh/workers", headers={"Authorization": "Bearer sk-probe-admin"}).json()
    engine: dict[str, int] = {}
    for w in r["workers"]:
        for k, n in ((w.get("engine") or {}).get("cross_tenant_reads") or {}).items():
            engine[k] = engine.get(k, 0) + n
    index = ray.get(get_index().read_stats.remote(), timeout=30)
    return {"engine_cross_tenant_reads": engine, "index_cross_tenant_reads": index["cross_tenant_reads"],
            "index_reads": index["reads"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--trials", type=int, default=200, help="trials of the 95%% set (half per arm, random order)")
    ap.add_argument("--length", type=int, default=128, help="prompt tokens of the 95%% set")
    ap.add_argument("--share", type=float, default=0.95)
    ap.add_argument("--short-trials", type=int, default=200, help="trials of the 16-token-prefix set")
    ap.add_argument("--short-length", type=int, default=32)
    ap.add_argument("--short-shared", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--budget-s", type=float, default=600.0, help="stop starting trials after this")
    ap.add_argument("--conditions", default=",".join(CONDITIONS),
                    help="comma-separated subset of " + ",".join(CONDITIONS) + " (control is always run)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "bench/results/timing_probe.json"))
    args = ap.parse_args()
    asked = set(args.conditions.split(","))
    if asked - set(CONDITIONS):
        ap.error(f"unknown conditions {sorted(asked - set(CONDITIONS))}; choose from {CONDITIONS}")
    conditions = tuple(c for c in CONDITIONS if c == "control" or c in asked)

    import httpx
    import ray
    import yaml
    from ray import serve

    from cluster.app import build_app

    t_start = time.monotonic()
    rng = random.Random(args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="kvmesh-probe-"))
    (tmp / "tenants.yaml").write_text(yaml.safe_dump(TENANTS))
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    port = start_serve()
    try:
        serve.run(build_app({"model": args.model, "tenants": str(tmp / "tenants.yaml"),
                             "kv_cache_bytes": 512 << 20, "worker_num_cpus": 1}), name="probe", route_prefix="/")
        client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120)
        model = client.get("/v1/models", headers={"Authorization": "Bearer sk-victim"}).json()["data"][0]["id"]
        from cluster.app import load_tokenizer

        tok = load_tokenizer(args.model)[1]
        vocab = int(getattr(tok, "vocab_size", 0) or len(tok))
        print(f"serving {model} on 127.0.0.1:{port}; warm-up", flush=True)
        for _ in range(args.warmup):
            ttft(client, "sk-other", [rng.randrange(100, vocab - 100) for _ in range(args.length)], None, model)
        deadline = t_start + (0.75 if args.short_trials else 1.0) * args.budget_s
        shared = int(round(args.share * args.length))
        print(f"set 1: {args.length}-token prompts, {shared} shared, {args.trials} trials", flush=True)
        long = run_trials(client, model, vocab, args.trials, args.length, shared, rng, deadline, conditions)
        print(f"set 2: {args.short_length}-token prompts, {args.short_shared} shared, {args.short_trials} trials",
              flush=True)
        short = run_trials(client, model, vocab, args.short_trials, args.short_length, args.short_shared, rng,
                           t_start + args.budget_s, conditions)
        counts = counters(client, ray)
    finally:
        serve.shutdown()
        ray.shutdown()

    nrng = np.random.default_rng(args.seed)
    res = {"sets": {}}
    for name, data, length, shared_n in (("shared_95pct", long, args.length, shared),
                                         ("shared_16_tokens", short, args.short_length, args.short_shared)):
        res["sets"][name] = {"prompt_tokens": length, "shared_tokens": shared_n,
                             "conditions": {c: analyse(d["hit"], d["miss"], nrng) for c, d in data.items()
                                            if d["hit"] and d["miss"]},
                             "ttft_s": data}  # raw, per condition and arm (for pooling runs)
    s95 = res["sets"]["shared_95pct"]["conditions"]
    valid = s95["control"]["ks_p"] < 1e-6
    targets = {c: {"ks_p>=0.01": s95[c]["ks_p"] >= 0.01, "auc<=0.55": s95[c]["auc"] <= 0.55}
               for c in ("no_grant", "salt") if c in s95}
    cross = counts["engine_cross_tenant_reads"]
    bad = {k: v for k, v in {**cross, **counts["index_cross_tenant_reads"]}.items() if k != "granted<-victim"}
    res.update({
        "valid": valid, "targets": targets, "cross_tenant_hits_without_grant": bad, "counters": counts,
        "args": vars(args), "seconds": time.monotonic() - t_start,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
    })
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2))

    print(f"\nmachine: {res['machine']}; {res['seconds']:.0f} s")
    for name, s in res["sets"].items():
        print(f"\n{name}: {s['prompt_tokens']}-token prompts, {s['shared_tokens']} shared")
        print(f"  {'condition':10s} {'n hit/miss':>11s} {'KS p':>10s} {'AUC':>6s} {'AUC up95':>8s} "
              f"{'hit ms':>8s} {'miss ms':>8s}")
        for c, a in s["conditions"].items():
            print(f"  {c:10s} {a['n_hit']:>5d}/{a['n_miss']:<5d} {a['ks_p']:10.2e} {a['auc']:6.3f} "
                  f"{a['auc_boot_upper95']:8.3f} {a['ttft_hit_median_ms']:8.1f} {a['ttft_miss_median_ms']:8.1f}")
    print(f"\npositive control detects (KS p < 1e-6): {valid}  -> run {'valid' if valid else 'INVALID'}")
    print(f"targets without a grant (KS p >= 0.01, AUC <= 0.55): {targets}")
    print(f"cross-tenant hits without a grant (engine + index): {bad or 0}")
    print(f"engine cross-domain reads: {cross}; index: {counts['index_cross_tenant_reads']}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
