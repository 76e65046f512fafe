"""Workload generators, the Mooncake trace reader, the infinite-cache oracle and the load
generator (against an in-process fake OpenAI server: no model, no Ray)."""

import asyncio
import json
from pathlib import Path

import pytest

from bench import loadgen
from bench.workloads import (TINY_VOCAB, TenantMix, TraceScale, Vocab, WorkItem, block_chain, generate_mooncake,
                             multi_tenant, multi_tenant_tenants, multi_turn, oracle_hits, read_mooncake,
                             shared_prefix, write_mooncake)

TRACE = Path(__file__).resolve().parents[1] / "bench" / "traces" / "mooncake_small.jsonl"


def test_shared_prefix_shape_and_oracle_matches_the_issue_figure():
    items = shared_prefix(groups=4, users=6, system_len=600, question_len=40, output_len=16, seed=1)
    assert len(items) == 24 and {w.group for w in items} == {"g0", "g1", "g2", "g3"}
    assert all(len(w.prompt_ids) == 640 and w.max_tokens == 16 for w in items)
    by_group = {}
    for w in items:
        by_group.setdefault(w.group, []).append(w.prompt_ids)
    for prompts in by_group.values():  # one system prompt per group, distinct questions
        assert len({p[:600] for p in prompts}) == 1 and len({p[600:] for p in prompts}) == 6
    assert len({p[0][:600] for p in by_group.values()}) == 4
    hits = oracle_hits(items, 16)
    # the first request of each group misses; the others reuse the 37 full blocks (592 tokens)
    assert sorted(hits) == [0] * 4 + [592] * 20 and sum(hits) == 11840
    assert shared_prefix(seed=1) == shared_prefix(seed=1) and shared_prefix(seed=1) != shared_prefix(seed=2)


def test_shared_prefix_arrivals_and_order():
    burst = shared_prefix(groups=2, users=3, shuffle=False)
    assert [w.group for w in burst] == ["g0"] * 3 + ["g1"] * 3 and all(w.at_s == 0 for w in burst)
    timed = shared_prefix(groups=2, users=50, rate_per_s=10.0, seed=3)
    ts = [w.at_s for w in timed]
    assert ts == sorted(ts) and 5.0 < ts[-1] < 20.0  # ~100 arrivals at 10/s
    with pytest.raises(ValueError):
        shared_prefix(groups=0)


def test_multi_turn_prompts_are_the_conversation_so_far():
    items = multi_turn(sessions=3, turns=4, system_len=32, user_len=8, output_len=5, seed=0)
    for s in ("s0", "s1", "s2"):
        turns = [w.prompt_ids for w in items if w.session == s]
        assert len(turns) == 4
        for a, b in zip(turns, turns[1:]):
            assert b[:len(a)] == a and len(b) == len(a) + 5 + 8  # reply + next user turn
    hits = dict(zip(map(id, items), oracle_hits(items, 16)))
    for s in ("s0", "s1", "s2"):
        turns = [w for w in items if w.session == s]
        for prev, w in zip(turns, turns[1:]):  # every full block of the previous prompt is reused
            assert hits[id(w)] >= len(prev.prompt_ids) // 16 * 16
    assert sorted(hits[id(w)] for w in items if w.session and w is items[0]) == [0]  # the very first misses


def test_multi_tenant_mix_zipf_grant_and_tenants_file():
    mix = (TenantMix("a", 2.0, prefixes=6, prefix_len=64), TenantMix("b", 1.0, prefixes=3, prefix_len=64,
                                                                         reads_from="a", borrow_p=0.6),
           TenantMix("c", 1.0, prefixes=10, prefix_len=48, zipf_s=1.2))
    items = multi_tenant(requests=600, rate_per_s=20.0, tenants=mix, question_len=8, seed=4)
    tenants = {w.tenant for w in items}
    assert tenants == {"a", "b", "c"}
    ts = [w.at_s for w in items]
    assert ts == sorted(ts) and 15 < ts[-1] < 45
    groups_c = [w.group for w in items if w.tenant == "c"]
    assert groups_c.count("c/p0") > groups_c.count("c/p9") * 2  # Zipf: the head is popular
    borrowed = [w for w in items if w.tenant == "b" and w.group.startswith("a/")]
    assert borrowed and all(w.read_domains == ("a",) and w.domain == "b" for w in borrowed)
    # the grant matters to the oracle: b's borrowed prompts hit a's blocks
    hits = oracle_hits(items, 16)
    assert sum(h for w, h in zip(items, hits) if w in borrowed) > 0
    no_grant = [WorkItem(w.prompt_ids, w.max_tokens, w.at_s, w.tenant, w.domain) for w in items]
    assert sum(oracle_hits(no_grant, 16)) < sum(hits)
    f = multi_tenant_tenants(mix)
    assert {t["name"]: t["share_with"] for t in f["tenants"]} == {"a": ["b"], "b": [], "c": []}
    with pytest.raises(ValueError):
        multi_tenant(tenants=(TenantMix("x", reads_from="nobody"),))


def test_oracle_is_block_aligned_per_domain_and_never_the_last_token():
    v = Vocab(1000, 10)
    p = tuple(range(10, 10 + 48))  # exactly 3 blocks
    a = WorkItem(p, 1, domain="d1")
    assert oracle_hits([a, a], 16) == [0, 32]  # never the last token: 2 of 3 blocks
    longer = WorkItem(p + (99,), 1, domain="d1")
    assert oracle_hits([a, longer], 16) == [0, 48]
    other = WorkItem(p + (99,), 1, domain="d2")
    assert oracle_hits([a, other], 16) == [0, 0]  # isolated domains
    partial = WorkItem(p[:20] + (7,) * 30, 1, domain="d1")
    assert oracle_hits([a, partial], 16) == [0, 16]  # a block that differs mid-way does not count
    assert len(block_chain(p, 16)) == 3 and block_chain(p, 16) != block_chain(p[::-1], 16)
    assert all(10 <= t < 1000 for t in v.seeded("k", 50)) and v.seeded("k", 5) == v.seeded("k", 5)


def test_mooncake_reader_scales_and_shares_prefixes(tmp_path):
    recs = [{"timestamp": 1000, "input_length": 1024, "output_length": 300, "hash_ids": [1, 2]},
            {"timestamp": 3000, "input_length": 1300, "output_length": 5, "hash_ids": [1, 2, 3]},
            {"timestamp": 2000, "input_length": 200, "output_length": 7, "hash_ids": [9]}]
    path = tmp_path / "t.jsonl"
    write_mooncake(recs, path)
    items = read_mooncake(path, TraceScale(tokens_per_hash=16, time_scale=0.5, max_output_tokens=64))
    assert [w.at_s for w in items] == [0.0, 0.5, 1.0]  # sorted, first at 0, half speed
    first, third = items[0], items[2]
    assert len(first.prompt_ids) == 32 and first.max_tokens == 64  # 2 hash blocks of 16; output capped
    assert len(third.prompt_ids) == 41 and third.prompt_ids[:32] == first.prompt_ids  # ceil(1300*16/512)
    assert len(items[1].prompt_ids) == 7  # ceil(200 * 16 / 512)
    assert oracle_hits(items, 16) == [0, 0, 32]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 1, "input_length": 5}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        read_mooncake(bad)


def test_shipped_mooncake_trace_reads_and_has_reuse():
    recs = [json.loads(line) for line in TRACE.read_text().splitlines()]
    assert len(recs) >= 100 and all(set(r) == {"timestamp", "input_length", "output_length", "hash_ids"} for r in recs)
    assert recs == generate_mooncake()  # the file is the seeded generator's output
    items = read_mooncake(TRACE, TraceScale(tokens_per_hash=16, max_requests=120))
    assert len(items) == 120
    hits, total = sum(oracle_hits(items, 16)), sum(len(w.prompt_ids) for w in items)
    assert 0.3 < hits / total < 0.99


# -- load generator against a fake server -----------------------------------------------------
def _fake_server():
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI()
    seen = []

    @app.post("/v1/completions")
    async def completions(req: Request):
        body = await req.json()
        seen.append(body)
        if req.headers.get("authorization") != "Bearer sk-a":
            return JSONResponse({"error": {"message": "bad key"}}, status_code=401)
        n = body["max_tokens"]

        async def sse():
            for i in range(n):
                await asyncio.sleep(0.001)
                yield f"data: {json.dumps({'choices': [{'index': 0, 'text': 'x'}]})}\n\n"
            use = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n,
                   "prompt_tokens_details": {"cached_tokens": 16}}
            yield f"data: {json.dumps({'choices': [], 'usage': use, 'kvmesh': {'worker': 'w1', 'route': 'local'}})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream")

    return app, seen


@pytest.mark.parametrize("mode", ["closed", "open"])
def test_loadgen_measures_streams_and_is_bounded(mode):
    import httpx

    app, seen = _fake_server()
    items = shared_prefix(groups=2, users=4, system_len=20, question_len=4, output_len=3, vocab=TINY_VOCAB,
                          tenant="a")
    keys = {"a": "sk-a"}
    res = asyncio.run(loadgen.run("http://fake", items, keys, "m", mode=mode, concurrency=2, rate_per_s=200.0,
                                  max_requests=6, transport=httpx.ASGITransport(app=app)))
    assert len(res) == 6 and len(seen) == 6 and all(r.ok for r in res)
    assert sorted(r.index for r in res) == list(range(6))  # bounded: the first 6 items, each once
    assert sorted(b["prompt"] for b in seen) == sorted(list(w.prompt_ids) for w in items[:6])
    assert all(b["stream"] and b["stream_options"]["include_usage"] for b in seen)
    r = res[0]
    assert r.ttft_s is not None and r.ttft_s <= r.latency_s and r.tpot_s is not None
    assert (r.completion_tokens, r.cached_tokens, r.worker, r.route) == (3, 16, "w1", "local")
    s = loadgen.summarize(res, ttft_slo_s=60.0)
    assert s["ok"] == 6 and s["cached_tokens"] == 96 and s["per_worker"] == {"w1": 6}
    assert s["ttft_s"]["p50"] <= s["ttft_s"]["p99"] and s["goodput"] == s["request_throughput"]


def test_loadgen_reports_errors_per_request():
    import httpx

    app, _ = _fake_server()
    items = shared_prefix(groups=1, users=2, system_len=8, question_len=2, output_len=2, vocab=TINY_VOCAB, tenant="b")
    res = asyncio.run(loadgen.run("http://fake", items, {"b": "sk-wrong"}, "m", transport=httpx.ASGITransport(app=app)))
    assert len(res) == 2 and all(r.status == 401 and not r.ok and "bad key" in r.error for r in res)
    assert loadgen.summarize(res)["errors"] == 2
    assert loadgen.percentile([1, 2, 3, 4], 50) == 2.5 and loadgen.percentile([], 90) is None
