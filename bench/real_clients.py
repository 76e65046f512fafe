"""Third-party load generators against the served app: aiperf (NVIDIA) and guidellm (vLLM project).

Each tool runs from its own venv (``bench/client_venvs.py``) against ``/v1/completions`` and
``/v1/chat/completions``, streaming and not, with the options their users pass: synthetic prompts
of ``--isl`` tokens counted by the default model's own tokenizer (a local directory: no hub
download), a fixed output length (``--osl``, sent as ``max_tokens``/``max_completion_tokens``
with ``ignore_eos``; aiperf also sends ``min_tokens``), streaming with ``stream_options``
(include_usage; guidellm also continuous_usage_stats), and a sweep of concurrency levels in one
invocation per (endpoint, streaming). Per run it records the tool's own summary (requests ok /
failed, TTFT, ITL, throughput) and what the server counted (``kvmesh_requests_total`` by status,
from ``/metrics``), so a request the tool reports as failed can be told from one kvmesh refused.

``--serve`` starts the app the way a user does (``python -m cluster.serve_cli run
cluster/serve.yaml``, what ``make serve`` runs: default model, 127.0.0.1:8000), waits for it,
runs the tools and stops it with SIGINT by its PID (then SIGTERM/SIGKILL, and any Ray process of
its own RAY_TMPDIR left is listed and killed by PID). Without ``--serve`` it drives ``--base-url``.

  python bench/real_clients.py --serve [--tools aiperf,guidellm] [--concurrency 1,4,8] [--requests 16]
Writes ``--out`` (default bench/results/real_clients.json; an existing file keeps the other
tools' entries) and prints one line per (tool, endpoint, streaming, concurrency).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import client_venvs  # noqa: E402
from bench.serve_sigint import describe, ours, port_free, wait_health  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
KEY = "sk-acme-demo"  # cluster/tenants.yaml's demo tenant (max_concurrent 32, 50 requests/s)
MODEL = "SmolLM2-135M-Instruct"
ENDPOINTS = ("completions", "chat")


def tokenizer_dir() -> str:
    from engine.model_loader import resolve_model_dir

    return str(resolve_model_dir("default")[1])


# -- the tools' command lines -----------------------------------------------------------------
def aiperf_cmd(exe: str, base_url: str, key: str, model: str, tok: str, endpoint: str, stream: bool,
               concurrency: list[int], requests: int, isl: int, osl: int, out_dir: Path) -> list[str]:
    cmd = [exe, "profile", "--model", model, "--url", base_url, "--endpoint-type", endpoint, "--api-key", key,
           "--tokenizer", tok, "--synthetic-input-tokens-mean", str(isl), "--synthetic-input-tokens-stddev", "0",
           "--output-tokens-mean", str(osl), "--output-tokens-stddev", "0",
           "--extra-inputs", "ignore_eos:true", "--extra-inputs", f"min_tokens:{osl}",
           "--concurrency", ",".join(map(str, concurrency)), "--request-count", str(requests),
           "--warmup-request-count", "1", "--random-seed", "0",
           "--ui", "none", "--no-gpu-telemetry", "--artifact-dir", str(out_dir)]
    if stream:
        cmd += ["--streaming", "--use-server-token-count"]
        if endpoint == "chat":  # aiperf asks for continuous_usage_stats on chat only
            cmd += ["--per-chunk-usage"]
    return cmd


def guidellm_cmd(exe: str, base_url: str, key: str, model: str, tok: str, endpoint: str, stream: bool,
                 concurrency: list[int], requests: int, isl: int, osl: int, out_json: Path) -> list[str]:
    fmt = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
    backend = f"kind=openai_http,target={base_url},model={model},api_key={key},request_format={fmt}"
    if not stream:
        backend += ",stream=false"
    return [exe, "run", "--backend", backend, "--profile", "kind=concurrent,streams=1",
            "--override", "profile.streams", ",".join(map(str, concurrency)),
            "--constraint", f"kind=max_requests,count={requests}",
            "--data", f"kind=synthetic_text,prompt_tokens={isl},output_tokens={osl}",
            "--tokenizer", f"kind=huggingface_auto,model={tok}",
            "--seed", "kind=static,value=0",
            "--output", f"kind=json,path={out_json}", "--disable-console-interactive"]


def tool_env(tool: str) -> dict:
    """The tool's environment: its own venv's packages (no kvmesh PYTHONPATH), no hub access.
    aiperf 0.13 cannot load a tokenizer *directory* with HF_HUB_OFFLINE set (offline it looks the
    name up as a hub cache entry): it runs without it and reads the local directory (no download)."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_DISABLE_TELEMETRY": "1",
           "HF_DATASETS_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)
    if tool == "aiperf":
        env.pop("HF_HUB_OFFLINE", None)
        env.pop("TRANSFORMERS_OFFLINE", None)
    else:
        env["HF_HUB_OFFLINE"] = "1"
    return env


# -- their summaries -------------------------------------------------------------------------
def _m(d: dict, name: str, stat: str = "avg"):
    v = (d.get(name) or {}).get(stat)
    return round(float(v), 3) if v is not None else None


def aiperf_summary(run_dir: Path) -> dict:
    """One concurrency level's summary from aiperf's ``profile_export_aiperf.json``."""
    p = run_dir / "profile_export_aiperf.json"
    if not p.exists():
        return {"error": f"no {p.name}"}
    d = json.loads(p.read_text())
    total = _m(d, "request_count") or 0
    errors = sum(int(e.get("count", 0)) for e in (d.get("error_summary") or []))
    return {"requests_ok": int(total), "requests_failed": errors,
            "errors": [{"count": e.get("count"), "detail": e.get("error_details")}
                       for e in d.get("error_summary") or []],
            "ttft_ms_p50": _m(d, "time_to_first_token", "p50"), "ttft_ms_p99": _m(d, "time_to_first_token", "p99"),
            "itl_ms_p50": _m(d, "inter_token_latency", "p50"), "itl_ms_p99": _m(d, "inter_token_latency", "p99"),
            "latency_ms_p50": _m(d, "request_latency", "p50"),
            "output_tokens_per_request": _m(d, "output_sequence_length"),
            "input_tokens_per_request": _m(d, "input_sequence_length"),
            "output_tokens_per_s": _m(d, "output_token_throughput"), "requests_per_s": _m(d, "request_throughput"),
            "cached_prompt_tokens_per_request": _m(d, "usage_prompt_cache_read_tokens")}


def _g(metric: dict | None, stat: str, status: str = "successful"):
    s = (metric or {}).get(status) or {}
    v = s.get("median") if stat == "p50" else (s.get("percentiles") or {}).get(stat) if stat.startswith("p") \
        else s.get(stat)
    return round(float(v), 3) if v is not None else None


def guidellm_summaries(out_json: Path) -> list[dict]:
    """One summary per benchmark (concurrency level) of guidellm's JSON report."""
    if not out_json.exists():
        return [{"error": f"no {out_json.name}"}]
    rep = json.loads(out_json.read_text())
    out = []
    for b in rep.get("benchmarks") or []:
        m = b.get("metrics") or {}
        made = (b.get("scheduler_metrics") or {}).get("requests_made") or {}
        prof = (b.get("config") or {}).get("strategy") or {}
        errored = (b.get("requests") or {}).get("errored") or []
        errs = [r.get("info", {}).get("error") or r.get("error") for r in errored]
        out.append({"concurrency": prof.get("streams") or prof.get("max_concurrency"),
                    "requests_ok": made.get("successful"), "requests_failed": made.get("errored"),
                    "requests_incomplete": made.get("incomplete"), "errors": [e for e in errs if e][:5],
                    "ttft_ms_p50": _g(m.get("time_to_first_token_ms"), "p50"),
                    "ttft_ms_p99": _g(m.get("time_to_first_token_ms"), "p99"),
                    "itl_ms_p50": _g(m.get("inter_token_latency_ms"), "p50"),
                    "itl_ms_p99": _g(m.get("inter_token_latency_ms"), "p99"),
                    "latency_ms_p50": (lambda v: None if v is None else round(v * 1000, 3))(
                        _g(m.get("request_latency"), "p50")),
                    "output_tokens_per_request": _g(m.get("output_token_count"), "mean"),
                    "input_tokens_per_request": _g(m.get("prompt_token_count"), "mean"),
                    "output_tokens_per_s": _g(m.get("output_tokens_per_second"), "mean"),
                    "requests_per_s": _g(m.get("requests_per_second"), "mean")})
    return out


# -- what the server counted ------------------------------------------------------------------
_REQ = re.compile(r'^kvmesh_requests_total\{([^}]*)\}\s+([0-9.eE+]+)', re.M)


def server_counts(base_url: str) -> dict[str, float]:
    """``kvmesh_requests_total`` by "endpoint code" (all tenants) from /metrics."""
    try:
        text = httpx.get(f"{base_url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    out: dict[str, float] = {}
    for labels, v in _REQ.findall(text):
        kv = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        k = f"{kv.get('endpoint')} {kv.get('code')}"
        out[k] = out.get(k, 0.0) + float(v)
    return out


def delta(after: dict, before: dict) -> dict:
    return {k: int(v - before.get(k, 0)) for k, v in sorted(after.items()) if v - before.get(k, 0)}


# -- one invocation ---------------------------------------------------------------------------
def run_tool(tool: str, exe: str, base_url: str, key: str, endpoint: str, stream: bool, args, work: Path) -> list[dict]:
    tok = tokenizer_dir()
    name = f"{tool}-{endpoint}-{'stream' if stream else 'whole'}"
    out_dir = work / name
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    if tool == "aiperf":
        cmd = aiperf_cmd(exe, base_url, key, args.model, tok, endpoint, stream, args.concurrency, args.requests,
                         args.isl, args.osl, out_dir)
    else:
        cmd = guidellm_cmd(exe, base_url, key, args.model, tok, endpoint, stream, args.concurrency, args.requests,
                           args.isl, args.osl, out_dir / "benchmarks.json")
    before = server_counts(base_url)
    t0 = time.monotonic()
    with open(out_dir / "tool.log", "wb") as log:
        try:
            rc = subprocess.run(cmd, cwd=out_dir, env=tool_env(tool), stdout=log, stderr=subprocess.STDOUT,
                                timeout=args.tool_timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    wall = round(time.monotonic() - t0, 1)
    counted = delta(server_counts(base_url), before)
    if tool == "aiperf":
        levels = [dict(concurrency=c, **aiperf_summary(out_dir / f"concurrency_{c}" if len(args.concurrency) > 1
                                                      else out_dir)) for c in args.concurrency]
    else:
        levels = guidellm_summaries(out_dir / "benchmarks.json")
    if not stream:  # no first token to time without streaming (guidellm writes 0.0 there)
        for lv in levels:
            lv.update({k: None for k in ("ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99")})
    shown = [a if a != key else "<key>" for a in cmd]
    shown[0] = Path(cmd[0]).name
    return [{"tool": tool, "endpoint": endpoint, "stream": stream, "rc": rc, "wall_s": wall, "artifacts": str(out_dir),
             "command": " ".join(shown), "server_counted": counted, "levels": levels}]


# -- the served app ---------------------------------------------------------------------------
class ServedApp:
    """``make serve``'s command (cluster/serve.yaml, 127.0.0.1:8000) in its own session and RAY_TMPDIR."""

    def __init__(self, log_path: Path, ready_timeout_s: float = 600.0):
        self.log_path, self.ready_timeout_s = log_path, ready_timeout_s
        self.proc: subprocess.Popen | None = None
        self.tmp = tempfile.mkdtemp(prefix="i17rc-", dir="/tmp")  # short: Ray's socket paths must fit
        self.info: dict = {}

    def __enter__(self) -> str:
        if not port_free(8000):
            raise RuntimeError("port 8000 is taken: wait for the other run, then retry")
        env = {**os.environ, "RAY_ADDRESS": "local", "RAY_TMPDIR": self.tmp, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
               "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT)}
        cmd = [sys.executable, "-m", "cluster.serve_cli", "run", "cluster/serve.yaml"]
        self.log = open(self.log_path, "wb")
        t0 = time.monotonic()
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        url = "http://127.0.0.1:8000"
        wait_health(url, self.proc, self.ready_timeout_s)
        r = httpx.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=300,
                       json={"model": MODEL, "prompt": "Hello", "max_tokens": 2})
        r.raise_for_status()
        self.info = {"command": "RAY_ADDRESS=local python -m cluster.serve_cli run cluster/serve.yaml",
                     "pid": self.proc.pid, "ready_s": round(time.monotonic() - t0, 1)}
        return url

    def __exit__(self, *exc) -> None:
        p = self.proc
        if p is None:
            return
        t0 = time.monotonic()
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
            try:
                p.wait(90)
            except subprocess.TimeoutExpired:
                p.terminate()
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(10)
        self.info["stopped_after_s"] = round(time.monotonic() - t0, 1)
        end = time.monotonic() + 30
        left = ours(p.pid, self.tmp)
        while left and time.monotonic() < end:
            time.sleep(0.5)
            left = ours(p.pid, self.tmp)
        self.info["leftover_pids"] = describe(left)
        for q in left:
            try:
                q.kill()
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.log.close()


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tools", default="aiperf,guidellm")
    ap.add_argument("--endpoints", default=",".join(ENDPOINTS))
    ap.add_argument("--streams", default="1,0", help="1 = streaming, 0 = whole responses")
    ap.add_argument("--serve", action="store_true", help="start `make serve`'s app on 127.0.0.1:8000 and stop it after")
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--api-key", default=KEY)
    ap.add_argument("--model", default=MODEL, help="the model name the tools send")
    ap.add_argument("--concurrency", type=_ints, default=[1, 4, 8])
    ap.add_argument("--requests", type=int, default=8, help="requests per concurrency level")
    ap.add_argument("--isl", type=int, default=256, help="prompt tokens")
    ap.add_argument("--osl", type=int, default=32, help="output tokens")
    ap.add_argument("--tool-timeout-s", type=float, default=240)
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "kvmesh-real-clients")
    ap.add_argument("--out", type=Path, default=RESULTS / "real_clients.json")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout` ends us: still stop the app (finally)
    tools = [t for t in args.tools.split(",") if t]
    exes = {t: str(client_venvs.ensure_venv(t)) for t in tools}
    args.work.mkdir(parents=True, exist_ok=True)
    report = json.loads(args.out.read_text()) if args.out.exists() else {}
    report.update({"machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                               "processor": platform.processor() or platform.machine()},
                   "model": args.model, "tenant_key": args.api_key, "isl": args.isl, "osl": args.osl,
                   "requests_per_level": args.requests, "concurrency": args.concurrency})
    report.setdefault("tools", {})
    serve = ServedApp(args.work / "serve.log") if args.serve else None
    base = serve.__enter__() if serve else args.base_url
    try:
        for tool in tools:
            runs = []
            for endpoint in [e for e in args.endpoints.split(",") if e]:
                for stream in [s == "1" for s in args.streams.split(",") if s]:
                    for r in run_tool(tool, exes[tool], base, args.api_key, endpoint, stream, args, args.work):
                        runs.append(r)
                        for lv in r["levels"]:
                            print(f"{tool:8s} {endpoint:11s} stream={int(stream)} c={lv.get('concurrency')} "
                                  f"ok={lv.get('requests_ok')} failed={lv.get('requests_failed')} "
                                  f"ttft_p50={lv.get('ttft_ms_p50')}ms itl_p50={lv.get('itl_ms_p50')}ms "
                                  f"out_tok/s={lv.get('output_tokens_per_s')} server={r['server_counted']} "
                                  f"rc={r['rc']}",
                                  flush=True)
            done = {(r["endpoint"], r["stream"]) for r in runs}  # a partial rerun keeps the other runs
            old = (report["tools"].get(tool) or {}).get("runs", [])
            kept = [r for r in old if (r["endpoint"], r["stream"]) not in done]
            order = sorted(kept + runs, key=lambda r: (r["endpoint"] != "completions", not r["stream"]))
            report["tools"][tool] = {"version": client_venvs.installed_version(tool), "runs": order}
    finally:
        if serve:
            serve.__exit__(None, None, None)
            report["serve"] = serve.info
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
