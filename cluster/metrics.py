"""Prometheus metrics of the serving front, per tenant (one registry per ingress instance)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401 - re-exported for the ingress

from cluster.protocol import STAGES

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_STAGE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class Metrics:
    def __init__(self, tenants: list[str]):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("kvmesh_requests", "HTTP requests by tenant, endpoint and status code",
                                ["tenant", "endpoint", "code"], registry=r)
        self.prompt_tokens = Counter("kvmesh_prompt_tokens", "Prompt tokens served", ["tenant"], registry=r)
        self.cached_tokens = Counter("kvmesh_cached_tokens", "Prompt tokens whose KV was reused", ["tenant"], registry=r)
        self.completion_tokens = Counter("kvmesh_completion_tokens", "Generated tokens", ["tenant"], registry=r)
        self.ttft = Histogram("kvmesh_ttft_seconds", "Time to first token at the ingress", ["tenant"],
                              buckets=_TTFT_BUCKETS, registry=r)
        self.stages = Histogram("kvmesh_request_stage_seconds",
                                "Where time to first token went, per request: ttft (the whole, at the ingress), "
                                "ingress (parsing, tokenizing), lease "
                                "(admission and routing, a controller round trip), route (of that, the router's "
                                "choice), engine_queue (waiting in the worker's engine: a slot, a pull landing), "
                                "prefill (forward passes), overhead (the rest: the worker call and the output's way back)",
                                ["tenant", "stage"], buckets=_STAGE_BUCKETS, registry=r)
        self.queue_depth = Gauge("kvmesh_queue_depth", "Admitted requests without a first token yet",
                                 ["tenant"], registry=r)
        self.inflight = Gauge("kvmesh_inflight_requests", "Admitted requests not finished", ["tenant"], registry=r)
        self.rejected = Counter("kvmesh_rejected", "Requests refused by limits", ["tenant", "reason"], registry=r)
        self.workers = Gauge("kvmesh_workers", "Worker actors by state", ["state"], registry=r)
        self.workers_assigned = Gauge("kvmesh_workers_assigned", "Workers assigned to a tenant by the autoscaler",
                                      ["tenant"], registry=r)
        self.routes = Counter("kvmesh_routes", "Finished requests by how their prompt KV was obtained",
                              ["tenant", "route"], registry=r)
        self.pulled_tokens = Counter("kvmesh_pulled_tokens", "Prompt tokens whose KV was pulled from another worker",
                                     ["tenant"], registry=r)
        self.router_decisions = Gauge("kvmesh_router_decisions", "Router decisions by kind (router actor)",
                                      ["kind"], registry=r)
        self.router_bytes = Gauge("kvmesh_router_bytes_pulled", "KV bytes pulled between workers", registry=r)
        self.router_failures = Gauge("kvmesh_router_pull_failures", "Failed pulls (recomputed)", registry=r)
        self.router_error = Gauge("kvmesh_router_ttft_error_seconds",
                                  "Mean |predicted - measured| TTFT by route kind", ["kind"], registry=r)
        self.router_bias = Gauge("kvmesh_router_ttft_bias_seconds",
                                 "Mean predicted - measured TTFT by route kind (< 0: the router underestimates)",
                                 ["kind"], registry=r)
        self.router_placements = Gauge("kvmesh_router_placements",
                                       "Routing choices by placement rule (match, spill, balance, relieve, idle, "
                                       "place; "
                                       "-fallback: without estimates)", ["kind"], registry=r)
        self.router_row_s = Gauge("kvmesh_router_decode_row_seconds",
                                  "Seconds one more sequence decoding beside a request adds to each of its "
                                  "output tokens, as the router measured it (placement's decode contention)",
                                  registry=r)
        self.router_routed = Gauge("kvmesh_router_routed", "Requests routed to each worker", ["worker"], registry=r)
        self.router_groups = Gauge("kvmesh_router_groups",
                                   "Prefix groups routed to each worker lately (a request within ~20 s)",
                                   ["worker"], registry=r)
        for t in tenants:  # every tenant has series from the first scrape
            for m in (self.prompt_tokens, self.cached_tokens, self.completion_tokens, self.queue_depth, self.inflight):
                m.labels(tenant=t)

    def observe_stages(self, tenant: str, timings: list[dict]) -> None:
        """One observation per measured stage of each prompt's ``protocol.stage_timings``."""
        for t in timings:
            for stage in STAGES:
                v = t.get(f"{stage}_s")
                if v is not None:
                    self.stages.labels(tenant=tenant, stage=stage).observe(v)

    def observe_finished(self, tenant: str, prompt: int, cached: int, completion: int,
                         route: str | None = None, pulled: int = 0) -> None:
        if route:
            self.routes.labels(tenant=tenant, route=route).inc()
        self.pulled_tokens.labels(tenant=tenant).inc(pulled)
        self.prompt_tokens.labels(tenant=tenant).inc(prompt)
        self.cached_tokens.labels(tenant=tenant).inc(cached)
        self.completion_tokens.labels(tenant=tenant).inc(completion)

    def render(self, queue_depth: dict[str, int], inflight: dict[str, int], workers: dict[str, int],
               assigned: dict[str, int], router: dict | None = None) -> bytes:
        """The exposition text, with gauges refreshed from the given snapshots. ``router``: the
        controller's routing counts (``decisions`` by kind, ``placements`` by rule, ``routed`` per
        worker, ``bytes_pulled``, ``pull_failures``, ``ttft_error`` by kind, ``decode_row_s``; any may
        be missing),
        None when it did not answer."""
        if router:
            for kind, n in router.get("decisions", {}).items():
                self.router_decisions.labels(kind=kind).set(n)
            self.router_bytes.set(router.get("bytes_pulled", 0))
            self.router_failures.set(router.get("pull_failures", 0))
            for kind, e in router.get("ttft_error", {}).items():
                self.router_error.labels(kind=kind).set(e["mean_abs_s"])
                if "mean_signed_s" in e:
                    self.router_bias.labels(kind=kind).set(e["mean_signed_s"])
            for kind, n in router.get("placements", {}).items():
                self.router_placements.labels(kind=kind).set(n)
            if "decode_row_s" in router:
                self.router_row_s.set(router["decode_row_s"])
            for worker, n in router.get("routed", {}).items():
                self.router_routed.labels(worker=worker).set(n)
            if "groups" in router:
                for labels in list(self.router_groups._metrics):  # workers gone or with no group lately
                    self.router_groups.labels(*labels).set(0)
                for worker, n in router["groups"].items():
                    self.router_groups.labels(worker=worker).set(n)
        for g, values in ((self.queue_depth, queue_depth), (self.inflight, inflight)):
            for labels in list(g._metrics):  # reset tenants that dropped to 0
                g.labels(*labels).set(0)
            for t, n in values.items():
                g.labels(tenant=t).set(n)
        for state, n in workers.items():
            self.workers.labels(state=state).set(n)
        for labels in list(self.workers_assigned._metrics):
            self.workers_assigned.labels(*labels).set(0)
        for t, n in assigned.items():
            self.workers_assigned.labels(tenant=t).set(n)
        return generate_latest(self.registry)
