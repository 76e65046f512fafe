"""Machines on one machine: SSH hosts in network namespaces behind shaped links, for ``ray up``.

    with ssh_hosts([LinkSpec("head", 1000), LinkSpec("w1", 1000), LinkSpec("w4", 100)]) as lab:
        lab.hosts["head"].ip, lab.key        # ssh -i lab.key root@<ip> runs inside that host

Each host is a ``bench.netlab`` namespace (tbf-shaped veth to the root namespace, which is the hub
and forwards between hosts) plus its own PID and mount namespace (``unshare --pid --mount
--fork --kill-child --mount-proc``) with a private ``/tmp``, running one ``sshd`` as its PID 1.
So a host behaves like a separate machine where it matters for Ray: ``ray stop`` run on a host
(Ray's start commands and ``ray down`` both run it) sees only that host's processes, never the
other Ray clusters on this machine; ``/tmp/ray`` and the local provider's state files are
per host, and so is ``/root`` (a per-host directory mounted there: ``~/kvmesh``,
``~/ray_bootstrap_key.pem`` are the host's own; ``binds`` can mount paths such as a model cache
into it). The filesystem is otherwise shared (the repo checkout, the Python venv). Root logs in
with a key generated per run.

On exit (also on error or Ctrl-C) the context SIGKILLs each host's ``unshare`` by PID (its child,
the host's PID 1, dies with it and the kernel kills every process in that PID namespace), deletes
the namespaces and links and removes the run directory (never while something is mounted below
it in this namespace). Needs root and ``openssh-server``
(``ensure_sshd`` installs it with apt-get once).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

from bench.cpuquota import cpu_cgroup, enter_command
from bench.netlab import LinkSpec, Network, build_network, remove_network

SSHD = "/usr/sbin/sshd"
RUN_ROOT = Path("/var/tmp")  # not /tmp: each host mounts its own /tmp over it


@dataclass(frozen=True)
class Host:
    name: str
    ip: str
    netns: str
    rate_mbit: float
    home: Path  # this machine's path of the host's /root (its ~)
    tmp: Path  # mounted on /tmp inside the host


@dataclass
class HostLab:
    run_dir: Path
    key: Path  # private key that logs in as root on every host
    network: Network
    hosts: dict[str, Host] = field(default_factory=dict)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    pid_namespaces: dict[str, str] = field(default_factory=dict)  # host -> "pid:[inode]"
    cgroups: dict[str, Path] = field(default_factory=dict)  # host -> its CPU cgroup (``cpus``)

    def ssh(self, host: str, command: str, timeout_s: float = 60) -> subprocess.CompletedProcess:
        """Run ``command`` on ``host`` over SSH (as ``ray up`` would)."""
        return subprocess.run(["ssh", *ssh_options(self.key), f"root@{self.hosts[host].ip}", command],
                              capture_output=True, text=True, timeout=timeout_s)


def ssh_options(key: Path) -> list[str]:
    return ["-i", str(key), "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
            "-o", "LogLevel=ERROR", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10"]


def ensure_sshd() -> None:
    """Install openssh-server (and rsync, which ``ray up`` file mounts use) once."""
    missing = [pkg for pkg, path in (("openssh-server", SSHD), ("rsync", "/usr/bin/rsync")) if not Path(path).exists()]
    if not missing:
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env, capture_output=True)
    subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing], check=True, env=env,
                   capture_output=True)


def sshd_config(host: Host, run_dir: Path, host_key: Path, authorized: Path, extra_env: dict[str, str]) -> str:
    """The host's sshd_config: root by key only, on the host's address, ``extra_env`` set."""
    env = " ".join(f'{k}="{v}"' for k, v in extra_env.items())
    return "\n".join([
        f"ListenAddress {host.ip}", "Port 22", f"HostKey {host_key}", f"AuthorizedKeysFile {authorized}",
        "PermitRootLogin prohibit-password", "PubkeyAuthentication yes", "PasswordAuthentication no",
        "KbdInteractiveAuthentication no", "UsePAM no", "StrictModes no", "PrintMotd no", "UseDNS no",
        f"PidFile {run_dir}/sshd-{host.name}.pid", "MaxStartups 100:30:200", "MaxSessions 100",
        "Subsystem sftp internal-sftp", *([f"SetEnv {env}"] if env else []), "",
    ])


def host_init(host: Host, sshd_conf: Path, binds: dict[str, str], daemon: str | None = None) -> str:
    """The shell line that becomes the host's PID 1: private /tmp, ``binds`` (source path ->
    path under the host's home) mounted into its home, the home mounted on /root, ``daemon`` (a
    shell command) started in the background, then sshd."""
    steps = [f"mount --bind {host.tmp} /tmp"]
    for src, rel in binds.items():
        steps.append(f"mkdir -p {host.home / rel} && mount --bind {src} {host.home / rel}")
    steps.append(f"mount --rbind {host.home} /root")
    line = " && ".join(steps)
    if daemon:
        line += f" && ( {daemon} ) </dev/null >/dev/null 2>&1 &"
        return line + f" exec {SSHD} -D -e -f {sshd_conf}"
    return line + f" && exec {SSHD} -D -e -f {sshd_conf}"


def _wait_port(ip: str, port: int, timeout_s: float, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"sshd for {ip} exited ({proc.returncode})")
        with contextlib.suppress(OSError), socket.create_connection((ip, port), timeout=1):
            return
        time.sleep(0.2)
    raise TimeoutError(f"sshd on {ip}:{port} did not come up")


def _stop_hosts(lab: HostLab) -> None:
    # unshare --fork ignores SIGTERM while it waits for its child: SIGKILL it, and --kill-child
    # (PR_SET_PDEATHSIG) kills the host's PID 1, whose death kills the whole PID namespace
    for p in lab.procs.values():
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGKILL)
    for p in lab.procs.values():
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(10)
    deadline = time.monotonic() + 10
    while leftover_pids(lab) and time.monotonic() < deadline:
        time.sleep(0.2)


def _pid_ns(pid: int) -> str | None:
    """The PID namespace of ``pid``'s first child (the host's PID 1 under ``unshare --fork``)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        child = int(Path(f"/proc/{pid}/task/{pid}/children").read_text().split()[0])
        return os.readlink(f"/proc/{child}/ns/pid")
    return None


def leftover_pids(lab: HostLab) -> list[int]:
    """PIDs of live processes still inside the hosts' PID namespaces: [] after the context exits
    (zombies are left out: they hold nothing, and only this machine's init can reap them)."""
    out = []
    for d in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):
            if (os.readlink(d / "ns" / "pid") in lab.pid_namespaces.values()
                    and (d / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"):
                out.append(int(d.name))
    return out


@contextlib.contextmanager
def ssh_hosts(links: Sequence[LinkSpec], prefix: str = "kvm", env: dict[str, str] | None = None,
              binds: dict[str, str] | None = None, daemon: str | None = None,
              boot_timeout_s: float = 30, cpus: dict[str, float] | None = None) -> Iterator[HostLab]:
    """Build the hosts and start their sshd; ``env`` is set in every SSH session on them;
    ``binds`` maps paths of this machine to paths under every host's home (e.g. a model cache
    the hosts come provisioned with); ``cpus`` caps a host's processes together at that many
    cores (``bench.cpuquota``: a machine of its own for compute too; hosts not named share this
    machine's cores)."""
    ensure_sshd()
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation directory
    network = build_network(links, prefix=prefix)
    run_dir = RUN_ROOT / f"{prefix}-{network.tag}"
    lab = HostLab(run_dir, run_dir / "id_ed25519", network)
    cgroups = contextlib.ExitStack()
    try:
        run_dir.mkdir(mode=0o700)
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(lab.key)], check=True)
        host_key = run_dir / "host_ed25519"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(host_key)], check=True)
        authorized = run_dir / "authorized_keys"
        shutil.copy(lab.key.with_suffix(".pub"), authorized)
        for spec in links:
            node = network.nodes[spec.name]
            host = Host(spec.name, node.ip, node.netns, spec.rate_mbit, run_dir / "home" / spec.name,
                        run_dir / "tmp" / spec.name)
            host.home.mkdir(parents=True)
            host.tmp.mkdir(parents=True)
            host.tmp.chmod(0o1777)
            (host.home / ".bashrc").write_text("")  # Ray's commands `source ~/.bashrc` first
            conf = run_dir / f"sshd-{spec.name}.conf"
            conf.write_text(sshd_config(host, run_dir, host_key, authorized, env or {}))
            inner = host_init(host, conf, binds or {}, daemon)
            log = open(run_dir / f"sshd-{spec.name}.log", "wb")
            cmd = ["ip", "netns", "exec", node.netns, "unshare", "--pid", "--mount", "--fork", "--kill-child",
                   "--mount-proc", "sh", "-c", inner]
            if cpus and spec.name in cpus:  # the host's PID 1 and all it starts inherit the cgroup
                cg = cgroups.enter_context(cpu_cgroup(f"{prefix}-{network.tag}-{spec.name}", cpus[spec.name]))
                lab.cgroups[spec.name] = cg
                cmd = ["sh", "-c", f'{enter_command(cg)} && exec "$@"', "sh", *cmd]
            lab.procs[spec.name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            lab.hosts[spec.name] = host
        for name, host in lab.hosts.items():
            _wait_port(host.ip, 22, boot_timeout_s, lab.procs[name])
            ns = _pid_ns(lab.procs[name].pid)
            if ns is None or ns == os.readlink("/proc/self/ns/pid"):
                raise RuntimeError(f"host {name} is not in a PID namespace of its own")
            lab.pid_namespaces[name] = ns
        yield lab
    finally:
        _stop_hosts(lab)
        cgroups.close()  # after the hosts' processes are gone
        remove_network(network)
        # the binds live in the hosts' private mount namespaces only; never delete through one
        mounted = [m for m in _mount_points() if m == str(run_dir) or m.startswith(f"{run_dir}/")]
        if mounted:
            raise RuntimeError(f"{mounted} still mounted in this namespace; not removing {run_dir}")
        if not os.environ.get("KVMESH_NETLAB_KEEP_LOGS"):
            shutil.rmtree(run_dir, ignore_errors=True)


def _mount_points() -> list[str]:
    return [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
