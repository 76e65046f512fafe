"""An optional per-step trace of the engine (a profiling aid for ``bench/flood.py``).

Off unless ``KVMESH_STEP_TRACE_DIR`` names a directory when the engine is built; then every
engine appends JSON lines to ``<dir>/steps-<pid>.jsonl``: one per added request
(``{"ev": "add", "t", "tenant", "n", "prompt", "running", "waiting"}``: ``n`` numbers the
engine's requests, ``prompt`` is its length, ``running``/``waiting`` what the scheduler held
before it), one per request's first token (``{"ev": "first", "t", "n", "cached", "prefill_s"}``:
engine-side TTFT = its ``t`` minus the add's) and one per step (``{"ev": "step", "t", "dt", "tok":
{tenant: tokens}, "rows": {tenant: rows}, "interrupted", "waiting": {tenant: count}, "preempted",
"room"}``, the last two the engine's preemptions so far, all and those for room; ``t`` is
wall-clock seconds at the start, ``dt`` the forward's seconds, ``cpu`` the engine thread's CPU
seconds in it: ``dt`` minus what ``cpu`` explains is time the thread waited, for a CPU quota other
processes share or for the GIL). Tenant names and counts only, never
tokens, prompts or request ids. The file is line-buffered and bounded by ``max_lines`` (later lines
are dropped).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import time
from pathlib import Path

ENV = "KVMESH_STEP_TRACE_DIR"


class StepTrace:
    def __init__(self, directory: str | None = None, max_lines: int = 200_000):
        directory = directory if directory is not None else os.environ.get(ENV)
        self._f = None
        self._left = max_lines
        if directory:
            Path(directory).mkdir(parents=True, exist_ok=True)
            self._f = open(Path(directory) / f"steps-{os.getpid()}.jsonl", "a", buffering=1)
        self._ids: dict[str, int] = {}  # request id -> its number, until its first token
        self._count = itertools.count()

    @property
    def on(self) -> bool:
        return self._f is not None

    @contextlib.contextmanager
    def paused(self):
        """Nothing is traced inside (the engine's own calibration is no workload)."""
        f, self._f = self._f, None
        try:
            yield
        finally:
            self._f = f

    def add(self, request_id: str, tenant: str, prompt: int, running: int, waiting: int) -> None:
        if self._f is None:
            return
        n = self._ids[request_id] = next(self._count)
        self.write({"ev": "add", "t": time.time(), "tenant": tenant, "n": n, "prompt": prompt, "running": running,
                    "waiting": waiting})

    def first(self, request_id: str, cached: int, prefill_s: float) -> None:
        n = self._ids.pop(request_id, None)
        if n is not None:
            self.write({"ev": "first", "t": time.time(), "n": n, "cached": cached, "prefill_s": round(prefill_s, 4)})

    def forget(self, request_id: str) -> None:
        """A request that ends without a first token (aborted, failed)."""
        self._ids.pop(request_id, None)

    def write(self, rec: dict) -> None:
        if self._f is None or self._left <= 0:
            return
        self._left -= 1
        self._f.write(json.dumps(rec, separators=(",", ":")) + "\n")
