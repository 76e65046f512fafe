"""The OpenAI wire format: request bodies (validated), their JSON schemas, error bodies.

No Ray, no engine state: the ingress parses a body into a ``CompletionBody``/``ChatBody`` (or a
tokenizer body), turns it into engine ``Request``s and formats the outputs back
(``cluster.choices``). Invariants of parsing:

* every field a body may carry is declared here, so ``/openapi.json`` (``openapi_body``) describes
  exactly what a route accepts;
* an OpenAI/vLLM field kvmesh does not implement (``UNSUPPORTED``) is a 400 naming it
  (``param``, code ``unsupported_parameter``) unless it is null or its neutral value;
* a field nobody defines is a 400 naming it (code ``unknown_parameter``), never silently ignored;
* harmless metadata (``user``, ``metadata``, ``store: false``, ``service_tier: auto|default``,
  ``prompt_cache_key``, ``safety_identifier``, ``stream_options.include_obfuscation``) is
  accepted and has no effect.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictFloat, StrictStr,
                      ValidationError, create_model)

from cluster import safe_json


class ApiError(Exception):
    """An error with its HTTP status and OpenAI error body."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


MAX_N = 64  # choices per prompt (n, best_of); the engine's limit too
MAX_PROMPTS = 256  # prompts in one batched completion request
MAX_LOGPROBS = 20  # top alternatives per token (OpenAI: 5 for completions, 20 for chat)

Number = StrictFloat  # strict: accepts ints, rejects bools and strings


def _num(ge=None, le=None, gt=None):
    """A finite JSON number in a range (the engine checks the same ranges again)."""
    return Annotated[float, Field(strict=True, ge=ge, le=le, gt=gt, allow_inf_nan=False)]


def _integral(v):
    """JSON Schema's integers include 1.0: take integral floats as ints (never bools or strings)."""
    return int(v) if isinstance(v, float) and v.is_integer() else v


def _int(**constraints):
    return Annotated[int, Field(strict=True, **constraints), BeforeValidator(_integral)]  # (this order keeps
    # the constraints in the JSON schema)


StrictInt = _int()
TokenId = _int(ge=0)
StopString = Annotated[str, Field(strict=True, min_length=1)]
TokenIdKey = Annotated[str, Field(strict=True, pattern=r"^[0-9]{1,9}$")]

# Fields of OpenAI's or vLLM's request bodies kvmesh does not implement: name -> (why, the values
# that mean "off" and are accepted). None (JSON null) is always accepted: it means "absent".
UNSUPPORTED: dict[str, tuple[str, tuple]] = {
    "suffix": ("insertion (fill-in-the-middle) is not implemented", ("",)),
    "tools": ("tool calling is not implemented", ()),
    "tool_choice": ("tool calling is not implemented", ("none",)),
    "functions": ("function calling is not implemented", ()),
    "function_call": ("function calling is not implemented", ("none",)),
    "audio": ("audio output is not implemented", ()),
    "modalities": ("only text output is implemented", ()),
    "prediction": ("predicted outputs are not implemented", ()),
    "web_search_options": ("web search is not implemented", ()),
    "reasoning_effort": ("the served models do not reason", ()),
    "verbosity": ("the served models have no verbosity control", ()),
    # our prefix cache lives as long as its tenant's TTL (tenants file): "in_memory" is what it is
    "prompt_cache_retention": ("extended cache retention is not implemented; a tenant's prefixes live as "
                               "long as its cache TTL (tenants file)", ("in_memory",)),
    # vLLM extensions
    "use_beam_search": ("beam search is not implemented", (False,)),
    "length_penalty": ("beam search is not implemented", (1, 1.0)),
    "skip_special_tokens": ("special tokens are always skipped in the text", (True,)),
    "spaces_between_special_tokens": ("not implemented", (True,)),
    "truncate_prompt_tokens": ("prompts are never truncated; a too long prompt is a 400", ()),
    "allowed_token_ids": ("not implemented (use logit_bias)", ()),
    "bad_words": ("not implemented (use logit_bias)", ()),
    "prompt_embeds": ("embeddings as input are not implemented", ()),
    "guided_json": ("use response_format json_schema", ()),
    "guided_regex": ("regex constraints are not implemented", ()),
    "guided_choice": ("choice constraints are not implemented", ()),
    "guided_grammar": ("grammar constraints are not implemented (use response_format)", ()),
    "guided_decoding_backend": ("the grammar backend is fixed (xgrammar)", ()),
    "guided_whitespace_pattern": ("not implemented", ()),
    "structural_tag": ("not implemented", ()),
    "structured_outputs": ("use response_format", ()),
    "logits_processors": ("custom logits processors are not accepted", ()),
    "kv_transfer_params": ("kvmesh moves KV itself (see the kvmesh object)", ()),
    "vllm_xargs": ("not implemented", ()),
    "chat_template": ("the model's own chat template is always used", ()),
    "chat_template_kwargs": ("not implemented", ()),
    "documents": ("not implemented", ()),
    "mm_processor_kwargs": ("the served models take text only", ()),
    "priority": ("priority scheduling is not implemented", (0,)),
    "prompt_logprobs": ("use echo with logprobs (completions)", ()),
}
# Unsupported only on one endpoint (the other endpoint supports or does not know them).
CHAT_ONLY_UNSUPPORTED = {"echo": ("echo is a completions option", (False,)),
                         "best_of": ("best_of is a completions option", (1,))}


def _same(a, b) -> bool:
    """JSON equality: bools are not numbers, 1 == 1.0."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    return type(a) is type(b) and a == b


def _is_off(value, offs: tuple) -> bool:
    return value is None or any(_same(value, o) for o in offs)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class KvmeshOptions(_Strict):
    reuse: Literal["approximate", "exact", "none"] | None = None
    template: StrictStr | None = None  # a template id of the tenant (tenants file or POST /v1/templates)
    params: dict[StrictStr, StrictStr] | None = None  # the template's parameter values


class StreamOptions(_Strict):
    include_usage: StrictBool | None = False
    continuous_usage_stats: StrictBool | None = False  # with include_usage: every chunk carries the usage so far
    include_obfuscation: StrictBool | None = None  # OpenAI pads chunks against length side channels: no effect here


class JsonSchemaFormat(_Strict):
    name: Annotated[str, Field(strict=True, min_length=1, max_length=64)]
    description: StrictStr | None = None
    schema_: dict[StrictStr, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


def _unsupported_fields(names) -> dict:
    """Pydantic field definitions that accept only null or the field's neutral values (schema)."""
    out = {}
    for name in names:
        _, offs = UNSUPPORTED.get(name) or CHAT_ONLY_UNSUPPORTED[name]
        typ = Literal[offs] if offs else None  # type: ignore[valid-type]
        out[name] = (typ | None if offs else type(None), None)
    return out


class _Body(_Strict):
    """Fields shared by completions and chat (OpenAI names; vLLM's extensions where noted)."""

    model: StrictStr
    max_tokens: _int(ge=0) | None = None
    temperature: _num(0, 2) | None = None
    top_p: _num(gt=0, le=1) | None = None
    top_k: _int(ge=-1) | None = None  # vLLM extension; 0 or -1 = off
    min_p: _num(0, 1) | None = None  # vLLM extension
    stop: StopString | Annotated[list[StopString], Field(max_length=4)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=64)] | None = None  # vLLM extension
    seed: StrictInt | None = None  # choice i of a request uses seed + i
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    n: _int(ge=1, le=MAX_N) | None = 1
    presence_penalty: _num(-2, 2) | None = None
    frequency_penalty: _num(-2, 2) | None = None
    repetition_penalty: _num(gt=0, le=2) | None = None  # vLLM extension
    logit_bias: Annotated[dict[TokenIdKey, _num(-100, 100)], Field(
        max_length=1024, json_schema_extra={"additionalProperties": False})] | None = None  # token id -> bias
    ignore_eos: StrictBool | None = False  # vLLM extension
    min_tokens: _int(ge=0) | None = None  # vLLM extension: no EOS / stop before this many tokens
    include_stop_str_in_output: StrictBool | None = False  # vLLM extension
    return_tokens_as_token_ids: StrictBool | None = None  # vLLM extension: logprob tokens as "token_id:<id>"
    response_format: ResponseFormat | None = None  # (completions: vLLM extension)
    # harmless metadata, accepted and without effect
    user: StrictStr | None = None
    metadata: dict[StrictStr, StrictStr] | None = None
    store: Literal[False] | None = None  # true would ask us to keep the completion: we keep nothing
    service_tier: Literal["auto", "default"] | None = None
    parallel_tool_calls: StrictBool | None = None  # without tools (rejected) it has no effect
    # a routing hint for OpenAI's cache: kvmesh routes by the prompt's cached prefix itself
    prompt_cache_key: Annotated[str, Field(strict=True, max_length=1024)] | None = None
    safety_identifier: Annotated[str, Field(strict=True, max_length=1024)] | None = None  # an end user's id
    kvmesh: KvmeshOptions | None = None
    # vLLM extension: names the response (id "cmpl-<request_id>"); engine ids stay the server's own
    request_id: Annotated[str, Field(strict=True, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:-]+$")] | None = None
    # vLLM's per-user cache isolation: requests with different salts never share KV
    cache_salt: StrictStr | None = Field(None, min_length=1, max_length=256)

    @property
    def is_stream(self) -> bool:
        return bool(self.stream)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's rule: per-chunk usage needs include_usage as well."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)

    @property
    def num_choices(self) -> int:
        return self.n or 1

    def check(self) -> None:
        """Cross-field rules the field types cannot say."""
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options is only allowed with stream: true", param="stream_options")
        rf = self.response_format
        if rf is not None and rf.type == "json_schema" and (rf.json_schema is None or rf.json_schema.schema_ is None):
            raise ApiError(400, "response_format json_schema needs json_schema: {name, schema}",
                           param="response_format.json_schema")

    def sampling(self, max_tokens: int) -> dict:
        """Arguments for engine.sequence.SamplingParams (which validates ranges); only fields the
        request sets, so an engine without a feature only sees the requests that use it."""
        d: dict = {"max_tokens": max_tokens}
        if self.ignore_eos:
            d["ignore_eos"] = True
        if self.min_tokens:
            d["min_tokens"] = self.min_tokens
        if self.include_stop_str_in_output and self.stop:
            d["include_stop_str"] = True
        for name in ("temperature", "top_p", "min_p", "seed", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            v = getattr(self, name)
            if v is not None:
                d[name] = float(v) if name != "seed" else v
        if self.top_k is not None:
            d["top_k"] = 0 if self.top_k == -1 else self.top_k  # vLLM: -1 = off
        if self.stop:
            d["stop"] = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if self.stop_token_ids:
            d["stop_token_ids"] = tuple(self.stop_token_ids)
        if self.logit_bias:
            d["logit_bias"] = tuple(sorted((int(k), float(v)) for k, v in self.logit_bias.items()))
        for name in ("presence_penalty", "frequency_penalty", "min_p"):
            if d.get(name) == 0.0:
                del d[name]  # the default: no need to require the engine feature
        if d.get("repetition_penalty") == 1.0:
            del d["repetition_penalty"]
        rf = self.response_format
        if rf is not None and rf.type != "text":
            d["grammar"] = ("json_schema", json.dumps(rf.json_schema.schema_)) if rf.type == "json_schema" \
                else ("json_object", None)
        return d


class CompletionBody(_Body):
    prompt: StrictStr | Annotated[list[StrictStr], Field(min_length=1, max_length=MAX_PROMPTS)] | \
        Annotated[list[StrictInt], Field(min_length=1)] | \
        Annotated[list[Annotated[list[StrictInt], Field(min_length=1)]], Field(min_length=1, max_length=MAX_PROMPTS)]
    echo: StrictBool | None = False
    logprobs: _int(ge=0, le=MAX_LOGPROBS) | None = None
    best_of: _int(ge=1, le=MAX_N) | None = None
    add_special_tokens: StrictBool | None = True  # vLLM extension: BOS etc. for text prompts

    def prompts(self) -> list[str | list[int]]:
        """The prompts of this request, each a text or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [list(p)]
        return list(p)

    @property
    def engine_n(self) -> int:
        """Choices asked of the engine per prompt: best_of when it exceeds n."""
        return max(self.num_choices, self.best_of or 1)

    def check(self) -> None:
        super().check()
        if self.best_of is not None and self.best_of < self.num_choices:
            raise ApiError(400, f"best_of ({self.best_of}) must be >= n ({self.num_choices})", param="best_of")
        if self.engine_n > self.num_choices and self.stream:
            raise ApiError(400, "best_of > n cannot be streamed", param="best_of")
        if self.max_tokens == 0 and not self.echo:
            raise ApiError(400, "max_tokens must be >= 1 (0 is allowed only with echo, to score the prompt)",
                           param="max_tokens")
        if len(self.prompts()) * self.engine_n > MAX_PROMPTS * 4:
            raise ApiError(400, f"at most {MAX_PROMPTS * 4} choices (prompts x max(n, best_of)) per request",
                           param="n")


class ContentPart(_Strict):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | list[ContentPart] | None = None
    name: StrictStr | None = None  # accepted (OpenAI: participant name); templates here ignore it
    tool_calls: None = None
    tool_call_id: None = None
    function_call: None = None
    refusal: None = None
    audio: None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class _ChatFields(_Body):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: _int(ge=1) | None = None
    logprobs: StrictBool | None = False
    top_logprobs: _int(ge=0, le=MAX_LOGPROBS) | None = None
    add_generation_prompt: StrictBool | None = True  # vLLM extension
    continue_final_message: StrictBool | None = False  # vLLM extension

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def check(self) -> None:
        super().check()
        if self.max_tokens == 0:
            raise ApiError(400, "max_tokens must be >= 1", param="max_tokens")
        if self.top_logprobs and not self.logprobs:
            raise ApiError(400, "top_logprobs requires logprobs: true", param="top_logprobs")
        if self.continue_final_message and self.add_generation_prompt:
            raise ApiError(400, "continue_final_message needs add_generation_prompt: false",
                           param="continue_final_message")

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


_COMMON_UNSUPPORTED = list(UNSUPPORTED)
_CompletionUnsupported = create_model("_CompletionUnsupported", __base__=CompletionBody,
                                      **_unsupported_fields(_COMMON_UNSUPPORTED))
_ChatUnsupported = create_model("_ChatUnsupported", __base__=_ChatFields,
                                **_unsupported_fields(list(_COMMON_UNSUPPORTED) + list(CHAT_ONLY_UNSUPPORTED)))


class CompletionRequest(_CompletionUnsupported):  # type: ignore[misc, valid-type]
    """POST /v1/completions."""


class ChatRequest(_ChatUnsupported):  # type: ignore[misc, valid-type]
    """POST /v1/chat/completions."""


ChatBody = ChatRequest  # the name the ingress used before


class TemplateBody(_Strict):
    """POST /v1/templates: a template of the caller's tenant."""

    id: Annotated[str, Field(strict=True, min_length=1)]
    template: Annotated[str, Field(strict=True, min_length=1)]


class TokenizeBody(_Strict):
    """POST /tokenize (vLLM): a prompt, or chat messages rendered with the chat template."""

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: StrictBool | None = None  # default: true for a prompt, false for messages
    add_generation_prompt: StrictBool | None = True
    continue_final_message: StrictBool | None = False
    return_token_strs: StrictBool | None = False

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ApiError(400, "send exactly one of prompt and messages", param="prompt")


class DetokenizeBody(_Strict):
    """POST /detokenize (vLLM)."""

    model: StrictStr | None = None
    tokens: list[StrictInt]

    def check(self) -> None:
        pass


def _unsupported(data: dict, fields: dict) -> None:
    for name, value in data.items():
        spec = fields.get(name)
        if spec is not None and not _is_off(value, spec[1]):
            raise ApiError(400, f"{name} is not supported by kvmesh: {spec[0]}", param=name,
                           code="unsupported_parameter")


def _message_unsupported(data: dict) -> None:
    msgs = data.get("messages")
    if not isinstance(msgs, list):
        return
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            continue
        if m.get("role") in ("tool", "function"):
            raise ApiError(400, f"messages[{i}]: {m['role']} messages are not supported by kvmesh (no tool calling)",
                           param=f"messages.{i}.role", code="unsupported_parameter")
        for k in ("tool_calls", "tool_call_id", "function_call", "audio"):
            if m.get(k) is not None:
                raise ApiError(400, f"messages[{i}].{k} is not supported by kvmesh (no tool calling / audio)",
                               param=f"messages.{i}.{k}", code="unsupported_parameter")
        content = m.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                if isinstance(part, dict) and part.get("type") not in (None, "text"):
                    raise ApiError(400, f"messages[{i}].content[{j}]: {part.get('type')!r} parts are not supported "
                                   "by kvmesh (text only)", param=f"messages.{i}.content", code="unsupported_parameter")


def parse_body(raw: bytes, cls: type[BaseModel]) -> BaseModel:
    """Parse and validate a JSON body; malformed JSON, wrong types, unsupported or unknown fields
    → ApiError(400) naming the field."""
    try:
        data = safe_json.loads(raw)  # bounded depth, no NaN/Infinity, UTF-8-clean strings
    except safe_json.BadJson as e:
        raise ApiError(400, str(e)) from None
    if not isinstance(data, dict):
        raise ApiError(400, "the body must be a JSON object")
    if cls is ChatRequest:
        _unsupported(data, {**{k: UNSUPPORTED[k] for k in _COMMON_UNSUPPORTED}, **CHAT_ONLY_UNSUPPORTED})
        _message_unsupported(data)
    elif cls is CompletionRequest:
        _unsupported(data, {k: UNSUPPORTED[k] for k in _COMMON_UNSUPPORTED})
    try:
        body = cls.model_validate(data)
    except ValidationError as e:
        errors = e.errors()
        unknown = [err for err in errors if err.get("type") == "extra_forbidden"]
        if unknown:
            loc = ".".join(str(x) for x in unknown[0].get("loc", ()))
            raise ApiError(400, f"unknown field {loc[:100]!r}", param=loc[:100], code="unknown_parameter") from None
        # the most specific error: a union's "wrong type" for each member says least
        err = next((x for x in errors if not x.get("type", "").endswith("_type")), errors[0])
        loc = ".".join(str(x) for x in err.get("loc", ()) if not _is_union_tag(x))
        raise ApiError(400, f"invalid field {loc[:100]!r}: {str(err.get('msg'))[:200]}", param=loc[:100] or None) from None
    check = getattr(body, "check", None)
    if check is not None:
        check()
    return body


_FIELD = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _is_union_tag(x) -> bool:
    """pydantic puts the tried union member in ``loc`` (``'str'``, ``'list[int]'``, ``'literal[...]'``):
    not a field name."""
    return isinstance(x, str) and (x in ("str", "int", "float", "bool", "none", "list", "dict") or not _FIELD.match(x))


# -- OpenAPI -----------------------------------------------------------------------------------
def _inline(schema: dict) -> dict:
    """The schema with every local ``$ref`` replaced by its definition (no ``$defs`` left), so it
    stands alone inside an OpenAPI document. The bodies here are not recursive."""
    defs = schema.get("$defs", {})

    def walk(node):
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                rest = {k: v for k, v in node.items() if k != "$ref"}
                return walk({**defs[ref.split("/")[-1]], **rest})
            return {k: walk(v) for k, v in node.items() if k != "$defs"}
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    return walk(schema)


def openapi_body(cls: type[BaseModel]) -> dict:
    """``openapi_extra`` for a route that parses ``cls`` from its raw body."""
    schema = _inline(cls.model_json_schema(by_alias=True))
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


# -- response metadata -------------------------------------------------------------------------
@dataclass(frozen=True)
class Served:
    """Where and how a request was served: the ``kvmesh`` object of every response."""

    worker: str
    route: str
    exact_cached_tokens: int
    approx_cached_tokens: int = 0
    pulled_tokens: int = 0
    reuse: str = "exact"
    # why the router chose ``worker``: the placement rule (policies.placement: match, spill,
    # balance, idle, place; None: no placement) and, per worker, the prompt tokens the global index
    # showed held (None: it did not answer in time or was not asked) and the router's own record
    placement: str | None = None
    index_holders: dict | None = None
    routed_holders: dict | None = None
    planned_route: str | None = None  # the router's plan (``route`` is what the worker did: a pull may fail)
    expected_ttft_s: float | None = None  # the router's TTFT estimate of its plan
    options: dict | None = None  # the ranking it chose from (cluster.types.RouteChoice.options)
    pull_outcome: str | None = None  # what the worker's pulls did (landed, partial, skipped_no_room, ...)
    timings: dict | None = None  # where its time to first token went (``stage_timings``)

    def as_dict(self) -> dict:
        return {"worker": self.worker, "route": self.route, "exact_cached_tokens": self.exact_cached_tokens,
                "approx_cached_tokens": self.approx_cached_tokens, "pulled_tokens": self.pulled_tokens,
                "reuse": self.reuse, "placement": self.placement, "index_holders": self.index_holders,
                "routed_holders": self.routed_holders, "planned_route": self.planned_route,
                "expected_ttft_s": None if self.expected_ttft_s is None else round(self.expected_ttft_s, 3),
                "options": self.options, "pull_outcome": self.pull_outcome, "timings": self.timings}


STAGES = ("ttft", "ingress", "lease", "route", "engine_queue", "prefill", "overhead")  # the histogram's


def stage_timings(received: float, built: float, first_at: float, lease_s: float | None, route_s: float | None,
                  engine_ttft_s: float | None, prefill_s: float | None) -> dict:
    """Where a request's time to first token went, in seconds (``perf_counter`` times of the
    ingress: the request ``received``, its engine requests ``built``, its ``first_at`` output):
    ``ingress`` (body, tokenizer, validation), ``lease`` (the controller's admission and routing,
    a round trip from the ingress), ``route`` (of that, the router's choice: index lookup and
    ranking), ``engine_ttft`` (the worker's engine, from being handed the request to its first
    token: waiting for the step in progress to end, for a slot or room, for a pull to land, and
    the prefill) split into ``engine_queue`` and ``prefill`` (the forward passes), ``overhead``
    (the rest: the call to the worker, its pull planning, the output's way back; with no lease,
    as behind Serve's own routers in ``cluster.baselines``, the routing too) and ``ttft`` (the
    whole, at the ingress). A stage not measured is None."""
    ttft = first_at - received
    out = {"ttft": ttft, "ingress": built - received, "lease": lease_s, "route": route_s,
           "engine_ttft": engine_ttft_s, "engine_queue": None, "prefill": prefill_s, "overhead": None}
    if engine_ttft_s is not None and prefill_s is not None:
        out["engine_queue"] = max(0.0, engine_ttft_s - prefill_s)
    if engine_ttft_s is not None:
        out["overhead"] = max(0.0, ttft - out["ingress"] - (lease_s or 0.0) - engine_ttft_s)
    return {f"{k}_s": None if v is None else round(v, 4) for k, v in out.items()}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


DONE = "data: [DONE]\n\n"


def error_event(err: ApiError) -> str:
    return f"data: {json.dumps(err.body())}\n\n"
