"""The OpenAI wire format: request bodies (validated), responses, stream chunks, error bodies.

No Ray, no engine state: the ingress parses a body into a ``CompletionBody``/``ChatBody``, turns
it into an engine ``Request`` and formats ``RequestOutput``s back. Unsupported OpenAI options
(n > 1, echo, logprobs, penalties) are rejected with a 400 rather than silently ignored.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Literal

from cluster import safe_json
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError


class ApiError(Exception):
    """An error with its HTTP status and OpenAI error body."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# -- request bodies ----------------------------------------------------------------------------
class KvmeshOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reuse: Literal["approximate", "exact", "none"] | None = None
    template: StrictStr | None = None  # a template id of the tenant (tenants file or POST /v1/templates)
    params: dict[StrictStr, StrictStr] | None = None  # the template's parameter values


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class _Body(BaseModel):
    # Unknown fields are ignored like OpenAI does for forward compatibility; known-but-unsupported
    # ones are checked in ``unsupported``.
    model_config = ConfigDict(extra="ignore")

    model: StrictStr
    max_tokens: StrictInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = 1
    user: StrictStr | None = None
    ignore_eos: StrictBool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logprobs: object = None
    kvmesh: KvmeshOptions | None = None
    # vLLM's per-user cache isolation: requests with different salts never share KV
    cache_salt: StrictStr | None = Field(None, min_length=1, max_length=256)

    def unsupported(self) -> None:
        if self.n != 1:
            raise ApiError(400, "only n=1 is supported", param="n")
        if self.presence_penalty or self.frequency_penalty:
            raise ApiError(400, "presence_penalty and frequency_penalty are not supported", param="presence_penalty")
        if self.logprobs not in (None, False, 0):
            raise ApiError(400, "logprobs are not supported", param="logprobs")

    def sampling(self, max_tokens: int) -> dict:
        """Arguments for engine.sequence.SamplingParams (which validates ranges)."""
        d: dict = {"max_tokens": max_tokens, "ignore_eos": self.ignore_eos}
        if self.temperature is not None:
            d["temperature"] = self.temperature
        if self.top_p is not None:
            d["top_p"] = self.top_p
        if self.top_k is not None:
            d["top_k"] = self.top_k
        if self.stop is not None:
            d["stop"] = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if self.seed is not None:
            d["seed"] = self.seed
        return d


class CompletionBody(_Body):
    prompt: StrictStr | list[StrictInt] | list[StrictStr]
    echo: StrictBool = False
    suffix: StrictStr | None = None
    best_of: StrictInt | None = None

    def unsupported(self) -> None:
        super().unsupported()
        if self.echo:
            raise ApiError(400, "echo is not supported", param="echo")
        if self.suffix:
            raise ApiError(400, "suffix is not supported", param="suffix")
        if self.best_of not in (None, 1):
            raise ApiError(400, "only best_of=1 is supported", param="best_of")
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str) and len(self.prompt) != 1:
            raise ApiError(400, "batched prompts are not supported: send one prompt per request", param="prompt")


class ContentPart(BaseModel):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatBody(_Body):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def parse_body(raw: bytes, cls: type[_Body]) -> _Body:
    """Parse and validate a JSON body; malformed JSON or wrong types → ApiError(400)."""
    try:
        data = safe_json.loads(raw)  # bounded depth, no NaN/Infinity, UTF-8-clean strings
    except safe_json.BadJson as e:
        raise ApiError(400, str(e)) from None
    if not isinstance(data, dict):
        raise ApiError(400, "the body must be a JSON object")
    try:
        body = cls.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err.get("loc", ()))
        raise ApiError(400, f"invalid field {loc[:100]!r}: {str(err.get('msg'))[:200]}", param=loc[:100] or None) from None
    body.unsupported()
    return body


# -- responses ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Served:
    """Where and how a request was served: the ``kvmesh`` object of every response."""

    worker: str
    route: str
    exact_cached_tokens: int
    approx_cached_tokens: int = 0
    pulled_tokens: int = 0
    reuse: str = "exact"

    def as_dict(self) -> dict:
        return {"worker": self.worker, "route": self.route, "exact_cached_tokens": self.exact_cached_tokens,
                "approx_cached_tokens": self.approx_cached_tokens, "pulled_tokens": self.pulled_tokens,
                "reuse": self.reuse}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _finish(reason: str | None) -> str | None:
    return {"abort": "stop"}.get(reason, reason) if reason else None


def completion_response(rid: str, model: str, text: str, finish_reason: str | None, use: dict,
                        served: Served, chat: bool) -> dict:
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "finish_reason": _finish(finish_reason), "logprobs": None}
    else:
        choice = {"index": 0, "text": text, "finish_reason": _finish(finish_reason), "logprobs": None}
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice], "usage": use, "kvmesh": served.as_dict()}


def chunk(rid: str, model: str, created: int, chat: bool, text: str | None = None, role: bool = False,
          finish_reason: str | None = None, use: dict | None = None, served: Served | None = None,
          no_choices: bool = False) -> str:
    """One SSE event (``data: {...}\\n\\n``)."""
    if no_choices:
        choices = []
    elif chat:
        delta: dict = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choices = [{"index": 0, "delta": delta, "finish_reason": _finish(finish_reason), "logprobs": None}]
    else:
        choices = [{"index": 0, "text": text or "", "finish_reason": _finish(finish_reason), "logprobs": None}]
    obj: dict = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
                 "model": model, "choices": choices}
    if use is not None:
        obj["usage"] = use
    if served is not None:
        obj["kvmesh"] = served.as_dict()
    return f"data: {json.dumps(obj)}\n\n"


DONE = "data: [DONE]\n\n"


def error_event(err: ApiError) -> str:
    return f"data: {json.dumps(err.body())}\n\n"
