"""Serve's HTTP proxy on a free loopback port, for tests, benchmarks and local runs.

Picking a port with ``bind(("127.0.0.1", 0))`` and handing it to ``serve.start`` races: the
kernel hands out ports from the ephemeral range, and Ray's own processes (starting between the
pick and the proxy's bind) take ports from the same range, so the proxy can find its port taken
(CI once failed exactly so: ``Failed to bind to address '127.0.0.1:34131'``). Ports here come
from below the ephemeral range and above Ray's worker ports, and ``start_serve`` tries another
port when the proxy cannot bind.
"""

from __future__ import annotations

import random
import socket

# Ray's default worker ports are 10002-19999; Linux's ephemeral range starts at 32768.
PORT_RANGE = (20000, 32000)
_BIND_ERROR = "Failed to bind"


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(v) for v in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1", rng: random.Random | None = None) -> int:
    """A port that is free now and outside the kernel's ephemeral range (where Ray's processes
    and outgoing connections take theirs)."""
    rng = rng or random.Random()
    lo, hi = ephemeral_range()
    for _ in range(200):
        port = rng.randrange(*PORT_RANGE)
        if not lo <= port <= hi and port_free(port, host):
            return port
    with socket.socket() as s:  # every pick taken (or the range moved): let the kernel choose
        s.bind((host, 0))
        return s.getsockname()[1]


def start_serve(attempts: int = 5, host: str = "127.0.0.1", **serve_kwargs) -> int:
    """``serve.start`` with ``http_options={"host": host, "port": <free port>}`` (plus
    ``serve_kwargs``); returns the port. When the proxy cannot bind its port (taken between the
    pick and the bind) Serve is shut down and started again on another port."""
    from ray import serve

    for attempt in range(attempts):
        port = free_port(host)
        try:
            serve.start(http_options={"host": host, "port": port}, **serve_kwargs)
            return port
        except Exception as e:  # RayTaskError(RuntimeError) from the proxy's ready()
            if _BIND_ERROR not in str(e) or attempt == attempts - 1:
                raise
            serve.shutdown()
    raise AssertionError("unreachable")
