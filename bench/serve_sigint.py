"""Does ``serve run`` (``make serve``) stop on Ctrl-C? Start it, wait for /health, send one
completion, send SIGINT, time until it exits.

The app is ``cluster/serve.yaml`` with the model replaced (``--model``, ``tiny-llama`` by default
to be fast) and Serve's HTTP on 127.0.0.1 at a free port. Ray runs locally (``RAY_ADDRESS=local``)
under its own ``RAY_TMPDIR`` (a fresh temp dir), so every Ray process this run started can be
found by that dir (in its command line or environment) and by descent from the ``serve run``
PID, and nothing of other Ray clusters on the machine is touched. If ``serve run`` has not exited
``--deadline-s`` after SIGINT it gets SIGTERM, then SIGKILL; any process of ours still alive
afterwards is listed (``leftover_pids``) and then killed by PID.

``--launcher kvmesh`` starts ``python -m cluster.serve_cli run`` (what ``make serve`` runs) instead of
Ray's ``serve run``; ``--ignored-sigint`` starts it with SIGINT ignored, as a script's ``cmd &``
does (Ray's ``serve run`` then ignores SIGINT: the cause of "Ctrl-C does not stop make serve" seen
from a harness); ``--streaming`` keeps a long stream open at SIGINT.
``--make`` runs ``make serve`` itself instead (the shipped config, default model, port 8000; only
when that port is free) and sends SIGINT to make's process group, as a terminal's Ctrl-C does.

  nice -n 5 .venv/bin/python bench/serve_sigint.py [--model tiny-llama] [--make] [--out FILE]
Prints the seconds from SIGINT to exit and writes JSON (``--out``; default
bench/results/serve_sigint.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from cluster.loopback import free_port, port_free  # noqa: E402

RESULTS = ROOT / "bench" / "results"
SERVE = Path(sys.executable).parent / "serve"
KEY = "sk-acme-demo"  # cluster/tenants.yaml's demo tenant


def write_config(path: Path, model: str, port: int) -> None:
    cfg = yaml.safe_load((ROOT / "cluster" / "serve.yaml").read_text())
    cfg["http_options"] = {**cfg.get("http_options", {}), "host": "127.0.0.1", "port": port}
    for app in cfg["applications"]:
        app["args"]["model"] = model
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))


def ours(root_pid: int, tmp: str) -> list[psutil.Process]:
    """Live processes of this run: ``root_pid``'s descendants and any process naming ``tmp`` (our
    RAY_TMPDIR) in its command line or environment. Zombies are left out (nothing to end)."""
    found: dict[int, psutil.Process] = {}
    try:
        root = psutil.Process(root_pid)
        for p in [root, *root.children(recursive=True)]:
            found[p.pid] = p
    except psutil.Error:
        pass
    me = os.getpid()
    for p in psutil.process_iter(["pid", "cmdline"]):
        if p.pid in found or p.pid == me:
            continue
        try:
            if any(tmp in a for a in (p.info["cmdline"] or ())) or p.environ().get("RAY_TMPDIR") == tmp:
                found[p.pid] = p
        except psutil.Error:
            pass
    alive = []
    for p in found.values():
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
        except psutil.Error:
            pass
    return alive


def describe(procs: list[psutil.Process]) -> list[str]:
    out = []
    for p in procs:
        try:
            out.append(f"{p.pid} {' '.join(p.cmdline())[:120]}")
        except psutil.Error:
            pass
    return out


def wait_health(url: str, proc: subprocess.Popen, timeout_s: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"serve run exited early with {proc.returncode}")
        try:
            r = httpx.get(f"{url}/health", timeout=5)
            if r.status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"/health did not answer 200 within {timeout_s:.0f} s")


def run_once(model: str = "tiny-llama", deadline_s: float = 120.0, ready_timeout_s: float = 300.0,
             make: bool = False, group: bool = False, log_path: Path | None = None, inherit_ignored_sigint: bool = False,
             streaming: bool = False, launcher: str = "serve") -> dict:
    """One start / request / SIGINT cycle; returns what happened (never leaves a process of ours).
    ``group``: SIGINT goes to the whole process group, as a terminal's Ctrl-C (always with ``make``).
    ``inherit_ignored_sigint``: start it with SIGINT ignored, as a non-interactive shell starts a
    background job (``serve run ... &`` in a script): Python then never raises KeyboardInterrupt.
    ``streaming``: a long streamed completion is open when SIGINT comes.
    ``launcher``: "serve" (Ray's CLI) or "kvmesh" (``cluster.serve_cli``, what ``make serve`` runs)."""
    tmp = tempfile.mkdtemp(prefix="i14sig-", dir="/tmp")  # short: Ray's socket paths must fit
    env = {**os.environ, "RAY_ADDRESS": "local", "RAY_TMPDIR": tmp, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT)}
    env.pop("RAY_DASHBOARD_ADDRESS", None)
    if make:
        port = 8000
        if not port_free(port):
            raise RuntimeError("port 8000 is taken: `make serve` cannot run here now")
        venv = Path(sys.executable).parents[1]  # this venv (a worktree has none): never reinstall it
        cmd = ["make", "serve", f"VENV={venv}", "-o", f"{venv}/.kvmesh-setup-done"]
    else:
        port = free_port()
        cfg = Path(tmp) / "serve.yaml"
        write_config(cfg, model, port)
        cmd = ([str(SERVE)] if launcher == "serve" else [sys.executable, "-m", "cluster.serve_cli"]) + ["run", str(cfg)]
    url = f"http://127.0.0.1:{port}"
    log_path = log_path or Path(tmp) / "serve_run.log"
    group = group or make
    out: dict = {"cmd": cmd, "model": "default" if make else model, "sigint_to": "process group" if group else "pid", "port": port, "ray_tmpdir": tmp,
                 "log": str(log_path)}
    with open(log_path, "wb") as logf:
        t_start = time.monotonic()
        # its own session: a Ctrl-C (SIGINT to the process group) can be sent without hitting us
        pre = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if inherit_ignored_sigint else None
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=pre)
        out["sigint_ignored_at_start"] = inherit_ignored_sigint
        stream = None
        out["pid"] = proc.pid
        try:
            out["ready_s"] = round(wait_health(url, proc, ready_timeout_s) + 0, 1)
            r = httpx.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=120,
                           json={"model": "default", "prompt": "Hello there", "max_tokens": 4, "temperature": 0})
            out["completion_status"] = r.status_code
            out["processes_before"] = len(ours(proc.pid, tmp))
            if streaming:  # a long stream in flight (read by nobody: it stays open) when SIGINT comes
                stream = subprocess.Popen(
                    ["curl", "-sN", "-m", str(int(deadline_s + 60)), f"{url}/v1/completions", "-H",
                     f"Authorization: Bearer {KEY}", "-H", "Content-Type: application/json", "-d",
                     json.dumps({"model": "default", "prompt": "Once upon a time", "max_tokens": 400,
                                 "ignore_eos": True, "stream": True})], stdout=subprocess.DEVNULL)
                time.sleep(3)
            t_sig = time.monotonic()
            if group:
                os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
            else:
                proc.send_signal(signal.SIGINT)
            try:
                proc.wait(deadline_s)
                out["exited_after_sigint_s"] = round(time.monotonic() - t_sig, 1)
                out["exit_code"] = proc.returncode
            except subprocess.TimeoutExpired:
                out["exited_after_sigint_s"] = None
        finally:
            if streaming and stream is not None:
                stream.kill()
                stream.wait()
            if proc.poll() is None:
                out["needed"] = "SIGTERM"
                proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    out["needed"] = "SIGKILL"
                    proc.kill()
                    proc.wait(10)
            # Ray's processes end a little after the driver: give them a bounded while
            t_end = time.monotonic() + 30
            left = ours(proc.pid, tmp)
            while left and time.monotonic() < t_end:
                time.sleep(0.5)
                left = ours(proc.pid, tmp)
            out["leftover_pids"] = describe(left)
            for p in left:
                try:
                    p.kill()
                except psutil.Error:
                    pass
            out["wall_s"] = round(time.monotonic() - t_start, 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--make", action="store_true", help="run `make serve` (default model, port 8000)")
    ap.add_argument("--group", action="store_true", help="SIGINT to the process group (Ctrl-C), not the PID")
    ap.add_argument("--ignored-sigint", action="store_true", help="start it with SIGINT ignored (a script's `&`)")
    ap.add_argument("--streaming", action="store_true", help="a long streamed completion open at SIGINT")
    ap.add_argument("--launcher", choices=("serve", "kvmesh"), default="serve",
                    help="Ray's `serve` CLI or cluster.serve_cli (what `make serve` runs)")
    ap.add_argument("--deadline-s", type=float, default=120.0)
    ap.add_argument("--out", default=str(RESULTS / "serve_sigint.json"))
    args = ap.parse_args()
    res = run_once(args.model, args.deadline_s, make=args.make, group=args.group,
                   inherit_ignored_sigint=args.ignored_sigint, streaming=args.streaming,
                   launcher=args.launcher)
    res["machine"] = {"platform": platform.platform(), "cpus": os.cpu_count(), "loadavg": os.getloadavg()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))
    print(f"SIGINT -> exit: {res.get('exited_after_sigint_s')} s (deadline {args.deadline_s:.0f} s); "
          f"leftover processes: {len(res['leftover_pids'])}; wrote {args.out}")


if __name__ == "__main__":
    main()
