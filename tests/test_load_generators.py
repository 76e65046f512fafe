"""The request bodies aiperf 0.13 and guidellm 0.8 send (captured from their runs against kvmesh,
``bench/real_clients.py``; aiperf's readiness probe from its source) are served in full: 200,
the fixed output length they ask for (``ignore_eos`` + ``min_tokens``), the usage they read, and
the SSE framing their parsers expect.

In-process (tests/ingress_harness.py: the real FastAPI ingress over one tiny-llama engine, no Ray).
"""

import json

import httpx
import pytest

from tests.ingress_harness import TINY, make_ingress, pool_idle

AUTH = {"Authorization": "Bearer sk-acme"}
N = 6  # output tokens asked for
PROMPT = "Fetch Desdemona hither. Ancient, conduct them; you best know the place."
MSG = [{"role": "user", "content": PROMPT}]
PARTS = [{"role": "user", "content": [{"type": "text", "text": PROMPT}]}]  # guidellm sends content parts

BODIES = {  # name -> (path, body), as each tool sends it
    "aiperf completions stream": ("/v1/completions", {
        "prompt": PROMPT, "model": TINY, "stream": True, "max_tokens": N, "ignore_eos": True, "min_tokens": N,
        "stream_options": {"include_usage": True}}),
    "aiperf completions": ("/v1/completions", {
        "prompt": PROMPT, "model": TINY, "stream": False, "max_tokens": N, "ignore_eos": True, "min_tokens": N}),
    "aiperf chat stream": ("/v1/chat/completions", {
        "messages": MSG, "model": TINY, "stream": True, "max_completion_tokens": N, "ignore_eos": True,
        "min_tokens": N, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}),
    "aiperf chat": ("/v1/chat/completions", {
        "messages": MSG, "model": TINY, "stream": False, "max_completion_tokens": N, "ignore_eos": True}),
    "aiperf readiness probe": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}],
                                                        "max_tokens": 1, "model": TINY}),
    "guidellm completions stream": ("/v1/completions", {
        "model": TINY, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "max_tokens": N, "stop": None, "ignore_eos": True, "prompt": PROMPT}),
    "guidellm completions": ("/v1/completions", {
        "model": TINY, "max_tokens": N, "stop": None, "ignore_eos": True, "prompt": PROMPT}),
    "guidellm chat stream": ("/v1/chat/completions", {
        "model": TINY, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "max_completion_tokens": N, "stop": None, "ignore_eos": True, "messages": PARTS}),
    "guidellm chat": ("/v1/chat/completions", {
        "model": TINY, "max_completion_tokens": N, "stop": None, "ignore_eos": True, "messages": PARTS}),
}


@pytest.fixture
async def served(tiny_model, monkeypatch):
    app, ing, engine = make_ingress(tiny_model, monkeypatch)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                 timeout=60) as client:
        yield client, engine
    engine.shutdown()


def sse_events(text: str) -> list[str]:
    """The ``data:`` payloads of an SSE body; every event is one ``data:`` line and a blank line."""
    assert text.endswith("\n\n"), text[-80:]
    events = text[:-2].split("\n\n")
    for e in events:
        assert e.startswith("data: ") and "\n" not in e, e[:120]
    return [e[len("data: "):] for e in events]


@pytest.mark.parametrize("name", list(BODIES))
async def test_load_generator_bodies_are_served_as_they_expect(served, name):
    client, engine = served
    path, body = BODIES[name]
    chat = path.endswith("chat/completions")
    want = body.get("max_completion_tokens") or body.get("max_tokens")
    r = await client.post(path, headers=AUTH, json=body)
    assert r.status_code == 200, r.text
    if not body.get("stream"):
        d = r.json()
        assert d["object"] == ("chat.completion" if chat else "text_completion")
        choice = d["choices"][0]
        assert isinstance(choice["message"]["content"] if chat else choice["text"], str)
        assert d["usage"]["completion_tokens"] == want and d["usage"]["prompt_tokens"] > 0
        assert choice["finish_reason"] == "length"
    else:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.text)
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        obj = "chat.completion.chunk" if chat else "text_completion"
        assert all(c["object"] == obj and c["id"] == chunks[0]["id"] for c in chunks)
        last = chunks[-1]  # include_usage: the usage chunk, with no choices, closes the stream
        assert last["choices"] == [] and last["usage"]["completion_tokens"] == want
        finished = [ch for c in chunks for ch in c["choices"] if ch.get("finish_reason")]
        assert [ch["finish_reason"] for ch in finished] == ["length"]
        if body["stream_options"].get("continuous_usage_stats"):
            counts = [c["usage"]["completion_tokens"] for c in chunks]
            assert counts == sorted(counts) and counts[-1] == want
        else:
            assert all(c.get("usage") is None for c in chunks[:-1])
    assert await pool_idle(engine)
