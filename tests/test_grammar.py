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
    assert cache.stats == {"compiled": 3, "hits": 1} and len(cache._compiled) == 2
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
