"""How long an ingress replica holds a 429 before sending it (pure rule, no Ray, no clock of its own).

A client that ignores ``Retry-After`` and retries at once turns every refusal into another
request the HTTP front end must accept, route and refuse: ``bench/flood.py`` measured six such
clients at ~70 refusals/s costing ~1 of 2 cores in the Serve proxy and the ingress replica,
CPU taken from the engine that serves the well-behaved tenants. Holding the refusal of a client
that retried inside its last ``Retry-After`` window (an ``asyncio.sleep``: no CPU) makes such a
closed-loop client's refusals cost ``1 / max_delay_s`` per connection per second instead.

Rule, per tenant: a refusal at ``now`` is held ``max_delay_s`` iff the tenant's previous refusal
told it to wait until after ``now`` (it retried early) and fewer than ``max_held`` refusals are
being held; otherwise it is sent at once. Either way the tenant is then told to wait until
``now + delay + retry_after_s``.

Invariants:
  * a tenant whose clients respect ``Retry-After`` is never delayed (its first refusal after a
    quiet period is sent at once);
  * ``held <= max_held`` (a flood of many connections gets immediate refusals beyond it, so the
    number of held connections, and their memory, is bounded); ``max_delay_s == 0`` disables it;
  * a delay is never longer than ``max_delay_s``; the refusal itself (status, body,
    ``Retry-After``) is unchanged.
"""

from __future__ import annotations


class RejectionDelay:
    def __init__(self, max_delay_s: float = 1.0, max_held: int = 256):
        if max_delay_s < 0:
            raise ValueError("max_delay_s must be >= 0")
        if max_held < 0:
            raise ValueError("max_held must be >= 0")
        self.max_delay_s = float(max_delay_s)
        self.max_held = max_held
        self.held = 0
        self.num_delayed = 0
        self._until: dict[str, float] = {}  # tenant -> when its last refusal allowed a retry

    def acquire(self, tenant: str, now: float, retry_after_s: float) -> float:
        """Seconds to hold this refusal of ``tenant`` (0: send it now). A positive answer counts
        as held until the caller's ``release()``."""
        early = now < self._until.get(tenant, float("-inf"))
        delay = self.max_delay_s if early and self.held < self.max_held else 0.0
        self._until[tenant] = now + delay + max(0.0, retry_after_s)
        if delay > 0:
            self.held += 1
            self.num_delayed += 1
        return delay

    def release(self) -> None:
        """A held refusal was sent (or its client went away)."""
        if self.held <= 0:
            raise RuntimeError("release() without a held refusal")
        self.held -= 1
