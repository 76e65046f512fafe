"""Bounds on what one HTTP request may make the ingress do before it reaches a worker.

All limits derive from the served model (its context ``max_model_len`` and its tokenizer):

* ``max_body_bytes``: a body longer than this is refused with a 413 before it is parsed
  (``read_body`` checks Content-Length, then counts the bytes as they stream in);
* ``max_prompt_chars``: prompt text longer than ``max_model_len`` tokens of the tokenizer's
  longest token could never fit the context, so it is refused (400, context_length_exceeded)
  before tokenizing; shorter text longer than ``ENCODE_INLINE_CHARS`` is tokenized on a thread,
  never on the event loop;
* templates (``check_template``): an id of at most ``MAX_TEMPLATE_ID_CHARS`` characters, a text
  of at most ``MAX_TEMPLATE_CHARS``, both valid UTF-8; the controller bounds how many templates
  one tenant keeps (``cluster.controller.TEMPLATES_PER_TENANT``).
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster.protocol import ApiError
from cluster.safe_json import utf8_clean

ENCODE_INLINE_CHARS = 2048  # longer prompt text is tokenized off the event loop
MAX_TEMPLATE_ID_CHARS = 128
MAX_TEMPLATE_CHARS = 64 * 1024


@dataclass(frozen=True)
class InputLimits:
    max_body_bytes: int
    max_prompt_chars: int

    @staticmethod
    def derive(max_model_len: int, tokenizer, max_body_bytes: int | None = None) -> "InputLimits":
        body = max_body_bytes if max_body_bytes is not None else (2 << 20) + 64 * max_model_len
        return InputLimits(int(body), max_model_len * max_token_chars(tokenizer))

    def check_chars(self, n: int, max_model_len: int, param: str) -> None:
        if n > self.max_prompt_chars:
            raise ApiError(400, f"the prompt has {n} characters, more than any {max_model_len}-token context can "
                           f"hold ({self.max_prompt_chars}); this model's context is {max_model_len} tokens",
                           code="context_length_exceeded", param=param)


def max_token_chars(tokenizer) -> int:
    """Characters of the longest token (an upper bound on characters per token; at least 1).
    Byte-level BPE vocabularies spell each byte as one character, so this also bounds bytes."""
    n = _vocab_size(tokenizer)
    toks = None
    convert = getattr(tokenizer, "convert_ids_to_tokens", None)
    if convert is not None:
        try:
            toks = [t for t in convert(list(range(n))) if isinstance(t, str)]
        except Exception:  # noqa: BLE001 - fall back to decoding
            toks = None
    if toks is None:
        toks = [tokenizer.decode([i]) for i in range(min(n, 1 << 17))]
    return max(1, max((len(t) for t in toks), default=1))


def _vocab_size(tokenizer) -> int:
    try:
        return int(len(tokenizer))
    except TypeError:
        return int(tokenizer.vocab_size)


async def read_body(req, limit: int) -> bytes:
    """The request body, or ApiError 413 once it exceeds ``limit`` bytes (never read whole)."""
    declared = req.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    async for chunk in req.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is larger than {limit} bytes", code="request_too_large")


def check_template(template_id: str, text: str) -> None:
    """ApiError 400 unless the id and text are within the limits and valid UTF-8."""
    if len(template_id) > MAX_TEMPLATE_ID_CHARS:
        raise ApiError(400, f"a template id has at most {MAX_TEMPLATE_ID_CHARS} characters", param="id")
    if len(text) > MAX_TEMPLATE_CHARS:
        raise ApiError(400, f"a template has at most {MAX_TEMPLATE_CHARS} characters", param="template")
    if not (utf8_clean(template_id) and utf8_clean(text)):
        raise ApiError(400, "template ids and texts must be valid Unicode text (no lone surrogates)", param="id")
