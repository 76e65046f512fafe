"""The OpenAI surface of issue 12 through the real ``openai`` client against a served app.

Tiny random model (byte tokenizer) except the tests marked ``model`` (the default model: logprobs
against HF ``forward``, ``json_schema`` outputs validated with jsonschema).
"""

import json
import math

import jsonschema
import openai
import pytest
from test_http import TINY, _cached, client, http, server  # noqa: F401 - the served app fixture

from cluster.protocol import CHAT_ONLY_UNSUPPORTED, UNSUPPORTED

pytestmark = pytest.mark.ray
AUTH = {"Authorization": "Bearer sk-acme"}
MSGS = [{"role": "user", "content": "Write one word."}]


def post(server, path, body, key="sk-acme"):
    return http(server).post(path, headers={"Authorization": f"Bearer {key}"}, json=body)


# -- schema, tokenizer routes, field policy -------------------------------------------------------
def test_openapi_describes_every_post_body_and_the_schema_matches_the_route(server):
    spec = http(server).get("/openapi.json").json()
    posts = {p: ops["post"] for p, ops in spec["paths"].items() if "post" in ops}
    assert set(posts) == {"/v1/completions", "/v1/chat/completions", "/v1/templates", "/tokenize", "/detokenize"}
    for path, op in posts.items():
        schema = op["requestBody"]["content"]["application/json"]["schema"]
        assert schema["type"] == "object" and schema["properties"], path
        assert schema["additionalProperties"] is False and "$ref" not in json.dumps(schema), path
    comp = posts["/v1/completions"]["requestBody"]["content"]["application/json"]["schema"]
    chat = posts["/v1/chat/completions"]["requestBody"]["content"]["application/json"]["schema"]
    assert {"prompt", "n", "best_of", "echo", "logprobs", "logit_bias", "stop_token_ids", "min_p"} <= \
        set(comp["properties"])
    assert {"messages", "response_format", "top_logprobs", "max_completion_tokens"} <= set(chat["properties"])
    # what the schema accepts the route accepts, what it rejects the route rejects (400)
    ok = {"model": TINY, "prompt": ["a", "b"], "max_tokens": 2, "stop": ["x"], "user": "u", "store": False}
    jsonschema.validate(ok, comp)
    assert post(server, "/v1/completions", ok).status_code == 200
    for bad in ({"model": TINY, "prompt": "x", "nope": 1}, {"model": TINY, "prompt": "x", "suffix": "s"},
                {"model": TINY, "prompt": "x", "store": True}, {"model": TINY, "prompt": "x", "n": 0}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, comp)
        assert post(server, "/v1/completions", bad).status_code == 400, bad
    jsonschema.validate({"model": TINY, "messages": MSGS, "response_format": {"type": "json_object"}}, chat)


def test_tokenize_detokenize_round_trip_and_chat_tokens_match_usage(server):
    text = "Tokenize me, then put me back together."
    r = post(server, "/tokenize", {"model": TINY, "prompt": text})
    assert r.status_code == 200, r.text
    tok = r.json()
    assert tok["count"] == len(tok["tokens"]) == len(text.encode()) and tok["max_model_len"] == 1024
    back = post(server, "/detokenize", {"model": TINY, "tokens": tok["tokens"]})
    assert back.json() == {"prompt": text}
    chat = post(server, "/tokenize", {"messages": MSGS, "add_generation_prompt": True}).json()
    used = client(server).chat.completions.create(model=TINY, messages=MSGS, max_tokens=1, temperature=0)
    assert chat["count"] == used.usage.prompt_tokens
    strs = post(server, "/tokenize", {"prompt": "ab", "return_token_strs": True}).json()["token_strs"]
    assert strs == ["a", "b"]
    assert post(server, "/tokenize", {"prompt": "x"}, key="sk-wrong").status_code == 401
    assert post(server, "/detokenize", {"tokens": [1]}, key="sk-wrong").status_code == 401
    assert post(server, "/detokenize", {"tokens": [10 ** 9]}).json()["error"]["param"] == "tokens"
    assert post(server, "/tokenize", {"prompt": "x", "messages": MSGS}).status_code == 400
    assert post(server, "/tokenize", {"model": "gpt-9", "prompt": "x"}).status_code == 404
    assert http(server).get("/version").json()["version"]
    info = http(server).get("/tokenizer_info", headers=AUTH).json()
    assert "eos_token" in info and info["model_max_length"] == 1024


def _unsupported_value(name, offs):
    for v in ("on", 7, True, ["x"], {"x": 1}):
        if not any(type(v) is type(o) and v == o for o in offs):
            return v


def test_every_unsupported_field_is_a_400_naming_it(server):
    for endpoint, extra, base in (("/v1/completions", {}, {"model": TINY, "prompt": "x", "max_tokens": 1}),
                                  ("/v1/chat/completions", CHAT_ONLY_UNSUPPORTED, {"model": TINY, "messages": MSGS,
                                                                                    "max_tokens": 1})):
        for name, (_, offs) in {**UNSUPPORTED, **extra}.items():
            r = post(server, endpoint, {**base, name: _unsupported_value(name, offs)})
            assert r.status_code == 400, (endpoint, name, r.text)
            err = r.json()["error"]
            assert err["param"] == name and name in err["message"], (endpoint, name, err)
        for name, (_, offs) in {**UNSUPPORTED, **extra}.items():  # null / the neutral value: accepted
            r = post(server, endpoint, {**base, name: offs[0] if offs else None})
            assert r.status_code == 200, (endpoint, name, r.text)
    c = client(server)
    cases = [lambda: c.completions.create(model=TINY, prompt="x", suffix="y"),
             lambda: c.chat.completions.create(model=TINY, messages=MSGS, tools=[{"type": "function", "function": {
                 "name": "f", "parameters": {"type": "object"}}}]),
             lambda: c.chat.completions.create(model=TINY, messages=MSGS, tool_choice="auto"),
             lambda: c.chat.completions.create(model=TINY, messages=MSGS, functions=[{"name": "f"}]),
             lambda: c.chat.completions.create(model=TINY, messages=MSGS, modalities=["text", "audio"]),
             lambda: c.chat.completions.create(model=TINY, messages=MSGS, audio={"voice": "alloy", "format": "wav"}),
             lambda: c.chat.completions.create(model=TINY, messages=MSGS, prediction={"type": "content", "content": "x"}),
             lambda: c.chat.completions.create(model=TINY, messages=MSGS, web_search_options={}),
             lambda: c.chat.completions.create(model=TINY, messages=MSGS, reasoning_effort="low")]
    names = ["suffix", "tools", "tool_choice", "functions", "modalities", "audio", "prediction", "web_search_options",
             "reasoning_effort"]
    for name, call in zip(names, cases):
        with pytest.raises(openai.BadRequestError) as e:
            call()
        assert e.value.body["param"] == name and e.value.body["code"] == "unsupported_parameter"
    with pytest.raises(openai.BadRequestError) as e:  # tool results and image parts in messages
        c.chat.completions.create(model=TINY, messages=[{"role": "tool", "content": "x", "tool_call_id": "1"}])
    assert e.value.body["param"].startswith("messages.0")
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=TINY, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}])
    assert e.value.body["param"] == "messages.0.content"


def test_unknown_fields_are_400s_and_metadata_is_accepted(server):
    c = client(server)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=TINY, prompt="x", extra_body={"frobnicate": 1})
    assert e.value.body["param"] == "frobnicate" and e.value.body["code"] == "unknown_parameter"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=TINY, messages=[{"role": "user", "content": "x", "colour": "red"}])
    assert e.value.body["param"] == "messages.0.colour"
    r = c.chat.completions.create(model=TINY, messages=MSGS, max_tokens=2, user="u-1", metadata={"k": "v"},
                                  store=False, service_tier="auto", parallel_tool_calls=False)
    assert r.usage.completion_tokens == 2
    for bad in ({"store": True}, {"service_tier": "flex"}, {"stream_options": {"include_usage": True}}):
        r = post(server, "/v1/chat/completions", {"model": TINY, "messages": MSGS, **bad})
        assert r.status_code == 400 and r.json()["error"]["param"].split(".")[0] == next(iter(bad)), r.text
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=TINY, messages=MSGS, top_logprobs=2)  # needs logprobs: true
    assert e.value.body["param"] == "top_logprobs"


# -- sampling fields ----------------------------------------------------------------------------
PROMPT = "Batch me, sample me, score me: "


def _greedy(c, prompt=PROMPT, **kw):
    return c.completions.create(model=TINY, prompt=prompt, temperature=0, **{"max_tokens": 12, **kw})


def _ids(lp) -> list[int]:
    """Token ids of a logprobs object asked with return_tokens_as_token_ids."""
    return [int(t.split(":")[1]) for t in lp.tokens]


IDS = {"return_tokens_as_token_ids": True}


def test_batched_prompts_one_choice_per_prompt_text_and_ids(server):
    c = client(server)
    prompts = [PROMPT + "one", PROMPT + "two", "three"]
    alone = [_greedy(c, p).choices[0].text for p in prompts]
    r = _greedy(c, prompts)
    assert [ch.index for ch in r.choices] == [0, 1, 2] and [ch.text for ch in r.choices] == alone
    assert r.usage.prompt_tokens == sum(len(p.encode()) for p in prompts) and r.usage.completion_tokens == 36
    assert len(r.model_extra["kvmesh"]["prompts"]) == 3
    ids = [[b + 3 for b in p.encode()] for p in prompts]  # the byte tokenizer's ids
    assert [ch.text for ch in _greedy(c, ids).choices] == alone
    chunks = list(_greedy(c, prompts, stream=True, stream_options={"include_usage": True}))
    texts = ["".join(ch.choices[0].text for ch in chunks if ch.choices and ch.choices[0].index == i) for i in range(3)]
    assert texts == alone and chunks[-1].usage.completion_tokens == 36 and not chunks[-1].choices


def test_stop_strings_and_stop_token_ids(server):
    c = client(server)
    base = _greedy(c, max_tokens=16).choices[0].text
    cut = next(i for i in range(2, len(base)) if base[i] not in base[:i] and base[i].isascii()
               and base[i].isprintable())  # its first occurrence is at i
    r = _greedy(c, max_tokens=16, stop=["\x00never", base[cut]])
    assert r.choices[0].text == base[:cut] and r.choices[0].finish_reason == "stop"
    r = _greedy(c, max_tokens=16, stop=[base[cut]], extra_body={"include_stop_str_in_output": True})
    assert r.choices[0].text == base[: cut + 1] and r.choices[0].finish_reason == "stop"
    tid = base[cut].encode()[0] + 3
    r = _greedy(c, max_tokens=16, extra_body={"stop_token_ids": [tid]})
    assert r.choices[0].finish_reason == "stop" and base.startswith(r.choices[0].text)
    assert len(r.choices[0].text) <= cut + 1


def test_min_tokens_defers_stops_and_is_bounded_by_max_tokens(server):
    c = client(server)
    base = _greedy(c, max_tokens=16, extra_body={"ignore_eos": True}).choices[0].text
    cut = next(i for i in range(2, len(base)) if base[i] not in base[:i] and base[i].isascii()
               and base[i].isprintable())
    r = _greedy(c, max_tokens=16, stop=[base[cut]], extra_body={"ignore_eos": True, "min_tokens": 16})
    assert r.choices[0].text == base and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 16
    bad = post(server, "/v1/completions", {"model": TINY, "prompt": "x", "max_tokens": 4, "min_tokens": 5})
    assert bad.status_code == 400 and "min_tokens" in bad.json()["error"]["message"]


def test_client_request_id_names_the_response_and_may_repeat(server):
    import concurrent.futures

    c = client(server)
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        rs = list(ex.map(lambda _: _greedy(c, max_tokens=4, extra_body={"request_id": "job-7.a:1"}), range(2)))
    assert [r.id for r in rs] == ["cmpl-job-7.a:1"] * 2 and rs[0].choices[0].text == rs[1].choices[0].text
    chat = c.chat.completions.create(model=TINY, messages=MSGS, max_tokens=2, extra_body={"request_id": "x1"})
    assert chat.id == "chatcmpl-x1"
    bad = post(server, "/v1/completions", {"model": TINY, "prompt": "x", "max_tokens": 1, "request_id": "a b"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "request_id"


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(server):
    c = client(server)
    chunks = list(_greedy(c, max_tokens=6, stream=True, extra_body={"ignore_eos": True},
                          stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert all(ch.usage is not None for ch in chunks)
    done = [ch.usage.completion_tokens for ch in chunks]
    assert done == sorted(done) and done[-1] == 6 and chunks[-1].choices == []
    assert len({ch.usage.prompt_tokens for ch in chunks}) == 1
    chat = list(c.chat.completions.create(model=TINY, messages=MSGS, max_tokens=3, stream=True,
                                          stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert all(ch.usage is not None for ch in chat) and chat[-1].usage.completion_tokens == chat[-2].usage.completion_tokens
    plain = list(_greedy(c, max_tokens=3, stream=True, stream_options={"include_usage": True}))
    assert [ch.usage is not None for ch in plain] == [False] * (len(plain) - 1) + [True]


def test_n_with_seed_reproduces_and_choice_i_uses_seed_plus_i(server):
    c = client(server)
    kw = dict(model=TINY, prompt=PROMPT, max_tokens=10, temperature=1.0)
    a = c.completions.create(n=3, seed=5, **kw)
    b = c.completions.create(n=3, seed=5, **kw)
    assert [ch.index for ch in a.choices] == [0, 1, 2]
    assert [ch.text for ch in a.choices] == [ch.text for ch in b.choices]
    assert a.choices[1].text == c.completions.create(n=1, seed=6, **kw).choices[0].text
    assert a.usage.completion_tokens == 30 and a.usage.prompt_tokens == len(PROMPT.encode())
    chunks = list(c.completions.create(n=3, seed=5, stream=True, stream_options={"include_usage": True}, **kw))
    got = ["".join(ch.choices[0].text for ch in chunks if ch.choices and ch.choices[0].index == i) for i in range(3)]
    assert got == [ch.text for ch in a.choices] and chunks[-1].usage.completion_tokens == 30
    finals = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert sorted(f.index for f in finals) == [0, 1, 2]
    chat = c.chat.completions.create(model=TINY, messages=MSGS, n=2, seed=3, max_tokens=4, temperature=1.0)
    assert [ch.index for ch in chat.choices] == [0, 1] and chat.usage.completion_tokens == 8
    # any int64 seed, as OpenAI and vLLM accept: a negative one seeds (seed mod 2**64)
    neg = c.completions.create(n=2, seed=-5, **kw)
    assert [ch.text for ch in neg.choices] == [ch.text for ch in c.completions.create(n=2, seed=-5, **kw).choices]
    assert neg.choices[0].text == c.completions.create(n=1, seed=2 ** 64 - 5, **kw).choices[0].text


def test_best_of_picks_by_cumulative_logprob_and_cannot_stream(server):
    c = client(server)
    kw = dict(model=TINY, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=11)
    r = c.completions.create(best_of=4, n=2, **kw)
    assert [ch.index for ch in r.choices] == [0, 1] and all(ch.logprobs is None for ch in r.choices)
    every = c.completions.create(n=4, logprobs=0, **kw)
    ranked = sorted(every.choices, key=lambda ch: -sum(ch.logprobs.token_logprobs))
    assert [ch.text for ch in r.choices] == [ch.text for ch in ranked[:2]]
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(best_of=3, n=1, stream=True, **kw)
    assert e.value.body["param"] == "best_of"


def test_completion_logprobs_shape_greedy_and_streaming_equal(server):
    c = client(server)
    r = _greedy(c, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 12
    if all(t.isascii() for t in lp.tokens):  # (a lone byte of a multi-byte character decodes to U+FFFD)
        assert "".join(lp.tokens) == r.choices[0].text
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert val <= 0 and math.isclose(val, max(top.values()), abs_tol=1e-6) and tok in top and len(top) <= 4
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(12)]
    again = _greedy(c, logprobs=3)  # its prompt now comes from the prefix cache: the same logprobs
    assert _cached(again) > 0 and again.choices[0].logprobs.token_logprobs == pytest.approx(lp.token_logprobs, abs=1e-4)
    chunks = list(_greedy(c, logprobs=3, stream=True))
    streamed = [v for ch in chunks if ch.choices and ch.choices[0].logprobs for v in ch.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(lp.token_logprobs, abs=1e-5)


def test_echo_with_logprobs_scores_the_prompt_consistently_with_generation(server):
    c = client(server)
    gen = _greedy(c, logprobs=1, max_tokens=8, extra_body=IDS)
    whole = post(server, "/tokenize", {"prompt": PROMPT}).json()["tokens"] + _ids(gen.choices[0].logprobs)
    text = post(server, "/detokenize", {"tokens": whole}).json()["prompt"]
    for _ in range(2):  # prompt logprobs compute the whole prompt (no prefix hit): the same numbers twice
        s = c.completions.create(model=TINY, prompt=whole, max_tokens=0, echo=True, logprobs=1, temperature=0,
                                 extra_body=IDS)
        ch = s.choices[0]
        assert ch.text == text and s.usage.completion_tokens == 0 and ch.finish_reason == "length"
        lp = ch.logprobs
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and _ids(lp) == whole
        assert len(lp.tokens) == s.usage.prompt_tokens == len(whole)
        # the prompt's scores of the generated tokens equal the logprobs they were generated with
        assert lp.token_logprobs[-8:] == pytest.approx(gen.choices[0].logprobs.token_logprobs, abs=1e-4)
    e = c.completions.create(model=TINY, prompt=PROMPT, max_tokens=3, echo=True, temperature=0)
    assert e.choices[0].text == PROMPT + _greedy(c, max_tokens=3).choices[0].text
    chunks = list(c.completions.create(model=TINY, prompt=PROMPT, max_tokens=3, echo=True, logprobs=0,
                                       temperature=0, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == e.choices[0].text


def test_logit_bias_forces_and_bans_tokens(server):
    c = client(server)
    z = ord("z") + 3
    r = _greedy(c, max_tokens=5, logit_bias={str(z): 100})
    assert r.choices[0].text == "zzzzz"
    first = _ids(_greedy(c, max_tokens=1, logprobs=0, extra_body=IDS).choices[0].logprobs)[0]
    banned = _ids(_greedy(c, max_tokens=1, logprobs=0, extra_body=IDS, logit_bias={str(first): -100})
                  .choices[0].logprobs)[0]
    assert banned != first
    with pytest.raises(openai.BadRequestError) as e:
        _greedy(c, logit_bias={"not-a-token": 1})
    assert e.value.body["param"] == "logit_bias"
    with pytest.raises(openai.BadRequestError):
        _greedy(c, logit_bias={"99999999": 1})  # out of the vocabulary


def test_penalties_reach_the_engine_and_min_p_one_is_greedy(server):
    c = client(server)
    prompts = ["aaaa aaaa aaaa", "abcabcabcabc", PROMPT]
    base = [_greedy(c, p, max_tokens=24).choices[0].text for p in prompts]
    for kw in ({"presence_penalty": 2.0}, {"frequency_penalty": 2.0}, {"extra_body": {"repetition_penalty": 2.0}}):
        got = [_greedy(c, p, max_tokens=24, **kw).choices[0].text for p in prompts]
        assert got != base, kw  # penalising repeats changes some greedy output of a looping model
    for bad in ({"presence_penalty": 3}, {"frequency_penalty": -3}, {"extra_body": {"repetition_penalty": 0}},
                {"extra_body": {"min_p": 2}}):
        with pytest.raises(openai.BadRequestError):
            _greedy(c, **bad)
    sampled = c.completions.create(model=TINY, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=1,
                                   extra_body={"min_p": 1.0})
    assert sampled.choices[0].text == _greedy(c).choices[0].text  # only the most likely token survives


def test_chat_logprobs_top_logprobs_max_completion_tokens_stream(server):
    c = client(server)
    kw = dict(model=TINY, messages=MSGS, temperature=0, logprobs=True, top_logprobs=3, max_completion_tokens=6)
    r = c.chat.completions.create(**kw)
    assert r.usage.completion_tokens == 6
    content = r.choices[0].logprobs.content
    assert len(content) == 6
    if all(t.token.isascii() for t in content):
        assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token
        assert t.bytes == list(t.token.encode()) and t.logprob == pytest.approx(t.top_logprobs[0].logprob)
    chunks = list(c.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    streamed = [t for ch in chunks if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]
    assert chunks[-1].usage.completion_tokens == 6 and _cached(chunks[-1]) > 0
    plain = c.chat.completions.create(model=TINY, messages=MSGS, temperature=0, max_completion_tokens=6)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == r.choices[0].message.content


# -- the default model: logprobs vs HF forward, json_schema outputs -------------------------------
@pytest.fixture(scope="module")
def smol(server):
    from cluster.app import build_app

    server["serve"].run(build_app({"model": "default", "tenants": server["tenants"], "kv_cache_bytes": 64 << 20,
                                   "worker_num_cpus": 0}), name="smol-api", route_prefix="/smol-api")
    yield client(server, prefix="/smol-api")
    server["serve"].delete("smol-api")


@pytest.mark.model
def test_greedy_logprobs_equal_hf_log_softmax(smol, default_model):
    import torch

    tok, model = default_model.tokenizer, default_model.model
    prompt = "The three primary colours are"
    r = smol.completions.create(model="default", prompt=prompt, max_tokens=6, temperature=0, logprobs=2, echo=True)
    lp = r.choices[0].logprobs
    ids = tok(prompt)["input_ids"]
    with torch.no_grad():
        gen = model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False)[0].tolist()
        logits = model(torch.tensor([gen])).logits[0].float()
    ref = torch.log_softmax(logits, dim=-1)
    assert len(lp.token_logprobs) == len(gen)
    for i in range(1, len(gen)):
        assert lp.token_logprobs[i] == pytest.approx(ref[i - 1, gen[i]].item(), abs=1e-4), i
    assert r.choices[0].text == prompt + tok.decode(gen[len(ids):], skip_special_tokens=True)


SCHEMAS = [
    {"type": "object", "properties": {"answer": {"type": "boolean"}}, "required": ["answer"],
     "additionalProperties": False},
    {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}, "n": {"type": "integer",
     "minimum": 0, "maximum": 9}}, "required": ["colour", "n"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 1, "maxItems": 3},
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}}, "required": ["name"],
     "additionalProperties": False},
]


@pytest.mark.model
@pytest.mark.parametrize("i", range(len(SCHEMAS)))
def test_json_schema_outputs_validate(smol, i):
    schema = SCHEMAS[i]
    msgs = [{"role": "user", "content": f"Answer in JSON matching this schema: {json.dumps(schema)}"}]
    rf = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": i % 2 == 0}}
    r = smol.chat.completions.create(model="default", messages=msgs, response_format=rf, max_tokens=60, temperature=0)
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    chunks = list(smol.chat.completions.create(model="default", messages=msgs, response_format=rf, max_tokens=60,
                                               temperature=0, stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == r.choices[0].message.content and chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.model
def test_json_object_and_completions_response_format(smol):
    r = smol.chat.completions.create(model="default", messages=[{"role": "user", "content": "Give a JSON object."}],
                                     response_format={"type": "json_object"}, max_tokens=80, temperature=0)
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    schema = SCHEMAS[1]
    c = smol.completions.create(model="default", prompt="JSON: ", max_tokens=40, temperature=0,
                                extra_body={"response_format": {"type": "json_schema",
                                                                "json_schema": {"name": "c", "schema": schema}}})
    jsonschema.validate(json.loads(c.choices[0].text), schema)
    with pytest.raises(openai.BadRequestError) as e:  # a schema the grammar compiler (on the worker) rejects
        smol.chat.completions.create(model="default", messages=MSGS, max_tokens=4, response_format={
            "type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "no-such-type"}}})
    assert e.value.param == "response_format"  # the engine's field, kept across Ray
