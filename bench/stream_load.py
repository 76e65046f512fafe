"""A bounded async HTTP client for the kvmesh app (bench/faults.py, bench/soak.py).

``stream_one`` sends one streaming completion and classifies how it ended:

* ``ok``      stream ended with ``[DONE]`` and a finish reason (the text is compared by the caller)
* ``error``   a clear OpenAI error: a non-200 status with an ``{"error": {...}}`` body, or an
              in-band error event followed by ``[DONE]``; ``kind`` = ``"<status>:<code>"``
* ``lost``    anything else the client cannot act on: connection refused/reset, a body that is not
              an OpenAI error, a stream cut before ``[DONE]`` (``kind`` names which)
* ``hung``    no end within ``deadline_s``
* ``cancelled`` the client itself disconnected mid-stream (soak's random disconnects)

Every request is bounded by ``deadline_s``; nothing here retries.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import httpx

WORDS = ("the of and to in is was for on that with as by at from his her an were are which this be or had not but "
         "what all when we there can one their has been if more will would who so no out up into them time than then "
         "some could these two may first only new now other its over also any like our after most even made many "
         "before must through back years where much your way well down should because each just those people how too "
         "little state good very make world still own see men work long get here between both life being under never "
         "day same another know while last might us great old year off come since against go came right used take "
         "three system river garden music engine winter letter market city paper window ocean forest signal").split()


def make_prompts(n_prefixes: int, per_prefix: int, prefix_words: int, seed: int = 13) -> list[str]:
    """``n_prefixes`` shared "system" paragraphs x ``per_prefix`` short questions each."""
    rng = random.Random(seed)
    out = []
    for p in range(n_prefixes):
        prefix = f"System {p}: " + " ".join(rng.choice(WORDS) for _ in range(prefix_words)) + ".\n"
        for q in range(per_prefix):
            out.append(prefix + f"Question {q}: " + " ".join(rng.choice(WORDS) for _ in range(8)) + "?\nAnswer:")
    return out


@dataclass
class Outcome:
    tag: str  # free label of the caller (phase, tenant, prompt index)
    prompt_ix: int
    t_start: float
    t_end: float = 0.0
    status: str = "lost"  # ok | error | lost | hung | cancelled
    kind: str = ""
    http_status: int = 0
    text: str = ""
    finish_reason: str | None = None
    ttft_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    worker: str | None = None
    route: str | None = None
    extra: dict = field(default_factory=dict)


def _error_kind(status: int, raw: bytes) -> tuple[str, str]:
    """(status, kind) of a non-200 answer: ``error`` when it is an OpenAI error body."""
    try:
        err = json.loads(raw)["error"]
        if isinstance(err, dict) and "message" in err:
            return "error", f"{status}:{err.get('code') or err.get('type')}"
    except Exception:  # noqa: BLE001 - not JSON / not the OpenAI shape
        pass
    return "lost", f"{status}:non_openai_body"


async def stream_one(client: httpx.AsyncClient, url: str, key: str, body: dict, tag: str, prompt_ix: int,
                     deadline_s: float, disconnect_after_chunks: int | None = None) -> Outcome:
    o = Outcome(tag, prompt_ix, time.monotonic())

    async def run() -> None:
        async with client.stream("POST", url, json=body, headers={"Authorization": f"Bearer {key}"}) as r:
            o.http_status = r.status_code
            if r.status_code != 200:
                o.status, o.kind = _error_kind(r.status_code, await r.aread())
                if r.status_code == 429:
                    o.extra["retry_after"] = r.headers.get("retry-after")
                return
            text, err, done, chunks = [], None, False, 0
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                j = json.loads(data)
                if "error" in j:
                    err = j["error"]
                    continue
                if o.ttft_s is None:
                    o.ttft_s = time.monotonic() - o.t_start
                for ch in j.get("choices") or ():
                    text.append(ch.get("text") or (ch.get("delta") or {}).get("content") or "")
                    o.finish_reason = ch.get("finish_reason") or o.finish_reason
                u = j.get("usage")
                if u:
                    o.prompt_tokens = u.get("prompt_tokens", 0)
                    o.cached_tokens = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                if j.get("kvmesh"):
                    o.worker, o.route = j["kvmesh"].get("worker"), j["kvmesh"].get("route")
                chunks += 1
                if disconnect_after_chunks is not None and chunks >= disconnect_after_chunks:
                    o.status, o.kind = "cancelled", "client_disconnect"
                    return  # leaving the context closes the connection mid-stream
            o.text = "".join(text)
            if err is not None:
                o.status = "error" if done else "lost"
                o.kind = f"inband:{err.get('code') or err.get('type')}" + ("" if done else ":no_done")
            elif done and o.finish_reason:
                o.status = "ok"
            else:
                o.status, o.kind = "lost", "stream_cut" if not done else "no_finish_reason"

    try:
        await asyncio.wait_for(run(), deadline_s)
    except asyncio.TimeoutError:
        o.status, o.kind = "hung", f"no_end_within_{deadline_s:g}s"
    except httpx.HTTPError as e:
        o.status, o.kind = "lost", type(e).__name__
    except json.JSONDecodeError:
        o.status, o.kind = "lost", "bad_sse_json"
    o.t_end = time.monotonic()
    return o


def summarize(outs: list[Outcome], refs: dict[int, str] | None = None) -> dict:
    """Counts by status and error kind; ``wrong`` = ok outcomes whose text differs from ``refs``."""
    by_status: dict[str, int] = {}
    kinds: dict[str, int] = {}
    wrong = 0
    for o in outs:
        by_status[o.status] = by_status.get(o.status, 0) + 1
        if o.status != "ok":
            kinds[f"{o.status}:{o.kind}"] = kinds.get(f"{o.status}:{o.kind}", 0) + 1
        elif refs is not None and o.prompt_ix in refs and o.text != refs[o.prompt_ix]:
            wrong += 1
    ttfts = sorted(o.ttft_s for o in outs if o.status == "ok" and o.ttft_s is not None)
    pt = sum(o.prompt_tokens for o in outs if o.status == "ok")
    return {"requests": len(outs), "by_status": by_status, "errors_by_kind": kinds,
            "wrong_outputs": wrong if refs is not None else None,  # None: outputs not checked
            "lost": by_status.get("lost", 0) + by_status.get("hung", 0),
            "hit_rate": (sum(o.cached_tokens for o in outs if o.status == "ok") / pt) if pt else None,
            "ttft_p50_s": ttfts[len(ttfts) // 2] if ttfts else None,
            "ttft_p99_s": ttfts[min(len(ttfts) - 1, int(len(ttfts) * 0.99))] if ttfts else None}
