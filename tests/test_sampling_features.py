"""Sampling features of the engine (issue 12): logprobs, prompt logprobs, penalties, logit_bias,
min_p, stop_token_ids, numerically safe sampling, n with forked choices, validation."""

from dataclasses import replace

import pytest
import torch

from engine.llm_engine import EngineConfig, LLMEngine
from engine.sampler import SampleRow, sample
from engine.sequence import InvalidRequest, Request, SamplingParams

TINY = EngineConfig(model="tiny-llama", num_blocks=64, block_size=16, max_num_batched_tokens=64, approx=None)
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


def ids(outs):
    return [t for o in outs for t in o.new_token_ids]


def choices(outs):
    """{choice index: generated ids}."""
    res = {}
    for o in outs:
        res.setdefault(o.index, []).extend(o.new_token_ids)
    return res


def hf_logprobs(model, tokens):
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([tokens])).logits[0].float(), dim=-1)


def assert_pool_clean(engine):
    engine.pool.check_invariants()
    assert engine.pool.num_free_blocks() == engine.pool.num_blocks
    assert all(b.ref_cnt == 0 for b in engine.pool.blocks)
    assert not engine.seqs and not engine.has_unfinished()


@pytest.fixture(scope="module")
def default_engine(default_model):
    return LLMEngine(EngineConfig(num_blocks=256, max_num_batched_tokens=32), loaded=default_model)


# -- logprobs -------------------------------------------------------------------------------
@pytest.mark.model
def test_greedy_logprobs_equal_hf_log_softmax(default_model, default_engine):
    eng = default_engine
    prompt = tuple(eng.encode("The three primary colors are red, blue and"))
    p = SamplingParams(max_tokens=10, temperature=0.0, logprobs=5)
    outs = eng.generate([Request("lp", prompt, p, reuse="none")])["lp"]
    out_ids = ids(outs)
    lps = [lp for o in outs for lp in o.logprobs]
    assert len(lps) == len(out_ids) == 10
    ref = hf_logprobs(default_model.model, list(prompt) + out_ids)
    for i, (tok, lp) in enumerate(zip(out_ids, lps)):
        row = ref[len(prompt) - 1 + i]
        assert lp.token_id == tok == int(row.argmax())
        assert abs(lp.logprob - float(row[tok])) < 1e-4
        top_v, top_i = row.topk(5)
        assert [t for t, _ in lp.top] == top_i.tolist()
        assert max(abs(a - b) for (_, a), b in zip(lp.top, top_v.tolist())) < 1e-4
    assert abs(outs[-1].cumulative_logprob - sum(lp.logprob for lp in lps)) < 1e-4
    assert_pool_clean(eng)


@pytest.mark.model
def test_logprobs_are_the_same_from_cache_recompute_and_pull(default_model, default_engine):
    eng = default_engine
    prompt = tuple(eng.encode("Summarize: the meeting covered the budget, two new hires and the office move. "
                              "Everyone agreed on the budget and the hires. " * 2))
    assert len(prompt) > 32
    p = SamplingParams(max_tokens=6, temperature=0.0, logprobs=3)
    eng.pool.reset_prefix_cache()
    cold = eng.generate([Request("cold", prompt, p)])["cold"]  # computes and registers
    hit = eng.generate([Request("hit", prompt, p)])["hit"]
    none = eng.generate([Request("none", prompt, p, reuse="none")])["none"]
    assert hit[0].num_cached_tokens >= 32 and none[0].num_cached_tokens == 0
    other = LLMEngine(EngineConfig(num_blocks=256, max_num_batched_tokens=32), loaded=default_model)
    req = Request("pulled", prompt, p)
    chains = other.prompt_chains(req)
    n_blocks = len(next(iter(chains.values())))
    data = eng.export_prefix(chains, 0, n_blocks)
    assert other.import_prefix(data, 0, chains, req.tenant) == n_blocks * 16
    pulled = other.generate([req])["pulled"]
    assert pulled[0].num_cached_tokens == n_blocks * 16
    base = [lp for o in cold for lp in o.logprobs]
    for outs in (hit, none, pulled):
        assert ids(outs) == ids(cold)
        got = [lp for o in outs for lp in o.logprobs]
        assert max(abs(a.logprob - b.logprob) for a, b in zip(got, base)) < 1e-4
        assert max(abs(x[1] - y[1]) for a, b in zip(got, base) for x, y in zip(a.top, b.top)) < 1e-4
    assert_pool_clean(eng)
    assert_pool_clean(other)


@pytest.mark.model
def test_prompt_logprobs_equal_hf_and_survive_a_cache_hit(default_model, default_engine):
    eng = default_engine  # max_num_batched_tokens=32: the prompt is computed in chunks
    prompt = tuple(eng.encode("Question: which planet is known as the red planet? Answer: Mars, the fourth "
                              "planet from the sun, is known as the red planet. It has two small moons, Phobos and Deimos."))
    assert len(prompt) > 40
    p = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2)
    ref = hf_logprobs(default_model.model, list(prompt))
    runs = []
    for rid in ("plp1", "plp2"):
        outs = eng.generate([Request(rid, prompt, p)])[rid]
        assert outs[0].num_cached_tokens == 0  # computed, never served from the cache
        plp = outs[0].prompt_logprobs
        assert plp is not None and len(plp) == len(prompt) and plp[0] is None
        assert all(o.prompt_logprobs is None for o in outs[1:])
        for pos in range(1, len(prompt)):
            e = plp[pos]
            assert e.token_id == prompt[pos]
            assert abs(e.logprob - float(ref[pos - 1, prompt[pos]])) < 1e-4
            assert [t for t, _ in e.top] == ref[pos - 1].topk(2).indices.tolist()
        runs.append([e.logprob for e in plp[1:]])
    assert max(abs(a - b) for a, b in zip(*runs)) < 1e-5
    # its blocks were registered: a plain request reuses them
    plain = eng.generate([Request("plain", prompt, GREEDY)])["plain"]
    assert plain[0].num_cached_tokens == (len(prompt) - 1) // 16 * 16
    assert_pool_clean(eng)


# -- numerics and isolation -------------------------------------------------------------------
def test_tiny_temperature_is_greedy_and_never_nan(tiny_model):
    eng = LLMEngine(TINY, loaded=tiny_model)
    prompt = tuple(range(5, 25))
    g = ids(eng.generate([Request("g", prompt, GREEDY)])["g"])
    for t in (1e-39, 1e-8, 9.9e-6):
        p = SamplingParams(max_tokens=8, temperature=t, top_k=3, top_p=0.5, min_p=0.2, seed=1)
        assert ids(eng.generate([Request(f"t{t}", prompt, p)])[f"t{t}"]) == g
    # 1e-5 is sampled (not greedy) but finite: logits / 1e-5 do not overflow
    out = eng.generate([Request("e", prompt, SamplingParams(max_tokens=8, temperature=1e-5, seed=3))])["e"]
    assert out[-1].error is None and len(ids(out)) == 8
    assert_pool_clean(eng)


def test_sampler_fails_only_the_bad_row():
    logits = torch.randn(3, 50)
    logits[1, 7] = float("nan")
    rows = [SampleRow(SamplingParams(temperature=0.0, logprobs=2)), SampleRow(SamplingParams(temperature=0.7)),
            SampleRow(SamplingParams(temperature=1.0, seed=1), torch.Generator().manual_seed(1))]
    res = sample(logits, rows)
    assert res.errors[0] is None and res.errors[2] is None and res.errors[1] is not None
    assert res.tokens[0] == int(logits[0].argmax()) and res.tokens[1] == -1 and 0 <= res.tokens[2] < 50
    assert res.logprobs[0].token_id == res.tokens[0]

    def mask_all(x):  # e.g. a grammar that allows nothing
        x[2] = float("-inf")

    res = sample(torch.randn(3, 50), rows, mask_all)
    assert res.errors[0] is None and res.errors[2] is not None


@pytest.mark.parametrize("temperature", [0.0, 0.5])
def test_a_vanishing_repetition_penalty_samples_a_seen_token_not_an_error(temperature):
    # (0, 2] admits 1e-300, which is 0 in float32: a seen token's positive logit divided by it
    # was inf, and the row had nothing to sample (HTTP 500)
    logits = torch.zeros(1, 50)
    logits[0, 3], logits[0, 9] = 1.0, 2.0  # 9 is the best unseen token; 3 was seen
    row = SampleRow(SamplingParams(temperature=temperature, repetition_penalty=1e-300, seed=0), tokens=[3, 4],
                    num_prompt=2)
    if temperature:
        row.generator = torch.Generator().manual_seed(0)
    res = sample(logits, [row])
    assert res.errors == [None] and res.tokens == [3]  # the penalty < 1 favours what was seen


class _RejectAll:
    """A grammar matcher stand-in that allows no token at all."""

    def fill_next_token_bitmask(self, bitmask, index):
        bitmask[index] = 0

    def accept_token(self, tok):
        return False

    def is_terminated(self):
        return False


def test_a_failing_request_ends_alone_and_the_engine_goes_on(tiny_model):
    eng = LLMEngine(TINY, loaded=tiny_model)
    prompt = tuple(range(3, 30))
    alone = ids(eng.generate([Request("alone", prompt, GREEDY)])["alone"])
    eng.add_request(Request("bad", prompt[:10], SamplingParams(max_tokens=8)))
    eng.seqs["bad"].matcher = _RejectAll()
    eng.add_request(Request("good", prompt, GREEDY))
    res = {"bad": [], "good": []}
    while eng.has_unfinished():
        for o in eng.step():
            res[o.request_id].append(o)
    assert res["bad"][-1].finished and res["bad"][-1].error and res["bad"][-1].finish_reason == "error"
    assert ids(res["good"]) == alone and res["good"][-1].error is None
    assert_pool_clean(eng)


# -- penalties, bias, min_p, stop ids: against a hand-made reference ---------------------------
def reference_greedy(model, prompt, steps, process):
    """Greedy decode with HF forward, ``process(logits, prompt, out)`` applied by hand."""
    out = []
    for _ in range(steps):
        with torch.no_grad():
            row = model(torch.tensor([list(prompt) + out])).logits[0, -1].float().clone()
        out.append(int(process(row, list(prompt), list(out)).argmax()))
    return out


def _freq(row, prompt, out, f=0.0, pr=0.0):
    for t in set(out):
        row[t] -= f * out.count(t) + pr
    return row


def _rep(row, prompt, out, r):
    for t in set(prompt + out):
        row[t] = row[t] / r if row[t] > 0 else row[t] * r
    return row


def _bias(row, prompt, out, bias):
    for t, b in bias:
        row[t] += b
    return row


@pytest.mark.parametrize("name,params,process", [
    ("frequency", dict(frequency_penalty=1.5), lambda r, p, o: _freq(r, p, o, f=1.5)),
    ("presence", dict(presence_penalty=2.0), lambda r, p, o: _freq(r, p, o, pr=2.0)),
    ("negative", dict(frequency_penalty=-0.8, presence_penalty=-0.5), lambda r, p, o: _freq(r, p, o, -0.8, -0.5)),
    ("repetition", dict(repetition_penalty=1.8), lambda r, p, o: _rep(r, p, o, 1.8)),
    ("bias", dict(logit_bias=((40, 5.0), (41, 3.0), (100, -100.0))),
     lambda r, p, o: _bias(r, p, o, ((40, 5.0), (41, 3.0), (100, -100.0)))),
    ("all", dict(frequency_penalty=0.7, presence_penalty=0.3, repetition_penalty=1.3, logit_bias={50: 2.5}),
     lambda r, p, o: _bias(_freq(_rep(r, p, o, 1.3), p, o, 0.7, 0.3), p, o, ((50, 2.5),))),
])
def test_penalties_and_bias_match_a_hand_reference(tiny_model, name, params, process):
    eng = LLMEngine(TINY, loaded=tiny_model)
    prompt = (5, 9, 9, 40, 41, 12, 13, 40, 7)
    plain = ids(eng.generate([Request("plain", prompt, SamplingParams(max_tokens=12, temperature=0.0))])["plain"])
    p = SamplingParams(max_tokens=12, temperature=0.0, **params)
    # with a plain request sharing the batch (its output must not change)
    res = eng.generate([Request("pen", prompt, p), Request("plain2", prompt, SamplingParams(max_tokens=12, temperature=0.0))])
    ref = reference_greedy(tiny_model.model, prompt, 12, process)
    assert ids(res["pen"]) == ref
    assert ids(res["plain2"]) == plain
    assert ref != plain, "the option must change this output (else the test proves nothing)"
    assert_pool_clean(eng)


def test_min_p_keeps_only_tokens_near_the_best(tiny_model):
    eng = LLMEngine(TINY, loaded=tiny_model)
    prompt = tuple(range(10, 30))
    for min_p, expect_violation in ((0.0, True), (0.8, False)):
        p = SamplingParams(max_tokens=40, temperature=1.0, min_p=min_p, logprobs=1, seed=7)
        outs = eng.generate([Request(f"m{min_p}", prompt, p)])[f"m{min_p}"]
        # temperature 1: the raw logprobs are the distribution min_p filters
        ratios = [lp.logprob - lp.top[0][1] for o in outs for lp in o.logprobs]
        violated = any(r < torch.log(torch.tensor(0.8)).item() - 1e-6 for r in ratios)
        assert violated == expect_violation
    assert_pool_clean(eng)


def test_stop_token_ids_stop_at_that_token(tiny_model):
    eng = LLMEngine(TINY, loaded=tiny_model)
    prompt = tuple(range(40, 60))
    full = ids(eng.generate([Request("f", prompt, SamplingParams(max_tokens=12, temperature=0.0))])["f"])
    k = next(i for i, t in enumerate(full) if i >= 2 and t not in full[:i])
    outs = eng.generate([Request("s", prompt, SamplingParams(max_tokens=12, temperature=0.0,
                                                             stop_token_ids=(full[k],)))])["s"]
    assert ids(outs) == full[: k + 1] and outs[-1].finish_reason == "stop"
    assert_pool_clean(eng)


def test_min_tokens_masks_eos_and_stop_ids_until_reached_then_they_stop(tiny_model):
    eng = LLMEngine(TINY, loaded=tiny_model)
    prompt = tuple(range(40, 60))
    eos = min(eng.eos_ids)
    full = ids(eng.generate([Request("f", prompt, SamplingParams(max_tokens=12, temperature=0.0))])["f"])
    stop_id = full[0]  # greedy would stop at once on it
    forced = dict(max_tokens=12, temperature=0.0, logit_bias={eos: 100.0})  # EOS always the argmax
    plain = eng.generate([Request("p", prompt, SamplingParams(**forced))])["p"]
    assert ids(plain) == [eos] and plain[-1].finish_reason == "stop"
    outs = eng.generate([Request("m", prompt, SamplingParams(**forced, min_tokens=5)),
                         Request("s", prompt, SamplingParams(max_tokens=12, temperature=0.0, min_tokens=3,
                                                             stop_token_ids=(stop_id,)))])
    got = ids(outs["m"])
    assert len(got) == 6 and eos not in got[:5] and got[5] == eos and outs["m"][-1].finish_reason == "stop"
    s = ids(outs["s"])
    assert stop_id not in s[:3] and len(s) >= 4 and (s[-1] == stop_id or len(s) == 12)
    assert_pool_clean(eng)


def test_min_tokens_defers_stop_strings_to_text_after_it(tiny_model):
    eng = LLMEngine(TINY, loaded=tiny_model)
    prompt = tuple(range(40, 60))
    full = eng.generate([Request("f", prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))])["f"]
    text = "".join(o.new_text for o in full)
    stop = next((text[i:i + 2] for i in range(len(text) - 1) if text[i:i + 2].strip()), None)
    if stop is None:
        pytest.skip("the tiny model's greedy text has no printable pair")
    first = eng.generate([Request("a", prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                              stop=(stop,)))])["a"]
    cut = "".join(o.new_text for o in first)
    assert cut == text[: text.index(stop)]
    deferred = eng.generate([Request("b", prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                                 stop=(stop,), min_tokens=12))])["b"]
    assert "".join(o.new_text for o in deferred) == text and deferred[-1].finish_reason == "length"
    assert_pool_clean(eng)


def test_plain_outputs_unchanged_by_feature_requests_in_the_batch(tiny_model):
    eng = LLMEngine(TINY, loaded=tiny_model)
    prompts = [tuple(range(3 + i, 23 + 2 * i)) for i in range(4)]
    plain = {f"p{i}": Request(f"p{i}", pr, SamplingParams(max_tokens=10, temperature=0.0)) for i, pr in enumerate(prompts)}
    alone = {rid: ids(o) for rid, o in eng.generate(list(plain.values())).items()}
    extra = [Request("lp", prompts[0], SamplingParams(max_tokens=10, logprobs=5, prompt_logprobs=3, seed=1)),
             Request("pen", prompts[1], SamplingParams(max_tokens=10, frequency_penalty=1.0, logit_bias={7: 50.0})),
             Request("n", prompts[2], SamplingParams(max_tokens=10, n=3, seed=2, min_p=0.1)),
             Request("g", prompts[3], SamplingParams(max_tokens=10, grammar={"kind": "json_object"}))]
    steps = eng.num_steps
    mixed = eng.generate([replace(r, request_id=r.request_id + "b") for r in plain.values()] + extra)
    for rid, want in alone.items():
        assert ids(mixed[rid + "b"]) == want
    # batched together: ~3 prefill steps + 10 decode steps (one at a time would be ~8 x 10)
    assert eng.num_steps - steps <= 16
    assert_pool_clean(eng)


# -- n: forked choices sharing the prompt's blocks ---------------------------------------------
def test_n_choices_prefill_once_seeded_reproduce_and_differ(tiny_model):
    eng = LLMEngine(TINY, loaded=tiny_model)
    prompt = tuple(range(3, 43))  # 40 tokens: 2 full blocks + a partial one (copied per choice)
    p = SamplingParams(max_tokens=6, temperature=1.0, n=4, seed=11, logprobs=0)
    before = eng.num_forward_tokens
    outs = eng.generate([Request("n", prompt, p, reuse="none")])["n"]
    # one prefill (40 tokens) + 4 choices x 5 decodes
    assert eng.num_forward_tokens - before == 40 + 4 * 5
    got = choices(outs)
    assert sorted(got) == [0, 1, 2, 3] and all(len(v) == 6 for v in got.values())
    assert len({tuple(v) for v in got.values()}) > 1
    assert [o.finished for o in outs].count(True) == 1 and outs[-1].finished
    assert sum(o.choice_finished for o in outs) == 4
    again = choices(eng.generate([Request("n2", prompt, p)])["n2"])
    assert again == got
    # choice i uses seed + i: choice 2 equals an n=1 request seeded 13
    one = ids(eng.generate([Request("one", prompt, replace(p, n=1, seed=13))])["one"])
    assert one == got[2]
    assert_pool_clean(eng)


def test_forked_choices_share_full_blocks_and_copy_the_partial_one(tiny_model):
    eng = LLMEngine(TINY, loaded=tiny_model)
    prompt = tuple(range(3, 43))  # 3 blocks, the last partial
    eng.add_request(Request("n", prompt, SamplingParams(max_tokens=4, temperature=0.0, n=3), reuse="none"))
    free0 = eng.pool.num_free_blocks()
    eng.step()  # prefill + fork + first tokens
    group = eng.seqs["n"].group
    assert len(group.choices) == 3
    parent = group.choices[0]
    for c in group.choices[1:]:
        assert [b.block_id for b in c.blocks[:2]] == [b.block_id for b in parent.blocks[:2]]
        assert c.blocks[2].block_id != parent.blocks[2].block_id
    assert all(b.ref_cnt == 3 for b in parent.blocks[:2])
    assert free0 - eng.pool.num_free_blocks() == 3 + 2  # 3 prompt blocks + 2 partial copies
    res = []
    while eng.has_unfinished():
        res += eng.step()
    got = choices(res)
    assert sorted(got) == [0, 1, 2] and len({tuple(v) for v in got.values()}) == 1  # greedy: all equal
    assert_pool_clean(eng)


def test_n_abort_one_choice_then_all_keeps_the_pool_exact(tiny_model):
    eng = LLMEngine(TINY, loaded=tiny_model)
    prompt = tuple(range(3, 43))
    eng.add_request(Request("n", prompt, SamplingParams(max_tokens=30, n=4, seed=0), reuse="none"))
    eng.step()
    used = eng.pool.num_blocks - eng.pool.num_free_blocks()
    assert used == 3 + 3
    out = eng.abort("n", index=2)
    assert out.index == 2 and out.choice_finished and not out.finished and out.finish_reason == "abort"
    assert eng.pool.num_blocks - eng.pool.num_free_blocks() == used - 1  # its partial copy only
    eng.step()
    out = eng.abort("n")
    assert out.finished
    assert_pool_clean(eng)
    assert eng.abort("n") is None


def test_n_under_preemption_and_a_full_pool_finishes_exactly(tiny_model):
    # 10 blocks: a 40-token prompt (3 blocks) x 4 choices growing to 70 tokens cannot all fit
    eng = LLMEngine(replace(TINY, num_blocks=10), loaded=tiny_model)
    prompt = tuple(range(3, 43))
    p = SamplingParams(max_tokens=30, temperature=0.0, n=4, ignore_eos=True)
    outs = eng.generate([Request("n", prompt, p)])["n"]
    got = choices(outs)
    assert all(len(v) == 30 for v in got.values()) and len({tuple(v) for v in got.values()}) == 1
    assert eng.scheduler.num_preemptions > 0
    ref = ids(LLMEngine(TINY, loaded=tiny_model).generate([Request("r", prompt, replace(p, n=1))])["r"])
    assert got[0] == ref
    assert_pool_clean(eng)


# -- validation -----------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [
    dict(n=0), dict(n=65), dict(n=True), dict(logprobs=21), dict(logprobs=-1), dict(prompt_logprobs=1.5),
    dict(presence_penalty=2.5), dict(frequency_penalty=float("nan")), dict(repetition_penalty=0.0),
    dict(repetition_penalty=3.0), dict(min_p=1.5), dict(logit_bias={5: 101.0}), dict(logit_bias={-1: 1.0}),
    dict(logit_bias="x"), dict(stop_token_ids=(1.5,)), dict(stop_token_ids="ab"), dict(temperature=float("inf")),
    dict(min_tokens=-1), dict(min_tokens=17), dict(min_tokens=1.5),
    dict(grammar={"kind": "regex"}), dict(grammar={"kind": "json_schema"}), dict(grammar={"kind": "json_object", "x": 1}),
])
def test_bad_sampling_params_are_invalid_requests(bad):
    with pytest.raises(InvalidRequest):
        SamplingParams(**bad)


def test_engine_validation_leaves_the_pool_untouched(tiny_model):
    eng = LLMEngine(TINY, loaded=tiny_model)
    free = eng.pool.num_free_blocks()
    for p in (SamplingParams(logit_bias={512: 1.0}), SamplingParams(stop_token_ids=(9999,)),
              SamplingParams(grammar={"kind": "json_schema", "schema": '{"type": "objectx"}'}),
              SamplingParams(grammar={"kind": "json_schema", "schema": "not json"})):
        with pytest.raises(InvalidRequest):
            eng.add_request(Request("x", (5, 6, 7), p))
        assert eng.pool.num_free_blocks() == free and not eng.seqs and not eng.has_unfinished()


def test_aborting_a_choice_before_the_fork_skips_only_it(tiny_model):
    eng = LLMEngine(TINY, loaded=tiny_model)
    eng.add_request(Request("n", tuple(range(3, 43)), SamplingParams(max_tokens=3, temperature=0.0, n=4)))
    out = eng.abort("n", index=2)
    assert out.index == 2 and out.choice_finished and out.finish_reason == "abort" and not out.finished
    res = []
    while eng.has_unfinished():
        res += eng.step()
    got = choices(res)
    assert sorted(got) == [0, 1, 3] and all(len(v) == 3 for v in got.values())
    assert res[-1].finished and sum(o.finished for o in res) == 1
    assert_pool_clean(eng)
