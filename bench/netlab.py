"""A real shaped network on one machine: Ray nodes in network namespaces behind rate-limited veths.

    with netlab([LinkSpec("slow", 100), LinkSpec("fast", 1000)]) as lab:
        # the driver is connected; lab.nodes["slow"].ip is that node's address
        ref = ray.remote(f).options(resources={lab.nodes["slow"].resource: 0.01}).remote()

Topology (a star; the root namespace is the hub and runs the Ray head and the driver):

    root ns  10.N.i.1 [kvm<tag>h<i>] ==veth, tbf rate_i both ways== [kvm<tag>n<i>] 10.N.i.2  ns i

A namespace reaches the head over its own link only; two namespaces talk through the root
namespace (``net.ipv4.ip_forward=1``), crossing both links. Namespaces get a route to the lab's
/16 only (no default route), so their traffic stays inside the lab. ``tc qdisc ... tbf`` shapes
both ends of every link (netem is not available here).

Every node is ``ray start --block``, a child process in its own process group, all sharing one
private ``--temp-dir``, with ``RAY_AUTH_MODE=token`` (set for the driver when this module is
imported: import it before ``ray``). Nodes start one at a time (``ray start`` gives a raylet 30 s
to register, which a loaded machine can miss; a failed start is retried).
On exit, also on error or Ctrl-C, the context: disconnects the driver, stops the nodes it started
(SIGTERM, then SIGKILL of their process groups and of any process whose command line names the
lab's temp dir), deletes every namespace and link it made, restores ``ip_forward`` and removes the
temp dir. It needs root (CAP_NET_ADMIN); it never runs ``ray stop``.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

RAY_BIN = str(Path(sys.executable).with_name("ray"))

# Ray reads its auth mode when it is imported: import this module before ``ray``.
os.environ["RAY_AUTH_MODE"] = "token"
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# A raylet re-requests an object it has not received within this time, and the sender then
# resends *all* chunks ("Duplicate push request ..., resending all the chunks"): with the default
# 10 s, an object taking > 10 s on a slow link (e.g. 70 MB at 25 Mbit/s) is sent twice and the
# duplicate keeps the link busy after the get returns, slowing the next transfers. The nodes
# inherit this environment.
os.environ.setdefault("RAY_object_manager_pull_timeout_ms", "120000")


@dataclass(frozen=True)
class LinkSpec:
    """A namespace with one Ray node, linked to the hub at ``rate_mbit`` (both directions)."""

    name: str
    rate_mbit: float
    num_cpus: int = 1
    object_store_mb: int = 512


@dataclass(frozen=True)
class LabNode:
    name: str
    netns: str | None  # None for the head (root namespace)
    ip: str
    host_dev: str | None
    peer_dev: str | None
    rate_mbit: float | None

    @property
    def resource(self) -> str:
        """Ray's built-in per-node resource: schedule a task here with ``resources={r: 0.01}``."""
        return f"node:{self.ip}"


@dataclass
class Lab:
    head: LabNode
    gcs_address: str
    temp_dir: str
    nodes: dict[str, LabNode] = field(default_factory=dict)
    procs: list[subprocess.Popen] = field(default_factory=list)
    netns: list[str] = field(default_factory=list)
    links: list[str] = field(default_factory=list)

    def shape(self, name: str, rate_mbit: float) -> None:
        """Change a link's rate (both ends) while running."""
        self.nodes[name] = shape_link(self.nodes[name], rate_mbit)

    def env(self) -> dict[str, str]:
        # "0" here makes `ray start --address` refuse to join ("multi-node not supported"); the lab
        # binds its own veth addresses, so nodes get "1"
        return {**os.environ, "RAY_AUTH_MODE": "token", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"}


def _sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()}")
    return r


def _tbf(verb: str, dev: str, rate_mbit: float) -> list[str]:
    # burst must cover at least one timer tick of traffic at the rate (HZ >= 100), else tbf caps low
    burst_kb = max(256, int(rate_mbit * 1e6 / 8 / 100 / 1024))
    return ["tc", "qdisc", verb, "dev", dev, "root", "tbf", "rate", f"{rate_mbit:g}mbit",
            "burst", f"{burst_kb}kb", "latency", "50ms"]


def _free_port(ip: str) -> int:
    with socket.socket() as s:
        s.bind((ip, 0))
        return s.getsockname()[1]


def _free_subnet() -> int:
    used = _sh("ip", "-4", "addr").stdout + _sh("ip", "-4", "route").stdout
    for n in random.Random().sample(range(100, 250), 150):
        if f"10.{n}." not in used:
            return n
    raise RuntimeError("no free 10.N.0.0/16 subnet")


def _wait_started(lab: Lab, proc: subprocess.Popen, log_name: str, timeout_s: float) -> bool:
    """True once ``ray start --block`` reports the runtime started; False if it exits first."""
    log = Path(lab.temp_dir) / f"{log_name}.log"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if b"Ray runtime started" in log.read_bytes():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.3)
    return False


def _start(lab: Lab, cmd: list[str], log_name: str) -> subprocess.Popen:
    log = open(Path(lab.temp_dir) / f"{log_name}.log", "wb")
    p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=lab.env(), start_new_session=True)
    lab.procs.append(p)
    return p


def _stop(lab: Lab) -> None:
    for p in reversed(lab.procs):  # workers first, head last
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + 5  # a SIGTERMed node drains for up to 30 s
    for p in lab.procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(max(0.1, deadline - time.monotonic()))
    for p in lab.procs:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(5)
    # stragglers that left the process groups (e.g. workers the raylet started): ours by their
    # command line naming the lab's private temp dir
    me = os.getpid()
    for pid_dir in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):
            pid = int(pid_dir.name)
            if pid != me and lab.temp_dir in (pid_dir / "cmdline").read_bytes().decode(errors="replace"):
                os.kill(pid, signal.SIGKILL)


@dataclass
class Network:
    """Shaped veth links from the root namespace (the hub) to one namespace per ``LinkSpec``."""

    tag: str
    net: int  # the lab's addresses are 10.<net>.0.0/16
    prefix: str = "kvm"
    nodes: dict[str, LabNode] = field(default_factory=dict)
    netns: list[str] = field(default_factory=list)
    links: list[str] = field(default_factory=list)
    forward: str | None = None  # ip_forward before the lab changed it (None: unchanged)

    def hub_ip(self, i: int) -> str:
        return f"10.{self.net}.{i}.1"


def build_network(links: Sequence[LinkSpec], prefix: str = "kvm") -> Network:
    """Create the namespaces and shaped links (names start with ``prefix``); on error, what was
    made is removed before the exception propagates. Needs root."""
    if os.geteuid() != 0:
        raise PermissionError("netlab needs root for ip netns / tc")
    if not links:
        raise ValueError("netlab needs at least one link")
    network = Network(f"{random.randrange(16**4):04x}", _free_subnet(), prefix)
    tag, net = network.tag, network.net
    try:
        for i, spec in enumerate(links, start=1):
            ns, hdev, ndev = f"{prefix}-{tag}-{spec.name}", f"{prefix}{tag}h{i}", f"{prefix}{tag}n{i}"
            host_ip, ip = network.hub_ip(i), f"10.{net}.{i}.2"
            _sh("ip", "netns", "add", ns)
            network.netns.append(ns)
            _sh("ip", "link", "add", hdev, "type", "veth", "peer", "name", ndev)
            network.links.append(hdev)
            _sh("ip", "link", "set", ndev, "netns", ns)
            _sh("ip", "addr", "add", f"{host_ip}/24", "dev", hdev)
            _sh("ip", "link", "set", hdev, "up")
            nx = ("ip", "netns", "exec", ns)
            _sh(*nx, "ip", "addr", "add", f"{ip}/24", "dev", ndev)
            _sh(*nx, "ip", "link", "set", ndev, "up")
            _sh(*nx, "ip", "link", "set", "lo", "up")
            _sh(*nx, "ip", "route", "add", f"10.{net}.0.0/16", "via", host_ip)
            _sh(*_tbf("add", hdev, spec.rate_mbit))
            _sh(*nx, *_tbf("add", ndev, spec.rate_mbit))
            network.nodes[spec.name] = LabNode(spec.name, ns, ip, hdev, ndev, spec.rate_mbit)
        forward = Path("/proc/sys/net/ipv4/ip_forward").read_text().strip()
        if len(links) > 1 and forward != "1":
            Path("/proc/sys/net/ipv4/ip_forward").write_text("1")
            network.forward = forward
    except BaseException:
        remove_network(network)
        raise
    return network


def remove_network(network: Network) -> None:
    """Delete every namespace and link of ``network`` and restore ``ip_forward``."""
    for ns in network.netns:
        _sh("ip", "netns", "del", ns, check=False)  # takes the peer ends (and so the links) along
    for dev in network.links:
        if _sh("ip", "link", "show", dev, check=False).returncode == 0:
            _sh("ip", "link", "del", dev, check=False)
    if network.forward is not None:
        Path("/proc/sys/net/ipv4/ip_forward").write_text(network.forward)
        network.forward = None


def shape_link(node: LabNode, rate_mbit: float) -> LabNode:
    """Change a link's rate (both ends) while running; returns the updated node."""
    _sh(*_tbf("change", node.host_dev, rate_mbit))
    _sh("ip", "netns", "exec", node.netns, *_tbf("change", node.peer_dev, rate_mbit))
    return LabNode(node.name, node.netns, node.ip, node.host_dev, node.peer_dev, rate_mbit)


@contextlib.contextmanager
def netlab(links: Sequence[LinkSpec], *, head_cpus: int = 1, head_object_store_mb: int = 512,
           connect: bool = True, boot_timeout_s: float = 90) -> Iterator[Lab]:
    """Build the lab, start the Ray nodes (and connect the driver unless ``connect=False``)."""
    network = build_network(links)
    tag, net = network.tag, network.net
    temp_dir = tempfile.mkdtemp(prefix=f"kvm{tag}_", dir="/tmp")
    head_ip = network.hub_ip(1)
    lab = Lab(LabNode("head", None, head_ip, None, None, None), "", temp_dir, nodes=network.nodes,
              netns=network.netns, links=network.links)
    connected = False
    try:
        # the head binds the host end of the first link (root namespace)
        port = _free_port(head_ip)
        lab.gcs_address = f"{head_ip}:{port}"
        ports = {"--node-manager-port": _free_port(head_ip), "--object-manager-port": _free_port(head_ip),
                 "--dashboard-agent-listen-port": _free_port(head_ip),
                 "--dashboard-agent-grpc-port": _free_port(head_ip),
                 "--metrics-export-port": _free_port(head_ip), "--runtime-env-agent-port": _free_port(head_ip),
                 "--ray-client-server-port": _free_port(head_ip)}
        common = ["--block", "--disable-usage-stats", f"--temp-dir={temp_dir}"]
        head = _start(lab, [RAY_BIN, "start", "--head", f"--port={port}", f"--node-ip-address={head_ip}",
                            f"--num-cpus={head_cpus}", f"--object-store-memory={head_object_store_mb << 20}",
                            "--include-dashboard=false", *[f"{k}={v}" for k, v in ports.items()], *common],
                      "head")
        if not _wait_started(lab, head, "head", boot_timeout_s):
            raise RuntimeError(f"the ray head did not start; logs in {temp_dir}")
        for spec in links:  # one at a time: `ray start` gives a raylet only 30 s to register
            node = lab.nodes[spec.name]
            cmd = ["ip", "netns", "exec", node.netns, RAY_BIN, "start", f"--address={lab.gcs_address}",
                   f"--node-ip-address={node.ip}", f"--num-cpus={spec.num_cpus}",
                   f"--object-store-memory={spec.object_store_mb << 20}", *common]
            for attempt in range(3):
                p = _start(lab, cmd, f"{spec.name}.{attempt}")
                if _wait_started(lab, p, f"{spec.name}.{attempt}", boot_timeout_s):
                    break
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)  # its raylet may outlive the failed `ray start`
            else:
                raise RuntimeError(f"ray node {spec.name} failed to start 3 times; logs in {temp_dir}")

        if connect:
            import ray

            ray.init(address=lab.gcs_address, _node_ip_address=head_ip, log_to_driver=False)
            connected = True
            deadline = time.monotonic() + boot_timeout_s
            while sum(n["Alive"] for n in ray.nodes()) < len(links) + 1:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"only {sum(n['Alive'] for n in ray.nodes())} of "
                                       f"{len(links) + 1} ray nodes joined; logs in {temp_dir}")
                if lab.procs[0].poll() is not None:
                    raise RuntimeError(f"the ray head exited early; logs in {temp_dir}")
                time.sleep(0.5)
        yield lab
    finally:
        if connected:
            import ray

            with contextlib.suppress(Exception):
                ray.shutdown()
        _stop(lab)
        remove_network(network)
        if not os.environ.get("KVMESH_NETLAB_KEEP_LOGS"):
            shutil.rmtree(temp_dir, ignore_errors=True)


def leftovers(prefix: str = "kvm") -> list[str]:
    """Namespaces and links named like a lab's (``<prefix>-...`` / ``<prefix><tag>h<i>``): should be []."""
    ns = [l.split()[0] for l in _sh("ip", "netns", "list").stdout.splitlines() if l.startswith(f"{prefix}-")]
    links = [l.split(":")[1].strip().split("@")[0] for l in _sh("ip", "-o", "link").stdout.splitlines()
             if l.split(":")[1].strip().startswith(prefix)]
    return ns + links
