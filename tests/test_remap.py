"""Oneiros remap: pure policy tests, then the mechanism on tiny-llama and the default model."""

from __future__ import annotations

import re

import pytest
import torch

from policies.remap import (
    HashRemap, IdentityRemap, Instance, LearnableRemap, RemapPlan, RepairGate, Template, align, detect_template,
    fixed_slot_positions, make_policy, query_suffix_start, segment, slot_class, structural_recompute,
    token_param, top_r_by_deviation,
)


def word_tokenize(text: str):
    """Toy tokenizer: words carry their leading space (like BPE), newlines are tokens."""
    toks = [(m.start(), m.end()) for m in re.finditer(r" ?[A-Za-z0-9]+|\n|[^\sA-Za-z0-9]| ", text)]
    return [hash_tok(text[s:e]) for s, e in toks], toks


def hash_tok(s: str) -> int:
    return sum(ord(c) * 31**i for i, c in enumerate(s)) % 10007


TPL = Template.parse("t", "Translate to French: {text}\nBe formal and brief.\nAnswer:")


def inst(text: str, tpl: Template = TPL, uid: int = 0) -> Instance:
    return Instance.build(tpl, {"text": text}, word_tokenize, uid=uid)


# -- templates and segmentation ---------------------------------------------------------------

def test_parse_render_and_escapes():
    t = Template.parse("x", "a {p} b {{literal}} {q}{p}")
    assert t.params == ("p", "q")
    assert [pc.param for pc in t.pieces] == [None, "p", None, "q", "p"]
    text, spans = t.render({"p": "P", "q": "QQ"})
    assert text == "a P b {literal} QQP"
    assert [text[s:e] for s, e in spans] == ["a ", "P", " b {literal} ", "QQ", "P"]


def test_segment_marks_straddling_tokens_not_literal():
    i = inst("the cat")
    text, spans = TPL.render({"text": "the cat"})
    # "Translate to French: " ends with a space that the BPE-like token " the" absorbs
    roles = {text[s:e]: r for (s, e), r in zip(word_tokenize(text)[1], i.roles)}
    assert roles["Translate"].literal and roles[" French"].literal
    assert not roles[" the"].literal and roles[" the"].piece == 0  # starts in the literal piece
    assert not roles[" cat"].literal and roles[" cat"].piece == 1
    assert segment([(0, 3), (3, 5)], [(0, 2), (2, 4), (4, 5)], [True, False]) == (
        segment([(0, 3), (3, 5)], [(0, 2)], [True, False])[0],
        (segment([(0, 3), (3, 5)], [(2, 4)], [True, False])[0]),
        segment([(0, 3), (3, 5)], [(4, 5)], [True, False])[0],
    )


# -- alignment ---------------------------------------------------------------------------------

def test_align_shifts_template_tokens_after_a_longer_value():
    donor, new = inst("the cat"), inst("the big black cat")
    plan = align(new, donor)
    assert plan.exact_prefix == len(word_tokenize("Translate to French: the")[0])
    assert all(plan.src[i] == i for i in range(plan.exact_prefix))
    tail = len(word_tokenize("\nBe formal and brief.\nAnswer:")[0])
    deltas = [d for d in plan.deltas()[-tail:]]
    assert deltas == [2] * tail  # " big" " black" moved the template text by 2
    assert plan.src[plan.exact_prefix] is None  # " big" is a parameter token: fresh
    srcs = [s for s in plan.src if s is not None]
    assert srcs == sorted(srcs)


def test_identity_reuses_identical_values_hash_needs_same_class():
    t = Template.parse("f", "A: {a}\nB: {b}\nQ:")
    mk = lambda a, b, uid=0: Instance.build(t, {"a": a, "b": b}, word_tokenize, uid=uid)  # noqa: E731
    new, donor = mk("red apple pie", "x"), mk("green tea", "x")
    plan = IdentityRemap().plan(new, donor)
    b_rows = [i for i, r in enumerate(new.roles) if token_param(t.pieces, r) == "b"]
    assert b_rows and all(plan.src[i] is not None for i in b_rows)  # identical value "x" reused
    a_rows = [i for i, r in enumerate(new.roles) if token_param(t.pieces, r) == "a"]
    assert all(plan.src[i] is None for i in a_rows)
    h = HashRemap(length_step=2)
    cands = [mk("green tea", "x", 1), mk("one two three", "x", 2)]
    assert h.choose_donor(new, cands).uid == 2  # same length bucket for every parameter
    assert h.choose_donor(mk("a b c d e f g", "x"), cands) is None
    assert IdentityRemap().choose_donor(mk("a b c d e f g", "x"), cands) is not None


def test_donor_choice_prefers_longest_common_prefix():
    cands = [inst("dogs run", uid=1), inst("the cats sleep", uid=2), inst("the cats eat", uid=3)]
    assert IdentityRemap().choose_donor(inst("the cats eat fish"), cands).uid == 3


def test_slot_class_is_stable_and_bucketed():
    assert slot_class([1, 2, 3], length_step=2) == slot_class([7, 8, 9, 10], length_step=2)
    assert slot_class([1, 2, 3], 8, 16) == slot_class([1, 2, 3], 8, 16)
    assert slot_class([1], 8, 1).hash_bucket == 0


def test_policy_table():
    assert isinstance(make_policy("hash", length_step=4), HashRemap)
    assert make_policy("identity").name == "identity"
    with pytest.raises(ValueError, match="unknown remap policy"):
        make_policy("nope")


# -- recompute selection -------------------------------------------------------------------------

def test_top_r_counts_only_tokens_beyond_the_exact_prefix():
    plan = RemapPlan((0, 1, 2, None, 4, 5, 6, 7), exact_prefix=3)
    dev = [9.0, 9.0, 9.0, 0.0, 1.0, 5.0, 2.0, 0.5]
    out = top_r_by_deviation(plan, dev, 0.5)  # 4 candidates (4..7) -> 2 recomputed
    assert out.recompute == {5, 6}
    assert out.reused == 7 - 2 and out.approx == 2


def test_structural_recompute_follows_changed_values():
    donor, new = inst("the cat"), inst("the big black cat")
    plan = structural_recompute(align(new, donor), new, after_change=2)
    first_tail = len(word_tokenize("Translate to French: the big black cat")[0])
    assert plan.recompute == {first_tail, first_tail + 1}
    same = structural_recompute(align(donor, donor), donor, after_change=2)
    assert same.recompute == frozenset()  # nothing changed: nothing to recompute


def test_learnable_priorities_roundtrip_and_select():
    pol = LearnableRemap({(2, 0): 1.0, (2, 3): 5.0})
    again = LearnableRemap.from_json(pol.to_json())
    assert again.priority == pol.priority
    donor, new = inst("the cat"), inst("the big black cat")
    plan = pol.select(align(new, donor), new, 0.01)
    (row,) = plan.recompute
    assert new.roles[row].piece == 2 and row - min(i for i, r in enumerate(new.roles) if r.piece == 2) == 3


def test_prompt_cache_fixed_slots_keep_template_positions():
    a, b = inst("the cat"), inst("the big black cat")
    pa, pb = fixed_slot_positions(a, {"text": 6}), fixed_slot_positions(b, {"text": 6})
    tail = len(word_tokenize("\nBe formal and brief.\nAnswer:")[0])
    assert pa[-tail:] == pb[-tail:]
    assert list(pb) == sorted(pb)
    assert fixed_slot_positions(b, {"text": 2}) is None


def test_detect_template_aligns_except_for_spans():
    base = list(range(100, 140))
    new = base[:10] + [7, 7, 7] + base[12:]  # a 2-token value replaced by a 3-token one
    other = list(range(500, 540))
    m = detect_template(new, [other, base], min_run=4)
    assert m is not None and m.donor_index == 1
    assert m.plan.exact_prefix == 10 and m.plan.src[10:13] == (None, None, None)
    assert m.plan.src[13] == 12 and m.coverage == pytest.approx(38 / 41)
    assert detect_template(new, [other]) is None


def test_query_suffix_and_shared_blocks():
    i = inst("the cat")
    assert query_suffix_start(i, max_tokens=3) == len(i.token_ids) - 3
    plan = RemapPlan(tuple(range(32)) + (None,), 0)
    assert plan.shared_blocks(16) == 2
    assert plan.with_recompute([20]).shared_blocks(16) == 1


def test_repair_gate_only_distrusts_near_ties_early():
    gate = RepairGate(min_margin=1.0, steps=2)
    assert gate.repair(0, 0.5) and gate.repair(1, 0.99)
    assert not gate.repair(0, 1.5) and not gate.repair(2, 0.1)


# -- mechanism ---------------------------------------------------------------------------------

def byte_tokenize(text: str):
    data = text.encode()
    assert len(data) == len(text)  # ASCII only
    return [b + 3 for b in data], [(i, i + 1) for i in range(len(text))]


def _hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1]


@pytest.fixture(scope="module")
def tiny():
    from engine.model_loader import load_model

    return load_model("tiny-llama")


@pytest.fixture(scope="module")
def default_model():
    from engine.model_loader import load_model

    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    return load_model("default")


def _hf_tokenize(tok):
    def f(text):
        enc = tok(text, return_offsets_mapping=True, add_special_tokens=False)
        return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]

    return f


def _check_shifted_instance_is_exact(model, tokenize):
    """A template instance with the SAME values, cached at shifted positions, reused with its
    template tokens re-rotated by Δ (parameters fresh): logits equal full prefill."""
    from engine.manual_forward import full_prefill
    from engine.remap import remap_prefill

    t = Template.parse("t", "Translate to French: {text}\nKeep it short and formal.\nFrench:")
    new = Instance.build(t, {"text": "the small cat sleeps"}, tokenize)
    ids = list(new.token_ids)
    ref, _ = full_prefill(model, ids)
    torch.testing.assert_close(ref, _hf_logits(model, ids), atol=2e-4, rtol=1e-4)
    _, donor = full_prefill(model, ids, [p + 23 for p in range(len(ids))])  # cached 23 positions later
    plan = align(new, new, reuse_identical_params=False)
    plan = RemapPlan(plan.src, 0)  # no exact prefix: every reused token is re-rotated (Δ = -23)
    res = remap_prefill(model, ids, donor, plan)
    assert res.plan.reused >= len(ids) // 2
    torch.testing.assert_close(res.logits, ref, atol=2e-4, rtol=1e-4)
    return res


def test_shifted_instance_is_exact_tiny(tiny):
    _check_shifted_instance_is_exact(tiny.model, byte_tokenize)


def test_shifted_instance_is_exact_default(default_model):
    _check_shifted_instance_is_exact(default_model.model, _hf_tokenize(default_model.tokenizer))


def test_rerotation_matches_rope_at_new_position(tiny):
    from engine.manual_forward import full_prefill
    from engine.remap import rerotate

    ids = byte_tokenize("hello remap world")[0]
    _, a = full_prefill(tiny.model, ids)
    _, b = full_prefill(tiny.model, ids, [p + 40 for p in range(len(ids))])
    moved = rerotate(tiny.model, a.k, torch.full((len(ids),), 40))
    torch.testing.assert_close(moved, b.k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a.v, b.v, atol=1e-5, rtol=1e-5)


def test_different_values_approximate_then_full_recompute_is_exact(tiny):
    from engine.manual_forward import full_prefill, greedy_continue
    from engine.remap import remap_prefill

    t = Template.parse("t", "Translate to French: {text}\nKeep it short and formal.\nFrench:")
    donor = Instance.build(t, {"text": "a dog"}, byte_tokenize)
    new = Instance.build(t, {"text": "the small cat"}, byte_tokenize)
    ids = list(new.token_ids)
    ref, ref_kv = full_prefill(tiny.model, ids)
    _, dkv = full_prefill(tiny.model, list(donor.token_ids))
    plan = align(new, donor)
    approx = remap_prefill(tiny.model, ids, dkv, plan, suffix_start=query_suffix_start(new))
    assert approx.plan.approx > 0 and approx.computed < len(ids)
    assert torch.isfinite(approx.logits).all()
    full = remap_prefill(tiny.model, ids, dkv, plan, r=1.0)  # every reused token recomputed
    assert full.plan.reused == plan.exact_prefix
    torch.testing.assert_close(full.logits, ref, atol=1e-4, rtol=1e-4)
    assert greedy_continue(tiny.model, full.logits, full.kv, 4) == greedy_continue(tiny.model, ref, ref_kv, 4)


def test_identical_prompt_still_computes_its_suffix(tiny):
    from engine.manual_forward import full_prefill
    from engine.remap import remap_prefill

    ids = byte_tokenize(TPL.render({"text": "the cat"})[0])[0]
    new = Instance.build(TPL, {"text": "the cat"}, byte_tokenize)
    ref, kv = full_prefill(tiny.model, ids)
    plan = align(new, new)
    assert plan.exact_prefix == len(ids)
    for r in (0.0, 0.3):
        res = remap_prefill(tiny.model, ids, kv, plan, r=r, suffix_start=len(ids) - 4)
        assert res.computed == 4 and res.plan.reused == len(ids) - 4
        torch.testing.assert_close(res.logits, ref, atol=1e-4, rtol=1e-4)


# -- partial_forward is ModelRunner.forward over dense KV --------------------------------------

def _reference_partial_forward(model, ids, positions, rows, given, select_layer=None, select=None):
    """The layer loop partial_forward had before it ran on ModelRunner, in plain torch: an
    independent reference for explicit rows, a position mask and a row filter."""
    import torch.nn.functional as F

    from engine.manual_forward import model_dims
    from engine.model_runner import apply_rope

    _, n_heads, n_kv, d = model_dims(model)
    k_all, v_all, inner = given.k.clone(), given.v.clone(), model.model
    with torch.no_grad():
        h = inner.embed_tokens(ids[rows])
        cos, sin = (t[0] for t in inner.rotary_emb(h[None], positions[rows][None]))
        for i, layer in enumerate(inner.layers):
            attn, x = layer.self_attn, layer.input_layernorm(h)
            q = apply_rope(attn.q_proj(x).view(-1, n_heads, d), cos, sin)
            k_all[i, rows] = apply_rope(attn.k_proj(x).view(-1, n_kv, d), cos, sin)
            v_all[i, rows] = attn.v_proj(x).view(-1, n_kv, d)
            mask = positions[None, :] <= positions[rows][:, None]
            kv = [t[i].transpose(0, 1)[None] for t in (k_all, v_all)]
            qt = q.transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(qt, *kv, attn_mask=mask, scale=d**-0.5, enable_gqa=True)
            h = h + attn.o_proj(o[0].transpose(0, 1).reshape(-1, n_heads * d))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
            if select is not None and i == select_layer:
                keep = select(i, rows, k_all[i, rows], v_all[i, rows])
                rows, h, cos, sin = rows[keep], h[keep], cos[keep], sin[keep]
        return model.lm_head(inner.norm(h[-1:]))[0].float(), k_all, v_all


def test_full_prefill_equals_model_runner_prefill(tiny):
    from engine.kv_cache import PagedKVCache
    from engine.manual_forward import full_prefill, model_dims
    from engine.model_runner import ModelRunner, build_batch

    ids = byte_tokenize("a paged prefill and a dense one agree")[0]
    logits, kv = full_prefill(tiny.model, ids)
    layers, _, n_kv, d = model_dims(tiny.model)
    cache = PagedKVCache(layers, 4, 16, n_kv, d)
    table = [2, 0, 3]  # scattered blocks
    paged = ModelRunner(tiny.model, cache, attention="sdpa").forward(build_batch([(ids, 0, True, table)], 16))
    torch.testing.assert_close(logits, paged[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits, _hf_logits(tiny.model, ids), atol=1e-4, rtol=1e-4)
    slots = torch.tensor([table[p // 16] * 16 + p % 16 for p in range(len(ids))])
    for layer in range(layers):
        torch.testing.assert_close(kv.k[layer], cache.k[layer][slots], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(kv.v[layer], cache.v[layer][slots], atol=1e-5, rtol=1e-5)


def test_scattered_rows_gapped_positions_and_row_filter_match_reference(tiny):
    from engine.manual_forward import full_prefill, partial_forward

    ids = byte_tokenize("Translate to French: the small cat\nFrench:")[0]
    n = len(ids)
    gapped = [p + 5 * (p >= 12) for p in range(n)]  # Prompt Cache style hole after row 11
    _, given = full_prefill(tiny.model, byte_tokenize("Translate to German: a dog at home\nGerman:")[0][:n], gapped)
    t_ids, pos = torch.tensor(ids), torch.tensor(gapped)
    rows = torch.tensor([3, 7] + list(range(20, n)))
    seen = []

    def select(layer, rows_, k, v):
        seen.append((layer, rows_.tolist(), k.shape, v.shape))
        return torch.tensor([j for j in range(len(rows_)) if j % 3 == 0 or j == len(rows_) - 1])

    for sel_layer, sel in ((None, None), (0, select)):
        logits, kv = partial_forward(tiny.model, t_ids, pos, rows, given, sel_layer, sel)
        ref_logits, ref_k, ref_v = _reference_partial_forward(tiny.model, t_ids, pos, rows, given, sel_layer, sel)
        torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(kv.k, ref_k, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(kv.v, ref_v, atol=1e-5, rtol=1e-5)
        assert not torch.equal(kv.k[1], given.k[1])  # computed rows were written, given left alone
        assert torch.equal(kv.k[:, 0], given.k[:, 0]) and torch.equal(kv.positions, pos)
    assert seen[0][:2] == (0, rows.tolist()) and seen[0][2] == seen[0][3] == (len(rows),) + tuple(given.k.shape[2:])
    filtered, _ = partial_forward(tiny.model, t_ids, pos, rows, given, 0, select)
    unfiltered, _ = partial_forward(tiny.model, t_ids, pos, rows, given)
    assert not torch.allclose(filtered, unfiltered)  # the filter changed which rows later layers saw
    with pytest.raises(ValueError, match="last row"):
        partial_forward(tiny.model, t_ids, pos, rows[:-1], given)
    with pytest.raises(ValueError, match="dropped"):
        partial_forward(tiny.model, t_ids, pos, rows, given, 0, lambda *a: torch.tensor([0]))


def test_row_filter_in_a_mixed_batch_leaves_other_sequences_alone(tiny):
    """A filtered, masked slice between a plain prefill chunk and a decode: the other rows'
    logits equal running them alone (their batch rows move when the filtered slice shrinks)."""
    from engine.kv_cache import PagedKVCache
    from engine.manual_forward import model_dims, partial_forward
    from engine.model_runner import ModelRunner, SeqSlice, build_batch

    layers, _, n_kv, d = model_dims(tiny.model)
    a, b, c = (byte_tokenize(s)[0] for s in ("first sequence", "second, filtered", "decode me"))
    tables = [[0], [1], [2]]

    def run(chunks, filtered=False):
        cache = PagedKVCache(layers, 3, 16, n_kv, d)
        runner = ModelRunner(tiny.model, cache, attention="sdpa")
        runner.forward(build_batch([(c[:-1], 0, False, tables[2])], 16))  # c's context, cached
        batch = build_batch(chunks, 16)
        if filtered:
            s = batch.prefills[1]
            keep = lambda layer, k, v: torch.tensor([1, 4, s.q_len - 1])  # noqa: E731
            batch.prefills[1] = SeqSlice(s.q_start, s.q_len, s.ctx_len, None, None, 0, keep)
        return runner.forward(batch)

    mixed = run([(a, 0, True, tables[0]), (b, 0, True, tables[1]), (c[-1:], len(c) - 1, True, tables[2])], True)
    alone = run([(a, 0, True, tables[0]), (c[-1:], len(c) - 1, True, tables[2])])
    torch.testing.assert_close(mixed[[0, 2]], alone, atol=1e-5, rtol=1e-5)
    # the filtered slice itself: dropped rows' later-layer keys are the fresh cache's zeros, as
    # partial_forward's with no given KV
    b_alone, _ = partial_forward(tiny.model, torch.tensor(b), torch.arange(len(b)), torch.arange(len(b)), None, 0,
                                 lambda layer, rows, k, v: torch.tensor([1, 4, len(b) - 1]))
    torch.testing.assert_close(mixed[1], b_alone, atol=1e-5, rtol=1e-5)


def test_teacher_force_in_one_forward_equals_decoding_token_by_token(tiny):
    """The shadow check feeds the exact output through the approximate KV in one forward; its
    logit rows equal one ``extend`` per token (what decoding would compute)."""
    from engine.manual_forward import extend, full_prefill, teacher_force

    ids = [(11 * i) % 200 + 3 for i in range(37)]
    tokens = [5, 77, 190, 42, 8]
    _, kv = full_prefill(tiny.model, ids)
    rows = teacher_force(tiny.model, kv, tokens)
    assert rows.shape[0] == len(tokens)
    step_kv = kv
    for i, t in enumerate(tokens):
        logits, step_kv = extend(tiny.model, step_kv, t)
        torch.testing.assert_close(rows[i], logits, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="all_logits"):
        from engine.manual_forward import partial_forward

        n = len(ids)
        partial_forward(tiny.model, torch.tensor(ids), torch.arange(n), torch.arange(n), None, 0,
                        lambda *a: torch.arange(n), all_logits=True)
