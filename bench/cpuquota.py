"""A fixed CPU share per emulated machine: a cgroup with a CFS quota that a host's processes inherit.

The hosts of ``bench.sshhosts`` are separate machines for the network (own namespace, shaped
link) but, without this, they all draw on this machine's cores: a worker that is idle leaves its
CPU to the busy ones, so concentrating every request on one worker costs nothing, which no real
cluster offers (a node's idle GPU or cores do not help another node). ``cpu_cgroup(name, cpus)``
makes a cgroup whose processes together get at most ``cpus`` cores (CFS bandwidth: ``quota =
cpus x period`` every ``period_us``); ``enter_command(path)`` is the shell prefix that moves the
shell into it before it ``exec``s the host, so every process the host starts (sshd, raylet,
workers) inherits the share. Works with cgroup v1 (``/sys/fs/cgroup/cpu``) and v2 (``cpu.max``).
On exit the cgroup is removed once its processes are gone (the caller stops them first).
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Iterator

V1_ROOT = Path("/sys/fs/cgroup/cpu")
V2_ROOT = Path("/sys/fs/cgroup")
PERIOD_US = 20_000  # short periods: a 100 ms step is throttled in slices, not stalled for 60 ms at once


def cgroup_root() -> tuple[Path, int]:
    """The cpu controller's mount and its cgroup version; raises when neither is usable."""
    if (V1_ROOT / "cpu.cfs_quota_us").exists():
        return V1_ROOT, 1
    v2 = V2_ROOT / "cgroup.controllers"
    if v2.exists() and "cpu" in v2.read_text().split():
        return V2_ROOT, 2
    raise RuntimeError("no cgroup cpu controller (v1 /sys/fs/cgroup/cpu or v2 cpu.max) to cap a host's CPU")


def quota_us(cpus: float, period_us: int = PERIOD_US) -> int:
    """CFS quota for ``cpus`` cores per ``period_us`` (the kernel's minimum is 1000 us)."""
    if not cpus > 0:
        raise ValueError(f"cpus must be > 0, got {cpus}")
    return max(1000, round(cpus * period_us))


def enter_command(path: Path) -> str:
    """Shell prefix that moves the running shell into the cgroup at ``path``."""
    return f"echo $$ > {path}/cgroup.procs"


def _procs(path: Path) -> list[str]:
    with contextlib.suppress(OSError):
        return (path / "cgroup.procs").read_text().split()
    return []


@contextlib.contextmanager
def cpu_cgroup(name: str, cpus: float, period_us: int = PERIOD_US, remove_timeout_s: float = 15) -> Iterator[Path]:
    """A cgroup ``name`` capped at ``cpus`` cores; removed on exit (after its processes exit)."""
    root, version = cgroup_root()
    path = root / name
    path.mkdir()
    try:
        if version == 1:
            (path / "cpu.cfs_period_us").write_text(str(period_us))
            (path / "cpu.cfs_quota_us").write_text(str(quota_us(cpus, period_us)))
        else:
            (path / "cpu.max").write_text(f"{quota_us(cpus, period_us)} {period_us}")
        yield path
    finally:
        deadline = time.monotonic() + remove_timeout_s
        while _procs(path) and time.monotonic() < deadline:
            time.sleep(0.2)
        with contextlib.suppress(OSError):
            path.rmdir()


def throttled(path: Path) -> dict:
    """The cgroup's CFS statistics (periods, throttled periods, throttled time in s)."""
    stats = {}
    with contextlib.suppress(OSError):
        for line in (path / "cpu.stat").read_text().splitlines():
            k, v = line.split()
            stats[k] = int(v)
    return {"periods": stats.get("nr_periods", 0), "throttled": stats.get("nr_throttled", 0),
            "throttled_s": round(stats.get("throttled_time", stats.get("throttled_usec", 0) * 1000) / 1e9, 2)}
