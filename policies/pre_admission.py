"""A replica's pre-admission: refuse at once what the controller would refuse anyway.

The controller's ``policies.tenancy.Admission`` is the authority on a tenant's limits: it sees
every replica's requests. But asking it costs the whole request path first (the body read from
the Serve proxy, parsing, validation, tokenizing, a controller round trip), and a tenant that
ignores Retry-After makes the ingress do that work dozens of times a second for nothing, on the
cores the other tenants' requests need. Each ingress replica therefore keeps a
``LocalAdmission``, consulted right after authentication, before the body is read. It knows the
tenants' limits and what this replica's own requests have told it:

* **leases held**: per tenant, the requests of this replica the controller admitted whose lease
  has not ended yet. Each holds one unit of the controller's in-flight count, and the replica
  forgets a lease before it sends ``end``, so ``held <= controller in-flight``; hence
  ``held >= max_concurrent`` means the controller refuses too.
* **an upper bound on the controller's token bucket**: the bucket refills at ``rate`` up to
  ``capacity`` and only ever loses tokens to admissions, so a bound proved at one time stays a
  bound when refilled the same way. Two events tighten it (``ts`` is when the replica sent the
  request, before the controller looked at it, ``now`` when the answer came):
  a refusal for rate with wait ``w`` says the bucket held ``1 - rate * w`` tokens when the
  controller looked, so ``1 - rate * w + rate * (t - ts)`` bounds it at any later ``t``; an
  admission says the controller took one token at some moment between ``ts`` and ``now`` from a
  bucket holding at most ``B`` (the bound at ``ts``) plus the refill since, so
  ``min(capacity, B + rate * (now - ts) - 1)`` bounds it at ``now``. Without events the bound is
  the full bucket.

Soundness (the invariant): ``check`` refuses only when the controller, looking at the request at
the same instant, would refuse it too (by concurrency: ``held >= max_concurrent``; by rate: the
bound is below one token, and the Retry-After it gives, ``(1 - bound) / rate``, is at most the
controller's own). It never refuses a request the controller would admit, with these documented
exceptions, all bounded in time: a changed tenants file reaches a replica on its next heartbeat
(``update``; until then the old limits apply here); a lease the controller reclaimed (the replica
was presumed dead) still counts here until its stream ends; a new controller (``reset``, on
reconnect) starts with empty counts and full buckets, as does the new controller.

Pure logic, no Ray; ``cluster.controller.ControllerClient`` drives it (``sent`` / ``admitted`` /
``refused`` / ``released`` around each lease).
"""

from __future__ import annotations

from dataclasses import dataclass

from policies.tenancy import AdmitDecision, RateLimit, TenantId, Tenants

EPS = 1e-9  # float slack: a bound within EPS of one token is not a refusal


@dataclass
class _Bound:
    """At most ``tokens`` tokens in the controller's bucket at time ``at``."""

    tokens: float
    at: float

    def value(self, now: float, rate: float, capacity: float) -> float:
        return min(capacity, self.tokens + max(0.0, now - self.at) * rate)


class Ticket:
    """One request sent to the controller by this replica (its state: sent, admitted, released)."""

    __slots__ = ("tenant", "sent_at", "bound_at_send", "epoch", "admitted", "released")

    def __init__(self, tenant: TenantId, sent_at: float, bound_at_send: float | None, epoch: int):
        self.tenant, self.sent_at, self.bound_at_send, self.epoch = tenant, sent_at, bound_at_send, epoch
        self.admitted = self.released = False


class LocalAdmission:
    """Per replica: leases held and token-bucket bounds per tenant (see the module docstring).

    Invariant: ``held[t]`` equals the tickets of tenant t of the current epoch that were
    ``admitted`` and not yet ``released``; a refused, failed or older-epoch ticket holds nothing."""

    def __init__(self, tenants: Tenants):
        self.tenants = tenants
        self.held: dict[TenantId, int] = {}
        self._bounds: dict[TenantId, _Bound] = {}
        self.epoch = 0
        self.refused_here = 0  # requests this replica refused without asking the controller

    def _limits(self, tenant: TenantId) -> RateLimit | None:
        t = self.tenants.by_name.get(tenant)
        return None if t is None else t.limits

    def _bound(self, tenant: TenantId, limits: RateLimit, now: float) -> float | None:
        if limits.requests_per_s is None:
            return None
        b = self._bounds.get(tenant)
        cap = limits.capacity
        return cap if b is None else b.value(now, limits.requests_per_s, cap)

    def _tighten(self, tenant: TenantId, limits: RateLimit, tokens: float, now: float) -> None:
        cur = self._bound(tenant, limits, now)
        if cur is not None and tokens < cur:
            self._bounds[tenant] = _Bound(tokens, now)

    def check(self, tenant: TenantId, now: float) -> AdmitDecision:
        """Refuse (``ok`` False, with the reason and the seconds until a retry can pass) only what
        the controller would refuse at ``now``; else ``ok`` (the controller still decides)."""
        limits = self._limits(tenant)
        if limits is None:
            return AdmitDecision(True)
        if limits.max_concurrent is not None and self.held.get(tenant, 0) >= limits.max_concurrent:
            self.refused_here += 1
            return AdmitDecision(False, 1.0, "concurrency")
        bound = self._bound(tenant, limits, now)
        if bound is not None and bound < 1.0 - EPS:
            self.refused_here += 1
            return AdmitDecision(False, (1.0 - bound) / limits.requests_per_s, "rate")
        return AdmitDecision(True)

    def sent(self, tenant: TenantId, now: float) -> Ticket:
        """A request of ``tenant`` goes to the controller now."""
        limits = self._limits(tenant)
        bound = None if limits is None else self._bound(tenant, limits, now)
        return Ticket(tenant, now, bound, self.epoch)

    def admitted(self, ticket: Ticket, now: float) -> None:
        """The controller admitted ``ticket``'s request (a lease was begun); the answer came at ``now``."""
        if ticket.epoch != self.epoch or ticket.admitted:
            return
        ticket.admitted = True
        self.held[ticket.tenant] = self.held.get(ticket.tenant, 0) + 1
        limits = self._limits(ticket.tenant)
        if limits is not None and limits.requests_per_s is not None and ticket.bound_at_send is not None:
            took = ticket.bound_at_send + max(0.0, now - ticket.sent_at) * limits.requests_per_s - 1.0
            self._tighten(ticket.tenant, limits, min(limits.capacity, took), now)

    def refused(self, ticket: Ticket, reason: str, retry_after_s: float, now: float) -> None:
        """The controller refused ``ticket``'s request for ``reason`` ("rate": the bucket needs
        ``retry_after_s`` more seconds for one token)."""
        if ticket.epoch != self.epoch or reason != "rate":
            return
        limits = self._limits(ticket.tenant)
        if limits is None or limits.requests_per_s is None:
            return
        left = 1.0 - retry_after_s * limits.requests_per_s  # tokens when the controller looked
        self._tighten(ticket.tenant, limits, left + max(0.0, now - ticket.sent_at) * limits.requests_per_s, now)

    def released(self, ticket: Ticket) -> None:
        """``ticket``'s request ended (its lease is about to be ended); idempotent."""
        if ticket.released:
            return
        ticket.released = True
        if ticket.admitted and ticket.epoch == self.epoch:
            n = self.held.get(ticket.tenant, 0)
            if n <= 0:
                raise RuntimeError(f"release without admission for tenant {ticket.tenant!r}")
            self.held[ticket.tenant] = n - 1

    def update(self, tenants: Tenants) -> None:
        """New tenants data (as ``Admission.update``): held counts kept; a tenant whose limits
        changed or who left loses its bound (the controller starts it a fresh, full bucket)."""
        for name in list(self._bounds):
            if name not in tenants.by_name or tenants[name].limits != self._limits(name):
                del self._bounds[name]
        self.tenants = tenants

    def reset(self) -> None:
        """A new controller (reconnect): it counts nothing and its buckets are full; so here.
        Tickets of the old epoch are ignored from now on."""
        self.epoch += 1
        self.held.clear()
        self._bounds.clear()
