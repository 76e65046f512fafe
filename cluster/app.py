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

from cluster.metrics import CONTENT_TYPE_LATEST, Metrics
import ray

from cluster import safe_json
from cluster.controller import ConfigMismatch, ControllerClient, ControllerClosing, Rejected, TemplateQuotaExceeded
from cluster.input_limits import ENCODE_INLINE_CHARS, InputLimits, _vocab_size, check_template, read_body
from cluster.pool import PoolConfig, WorkerUnavailable
from cluster.protocol import (DONE, ApiError, ChatBody, CompletionBody, Served, chunk, completion_response,
                              error_event, parse_body, usage)
from engine.approx import ApproxConfig
from engine.async_engine import EngineDead, EngineStepFailed
from engine.fault_isolation import RequestFailed
from engine.llm_engine import EngineConfig, check_sampling_limits
from engine.redact import redact
from engine.sequence import InvalidRequest, Request, SamplingParams
from policies.autoscale import AutoscaleConfig
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

    def __post_init__(self):
        if self.metrics_auth not in ("none", "admin"):
            raise ValueError(f"metrics_auth must be 'none' or 'admin', got {self.metrics_auth!r}")

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
                          tenant_quotas=tenants.eviction_quotas(),
                          approx=ApproxConfig(tenant_gates=tenants.quality_gates()))
    return PoolConfig(engine=engine, autoscale=s.autoscale(), shares=tuple(sorted(tenants.worker_shares().items())),
                      worker_num_cpus=s.worker_num_cpus, worker_num_gpus=s.worker_num_gpus,
                      auto_device=s.device is None, auto_dtype=s.dtype is None, ready_timeout_s=s.ready_timeout_s,
                      app=app)


def build_app(args: dict) -> Application:
    """Serve application builder: ``import_path: cluster.app:build_app`` with ``args``."""
    settings = AppSettings.from_args(args)
    path = Path(settings.tenants) if settings.tenants else tenants_path(EXAMPLE_TENANTS)
    tenants_data = read_tenants_file(path)
    return KvmeshIngress.bind(dataclasses.asdict(settings), tenants_data)


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
    """One admitted request being answered; closes its stream (ending the lease) exactly once."""

    def __init__(self, ing: "KvmeshIngress", tenant: str, endpoint: str, request: Request, chat: bool, worker: str,
                 route: str, stream, first, include_usage: bool):
        self.ing, self.tenant, self.endpoint, self.request, self.chat = ing, tenant, endpoint, request, chat
        self.worker, self.route, self.stream, self.first, self.include_usage = worker, route, stream, first, include_usage
        self.model = ing.model_name
        self.created = int(time.time())

    def _served(self, out) -> Served:
        approx = getattr(out, "num_approx_tokens", 0)
        return Served(worker=self.worker, route=out.route or self.route,
                      exact_cached_tokens=out.num_cached_tokens - approx, approx_cached_tokens=approx,
                      pulled_tokens=out.pulled_tokens, reuse=self.request.reuse)

    def _done(self, out, code: int) -> None:
        m = self.ing.metrics
        m.requests.labels(tenant=self.tenant, endpoint=self.endpoint, code=str(code)).inc()
        if out is not None:
            m.observe_finished(self.tenant, out.num_prompt_tokens, out.num_cached_tokens, out.num_output_tokens,
                               out.route, out.pulled_tokens)

    async def _outputs(self):
        yield self.first
        if not self.first.finished:
            async for _, _, out in self.stream:
                yield out

    async def whole(self):
        text, last, code = [], None, 200
        try:
            async for out in self._outputs():
                text.append(out.new_text)
                last = out
        except Exception as e:  # noqa: BLE001
            code = _as_api_error(e).status
            raise _as_api_error(e) from None
        finally:
            await self.stream.aclose()
            self._done(last if code == 200 else None, code)
        use = usage(last.num_prompt_tokens, last.num_output_tokens, last.num_cached_tokens)
        return completion_response(self.request.request_id, self.model, "".join(text), last.finish_reason, use,
                                   self._served(last), self.chat)

    async def sse(self):
        rid, last, code = self.request.request_id, None, 200
        try:
            if self.chat:
                yield chunk(rid, self.model, self.created, True, text="", role=True)
            async for out in self._outputs():
                last = out
                if out.finished:
                    use = usage(out.num_prompt_tokens, out.num_output_tokens, out.num_cached_tokens)
                    yield chunk(rid, self.model, self.created, self.chat, text=out.new_text,
                                finish_reason=out.finish_reason, served=self._served(out),
                                use=None if self.include_usage else use)
                    if self.include_usage:
                        yield chunk(rid, self.model, self.created, self.chat, use=use, no_choices=True,
                                    served=self._served(out))
                elif out.new_text:
                    yield chunk(rid, self.model, self.created, self.chat, text=out.new_text)
            yield DONE
        except Exception as e:  # noqa: BLE001 - the status line is sent: report in-band
            err = _as_api_error(e)
            code = err.status
            yield error_event(err)
            yield DONE
        except BaseException:  # client disconnected (cancelled): the finally below frees the request
            code = 499
            raise
        finally:
            await self.stream.aclose()
            self._done(last if code == 200 else None, code)


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
        return ApiError(400, msg.split("InvalidRequest: ")[-1])
    if isinstance(e, RequestFailed):
        return ApiError(500, _last_line(e), type_="server_error", code="request_failed")
    if isinstance(e, (EngineStepFailed, EngineDead)):
        return ApiError(503, f"the worker's engine failed; retry the request ({_last_line(e)[:200]})",
                        type_="server_error", code="engine_failed")
    if isinstance(e, TemplateQuotaExceeded):
        return ApiError(429, str(e), type_="requests", code="template_quota_exceeded", param="id")
    if isinstance(e, WorkerUnavailable):
        return ApiError(503, str(e), type_="server_error", code="worker_unavailable")
    if isinstance(e, (asyncio.TimeoutError, TimeoutError, ray.exceptions.GetTimeoutError)):
        return ApiError(503, "the kvmesh controller did not answer in time; retry later", type_="server_error",
                        code="controller_timeout")
    if isinstance(e, (ControllerClosing, ray.exceptions.RayActorError)):
        return ApiError(503, "the kvmesh controller is restarting; retry later", type_="server_error",
                        code="controller_unavailable")
    if isinstance(e, ConfigMismatch):
        log.error("kvmesh replica refused by its controller: %s", e)
        return ApiError(503, f"this replica cannot attach to the kvmesh controller: {e}", type_="server_error",
                        code="controller_unavailable")
    log.error("request failed: %s", redact(repr(e), 300))
    return ApiError(500, f"internal error: {type(e).__name__}", type_="server_error", code="internal_error")


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000, num_replicas=1)
@serve.ingress(app)
class KvmeshIngress:
    async def __init__(self, settings: dict, tenants_data: dict):
        s = AppSettings(**settings)
        tenants = Tenants.from_dict(tenants_data)
        # One controller per app, shared by all ingress replicas (the first one creates it).
        app_name = serve.get_replica_context().app_name
        pool = ControllerClient(app_name, pool_config(s, tenants, app_name), tenants_data, s.client_ttl_s)
        pool.on_tenants = self._new_tenants
        await pool.connect()
        if pool.tenants_data != tenants_data:  # the controller runs a newer tenants file: take it
            tenants = Tenants.from_dict(pool.tenants_data)
            pool.config = pool_config(s, tenants, app_name)
        self._setup(s, tenants, pool, await pool.wait_ready(s.ready_timeout_s))

    def _setup(self, s: AppSettings, tenants: Tenants, pool, info: dict) -> None:
        """The replica's state, given its controller client ``pool`` and a ready worker's
        ``info`` (also used by in-process tests with a stand-in pool)."""
        self.settings, self.tenants, self.pool = s, tenants, pool
        self.model_name, self.tokenizer = load_tokenizer(s.model)
        self.metrics = Metrics(self.tenants.names())
        self.max_model_len = int(info["max_model_len"])
        self.vocab_size = int(info.get("vocab_size") or _vocab_size(self.tokenizer))
        self.limits = InputLimits.derive(self.max_model_len, self.tokenizer, s.max_body_bytes)

    def _new_tenants(self, tenants_data: dict) -> None:
        """The controller runs a newer tenants file (another replica of a redeploy brought it):
        authenticate with its keys from now on."""
        try:
            tenants = Tenants.from_dict(tenants_data)
        except TenantsError:
            log.exception("the controller's tenants data is invalid here; keeping the old one")
            return
        self.tenants = tenants
        if getattr(self, "settings", None) is not None:  # (during __init__, it sets both itself)
            # reconnecting (e.g. to a new controller) brings this data and the quotas derived from it
            self.pool.config = pool_config(self.settings, tenants, self.pool.app)

    async def __del__(self):  # Serve calls it when the replica stops: the last one stops the workers
        await self.pool.close()

    async def check_health(self):  # Serve's replica health check (reconnects to a new controller if it died)
        h = await self.pool.call("health")
        if not h["workers"]:
            raise RuntimeError(h["error"] or "no workers")

    # -- plain routes --------------------------------------------------------------------------
    @app.get("/health")
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

    @app.get("/metrics")
    async def metrics(self, req: HttpRequest):
        if self.settings.metrics_auth == "admin" and not self.tenants.is_admin(_bearer(req)):
            raise ApiError(401, "/metrics needs an admin key (send Authorization: Bearer <admin key>)",
                           code="invalid_api_key")
        snap = await self._ask("metrics_snapshot")
        text = self.metrics.render(snap["queue_depth"], snap["inflight"], snap["states"], snap["assigned"],
                                   snap["router"])
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(self, req: HttpRequest):
        self._auth(req)
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                            "owned_by": "kvmesh", "max_model_len": self.max_model_len}]}

    @app.get("/kvmesh/workers")
    async def workers(self, req: HttpRequest):
        """Pool and engine state per worker: a tenant's key sees only its own state, an admin key
        (tenants file ``admin_keys``) everything (``policies.introspection``)."""
        if self.tenants.is_admin(_bearer(req)):
            return await self._ask("workers_view", None)
        return await self._ask("workers_view", self._auth(req).name)

    @app.post("/v1/templates")
    async def register_template(self, req: HttpRequest):
        """Register ``{"id": ..., "template": "text with {param}"}`` for the caller's tenant
        (kept by the controller for every replica; the text travels with each request, so workers
        need no copy)."""
        from policies.remap import Template

        tenant = self._auth(req)
        try:
            body = safe_json.loads(await read_body(req, self.limits.max_body_bytes))
        except safe_json.BadJson as e:
            raise ApiError(400, str(e)) from None
        tid, text = (body.get("id"), body.get("template")) if isinstance(body, dict) else (None, None)
        if not (isinstance(tid, str) and tid and isinstance(text, str) and text):
            raise ApiError(400, 'expected {"id": "<template id>", "template": "text with {param} spans"}')
        check_template(tid, text)
        params = list(Template.parse(tid, text).params)
        await self._ask("register_template", tenant.name, tid, text)
        return {"object": "template", "id": tid, "tenant": tenant.name, "params": params}

    async def _template(self, tenant: TenantConfig, tid: str) -> str:
        text = dict(tenant.templates).get(tid) or await self._ask("template", tenant.name, tid)
        if text is None:
            raise ApiError(400, f"unknown template {tid!r} for tenant {tenant.name!r}", param="kvmesh.template")
        return text

    # -- completions ---------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(self, req: HttpRequest):
        return await self._serve(req, chat=False)

    @app.post("/v1/chat/completions")
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

    async def _prompt_ids(self, body, chat: bool) -> list[int]:
        """The prompt's token ids. Text longer than the context could hold in any tokenization is
        refused before tokenizing (``InputLimits.max_prompt_chars``); long text is tokenized on a
        thread, never on the event loop; token-id prompts must lie in the vocabulary."""
        tok = self.tokenizer
        param = "messages" if chat else "prompt"
        if chat:
            msgs = [{"role": m.role, "content": m.text()} for m in body.messages]
            self.limits.check_chars(sum(len(m["content"]) for m in msgs), self.max_model_len, param)
            try:
                text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
            except Exception as e:  # noqa: BLE001 - template errors are the client's messages
                raise ApiError(400, f"cannot apply the chat template: {redact(str(e))}", param="messages") from None
            return await self._encode(text, add_special_tokens=False)
        p = body.prompt
        if isinstance(p, list) and p and isinstance(p[0], int):
            bad = next((t for t in p if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise ApiError(400, f"prompt token ids must be integers in [0, {self.vocab_size}); got "
                               f"{redact(bad, 24)}", param="prompt")
            return list(p)
        text = p[0] if isinstance(p, list) and p else p if isinstance(p, str) else ""
        self.limits.check_chars(len(text), self.max_model_len, param)
        return await self._encode(text, add_special_tokens=True)

    async def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if len(text) <= ENCODE_INLINE_CHARS:
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        return list(await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens=add_special_tokens))

    async def _build(self, tenant: TenantConfig, body, chat: bool) -> Request:
        if body.model not in (self.model_name, "default"):
            raise ApiError(404, f"the model {body.model!r} does not exist; this server serves {self.model_name!r}",
                           code="model_not_found", param="model")
        ids = await self._prompt_ids(body, chat)
        n = len(ids)
        if n == 0:
            raise ApiError(400, "the prompt is empty", param="prompt")
        if n >= self.max_model_len:
            raise ApiError(400, f"the prompt has {n} tokens; this model's context is {self.max_model_len} tokens",
                           code="context_length_exceeded", param="messages" if chat else "prompt")
        requested = body.requested_max_tokens() if chat else body.max_tokens
        if requested is None:
            requested = min(self.settings.default_chat_max_tokens, self.max_model_len - n) if chat else 16
        elif requested > 0 and n + requested > self.max_model_len:
            raise ApiError(400, f"prompt ({n} tokens) + max_tokens ({requested}) exceeds the context of "
                           f"{self.max_model_len} tokens", code="context_length_exceeded", param="max_tokens")
        try:
            params = SamplingParams(**body.sampling(requested))
            check_sampling_limits(params)
        except InvalidRequest as e:
            raise ApiError(400, redact(str(e), 300)) from None
        reuse = (body.kvmesh.reuse if body.kvmesh and body.kvmesh.reuse else None) or tenant.reuse
        prefix = "chatcmpl" if chat else "cmpl"
        tid = body.kvmesh.template if body.kvmesh else None
        approx = {}
        if tid is not None:
            approx = {"template": tid, "template_text": await self._template(tenant, tid),
                      "template_params": dict(body.kvmesh.params or {})}
        domain, read = self.tenants.request_domains(tenant.name, body.cache_salt)
        return Request(request_id=f"{prefix}-{uuid.uuid4().hex}", prompt_ids=tuple(ids), params=params,
                       tenant=tenant.name, share_domain=domain, reuse=reuse,
                       read_domains=read, remap_policy=tenant.remap_policy,
                       recompute_ratio=tenant.recompute_ratio, **approx)

    async def _serve(self, req: HttpRequest, chat: bool):
        endpoint = "chat" if chat else "completions"
        tenant_name = "-"
        try:
            tenant = self._auth(req)
            tenant_name = tenant.name
            body = parse_body(await read_body(req, self.limits.max_body_bytes), ChatBody if chat else CompletionBody)
            request = await self._build(tenant, body, chat)
        except Exception as e:  # noqa: BLE001 - counted, and always an OpenAI error body
            err = _as_api_error(e)
            self.metrics.requests.labels(tenant=tenant_name, endpoint=endpoint, code=str(err.status)).inc()
            raise err from None
        t0 = time.perf_counter()
        stream = self.pool.generate(request)  # admission + routing by the controller, then the worker's stream
        try:
            ws, choice, first = await stream.__anext__()  # errors before the first token → 4xx/5xx
        except BaseException as e:
            await stream.aclose()
            if isinstance(e, Rejected):
                self.metrics.rejected.labels(tenant=tenant.name, reason=e.reason).inc()
                e = ApiError(429, f"tenant {tenant.name!r} is over its {e.reason} limit; retry later",
                             type_="requests", code="rate_limit_exceeded",
                             headers={"Retry-After": str(max(1, math.ceil(e.retry_after_s)))})
            if not isinstance(e, Exception):  # cancelled: the client went away before the first token
                self.metrics.requests.labels(tenant=tenant.name, endpoint=endpoint, code="499").inc()
                raise
            err = _as_api_error(e)
            self.metrics.requests.labels(tenant=tenant.name, endpoint=endpoint, code=str(err.status)).inc()
            raise err from None
        self.metrics.ttft.labels(tenant=tenant.name).observe(time.perf_counter() - t0)
        ctx = _Ctx(self, tenant.name, endpoint, request, chat, ws.worker_id, choice.route, stream, first,
                   body.stream_options.include_usage if body.stream_options else False)
        if body.stream:
            return StreamingResponse(ctx.sse(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await ctx.whole()
