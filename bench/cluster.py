"""The whole cluster against what users would deploy instead (issue 11): one run, same workers.

    sudo nice -n 5 .venv/bin/python bench/cluster.py            # default size, ~30 min on 2 cores
    sudo nice -n 5 .venv/bin/python bench/cluster.py --quick    # smoke run, ~5 min

1. Hosts: ``bench.sshhosts`` makes one SSH host per Ray node (network namespace + own PID/mount
   namespace, sshd, per-run keys): a head behind 1 Gbit/s and ``--workers`` worker hosts, most
   behind 1 Gbit/s, the last behind ``--slow-mbit`` (100 Mbit/s), tbf-shaped veths
   (``bench.netlab``). 2. ``ray up`` of this run's sibling of ``cluster/ray-up-local.yaml``
   (``bench.rayup``: which fields change and why is in the JSON); one CPU per worker host, none
   on the head, so every engine runs on its own host with one thread. 3. For each configuration
   (``pow2``, ``affinity``, ``kvmesh``, ``kvmesh+approx``): ``serve deploy`` of its shipped Serve
   config with this run's edits (``bench.cluster_setup``) from the head (``ray exec``), wait until
   it serves, warm up, then drive (a) the shared-prefix workload with inference-perf
   (``bench.ipperf``: Poisson arrivals, its ``shared_prefix`` generator; ``--sweep steady``, the
   default: ONE run whose stages are a warm-up (until every group has been sent once, read from
   inference-perf's own prompt order: ``bench/ipperf_groups.py``, ``--warmup-max-s``) and the
   offered rates, over one set of groups, as
   inference-perf sweeps and as an application's system prompts stay in use (every stage walks
   inference-perf's prompt list from its start, so later stages repeat the first prompts); then,
   while the configuration has not saturated, one more run per ``--extend-rates`` rate
   (``shared_prefix_steady``); ``--sweep fresh``: a separate run per rate with new groups each,
   so every stage starts cold), then its hot-prefix variant at ``--hot-rates`` (one group: one system prompt
   shared by every user, as one application sends it; ``summary.hot_prefix``), (b) multi-turn chat,
   the multi-tenant mix (with the template tenant) and the Mooncake-format trace with kvmesh's
   own generator (``bench.loadgen``); ``/metrics`` and ``/kvmesh/workers`` are read after each
   step; then ``serve shutdown``. 4. ``ray down``; every host, namespace and link is removed.
``oracle`` is one infinite cache over the same prompts in the same order (``bench.workloads``),
the prompts tokenized as the server does. Each worker's ``kv_cache_bytes`` is sized so that the
shared-prefix workload's distinct prefixes need ``--pool-ratio`` (3) x one worker's pool.

Writes ``bench/results/cluster.json`` (``summary``: ``hit_tokens_vs_oracle``,
``throughput_at_equal_p99_ttft``, ``ttft_p90_affinity_over_kvmesh``; per configuration and rate:
TTFT p50/p90/p99, TPOT, request and token throughput, goodput at ``--ttft-slo``, hit tokens vs
the oracle, kvmesh's route decisions and bytes pulled, each request's TTFT) and
``bench/results/cluster.png``. ``summary.bootstrap``: each ratio's 90% interval over resamples
of the run's requests and the share of them that meets the target (``cluster_report.bootstrap``).
``--resummarize JSON [--run-dir DIR]`` recomputes a written run's summary with the current code.
Needs root (namespaces, tc, sshd); installs openssh-server and inference-perf's venv once.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import platform
import random
import re
import signal
import sys
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Sequence

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import cluster_report as report  # noqa: E402
from bench import cluster_setup as setup  # noqa: E402
from bench import cpuquota, ipperf, rayup, workloads  # noqa: E402
from bench import steps as steptrace  # noqa: E402
from bench.loadgen import Result, percentile, send_one, summarize  # noqa: E402
from bench.netlab import LinkSpec, leftovers  # noqa: E402
from bench.sshhosts import leftover_pids, ssh_hosts  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = "SmolLM2-135M-Instruct"
PORT = 8000
HOST_ENV = {"PYTHONPATH": "/root/kvmesh", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            "RAY_object_manager_pull_timeout_ms": "120000",
            # a node gives its dashboard agent this long to report its ports (the default 15 s is too short for
            # Python to start on this loaded 2-core machine; Ray >= 2.5x reads it for the agent port files)
            "RAY_agent_register_timeout_ms": "240000"}
TEXTS = ["The weather is nice today.", "My brother lives near the river.", "Please close the door.",
         "We go to the market on Saturday.", "The children play in the park.", "I would like a coffee.",
         "She reads a book every evening.", "The museum opens at nine.", "Our neighbours have a dog.",
         "He forgot his keys at the office.", "The soup needs more salt.", "They travelled to Spain."]
TEMPLATE = ("Translate the text below into French.\n\nText: {text}\n\nGuidelines:\n"
            "1. Keep the meaning of the original text exactly; do not add or remove information.\n"
            "2. Keep names of people and places unchanged.\n"
            "3. Use a neutral, polite register suitable for a general audience.\n"
            "4. Keep numbers, dates and times in their original form.\n"
            "5. Answer with the French translation only, on a single line.\n\nFrench translation:")


def model_dir() -> Path:
    from engine.model_loader import resolve_model_dir

    return Path(resolve_model_dir("default")[1])


def load_avg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


class Cluster:
    """The running Ray cluster of this bench: ``ray up``/``exec``/``down`` and HTTP to the head."""

    def __init__(self, lab, out: Path, log):
        self.lab, self.out, self.log = lab, out, log
        self.head = lab.hosts["head"]
        self.base_url = f"http://{self.head.ip}:{PORT}"
        self.config_path: Path | None = None

    def up(self, workers: list[str], boot_timeout_s: float) -> dict:
        cfg = rayup.sibling_config(rayup.load_shipped(), cluster_name=f"kvmesh-bench-{self.lab.network.tag}",
                                   head_ip=self.head.ip, worker_ips=[self.lab.hosts[w].ip for w in workers],
                                   key=self.lab.key, venv=rayup.venv_dir(),
                                   start_lock=self.lab.run_dir / "ray-start.lock")
        self.config_path = rayup.write_config(cfg, self.lab.run_dir / "ray-up.yaml")
        t0 = time.monotonic()
        for attempt in range(1, 4):  # Ray gives a starting node 30 s (fixed) to register; a loaded machine misses it
            try:
                rayup.ray_up(self.config_path, self.out / "ray.log")
                break
            except RuntimeError as e:
                self.log(f"ray up attempt {attempt} failed: {str(e).splitlines()[-1]}")
                rayup.ray_down(self.config_path, self.out / "ray.log")
                if attempt == 3:
                    raise
        alive = self.wait_nodes(len(workers) + 1, boot_timeout_s)
        if alive < len(workers) + 1:  # a worker whose start failed: ray up again, as a user would
            self.log(f"only {alive} of {len(workers) + 1} nodes joined; ray up --restart-only")
            rayup.ray_up(self.config_path, self.out / "ray.log", restart_only=True)
            alive = self.wait_nodes(len(workers) + 1, boot_timeout_s)
        if alive < len(workers) + 1:
            raise RuntimeError(f"only {alive} of {len(workers) + 1} Ray nodes joined; see {self.out / 'ray.log'}")
        return {"config": cfg, "up_s": round(time.monotonic() - t0, 1), "nodes": alive}

    def exec(self, command: str, timeout_s: float = 300, check: bool = True) -> str:
        return rayup.ray_exec(self.config_path, command, self.out / "ray.log", timeout_s=timeout_s, check=check)

    def alive_nodes(self) -> int:
        out = self.exec("~/kvmesh/.venv/bin/python -c 'import ray; ray.init(address=\"auto\", log_to_driver=False); "
                        "print(\"ALIVE\", sum(n[\"Alive\"] for n in ray.nodes()))'", check=False, timeout_s=120)
        m = re.search(r"ALIVE (\d+)", out)
        return int(m.group(1)) if m else 0

    def wait_nodes(self, n: int, timeout_s: float) -> int:
        deadline, alive = time.monotonic() + timeout_s, 0
        while time.monotonic() < deadline:
            alive = self.alive_nodes()
            if alive >= n:
                break
            time.sleep(5)
        return alive

    def deploy(self, name: str, serve_cfg: dict, tenants: dict, timeout_s: float) -> float:
        """``serve deploy`` from the head; returns seconds until every replica/worker serves."""
        slug = name.replace("+", "-")
        setup.dump_yaml(tenants, self.head.home / "bench" / f"tenants-{slug}.yaml")
        setup.dump_yaml(serve_cfg, self.head.home / "bench" / f"serve-{slug}.yaml")
        t0 = time.monotonic()
        self.exec(f"cd ~/kvmesh && .venv/bin/serve deploy /root/bench/serve-{slug}.yaml")
        app = serve_cfg["applications"][0]["name"]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            status = self.exec("cd ~/kvmesh && .venv/bin/serve status", check=False, timeout_s=120)
            if re.search(rf"{re.escape(app)}:\s*\n\s*status: RUNNING", status) and self.health():
                return time.monotonic() - t0
            if "DEPLOY_FAILED" in status:
                raise RuntimeError(f"{name} failed to deploy:\n{status[-3000:]}")
            time.sleep(5)
        raise TimeoutError(f"{name} did not become ready in {timeout_s:.0f}s")

    def shutdown_serve(self) -> None:
        self.exec("cd ~/kvmesh && .venv/bin/serve shutdown -y", check=False)

    def get(self, path: str, key: str | None = None, timeout_s: float = 20) -> tuple[int, str]:
        req = urllib.request.Request(self.base_url + path, headers={"Authorization": f"Bearer {key}"} if key else {})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                return r.status, r.read().decode()
        except Exception as e:  # noqa: BLE001 - reported as a failed probe
            return getattr(e, "code", 0) or 0, str(e)

    def health(self) -> bool:
        return self.get("/health")[0] == 200

    def down(self) -> int:
        if not self.config_path:
            return 0
        rc = rayup.ray_down(self.config_path, self.out / "ray.log")
        rayup.forget(self.config_path)
        return rc


# -- metrics ---------------------------------------------------------------------------------
_PROM = re.compile(r"^(kvmesh_[a-z_]+)(\{[^}]*\})?\s+([0-9.eE+-]+|NaN)$")


def parse_prometheus(text: str) -> dict[str, float]:
    """kvmesh's series (``name{labels}`` -> value), summed over ingress replicas' duplicates."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _PROM.match(line.strip())
        if m and not m.group(1).endswith(("_bucket", "_created")):
            key = m.group(1) + (m.group(2) or "")
            try:
                out[key] = out.get(key, 0.0) + float(m.group(3))
            except ValueError:
                continue
    return out


def metrics_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Counter growth between two scrapes (a gauge's latest value is in the later scrape)."""
    d = {}
    for k, v in after.items():
        delta = v - before.get(k, 0.0)
        if abs(delta) > 1e-12:
            d[k] = round(delta, 6)
    return d


def stage_means(m: dict[str, float]) -> dict[str, float]:
    """Mean seconds per request of each stage of the time to first token (the ingress's
    ``kvmesh_request_stage_seconds`` histogram, all tenants) from a metrics delta: the request
    path's profile for load generators that do not keep the responses' ``kvmesh.timings``."""
    sums: dict[str, list[float]] = {}
    for k, v in m.items():
        if k.startswith("kvmesh_request_stage_seconds_") and 'stage="' in k:
            stage = re.search(r'stage="([^"]+)"', k).group(1)
            acc = sums.setdefault(stage, [0.0, 0.0])
            acc[0 if k.startswith("kvmesh_request_stage_seconds_sum") else 1] += v
    return {st: round(a / n, 4) for st, (a, n) in sums.items() if n}


def decisions(m: dict[str, float], now: dict[str, float] | None = None) -> dict:
    """Route decisions and pulled bytes/tokens from a metrics delta; with ``now`` (the later
    scrape), the prefix groups each worker served lately (a gauge)."""
    routes = {re.search(r'route="([^"]+)"', k).group(1): v for k, v in m.items()
              if k.startswith("kvmesh_routes_total") and 'route="' in k}
    kinds = {re.search(r'kind="([^"]+)"', k).group(1): v for k, v in m.items()
             if k.startswith("kvmesh_router_decisions") and 'kind="' in k}
    placements = {re.search(r'="([^"]+)"', k).group(1): v for k, v in m.items()
                  if k.startswith("kvmesh_router_placements{")}
    routed = {re.search(r'worker="([^"]+)"', k).group(1): v for k, v in m.items()
              if k.startswith("kvmesh_router_routed{") and 'worker="' in k}
    return {"stage_means_s": stage_means(m), "routes": routes, "router_decisions": kinds, "placements": placements, "routed_per_worker": routed,
            "bytes_pulled": sum(v for k, v in m.items() if k.startswith("kvmesh_router_bytes_pulled")),
            "pulled_tokens": sum(v for k, v in m.items() if k.startswith("kvmesh_pulled_tokens_total")),
            "groups_per_worker": {re.search(r'worker="([^"]+)"', k).group(1): v for k, v in (now or {}).items()
                                  if k.startswith("kvmesh_router_groups{") and 'worker="' in k}}


# -- workloads -------------------------------------------------------------------------------
def tokenize(tok, text: str) -> tuple[int, ...]:
    return tuple(tok.encode(text, add_special_tokens=True))


def template_items(n: int, rate: float, seed: int, tok) -> tuple[list[workloads.WorkItem], list[dict]]:
    """The template tenant's requests: instances of one template (parameter ``text``)."""
    rng = random.Random(seed)
    times = workloads.poisson_arrivals(n, rate, rng)
    items, extras = [], []
    for i, t in enumerate(times):
        text = TEXTS[i % len(TEXTS)]
        prompt = TEMPLATE.replace("{text}", text)
        items.append(workloads.WorkItem(tokenize(tok, prompt), 16, t, setup.TEMPLATE_TENANT, setup.TEMPLATE_TENANT,
                                        group="tmpl"))
        extras.append({"prompt": prompt, "kvmesh": {"template": setup.TEMPLATE_ID, "params": {"text": text}}})
    return items, extras


async def drive(base_url: str, items: list[workloads.WorkItem], extras: list[dict | None], timeout_s: float = 180,
                progress=None) -> list[Result]:
    """Open loop: each item at its ``at_s``, its own request extras (prompt text, kvmesh fields)."""
    import httpx

    keys = {i.tenant: f"sk-{i.tenant}" for i in items}
    out: list[Result] = []
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(timeout_s),
                                 limits=httpx.Limits(max_connections=256)) as client:
        t0 = time.perf_counter()

        async def one(i: int) -> None:
            delay = items[i].at_s - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            r = await send_one(client, i, items[i], keys[items[i].tenant], MODEL, t0, timeout_s, extras[i])
            out.append(r)
            if progress:
                progress()

        await asyncio.gather(*(one(i) for i in range(len(items))))
    return sorted(out, key=lambda r: r.index)


def other_workloads(args, tok) -> dict[str, tuple[list[workloads.WorkItem], list[dict | None]]]:
    """multi_turn, multi_tenant (+ the template tenant) and the Mooncake trace, as work items."""
    q = args.quick
    mt = workloads.multi_turn(sessions=args.multi_turn_sessions or (4 if q else 6), turns=3, system_len=256,
                              user_len=32, output_len=16, rate_per_s=0.5, think_s=4.0, seed=1,
                              tenant=setup.BENCH_TENANT)
    mix = workloads.multi_tenant(requests=24 if q else 32, rate_per_s=args.other_rate, output_len=16, seed=2)
    titems, textras = template_items(8 if q else 12, args.other_rate / 3, 3, tok)
    merged = sorted([(w, None) for w in mix] + list(zip(titems, textras)), key=lambda p: p[0].at_s)
    trace = workloads.read_mooncake(Path(__file__).resolve().parent / "traces" / "mooncake_small.jsonl",
                                    workloads.TraceScale(tokens_per_hash=16, time_scale=args.trace_time_scale,
                                                         max_requests=24 if q else 32, max_input_tokens=1024,
                                                         max_output_tokens=16), tenant=setup.BENCH_TENANT)
    all_ = {"multi_turn": (mt, [None] * len(mt)), "multi_tenant": ([w for w, _ in merged], [e for _, e in merged]),
            "mooncake_trace": (trace, [None] * len(trace))}
    return {k: v for k, v in all_.items() if k in args.workloads}


WHY = ("placement", "index_holders", "routed_holders", "planned_route", "expected_ttft_s", "options", "pull_outcome",
       "timings")  # kvmesh's explanation, and where its time to first token went


def per_request(results: list[Result], items: list[workloads.WorkItem], oracle: list[int]) -> list[dict]:
    """One row per request of a kvmesh-loadgen workload (in workload order): when it was sent,
    its tenant and prefix group, TTFT, cached tokens against the oracle's, and where it ran (the
    response's ``kvmesh`` worker and route; None from the baselines) and, from kvmesh, why (its
    placement rule, the holders the index and the router's record showed, the planned route and its
    expected TTFT): what a hit gap is read from."""
    return [{"sent_s": round(r.sent_s, 2), "tenant": r.tenant, "group": items[r.index].group,
             "ttft_s": None if r.ttft_s is None else round(r.ttft_s, 3), "cached": r.cached_tokens,
             "oracle": h, "worker": r.worker, "route": r.route, "status": r.status,
             **{k: r.served.get(k) for k in WHY if r.served}}
            for r, h in zip(results, oracle)]


def router_estimates(cl: "Cluster") -> dict | None:
    """The kvmesh router's estimates at this moment (links, prefill fits, waits; the admin view of
    ``/kvmesh/workers``): what its pull-or-recompute choices were priced with; with each worker's
    pull counters (``pulls``: joined, waited for room, skipped) and import holds (``holds``), and
    the router's last placement decisions (``placement_log``: place, spill, balance, idle, with
    every candidate's TTFT, held, evicted and prefix blocks)."""
    code, text = cl.get("/kvmesh/workers", setup.BENCH_ADMIN_KEY)
    try:
        view = json.loads(text) if code == 200 else None
    except ValueError:
        return None
    if view is None:
        return None
    engines = {w["worker_id"]: w.get("engine") or {} for w in view.get("workers") or []}
    return {**(view.get("router") or {}),
            "tpot_s": {w["worker_id"]: w.get("tpot_s") for w in view.get("workers") or []},
            "pulls": {w: e.get("pulls") for w, e in engines.items()},
            "holds": {w: e.get("import_holds") for w, e in engines.items()},
            "placement_log": view.get("placement_log")}


def hit_ratio(results: list[Result], oracle: list[int]) -> dict:
    got = sum(r.cached_tokens for r in results if r.ok)
    best = sum(h for r, h in zip(results, oracle) if r.ok)
    return {"cached_tokens": got, "oracle_cached_tokens": best, "vs_oracle": got / best if best else None}


# -- main ------------------------------------------------------------------------------------
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run (~5 min): 2 rates, short stages, small workloads")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--slow-mbit", type=float, default=100.0)
    ap.add_argument("--fast-mbit", type=float, default=1000.0)
    ap.add_argument("--node-cpus", type=float, default=None,
                    help="cores each worker host may use (a CFS quota, bench/cpuquota.py), like a machine of its "
                         "own; default 0.8 x this machine's cores / workers; 0: hosts share all cores (before)")
    ap.add_argument("--configs", default=",".join(setup.CONFIGS))
    ap.add_argument("--rates", default=None,
                    help="offered shared-prefix request rates (req/s), comma separated ('': skip that workload)")
    ap.add_argument("--stage-s", type=int, default=None, help="seconds per rate")
    ap.add_argument("--groups", type=int, default=None)
    ap.add_argument("--users", type=int, default=None)
    ap.add_argument("--data-seed", type=int, default=0,
                    help="added to inference-perf's data seed (its prompts and their order; 0: the runs before "
                         "session 19). Every stage walks that order from its start, so the seed decides how skewed "
                         "each stage's traffic over the groups is")
    ap.add_argument("--system-len", type=int, default=512)
    ap.add_argument("--question-len", type=int, default=40)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--hot-rates", default=None,
                    help="offered rates of the hot-prefix workload (one system prompt for all users; '' = skip)")
    ap.add_argument("--pool-ratio", type=float, default=3.0, help="distinct prefixes / one worker's KV pool")
    ap.add_argument("--ttft-slo", type=float, default=2.0, help="TTFT SLO (s) for goodput")
    ap.add_argument("--other-rate", type=float, default=0.8, help="req/s of the multi-tenant mix")
    ap.add_argument("--trace-time-scale", type=float, default=0.5)
    ap.add_argument("--approx-all", action="store_true",
                    help="run every workload on kvmesh+approx (default: only the multi-tenant mix, the only one "
                         "with a template tenant; elsewhere kvmesh+approx is kvmesh)")
    ap.add_argument("--workloads", default="multi_turn,multi_tenant,mooncake_trace",
                    help="kvmesh-loadgen workloads to run after the shared-prefix sweep ('' for none)")
    ap.add_argument("--multi-turn-sessions", type=int, default=None,
                    help="chat sessions of the multi-turn workload (3 turns each; default 6, --quick 4)")
    ap.add_argument("--kvmesh-args", default="",
                    help="extra app arguments of the kvmesh configurations, key=value comma separated (values "
                         "parsed as YAML), e.g. router_learn_decode=false")
    ap.add_argument("--sweep", choices=("fresh", "steady"), default="steady",
                    help="fresh: one inference-perf run per rate, each with new groups (every stage starts cold); "
                         "steady: one inference-perf run over all rates (after a warm-up stage) and one set of "
                         "groups, as inference-perf sweeps: system prompts stay in use across stages")
    ap.add_argument("--extend-rates", default=None,
                    help="steady sweep: higher shared-prefix rates (req/s, comma separated) a configuration goes "
                         "on at, one stage each, while its highest stage so far has not saturated (p99 TTFT below "
                         "--extend-below-p99), so that throughput at equal p99 is read where the configurations "
                         "saturate rather than as a lower bound (default 3; --quick and paired runs: none; '': none)")
    ap.add_argument("--extend-below-p99", type=float, default=report.EXTEND_BELOW_P99_S,
                    help="p99 TTFT (s) at which a configuration's sweep counts as saturated and stops extending")
    ap.add_argument("--warmup-max-s", type=int, default=None,
                    help="steady sweep: the warm-up stage lasts until every group has been sent once (from "
                         "inference-perf's own prompt order, bench/ipperf_groups.py), at least one stage and at "
                         "most this long (default 4 stages); 0: exactly one stage, as before session 18")
    ap.add_argument("--unseeded-arrivals", dest="seeded_arrivals", action="store_false",
                    help="inference-perf draws its Poisson arrival times unseeded (its own behaviour): every "
                         "configuration gets different ones. Default: seeded through bench/ipperf_seeded.py, the "
                         "same arrival times for every configuration")
    ap.add_argument("--step-trace", action="store_true",
                    help="engines write step traces (engine/step_trace.py); each stage gets engine_steps "
                         "(bench/steps.py: engine-side TTFT, requests that arrived at a busy engine, host speed)")
    ap.add_argument("--tag-prefix", default="kvc", help="prefix of the namespaces/links this run creates")
    ap.add_argument("--barrier", default=None, metavar="DIR:N",
                    help="paired runs (bench/cluster_paired.py): wait before each measured workload until N "
                         "processes sharing DIR reach it, so that their loads run at the same time")
    ap.add_argument("--out", default=str(RESULTS / "cluster.json"))
    ap.add_argument("--resummarize", default=None, metavar="JSON",
                    help="run nothing: recompute this written run's summary with the current code (in place)")
    ap.add_argument("--run-dir", default=None, metavar="DIR",
                    help="with --resummarize: the run's cluster_run directory, to fill in the stages' TTFT "
                         "samples of a run written before they were kept")
    a = ap.parse_args(argv)
    rates = a.rates if a.rates is not None else ("0.5,1.5" if a.quick else "0.5,1.0,2.0")
    a.rates = [float(x) for x in rates.split(",") if x]  # '': no shared-prefix sweep (the other workloads only)
    a.stage_s = a.stage_s or (20 if a.quick else 30)
    a.warmup_max_s = 4 * a.stage_s if a.warmup_max_s is None else a.warmup_max_s
    a.groups = a.groups or (8 if a.quick else 12)
    a.users = a.users or max(4, int(max(a.rates, default=0) * a.stage_s / a.groups) + 1)
    ext = ("" if a.quick or a.barrier else "3") if a.extend_rates is None else a.extend_rates
    a.extend_rates = [float(x) for x in ext.split(",") if x]
    hot = ("" if a.quick else "0.7,1.3") if a.hot_rates is None else a.hot_rates
    a.hot_rates = [float(x) for x in hot.split(",") if x]
    a.configs = [c for c in a.configs.split(",") if c]
    if a.node_cpus is None:
        a.node_cpus = round(0.8 * (os.cpu_count() or 1) / a.workers, 3)
    a.workloads = [w for w in a.workloads.split(",") if w]
    a.kvmesh_args = {k.strip(): yaml.safe_load(v) for k, v in (kv.split("=", 1) for kv in a.kvmesh_args.split(",") if kv)}
    return a


class Barrier:
    """Where paired runs meet (``bench/cluster_paired.py``: one ``cluster.py`` per configuration,
    each on its own twin cluster). Before each measured workload every process touches
    ``DIR/<workload>.<configuration>`` and waits until ``N`` such files exist, so that the
    configurations are driven at the same time and meet the same machine: this machine's speed
    drifts by up to 2x over a day, and run one after another, configurations met different
    speeds (``bench/host_speed.py``). A process that stops (done or failed) leaves
    ``DIR/left.<configuration>``, which counts for every later workload, so the others never wait
    for it. A process's files carry its ``run`` tag (``--tag-prefix``: ``<configuration>@<tag>``),
    so two processes may run one configuration with different settings (``--kvmesh-args``) side by
    side. Without ``--barrier`` it does nothing."""

    def __init__(self, spec: str | None, timeout_s: float = 1800.0, run: str = ""):
        self.dir, self.n, self.timeout_s = None, 1, timeout_s
        self.run = run  # this process's tag: two processes may run configurations of one name
        if spec:
            d, n = spec.rsplit(":", 1)
            self.dir, self.n = Path(d), int(n)
            self.dir.mkdir(parents=True, exist_ok=True)

    def meet(self, workload: str, name: str, log=None) -> float:
        """Returns the seconds waited."""
        if self.dir is None:
            return 0.0
        (self.dir / f"{workload}.{self._member(name)}").touch()
        t0 = time.monotonic()
        while len({p.name.split(".", 1)[1] for p in [*self.dir.glob(f"{workload}.*"), *self.dir.glob("left.*")]}) \
                < self.n and time.monotonic() - t0 < self.timeout_s:
            time.sleep(0.5)
        waited = time.monotonic() - t0
        if log and waited > 1:
            log(f"{name}: waited {waited:.0f}s for the paired runs at {workload}")
        return waited

    def _member(self, name: str) -> str:
        return f"{name}@{self.run}" if self.run else name

    def skip(self, workloads, name: str) -> None:
        """Workloads this configuration does not run: the others need not wait for it there."""
        if self.dir is not None:
            for w in workloads:
                (self.dir / f"{w}.{self._member(name)}").touch()

    def leave(self, names) -> None:
        if self.dir is not None:
            for n in names:
                (self.dir / f"left.{self._member(n)}").touch()


def _interrupt(signum, frame):  # SIGTERM/SIGINT (also when started in the background): clean up, then exit
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.resummarize:
        return resummarize(Path(args.resummarize), Path(args.run_dir) if args.run_dir else None)
    if os.geteuid() != 0:
        raise SystemExit("bench/cluster.py needs root (network namespaces, tc, sshd)")
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    from tqdm import tqdm
    from transformers import AutoTokenizer

    out_json = Path(args.out)
    work = out_json.parent / "cluster_run"
    work.mkdir(parents=True, exist_ok=True)
    exe = ipperf.ensure_venv()
    mdir = model_dir()
    tok = AutoTokenizer.from_pretrained(mdir)
    shape = setup.model_shape(mdir)
    spec_base = ipperf.SharedPrefixSpec(args.groups, args.users, args.system_len, args.question_len, args.output_len)
    kv_bytes = setup.kv_cache_bytes(spec_base.distinct_prefix_tokens, args.pool_ratio, shape)
    others = other_workloads(args, tok)
    grants = workloads.multi_tenant_tenants()
    workers = [f"w{i}" for i in range(1, args.workers + 1)]
    links = [LinkSpec("head", args.fast_mbit)] + [LinkSpec(w, args.slow_mbit if w == workers[-1] else args.fast_mbit)
                                                  for w in workers]
    steps = sum(len(args.rates) + len(args.hot_rates) + len(others) + 1
                for c in args.configs if c != "kvmesh+approx" or args.approx_all)
    steps += 2 if "kvmesh+approx" in args.configs and not args.approx_all else 0
    bar = tqdm(total=steps, desc="cluster bench", unit="step", dynamic_ncols=True)
    log = lambda msg: tqdm.write(f"[{time.strftime('%H:%M:%S', time.gmtime())}] {msg}")  # noqa: E731
    doc: dict = {"bench": "cluster", "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                                                 "python": platform.python_version()},
                 "load_avg": {"start": load_avg()}, "args": {k: v for k, v in vars(args).items()},
                 "sizing": {"kv_cache_bytes": kv_bytes, "kv_bytes_per_token": shape.kv_bytes_per_token,
                            "distinct_prefix_tokens": spec_base.distinct_prefix_tokens,
                            "pool_ratio": setup.pool_ratio(spec_base.distinct_prefix_tokens, kv_bytes, shape),
                            "pool_tokens": kv_bytes // shape.kv_bytes_per_token},
                 "ray_up_changes": list(rayup.CHANGES), "configs": {}, "steps": []}
    t_start = time.monotonic()
    lab_ref = {}
    try:
        env = dict(HOST_ENV, KVMESH_STEP_TRACE_DIR=steptrace.TRACE_DIR) if args.step_trace else HOST_ENV
        with ssh_hosts(links, prefix=args.tag_prefix, env=env,
                       binds={str(ipperf.CACHE): ".cache/kvmesh", str(Path.home() / ".pyenv"): ".pyenv"},
                       daemon=rayup.port_prewriter(),
                       cpus={w: args.node_cpus for w in workers} if args.node_cpus > 0 else None) as lab:
            lab_ref["lab"] = lab
            cl = Cluster(lab, work, log)
            doc["cluster"] = {"hosts": {n: {"ip": h.ip, "rate_mbit": h.rate_mbit,
                                            "cpus": args.node_cpus if n in lab.cgroups else None}
                                        for n, h in lab.hosts.items()},
                              "endpoint": cl.base_url}
            try:
                log(f"ray up: head {cl.head.ip}, workers " + ", ".join(
                    f"{w}={lab.hosts[w].ip}@{lab.hosts[w].rate_mbit:g}Mbit" for w in workers))
                up = cl.up(workers, boot_timeout_s=300)
                doc["cluster"].update(ray_up_s=up["up_s"], nodes=up["nodes"], ray_up_config=up["config"])
                log(f"cluster up in {up['up_s']:.0f}s ({up['nodes']} nodes)")
                for name in args.configs:
                    try:
                        run_config(cl, name, args, exe, mdir, tok, kv_bytes, others, grants, bar, log, doc)
                    except Exception as e:  # noqa: BLE001 - one configuration failing must not lose the others
                        Barrier(args.barrier, run=args.tag_prefix).leave([name])
                        log(f"{name} failed: {type(e).__name__}: {e}")
                        doc["configs"].setdefault(name, {})["error"] = f"{type(e).__name__}: {e}"[:2000]
                        cl.shutdown_serve()
                    write(doc, out_json)
            finally:
                doc["cluster"]["cpu_throttling"] = {n: cpuquota.throttled(p) for n, p in lab.cgroups.items()}
                doc["cluster"]["ray_down_rc"] = cl.down()
    finally:
        Barrier(args.barrier, run=args.tag_prefix).leave(args.configs)
        bar.close()
        lab = lab_ref.get("lab")
        doc["leftovers"] = {"namespaces_and_links": leftovers(args.tag_prefix),
                            "host_processes": leftover_pids(lab) if lab else []}
        doc["load_avg"]["end"] = load_avg()
        doc["wall_s"] = round(time.monotonic() - t_start, 1)
        finish(doc, out_json)
    return doc


def run_config(cl: Cluster, name: str, args, exe, mdir, tok, kv_bytes, others, grants, bar, log, doc) -> dict:
    res: dict = {"shared_prefix": [], "load_avg": {"start": load_avg()}}
    doc["configs"][name] = res  # filled in as it runs: an interrupted run keeps what it measured
    approx_only = name == "kvmesh+approx" and not args.approx_all
    tenants = setup.tenants_file(name, grants, TEMPLATE)
    serve_cfg = setup.serve_config(name, host=cl.head.ip, port=PORT, workers=args.workers, kv_bytes=kv_bytes,
                                   tenants_path=f"/root/bench/tenants-{name.replace('+', '-')}.yaml")
    if name.startswith("kvmesh") and args.kvmesh_args:
        serve_cfg["applications"][0]["args"].update(args.kvmesh_args)
    res["serve_config"] = serve_cfg
    log(f"{name}: serve deploy")
    res["deploy_s"] = round(cl.deploy(name, serve_cfg, tenants, timeout_s=900), 1)
    log(f"{name}: ready in {res['deploy_s']:.0f}s")
    try:
        warm = [workloads.WorkItem(workloads.Vocab().tokens(random.Random(100 + i), 96), 4, 0.0, setup.BENCH_TENANT,
                                   setup.BENCH_TENANT) for i in range(2 * args.workers)]
        asyncio.run(drive(cl.base_url, warm, [None] * len(warm)))
        bar.update(1)
        barrier = Barrier(args.barrier, run=args.tag_prefix)
        if approx_only:
            barrier.skip(["shared_prefix", "hot_prefix", *[f"{k}-{i}" for k in ("shared_prefix", "hot_prefix")
                                                           for i in range(len(args.rates) + len(args.hot_rates))],
                          *[w for w in others if w != "multi_tenant"]], name)
        m0 = parse_prometheus(cl.get("/metrics")[1])
        if not approx_only and args.sweep == "steady":
            for key, hot, rates in (("shared_prefix", False, args.rates), ("hot_prefix", True, args.hot_rates)):
                if rates:
                    barrier.meet(key, name, log)
                    stages = shared_prefix_steady(cl, name, args, exe, mdir, tok, rates, log, hot=hot,
                                                  extend=() if hot else args.extend_rates)
                    res[f"{key}_warmup"], res[key] = stages[0], stages[1:]
                    if name.startswith("kvmesh"):  # its placement log: how the groups came to be split so
                        res[f"{key}_router_estimates"] = router_estimates(cl)
                    bar.total += len(stages) - 1 - len(rates)  # the stages the sweep went on at
                    bar.update(len(stages) - 1)
                    write(doc, Path(args.out))
            m0 = parse_prometheus(cl.get("/metrics")[1])
        elif not approx_only:
            for k, rate in enumerate(args.rates):
                barrier.meet(f"shared_prefix-{k}", name, log)
                res["shared_prefix"].append(shared_prefix_rate(cl, name, args, exe, mdir, tok, k, rate, log))
                m1 = parse_prometheus(cl.get("/metrics")[1])
                res["shared_prefix"][-1]["kvmesh_metrics"] = decisions(metrics_delta(m0, m1), m1)
                m0 = m1
                bar.update(1)
                write(doc, Path(args.out))
            res["hot_prefix"] = []
            for k, rate in enumerate(args.hot_rates):
                barrier.meet(f"hot_prefix-{k}", name, log)
                res["hot_prefix"].append(shared_prefix_rate(cl, name, args, exe, mdir, tok, k, rate, log, hot=True))
                m1 = parse_prometheus(cl.get("/metrics")[1])
                res["hot_prefix"][-1]["kvmesh_metrics"] = decisions(metrics_delta(m0, m1), m1)
                m0 = m1
                bar.update(1)
                write(doc, Path(args.out))
        res["workloads"] = {}
        for wname, (items, extras) in others.items():
            if approx_only and wname != "multi_tenant":
                continue
            barrier.meet(wname, name, log)
            log(f"{name}: {wname} ({len(items)} requests)")
            t0, wall0 = time.monotonic(), time.time()
            cpu0 = cpu_by_component(cl)
            results = asyncio.run(drive(cl.base_url, items, extras))
            wall = time.monotonic() - t0
            cpu1 = cpu_by_component(cl)
            oracle = workloads.oracle_hits(items)
            m1 = parse_prometheus(cl.get("/metrics")[1])
            s = summarize(results, args.ttft_slo, wall_s=wall)
            s.update(hit=hit_ratio(results, oracle), kvmesh_metrics=decisions(metrics_delta(m0, m1), m1),
                     router_estimates=router_estimates(cl) if name.startswith("kvmesh") else None,
                     per_tenant={t: hit_ratio([r for r in results if r.tenant == t],
                                              [h for r, h in zip(results, oracle) if r.tenant == t])
                                 for t in sorted({r.tenant for r in results})},
                     approx_cached_tokens=None, errors_sample=[r.error for r in results if r.error][:3],
                     per_request=per_request(results, items, oracle), wall_clock=[wall0, time.time()])
            s["cpu"] = cpu_delta(cpu0, cpu1, s["ok"])
            m0 = m1
            res["workloads"][wname] = s
            log(f"{name}: {wname} hit/oracle {s['hit']['vs_oracle']}, TTFT p90 {s['ttft_s']['p90']}")
            bar.update(1)
        res["pull_log"] = pull_log(cl)
        res["workers_view"] = cl.get("/kvmesh/workers", f"sk-{setup.BENCH_TENANT}")[1][:20000]
        res["metrics_text"] = cl.get("/metrics")[1][:20000]
    finally:
        cl.shutdown_serve()
        if args.step_trace:
            engine_steps(cl, name, res)
        res["load_avg"]["end"] = load_avg()
        if approx_only:
            bar.update(1)
    return res


COMPONENTS = (("ray::Worker", "worker"), ("EngineReplica", "worker"), ("KvmeshIngress", "ingress"),
              ("BaselineIngress", "ingress"), ("ray::ProxyActor", "serve_proxy"), ("ray::Controller", "controller"),
              ("ray::Router", "router"), ("ray::IndexActor", "index"), ("ray::ServeController", "serve_controller"))


def cpu_by_component(cl: Cluster) -> dict[str, float]:
    """CPU seconds (user + system) used so far by the processes of the bench's hosts, by
    component (kvmesh/baseline workers, ingress, Serve proxy, controller, router, index; the rest
    of Ray as ``ray_system``, anything else ``other``). Differences between two snapshots are a
    stage's CPU per component: the request path's profile, the same way for every configuration."""
    from bench.sshhosts import leftover_pids

    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for pid in leftover_pids(cl.lab):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        cpu = (int(fields[11]) + int(fields[12])) / tick
        name = next((c for k, c in COMPONENTS if k in cmd), None)
        if name is None:
            name = "ray_system" if ("ray" in cmd or "gcs_server" in cmd or "raylet" in cmd) else "other"
        out[name] = out.get(name, 0.0) + cpu
    return out


def cpu_delta(a: dict[str, float], b: dict[str, float], requests: int) -> dict:
    """Per component: CPU seconds between snapshots ``a`` and ``b`` (processes that exited meanwhile
    are not counted), and per completed request."""
    d = {k: round(b.get(k, 0.0) - a.get(k, 0.0), 2) for k in sorted(set(a) | set(b))}
    d = {k: v for k, v in d.items() if v > 0}
    return {"cpu_s": d, "cpu_s_total": round(sum(d.values()), 2),
            "cpu_s_per_request": {k: round(v / requests, 3) for k, v in d.items()} if requests else {}}


def engine_steps(cl: Cluster, name: str, res: dict) -> None:
    """Move this configuration's engine step traces off the hosts and add each inference-perf
    stage's and loadgen workload's ``engine_steps`` (``bench.steps.summarize`` over its
    wall-clock window)."""
    files = steptrace.collect({n: h.tmp for n, h in cl.lab.hosts.items()}, cl.out / "steps" / name.replace("+", "-"))
    engines = steptrace.read(files)
    stages = [s for key in ("shared_prefix", "hot_prefix") for s in res.get(key) or []]
    for s in stages + list((res.get("workloads") or {}).values()):
        if s.get("wall_clock"):
            s["engine_steps"] = steptrace.summarize(engines, *s["wall_clock"])


def pull_log(cl: Cluster, limit: int = 40) -> dict:
    """The workers' log lines about pulls (failed, skipped, replicated) from every host's Ray
    logs, with counts: why a planned pull did not land is in them."""
    lines: list[str] = []
    for name, host in cl.lab.hosts.items():
        for f in sorted(Path(host.tmp).glob("ray/session_*/logs/worker-*.err")):
            try:
                for line in f.read_text(errors="replace").splitlines():
                    if "pull of blocks" in line or "replicating a hot prefix" in line:
                        lines.append(f"{name}: {line[-300:]}")
            except OSError:
                continue
    return {"failed": sum("failed after" in x for x in lines), "skipped": sum("skipped" in x for x in lines),
            "replicated": sum("replicating" in x for x in lines), "lines": lines[-limit:]}


def shared_prefix_rate(cl: Cluster, name: str, args, exe, mdir, tok, k: int, rate: float, log,
                       hot: bool = False) -> dict:
    """One offered rate of the shared-prefix workload through inference-perf. ``hot``: the
    hot-prefix variant, one group (one system prompt shared by every user, the common case of
    one application), enough users that no prompt repeats within the stage."""
    groups = 1 if hot else args.groups
    users = int(rate * args.stage_s) + 4 if hot else args.users
    spec = ipperf.SharedPrefixSpec(groups, users, args.system_len, args.question_len, args.output_len,
                                   seed=(2000 if hot else 1000) + k + args.data_seed)
    d = cl.out / f"{name.replace('+', '-')}-{'hot' if hot else 'rate'}{k}"
    d.mkdir(parents=True, exist_ok=True)
    cfg = ipperf.config(spec, [rate], args.stage_s, cl.base_url, f"sk-{setup.BENCH_TENANT}", MODEL, str(mdir),
                        d / "reports")
    setup.dump_yaml(cfg, d / "inference-perf.yaml")
    log(f"{name}: {'hot' if hot else 'shared'} prefix at {rate:g} req/s for {args.stage_s}s (inference-perf)")
    t0, wall0 = time.monotonic(), time.time()
    cpu0 = cpu_by_component(cl)
    rc = ipperf.run(exe, d / "inference-perf.yaml", d / "inference-perf.log", timeout_s=args.stage_s * 6 + 300,
                    arrival_seed=spec.seed if args.seeded_arrivals else None)
    cpu1 = cpu_by_component(cl)
    (results,), (prompts,) = ipperf.results(d / "reports", 1)
    oracle = workloads.oracle_hits(prompt_items(tok, prompts))
    wall = (max((r.sent_s + (r.latency_s or 0) for r in results), default=0.0)) if results else 0.0
    s = stage_figures(results, oracle, rate, ipperf.load_summaries(d / "reports", 1)[0], args, wall,
                      inference_perf_rc=rc, run_s=round(time.monotonic() - t0, 1), wall_clock=[wall0, time.time()])
    s["cpu"] = cpu_delta(cpu0, cpu1, s["ok"])
    log_stage(log, name, s, f", CPU s/request {s['cpu']['cpu_s_per_request']}")
    return s


def prompt_items(tok, prompts: list[str]) -> list[workloads.WorkItem]:
    """inference-perf's prompts as the server tokenizes them (for the oracle)."""
    return [workloads.WorkItem(tokenize(tok, p) or (0,), 1, 0.0, setup.BENCH_TENANT, setup.BENCH_TENANT)
            for p in prompts]


def group_traffic(prompts: list[str], key_chars: int = 64) -> dict:
    """How one stage's requests spread over the prefix groups (a group = prompts that open with the
    same ``key_chars`` characters of system prompt): groups sent, and the busiest group's share.
    inference-perf restarts its prompt walk every stage, so a group early and often in its seeded
    order is that much hotter in every stage (the default data seed: 9 of the first 35 requests)."""
    counts = Counter(p[:key_chars] for p in prompts)
    n = sum(counts.values())
    return {"groups": len(counts), "top_share": round(max(counts.values()) / n, 3) if n else None,
            "counts": sorted(counts.values(), reverse=True)}


def stage_figures(results: list[Result], oracle: list[int], rate: float, load_summary: dict, args, wall_s: float,
                  **extra) -> dict:
    """One stage's figures: ``loadgen.summarize`` over its own span ``wall_s`` (first send to last
    completion), the rate inference-perf really offered, hit tokens against ``oracle``."""
    s = summarize(results, args.ttft_slo, wall_s=wall_s or None)
    s.update(rate=rate, offered_rate=load_summary.get("achieved_rate"), hit=hit_ratio(results, oracle),
             load_avg=load_avg(), errors_sample=[r.error for r in results if r.error][:3],
             ttft_samples_s=ttft_samples(results), **extra)
    return s


def ttft_samples(results: list[Result]) -> list[float | None]:
    """Each request's TTFT in send order (None: it failed or got no first token), for
    ``cluster_report.bootstrap``."""
    return [round(r.ttft_s, 4) if r.ok and r.ttft_s is not None else None for r in results]


def log_stage(log, name: str, s: dict, tail: str = "") -> None:
    t = s["ttft_s"]
    log(f"{name} @ {s['rate']:g}/s{' (warm-up)' if s.get('warmup') else ''}: {s['ok']}/{s['requests']} ok, "
        f"{s['request_throughput'] or 0:.2f} req/s (offered {_f(s['offered_rate'])}), TTFT p50/p90/p99 "
        f"{_f(t['p50'])}/{_f(t['p90'])}/{_f(t['p99'])} s, hit/oracle {_f(s['hit']['vs_oracle'])}{tail}")


class Sampler:
    """Every ``period_s`` in a thread: the hosts' CPU by component and the app's ``/metrics``,
    stamped with wall-clock time, so that one inference-perf run of several stages can be cut
    into the stages' CPU and routing decisions afterwards."""

    def __init__(self, cl: Cluster, period_s: float = 5.0):
        self.cl, self.period_s = cl, period_s
        self.samples: list[tuple[float, dict, dict]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _take(self) -> None:
        t, cpu = time.time(), cpu_by_component(self.cl)
        code, text = self.cl.get("/metrics", timeout_s=10)
        self.samples.append((t, cpu, parse_prometheus(text) if code == 200 else {}))

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self._take()

    def __enter__(self) -> "Sampler":
        self._take()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._take()

    def at(self, t: float) -> tuple[float, dict, dict]:
        """The first sample taken at or after ``t`` (the last one if none)."""
        return next((x for x in self.samples if x[0] >= t), self.samples[-1])


def warmup_stage(spec: ipperf.SharedPrefixSpec, rate: float, stage_s: int, max_s: int, exe, d: Path, cl: Cluster,
                 mdir) -> tuple[int, str]:
    """The steady sweep's warm-up duration: long enough that every group is sent once before the
    measured stages (inference-perf walks one fixed shuffle of the prompts, so a one-stage warm-up
    of 15 requests showed 9 of 12 groups, and the 1 req/s stage's p99 was the first sight of the
    other three, for every configuration alike), at least ``stage_s``, at most ``max_s``. The
    order is read from inference-perf's own generator (``ipperf.group_order``); where that fails
    the warm-up is one stage. Returns (seconds, what it covers, for the log and the JSON)."""
    if max_s <= stage_s or spec.groups <= 1:
        return stage_s, "one stage"
    probe = d / "groups-probe.yaml"
    setup.dump_yaml(ipperf.config(spec, [rate], stage_s, cl.base_url, "probe", MODEL, str(mdir), d / "probe"), probe)
    try:
        need = ipperf.requests_to_cover(ipperf.group_order(exe, probe))
    except Exception as e:  # noqa: BLE001 - the bench still runs, with the old warm-up
        return stage_s, f"one stage: group order unknown ({type(e).__name__}: {e})"
    secs = min(max_s, max(stage_s, math.ceil(need / rate)))
    sent = int(rate * secs)
    return secs, f"{sent} requests, every group by request {need}" if sent >= need else \
        f"{sent} requests, {need} needed to show every group"


def shared_prefix_steady(cl: Cluster, name: str, args, exe, mdir, tok, rates: list[float], log,
                         hot: bool = False, extend: Sequence[float] = ()) -> list[dict]:
    """The shared-prefix sweep as inference-perf runs one: a single run whose load stages are a
    warm-up at the first rate and then ``rates``, over ONE set of groups (its data generator
    builds one prompt list and every stage walks it from its start), so system prompts stay in
    use from stage to stage as an application's do. Per stage (warm-up first): the same figures
    as ``shared_prefix_rate``, hit tokens against one infinite cache over the whole run (a group
    warmed in an earlier stage is a hit for the oracle too), CPU and routing decisions from a
    ``Sampler`` cut at the stage's wall-clock window.

    ``extend``: higher rates the sweep goes on at, one at a time, while its highest stage so far
    has not saturated (``cluster_report.extends``: p99 TTFT below ``--extend-below-p99``). Each is
    one more inference-perf run of the same data (the same groups and prompts, warm from the
    run before; a stage of the main run would walk the same prompts from the start too) with
    the same seeded arrivals for every configuration, so a configuration the default rates
    leave unsaturated is measured up to where it saturates instead of giving a lower bound."""
    stage_rates = [rates[0], *rates]
    groups = 1 if hot else args.groups
    warm_max = max(args.stage_s, args.warmup_max_s)
    total = rates[0] * warm_max + sum(r * args.stage_s for r in rates)
    users = int(total * 1.3 / groups) + 4
    spec = ipperf.SharedPrefixSpec(groups, users, args.system_len, args.question_len, args.output_len,
                                   seed=(3000 if hot else 4000) + args.data_seed)
    d = cl.out / f"{name.replace('+', '-')}-{'hot' if hot else 'shared'}-steady"
    d.mkdir(parents=True, exist_ok=True)
    warm_s, cover = warmup_stage(spec, rates[0], args.stage_s, warm_max, exe, d, cl, mdir)
    durations = [warm_s] + [args.stage_s] * len(rates)
    log(f"{name}: {'hot' if hot else 'shared'} prefix, one run, warm-up of {warm_s}s ({cover}) + {len(rates)} "
        f"stages of {args.stage_s}s at {', '.join(f'{r:g}' for r in rates)} req/s over {groups} groups "
        f"(inference-perf)")
    out, prompts = ipperf_stages(cl, name, args, exe, mdir, tok, spec, stage_rates, durations, d, log,
                                 warmup_cover=cover)
    for rate in extend:
        top = stage_point(out[-1]) if out and out[-1].get("ok") else None
        if top is None or rate <= top.rate or not report.extends(top, args.extend_below_p99):
            break
        log(f"{name}: the sweep goes on at {rate:g} req/s (p99 TTFT {top.ttft_p99:.2f} s at {top.rate:g} req/s, "
            f"below {args.extend_below_p99:g} s)")
        ext, prompts = ipperf_stages(cl, name, args, exe, mdir, tok, spec, [rate], [args.stage_s],
                                     d.with_name(f"{d.name}-{rate:g}"), log, prior=prompts, extension=True)
        out += ext
    return out


def ipperf_stages(cl: Cluster, name: str, args, exe, mdir, tok, spec: ipperf.SharedPrefixSpec,
                  stage_rates: list[float], durations: list[int], d: Path, log, prior: Sequence[str] = (),
                  warmup_cover: str | None = None, extension: bool = False) -> tuple[list[dict], list[str]]:
    """One inference-perf run of ``spec`` at ``stage_rates`` (the first a warm-up unless
    ``extension``): per stage its figures, and every prompt sent so far (``prior``, the prompts of
    the runs before on this deployment, then this run's: the oracle's cache has seen them all)."""
    d.mkdir(parents=True, exist_ok=True)
    cfg = ipperf.config(spec, stage_rates, durations, cl.base_url, f"sk-{setup.BENCH_TENANT}", MODEL, str(mdir),
                        d / "reports")
    setup.dump_yaml(cfg, d / "inference-perf.yaml")
    with Sampler(cl) as sampler:
        rc = ipperf.run(exe, d / "inference-perf.yaml", d / "inference-perf.log",
                        timeout_s=sum(t * 6 + 120 for t in durations) + 300,
                        arrival_seed=spec.seed if args.seeded_arrivals else None)
    per_stage, prompts = ipperf.results(d / "reports", len(stage_rates), relative=False)
    loads = ipperf.load_summaries(d / "reports", len(stage_rates))
    sent = [*prior, *(p for ps in prompts for p in ps)]
    oracle = workloads.oracle_hits(prompt_items(tok, sent))
    # inference-perf stamps requests with time.perf_counter() (CLOCK_MONOTONIC: one clock for every
    # process here); the sampler and the engines' step traces use wall-clock time
    to_wall = time.time() - time.perf_counter()
    out, k = [], len(prior)
    for i, (results, rate) in enumerate(zip(per_stage, stage_rates)):
        warmup = i == 0 and not extension
        stage_prompts = prompts[i] if i < len(prompts) else []
        stage_oracle, k = oracle[k:k + len(results)], k + len(results)
        if not results:
            out.append({"rate": rate, "requests": 0, "ok": 0, "warmup": warmup, "extension": extension})
            continue
        t0 = min(r.sent_s for r in results) + to_wall
        t1 = max(r.sent_s + (r.latency_s or 0) for r in results) + to_wall
        results = [dataclasses.replace(r, sent_s=r.sent_s + to_wall - t0) for r in results]
        s = stage_figures(results, stage_oracle, rate, loads[i], args, t1 - t0, warmup=warmup, inference_perf_rc=rc,
                          run_s=round(t1 - t0, 1), wall_clock=[t0, t1], groups_sent=group_traffic(stage_prompts),
                          **({"warmup_cover": warmup_cover} if warmup else {}),
                          **({"extension": True} if extension else {}))
        (_, c0, m0), (_, c1, m1) = sampler.at(t0), sampler.at(t1)
        s.update(cpu=cpu_delta(c0, c1, s["ok"]), kvmesh_metrics=decisions(metrics_delta(m0, m1), m1))
        log_stage(log, name, s)
        out.append(s)
    return out, sent


def _f(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def stage_point(s: dict) -> report.Point:
    """A stage's figures as a point of its configuration's curve."""
    return report.Point(s["rate"], s["request_throughput"] or 0.0, s["ttft_s"]["p50"] or 0.0, s["ttft_s"]["p90"] or 0.0,
                        s["ttft_s"]["p99"] or 0.0, s["errors"], s.get("offered_rate"), tuple(s.get("ttft_samples_s") or ()))


def curves(doc: dict, key: str = "shared_prefix") -> dict[str, list[report.Point]]:
    out = {}
    for name, res in doc["configs"].items():
        pts = [stage_point(s) for s in res.get(key, []) if s.get("ok")]
        if pts:
            out[name] = pts
    return out


def series_summary(doc: dict, key: str) -> tuple[dict, dict]:
    """``report.summary`` of one inference-perf series (``shared_prefix`` or ``hot_prefix``) over
    the configurations that ran it, and its TTFT curves; hit tokens are each configuration's
    against the oracle of its own prompts."""
    cv = curves(doc, key)
    ran = {n: r[key] for n, r in doc["configs"].items() if r.get(key)}
    hits = {n: sum(s["hit"]["cached_tokens"] for s in st) for n, st in ran.items()}
    oracle = {n: sum(s["hit"]["oracle_cached_tokens"] for s in st) for n, st in ran.items()}
    s = report.summary(cv, hits, max(oracle.values(), default=0)) if cv else {}
    s["hit_tokens_vs_oracle"] = {**{n: (hits[n] / oracle[n] if oracle[n] else None) for n in hits}, "oracle": 1.0}
    speed = report.host_speed({n: [(x.get("engine_steps") or {}).get("decode_1row_s") for x in st]
                               for n, st in ran.items()})
    if any(speed.values()):
        s["host_speed_decode_1row_s"] = speed
        s["throughput_at_equal_p99_ttft_speed_adjusted"] = report.speed_adjusted(
            s.get("throughput_at_equal_p99_ttft") or {}, speed)
    return s, cv


def worker_cpu_share(doc: dict, key: str = "shared_prefix") -> dict[str, list[dict]]:
    """Per configuration and rate: CPU cores the worker processes used during the stage, and
    that as a share of the worker hosts' capacity (``workers x node_cpus``; None when the hosts
    share the machine's cores). A saturated throughput with a share well below 1 is capacity a
    router left idle (or that the hosts' own Ray processes took); near 1, no router can serve more."""
    args = doc.get("args") or {}
    cap = (args.get("workers") or 0) * (args.get("node_cpus") or 0)
    out: dict[str, list[dict]] = {}
    for name, res in doc["configs"].items():
        for st in res.get(key) or []:
            cpu, run_s = st.get("cpu") or {}, st.get("run_s")
            if not run_s or "worker" not in cpu.get("cpu_s", {}):
                continue
            cores = cpu["cpu_s"]["worker"] / run_s
            out.setdefault(name, []).append({"rate": st["rate"], "worker_cores": round(cores, 3),
                                             "share": round(cores / cap, 3) if cap else None})
    return out


def finish(doc: dict, out_json: Path) -> None:
    s, cv = series_summary(doc, "shared_prefix")
    s["worker_cpu_share"] = worker_cpu_share(doc)
    hit_by_cfg = {n: v for n, v in s["hit_tokens_vs_oracle"].items() if n != "oracle"}
    hot_summary, hot = series_summary(doc, "hot_prefix")
    if hot:
        s["hot_prefix"] = hot_summary
    doc["summary"] = s
    if cv:
        doc["targets"] = report.targets(s)
    ratios = {"shared_prefix": dict(hit_by_cfg)}
    if hot:
        ratios["hot_prefix"] = {n: v for n, v in hot_summary["hit_tokens_vs_oracle"].items() if n != "oracle"}
    for n, r in doc["configs"].items():
        for w, ws in (r.get("workloads") or {}).items():
            ratios.setdefault(w, {})[n] = ws["hit"]["vs_oracle"]
    doc["hit_ratios"] = ratios
    write(doc, out_json)
    if cv:
        report.plot({**cv, **{f"{n} (hot)": c for n, c in hot.items()}}, ratios, out_json.with_suffix(".png"))
    print_table(doc)


def resummarize(path: Path, run_dir: Path | None = None) -> dict:
    """Recompute the written run at ``path`` with the current ``cluster_report`` (JSON and PNG in
    place). With ``run_dir`` (the run's ``cluster_run`` directory, or a paired run's), first fill in the TTFT samples
    that stages written before they were kept lack, from inference-perf's reports there; a stage
    whose reports do not give its recorded request count and p99 stops it."""
    doc = json.loads(path.read_text())
    for name, res in doc["configs"].items() if run_dir is not None else ():
        for key, kind in (("shared_prefix", "shared"), ("hot_prefix", "hot")):
            stages = res.get(key) or []
            sub = f"{name.replace('+', '-')}-{kind}-steady/reports"
            # a paired run (bench/cluster_paired.py) keeps each configuration's under <name>/cluster_run
            reports = next((d for d in (run_dir / sub, run_dir / name / "cluster_run" / sub) if d.is_dir()), None)
            if not stages or all("ttft_samples_s" in st for st in stages) or reports is None:
                continue
            per_stage, _ = ipperf.results(reports, len(stages) + 1)  # the warm-up stage first
            for st, results in zip(stages, per_stage[1:]):
                samples = ttft_samples(results)
                p99 = percentile([x for x in samples if x is not None], 99)
                if len(results) != st["requests"] or p99 is None or abs(p99 - st["ttft_s"]["p99"]) > 1e-3:
                    raise SystemExit(f"{reports}: the stage at {st['rate']:g} req/s does not match {path}")
                st["ttft_samples_s"] = samples
    finish(doc, path)
    return doc


def write(doc: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, default=str))


def print_table(doc: dict) -> None:
    print(f"\nmachine: {doc['machine']}  load avg start {doc['load_avg'].get('start')} end {doc['load_avg'].get('end')}")
    print(f"{'config':14s} {'rate':>5s} {'offer':>5s} {'ok':>7s} {'req/s':>6s} {'tok/s':>6s} {'p50':>6s} {'p90':>6s} "
          f"{'p99':>6s} {'tpot':>6s} {'good':>6s} {'hit/or':>6s}  routes")
    for name, res in doc["configs"].items():
        series = [("", x) for x in res.get("shared_prefix", [])] + [("hot ", x) for x in res.get("hot_prefix", [])]
        for key, s in series:
            t = s["ttft_s"]
            print(f"{key + name:14s} {s['rate']:5.2f} {_f(s.get('offered_rate')):>5s} {s['ok']:3d}/{s['requests']:<3d} "
                  f"{s['request_throughput'] or 0:6.2f} "
                  f"{s['output_token_throughput'] or 0:6.1f} {_f(t['p50']):>6s} {_f(t['p90']):>6s} {_f(t['p99']):>6s} "
                  f"{_f(s['tpot_s']['p50']):>6s} {s['goodput'] or 0:6.2f} {_f(s['hit']['vs_oracle']):>6s}  "
                  f"{s.get('kvmesh_metrics', {}).get('routes', {})}")
            st = s.get("kvmesh_metrics", {}).get("stage_means_s")
            if st:
                print(f"{'':14s} time to first token by stage, mean s: " + ", ".join(f"{k} {v:.3f}" for k, v in st.items()))
        for w, s in (res.get("workloads") or {}).items():
            t = s["ttft_s"]
            print(f"{name:14s} {w:>13s} {s['ok']:3d}/{s['requests']:<3d} p50/p90/p99 {_f(t['p50'])}/{_f(t['p90'])}/"
                  f"{_f(t['p99'])} hit/oracle {_f(s['hit']['vs_oracle'])}")
    print("summary:", json.dumps(doc.get("summary", {}).get("throughput_at_equal_p99_ttft")),
          "hit vs oracle:", json.dumps(doc.get("summary", {}).get("hit_tokens_vs_oracle")),
          "p90 affinity/kvmesh:", doc.get("summary", {}).get("ttft_p90_affinity_over_kvmesh"))
    for key, b in (doc.get("summary", {}).get("bootstrap") or {}).items():
        if isinstance(b, dict):
            print(f"{key}: 90% of {doc['summary']['bootstrap']['replicates']} resamples of the requests within "
                  f"{_f(b['p05'])}-{_f(b['p95'])} (median {_f(b['p50'])}), target met in {b['met_share']:.0%}"
                  + (f", a lower bound in {b['lower_bound_share']:.0%}" if b["lower_bound_share"] else ""))
    if doc.get("summary", {}).get("host_speed_decode_1row_s"):
        print("hosts' speed (one-row decode step, s):", json.dumps(doc["summary"]["host_speed_decode_1row_s"]),
              "throughput ratios adjusted to equal speed (an estimate):",
              json.dumps(doc["summary"].get("throughput_at_equal_p99_ttft_speed_adjusted")))
    for name, pts in (doc.get("summary", {}).get("worker_cpu_share") or {}).items():
        print(f"worker CPU share of the hosts' capacity, {name}:",
              ", ".join(f"{p['rate']:g}/s {_f(p['share'])}" for p in pts))
    hot = doc.get("summary", {}).get("hot_prefix")
    if hot:
        print("hot prefix:", json.dumps(hot.get("throughput_at_equal_p99_ttft")), "hit vs oracle:",
              json.dumps(hot.get("hit_tokens_vs_oracle")), "p90 affinity/kvmesh:",
              hot.get("ttft_p90_affinity_over_kvmesh"), "p90 pow2/kvmesh:", hot.get("ttft_p90_pow2_over_kvmesh"))
    for k, v in (doc.get("targets") or {}).items():
        print(f"  target {k}: {v['value']} (>= {v['target']}) {'met' if v['met'] else 'NOT met'}")
    print("leftovers:", doc.get("leftovers"))


if __name__ == "__main__":
    main()
