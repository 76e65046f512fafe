"""inference-perf (PyPI ``inference-perf``, kubernetes-sigs) as the shared-prefix load generator.

It needs Python >= 3.12, so it gets its own venv (``ensure_venv``: ``python3.12 -m venv`` under
the kvmesh cache, ``pip install inference-perf==VERSION`` once). ``config`` writes its YAML: the
``shared_prefix`` data generator (groups x users, system prompt / question / output lengths, a
seed), a Poisson rate sweep as ``load.stages``, streaming completions against the endpoint with
the tenant's API key, the model's own tokenizer directory, per-request reports. ``run`` runs it
as a separate process; ``results`` reads its per-request report back as ``bench.loadgen.Result``s
split by stage (stage sizes from its per-stage reports), with the server's ``usage`` (prompt and
cached tokens) and the prompts (for the oracle).
"""

from __future__ import annotations

import fcntl
import glob
import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from bench.loadgen import Result

VERSION = "0.7.0"
CACHE = Path(os.environ.get("KVMESH_CACHE", Path.home() / ".cache" / "kvmesh"))


def find_python(names: tuple[str, ...], pyenv_glob: str, check: str, missing: str) -> str:
    """The first of ``names`` on PATH, else of pyenv's interpreters matching ``pyenv_glob``, for
    which ``check`` (a Python expression on ``sys``) holds; ``missing`` is the error otherwise."""
    candidates = [shutil.which(n) for n in names]
    candidates += sorted(glob.glob(str(Path.home() / ".pyenv" / "versions" / pyenv_glob)))
    for c in candidates:
        if c and subprocess.run([c, "-c", f"import sys; assert {check}"], capture_output=True).returncode == 0:
            return c
    raise RuntimeError(missing)


def find_python312() -> str:
    """A Python >= 3.12 interpreter: ``python3.12``/``python3.13`` on PATH, else pyenv's."""
    return find_python(("python3.12", "python3.13"), "3.1[2-9]*/bin/python3.1[2-9]", "sys.version_info >= (3, 12)",
                       "inference-perf needs Python >= 3.12 and none was found (python3.12 or pyenv)")


def ensure_venv(cache: Path = CACHE) -> Path:
    """The ``inference-perf`` executable of its own venv (created and installed once)."""
    venv = cache / "venv-inference-perf"
    exe = venv / "bin" / "inference-perf"
    if exe.exists():
        return exe
    cache.mkdir(parents=True, exist_ok=True)
    # paired runs start several processes at once on a fresh machine: one installs, the others wait
    # (two creating one venv at once failed: 'python3.12 -m venv' returned 1 in the second)
    with open(cache / "venv-inference-perf.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not exe.exists():
            subprocess.run([find_python312(), "-m", "venv", str(venv)], check=True)
            subprocess.run([str(venv / "bin" / "pip"), "install", "-q", f"inference-perf=={VERSION}"], check=True)
    return exe


@dataclass(frozen=True)
class SharedPrefixSpec:
    groups: int
    users: int
    system_len: int
    question_len: int
    output_len: int
    seed: int = 0

    @property
    def distinct_prefix_tokens(self) -> int:
        return self.groups * self.system_len

    @property
    def prompts(self) -> int:
        return self.groups * self.users


def config(spec: SharedPrefixSpec, rates: list[float], stage_s: int | list[int], base_url: str, api_key: str,
           model: str, tokenizer_dir: str, out_dir: Path, interval_s: float = 3.0, timeout_s: float = 120.0) -> dict:
    """inference-perf's config for one configuration's sweep (``stage_s``: one duration for every
    stage, or one per stage; a Poisson stage sends ``int(rate x duration)`` requests)."""
    durations = list(stage_s) if isinstance(stage_s, (list, tuple)) else [stage_s] * len(rates)
    return {
        "api": {"type": "completion", "streaming": True},
        "data": {"type": "shared_prefix", "shared_prefix": {
            "num_groups": spec.groups, "num_prompts_per_group": spec.users, "system_prompt_len": spec.system_len,
            "question_len": spec.question_len, "output_len": spec.output_len, "seed": spec.seed}},
        "load": {"type": "poisson", "interval": interval_s, "stages": [{"rate": r, "duration": d} for r, d in zip(rates, durations, strict=True)],
                 "num_workers": 1, "worker_max_concurrency": 256, "request_timeout": timeout_s, "base_seed": spec.seed},
        "server": {"type": "vllm", "model_name": model, "base_url": base_url, "ignore_eos": True, "api_key": api_key},
        "tokenizer": {"pretrained_model_name_or_path": tokenizer_dir},
        "report": {"request_lifecycle": {"summary": True, "per_stage": True, "per_request": True,
                                         "per_request_fields": {"computed_metrics": True, "response_chunks": False,
                                                                "response": False}}},
        "storage": {"local_storage": {"path": str(out_dir)}},
    }


def group_order(exe: Path, config_path: Path) -> list[int]:
    """The group of each request the config's ``shared_prefix`` generator sends, in send order
    (``bench/ipperf_groups.py`` under inference-perf's own interpreter; its order depends on the
    data section only: groups, users, lengths, seed)."""
    script = Path(__file__).resolve().parent / "ipperf_groups.py"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("PYTHONPATH", None)
    out = subprocess.run([str(exe.parent / "python"), str(script), str(config_path)], capture_output=True, text=True,
                         env=env, timeout=600, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def requests_to_cover(order: list[int]) -> int:
    """How many requests from the start of ``order`` it takes to send every group at least once."""
    seen: set[int] = set()
    groups = set(order)
    for i, g in enumerate(order):
        seen.add(g)
        if seen == groups:
            return i + 1
    return len(order)


def command(exe: Path, config_path: Path, arrival_seed: int | None = None) -> list[str]:
    """inference-perf's command line; with ``arrival_seed`` through ``bench/ipperf_seeded.py``, so
    its Poisson arrival times are the same for every run with that seed (its own timer is unseeded)."""
    if arrival_seed is None:
        return [str(exe), "--config_file", str(config_path)]
    return [str(exe.parent / "python"), str(Path(__file__).resolve().parent / "ipperf_seeded.py"),
            "--config_file", str(config_path)]


def run(exe: Path, config_path: Path, log: Path, timeout_s: float, arrival_seed: int | None = None) -> int:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("PYTHONPATH", None)  # its own venv, not kvmesh's
    if arrival_seed is not None:
        env["KVMESH_IPERF_ARRIVAL_SEED"] = str(arrival_seed)
    with open(log, "wb") as f:
        return subprocess.run(command(exe, config_path, arrival_seed), stdout=f, stderr=subprocess.STDOUT,
                               env=env, timeout=timeout_s).returncode


def _report(out_dir: Path, name: str):
    hits = sorted(out_dir.rglob(f"*{name}*.json"))
    return json.loads(hits[0].read_text()) if hits else None


def load_summaries(out_dir: Path, n_stages: int) -> list[dict]:
    """Per stage, inference-perf's ``load_summary`` ({} where missing): ``count``, ``send_duration``
    and ``achieved_rate``. Its Poisson timer draws each second's arrivals until the stage's
    ``rate x duration`` requests are out, so a stage's sends span a random time (seen: 70 to 128 s
    for a 90-s stage at 0.4 req/s): the offered rate a stage really had is ``achieved_rate``."""
    return [((_report(out_dir, f"stage_{k}_lifecycle_metrics") or {}).get("load_summary") or {})
            for k in range(n_stages)]


def stage_counts(out_dir: Path, n_stages: int) -> list[int]:
    """Requests per stage from inference-perf's per-stage reports."""
    return [int(s.get("count") or 0) for s in load_summaries(out_dir, n_stages)]


def _prompt_of(entry: dict) -> str:
    req = entry.get("request")
    if isinstance(req, str):
        try:
            req = json.loads(req)
        except ValueError:
            return req
    if isinstance(req, dict):
        p = req.get("prompt")
        return p if isinstance(p, str) else json.dumps(p)
    return ""


def results(out_dir: Path, n_stages: int, relative: bool = True) -> tuple[list[list[Result]], list[list[str]]]:
    """Per stage: the requests as ``Result``s (in start order) and their prompts. ``sent_s`` is
    the offset from the first request, or (``relative`` False) inference-perf's own stamp
    (``time.perf_counter()`` of its process: CLOCK_MONOTONIC on Linux)."""
    entries = _report(out_dir, "per_request_lifecycle_metrics") or []
    entries = sorted(entries, key=lambda e: e.get("start_time", 0.0))
    t0 = entries[0]["start_time"] if entries and relative else 0.0
    rows: list[tuple[Result, str]] = []
    for i, e in enumerate(entries):
        info = e.get("info") or {}
        rm = info.get("response_metrics") or {}
        usage = rm.get("server_usage") or {}
        cm = e.get("computed_metrics") or {}
        err = e.get("error")
        ttft = cm.get("time_to_first_token")
        n_out = int(usage.get("completion_tokens") or cm.get("output_tokens") or 0)
        cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        rows.append((Result(i, "bench", e["start_time"] - t0, ttft, cm.get("request_latency"),
                            cm.get("time_per_output_token"), int(usage.get("prompt_tokens") or cm.get("input_tokens") or 0),
                            n_out, cached, None, None, 200 if err is None else 0,
                            None if err is None else json.dumps(err)[:300]), _prompt_of(e)))
    counts = stage_counts(out_dir, n_stages)
    if sum(counts) != len(rows):  # fall back to one stage when the per-stage counts do not add up
        counts = [len(rows)] + [0] * (n_stages - 1)
    out_r, out_p, k = [], [], 0
    for c in counts:
        out_r.append([r for r, _ in rows[k:k + c]])
        out_p.append([p for _, p in rows[k:k + c]])
        k += c
    return out_r, out_p
