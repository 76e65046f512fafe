"""The worker engine: HF-exact greedy outputs, batching, chunked prefill, preemption, bad input."""

import numpy as np
import pytest
import torch

from engine.llm_engine import EngineConfig, LLMEngine
from engine.sequence import InvalidRequest, Request, SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "List three colors:",
    "Translate to French: I would like a cup of coffee, please.",
    "Q: What is 12 times 7?\nA:",
    "The quick brown fox",
    "import numpy as np\n\n# compute the mean of an array\n",
    "Write a haiku about the sea.",
    "Dear customer, thank you for your order. Unfortunately,",
    "In 1969, the first humans",
    "Photosynthesis is the process by which",
    "SELECT name, age FROM users WHERE",
    "The three laws of thermodynamics are",
    "Recipe for pancakes:\n1.",
    "Message: I loved this movie!\nLabel: positive\n\nMessage: The food was cold.\nLabel:",
    "A list of prime numbers: 2, 3, 5, 7,",
    "Summarize: The meeting covered budget planning for next year, hiring two engineers, "
    "and moving the office to a larger space downtown. Everyone agreed on the budget. " * 3,
    "<|im_start|>user\nWhat is the tallest mountain?<|im_end|>\n<|im_start|>assistant\n",
    "Hello",
]


def hf_greedy(model, ids, max_new_tokens):
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return out[0, len(ids):].tolist()


def output_ids(outs):
    return [t for o in outs for t in o.new_token_ids]


def assert_pool_clean(engine: LLMEngine):
    """Every block is free or cached-evictable; no reference is held."""
    assert engine.pool.num_free_blocks() == engine.pool.num_blocks
    assert all(b.ref_cnt == 0 for b in engine.pool.blocks)
    assert not engine.seqs and not engine.has_unfinished()


@pytest.fixture(scope="module")
def default_engine(default_model):
    return LLMEngine(EngineConfig(num_blocks=1024, max_num_batched_tokens=256), loaded=default_model)


@pytest.mark.model
def test_greedy_equals_hf_generate_one_at_a_time_and_batched(default_engine, default_model):
    eng = default_engine
    prompts = [eng.encode(p) for p in PROMPTS]
    refs = [hf_greedy(default_model.model, ids, GREEDY.max_tokens) for ids in prompts]
    # one at a time, without prefix caching interfering (reuse none)
    for i, ids in enumerate(prompts):
        res = eng.generate([Request(f"single{i}", tuple(ids), GREEDY, reuse="none")])
        assert output_ids(res[f"single{i}"]) == refs[i], PROMPTS[i]
    # all together: one continuous batch with chunked prefill (budget 256 < total prompt tokens)
    res = eng.generate([Request(f"batch{i}", tuple(ids), GREEDY) for i, ids in enumerate(prompts)])
    for i in range(len(prompts)):
        assert output_ids(res[f"batch{i}"]) == refs[i], PROMPTS[i]
    assert_pool_clean(eng)


@pytest.mark.model
def test_text_and_finish_reasons(default_engine):
    eng = default_engine
    ids = eng.encode("The capital of France is")
    res = eng.generate([Request("t", tuple(ids), SamplingParams(max_tokens=5, temperature=0))])["t"]
    text = "".join(o.new_text for o in res)
    assert text == eng.tokenizer.decode(output_ids(res), skip_special_tokens=True)
    assert res[-1].finished and res[-1].finish_reason == "length"
    assert [o.finished for o in res[:-1]] == [False] * (len(res) - 1)


def tiny_engine(tiny_model, **kw):
    cfg = dict(model="tiny-llama", num_blocks=64, block_size=16, max_num_batched_tokens=512)
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg), loaded=tiny_model)


def prompt(seed, n):
    g = np.random.default_rng(seed)
    return tuple(int(x) for x in g.integers(3, 250, n))


def test_chunked_prefill_and_batching_do_not_change_outputs(tiny_model):
    reqs = lambda: [Request(f"r{i}", prompt(i, 20 + 37 * i), GREEDY) for i in range(6)]  # noqa: E731
    ref = {k: output_ids(v) for k, v in tiny_engine(tiny_model).generate(reqs()).items()}
    # one request at a time
    single = tiny_engine(tiny_model)
    for r in reqs():
        assert output_ids(single.generate([r])[r.request_id]) == ref[r.request_id]
    # tiny token budget: prefills are chunked into 7-token pieces, mixed with decodes
    chunked = tiny_engine(tiny_model, max_num_batched_tokens=7)
    got = {k: output_ids(v) for k, v in chunked.generate(reqs()).items()}
    assert got == ref
    assert chunked.num_steps > single.num_steps / 6
    assert_pool_clean(chunked)


def test_preemption_under_a_small_pool_keeps_outputs(tiny_model):
    reqs = lambda: [Request(f"r{i}", prompt(i, 60), SamplingParams(max_tokens=40, temperature=0)) for i in range(5)]  # noqa: E731
    ref = {k: output_ids(v) for k, v in tiny_engine(tiny_model, num_blocks=128).generate(reqs()).items()}
    small = tiny_engine(tiny_model, num_blocks=12)  # 5 x 100 tokens need 35 blocks
    outs = small.generate(reqs())
    got = {k: output_ids(v) for k, v in outs.items()}
    assert got == ref
    assert small.scheduler.num_preemptions > 0
    # distinct prompts: nothing of any prompt was reused, also after a preempted sequence was
    # resumed on its own cached blocks (it reported them as cached prompt tokens, > the prompt)
    assert all(o.num_cached_tokens == 0 for v in outs.values() for o in v)
    assert_pool_clean(small)


def test_pool_accounting_after_finished_and_aborted_requests(tiny_model):
    eng = tiny_engine(tiny_model, num_blocks=40, max_num_batched_tokens=32)
    for i in range(8):
        eng.add_request(Request(f"r{i}", prompt(i % 3, 45 + i), SamplingParams(max_tokens=10 + i, temperature=0)))
    aborted = set()
    steps = 0
    while eng.has_unfinished():
        eng.step()
        steps += 1
        if steps == 3:
            for rid in ("r1", "r4"):  # mid-prefill / waiting
                assert eng.abort(rid).finish_reason == "abort"
                aborted.add(rid)
        if steps == 9:
            assert eng.abort("r0").finish_reason == "abort"  # mid-decode
            aborted.add("r0")
    assert eng.abort("r0") is None  # aborting twice is harmless
    assert_pool_clean(eng)
    assert eng.pool.eviction.num_evictable() == len(eng.pool._cached)


def test_bad_input_raises_and_leaves_pool_intact(tiny_model):
    eng = tiny_engine(tiny_model, num_blocks=16)  # context 256 tokens
    free = eng.pool.num_free_blocks()
    bad = [
        lambda: Request("a", (), GREEDY),
        lambda: Request("b", prompt(0, 300), GREEDY),
        lambda: Request("c", prompt(0, 250), SamplingParams(max_tokens=10, temperature=0)),
        lambda: Request("d", (5, 6, 10**6), GREEDY),
        lambda: Request("e", (5, 6), GREEDY, reuse="sometimes"),
    ]
    for make in bad:
        with pytest.raises(InvalidRequest):
            eng.add_request(make())
    for kwargs in [dict(max_tokens=0), dict(max_tokens=-3), dict(temperature=-1), dict(temperature=float("nan")),
                   dict(top_p=0), dict(top_p=1.5), dict(top_k=-2), dict(stop=[""]), dict(stop=["a"] * 5),
                   dict(seed="x")]:
        with pytest.raises(InvalidRequest):
            SamplingParams(**kwargs)
    with pytest.raises(InvalidRequest, match="unknown sampling"):
        SamplingParams.from_dict({"max_tokens": 3, "temprature": 0.5})
    eng.add_request(Request("ok", (5, 6, 7), GREEDY))
    with pytest.raises(InvalidRequest, match="duplicate"):
        eng.add_request(Request("ok", (5, 6, 7), GREEDY))
    assert eng.pool.num_free_blocks() == free
    while eng.has_unfinished():
        eng.step()
    assert_pool_clean(eng)


def test_seeded_sampling_is_reproducible_and_varies_with_seed(tiny_model):
    def run(seed):
        eng = tiny_engine(tiny_model)
        p = SamplingParams(max_tokens=20, temperature=1.5, top_p=0.95, top_k=50, seed=seed)
        return output_ids(eng.generate([Request("s", prompt(1, 30), p)])["s"])

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_stop_strings_cut_text_and_finish(tiny_model):
    eng = tiny_engine(tiny_model)
    full = "".join(o.new_text for o in eng.generate([Request("f", prompt(2, 30), SamplingParams(max_tokens=30, temperature=0))])["f"])
    # pick a stop string from the middle of the greedy continuation
    stop = full[5:7]
    assert stop, full
    res = eng.generate([Request("s", prompt(2, 30), SamplingParams(max_tokens=30, temperature=0, stop=[stop]))])["s"]
    text = "".join(o.new_text for o in res)
    assert res[-1].finish_reason == "stop"
    assert text == full[: full.find(stop)]
    assert stop not in text


def test_export_import_blocks_roundtrip(tiny_model):
    eng = tiny_engine(tiny_model)
    eng.generate([Request("x", prompt(3, 40), SamplingParams(max_tokens=1, temperature=0))])
    kv = eng.cache.export_blocks([0, 1], positions=[0, 16], model_id=eng.loaded.model_id)
    assert kv.k.shape == (2, 2, 16, 2, 16) and kv.k.dtype == np.float32
    eng.cache.import_blocks([5, 6], kv)
    again = eng.cache.export_blocks([5, 6], positions=[0, 16], model_id=eng.loaded.model_id)
    np.testing.assert_array_equal(again.k, kv.k)
    np.testing.assert_array_equal(again.v, kv.v)
    with pytest.raises(ValueError):
        eng.cache.import_blocks([5], kv)


def test_bfloat16_blocks_travel_as_bits():
    from engine.kv_cache import PagedKVCache

    cache = PagedKVCache(2, 8, 4, 2, 8, dtype=torch.bfloat16)
    for layer in range(2):
        cache.k[layer].normal_()
        cache.v[layer].normal_()
    kv = cache.export_blocks([1, 3], positions=[0, 4], model_id="m")
    assert kv.dtype == "bfloat16" and kv.k.dtype == np.int16
    other = PagedKVCache(2, 8, 4, 2, 8, dtype=torch.bfloat16)
    other.import_blocks([0, 1], kv)
    assert torch.equal(other.paged(1)[0][:2], cache.paged(1)[0][[1, 3]])
    assert torch.equal(other.paged(0)[1][:2], cache.paged(0)[1][[1, 3]])


@pytest.mark.parametrize("new,past", [(7, 3), (40, 24), (16, 16), (10, 50), (5, 0)])
def test_attention_with_context_equals_masked_sdpa(new, past):
    """Both paths (split + log-sum-exp merge when the chunk is at least as long as its context, one masked
    call with a cached additive mask otherwise) equal a plain masked SDPA with a bottom-right causal mask."""
    import torch.nn.functional as F

    from engine.model_runner import attend_with_context

    g = torch.Generator().manual_seed(new * 100 + past)
    q = torch.randn(new, 4, 16, generator=g).transpose(0, 1)[None]
    k = torch.randn(past + new, 2, 16, generator=g).transpose(0, 1)[None]
    v = torch.randn(past + new, 2, 16, generator=g).transpose(0, 1)[None]
    mask = torch.ones(new, past + new, dtype=torch.bool).tril(diagonal=past)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25, enable_gqa=True)
    torch.testing.assert_close(attend_with_context(q, k, v, past, 0.25), ref, atol=1e-5, rtol=1e-5)


def test_attention_mask_follows_the_query_dtype():
    """The cached additive mask is built in q's dtype (CUDA SDPA rejects or misreads a float32
    bias with bf16 queries); bf16 results stay close to the fp32 ones."""
    from engine.model_runner import attend_with_context

    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 4, 6, 16, generator=g)
    k, v = torch.randn(1, 2, 40, 16, generator=g), torch.randn(1, 2, 40, 16, generator=g)
    ref = attend_with_context(q, k, v, 34, 0.25)
    out = attend_with_context(q.bfloat16(), k.bfloat16(), v.bfloat16(), 34, 0.25)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)


def test_ttft_counts_from_when_the_request_reached_the_engine(tiny_model):
    """``add_request(arrival=)``: the time a request waited to be added (the async engine adds
    between steps) is part of its time to first token, not hidden before it."""
    import time

    eng = tiny_engine(tiny_model)
    eng.add_request(Request("now", prompt(0, 20), GREEDY))
    eng.add_request(Request("waited", prompt(1, 20), GREEDY), arrival=time.perf_counter() - 5.0)
    firsts = {}
    while eng.has_unfinished():
        for o in eng.step():
            firsts.setdefault(o.request_id, o)
    assert firsts["waited"].ttft_s >= 5.0 > firsts["now"].ttft_s
    assert firsts["waited"].prefill_s < 5.0  # forward time only: the wait is not prefill


def test_calibrate_times_prefills_and_leaves_no_trace(tiny_model):
    """``LLMEngine.calibrate``: one sample per length (after an untimed warm-up), nothing cached,
    no tenant or step counted, and the engine serves exactly as before."""
    from engine.llm_engine import CALIBRATION_TENANT

    eng = tiny_engine(tiny_model)
    ref = output_ids(tiny_engine(tiny_model).generate([Request("r", prompt(0, 40), GREEDY)])["r"])
    samples = eng.calibrate((16, 64))
    assert [n for n, _ in samples] == [16, 64] and all(s > 0 for _, s in samples)
    assert eng.num_steps == 0 and CALIBRATION_TENANT not in eng.stats()["tenants"]
    assert eng.pool.num_free_blocks() == eng.pool.num_blocks and not eng.seqs
    assert output_ids(eng.generate([Request("r", prompt(0, 40), GREEDY)])["r"]) == ref
    assert eng.calibrate(()) == []
    assert [n for n, _ in eng.calibrate((10_000,))] == [eng.max_model_len - 2]  # clipped to the context


def _padded_decode_reference(q, kc, vc, tables, lens, block_size):
    """Each row alone: its own keys gathered, plain SDPA (the path the shared form replaces)."""
    import torch.nn.functional as F

    from engine.kv_cache import token_slots

    out = []
    for i, (table, n) in enumerate(zip(tables, lens)):
        slots = torch.tensor(token_slots(table, block_size, 0, n))
        k, v = kc[slots].transpose(0, 1)[None], vc[slots].transpose(0, 1)[None]
        out.append(F.scaled_dot_product_attention(q[i][None, :, None, :], k, v, scale=0.125, enable_gqa=True)[0, :, 0])
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shared_decode_attention_equals_each_row_alone(dtype):
    """Decode rows sharing a prefix's blocks attend over the union of their keys, gathered once:
    every row sees exactly its own keys (shared blocks, its private tail, only the filled part of a
    partial last block, also one that a forked row shares at another length)."""
    from engine.model_runner import attend_decode_shared, shared_decode_keys

    bs, kvh, heads, d = 4, 2, 6, 64
    g = torch.Generator().manual_seed(3)
    kc = torch.randn(40 * bs, kvh, d, generator=g).to(dtype)
    vc = torch.randn(40 * bs, kvh, d, generator=g).to(dtype)
    prefix = list(range(10, 20))  # 10 shared blocks = 40 keys
    tables = [prefix + [30], prefix + [31, 32], prefix + [33], prefix + [33]]  # rows 3 and 4 share a partial block
    lens = [41, 47, 42, 43]
    shared = shared_decode_keys(tables, lens, bs)
    assert shared is not None
    slots, hidden = shared
    assert slots.shape[0] == 14 * bs and hidden.shape == (4, 14 * bs)
    assert (~hidden).sum(1).tolist() == lens
    q = torch.randn(4, heads, d, generator=g).to(dtype)
    got = attend_decode_shared(q, kc, vc, slots, hidden, 0.125)
    assert got.dtype == dtype
    ref = _padded_decode_reference(q.float(), kc.float(), vc.float(), tables, lens, bs)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), ref, atol=tol, rtol=tol)


def test_decode_rows_sharing_little_keep_the_padded_form():
    from engine.model_runner import build_batch, shared_decode_keys

    private = [list(range(i * 10, i * 10 + 10)) for i in range(4)]
    assert shared_decode_keys(private, [40] * 4, 4) is None
    assert shared_decode_keys([list(range(10))], [40], 4) is None  # one row: nothing to share
    # one shared block of ten: the union is 37 of 40 blocks
    assert shared_decode_keys([[0] + t[1:] for t in private], [40] * 4, 4) is None
    batch = build_batch([([1], 39, 1, t) for t in private], 4)
    assert batch.decode_shared == () and batch.decode_rest is None and batch.decode_slots.shape == (4, 40)


def test_mixed_decode_batch_groups_rows_by_prefix_and_keeps_logits(tiny_model, monkeypatch):
    """Rows of two prefixes form two shared groups; a lone row and a pair sharing only one block
    take the padded form; every row's logits equal the all-padded forward's."""
    import engine.model_runner as mr
    from engine.kv_cache import PagedKVCache

    cfg = tiny_model.model.config
    hd = cfg.hidden_size // cfg.num_attention_heads
    cache = PagedKVCache(cfg.num_hidden_layers, 80, 4, cfg.num_key_value_heads, hd)
    g = torch.Generator().manual_seed(1)
    for layer in range(cfg.num_hidden_layers):
        cache.k[layer].copy_(torch.randn(cache.k[layer].shape, generator=g))
        cache.v[layer].copy_(torch.randn(cache.v[layer].shape, generator=g))
    runner = mr.ModelRunner(tiny_model.model, cache, "sdpa")
    a, b = list(range(0, 12)), list(range(20, 32))
    tables = [a + [40], b + [41], a + [42], [60] + list(range(61, 70)), b + [43], a + [44],
              [70, 71, 72], [70, 73, 74]]
    lens = [49, 50, 51, 38, 49, 52, 11, 12]
    chunks = [([5 + i], n - 1, 1, t) for i, (t, n) in enumerate(zip(tables, lens))]
    batch = mr.build_batch(chunks, 4)
    groups = sorted(idx.tolist() for idx, _, _ in batch.decode_shared)
    assert groups == [[0, 2, 5], [1, 4]] and batch.decode_rest.tolist() == [3, 6, 7]
    got = runner.forward(batch)
    monkeypatch.setattr(mr, "SHARED_DECODE_MARGIN", 0)
    padded = mr.build_batch(chunks, 4)
    assert padded.decode_shared == () and padded.decode_rest is None
    torch.testing.assert_close(got, runner.forward(padded), atol=1e-4, rtol=1e-4)


def test_concurrent_decodes_over_a_cached_prefix_equal_one_at_a_time(tiny_model, monkeypatch):
    """Requests that hit two cached prefixes (and one that hits none) decode in one batch, each
    prefix's rows through the shared form; their greedy outputs equal each request served alone."""
    import engine.model_runner as mr

    calls = []
    real = mr.attend_decode_shared
    monkeypatch.setattr(mr, "attend_decode_shared", lambda q, *a: calls.append(q.shape[0]) or real(q, *a))
    heads = [prompt(7, 160), prompt(8, 150)]
    reqs = lambda: [Request(f"r{i}", heads[i % 2] + prompt(100 + i, 5 + i), GREEDY) for i in range(8)] + [  # noqa: E731
        Request("lone", prompt(9, 90), GREEDY)]
    alone = {}
    for r in reqs():
        alone[r.request_id] = output_ids(tiny_engine(tiny_model).generate([r])[r.request_id])
    assert not calls
    eng = tiny_engine(tiny_model)
    eng.generate([Request(f"warm{i}", h, SamplingParams(max_tokens=1, temperature=0)) for i, h in enumerate(heads)])
    got = {k: output_ids(v) for k, v in eng.generate(reqs()).items()}
    assert got == alone
    assert calls and max(calls) == 4  # each prefix's four rows in one group
    assert_pool_clean(eng)
