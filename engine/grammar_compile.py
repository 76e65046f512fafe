"""A schema's grammar is compiled first in a child process with a CPU budget.

A ``response_format`` schema is client input, and xgrammar's compile time is not bounded by its
size: with the default model's tokenizer, 600 optional string properties (32 KB) took 1.3
CPU-seconds, 800 (43 KB) 5.2 s, 2,000 (98 KB) 204 s, while 5,000 required integer properties took
2 s. A thread cannot be stopped, so a schema is compiled first in a child process (started once,
on the first compile; one compile at a time) whose CPU time is limited per compile by
``RLIMIT_CPU``: past ``cpu_s`` seconds the kernel ends the child (SIGXCPU), the request is
refused (``InvalidRequest``, param ``response_format``) and the next compile starts a new child.
The child and the worker's compile thread run at niceness +5 (``NICE``): on a busy worker a
costly schema waits for idle CPU instead of slowing every other request's steps, and a
wall-clock limit (``WALL_PER_CPU_S`` per CPU-second) backs the CPU limit up for a child starved
of CPU. A schema that compiled within the budget is compiled again in the worker (xgrammar's
serialized grammar is no way back: 789 MB of JSON and 59 s for that 32 KB schema's 5 MB of token
masks), so an accepted schema costs its compile twice and a refused one at most ``cpu_s``. The child loads xgrammar and with it torch
(~260 MB): it exits after ``IDLE_EXIT_S`` without a compile, and the next compile starts a new
one (~2.5 s).
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from pathlib import Path

WALL_PER_CPU_S = 10.0  # the wall-clock backstop, per second of CPU budget (at least MIN_WALL_S)
MIN_WALL_S = 30.0
IDLE_EXIT_S = 600.0  # an idle child exits (xgrammar loads torch: ~260 MB); the next compile starts one
NICE = 5  # compiles yield the CPU to the engine's steps: the schema's sender waits, not the others
_ROOT = Path(__file__).resolve().parents[1]  # the directory holding the ``engine`` package


def lower_priority(n: int = NICE) -> None:
    """Add ``n`` to the calling thread's niceness (Linux: per thread; elsewhere the process's)."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + n))
    except (OSError, AttributeError):
        pass


def _serve(conn_in: Connection, conn_out: Connection, cpu_s: float, idle_s: float = IDLE_EXIT_S) -> None:
    """The child's loop: tokenizer info JSON first, then (schema, max_bytes) in; ("ok", bytes),
    ("too_big", bytes) or ("error", message) out (bytes: the grammar's token masks). Ends at EOF,
    None or ``idle_s`` idle."""
    import xgrammar as xgr

    lower_priority()
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.deserialize_json(conn_in.recv()), max_threads=1,
                                   cache_enabled=False)
    while True:
        try:
            if not conn_in.poll(idle_s):
                return
            msg = conn_in.recv()
        except (EOFError, OSError):  # the parent is gone
            return
        if msg is None:
            return
        schema, max_bytes = msg
        ru = resource.getrusage(resource.RUSAGE_SELF)
        soft = int(ru.ru_utime + ru.ru_stime + cpu_s) + 1  # whole seconds: SIGXCPU past it
        hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
        resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))
        try:
            # compact JSON (no free whitespace): a small model cannot loop on blanks
            compiled = compiler.compile_json_schema(schema, any_whitespace=False)
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError with the reason
            conn_out.send(("error", str(e).strip() or repr(e)))
            continue
        size = int(compiled.memory_size_bytes)
        conn_out.send(("too_big" if size > max_bytes else "ok", size))
        del compiled


class CompileProcess:
    """One child process test-compiling JSON schemas, at most ``cpu_s`` CPU-seconds each. Thread-safe
    (compiles run one at a time); ``close()`` ends the child. The child is a plain ``python -m``
    of this module (no multiprocessing spawn: that would import the parent's ``__main__``, a Ray
    worker's or pytest's, again)."""

    def __init__(self, info_json: str, cpu_s: float, wall_s: float | None = None, idle_s: float = IDLE_EXIT_S):
        self.info_json, self.cpu_s, self.idle_s = info_json, float(cpu_s), float(idle_s)
        self.wall_s = wall_s if wall_s is not None else max(MIN_WALL_S, WALL_PER_CPU_S * self.cpu_s)
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._send: Connection | None = None
        self._recv: Connection | None = None
        self.stats = {"started": 0, "over_budget": 0}

    def _start(self) -> None:
        to_child, from_parent = os.pipe()[::-1]  # (write end, read end)
        from_child, to_parent = os.pipe()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")]))}
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "engine.grammar_compile", str(from_parent), str(to_parent), repr(self.cpu_s),
                 repr(self.idle_s)],
                pass_fds=(from_parent, to_parent), env=env, cwd=str(_ROOT), stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL)
        finally:
            os.close(from_parent)
            os.close(to_parent)
        self._send, self._recv = Connection(to_child, readable=False), Connection(from_child, writable=False)
        self._send.send(self.info_json)
        self.stats["started"] += 1

    def _stop(self) -> None:
        proc, self._proc = self._proc, None
        for c in (self._send, self._recv):
            if c is not None:
                c.close()
        self._send = self._recv = None
        if proc is not None:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=5)

    def compile(self, schema: str, max_bytes: int) -> tuple[str, object]:
        """("ok", bytes) or ("too_big", bytes) or ("error", xgrammar's message) (bytes: the
        compiled grammar's token masks); InvalidRequest when the compile ran past its budget."""
        from engine.sequence import InvalidRequest

        with self._lock:
            over_wall = False
            for attempt in (0, 1):
                if self._proc is None or self._proc.poll() is not None:
                    self._stop()
                    self._start()
                try:
                    self._send.send((schema, max_bytes))
                    if self._recv.poll(self.wall_s):
                        return self._recv.recv()
                    over_wall = True
                    break
                except (EOFError, OSError):  # ended by the kernel at its CPU limit, or idle just now
                    if attempt or not self._exited_idle():
                        break
                    self._stop()  # it exited idle as the schema was sent: once more, on a new child
            self._stop()
            self.stats["over_budget"] += 1
        limit = f"{self.wall_s:g} s" if over_wall else f"{self.cpu_s:g} CPU-seconds"
        err = InvalidRequest(f"the JSON schema is too complex: its grammar did not compile within {limit}",
                             param="response_format")
        err.over_cpu = not over_wall  # the schema's own cost (a wall-clock miss may be the machine's load)
        raise err

    def _exited_idle(self) -> bool:
        """The child ended by itself (exit 0: idle), not by a signal (its CPU limit)."""
        try:
            return self._proc.wait(timeout=5) == 0
        except subprocess.TimeoutExpired:
            return False

    def close(self) -> None:
        with self._lock:
            if self._send is not None:
                try:
                    self._send.send(None)
                except OSError:
                    pass
            self._stop()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None


if __name__ == "__main__":
    _serve(Connection(int(sys.argv[1]), writable=False), Connection(int(sys.argv[2]), readable=False),
           float(sys.argv[3]), float(sys.argv[4]))
