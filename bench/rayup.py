"""``ray up`` / ``ray exec`` / ``ray down`` of the project's own local-provider config.

``sibling_config`` turns the shipped ``cluster/ray-up-local.yaml`` into the config of one bench
run, changing only what a user edits for their machines plus what this machine's hosts need,
each named in ``CHANGES`` (the bench writes them into its JSON):

* ``provider.head_ip`` / ``worker_ips``, ``auth``, ``max_workers``: the fields the shipped file
  says to edit (IPs, user, key; ``max_workers`` = number of worker IPs);
* ``cluster_name``: one per run, so the local provider's state files never collide;
* ``setup_commands``: the hosts are pre-provisioned (the bench's own Python venv is on the shared
  filesystem, the converted model is in the cache mounted at ``~/.cache/kvmesh``), so ``make setup
  model`` becomes "link the venv as ``~/kvmesh/.venv``" (on this 2-core machine the model
  loader's check, run on four workers at once, also starves the Ray agents starting next to it);
* start commands: ``--num-cpus`` per node (one per worker: one engine thread each, and the head
  none, so that every worker lands on a worker node), ``--object-store-memory`` (this machine's
  RAM is shared by five nodes), fixed raylet/agent ports (``FIXED_PORTS``) and, with
  ``start_lock``, ``flock`` around ``ray start`` so that the hosts of this one machine start
  their nodes one at a time (Ray gives a node's dashboard agent a fixed 15 s to come up; four
  starting at once on two loaded cores miss it, and the head's autoscaler retries them).

The shipped config itself names the head's address in its start command
(``--node-ip-address``, the same address as ``head_ip``; the bench substitutes this run's): without
it, a head without a default route (these namespaces; air-gapped on-prem machines) advertises a
wrong address and no worker can join (Ray's local provider sets ``$RAY_HEAD_IP`` only for worker
commands).
"""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
SHIPPED = REPO / "cluster" / "ray-up-local.yaml"

# Every host has its own network namespace, so fixed ports never collide. With dynamic ports the
# raylet waits ~15 s for the dashboard agent to report its port and aborts the node ("Timed out
# waiting for file .../metrics_agent_port_..."): on this shared 2-core machine the agent's start
# takes longer than that.
FIXED_PORTS = {"node-manager-port": 8076, "object-manager-port": 8077, "metrics-export-port": 8078,
               "dashboard-agent-grpc-port": 8079, "dashboard-agent-listen-port": 52365,
               "runtime-env-agent-port": 8080}

CHANGES = (
    "provider.head_ip/worker_ips, auth.ssh_user/ssh_private_key, max_workers: this run's hosts (the edits the "
    "shipped file asks for)",
    "cluster_name: unique per run (local provider state files)",
    "setup_commands: hosts are pre-provisioned (shared venv linked as ~/kvmesh/.venv, converted model in the "
    "cache mounted at ~/.cache/kvmesh), so `make setup model` becomes the link",
    "start commands: --num-cpus (1 per worker node, 0 on the head), --object-store-memory per node, fixed "
    "agent/raylet ports (a dynamic-port dashboard agent that starts slower than ~15 s aborts its raylet on this "
    "loaded machine), `flock` around `ray start` (one node starting at a time on this one machine)",
    "head start command: the shipped --node-ip-address (= head_ip) replaced by this run's head address",
)


def venv_dir() -> Path:
    """The venv of the interpreter running the bench (the repo's own .venv when run from it)."""
    return Path(sys.prefix)


def sibling_config(shipped: dict, *, cluster_name: str, head_ip: str, worker_ips: list[str], key: Path,
                   venv: Path, head_cpus: int = 0, worker_cpus: int = 1,
                   object_store_mb: int = 256, start_lock: Path | None = None) -> dict:
    """This run's ``ray up`` config, derived from ``shipped`` (see the module docstring)."""
    cfg = copy.deepcopy(shipped)
    cfg["cluster_name"] = cluster_name
    cfg["provider"] = {**cfg["provider"], "head_ip": head_ip, "worker_ips": list(worker_ips)}
    cfg["auth"] = {"ssh_user": "root", "ssh_private_key": str(key)}
    cfg["max_workers"] = len(worker_ips)
    cfg["rsync_exclude"] = [*cfg.get("rsync_exclude", []), "bench/results/cluster_run"]  # this bench's own logs
    cfg["setup_commands"] = [f"mkdir -p ~/kvmesh && ln -sfn {venv} ~/kvmesh/.venv"]
    store = f"--object-store-memory={object_store_mb << 20} " + " ".join(f"--{k}={v}" for k, v in FIXED_PORTS.items())
    shipped_head = shipped["provider"]["head_ip"]

    def start(cmds: list[str], cpus: int) -> list[str]:
        out = []
        for c in cmds:
            if " start " in f" {c} " and "ray start" in c:
                c = f"{c} --num-cpus={cpus} {store}"
                if start_lock is not None:  # one node starting at a time (all hosts share this file)
                    c = c.replace("~/kvmesh/.venv/bin/ray start", f"flock {start_lock} ~/kvmesh/.venv/bin/ray start")
            out.append(c.replace(shipped_head, head_ip) if "--head" in c else c)
        return out

    cfg["head_start_ray_commands"] = start(cfg["head_start_ray_commands"], head_cpus)
    cfg["worker_start_ray_commands"] = start(cfg["worker_start_ray_commands"], worker_cpus)
    return cfg


def load_shipped(path: Path = SHIPPED) -> dict:
    return yaml.safe_load(path.read_text())


def write_config(cfg: dict, path: Path) -> Path:
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def _ray(*args: str, timeout_s: float, log: Path | None = None) -> subprocess.CompletedProcess:
    cmd = [str(venv_dir() / "bin" / "ray"), *args]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    if log is not None:
        with open(log, "a") as f:
            f.write(f"$ {' '.join(cmd)}\n{r.stdout}\n{r.stderr}\n(rc={r.returncode})\n")
    return r


def ray_up(config: Path, log: Path, timeout_s: float = 600, restart_only: bool = False) -> None:
    """``ray up -y``; ``restart_only``: restart Ray on the head without setup (the head's
    autoscaler then starts the workers that are not up again)."""
    extra = ["--restart-only"] if restart_only else []
    r = _ray("up", "-y", "--no-config-cache", "--disable-usage-stats", *extra, str(config), timeout_s=timeout_s,
             log=log)
    if r.returncode != 0:
        raise RuntimeError(f"ray up failed ({r.returncode}); see {log}:\n{r.stderr[-2000:]}")


def ray_exec(config: Path, command: str, log: Path, timeout_s: float = 300, check: bool = True) -> str:
    r = _ray("exec", str(config), command, timeout_s=timeout_s, log=log)
    if check and r.returncode != 0:
        raise RuntimeError(f"ray exec {command!r} failed ({r.returncode}); see {log}:\n{(r.stdout + r.stderr)[-2000:]}")
    return r.stdout


def ray_down(config: Path, log: Path, timeout_s: float = 180) -> int:
    return _ray("down", "-y", str(config), timeout_s=timeout_s, log=log).returncode


def forget(config: Path) -> None:
    """Remove what ``ray up``/``down`` left on this (the driver's) machine for the cluster: the
    local provider's state and lock files and the cached provider configs naming it."""
    name = yaml.safe_load(config.read_text())["cluster_name"]
    for f in [*Path("/tmp/ray").glob(f"cluster-{name}.*"), *Path("/tmp").glob(f"cluster-{name}.*")]:
        f.unlink(missing_ok=True)
    for f in Path("/tmp").glob("ray-config-*"):
        try:
            if name in f.read_text(errors="replace"):
                f.unlink()
        except OSError:
            continue


def port_prewriter(ports: dict[str, int] = FIXED_PORTS) -> str:
    """A host daemon (shell loop) for this overloaded machine: as soon as a raylet on the host logs
    its node id, write the dashboard agent's and runtime-env agent's port files that the raylet
    waits for (Ray 2.60 gives them a fixed 15 s, not configurable, and on two cores shared by
    many processes the agents' Python takes longer to start). The ports are the fixed ones the
    start commands pass (``FIXED_PORTS``), so the files say what the agents then bind; the agents
    rewrite the same values when they are up."""
    listen, env_port = ports["dashboard-agent-listen-port"], ports["runtime-env-agent-port"]
    return ("while :; do for log in /tmp/ray/session_*/logs/raylet.out; do [ -f \"$log\" ] || continue; "
            "s=${log%/logs/raylet.out}; [ -e \"$s/.ports_prewritten\" ] && continue; "
            "id=$(grep -a -o -m1 'node_id=[0-9a-f]*' \"$log\" | cut -d= -f2); [ -n \"$id\" ] || continue; "
            f"[ -e \"$s/dashboard_agent_listen_port_$id\" ] || printf {listen} > \"$s/dashboard_agent_listen_port_$id\"; "
            f"[ -e \"$s/runtime_env_agent_port_$id\" ] || printf {env_port} > \"$s/runtime_env_agent_port_$id\"; "
            "touch \"$s/.ports_prewritten\"; done; sleep 0.3; done")
