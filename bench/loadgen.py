"""kvmesh's own load generator: bounded, async, streaming, over the OpenAI completions API.

Sends ``bench.workloads.WorkItem``s as ``POST /v1/completions`` with ``prompt`` = token ids,
``stream: true`` and ``stream_options.include_usage`` and measures per request: time to first
token (first streamed text chunk), time per output token after it, end-to-end latency, the
``usage`` (prompt, completion, cached tokens) and the ``kvmesh`` object (worker, route) of the
final chunk. Two modes:
  * open loop (``run(..., mode="open")``): each item is sent at its ``at_s`` (Poisson arrivals
    from the workload, optionally rescaled to ``rate_per_s``), whatever is in flight;
  * closed loop (``mode="closed"``): ``concurrency`` clients, each sends its next item when its
    previous one finished.
Bounded: at most ``max_requests`` items, no new sends after ``duration_s``, each request at most
``timeout_s``, open loop at most ``max_inflight`` in flight (later arrivals wait and count as
``late``). Never raises for a failed request: it is a ``Result`` with ``error``.

``summarize`` turns results into the figures a report needs (TTFT p50/p90/p99, TPOT, request
and token throughput, goodput at a TTFT SLO, hit tokens).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

import httpx

from bench.workloads import WorkItem, poisson_arrivals


@dataclass(frozen=True)
class Result:
    index: int  # position of the item in the workload
    tenant: str
    sent_s: float  # offset from the run's start
    ttft_s: float | None
    latency_s: float | None
    tpot_s: float | None  # (last token - first token) / (completion tokens - 1)
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    worker: str | None
    route: str | None
    status: int
    error: str | None = None
    late_s: float = 0.0  # open loop: how long after its arrival the request could be sent
    served: dict | None = None  # the response's ``kvmesh`` object (kvmesh only): where and why it ran

    @property
    def ok(self) -> bool:
        return self.error is None and self.status == 200


def _body(item: WorkItem, model: str, extra: dict | None) -> dict:
    body = {"model": model, "prompt": list(item.prompt_ids), "max_tokens": item.max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    body.update(extra or {})
    return body


async def send_one(client: httpx.AsyncClient, index: int, item: WorkItem, key: str, model: str, t0: float,
                   timeout_s: float = 120.0, extra: dict | None = None, late_s: float = 0.0) -> Result:
    """One streamed completion; every failure becomes a ``Result`` with ``error``."""
    sent = time.perf_counter()
    first = last = None
    usage, served, status, err, chunks = {}, {}, 0, None, 0

    async def go() -> None:
        nonlocal first, last, usage, served, status, err, chunks
        async with client.stream("POST", "/v1/completions", json=_body(item, model, extra),
                                 headers={"Authorization": f"Bearer {key}"}) as r:
            status = r.status_code
            if status != 200:
                err = (await r.aread()).decode(errors="replace")[:300]
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                if "error" in ev:
                    err = json.dumps(ev["error"])[:300]
                    return
                now = time.perf_counter()
                if any(c.get("text") for c in ev.get("choices", ())):
                    first = first or now
                    last = now
                    chunks += 1
                usage = ev.get("usage") or usage
                served = ev.get("kvmesh") or served

    try:
        await asyncio.wait_for(go(), timeout_s)
    except Exception as e:  # noqa: BLE001 - timeouts, connection errors: reported per request
        err = f"{type(e).__name__}: {e}"[:300]
    end = time.perf_counter()
    n_out = int(usage.get("completion_tokens", chunks) or 0)
    tpot = (last - first) / (n_out - 1) if first is not None and last is not None and n_out > 1 else None
    return Result(index, item.tenant, sent - t0, None if first is None else first - sent,
                  end - sent if err is None else None, tpot, int(usage.get("prompt_tokens", len(item.prompt_ids))),
                  n_out, int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)),
                  served.get("worker"), served.get("route"), status, err, late_s, served or None)


async def run(base_url: str, items: Sequence[WorkItem], keys: dict[str, str] | Callable[[str], str], model: str,
              mode: str = "closed", concurrency: int = 2, rate_per_s: float | None = None,
              max_requests: int | None = None, duration_s: float | None = None, timeout_s: float = 120.0,
              max_inflight: int = 256, extra: dict | None = None,
              progress: Callable[[Result], None] | None = None, transport=None) -> list[Result]:
    """Drive ``items`` against ``base_url``; results in completion order. ``keys``: tenant ->
    API key. ``rate_per_s`` (open loop) rescales the items' arrival offsets to that mean rate
    (items all at 0 get Poisson arrivals of that rate). ``transport``: an httpx transport (tests)."""
    if mode not in ("open", "closed"):
        raise ValueError("mode must be 'open' or 'closed'")
    items = list(items)[:max_requests] if max_requests is not None else list(items)
    key_of = keys if callable(keys) else keys.__getitem__
    results: list[Result] = []
    limits = httpx.Limits(max_connections=max(concurrency, max_inflight) + 4, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(timeout_s), limits=limits,
                                 transport=transport) as client:
        t0 = time.perf_counter()

        def expired() -> bool:
            return duration_s is not None and time.perf_counter() - t0 >= duration_s

        async def one(i: int, late: float = 0.0) -> None:
            r = await send_one(client, i, items[i], key_of(items[i].tenant), model, t0, timeout_s, extra, late)
            results.append(r)
            if progress:
                progress(r)

        if mode == "closed":
            queue = iter(range(len(items)))

            async def worker() -> None:
                for i in queue:  # shared iterator: each item goes to exactly one client
                    if expired():
                        return
                    await one(i)

            await asyncio.gather(*(worker() for _ in range(max(1, concurrency))))
        else:
            due_s = [w.at_s for w in items]
            if rate_per_s is not None and items:
                span = max(due_s)
                if span > 0:
                    due_s = [t * (len(items) / rate_per_s) / span for t in due_s]
                else:  # a burst workload: Poisson arrivals of that rate (fixed seed)
                    due_s = poisson_arrivals(len(items), rate_per_s, random.Random(0))
            sem = asyncio.Semaphore(max_inflight)
            tasks = []

            async def gated(i: int, due: float) -> None:
                async with sem:
                    await one(i, max(0.0, time.perf_counter() - t0 - due))

            for i, due in enumerate(due_s):
                delay = due - (time.perf_counter() - t0)
                if delay > 0:
                    await asyncio.sleep(delay)
                if expired():
                    break
                tasks.append(asyncio.create_task(gated(i, due)))
            await asyncio.gather(*tasks)
        return results


def percentile(xs: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in [0, 100]); None for no data."""
    xs = sorted(xs)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(results: Sequence[Result], ttft_slo_s: float = 1.0, wall_s: float | None = None) -> dict:
    """Figures over ``results``: TTFT and TPOT percentiles, throughput, goodput (requests per
    second that finished with TTFT <= ``ttft_slo_s``), hit tokens, errors, per-worker counts."""
    ok = [r for r in results if r.ok]
    if wall_s is None:
        wall_s = max((r.sent_s + (r.latency_s or 0.0) for r in ok), default=0.0) - min(
            (r.sent_s for r in ok), default=0.0)
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpot = [r.tpot_s for r in ok if r.tpot_s is not None]
    workers: dict[str, int] = {}
    for r in ok:
        workers[r.worker or "?"] = workers.get(r.worker or "?", 0) + 1
    per_s = (lambda n: n / wall_s) if wall_s > 0 else (lambda n: None)
    return {"requests": len(results), "ok": len(ok), "errors": len(results) - len(ok), "wall_s": wall_s,
            "ttft_s": {f"p{q}": percentile(ttft, q) for q in (50, 90, 99)},
            "tpot_s": {f"p{q}": percentile(tpot, q) for q in (50, 90, 99)},
            "request_throughput": per_s(len(ok)),
            "output_token_throughput": per_s(sum(r.completion_tokens for r in ok)),
            "goodput": per_s(sum(1 for r in ok if r.ttft_s is not None and r.ttft_s <= ttft_slo_s)),
            "ttft_slo_s": ttft_slo_s,
            "prompt_tokens": sum(r.prompt_tokens for r in ok), "cached_tokens": sum(r.cached_tokens for r in ok),
            "per_worker": workers, "late_s_max": max((r.late_s for r in results), default=0.0)}


def as_dicts(results: Sequence[Result]) -> list[dict]:
    return [asdict(r) for r in results]
