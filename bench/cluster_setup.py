"""What ``bench/cluster.py`` deploys: the Serve app configs per configuration, the tenants file and
the KV pool size. Pure functions (no Ray, no network), tested in ``tests/test_cluster_bench.py``.

Every configuration runs on the same workers (one per worker node, ``worker_num_cpus: 1``), the
same model and the same ``kv_cache_bytes``; each Serve config is the shipped file a user would
deploy (``cluster/serve.yaml``, ``cluster/serve-pow2.yaml``, ``cluster/serve-affinity.yaml``) with
only the user's edits: the HTTP address, the number of workers, the KV pool and the tenants file.
``kvmesh+approx`` differs from ``kvmesh`` only in its tenants file: the template tenant's default
reuse is ``approximate`` (its quality gate on, as the tenants file defaults it).
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
CLUSTER = REPO / "cluster"
SHIPPED_SERVE = {"pow2": CLUSTER / "serve-pow2.yaml", "affinity": CLUSTER / "serve-affinity.yaml",
                 "kvmesh": CLUSTER / "serve.yaml", "kvmesh+approx": CLUSTER / "serve.yaml"}
CONFIGS = ("pow2", "affinity", "kvmesh", "kvmesh+approx")  # measured; "oracle" is computed
TEMPLATE_TENANT = "tmpl"
TEMPLATE_ID = "fr"
BENCH_TENANT = "bench"
BENCH_ADMIN_KEY = "sk-bench-admin"  # reads the admin view of /kvmesh/workers (the router's estimates)


@dataclass(frozen=True)
class ModelShape:
    """What sizes a token's KV: layers x KV heads x head dim x 2 (K and V) x bytes per element."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 4  # float32 on CPU

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @classmethod
    def from_hf_config(cls, config: dict, dtype_bytes: int = 4) -> "ModelShape":
        heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        return cls(config["num_hidden_layers"], config.get("num_key_value_heads", heads), head_dim, dtype_bytes)


def kv_cache_bytes(distinct_prefix_tokens: int, ratio: float, shape: ModelShape, block_size: int = 16) -> int:
    """One worker's KV pool such that the workload's distinct shared prefixes need ``ratio`` x it
    (rounded down to whole blocks; at least one block)."""
    if distinct_prefix_tokens < 1 or ratio <= 0:
        raise ValueError("need distinct_prefix_tokens >= 1 and ratio > 0")
    blocks = max(1, math.floor(distinct_prefix_tokens / ratio / block_size))
    return blocks * block_size * shape.kv_bytes_per_token


def pool_ratio(distinct_prefix_tokens: int, kv_bytes: int, shape: ModelShape) -> float:
    """How many worker pools the distinct prefixes need (the issue's 3-6x)."""
    return distinct_prefix_tokens * shape.kv_bytes_per_token / kv_bytes


def tenants_file(config: str, grants: dict | None = None, template: str | None = None) -> dict:
    """The tenants file every configuration reads: ``bench`` (shared-prefix, multi-turn, trace),
    the multi-tenant mix's tenants (``grants``: ``bench.workloads.multi_tenant_tenants()``) and the
    template tenant, whose default reuse is approximate only under ``kvmesh+approx``. No rate
    limits: the load generator, not admission, sets the load."""
    tenants = [{"name": BENCH_TENANT, "api_keys": [f"sk-{BENCH_TENANT}"]}]
    for t in (grants or {}).get("tenants", []):
        tenants.append(copy.deepcopy(t))
    tmpl = {"name": TEMPLATE_TENANT, "api_keys": [f"sk-{TEMPLATE_TENANT}"],
            "reuse": "approximate" if config == "kvmesh+approx" else "exact"}
    if template:
        tmpl["templates"] = {TEMPLATE_ID: template}
    tenants.append(tmpl)
    names = [t["name"] for t in tenants]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate tenant names {names}")
    return {"admin_keys": [BENCH_ADMIN_KEY], "tenants": tenants}


def serve_config(config: str, *, host: str, port: int, workers: int, kv_bytes: int, tenants_path: str,
                 shipped: dict | None = None, max_num_seqs: int | None = None) -> dict:
    """The Serve config of ``config``, derived from its shipped file (``shipped``: its parsed
    YAML, read from ``SHIPPED_SERVE`` when None)."""
    if config not in CONFIGS:
        raise ValueError(f"unknown configuration {config!r}; known: {CONFIGS}")
    cfg = copy.deepcopy(shipped if shipped is not None else yaml.safe_load(SHIPPED_SERVE[config].read_text()))
    cfg["http_options"] = {**cfg.get("http_options", {}), "host": host, "port": port}
    if len(cfg["applications"]) != 1:
        raise ValueError("expected one application in the shipped config")
    app = cfg["applications"][0]
    app["name"] = config.replace("+", "-")
    args = app.setdefault("args", {})
    args.update(workers=workers, kv_cache_bytes=kv_bytes, tenants=tenants_path, worker_num_cpus=1)
    if max_num_seqs is not None:
        args["max_num_seqs"] = max_num_seqs
    if config.startswith("kvmesh"):
        args["max_workers"] = workers  # fixed pool: same workers as the baselines
    else:
        for d in app.get("deployments", []):
            if d.get("name") == "EngineReplica":
                d["num_replicas"] = workers
    return cfg


def dump_yaml(data: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def model_shape(model_dir: Path) -> ModelShape:
    return ModelShape.from_hf_config(json.loads((model_dir / "config.json").read_text()))
