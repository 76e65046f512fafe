"""The async engine and the worker actor: streaming, abort on cancel, errors reach the caller."""

import asyncio

import pytest

from engine.async_engine import AsyncEngine
from engine.llm_engine import EngineConfig, LLMEngine
from engine.model_loader import ModelLoadError, load_model
from engine.sequence import InvalidRequest, Request, SamplingParams

CFG = EngineConfig(model="tiny-llama", num_blocks=64, max_num_batched_tokens=64)


def req(rid, n=40, max_tokens=8, **kw):
    return Request(rid, tuple(range(3, 3 + n)), SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), **kw)


async def test_streams_all_tokens_concurrently(tiny_model):
    eng = AsyncEngine(CFG, loaded=tiny_model)
    try:
        async def collect(r):
            return [o async for o in eng.generate(r)]

        outs = await asyncio.gather(*(collect(req(f"r{i}", n=20 + i)) for i in range(5)))
        for o in outs:
            assert [x.num_output_tokens for x in o] == list(range(1, 9))
            assert o[-1].finished and o[-1].finish_reason == "length"
        stats = await eng.call(lambda e: e.stats())
        assert stats["free_blocks"] == stats["num_blocks"]
    finally:
        eng.shutdown()


async def test_closing_the_stream_aborts_and_frees_blocks(tiny_model):
    eng = AsyncEngine(CFG, loaded=tiny_model)
    try:
        stream = eng.generate(req("long", max_tokens=500))
        first = await stream.__anext__()
        assert not first.finished
        await stream.aclose()  # client went away
        for _ in range(200):
            s = await eng.call(lambda e: (e.pool.num_free_blocks(), e.pool.num_blocks, len(e.seqs)))
            if s[0] == s[1] and s[2] == 0:
                break
            await asyncio.sleep(0.01)
        assert s[0] == s[1] and s[2] == 0
    finally:
        eng.shutdown()


async def test_invalid_request_raises_to_caller(tiny_model):
    eng = AsyncEngine(CFG, loaded=tiny_model)
    try:
        with pytest.raises(InvalidRequest):
            async for _ in eng.generate(Request("bad", (), SamplingParams(max_tokens=3))):
                pass
        # the engine still serves afterwards
        outs = [o async for o in eng.generate(req("good"))]
        assert outs[-1].finished
    finally:
        eng.shutdown()


def test_model_load_errors_name_what_was_expected(tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        load_model(str(tmp_path / "nope"))
    (tmp_path / "m").mkdir()
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(str(tmp_path / "m"))
    (tmp_path / "m" / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(ModelLoadError, match="unsupported model type 'gpt2'"):
        load_model(str(tmp_path / "m"))
    (tmp_path / "w.bin").write_text("x")
    with pytest.raises(ModelLoadError, match="gguf"):
        load_model(str(tmp_path / "w.bin"))


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_local_directory_models_of_other_families_match_hf(tmp_path, default_model, family):
    """A save_pretrained directory of a Qwen2 / Mistral model loads and decodes like HF generate."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(family, vocab_size=default_model.model.config.vocab_size, hidden_size=64,
                               intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
        if family == "qwen2":
            assert model.model.layers[0].self_attn.q_proj.bias is not None
    model.save_pretrained(tmp_path / family)
    default_model.tokenizer.save_pretrained(tmp_path / family)
    eng = LLMEngine(EngineConfig(model=str(tmp_path / family), num_blocks=32))
    ids = eng.encode("Hello there, how are you doing today?")
    out = eng.generate([Request("q", tuple(ids), SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))])["q"]
    with torch.no_grad():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=10, min_new_tokens=10, do_sample=False)[0, len(ids):]
    assert [t for o in out for t in o.new_token_ids] == ref.tolist()


@pytest.mark.ray
def test_worker_actor_streams_and_cancel_frees_blocks():
    import ray

    from actors.worker import worker_actor_class

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        w = worker_actor_class(num_gpus=0).remote("w0", CFG)
        info = ray.get(w.ready.remote(), timeout=120)
        assert info["worker_id"] == "w0" and info["block_size"] == 16

        async def run():
            outs = [await ref async for ref in w.generate.remote(req("a"))]
            assert outs[-1].finished and len(outs) == 8
            gen = w.generate.remote(req("b", max_tokens=900))
            await gen.__anext__()
            ray.cancel(gen)
            for _ in range(300):
                s = await w.stats.remote()
                if s["free_blocks"] == s["num_blocks"] and s["running"] == 0 and s["waiting"] == 0:
                    return s
                await asyncio.sleep(0.02)
            return s

        s = asyncio.run(run())
        assert s["free_blocks"] == s["num_blocks"] and s["running"] == 0
    finally:
        ray.shutdown()


async def test_a_slow_grammar_compile_does_not_hold_up_other_requests(tiny_model):
    """The compile runs off the engine thread: another request's tokens keep coming while it
    runs (before: the compile ran on the engine thread, between two steps, and no step ran)."""
    import json

    from engine.sequence import GrammarSpec
    from tests.test_grammar import _slow_schema

    eng = AsyncEngine(EngineConfig(model="tiny-llama", num_blocks=128, grammar_compile_cpu_s=1), loaded=tiny_model)
    seen = []
    cache = eng.engine.grammars
    real = cache._compile_checked

    def timed(schema):
        start = len(seen)
        try:
            return real(schema)
        finally:
            window.append(len(seen) - start)

    window: list[int] = []
    cache._compile_checked = timed
    try:
        async def other():
            async for out in eng.generate(Request("long", tuple(range(3, 20)),
                                                  SamplingParams(max_tokens=900, ignore_eos=True, temperature=0.0))):
                seen.extend(out.new_token_ids)

        task = asyncio.create_task(other())
        while not seen:
            await asyncio.sleep(0.01)
        spec = GrammarSpec("json_schema", _slow_schema())
        with pytest.raises(InvalidRequest, match="too complex"):
            async for _ in eng.generate(Request("g", (5, 6, 7), SamplingParams(max_tokens=4, grammar=spec))):
                pass
        ok = GrammarSpec("json_schema", json.dumps({"enum": ["yes", "no"]}))
        outs = [o async for o in eng.generate(Request("h", (5, 6, 7), SamplingParams(max_tokens=4, grammar=ok)))]
        assert outs[-1].finished and outs[-1].error is None
        await task
        assert len(window) == 2 and window[0] > 0, window  # tokens were produced during the slow compile
        assert len(seen) == 900
    finally:
        eng.shutdown()
