"""An optional per-step trace of the engine (a profiling aid for ``bench/flood.py``).

Off unless ``KVMESH_STEP_TRACE_DIR`` names a directory when the engine is built; then every
engine appends JSON lines to ``<dir>/steps-<pid>.jsonl``: one per added request
(``{"ev": "add", "t", "tenant"}``) and one per step (``{"ev": "step", "t", "dt", "tok": {tenant:
tokens}, "rows": {tenant: rows}, "interrupted", "waiting": {tenant: count}}``; ``t`` is wall-clock
seconds at the start, ``dt`` the forward's seconds). Tenant names only, never tokens or prompts.
The file is line-buffered and bounded by ``max_lines`` (later lines are dropped).
"""

from __future__ import annotations

import json
import os
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

    @property
    def on(self) -> bool:
        return self._f is not None

    def write(self, rec: dict) -> None:
        if self._f is None or self._left <= 0:
            return
        self._left -= 1
        self._f.write(json.dumps(rec, separators=(",", ":")) + "\n")
