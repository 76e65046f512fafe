"""Benchmarks that compare code trees side by side: one process per tree, the same arguments.

A script adds ``--before`` / ``--after`` / ``--arm`` (``add_arguments``); run with ``--arm`` it
measures the tree it was started in (``enter_arm`` puts that tree first on ``sys.path``) and
prints one ``RESULT <json>`` line; ``run_arms`` starts it once per tree and collects those.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--before", help="code tree of the 'before' arm (e.g. a git worktree of an older commit)")
    ap.add_argument("--after", default=str(ROOT), help="code tree of the 'after' arm (default: this one)")
    ap.add_argument("--arm", help=argparse.SUPPRESS)  # internal: measure the tree on sys.path, print JSON


def enter_arm() -> None:
    """The tree under test (cwd) first on sys.path; never bench/ itself (its engine.py is not the package)."""
    here = Path(__file__).resolve().parent
    sys.path[:] = [os.getcwd()] + [p for p in sys.path if Path(p or ".").resolve() != here]


def print_result(result: dict) -> None:
    print("RESULT " + json.dumps(result), flush=True)


def run_arms(script: str, args, env: dict | None = None, timeout: float = 900) -> dict[str, dict]:
    """{arm name: its RESULT} for ``before`` (if given) and ``after``, each ``script`` run with this
    process's arguments in its own tree; a failed arm ends the benchmark."""
    arms = {"before": args.before, "after": args.after} if args.before else {"after": args.after}
    out = {}
    for name, tree in arms.items():
        print(f"arm {name}: {tree}", flush=True)
        proc = subprocess.run([sys.executable, str(Path(script).resolve()), *sys.argv[1:], "--arm", name],
                              cwd=tree, env={**os.environ, "PYTHONPATH": tree, **(env or {})},
                              capture_output=True, text=True, timeout=timeout)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        for ln in proc.stdout.splitlines():
            if not ln.startswith("RESULT "):
                print(ln)
        if proc.returncode or not lines:
            print(proc.stderr[-3000:])
            raise SystemExit(f"arm {name} failed (rc {proc.returncode})")
        out[name] = json.loads(lines[-1][len("RESULT "):])
    return out


def write(out: dict, path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(out, indent=1))
    print(f"wrote {path}")
