"""Tenant-aware autoscaling: how many workers the pool needs and which tenant gets how many.

Pure policy (no Ray). The pool samples per-tenant demand (tokens of queued and running requests)
every tick and asks ``TenantAutoscaler.decide`` for a target; it then creates or drains workers
and assigns them to tenants.

Sizing rule, per tenant t:
    need_t  = ceil((queued_t + running_t) / target_tokens_per_worker)
    want_t  = clamp(need_t, min_t, max_t)           (min_t: guaranteed workers, max_t: cap)
Allocation: every tenant first gets its guaranteed ``min_t`` (the sum of minimums must fit in
``max_workers``); the rest of ``max_workers`` goes one worker at a time to the tenant with the
fewest allocated workers among those still wanting more (ties: more unmet demand first, then
name), so one tenant's burst can never take another tenant's guaranteed workers.
Target = max(min_workers, sum of allocations). Scaling up happens after demand has wanted it for
``upscale_delay_s``; scaling down after it has wanted fewer workers for ``downscale_delay_s``
(then to the largest target seen in that window), so short gaps in a burst do not thrash.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

TenantId = str


@dataclass(frozen=True)
class TenantShare:
    min_workers: int = 0
    max_workers: int | None = None  # None: up to the pool's max

    def __post_init__(self):
        if isinstance(self.min_workers, bool) or not isinstance(self.min_workers, int) or self.min_workers < 0:
            raise ValueError(f"workers.min must be an integer >= 0, got {self.min_workers!r}")
        if self.max_workers is not None and (isinstance(self.max_workers, bool) or not isinstance(self.max_workers, int)
                                             or self.max_workers < max(1, self.min_workers)):
            raise ValueError(f"workers.max must be an integer >= max(1, workers.min), got {self.max_workers!r}")


@dataclass(frozen=True)
class TenantDemand:
    queued_tokens: int = 0  # prompt + max output tokens of requests not yet started
    running_tokens: int = 0  # remaining tokens of started requests

    @property
    def tokens(self) -> int:
        return self.queued_tokens + self.running_tokens


@dataclass(frozen=True)
class AutoscaleConfig:
    min_workers: int = 1
    max_workers: int = 1
    target_tokens_per_worker: int = 4096
    upscale_delay_s: float = 0.0
    downscale_delay_s: float = 30.0
    interval_s: float = 1.0

    def __post_init__(self):
        if self.min_workers < 0 or self.max_workers < max(1, self.min_workers):
            raise ValueError("autoscaling needs 0 <= min_workers <= max_workers and max_workers >= 1")
        if self.target_tokens_per_worker < 1:
            raise ValueError("target_tokens_per_worker must be >= 1")
        if self.upscale_delay_s < 0 or self.downscale_delay_s < 0 or self.interval_s <= 0:
            raise ValueError("delays must be >= 0 and interval_s > 0")


@dataclass(frozen=True)
class ScaleDecision:
    target: int
    allocation: tuple[tuple[TenantId, int], ...]  # sorted by tenant; sum <= target

    def for_tenant(self, tenant: TenantId) -> int:
        return dict(self.allocation).get(tenant, 0)


def check_shares(shares: Mapping[TenantId, TenantShare], config: AutoscaleConfig) -> None:
    total_min = sum(s.min_workers for s in shares.values())
    if total_min > config.max_workers:
        raise ValueError(f"tenants' guaranteed workers ({total_min}) exceed max_workers ({config.max_workers})")


def allocate(demands: Mapping[TenantId, TenantDemand], shares: Mapping[TenantId, TenantShare],
             config: AutoscaleConfig) -> ScaleDecision:
    """The instantaneous target and per-tenant allocation for this demand (no hysteresis)."""
    check_shares(shares, config)
    tenants = sorted(set(shares) | set(demands))
    alloc: dict[TenantId, int] = {}
    want: dict[TenantId, int] = {}
    unmet_tokens: dict[TenantId, int] = {}
    for t in tenants:
        share = shares.get(t, TenantShare())
        cap = config.max_workers if share.max_workers is None else min(share.max_workers, config.max_workers)
        tokens = demands.get(t, TenantDemand()).tokens
        need = math.ceil(tokens / config.target_tokens_per_worker)
        want[t] = max(share.min_workers, min(need, cap))
        alloc[t] = share.min_workers
        unmet_tokens[t] = tokens
    budget = config.max_workers - sum(alloc.values())
    while budget > 0:
        hungry = [t for t in tenants if alloc[t] < want[t]]
        if not hungry:
            break
        t = min(hungry, key=lambda t: (alloc[t], -unmet_tokens[t], t))
        alloc[t] += 1
        budget -= 1
    target = max(config.min_workers, sum(alloc.values()))
    return ScaleDecision(target, tuple((t, n) for t, n in sorted(alloc.items()) if n > 0))


class TenantAutoscaler:
    """``allocate`` plus up/down delays. Invariant: ``decide`` returns targets within
    [min_workers, max_workers]; the allocation always follows demand, only the target is delayed."""

    def __init__(self, config: AutoscaleConfig, shares: Mapping[TenantId, TenantShare]):
        check_shares(shares, config)
        self.config = config
        self.shares = dict(shares)
        self._up_since: float | None = None
        self._down_since: float | None = None
        self._down_peak = 0

    def decide(self, current: int, demands: Mapping[TenantId, TenantDemand], now: float) -> ScaleDecision:
        want = allocate(demands, self.shares, self.config)
        target = current
        if want.target > current:
            self._down_since = None
            if self._up_since is None:
                self._up_since = now
            if now - self._up_since >= self.config.upscale_delay_s:
                target, self._up_since = want.target, None
        elif want.target < current:
            self._up_since = None
            if self._down_since is None:
                self._down_since, self._down_peak = now, want.target
            self._down_peak = max(self._down_peak, want.target)
            if now - self._down_since >= self.config.downscale_delay_s:
                target, self._down_since = self._down_peak, None
        else:
            self._up_since = self._down_since = None
        target = min(self.config.max_workers, max(self.config.min_workers, target))
        return ScaleDecision(target, want.allocation)
