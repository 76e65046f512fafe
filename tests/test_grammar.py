"""Structured output (engine/grammar.py): json_object / json_schema through xgrammar masks applied
inside the batched sampler."""

import json

import jsonschema
import pytest

from engine.grammar import GrammarCache
from engine.llm_engine import EngineConfig, LLMEngine
from engine.sequence import GrammarSpec, InvalidRequest, Request, SamplingParams

TINY = EngineConfig(model="tiny-llama", num_blocks=64, block_size=16, max_num_batched_tokens=64, approx=None)


def ids(outs):
    return [t for o in outs for t in o.new_token_ids]


S = lambda **props: {"type": "object", "properties": props, "required": list(props)}  # noqa: E731
STR = {"type": "string", "maxLength": 16}
INT = {"type": "integer", "minimum": 0, "maximum": 1000}
BOOL = {"type": "boolean"}

SCHEMAS = [
    S(name=STR, age={"type": "integer", "minimum": 0, "maximum": 120}),
    S(color={"enum": ["red", "green", "blue"]}),
    S(active=BOOL, admin=BOOL),
    S(tags={"type": "array", "items": STR, "maxItems": 3}),
    S(address=S(street=STR, city=STR, zip={"type": "string", "maxLength": 5})),
    S(id=INT, status={"enum": ["open", "closed", "pending"]}),
    S(title=STR, done=BOOL, priority={"type": "integer", "minimum": 1, "maximum": 5}),
    S(scores={"type": "array", "items": INT, "minItems": 1, "maxItems": 4}),
    S(user=S(name=STR, email={"type": "string", "maxLength": 24}), verified=BOOL),
    S(answer={"enum": ["yes", "no"]}, confidence={"type": "integer", "minimum": 0, "maximum": 100}),
    S(city=STR, population=INT),
    S(point=S(x=INT, y=INT)),
    S(items={"type": "array", "items": S(sku=STR, qty=INT), "maxItems": 2}),
    S(language={"enum": ["python", "rust", "go", "c"]}, typed=BOOL),
    S(first=STR, last=STR, middle={"type": "string", "maxLength": 1}),
    S(matrix={"type": "array", "items": {"type": "array", "items": INT, "maxItems": 2}, "maxItems": 2}),
    S(event=STR, day={"enum": ["mon", "tue", "wed", "thu", "fri"]}, hour={"type": "integer", "minimum": 0, "maximum": 23}),
    S(ok=BOOL, code=INT, message=STR),
    S(meta=S(version=INT, stable=BOOL, owner=S(team=STR))),
    S(animal={"enum": ["cat", "dog"]}, legs={"type": "integer", "minimum": 0, "maximum": 8}, pet=BOOL,
      names={"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2}),
]


@pytest.mark.model
def test_json_schema_outputs_validate_on_20_schemas(default_model):
    assert len(SCHEMAS) == 20
    eng = LLMEngine(EngineConfig(num_blocks=512, max_num_batched_tokens=256), loaded=default_model)
    tok = default_model.tokenizer
    reqs = []
    for i, schema in enumerate(SCHEMAS):
        msgs = [{"role": "user", "content": f"Reply with one JSON object for this schema: {json.dumps(schema)}"}]
        prompt = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        spec = GrammarSpec("json_schema", json.dumps(schema))
        reqs.append(Request(f"s{i}", tuple(eng.encode(prompt)), SamplingParams(max_tokens=160, temperature=0.0,
                                                                             grammar=spec)))
    steps = eng.num_steps
    res = eng.generate(reqs)
    assert eng.num_steps - steps <= 200  # batched, not one request at a time
    for i, schema in enumerate(SCHEMAS):
        outs = res[f"s{i}"]
        assert outs[-1].finish_reason == "stop", (i, tok.decode(ids(outs)))
        text = "".join(o.new_text for o in outs)
        jsonschema.validate(json.loads(text), schema)
    assert eng.grammars.stats["compiled"] == 20
    eng.pool.check_invariants()
    assert eng.pool.num_free_blocks() == eng.pool.num_blocks


def test_tiny_model_grammar_outputs_are_valid_prefixes(tiny_model):
    """The byte tokenizer gets a RAW byte vocabulary: every emitted token is accepted by a fresh
    matcher replaying the output, and a choice that stops is complete JSON."""
    eng = LLMEngine(TINY, loaded=tiny_model)
    spec = GrammarSpec("json_schema", json.dumps(S(a=BOOL, b={"enum": ["x", "yy"]})))
    p = SamplingParams(max_tokens=40, temperature=1.0, seed=3, n=3, grammar=spec)
    outs = eng.generate([Request("g", tuple(range(3, 20)), p), Request("o", (5, 6, 7),
                         SamplingParams(max_tokens=30, grammar=GrammarSpec("json_object"), seed=1))])
    for rid, spec_ in (("g", spec), ("o", GrammarSpec("json_object"))):
        by_choice = {}
        for o in outs[rid]:
            by_choice.setdefault(o.index, []).append(o)
        for cho in by_choice.values():
            m = eng.grammars.matcher(spec_)
            toks = ids(cho)
            assert all(m.accept_token(t) for t in toks)
            assert toks[0] == ord("{") + 3
            if cho[-1].finish_reason == "stop":
                assert m.is_terminated()
                json.loads(tiny_model.tokenizer.decode(toks))
    assert eng.grammars.stats["hits"] >= 2  # compiled once per spec
    assert eng.pool.num_free_blocks() == eng.pool.num_blocks


def test_grammar_cache_is_lru_and_rejects_bad_schemas(tiny_model):
    cache = GrammarCache(tiny_model.tokenizer, 512, {2}, max_entries=2)
    specs = [GrammarSpec("json_schema", json.dumps(S(**{f"k{i}": BOOL}))) for i in range(3)]
    for s in specs:
        cache.compile(s)
    cache.compile(specs[2])
    assert cache.stats == {"compiled": 3, "hits": 1, "refused": 0} and len(cache._compiled) == 2
    cache.compile(specs[0])  # evicted: compiled again
    assert cache.stats["compiled"] == 4
    for bad in ('{"type": "objectx"}', "[1, 2", '{"type": "object", "properties": {"a": {"type": "strin"}}}'):
        with pytest.raises(InvalidRequest) as e:
            cache.compile(GrammarSpec("json_schema", bad))
        assert ".cc:" not in str(e.value) and "/project" not in str(e.value)  # the reason, not xgrammar's source line
    with pytest.raises(InvalidRequest, match=r'cannot be compiled: Unsupported type "objectx"$'):
        cache.compile(GrammarSpec("json_schema", '{"type": "objectx"}'))


def test_a_grammar_that_can_only_end_ends_before_min_tokens(tiny_model):
    """min_tokens bans EOS, a complete grammar allows nothing else: the grammar wins (before: the
    row had no token to draw and the request failed with a 500)."""
    eng = LLMEngine(TINY, loaded=tiny_model)
    spec = GrammarSpec("json_schema", json.dumps({"enum": [1]}))
    outs = eng.generate([Request("g", tuple(range(3, 20)), SamplingParams(max_tokens=16, min_tokens=8,
                                                                          temperature=0.0, grammar=spec))])["g"]
    assert outs[-1].error is None and outs[-1].finish_reason == "stop"
    toks = [t for t in ids(outs) if t not in eng.eos_ids]
    assert tiny_model.tokenizer.decode(toks) == "1"
    # where the grammar leaves a choice (an integer may go on), min_tokens still holds EOS back
    spec = GrammarSpec("json_schema", json.dumps({"type": "integer"}))
    outs = eng.generate([Request("i", tuple(range(3, 20)), SamplingParams(max_tokens=12, min_tokens=6,
                                                                          temperature=0.0, grammar=spec))])["i"]
    assert outs[-1].error is None and len(ids(outs)) >= 6
    assert eng.pool.num_free_blocks() == eng.pool.num_blocks


def _slow_schema(n: int = 1500) -> str:
    """n optional string properties: xgrammar's compile grows much faster than the schema (2,000 of
    them, 98 KB, took 204 CPU-seconds with the default model's tokenizer)."""
    return json.dumps({"type": "object", "properties": {f"field_{i}_{'x' * (i % 7)}": {"type": "string", "maxLength": 20}
                                                        for i in range(n)}})


def test_a_schema_past_the_compile_budget_is_refused_and_the_next_one_compiles(tiny_model):
    cache = GrammarCache(tiny_model.tokenizer, 512, {2}, compile_cpu_s=1)
    try:
        small = GrammarSpec("json_schema", json.dumps(S(a=BOOL)))
        assert cache.compile(small) is not None
        with pytest.raises(InvalidRequest, match="too complex: its grammar did not compile within 1 CPU-seconds") as e:
            cache.compile(GrammarSpec("json_schema", _slow_schema()))
        assert e.value.param == "response_format"
        assert cache._child.stats == {"started": 1, "over_budget": 1} and cache.stats["refused"] == 1
        with pytest.raises(InvalidRequest, match="too complex") as again:  # remembered: no second compile
            cache.compile(GrammarSpec("json_schema", _slow_schema()))
        assert again.value.param == "response_format" and cache.stats["refused"] == 2
        assert cache._child.stats == {"started": 1, "over_budget": 1} and cache._child._proc is None
        other = GrammarSpec("json_schema", json.dumps(S(b=INT)))
        m = cache.matcher(other)  # a new child compiles it; the grammar works in this process
        assert m.accept_string('{"b": 7}') and not m.accept_string('}') and m.accept_token(2) and m.is_terminated()
        assert cache._child.stats["started"] == 2 and cache.cached(small) is not None  # kept across the restart
    finally:
        cache.close()
    assert cache._child is None


def test_schema_length_and_grammar_memory_are_bounded(tiny_model):
    spec = GrammarSpec("json_schema", json.dumps(S(**{f"k{i}": BOOL for i in range(8)})))
    with pytest.raises(InvalidRequest, match=f"has {len(spec.schema)} characters; this server compiles schemas of at most 100$") as e:
        GrammarCache(tiny_model.tokenizer, 512, {2}, max_schema_chars=100, compile_cpu_s=0).compile(spec)
    assert e.value.param == "response_format"
    cache = GrammarCache(tiny_model.tokenizer, 512, {2}, compile_cpu_s=0)
    one = cache.compile(spec)
    size = one.memory_size_bytes
    assert size > 0 and cache.bytes == size
    with pytest.raises(InvalidRequest, match="MiB of token masks"):  # larger than the whole budget: not kept
        GrammarCache(tiny_model.tokenizer, 512, {2}, max_bytes=size - 1, compile_cpu_s=0).compile(spec)
    # kept within max_bytes: the least recently used go first, never the one just compiled
    cache = GrammarCache(tiny_model.tokenizer, 512, {2}, max_bytes=int(2.5 * size), compile_cpu_s=0)
    specs = [GrammarSpec("json_schema", json.dumps(S(**{f"{c}{i}": BOOL for i in range(8)}))) for c in "abcd"]
    for s in specs:
        cache.compile(s)
    assert cache.bytes <= cache.max_bytes and [cache.cached(s) is not None for s in specs] == [False, False, True, True]


def test_an_idle_compile_child_exits_and_the_next_compile_starts_another(tiny_model):
    from engine.grammar_compile import CompileProcess

    info = GrammarCache(tiny_model.tokenizer, 512, {2})._get_info().serialize_json()
    child = CompileProcess(info, cpu_s=5, idle_s=0.5)
    try:
        assert child.compile(json.dumps(S(a=BOOL)), 1 << 30)[0] == "ok"
        first = child._proc
        assert first.wait(timeout=30) == 0  # exited by itself once idle
        kind, _ = child.compile(json.dumps(S(b=BOOL)), 1 << 30)
        assert kind == "ok" and child.stats == {"started": 2, "over_budget": 0}
        assert child.compile('{"type": "nope"}', 1 << 30)[0] == "error"  # xgrammar's refusal is no restart
        assert child.compile(json.dumps(S(c=BOOL)), 1)[0] == "too_big" and child.stats["started"] == 2
    finally:
        child.close()
    assert child.pid is None
