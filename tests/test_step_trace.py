"""engine/step_trace.py: off by default; with a directory, one line per add and per step, tenant
names and counts only (no tokens)."""

import json

from engine.llm_engine import EngineConfig, LLMEngine
from engine.sequence import Request, SamplingParams
from engine.step_trace import ENV


def test_trace_off_by_default_and_on_with_a_directory(tiny_model, tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert not LLMEngine(EngineConfig(model="tiny-llama", num_blocks=32, approx=None), tiny_model).trace.on
    monkeypatch.setenv(ENV, str(tmp_path / "t"))
    eng = LLMEngine(EngineConfig(model="tiny-llama", num_blocks=32, approx=None), tiny_model)
    eng.add_request(Request("r", (5, 6, 7, 8), SamplingParams(max_tokens=2, temperature=0, ignore_eos=True),
                            tenant="acme"))
    while eng.has_unfinished():
        eng.step()
    lines = [json.loads(x) for f in (tmp_path / "t").glob("steps-*.jsonl") for x in f.read_text().splitlines()]
    assert [r["ev"] for r in lines] == ["add", "step", "first", "step"]
    add, first = lines[0], lines[2]
    assert (add["tenant"], add["n"], add["prompt"], add["running"], add["waiting"]) == ("acme", 0, 4, 0, 0)
    # the first token's line names the same request by its number: engine-side TTFT = t - add's t
    assert first["n"] == 0 and first["cached"] == 0 and first["t"] >= add["t"] and first["prefill_s"] >= 0
    steps = [r for r in lines if r["ev"] == "step"]
    assert [r["tok"] for r in steps] == [{"acme": 4}, {"acme": 1}]
    assert all(r["interrupted"] is False and r["dt"] >= 0 and 0 <= r["cpu"] for r in steps)
    # a second request added while the first is still decoding sees it running; one aborted
    # before its first token leaves no number behind
    eng.add_request(Request("r2", (5, 6, 7, 8, 9), SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
                            tenant="acme"))
    eng.step()
    eng.add_request(Request("r3", (1, 2), SamplingParams(max_tokens=2), tenant="acme"))
    eng.abort("r3")
    assert eng.trace._ids == {}
    while eng.has_unfinished():
        eng.step()
    lines = [json.loads(x) for f in (tmp_path / "t").glob("steps-*.jsonl") for x in f.read_text().splitlines()]
    adds = [r for r in lines if r["ev"] == "add"]
    assert [(r["n"], r["running"]) for r in adds] == [(0, 0), (1, 0), (2, 1)]
    # no token ids or request ids: only these fields, with tenant names and counts
    assert {k for r in lines for k in r} <= {"ev", "t", "tenant", "dt", "cpu", "tok", "rows", "interrupted", "waiting",
                                              "n", "prompt", "running", "cached", "prefill_s", "preempted", "room"}
    assert all(r["preempted"] == r["room"] == 0 for r in steps)  # preemptions so far: none in a 32-block pool


def test_a_step_with_waiting_requests_says_why_they_wait(tiny_model, tmp_path, monkeypatch):
    """``held``: waiting requests by reason (``Scheduler.held_back``): no room in the pool, a
    pull still landing; with the pool's free blocks."""
    monkeypatch.setenv(ENV, str(tmp_path / "t"))
    eng = LLMEngine(EngineConfig(model="tiny-llama", num_blocks=12, approx=None, max_num_batched_tokens=256),
                    tiny_model)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    eng.add_request(Request("a", tuple(3 + i % 200 for i in range(100)), params, tenant="acme"))  # 7 of 12 blocks
    eng.add_request(Request("b", tuple(9 + i % 190 for i in range(100)), params, tenant="acme"))  # 7 more: no room
    eng.expect_pull("c", {})
    eng.add_request(Request("c", (5, 6, 7), params, tenant="acme"))  # its KV is still landing
    eng.step()
    assert eng.scheduler.held_back() == {"room": 1, "pull": 1}
    eng.pull_landed("c")
    while eng.has_unfinished():
        eng.step()
    steps = [json.loads(x) for f in (tmp_path / "t").glob("steps-*.jsonl") for x in f.read_text().splitlines()
             if '"step"' in x]
    first = steps[0]
    assert first["held"] == {"room": 1, "pull": 1} and 0 <= first["free_blocks"] < 7
    assert all("held" not in s for s in steps if not s["waiting"])
