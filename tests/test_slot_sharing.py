"""Template slots across workers: slot-pool events, donor export/import, and (Ray) the index's
slot registry + a routed donor pull between two worker actors.

Tiny model (byte tokenizer); requests are built as in tests/test_approx.py.
"""

import asyncio
import os
import time
from dataclasses import replace

import pytest
import torch

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

from actors.index_publisher import Drained, decode_message, encode_batch  # noqa: E402
from actors.slot_registry import SlotKey, SlotRegistry  # noqa: E402
from engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from engine.sequence import Request, SamplingParams  # noqa: E402
from engine.slot_pool import Donor, SlotEvent, SlotPool, seq_kv  # noqa: E402

BS = 16
T = ("Please classify the review below as positive or negative.\nReview: {text}\n"
     "Think about the words used by the writer, the tone, and the overall impression. Label:")
A, B = "I loved this film a lot.", "The food was cold, sadly"  # same length bucket (hash slot class)
CFG = EngineConfig(model="tiny-llama", block_size=BS, num_blocks=96, max_num_batched_tokens=256)


def greedy(n: int = 6) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def encode(tokenizer, text: str) -> tuple[int, ...]:
    return tuple(tokenizer.encode(text, add_special_tokens=False))


def treq(tokenizer, rid, text, tenant="acme", **kw) -> Request:
    return Request(rid, encode(tokenizer, T.replace("{text}", text)), greedy(), tenant=tenant, reuse="approximate",
                   template="sent", template_text=T, template_params={"text": text}, **kw)


def run(eng, req):
    outs = eng.generate([req])[req.request_id]
    return [t for o in outs for t in o.new_token_ids], outs[-1]


def engine(loaded) -> LLMEngine:
    eng = LLMEngine(CFG, loaded=loaded)
    eng.approx.pool.record_events = True
    return eng


# -- slot pool events (no model) ---------------------------------------------------------------
def donor(tokens, domain="acme", template="t", key=("t", 1), n_layers=2):
    k = torch.zeros(n_layers, len(tokens), 1, 4)
    return Donor(domain, domain, tuple(tokens), seq_kv(k, k.clone()), None, template, key)


def test_events_on_put_evict_and_replace():
    pool = SlotPool(bytes_per_domain=400, record_events=True)  # a 3-token donor is 192 bytes: two fit
    d1, d2, d3 = donor((1, 2, 3)), donor((4, 5, 6)), donor((7, 8, 9), key=("t", 2))
    assert pool.put(d1) and pool.put(d2) and pool.put(d3)
    ev = pool.take_events()
    assert [(e.kind, e.slot_id, e.slot_class) for e in ev] == [
        ("added", d1.slot_id, "('t', 1)"), ("added", d2.slot_id, "('t', 1)"), ("added", d3.slot_id, "('t', 2)"),
        ("removed", d1.slot_id, "('t', 1)")]  # LRU: d1 evicted to fit d3
    assert ev[0] == SlotEvent("added", "t", "('t', 1)", "acme", d1.slot_id, 3, "acme")
    assert pool.take_events() == [] and pool.get(d1.slot_id) is None and pool.get(d2.slot_id) is d2
    d2b = donor((4, 5, 6), key=("t", 3))  # same prompt, another slot class: re-filed
    assert d2b.slot_id == d2.slot_id
    pool.put(d2b)
    assert [(e.kind, e.slot_class) for e in pool.take_events()] == [("removed", "('t', 1)"), ("added", "('t', 3)")]
    pool.put(donor((4, 5, 6), key=("t", 3)))  # refresh, same class: one (idempotent) add
    assert [e.kind for e in pool.take_events()] == ["added"]
    pool.put(donor((1, 1, 1), template=None, key=None))  # no template: never registered
    assert pool.take_events()[-1].kind == "removed"  # ...but it evicted a template donor
    assert {e.slot_id for e in pool.slot_entries()} == {d2.slot_id}
    pool.check_invariants()
    assert donor((4, 5, 6), domain="globex").slot_id != d2.slot_id  # domains never share slot ids
    quiet = SlotPool(record_events=False)
    quiet.put(donor((1, 2, 3)))
    assert quiet.take_events() == []


def test_slot_batches_round_trip_and_apply():
    ev = [SlotEvent("added", "t", "c1", "acme", "s1", 40, "acme"), SlotEvent("removed", "t", "c0", "acme", "s0", 40)]
    batch, slots = decode_message(encode_batch("w1", 0, BS, [], None, ev, ev[:1]))
    assert batch.snapshot is None and batch.events == ()
    assert slots.events == ((True, SlotKey("t", "c1", "acme"), "s1", 40, {"tenant": "acme"}),
                            (False, SlotKey("t", "c0", "acme"), "s0", 40, {"tenant": ""}))
    assert slots.snapshot == ((SlotKey("t", "c1", "acme"), "s1", 40, {"tenant": "acme"}),)
    assert decode_message(encode_batch("w1", 1, BS, []))[1].snapshot is None  # no slot part
    reg = SlotRegistry()
    reg.register(SlotKey("t", "c0", "acme"), "w1", "old")
    reg.register(SlotKey("t", "c1", "globex"), "w2", "g")
    reg.replace_worker("w1", slots.snapshot)
    assert [(k.slot_class, e.worker_id, e.slot_id) for k, e in reg.lookup_template("t", ["acme"])] == [("c1", "w1", "s1")]
    assert len(reg.lookup_template("t", ["acme", "globex"])) == 2 and reg.lookup_template("t", ["initech"]) == []
    reg.remove_worker("w1")
    assert reg.lookup_template("t", ["acme"]) == []
    reg.check_invariants()
    assert Drained(*([], None)).slot_snapshot is None  # a worker without slots drains a pair


# -- export / import between engines ---------------------------------------------------------
def test_export_import_round_trip_matches_the_donor_worker(tiny_model):
    tok = tiny_model.tokenizer
    a, b = engine(tiny_model), engine(tiny_model)
    run(a, treq(tok, "a", A))
    (ev,) = a.approx.pool.take_events()
    assert ev.kind == "added" and ev.template_id == "sent" and ev.domain == "acme"
    assert ev.num_tokens == len(encode(tok, T.replace("{text}", A)))
    assert b.needed_slot_class(treq(tok, "q", B)) == ev.slot_class  # b has no donor of that class
    assert a.needed_slot_class(treq(tok, "q", B)) is None  # a has one
    assert a.needed_slot_class(replace(treq(tok, "q", B), reuse="exact")) is None
    payload = a.export_donor(ev.slot_id)
    assert a.export_donor("no-such-slot") is None
    assert payload.k.shape[1] == ev.num_tokens and payload.model_id == tiny_model.model_id
    assert b.import_donor(payload, ("acme",))
    (ev_b,) = b.approx.pool.take_events()
    assert (ev_b.slot_id, ev_b.slot_class) == (ev.slot_id, ev.slot_class)  # b now registers it too
    assert b.needed_slot_class(treq(tok, "q", B)) is None
    ids_a, out_a = run(a, treq(tok, "b1", B))
    ids_b, out_b = run(b, treq(tok, "b2", B))
    assert out_b.num_approx_tokens > 0
    assert ids_b == ids_a and out_b.num_cached_tokens == out_a.num_cached_tokens
    b.approx.pool.check_invariants()


def test_import_refuses_other_model_unreadable_domain_and_bad_kv(tiny_model):
    tok = tiny_model.tokenizer
    a, b = engine(tiny_model), engine(tiny_model)
    run(a, treq(tok, "a", A))
    (ev,) = a.approx.pool.take_events()
    payload = a.export_donor(ev.slot_id)
    bad = [(replace(payload, model_id="another-model"), ("acme",), "model"),
           (payload, ("globex",), "not readable"),  # no grant
           (replace(payload, k=payload.k[:, :-1]), ("acme",), "shape"),
           (replace(payload, token_ids=payload.token_ids[:-1] + (1,)), ("acme",), "segmentation")]
    for p, readers, msg in bad:
        with pytest.raises(ValueError, match=msg):
            b.import_donor(p, readers)
        assert len(b.approx.pool) == 0 and b.approx.pool.take_events() == []
    _, out = run(b, treq(tok, "g", B, tenant="globex", read_domains=("acme",)))
    assert out.num_approx_tokens == 0  # nothing leaked in: globex ran exactly (and donated)
    assert b.import_donor(payload, ("globex", "acme"))  # granted reader
    assert {d.domain for d in b.approx.pool} == {"acme", "globex"}
    b.approx.pool.check_invariants()


# -- two worker actors, the index's slot registry, a routed donor pull -------------------------
@pytest.mark.ray
def test_donor_found_in_index_and_pulled_by_another_worker(tiny_model):
    import ray

    from actors.index_actor import get_or_create_index
    from actors.router import RouterClient
    from actors.worker import worker_actor_class
    from cluster.pool import WorkerState
    from cluster.routing import CostAwareRouter

    tok = tiny_model.tokenizer
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="kvmesh-slots")
    try:
        index = get_or_create_index(BS, liveness_s=0.2)
        W = worker_actor_class(num_gpus=0, num_cpus=0)
        wa, wb = W.remote("wa", CFG), W.remote("wb", CFG)
        ia, ib = ray.get([wa.ready.remote(), wb.ready.remote()], timeout=120)
        ray.get([w.start_index_publisher.remote(0.05, 0.2) for w in (wa, wb)], timeout=60)

        def slots(domains=("acme",)):
            return ray.get(index.lookup_template.remote("sent", list(domains)), timeout=10)

        def poll(pred, what):
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                got = slots()
                if pred(got):
                    return got
                time.sleep(0.1)
            raise AssertionError(f"the index never showed {what}: {got}")

        # A serves an instance of the template: it becomes a donor and the index lists it
        ray.get(wa.generate_all.remote(treq(tok, "a", A)), timeout=120)
        (entry,) = poll(lambda s: len(s) == 1, "A's slot")
        assert entry["worker_id"] == "wa" and entry["domain"] == "acme"
        assert slots(("globex",)) == []  # another tenant without a grant finds none

        # the router, choosing B (the only candidate), offers A's donor; B pulls it and reuses
        states = {"wa": WorkerState("wa", wa, ia), "wb": WorkerState("wb", wb, ib)}
        router = CostAwareRouter(ia["model_id"], BS, index, RouterClient(timeout_s=0.01), states.get, timeout_s=10.0)
        req = treq(tok, "b", B)
        choice = asyncio.run(router.choose(req, [states["wb"]]))
        assert choice.worker_id == "wb" and [p.slot_id for p in choice.donor_pulls] == [entry["slot_id"]]
        globex = treq(tok, "g", B, tenant="globex")
        assert asyncio.run(router.choose(globex, [states["wb"]])).donor_pulls == ()
        outs = ray.get(wb.generate_all.remote(req, choice.pulls, choice.donor_pulls), timeout=120)
        assert outs[-1].num_approx_tokens > 0 and outs[-1].route == "pulled"
        assert outs[-1].pulled_tokens >= outs[-1].num_approx_tokens
        ref = ray.get(wa.generate_all.remote(treq(tok, "b-on-a", B)), timeout=120)  # A, from its own donor
        assert ref[-1].num_approx_tokens > 0
        assert [t for o in outs for t in o.new_token_ids] == [t for o in ref for t in o.new_token_ids]
        assert ray.get(wb.stats.remote())["donor_pulls"]["pulled"] == 1
        poll(lambda s: {e["worker_id"] for e in s} == {"wa", "wb"}, "B's imported slot")
        # B holds the class now: no offers for it
        assert asyncio.run(router.choose(treq(tok, "b3", B), [states["wb"]])).donor_pulls == ()

        # A dies: its slots leave the registry; B's stay
        ray.kill(wa)
        left = poll(lambda s: {e["worker_id"] for e in s} == {"wb"}, "A's slots removed")
        assert len(left) == 1
    finally:
        ray.shutdown()


def test_slot_class_tells_templates_with_the_same_id_apart(tiny_model):
    """A donor of template "sent" inside another wrapper (or another tenant's text under the same
    id) cannot serve a plain instance (``choose_donor`` compares templates), so it must not count
    as holding that slot class: the worker would never pull a usable donor."""
    eng = engine(tiny_model)
    tok = eng.tokenizer
    wrapped = "System: be brief.\nUser: " + T.replace("{text}", A)
    run(eng, Request("w", encode(tok, wrapped), greedy(), tenant="acme", reuse="approximate", template="sent",
                     template_text=T, template_params={"text": A}))
    assert len(eng.approx.pool) == 1
    plain = treq(tok, "p", B)
    want = eng.needed_slot_class(plain)
    assert want is not None and want != next(iter(eng.approx.pool)).slot_class
    assert eng.approx.match(plain) is None  # indeed unusable here
    run(eng, treq(tok, "p0", A))  # a plain donor of the same slot class: now held
    assert eng.needed_slot_class(treq(tok, "p1", B)) is None


def test_decode_rejects_an_unknown_slot_event_kind():
    import msgpack

    payload = encode_batch("w", 1, BS, [], slot_events=[SlotEvent("added", "t", "c", "acme", "s", 3, "acme")])
    m = msgpack.unpackb(payload, raw=False)
    m["se"][0][0] = 7
    with pytest.raises(ValueError, match="slot event kind"):
        decode_message(msgpack.packb(m, use_bin_type=True))
