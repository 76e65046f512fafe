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
    assert [r["ev"] for r in lines] == ["add", "step", "step"]
    assert lines[0]["tenant"] == "acme"
    assert [r["tok"] for r in lines[1:]] == [{"acme": 4}, {"acme": 1}]
    assert all(r["interrupted"] is False and r["dt"] >= 0 for r in lines[1:])
    # no token ids: only these fields, with tenant names and counts
    assert {k for r in lines for k in r} <= {"ev", "t", "tenant", "dt", "tok", "rows", "interrupted", "waiting"}
