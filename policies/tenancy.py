"""Tenants: the tenants file, API keys, grants, default reuse modes, rate and concurrency limits.

Pure policy (no Ray, no torch). The serving front loads the file once (``KVMESH_TENANTS``, else
the example in ``cluster/``), authenticates every request by its API key and asks
``Admission`` whether the tenant may start one more request now.

The tenants file (YAML; only ``name`` and ``api_keys`` are required)::

    tenants:
      - name: acme
        api_keys: [sk-acme-demo]
        share_with: [globex]      # grant: these tenants may reuse acme's KV (default: none)
        reuse: exact              # default reuse mode: approximate | exact | none
        priority: 1               # eviction priority class: higher is evicted last
        latency_guard: false      # true: lower classes' prefill chunks are capped at all times
        cache: {min_blocks: 0, max_blocks: null, ttl_s: null}     # see policies.eviction
        limits: {requests_per_s: 20, burst: 40, max_concurrent: 16}  # null = unlimited
        workers: {min: 1, max: 4}  # autoscaling: guaranteed workers and cap (policies.autoscale)
        templates: {sent: "Review: {text}\nLabel:"}   # approximate reuse: named templates
        remap:                    # approximate reuse (policies.remap)
          policy: hash            # identity | hash | learnable
          recompute_ratio: 0.3    # the first recompute share the quality gate tries
          gate: true              # measure quality per template before serving approximately
          min_agreement: 1.0      # share of shadow checks whose greedy output must agree exactly
          calibration_samples: 4  # shadow checks per calibration (and sliding window when open)
          max_kl: null            # optional bound on the mean first-token KL of those checks
          recheck_every: 8        # once open, every n-th request is served exactly and checked
          ladder: [0.5, 0.7]      # recompute shares tried after a failed calibration
          backoff_requests: 64    # past the ladder: requests served exactly before retrying

Share domains: a tenant writes its KV blocks into its own domain (its name), so no other
tenant can hit them. A grant ``acme.share_with: [globex]`` adds ``acme`` to globex's read
domains: globex's requests may reuse acme's blocks, never the other way round unless globex
grants acme too. Users of one tenant share, unless a request carries a ``cache_salt``
(vLLM's field): it writes into and reads only the domain ``<tenant>#salt:<digest of the salt>``,
so requests with different salts (or one salted, one not) never share KV, and a salted request
reads no granted domain either (as in vLLM, where the salt enters the first block's hash).

Admin keys (top-level ``admin_keys: [...]``) are not tenants: they cannot run completions; they
see every tenant's state in ``/kvmesh/workers`` (and ``/metrics`` when the app restricts it).
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from policies.autoscale import TenantShare
from policies.eviction import TenantQuota
from policies.remap import GateConfig

TenantId = str
# The request reuse modes (the engine imports them from here).
REUSE_MODES = ("approximate", "exact", "none")
TENANTS_ENV = "KVMESH_TENANTS"
# A salted share domain is "<tenant>" + SALT_SEP + a digest of the salt; tenant names cannot
# contain "#" (nor "/", the gate keys' separator), so a domain always names its tenant
# (``domain_tenant``).
SALT_SEP = "#salt:"
MAX_CACHE_SALT_CHARS = 256


class TenantsError(ValueError):
    """The tenants file is malformed; the message names the tenant and the field."""


@dataclass(frozen=True)
class RateLimit:
    """Token bucket: ``requests_per_s`` refill, ``burst`` capacity; ``max_concurrent`` in flight.
    ``None`` means unlimited."""

    requests_per_s: float | None = None
    burst: int | None = None
    max_concurrent: int | None = None

    def __post_init__(self):
        if self.requests_per_s is not None and not self.requests_per_s > 0:
            raise TenantsError("limits.requests_per_s must be > 0 (or null)")
        if self.burst is not None and (not isinstance(self.burst, int) or self.burst < 1):
            raise TenantsError("limits.burst must be an integer >= 1 (or null)")
        if self.max_concurrent is not None and (not isinstance(self.max_concurrent, int) or self.max_concurrent < 1):
            raise TenantsError("limits.max_concurrent must be an integer >= 1 (or null)")

    @property
    def capacity(self) -> float:
        """Bucket size: ``burst``, else one second's worth of requests (at least 1)."""
        if self.burst is not None:
            return float(self.burst)
        return max(1.0, float(self.requests_per_s or 1.0))

    def batch_window(self, prompts: int) -> int:
        """How many of a batched request's ``prompts`` may ask for admission at once: all of them,
        at most ``max_concurrent``, and with a rate limit at most what its bucket holds (each
        prompt takes a lease and a token; the rest start as the first ones end)."""
        n = prompts
        if self.max_concurrent is not None:
            n = min(n, self.max_concurrent)
        if self.requests_per_s is not None:
            n = min(n, int(self.capacity))
        return max(1, n)


@dataclass(frozen=True)
class TenantConfig:
    name: TenantId
    api_keys: tuple[str, ...]
    share_with: tuple[TenantId, ...] = ()
    reuse: str = "exact"
    priority: int = 0
    cache: TenantQuota = TenantQuota()
    limits: RateLimit = RateLimit()
    workers: TenantShare = TenantShare()
    # approximate reuse: templates {id: "text with {param}"} and the remap policy / recompute share
    templates: tuple[tuple[str, str], ...] = ()
    remap_policy: str | None = None
    recompute_ratio: float | None = None
    # the quality gate's thresholds for this tenant's approximate requests; None: ungated
    quality_gate: GateConfig | None = GateConfig()


_TENANT_FIELDS = {"name", "api_keys", "share_with", "reuse", "priority", "latency_guard", "cache", "limits",
                  "workers", "templates", "remap"}


# remap: keys of the quality gate -> GateConfig fields
_GATE_FIELDS = {"min_agreement": "min_agreement", "calibration_samples": "samples", "max_kl": "max_kl",
                "recheck_every": "recheck_every", "ladder": "ladder", "backoff_requests": "backoff_requests"}


def _parse_gate(remap: dict, where: str) -> GateConfig | None:
    """The tenant's quality gate: on unless ``remap.gate`` is false; thresholds from ``remap``."""
    on = remap.get("gate", True)
    if not isinstance(on, bool):
        raise TenantsError(f"{where}: remap.gate must be true or false")
    given = {_GATE_FIELDS[k]: v for k, v in remap.items() if k in _GATE_FIELDS}
    if not on:
        if given:
            raise TenantsError(f"{where}: remap.gate is false but gate thresholds "
                               f"{sorted(k for k in remap if k in _GATE_FIELDS)} are set")
        return None
    if "ladder" in given:
        if not isinstance(given["ladder"], list):
            raise TenantsError(f"{where}: remap.ladder must be a list of recompute shares in [0, 1]")
        given["ladder"] = tuple(given["ladder"])
    backoff = given.get("backoff_requests")
    if isinstance(backoff, int) and not isinstance(backoff, bool):
        given["max_backoff_requests"] = max(GateConfig.max_backoff_requests, backoff)
    try:
        return GateConfig(**given)
    except ValueError as e:  # GateConfig names its field first: name the file's key instead
        key, field_ = next(((k, f) for k, f in _GATE_FIELDS.items() if str(e).startswith(f + " ")), ("gate", ""))
        raise TenantsError(f"{where}: remap.{key}{str(e)[len(field_):]}") from None


def _parse_remap(d: dict, where: str) -> tuple[tuple[tuple[str, str], ...], str | None, float | None, GateConfig | None]:
    from policies.remap import REMAP_POLICIES

    templates = d.get("templates") or {}
    if not isinstance(templates, dict) or not all(isinstance(k, str) and k and isinstance(v, str) and v
                                                  for k, v in templates.items()):
        raise TenantsError(f"{where}: templates must map template ids to non-empty template texts")
    remap = d.get("remap") or {}
    if not isinstance(remap, dict) or set(remap) - {"policy", "recompute_ratio", "gate", *_GATE_FIELDS}:
        raise TenantsError(f"{where}: remap must be a mapping with policy, recompute_ratio, gate and the gate's "
                           f"thresholds {sorted(_GATE_FIELDS)}")
    policy, r = remap.get("policy"), remap.get("recompute_ratio")
    if policy is not None and policy not in REMAP_POLICIES:
        raise TenantsError(f"{where}: remap.policy must be one of {sorted(REMAP_POLICIES)}")
    if r is not None and (isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 <= r <= 1):
        raise TenantsError(f"{where}: remap.recompute_ratio must be in [0, 1]")
    return tuple(sorted(templates.items())), policy, None if r is None else float(r), _parse_gate(remap, where)


def _parse_tenant(d: object, defaults: Mapping) -> TenantConfig:
    if not isinstance(d, dict):
        raise TenantsError(f"each tenant must be a mapping, got {d!r}")
    d = {**defaults, **d}
    name = d.get("name")
    if not isinstance(name, str) or not name.strip():
        raise TenantsError(f"a tenant needs a non-empty string name, got {name!r}")
    if "#" in name or "/" in name:
        raise TenantsError(f"tenant name {name!r} must not contain '#' or '/' (they separate salted share "
                           "domains and gate keys)")
    where = f"tenant {name!r}"
    unknown = set(d) - _TENANT_FIELDS
    if unknown:
        raise TenantsError(f"{where}: unknown fields {sorted(unknown)}")
    keys = d.get("api_keys")
    if not isinstance(keys, list) or not keys or not all(isinstance(k, str) and k for k in keys):
        raise TenantsError(f"{where}: api_keys must be a non-empty list of non-empty strings")
    share = d.get("share_with") or []
    if not isinstance(share, list) or not all(isinstance(s, str) for s in share):
        raise TenantsError(f"{where}: share_with must be a list of tenant names")
    reuse = d.get("reuse", "exact")
    if reuse not in REUSE_MODES:
        raise TenantsError(f"{where}: reuse must be one of {REUSE_MODES}, got {reuse!r}")
    priority = d.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise TenantsError(f"{where}: priority must be an integer")
    guard = d.get("latency_guard", False)
    if not isinstance(guard, bool):
        raise TenantsError(f"{where}: latency_guard must be true or false")
    cache_d = d.get("cache") or {}
    if isinstance(cache_d, dict) and {"priority", "latency_guard"} & set(cache_d):
        raise TenantsError(f"{where}: priority and latency_guard are tenant fields, not cache fields")
    try:
        cache = TenantQuota(priority=priority, latency_guard=guard, **cache_d)
        limits = RateLimit(**(d.get("limits") or {}))
        w = d.get("workers") or {}
        if not isinstance(w, dict) or set(w) - {"min", "max"}:
            raise TenantsError(f"{where}: workers must be a mapping with min and max")
        workers = TenantShare(min_workers=w.get("min", 0), max_workers=w.get("max"))
    except (TypeError, ValueError) as e:
        raise TenantsError(f"{where}: {e}") from None
    templates, remap_policy, recompute_ratio, gate = _parse_remap(d, where)
    return TenantConfig(name=name, api_keys=tuple(keys), share_with=tuple(share), reuse=reuse,
                        priority=priority, cache=cache, limits=limits, workers=workers,
                        templates=templates, remap_policy=remap_policy, recompute_ratio=recompute_ratio,
                        quality_gate=gate)


class Tenants:
    """The validated tenants table. Invariants: names and API keys are unique; every grant names
    an existing other tenant."""

    def __init__(self, tenants: list[TenantConfig], admin_keys: tuple[str, ...] = ()):
        self.by_name: dict[TenantId, TenantConfig] = {}
        self._by_key: dict[str, TenantConfig] = {}
        self.admin_keys = frozenset(admin_keys)
        for t in tenants:
            if t.name in self.by_name:
                raise TenantsError(f"duplicate tenant name {t.name!r}")
            self.by_name[t.name] = t
            for k in t.api_keys:
                if k in self._by_key:
                    raise TenantsError(f"API key of tenant {t.name!r} is also used by {self._by_key[k].name!r}")
                self._by_key[k] = t
        for t in tenants:
            for other in t.share_with:
                if other not in self.by_name:
                    raise TenantsError(f"tenant {t.name!r}: share_with names unknown tenant {other!r}")
                if other == t.name:
                    raise TenantsError(f"tenant {t.name!r}: share_with names itself")
        if not self.by_name:
            raise TenantsError("the tenants file defines no tenants")
        clash = self.admin_keys & set(self._by_key)
        if clash:
            raise TenantsError(f"admin key(s) also used as API keys of tenants "
                               f"{sorted({self._by_key[k].name for k in clash})}")

    @classmethod
    def from_dict(cls, data: object) -> "Tenants":
        if not isinstance(data, dict) or not isinstance(data.get("tenants"), list):
            raise TenantsError("the tenants file must be a mapping with a 'tenants' list")
        unknown = set(data) - {"tenants", "defaults", "admin_keys"}
        if unknown:
            raise TenantsError(f"unknown top-level fields {sorted(unknown)}")
        defaults = data.get("defaults") or {}
        if not isinstance(defaults, dict) or {"name", "api_keys"} & set(defaults):
            raise TenantsError("defaults must be a mapping without name or api_keys")
        admin = data.get("admin_keys") or []
        if not isinstance(admin, list) or not all(isinstance(k, str) and k for k in admin):
            raise TenantsError("admin_keys must be a list of non-empty strings")
        return cls([_parse_tenant(t, defaults) for t in data["tenants"]], tuple(admin))

    # -- questions ---------------------------------------------------------------------------
    def authenticate(self, api_key: str | None) -> TenantConfig | None:
        """The tenant owning ``api_key``; None for a missing or unknown key."""
        if not api_key:
            return None
        return self._by_key.get(api_key)

    def is_admin(self, api_key: str | None) -> bool:
        """Whether ``api_key`` is one of the file's ``admin_keys``."""
        return bool(api_key) and api_key in self.admin_keys

    def __getitem__(self, name: TenantId) -> TenantConfig:
        return self.by_name[name]

    def __iter__(self):
        return iter(self.by_name.values())

    def names(self) -> list[TenantId]:
        return list(self.by_name)

    def share_domain(self, name: TenantId) -> str:
        """The domain a tenant's blocks are written into: its own."""
        return name

    def read_domains(self, name: TenantId) -> tuple[str, ...]:
        """Domains besides its own that ``name`` may read: those of tenants that granted it."""
        return tuple(sorted(t.name for t in self.by_name.values() if name in t.share_with))

    def request_domains(self, name: TenantId, cache_salt: str | None = None) -> tuple[str, tuple[str, ...]]:
        """(share domain, read domains) of one request of ``name``: its own domain and grants,
        or with a ``cache_salt`` the salted domain alone (see the module docstring)."""
        if cache_salt is None:
            return self.share_domain(name), self.read_domains(name)
        return salted_domain(name, cache_salt), ()

    def eviction_quotas(self) -> dict[TenantId, TenantQuota]:
        return {t.name: t.cache for t in self.by_name.values()}

    def worker_shares(self) -> dict[TenantId, TenantShare]:
        return {t.name: t.workers for t in self.by_name.values()}

    def quality_gates(self) -> dict[TenantId, GateConfig | None]:
        """Per tenant its approximate-reuse quality gate (None: ungated), for the engine's
        ``ApproxConfig.tenant_gates``."""
        return {t.name: t.quality_gate for t in self.by_name.values()}


def check_cache_salt(salt: object) -> str:
    """A valid ``cache_salt`` (non-empty string of at most ``MAX_CACHE_SALT_CHARS``) or ValueError."""
    if not isinstance(salt, str) or not salt or len(salt) > MAX_CACHE_SALT_CHARS:
        raise ValueError(f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters")
    return salt


def salted_domain(name: TenantId, cache_salt: str) -> str:
    """The share domain of ``name``'s requests salted with ``cache_salt``: the salt itself never
    appears (a 128-bit digest of tenant and salt does), so introspection cannot show it."""
    check_cache_salt(cache_salt)
    digest = hashlib.sha256(name.encode() + b"\0" + cache_salt.encode("utf-8", "surrogatepass")).hexdigest()[:32]
    return f"{name}{SALT_SEP}{digest}"


def domain_tenant(domain: str) -> TenantId:
    """The tenant owning a share domain (its own or one of its salted domains)."""
    return domain.split("#", 1)[0]


def read_label(reader_domain: str, owner_domain: str) -> str:
    """How a request of ``reader_domain`` reused KV stored under ``owner_domain``, for the
    isolation counters (bounded by tenants, not by salts): ``"own"`` (same domain), ``"salt"``
    (another domain of the same tenant: a salted and an unsalted request, or two salts; must
    never happen) or ``"tenant:<owner>"`` (another tenant's domain: only through a grant)."""
    if reader_domain == owner_domain:
        return "own"
    owner = domain_tenant(owner_domain)
    return "salt" if owner == domain_tenant(reader_domain) else f"tenant:{owner}"


def tenants_path(default: str | os.PathLike) -> Path:
    """``$KVMESH_TENANTS`` if set, else ``default``."""
    return Path(os.environ.get(TENANTS_ENV) or default)


def read_tenants_file(path: str | os.PathLike) -> dict:
    import yaml

    p = Path(path)
    if not p.is_file():
        raise TenantsError(f"tenants file {p} not found (set {TENANTS_ENV} or pass tenants=...)")
    with open(p) as f:
        data = yaml.safe_load(f)
    Tenants.from_dict(data)  # validate early, with the file's name in the traceback
    return data


# -- admission: rate and concurrency limits ----------------------------------------------------
@dataclass
class TokenBucket:
    """Refills ``rate`` tokens per second up to ``capacity``; a request takes one token."""

    rate: float
    capacity: float
    tokens: float = field(default=-1.0)
    updated: float = 0.0

    def __post_init__(self):
        if self.tokens < 0:
            self.tokens = self.capacity

    def take(self, now: float) -> float:
        """Take a token: 0.0 on success, else the seconds until one is available (nothing taken)."""
        self.tokens = min(self.capacity, self.tokens + max(0.0, now - self.updated) * self.rate)
        self.updated = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate


@dataclass(frozen=True)
class AdmitDecision:
    ok: bool
    retry_after_s: float = 0.0
    reason: str = ""  # "rate" | "concurrency" when refused

    @property
    def retry_after_header(self) -> str:
        """Retry-After is whole seconds; never 0 for a refusal."""
        return str(max(1, math.ceil(self.retry_after_s)))


class Admission:
    """Per-tenant token buckets and in-flight counts. Invariant: ``inflight[t]`` equals the number
    of ``admit`` successes for t not yet matched by ``release``; a refused request consumes
    nothing."""

    def __init__(self, tenants: Tenants):
        self.tenants = tenants
        self._buckets: dict[TenantId, TokenBucket] = {}
        self.inflight: dict[TenantId, int] = {}

    def admit(self, tenant: TenantId, now: float) -> AdmitDecision:
        limits = self.tenants[tenant].limits
        n = self.inflight.get(tenant, 0)
        if limits.max_concurrent is not None and n >= limits.max_concurrent:
            return AdmitDecision(False, 1.0, "concurrency")
        if limits.requests_per_s is not None:
            bucket = self._buckets.get(tenant)
            if bucket is None:
                bucket = self._buckets[tenant] = TokenBucket(limits.requests_per_s, limits.capacity, updated=now)
            wait = bucket.take(now)
            if wait > 0:
                return AdmitDecision(False, wait, "rate")
        self.inflight[tenant] = n + 1
        return AdmitDecision(True)

    def update(self, tenants: Tenants) -> None:
        """Apply a new tenants table (a redeploy): in-flight counts are kept (releases of requests
        admitted before still match); a tenant whose limits changed starts a fresh bucket."""
        for name in list(self._buckets):
            if name not in tenants.by_name or tenants[name].limits != self.tenants[name].limits:
                del self._buckets[name]
        self.tenants = tenants

    def release(self, tenant: TenantId) -> None:
        n = self.inflight.get(tenant, 0)
        if n <= 0:
            raise RuntimeError(f"release without admit for tenant {tenant!r}")
        self.inflight[tenant] = n - 1
