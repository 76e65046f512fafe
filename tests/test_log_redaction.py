"""Request data reaches log lines only as a bounded prefix; API keys never.

A long marker string is sent in a prompt, in headers and inside exceptions raised by the
tokenizer and the sampler (the paths that log errors with their messages); a bad API key
carries another marker. Every captured log record (message and traceback text) may hold at
most ``redact``'s bounded prefix of the marker, and no part of the key.
"""

import logging

import httpx
import pytest

from engine.redact import PREFIX_CHARS, describe_exc, redact
from tests.ingress_harness import TINY, make_ingress

CHUNKS = [f"#{i:04d}" for i in range(400)]
MARKER = "".join(CHUNKS)  # 2,000 characters, every 5-character chunk unique
KEY = "sk-LEAKED-KEY-0123456789abcdef"
MAX_LOGGED = 200  # the longest redact() limit used by a log call (describe_exc)


def test_redact_bounds_and_describe_exc():
    assert redact("short") == "short"
    r = redact("x" * 100)
    assert r.startswith("x" * PREFIX_CHARS) and "+68 chars" in r and len(r) < 60
    e = UnicodeEncodeError("utf-8", "\udc80" + "secret" * 100, 0, 1, "surrogates not allowed")
    assert "secret" * 3 not in describe_exc(e) and "secret" * 3 in repr(e)


def logged_chunks(records) -> int:
    worst = 0
    for rec in records:
        text = rec.getMessage() + (rec.exc_text or "") + (str(rec.exc_info[1]) if rec.exc_info else "")
        worst = max(worst, sum(1 for c in CHUNKS if c in text))
        assert "LEAKED-KEY" not in text, rec.getMessage()[:200]
    return worst


async def test_prompts_headers_keys_and_errors_are_never_logged_whole(tiny_model, monkeypatch, caplog):
    caplog.set_level(logging.DEBUG)
    app, ing, engine = make_ingress(tiny_model, monkeypatch)
    real_forward = engine.engine.runner.forward

    def forward(batch):
        if (batch.input_ids == ord("~") + 3).any():  # the failing request's prompt
            raise RuntimeError("kernel choked on " + MARKER)
        return real_forward(batch)

    engine.engine.runner.forward = forward
    headers = {"Authorization": "Bearer sk-acme", "X-Marker": MARKER, "User-Agent": MARKER}
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app, raise_app_exceptions=False),
                                     base_url="http://test", timeout=60) as c:
            ok = await c.post("/v1/completions", headers=headers,
                              json={"model": TINY, "prompt": MARKER[:900], "max_tokens": 2})
            assert ok.status_code == 200
            bad_key = await c.post("/v1/completions", headers={**headers, "Authorization": f"Bearer {KEY}"},
                                   json={"model": TINY, "prompt": MARKER[:900]})
            assert bad_key.status_code == 401 and KEY not in bad_key.text
            failed = await c.post("/v1/completions", headers=headers,
                                  json={"model": TINY, "prompt": "~" + MARKER[:900], "max_tokens": 2})
            assert failed.status_code == 500 and failed.json()["error"]["code"] == "engine_error"
            assert MARKER[:50] not in failed.text

            def encode(text, **_):
                raise ValueError(f"tokenizer cannot handle {text!r}")

            monkeypatch.setattr(ing.tokenizer, "encode", encode)
            broken = await c.post("/v1/completions", headers=headers,
                                  json={"model": TINY, "prompt": MARKER[:900], "max_tokens": 2})
            assert broken.status_code == 500 and MARKER[:50] not in broken.text
    finally:
        engine.shutdown()
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "failed in forward" in messages and "request failed" in messages  # the error paths did log
    assert logged_chunks(caplog.records) <= MAX_LOGGED // 5 + 1
