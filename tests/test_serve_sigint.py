"""`make serve` stops on SIGINT and leaves no Ray process, however it was started.

Runs what ``make serve`` runs (``python -m cluster.serve_cli run``, the tiny model on a free
loopback port, its own RAY_TMPDIR) *with SIGINT ignored at start*, as a script's background
``make serve &`` gets it (Ray's plain ``serve run`` then never stops on SIGINT). Waits for /health,
sends one completion, sends SIGINT to the PID. The 120 s deadline is a hang detector, not a speed
target (it stops in ~6 s here); every process of the run is found by PID and its RAY_TMPDIR.
"""

from __future__ import annotations

from bench.serve_sigint import run_once


def test_make_serve_stops_on_sigint_even_when_started_ignoring_it():
    res = run_once("tiny-llama", deadline_s=120.0, inherit_ignored_sigint=True, launcher="kvmesh")
    assert res["completion_status"] == 200, res
    assert res["exited_after_sigint_s"] is not None, f"serve run did not stop within 120 s of SIGINT: {res}"
    assert res["exit_code"] == 0 and "needed" not in res, res
    assert res["leftover_pids"] == [], res
