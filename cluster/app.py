"""The Serve application: an OpenAI-compatible FastAPI ingress in front of a worker pool.

``serve run cluster/serve.yaml`` calls ``build_app(args)`` with the ``args`` of the YAML file
(see ``AppSettings`` for the fields). The ingress authenticates (API key → tenant), validates,
applies the chat template and tokenizes, then leases a worker from the app's controller actor
(``cluster.controller``: admission, routing, the worker pool) and streams tokens straight from that
worker. Workers are plain Ray actors owned by the controller's ``cluster.pool.WorkerPool`` (see
there for why); ingress replicas hold no pool state, so the deployment may run several replicas.
"""

# No `from __future__ import annotations`: FastAPI must see the real Request annotation
# through Serve's ingress wrapper.
import asyncio
import contextlib
import dataclasses
import logging
import math
import time
import uuid
from dataclasses import dataclass, fields
from pathlib import Path

from fastapi import FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve import Application
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from actors.head_affinity import ingress_actor_options
from cluster.metrics import CONTENT_TYPE_LATEST, Metrics
import ray

from cluster.controller import ConfigMismatch, ControllerClient, ControllerClosing, Rejected, TemplateQuotaExceeded
from cluster.input_limits import ENCODE_INLINE_CHARS, InputLimits, check_template, read_body
from cluster.pool import LEND_MODES, PoolConfig, WorkerUnavailable
from cluster.choices import Assembler, PromptInfo, TokenIds, TokenTexts, chunk_event, response
from cluster.protocol import (DONE, ApiError, ChatRequest, CompletionRequest, DetokenizeBody, Served, TemplateBody,
                              stage_timings,
                              TokenizeBody, error_event, openapi_body, parse_body)
from engine.approx import ApproxConfig
from engine.async_engine import EngineDead, EngineStepFailed
from engine.llm_engine import EngineConfig, check_sampling_limits
from engine.redact import describe_exc, redact
from engine.sequence import InvalidRequest, Request, SamplingParams
from policies.autoscale import AutoscaleConfig
from policies.reject_delay import RejectionDelay
from policies.tenancy import TenantConfig, Tenants, TenantsError, read_tenants_file, tenants_path

log = logging.getLogger(__name__)
EXAMPLE_TENANTS = Path(__file__).with_name("tenants.yaml")


@dataclass(frozen=True)
class AppSettings:
    """The ``args`` of ``cluster/serve.yaml`` (all optional)."""

    model: str = "default"  # "default", "tiny-llama", a safetensors directory or a .gguf file
    workers: int = 1  # workers at start and the autoscaler's minimum
    max_workers: int | None = None  # autoscaler's maximum; None = workers (no autoscaling)
    block_size: int = 16
    tenants: str | None = None  # tenants file; None: $KVMESH_TENANTS, else cluster/tenants.yaml
    kv_cache_bytes: int = 512 * 1024 * 1024  # per worker
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    worker_num_cpus: float = 1.0
    worker_num_gpus: float | None = None  # None: 1 per worker when the cluster has GPUs
    device: str | None = None  # None: cuda when workers get GPUs, else cpu
    dtype: str | None = None  # None: float32 on cpu, bfloat16 on cuda
    target_tokens_per_worker: int = 4096  # autoscaling: demand (tokens) one worker should carry
    upscale_delay_s: float = 0.0
    downscale_delay_s: float = 30.0
    autoscale_interval_s: float = 1.0
    default_chat_max_tokens: int = 512  # chat requests without max_tokens: min(this, room left)
    ready_timeout_s: float = 600.0
    client_ttl_s: float = 30.0  # an ingress replica silent this long is presumed dead (its leases reclaimed)
    max_body_bytes: int | None = None  # request bodies larger get a 413; None: 2 MiB + 64 bytes per context token
    # "none": /metrics answers anyone who reaches the port; "admin": it needs an admin key
    # (tenants file ``admin_keys``) as a Bearer token
    metrics_auth: str = "none"
    # a tenant retrying inside its last Retry-After gets its next 429 this much later (an asyncio
    # sleep, at most reject_delay_max_held at once per replica; 0: off): policies/reject_delay.py
    reject_delay_s: float = 1.0
    reject_delay_max_held: int = 256
    # a batched completion's prompts each take a lease (the tenant's limits count prompts); those
    # its limits refuse wait while others of the request run and start as their leases end. The
    # request fails with the 429 when nothing of it runs: every prompt refused at once, or a prompt
    # refused this long with none of the request's prompts in flight (``_BatchAdmission``)
    batch_wait_s: float = 30.0
    # niceness added to each worker's engine thread (EngineConfig.thread_nice); e.g. -5 gives the
    # engine CPU precedence over the Serve proxy and ingress on shared cores (needs root)
    engine_thread_nice: int = 0
    # lower-priority prefill tokens per step (all together) while a higher class contends or is
    # guarded (EngineConfig.low_priority_prefill_tokens): bounds the step a higher request waits out
    low_priority_prefill_tokens: int = 32
    # with a guarded (latency_guard) tenant: its prefill steps carry no lower-class work, decodes
    # included (EngineConfig.guarded_steps_alone), and a lower-class step in progress is abandoned
    # between layers when its request arrives (EngineConfig.interrupt_for_guarded)
    guarded_steps_alone: bool = True
    interrupt_for_guarded: bool = True
    # a request whose prompt continues blocks that a running prefill on its worker is computing
    # waits for them instead of computing them again (EngineConfig.join_inflight_prefill)
    join_inflight_prefill: bool = True
    # within a priority class a worker admits the waiting tenant with the fewest tokens computed
    # for it first, and no tenant takes the last fair_reserve_seqs (<= max_num_seqs // 4) sequence
    # slots (EngineConfig.fair_share, policies/fair_share.py); false: arrival order, no reserve
    fair_share: bool = True
    fair_reserve_seqs: int = 4
    # with fair_share, a full KV pool is shared by tenant too (EngineConfig.fair_preempt): growth
    # preempts the tenant running the most sequences first, and a tenant short of its share of a
    # full pool preempts another's latest sequence; false: the most recently admitted goes
    fair_preempt: bool = True
    # structured output: a response_format JSON schema longer than this is a 400 (compiling grows
    # faster than the schema); compiled grammars a worker keeps, in bytes (engine/grammar.py)
    max_schema_chars: int = 128 * 1024
    grammar_cache_bytes: int = 256 << 20
    # CPU-seconds one schema may take to compile (a child process per worker; past it a 400)
    grammar_compile_cpu_s: float = 10.0
    # a pulled request is queued while its KV arrives (admitted once it has landed; the router
    # prices a pull as max(wait, transfer)), the pulled KV and the local prefix it extends are held
    # for it until admitted, at most this long, and a pull with no room waits for room while
    # requests run (EngineConfig.import_hold_s). 0: off, all three (before session 21)
    import_hold_s: float = 60.0
    # the router learns, per worker, the wait each decoding sequence adds to a new request's TTFT
    # (policies.routing.DecodeModel), so a busy holder's dominant group spills; false: it charges
    # nothing for decoding sequences (cluster/README, Placement, sessions 8 and 13)
    router_learn_decode: bool = True
    # the router prices each worker's KV memory from the requests in flight there: a request that
    # would wait for room in a full pool is priced with that wait (policies.routing.kv_admission_s,
    # cluster/README, session 22); false: the queue's compute only (before session 22)
    router_kv_memory: bool = True
    # the router ranks and weighs per request at most this many workers: the prompt's holders,
    # then the least busy (policies.placement.shortlist; bench/router_scale.py); 0: every worker
    router_max_candidates: int = 16
    # a hot prefix group (more than its holders' share of the traffic) spills from a busy holder to
    # an idle worker with room for it, at a transfer or one prefill for that request
    # (PlacementConfig.idle_slack, cluster/README, Placement, session 16); false: only when faster
    router_idle_spill: bool = True
    # a holder's dominant group spills (a copy on a faster worker) only while its share of the
    # cluster's recent traffic is surely worth its holders (PlacementConfig.spill_share_margin,
    # cluster/README, Placement, session 17); false: any dominant group spills
    router_spill_needs_share: bool = True
    # a holder whose queue wait (averaged over 30 s) exceeds this x the least-waiting worker's + 2 s
    # lets any of its groups go, to the worker that starts the request sooner counting a pull or a
    # prefill (PlacementConfig.balance_ratio, "balance" decisions); 0: off (cluster/README, sessions 12, 18)
    router_balance_ratio: float = 0.0
    # a new prefix group's options within this x its own prefill of the cheapest count as ties, which
    # go to the worker holding the fewest prefixes (PlacementConfig.place_tie, default 0.25); 1 spreads
    # groups evenly where prefills are slow (cluster/README, Placement, session 19)
    router_place_tie: float | None = None
    # a new prefix group (or a spill's copy) stays off workers whose shared prefixes would then fill
    # more than this share of their KV pool while a worker with room is within a few prefills
    # (PlacementConfig.prefix_fill, default 0.9); 1: off (cluster/README, session 24)
    router_prefix_fill: float | None = None
    # any field of policies.placement.PlacementConfig by name, e.g. {idle_busy_running: 3}, applied
    # after the router_* arguments above: for measuring a placement rule's variants (bench/cluster.py
    # --kvmesh-args); the defaults are the measured ones
    router_placement: dict | None = None
    # a prefix block reused within this many seconds is evicted after requests' unshared tails
    # (EngineConfig.cache_protect_s, policies/eviction.py); 0: plain LRU for them
    cache_protect_s: float = 60.0
    # a new chain's blocks (a new group's first prompt) released within this many seconds are
    # evicted after tails too, while new chains have been reused more than tails
    # (EngineConfig.cache_seed_s, policies/eviction.py); 0: plain LRU for them
    cache_seed_s: float = 120.0
    # when another tenant's request may use a worker assigned to a tenant (WorkerPool.lendable):
    # "unqueued" (no request waits there for its first token), "idle" (nothing in flight: before
    # session 22), "never" (an assignment fences the others out)
    lend_workers: str = "unqueued"
    # a worker not lent now still takes another tenant's request that finds all of its prompt there
    # but at most this many tokens (its own prefix, computed there before the assignment) instead
    # of that prefix being recomputed elsewhere (PoolConfig.lend_hit_tokens; 0: off)
    lend_hit_tokens: int = 64
    # a request on a lent worker runs below the owner's priority classes (Request.guest): the owner's
    # requests arriving meanwhile cap its prefill chunks (engine/scheduler.py); false (default, it
    # measured slower for owners and guests alike, cluster/README session 23): its tenant's class
    guests_yield: bool = False
    # each new worker times a short and a long synthetic prefill before it serves, and the router's
    # prefill fit starts from them (LLMEngine.calibrate); false: from a prior made on another machine
    calibrate_prefill: bool = True

    def __post_init__(self):
        for f in fields(self):  # a YAML "false" in quotes would read as true
            if f.type in ("bool", bool) and not isinstance(getattr(self, f.name), bool):
                raise ValueError(f"{f.name} must be true or false, got {getattr(self, f.name)!r}")
        if self.metrics_auth not in ("none", "admin"):
            raise ValueError(f"metrics_auth must be 'none' or 'admin', got {self.metrics_auth!r}")
        if self.reject_delay_s < 0 or self.reject_delay_max_held < 0:
            raise ValueError("reject_delay_s and reject_delay_max_held must be >= 0")
        if self.low_priority_prefill_tokens < 1:
            raise ValueError("low_priority_prefill_tokens must be >= 1")
        if self.cache_protect_s < 0 or self.cache_seed_s < 0:
            raise ValueError("cache_protect_s and cache_seed_s must be >= 0 (0: plain LRU)")
        for name in ("max_schema_chars", "grammar_cache_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        v = self.grammar_compile_cpu_s
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < float("inf"):
            raise ValueError(f"grammar_compile_cpu_s must be a number >= 0 (0: compile in the worker, unbounded), got {v!r}")
        if self.import_hold_s < 0:
            raise ValueError("import_hold_s must be >= 0 (0: pulled KV is not held)")
        if self.router_prefix_fill is not None and not 0 < self.router_prefix_fill <= 1:
            raise ValueError("router_prefix_fill must be in (0, 1] (1: off)")
        if self.router_placement is not None:
            from policies.placement import PlacementConfig

            if not isinstance(self.router_placement, dict):
                raise ValueError(f"router_placement must map PlacementConfig fields to values, got {self.router_placement!r}")
            unknown = set(self.router_placement) - {f.name for f in fields(PlacementConfig)}
            if unknown:
                raise ValueError(f"router_placement: unknown PlacementConfig fields {sorted(unknown)}")
        if self.lend_workers not in LEND_MODES:
            raise ValueError(f"lend_workers must be one of {LEND_MODES}, got {self.lend_workers!r}")
        for name, zero in (("lend_hit_tokens", "off"), ("router_max_candidates", "every worker"),
                           ("fair_reserve_seqs", "no reserve")):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{name} must be an integer >= 0 (0: {zero}), got {v!r}")

    @classmethod
    def from_args(cls, args):
        args = dict(args or {})
        unknown = set(args) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown kvmesh app arguments {sorted(unknown)}; known: {[f.name for f in fields(cls)]}")
        return cls(**args)

    def autoscale(self) -> AutoscaleConfig:
        return AutoscaleConfig(min_workers=self.workers, max_workers=max(self.workers, self.max_workers or self.workers),
                               target_tokens_per_worker=self.target_tokens_per_worker,
                               upscale_delay_s=self.upscale_delay_s, downscale_delay_s=self.downscale_delay_s,
                               interval_s=self.autoscale_interval_s)


def load_tokenizer(spec: str):
    """(served model name, tokenizer) without loading the weights."""
    from engine.model_loader import TINY_MODEL, resolve_model_dir
    from engine.tokenizer import ByteTokenizer

    if spec == TINY_MODEL:
        return TINY_MODEL, ByteTokenizer(vocab_size=512)
    from transformers import AutoTokenizer

    name, path = resolve_model_dir(spec)
    return name, AutoTokenizer.from_pretrained(path)


def pool_config(s: AppSettings, tenants: Tenants, app: str = "") -> PoolConfig:
    """The controller's pool configuration, unresolved: a ``worker_num_gpus``/``device``/``dtype``
    left unset stays unset (the controller resolves it once against the cluster), so every
    replica of an app computes the same config whatever the cluster looks like when it starts."""
    device = s.device or "cpu"  # placeholder when auto_device: the controller picks
    engine = EngineConfig(model=s.model, block_size=s.block_size, kv_cache_bytes=s.kv_cache_bytes,
                          max_num_seqs=s.max_num_seqs, max_num_batched_tokens=s.max_num_batched_tokens,
                          device=device, dtype=s.dtype or ("float32" if device == "cpu" else "bfloat16"),
                          tenant_quotas=tenants.eviction_quotas(), thread_nice=s.engine_thread_nice,
                          low_priority_prefill_tokens=s.low_priority_prefill_tokens,
                          guarded_steps_alone=s.guarded_steps_alone, interrupt_for_guarded=s.interrupt_for_guarded,
                          join_inflight_prefill=s.join_inflight_prefill, fair_share=s.fair_share,
                          fair_reserve_seqs=s.fair_reserve_seqs, fair_preempt=s.fair_preempt,
                          max_schema_chars=s.max_schema_chars, grammar_cache_bytes=s.grammar_cache_bytes,
                          grammar_compile_cpu_s=s.grammar_compile_cpu_s,
                          import_hold_s=s.import_hold_s,
                          cache_protect_s=s.cache_protect_s, cache_seed_s=s.cache_seed_s, approx=ApproxConfig(tenant_gates=tenants.quality_gates()))
    return PoolConfig(engine=engine, autoscale=s.autoscale(), shares=tuple(sorted(tenants.worker_shares().items())),
                      worker_num_cpus=s.worker_num_cpus, worker_num_gpus=s.worker_num_gpus,
                      auto_device=s.device is None, auto_dtype=s.dtype is None, ready_timeout_s=s.ready_timeout_s,
                      app=app, router_learn_decode=s.router_learn_decode, router_kv_memory=s.router_kv_memory,
                      router_max_candidates=s.router_max_candidates, router_idle_spill=s.router_idle_spill,
                      lend_workers=s.lend_workers, lend_hit_tokens=s.lend_hit_tokens,
                      guests_yield=s.guests_yield, calibrate_prefill=s.calibrate_prefill,
                      router_spill_needs_share=s.router_spill_needs_share, router_balance_ratio=s.router_balance_ratio,
                      router_place_tie=s.router_place_tie, router_prefix_fill=s.router_prefix_fill,
                      router_placement=tuple(sorted((k, tuple(v) if isinstance(v, list) else v)  # YAML lists
                                                    for k, v in (s.router_placement or {}).items())))


def build_app(args: dict) -> Application:
    """Serve application builder: ``import_path: cluster.app:build_app`` with ``args``."""
    settings = AppSettings.from_args(args)
    path = Path(settings.tenants) if settings.tenants else tenants_path(EXAMPLE_TENANTS)
    tenants_data = read_tenants_file(path)
    return KvmeshIngress.options(ray_actor_options=ingress_actor_options()).bind(dataclasses.asdict(settings),
                                                                                 tenants_data)


app = FastAPI(title="kvmesh", docs_url=None, redoc_url=None)


@app.exception_handler(ApiError)
async def _api_error(_, e: ApiError):
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


@app.exception_handler(RequestValidationError)
async def _validation_error(_, e: RequestValidationError):
    return JSONResponse(ApiError(400, str(e)).body(), status_code=400)


@app.exception_handler(StarletteHTTPException)
async def _http_error(_, e: StarletteHTTPException):
    code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
    return JSONResponse(ApiError(e.status_code, str(e.detail), code=code).body(), status_code=e.status_code)


@app.exception_handler(Exception)
async def _any_error(_, e: Exception):
    """Last resort: whatever a route did not map still gets an OpenAI error body (logged)."""
    err = _as_api_error(e)
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def _bearer(req: HttpRequest) -> str | None:
    h = req.headers.get("authorization", "")
    scheme, _, key = h.partition(" ")
    return key.strip() if scheme.lower() == "bearer" and key.strip() else None


class _Ctx:
    """One admitted HTTP request being answered: one engine request (stream) per prompt, merged
    into one response; closes every stream (ending its lease) exactly once."""

    def __init__(self, ing: "KvmeshIngress", tenant: str, endpoint: str, rid: str, requests: list[Request],
                 chat: bool, leases: list, streams: list, firsts: list, asm: Assembler, include_usage: bool,
                 continuous_usage: bool = False, timings: list[dict] | None = None):
        self.ing, self.tenant, self.endpoint, self.rid, self.requests = ing, tenant, endpoint, rid, requests
        self.chat, self.leases, self.streams, self.firsts, self.asm = chat, leases, streams, firsts, asm
        self.timings = timings or [None] * len(requests)
        self.include_usage, self.continuous_usage = include_usage, continuous_usage
        self.model = ing.model_name
        self.created = int(time.time())
        self.lasts: list = [None] * len(requests)

    def _served(self, p: int, out) -> Served:
        worker, choice = self.leases[p]
        approx = getattr(out, "num_approx_tokens", 0)
        return Served(worker=worker, route=out.route or choice.route,
                      exact_cached_tokens=out.num_cached_tokens - approx, approx_cached_tokens=approx,
                      pulled_tokens=out.pulled_tokens, reuse=self.requests[p].reuse, placement=choice.placement,
                      index_holders=choice.index_holders, routed_holders=choice.routed_holders,
                      planned_route=choice.route, expected_ttft_s=choice.expected_ttft_s, options=choice.options,
                      pull_outcome=getattr(out, "pull_outcome", None), timings=self.timings[p])

    def _kvmesh(self) -> dict:
        """The response's ``kvmesh`` object: the serving of its one prompt, or ``{"prompts": [...]}``."""
        served = [self._served(p, out).as_dict() for p, out in enumerate(self.lasts) if out is not None]
        return served[0] if len(self.requests) == 1 and served else {"prompts": served}

    def _done(self, code: int) -> None:
        m = self.ing.metrics
        m.requests.labels(tenant=self.tenant, endpoint=self.endpoint, code=str(code)).inc()
        if code == 200:
            for out in self.lasts:
                if out is not None:
                    m.observe_finished(self.tenant, out.num_prompt_tokens, out.num_cached_tokens,
                                       out.num_output_tokens, out.route, out.pulled_tokens)

    async def _outputs(self, p: int):
        yield self.firsts[p]
        if not self.firsts[p].finished:
            async for _, _, out in self.streams[p]:  # closed by _close, whoever stops first
                yield out

    async def _merged(self):
        """(prompt index, output) of every stream, as they come (one stream: no task needed)."""
        if len(self.streams) == 1:
            async with contextlib.aclosing(self._outputs(0)) as outs:
                async for out in outs:
                    yield 0, out
            return
        q: asyncio.Queue = asyncio.Queue()
        end = object()

        async def pump(p: int):
            try:
                async with contextlib.aclosing(self._outputs(p)) as outs:
                    async for out in outs:
                        await q.put((p, out, None))
            except Exception as e:  # noqa: BLE001 - handed to the consumer
                await q.put((p, None, e))
            await q.put((p, None, end))

        tasks = [asyncio.get_running_loop().create_task(pump(p)) for p in range(len(self.streams))]
        try:
            left = len(tasks)
            while left:
                p, out, e = await q.get()
                if e is end:
                    left -= 1
                elif e is not None:
                    raise e
                else:
                    yield p, out
        finally:
            await _cancel(tasks)

    async def _close(self) -> None:
        for s in self.streams:
            await s.aclose()

    async def whole(self):
        code = 200

        async def drain(p: int):
            async with contextlib.aclosing(self._outputs(p)) as outs:
                async for out in outs:
                    self.lasts[p] = out
                    self.asm.add(p, out)

        try:
            await _all([drain(p) for p in range(len(self.streams))])
        except Exception as e:  # noqa: BLE001
            err = _as_api_error(e)
            code = err.status
            raise err from None
        except BaseException:  # client disconnected (cancelled): not a success
            code = 499
            raise
        finally:
            await self._close()
            self._done(code)
        return response(self.rid, self.model, self.chat, self.asm.final_choices(), self.asm.usage(), self._kvmesh())

    async def sse(self):
        rid, code, asm, merged = self.rid, 200, self.asm, None

        def event(choices, use=None, kvmesh=None):
            if use is None and self.continuous_usage:
                use = asm.usage()  # so far
            return chunk_event(rid, self.model, self.created, self.chat, choices, use, kvmesh)

        try:
            if self.chat:
                for d in asm.role_deltas():
                    yield event([d])
            merged = self._merged()
            async for p, out in merged:
                self.lasts[p] = out
                for d in asm.add(p, out):
                    if d["finish_reason"] is None:
                        yield event([d])
                        continue
                    last = all(asm.finished) and all(c.finish_reason for c in asm.choices.values())
                    use = asm.usage() if last and not self.include_usage else None
                    yield event([d], use, self._served(p, out).as_dict())
            if self.include_usage:
                yield event([], asm.usage(), self._kvmesh())
            yield DONE
        except ray.exceptions.TaskCancelledError:  # Serve cancelled the request: its client went away
            code = 499
        except Exception as e:  # noqa: BLE001 - the status line is sent: report in-band
            err = _as_api_error(e)
            code = err.status
            yield error_event(err)
            yield DONE
        except BaseException:  # client disconnected (cancelled): the finally below frees the requests
            code = 499
            raise
        finally:
            if merged is not None:
                await merged.aclose()  # stops its pump tasks before their streams are closed
            await self._close()
            self._done(code)


async def _first(stream):
    """A stream's first item and when it came (``perf_counter``)."""
    item = await stream.__anext__()
    return item, time.perf_counter()


_END = object()
BATCH_RETRY_MIN_S = 0.05  # a refused prompt of a batch asks again no sooner than this


class _Prefetched:
    """A stream read ahead by its own task into a queue (a batched request's prompts): its worker
    finishes and its lease ends whenever the response reads it, so the batch's later prompts,
    waiting for those leases (``_BatchAdmission``), cannot wait on a reader waiting for them.
    ``on_end`` runs exactly once, when the stream has ended, failed or been closed."""

    def __init__(self, stream, on_end):
        self._q: asyncio.Queue = asyncio.Queue()
        self._on_end, self._ended = on_end, False
        self._task = asyncio.get_running_loop().create_task(self._pump(stream))

    def _end(self) -> None:
        if not self._ended:
            self._ended = True
            self._on_end()

    async def _pump(self, stream) -> None:
        try:
            async with contextlib.aclosing(stream) as items:
                async for item in items:
                    self._q.put_nowait((item, None))
            self._q.put_nowait((None, _END))
        except Exception as e:  # noqa: BLE001 - the reader raises it
            self._q.put_nowait((None, e))
        finally:
            self._end()

    def __aiter__(self):
        return self

    async def __anext__(self):
        item, e = await self._q.get()
        if e is _END:
            self._q.put_nowait((None, _END))
            raise StopAsyncIteration
        if e is not None:
            raise e
        return item

    async def aclose(self) -> None:
        await _cancel([self._task])
        self._end()  # (a task cancelled before it ran never reached its finally)


class _BatchAdmission:
    """The prompts of one batched request, each admitted on its own lease: the tenant's
    concurrency and rate limits count prompts, so a batch larger than ``max_concurrent`` (or than
    its rate bucket) could never be admitted at once, and a 429 for it would be one that no retry
    fixes. At most ``window`` prompts are in flight at once (the tenant's limits); a prompt the
    limits refuse (other requests of the tenant hold its leases) asks again when one of the
    request's prompts ends, or after the refusal's Retry-After. The request fails with that 429
    only when nothing of it runs: every prompt in flight refused and none ever admitted, or a
    prompt refused for ``wait_s`` with none of the request's prompts in flight."""

    def __init__(self, pool, requests: list[Request], window: int, wait_s: float):
        self.pool, self.requests, self.wait_s = pool, requests, wait_s
        self.streams: list = [None] * len(requests)
        self.slots = asyncio.Semaphore(max(1, window))
        self.active = 0  # attempts in flight: waiting for admission, or admitted and not ended
        self.admitted = False  # a prompt has had its first output
        self.changed = asyncio.Event()  # set, and replaced, when an attempt ends

    def _ended(self) -> None:
        self.active -= 1
        self.slots.release()
        self.changed.set()
        self.changed = asyncio.Event()

    async def first(self, p: int):
        """Prompt ``p``'s first output and when it came, as ``_first``."""
        idle_since = None
        while True:
            await self.slots.acquire()
            self.active += 1
            s = self.streams[p] = _Prefetched(self.pool.generate(self.requests[p]), self._ended)
            try:
                got = await _first(s)
            except Rejected as e:
                await s.aclose()
                now, wait = time.monotonic(), max(BATCH_RETRY_MIN_S, e.retry_after_s)
                idle_since = None if self.active else (idle_since or now)
                if idle_since is not None and (not self.admitted or now + wait - idle_since > self.wait_s):
                    raise
                changed = self.changed
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(changed.wait(), wait)
                continue
            self.admitted = True
            return got


class ClosingStreamingResponse(StreamingResponse):
    """A ``StreamingResponse`` that always closes its body iterator when the response ends.

    Starlette leaves the iterator suspended when the client disconnects while a chunk is being
    sent (the cancellation lands in ``send``, not in the generator); it is then closed only by the
    garbage collector, which may be minutes later in a big process, and until then the request's
    lease and its worker stream stay open. Closing here ends them at once. The close runs in its
    own task and is awaited shielded, so a second cancellation cannot cut it short."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except ray.exceptions.TaskCancelledError:  # the client went away (Serve's receive() raises it)
            log.debug("stream ended: the client disconnected")
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await asyncio.shield(asyncio.get_running_loop().create_task(_quiet_close(aclose)))


async def _quiet_close(aclose) -> None:
    try:
        await aclose()
    except RuntimeError:  # already running: its own finally is under way
        pass


# SamplingParams field -> the HTTP field that asks for it (for "not supported by this engine").
_ENGINE_PARAM = {"grammar": "response_format", "prompt_logprobs": "echo", "n": "n"}


def _grammar_spec():
    try:
        from engine.sequence import GrammarSpec
    except ImportError:
        from engine.grammar import GrammarSpec
    return GrammarSpec


async def _cancel(tasks) -> None:
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _all(coros) -> list:
    """Run ``coros`` concurrently; the first failure cancels the others (awaited) and is raised."""
    tasks = [asyncio.get_running_loop().create_task(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    finally:
        await _cancel([t for t in tasks if not t.done()])


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("kvmesh")
    except Exception:  # noqa: BLE001 - not installed (run from a checkout)
        return "0.1.0"


def _vocab_size(tok) -> int:
    try:
        return max(len(tok), int(getattr(tok, "vocab_size", 0)))
    except TypeError:  # no __len__ (the byte tokenizer)
        return int(tok.vocab_size)


def _last_line(e: BaseException) -> str:
    """The cause's own message of a (possibly Ray-wrapped) exception, bounded."""
    lines = [x for x in str(e).splitlines() if x.strip()]
    last = lines[-1].strip() if lines else type(e).__name__
    head, sep, rest = last.partition(": ")
    return (rest if sep and head.isidentifier() else last)[:300]


def _as_api_error(e: BaseException) -> ApiError:
    """The OpenAI error for ``e``: 4xx for the client's mistakes, 503 when the controller or a
    worker is unavailable, too slow or being replaced, else 500 ``internal_error`` (logged with
    its traceback)."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, InvalidRequest):
        msg = str(e).splitlines()[-1] if str(e) else "invalid request"
        # a Ray-wrapped one keeps the engine's exception (and its ``param``) as ``cause``
        return ApiError(400, msg.split("InvalidRequest: ")[-1], param=getattr(getattr(e, "cause", None) or e, "param", None))
    retry = {"Retry-After": "1"}  # a 503 here is transient: a worker or the controller is being replaced
    if isinstance(e, (EngineStepFailed, EngineDead)):
        return ApiError(503, f"the worker's engine failed; retry the request ({_last_line(e)[:200]})",
                        type_="server_error", code="engine_failed", headers=retry)
    if isinstance(e, TemplateQuotaExceeded):
        return ApiError(429, str(e), type_="requests", code="template_quota_exceeded", param="id")
    if isinstance(e, WorkerUnavailable):
        return ApiError(503, str(e), type_="server_error", code="worker_unavailable", headers=retry)
    if isinstance(e, (asyncio.TimeoutError, TimeoutError, ray.exceptions.GetTimeoutError)):
        return ApiError(503, "the kvmesh controller did not answer in time; retry later", type_="server_error",
                        code="controller_timeout", headers=retry)
    if isinstance(e, (ControllerClosing, ray.exceptions.RayActorError)):
        return ApiError(503, "the kvmesh controller is restarting; retry later", type_="server_error",
                        code="controller_unavailable", headers=retry)
    if isinstance(e, (ray.exceptions.TaskCancelledError, ClientDisconnect)):  # the client went away
        return ApiError(499, "the client closed the request", type_="server_error", code="client_closed_request")
    if isinstance(e, ConfigMismatch):
        log.error("kvmesh replica refused by its controller: %s", e)
        return ApiError(503, f"this replica cannot attach to the kvmesh controller: {e}", type_="server_error",
                        code="controller_unavailable")
    log.error("request failed: %s", describe_exc(e, traceback=True))
    return ApiError(500, f"internal error: {type(e).__name__}", type_="server_error", code="internal_error")


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000, num_replicas=1)
@serve.ingress(app)
class KvmeshIngress:
    async def __init__(self, settings: dict, tenants_data: dict):
        s = AppSettings(**settings)
        tenants = Tenants.from_dict(tenants_data)
        self.settings, self.tenants = s, tenants
        pool = await self._open_pool(tenants_data)
        if getattr(pool, "tenants_data", tenants_data) != tenants_data:  # the controller runs a newer tenants file: take it
            tenants = Tenants.from_dict(pool.tenants_data)
            pool.config = pool_config(s, tenants, pool.app)
        self._setup(s, tenants, pool, await pool.wait_ready(s.ready_timeout_s))

    def _setup(self, s: AppSettings, tenants: Tenants, pool, info: dict) -> None:
        """The replica's state, given what serves its requests (``pool``) and a ready worker's
        ``info`` (also used by in-process tests with a stand-in pool)."""
        self.settings, self.tenants, self.pool = s, tenants, pool
        self.model_name, self.tokenizer = load_tokenizer(s.model)
        self.token_texts = TokenTexts(self.tokenizer)
        self.metrics = Metrics(self.tenants.names())
        self.max_model_len = int(info["max_model_len"])
        self.vocab_size = int(info.get("vocab_size") or _vocab_size(self.tokenizer))
        self.limits = InputLimits.derive(self.max_model_len, self.tokenizer, s.max_body_bytes)
        self.reject_delay = RejectionDelay(s.reject_delay_s, s.reject_delay_max_held)

    async def _open_pool(self, tenants_data: dict):
        """What serves the requests behind this ingress: the app's controller, one per app and
        shared by all ingress replicas (the first one creates it). ``cluster.baselines``
        overrides this to put plain Serve engine replicas behind the same front end."""
        app_name = serve.get_replica_context().app_name
        pool = ControllerClient(app_name, pool_config(self.settings, self.tenants, app_name), tenants_data,
                                self.settings.client_ttl_s)
        pool.on_tenants = self._new_tenants
        self._opening = pool  # closed by __del__ should __init__ fail after this
        await pool.connect()
        return pool

    def _new_tenants(self, tenants_data: dict) -> None:
        """The controller runs a newer tenants file (another replica of a redeploy brought it):
        authenticate with its keys from now on."""
        try:
            tenants = Tenants.from_dict(tenants_data)
        except TenantsError:
            log.exception("the controller's tenants data is invalid here; keeping the old one")
            return
        self.tenants = tenants
        if getattr(self, "pool", None) is not None:  # (during __init__, it sets the config itself)
            # reconnecting (e.g. to a new controller) brings this data and the quotas derived from it
            self.pool.config = pool_config(self.settings, tenants, self.pool.app)

    async def __del__(self):  # Serve calls it when the replica stops: the last one stops the workers
        pool = getattr(self, "pool", None) or getattr(self, "_opening", None)  # (__init__ may have failed)
        if pool is not None:
            await pool.close()

    async def check_health(self):  # Serve's replica health check (reconnects to a new controller if it died)
        h = await self.pool.call("health")
        if not h["workers"]:
            raise RuntimeError(h["error"] or "no workers")

    # -- plain routes --------------------------------------------------------------------------
    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: probes (aiperf, load balancers) ask it first
    async def health(self):
        try:
            ready = (await self.pool.call("health"))["ready"]
        except Exception:  # noqa: BLE001 - controller unreachable: not ready
            ready = 0
        status = 200 if ready else 503
        return JSONResponse({"status": "ok" if ready else "starting", "workers_ready": ready,
                             "model": self.model_name}, status_code=status)

    async def _ask(self, method: str, *args):
        """``Controller.<method>(*args)``; any failure becomes an OpenAI error (503 when the
        controller is unavailable or slow)."""
        try:
            return await self.pool.call(method, *args)
        except Exception as e:  # noqa: BLE001 - mapped, never a bare 500
            raise _as_api_error(e) from None

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def metrics(self, req: HttpRequest):
        if self.settings.metrics_auth == "admin" and not self.tenants.is_admin(_bearer(req)):
            raise ApiError(401, "/metrics needs an admin key (send Authorization: Bearer <admin key>)",
                           code="invalid_api_key")
        snap = await self._ask("metrics_snapshot")
        text = self.metrics.render(snap["queue_depth"], snap["inflight"], snap["states"], snap["assigned"],
                                   snap["router"])
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    def _model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": 0, "owned_by": "kvmesh",
                "max_model_len": self.max_model_len}

    @app.get("/v1/models")
    async def models(self, req: HttpRequest):
        self._auth(req)
        return {"object": "list", "data": [self._model_card()]}

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(self, model: str, req: HttpRequest):
        """OpenAI's retrieve-model route (``client.models.retrieve``): the served model's card."""
        self._auth(req)
        if model != self.model_name:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")
        return self._model_card()

    @app.get("/kvmesh/workers")
    async def workers(self, req: HttpRequest):
        """Pool and engine state per worker: a tenant's key sees only its own state, an admin key
        (tenants file ``admin_keys``) everything (``policies.introspection``)."""
        if self.tenants.is_admin(_bearer(req)):
            return await self._ask("workers_view", None)
        return await self._ask("workers_view", self._auth(req).name)

    @app.post("/v1/templates", openapi_extra=openapi_body(TemplateBody))
    async def register_template(self, req: HttpRequest):
        """Register ``{"id": ..., "template": "text with {param}"}`` for the caller's tenant
        (kept by the controller for every replica; the text travels with each request, so workers
        need no copy)."""
        from policies.remap import Template

        tenant = self._auth(req)
        body = parse_body(await read_body(req, self.limits.max_body_bytes), TemplateBody)
        tid, text = body.id, body.template
        check_template(tid, text)
        params = list(Template.parse(tid, text).params)
        await self._ask("register_template", tenant.name, tid, text)
        return {"object": "template", "id": tid, "tenant": tenant.name, "params": params}

    async def _template(self, tenant: TenantConfig, tid: str) -> str:
        text = dict(tenant.templates).get(tid) or await self._ask("template", tenant.name, tid)
        if text is None:
            raise ApiError(400, f"unknown template {tid!r} for tenant {tenant.name!r}", param="kvmesh.template")
        return text

    # -- tokenizer (vLLM's routes) --------------------------------------------------------------
    @app.get("/version")
    async def version(self):
        return {"version": _version()}

    @app.post("/tokenize", openapi_extra=openapi_body(TokenizeBody))
    async def tokenize(self, req: HttpRequest):
        """``{prompt}`` or ``{messages}`` (chat template applied) → ``{count, max_model_len, tokens}``."""
        self._auth(req)
        body = parse_body(await read_body(req, self.limits.max_body_bytes), TokenizeBody)
        self._check_model(body.model)
        if body.messages is not None:
            ids = self._chat_ids(body.messages, body.add_generation_prompt is not False,
                                 bool(body.continue_final_message), bool(body.add_special_tokens))
        else:
            special = True if body.add_special_tokens is None else body.add_special_tokens
            self.limits.check_chars(len(body.prompt), self.max_model_len, "prompt")
            ids = await self._encode(body.prompt, add_special_tokens=special)
        strs = [self.token_texts(t) for t in ids] if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize", openapi_extra=openapi_body(DetokenizeBody))
    async def detokenize(self, req: HttpRequest):
        """``{tokens}`` → ``{prompt}`` (special tokens kept, as vLLM)."""
        self._auth(req)
        body = parse_body(await read_body(req, self.limits.max_body_bytes), DetokenizeBody)
        self._check_model(body.model)
        vocab = _vocab_size(self.tokenizer)
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise ApiError(400, f"token ids must be in [0, {vocab}), got {bad[0]}", param="tokens")
        try:
            text = self.tokenizer.decode(body.tokens, skip_special_tokens=False)
        except TypeError:
            text = self.tokenizer.decode(body.tokens)
        return {"prompt": text}

    @app.get("/tokenizer_info")
    async def tokenizer_info(self, req: HttpRequest):
        """The tokenizer's special tokens and chat template (vLLM's route; lm-eval's remote tokenizer)."""
        self._auth(req)
        tok = self.tokenizer
        info = {k: getattr(tok, k, None) for k in ("eos_token", "bos_token", "pad_token", "unk_token")}
        template = getattr(tok, "chat_template", None)
        info = {k: v if isinstance(v, str) else None for k, v in info.items()}
        return {"tokenizer_class": type(tok).__name__, **info,
                "chat_template": template if isinstance(template, str) else None,
                "model_max_length": self.max_model_len}

    # -- completions ---------------------------------------------------------------------------
    @app.post("/v1/completions", openapi_extra=openapi_body(CompletionRequest))
    async def completions(self, req: HttpRequest):
        return await self._serve(req, chat=False)

    @app.post("/v1/chat/completions", openapi_extra=openapi_body(ChatRequest))
    async def chat_completions(self, req: HttpRequest):
        return await self._serve(req, chat=True)

    def _auth(self, req: HttpRequest) -> TenantConfig:
        key = _bearer(req)
        tenant = self.tenants.authenticate(key)
        if tenant is None and self.tenants.is_admin(key):
            raise ApiError(403, "an admin key is not a tenant: it can read /kvmesh/workers and /metrics only",
                           type_="permission_error", code="permission_denied")
        if tenant is None:
            raise ApiError(401, "missing or unknown API key (send Authorization: Bearer <key>)",
                           code="invalid_api_key")
        return tenant

    def _rejected(self, tenant: str, reason: str, retry_after_s: float) -> ApiError:
        """The 429 of a request refused by ``tenant``'s ``reason`` ("rate" | "concurrency") limit (counted)."""
        self.metrics.rejected.labels(tenant=tenant, reason=reason).inc()
        return ApiError(429, f"tenant {tenant!r} is over its {reason} limit; retry later", type_="requests",
                        code="rate_limit_exceeded", headers={"Retry-After": str(max(1, math.ceil(retry_after_s)))})

    def _pre_admit(self, tenant: str) -> None:
        """Refuse at once (429) a request the controller would refuse too, judged from this
        replica's own leases and the controller's past answers (``ControllerClient.pre_admit``,
        ``policies.pre_admission``): nothing of it is read, parsed or sent anywhere. A pool
        without ``pre_admit`` (``cluster.baselines``) leaves every decision to its admission."""
        check = getattr(self.pool, "pre_admit", None)
        if check is None:
            return
        d = check(tenant)
        if not d.ok:
            raise self._rejected(tenant, d.reason, d.retry_after_s)

    async def _hold_refusal(self, tenant: str, err: ApiError) -> None:
        """Hold a rate/concurrency 429 of a tenant that retried inside its last Retry-After
        (``policies.reject_delay``): a client ignoring Retry-After then costs the front end one
        refusal per ``reject_delay_s`` per connection instead of one per round trip."""
        if err.status != 429 or err.code != "rate_limit_exceeded":
            return
        try:
            retry_after = float(err.headers.get("Retry-After", 0))
        except ValueError:
            retry_after = 0.0
        delay = self.reject_delay.acquire(tenant, time.monotonic(), retry_after)
        if delay > 0:
            try:
                await asyncio.sleep(delay)
            finally:
                self.reject_delay.release()

    def _check_model(self, model: str | None) -> None:
        if model is not None and model not in (self.model_name, "default"):
            raise ApiError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                           code="model_not_found", param="model")

    def _chat_text(self, messages, add_generation_prompt: bool = True, continue_final_message: bool = False) -> str:
        """The chat template applied to ``messages``; text longer than any context could hold is
        refused first (``InputLimits.check_chars``)."""
        msgs = [{"role": m.role, "content": m.text()} for m in messages]
        self.limits.check_chars(sum(len(m["content"]) for m in msgs), self.max_model_len, "messages")
        kw = {"continue_final_message": True} if continue_final_message else {}
        try:
            return self.tokenizer.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt,
                                                      tokenize=False, **kw)
        except Exception as e:  # noqa: BLE001 - template errors are the client's messages
            raise ApiError(400, f"cannot apply the chat template: {redact(str(e), 200)}", param="messages") from None

    def _chat_ids(self, messages, add_generation_prompt: bool = True, continue_final_message: bool = False,
                  add_special_tokens: bool = False) -> list[int]:
        text = self._chat_text(messages, add_generation_prompt, continue_final_message)
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    async def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """Token ids of ``text``; long text is tokenized on a thread, never on the event loop."""
        if len(text) <= ENCODE_INLINE_CHARS:
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        return list(await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens=add_special_tokens))

    def _check_ids(self, ids, param: str = "prompt") -> None:
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ApiError(400, f"prompt token ids must be integers in [0, {self.vocab_size}); got {redact(bad, 24)}",
                           param=param)

    async def _prompts(self, body, chat: bool) -> list[PromptInfo]:
        """The request's prompts as token ids (+ their text, for echo). Text is bounded before
        tokenizing and tokenized off the event loop when long; token ids must be in the vocabulary."""
        if chat:
            text = self._chat_text(body.messages, body.add_generation_prompt is not False,
                                   bool(body.continue_final_message))
            return [PromptInfo(await self._encode(text, add_special_tokens=False), "")]
        tok, out = self.tokenizer, []
        for p in body.prompts():
            if isinstance(p, str):
                self.limits.check_chars(len(p), self.max_model_len, "prompt")
                out.append(PromptInfo(await self._encode(p, add_special_tokens=body.add_special_tokens is not False), p))
                continue
            self._check_ids(p)
            text = ""
            if body.echo:
                try:
                    text = tok.decode(p, skip_special_tokens=True)
                except Exception:  # noqa: BLE001 - ids out of range: the engine says so below
                    raise ApiError(400, "prompt token ids must be valid token ids of the model",
                                   param="prompt") from None
            out.append(PromptInfo(list(p), text))
        return out

    def _params(self, d: dict) -> SamplingParams:
        """SamplingParams from ``d``; a field this engine build lacks is a 400 naming the HTTP field."""
        known = {f.name for f in fields(SamplingParams)}
        for k in d:
            if k not in known:
                param = _ENGINE_PARAM.get(k, k)
                raise ApiError(400, f"{param} is not supported by this kvmesh engine build", param=param,
                               code="unsupported_parameter")
        if "grammar" in d:
            kind, schema = d["grammar"]
            d = {**d, "grammar": _grammar_spec()(kind=kind, schema=schema)}
        try:
            params = SamplingParams(**d)
            check_sampling_limits(params)
            return params
        except InvalidRequest as e:
            raise ApiError(400, redact(str(e), 300), param=e.param) from None

    async def _build(self, tenant: TenantConfig, body, chat: bool) -> tuple[str, list[Request], Assembler]:
        """(response id, one engine Request per prompt, the Assembler that formats their outputs)."""
        self._check_model(body.model)
        prompts = await self._prompts(body, chat)
        param = "messages" if chat else "prompt"
        requested = body.requested_max_tokens() if chat else body.max_tokens
        echo = bool(not chat and body.echo)
        score_only = echo and requested == 0
        n_engine = body.num_choices if chat else body.engine_n
        k = body.num_logprobs if chat else body.logprobs
        reuse = (body.kvmesh.reuse if body.kvmesh and body.kvmesh.reuse else None) or tenant.reuse
        prefix = "chatcmpl" if chat else "cmpl"
        engine_rid = f"{prefix}-{uuid.uuid4().hex}"  # unique whatever the client sends
        rid = f"{prefix}-{body.request_id}" if body.request_id else engine_rid
        tid = body.kvmesh.template if body.kvmesh else None
        approx = {}
        if tid is not None:
            approx = {"template": tid, "template_text": await self._template(tenant, tid),
                      "template_params": dict(body.kvmesh.params or {})}
        domain, read = self.tenants.request_domains(tenant.name, body.cache_salt)
        requests = []
        for i, info in enumerate(prompts):
            n = len(info.ids)
            where = f"prompt[{i}]" if len(prompts) > 1 else "the prompt"
            if n == 0:
                raise ApiError(400, f"{where} is empty", param=param)
            if n >= self.max_model_len:
                raise ApiError(400, f"{where} has {n} tokens; this model's context is {self.max_model_len} tokens",
                               code="context_length_exceeded", param=param)
            max_tokens = requested
            if max_tokens is None:
                # the room left, at most the default (completions: OpenAI's 16)
                max_tokens = min(self.settings.default_chat_max_tokens if chat else 16, self.max_model_len - n)
            elif score_only:
                max_tokens = 1  # the engine generates >= 1 token; the answer drops it
            elif n + max_tokens > self.max_model_len:
                raise ApiError(400, f"{where} ({n} tokens) + max_tokens ({max_tokens}) exceeds the context of "
                               f"{self.max_model_len} tokens", code="context_length_exceeded", param="max_tokens")
            d = body.sampling(max_tokens)
            if n_engine > 1:
                d["n"] = n_engine
            if k is not None:
                d["logprobs"] = k
            elif n_engine > body.num_choices:
                d["logprobs"] = 0  # best_of ranks by cumulative logprob (not returned)
            if echo and k is not None:
                d["prompt_logprobs"] = k
            requests.append(Request(
                request_id=engine_rid if len(prompts) == 1 else f"{engine_rid}-{i}", prompt_ids=tuple(info.ids),
                params=self._params(d), tenant=tenant.name, share_domain=domain,
                reuse=reuse, read_domains=read, remap_policy=tenant.remap_policy,
                recompute_ratio=tenant.recompute_ratio, **approx))
        texts = TokenIds() if body.return_tokens_as_token_ids else self.token_texts
        asm = Assembler(chat, prompts, body.num_choices, n_engine, texts, logprobs=k, echo=echo, score_only=score_only)
        return rid, requests, asm

    async def _serve(self, req: HttpRequest, chat: bool):
        endpoint = "chat" if chat else "completions"
        tenant_name = "-"
        received = time.perf_counter()
        try:
            tenant = self._auth(req)
            tenant_name = tenant.name
            self._pre_admit(tenant.name)  # before the body is read: a flood's refusals cost ~nothing
            body = parse_body(await read_body(req, self.limits.max_body_bytes), ChatRequest if chat else CompletionRequest)
            rid, requests, asm = await self._build(tenant, body, chat)
        except Exception as e:  # noqa: BLE001 - counted, and always an OpenAI error body
            err = _as_api_error(e)
            self.metrics.requests.labels(tenant=tenant_name, endpoint=endpoint, code=str(err.status)).inc()
            await self._hold_refusal(tenant_name, err)
            raise err from None
        t0 = time.perf_counter()
        # admission + routing by the controller, then the worker's stream; all prompts at once
        # (a batch: as many as the tenant's limits let in flight, the others as their leases end)
        if len(requests) == 1:
            streams = [self.pool.generate(requests[0])]
            starts = [_first(streams[0])]
        else:
            batch = _BatchAdmission(self.pool, requests, tenant.limits.batch_window(len(requests)),
                                    self.settings.batch_wait_s)
            streams = batch.streams  # filled as the prompts start
            starts = [batch.first(p) for p in range(len(requests))]
        try:
            firsts = await _all(starts)  # errors before the first token → 4xx/5xx
        except BaseException as e:
            for s in streams:
                if s is not None:
                    await s.aclose()
            if isinstance(e, Rejected):
                e = self._rejected(tenant.name, e.reason, e.retry_after_s)
            if not isinstance(e, Exception):  # cancelled: the client went away before the first token
                self.metrics.requests.labels(tenant=tenant.name, endpoint=endpoint, code="499").inc()
                raise
            err = _as_api_error(e)
            self.metrics.requests.labels(tenant=tenant.name, endpoint=endpoint, code=str(err.status)).inc()
            await self._hold_refusal(tenant.name, err)
            raise err from None
        self.metrics.ttft.labels(tenant=tenant.name).observe(time.perf_counter() - t0)
        timings = [stage_timings(received, t0, at, choice.lease_s, choice.route_s, first.ttft_s, first.prefill_s)
                   for (_, choice, first), at in firsts]
        self.metrics.observe_stages(tenant.name, timings)
        leases = [(ws.worker_id, choice) for (ws, choice, _), _ in firsts]
        outs = [first for (_, _, first), _ in firsts]
        ctx = _Ctx(self, tenant.name, endpoint, rid, requests, chat, leases, streams, outs, asm, body.include_usage,
                   body.continuous_usage, timings)
        if body.is_stream:
            return ClosingStreamingResponse(ctx.sse(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await ctx.whole()
