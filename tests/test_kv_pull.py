"""KV pulls: export/import between engines, and a routed pull across two Ray nodes on loopback."""

import asyncio
import os
import time

import numpy as np
import pytest

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

from engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from engine.sequence import Request, SamplingParams  # noqa: E402

CFG = EngineConfig(model="tiny-llama", num_blocks=64, max_num_batched_tokens=256)
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PREFIX = tuple((7 * i) % 250 + 3 for i in range(70))


def ids(outs):
    return [t for o in outs for t in o.new_token_ids]


def reference(loaded, prompt):
    eng = LLMEngine(CFG, loaded=loaded)
    return ids(eng.generate([Request("ref", prompt, GREEDY, reuse="none")])["ref"])


def test_export_import_between_engines_reuses_exactly(tiny_model):
    a, b = LLMEngine(CFG, loaded=tiny_model), LLMEngine(CFG, loaded=tiny_model)
    a.generate([Request("warm", PREFIX + (9, 9, 9), GREEDY, tenant="t1")])
    prompt = PREFIX + (5, 6, 7, 8)
    req = Request("r", prompt, GREEDY, tenant="t1")
    chains = b.prompt_chains(req)
    assert b.held_prefix_tokens(chains) == 0 and a.held_prefix_tokens(chains) == 64
    data = a.export_prefix(chains, 0, 4)
    assert data.num_blocks == 4 and data.positions == (0, 16, 32, 48)
    assert b.import_prefix(data, 0, chains, "t1") == 64
    assert b.import_prefix(data, 0, chains, "t1") == 0  # already cached: nothing new
    c = LLMEngine(CFG, loaded=tiny_model)
    c.generate([Request("half", PREFIX[:33], GREEDY, tenant="t1")])  # caches blocks 0-1 itself
    assert c.held_prefix_tokens(chains) == 32
    assert c.import_prefix(data, 0, chains, "t1") == 32  # imports only blocks 2-3
    assert ids(c.generate([Request("r2", prompt, GREEDY, tenant="t1")])["r2"]) == reference(tiny_model, prompt)
    out = b.generate([req])["r"]
    assert out[-1].num_cached_tokens == 64
    assert ids(out) == reference(tiny_model, prompt)
    b.pool.check_invariants()


def test_a_pull_that_cannot_land_whole_is_refused_up_front(tiny_model):
    """Chunks import one by one; if the whole range cannot fit at once, later chunks would evict
    the earlier ones (and other cached prefixes) for nothing: ``can_import`` says no first."""
    a = LLMEngine(CFG, loaded=tiny_model)
    small = LLMEngine(EngineConfig(model="tiny-llama", num_blocks=6, max_num_batched_tokens=256), loaded=tiny_model)
    prompt = PREFIX + tuple(range(60))  # 8 full blocks
    a.generate([Request("warm", prompt + (1,), GREEDY, tenant="t1")])
    chains = small.prompt_chains(Request("r", prompt + (2,), GREEDY, tenant="t1"))
    assert not small.can_import(chains, 0, 8, "t1")
    assert small.can_import(chains, 0, 4, "t1")
    assert small.import_prefix(a.export_prefix(chains, 0, 4), 0, chains, "t1") == 64
    # 4 held (idle, so counted as free): 4 more would have to evict them
    assert not small.can_import(chains, 0, 8, "t1") and not small.can_import(chains, 4, 8, "t1")
    assert small.can_import(chains, 4, 6, "t1")


def test_import_verifies_hashes_model_and_isolation(tiny_model):
    a, b = LLMEngine(CFG, loaded=tiny_model), LLMEngine(CFG, loaded=tiny_model)
    a.generate([Request("warm", PREFIX + (9,), GREEDY, tenant="t1")])
    req = Request("r", PREFIX + (1, 2), GREEDY, tenant="t1")
    chains = b.prompt_chains(req)
    data = a.export_prefix(chains, 0, 4)
    other = b.prompt_chains(Request("o", tuple(reversed(PREFIX)) + (1, 2), GREEDY, tenant="t1"))
    free = b.pool.num_free_blocks()
    with pytest.raises(ValueError, match="hash chain"):
        b.import_prefix(data, 0, other, "t1")  # KV of other tokens
    with pytest.raises(ValueError, match="positions"):
        b.import_prefix(data, 1, chains, "t1")  # shifted
    from dataclasses import replace

    with pytest.raises(ValueError, match="model"):
        b.import_prefix(replace(data, model_id="another-model"), 0, chains, "t1")
    assert b.pool.num_free_blocks() == free and not b.pool._cached
    # another tenant's chains (no grant) cannot name tenant t1's blocks
    assert a.export_prefix(b.prompt_chains(Request("x", req.prompt_ids, GREEDY, tenant="t2")), 0, 4) is None
    # with a grant (t2 reads t1's domain) they can
    granted = b.prompt_chains(Request("y", req.prompt_ids, GREEDY, tenant="t2", read_domains=("t1",)))
    assert a.export_prefix(granted, 0, 4).num_blocks == 4


def test_an_export_racing_an_eviction_ends_before_the_first_overwritten_block(tiny_model):
    """Exports run off the engine thread, so the engine may evict and overwrite a block while it
    is copied: the export ends before the first block that left the cache meanwhile."""
    a = LLMEngine(CFG, loaded=tiny_model)
    a.generate([Request("warm", PREFIX + (9, 9, 9), GREEDY, tenant="t1")])
    chains = a.prompt_chains(Request("r", PREFIX + (5,), GREEDY, tenant="t1"))
    clean = a.export_prefix(chains, 0, 4)
    assert clean.num_blocks == 4 and a.export_races == 0
    copy, taken = a.cache.export_blocks, []

    def racing(*args, **kw):  # the engine thread, mid-copy: evicts two cached blocks and writes them
        out = copy(*args, **kw)
        free_list = a.pool.num_free_blocks() - len(a.kv.held_blocks(chains))
        taken.extend(a.pool.allocate(free_list + 2, "t2"))
        for layer in range(a.cache.num_layers):
            pk, pv = a.cache.paged(layer)
            pk[[b.block_id for b in taken]] = 1e3
        return out

    a.cache.export_blocks = racing
    data = a.export_prefix(chains, 0, 4)
    assert a.export_races == 1
    assert data.num_blocks == 2 and data.positions == (0, 16)  # the tail blocks are evicted first
    assert np.array_equal(data.k, clean.k[:, :2]) and np.array_equal(data.v, clean.v[:, :2])
    a.pool.free(taken)
    taken.clear()
    a.cache.export_blocks = lambda *args, **kw: (out := copy(*args, **kw), a.pool.reset_prefix_cache())[0]
    assert a.export_prefix(chains, 0, 2) is None and a.export_races == 2  # every block left: nothing
    a.pool.check_invariants()


@pytest.mark.ray
def test_a_busy_holder_serves_a_pull_without_its_engine_thread(tiny_model):
    """A pull's holder is usually busy (that is why the prompt goes elsewhere): its export does
    not wait for the step in progress. The holder's engine thread is stalled for longer than the
    pull may take; the pull still lands whole and the output equals a recompute."""
    import ray

    from actors.worker import Pull, worker_actor_class

    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        W = worker_actor_class(num_gpus=0, num_cpus=0)
        holder, target = W.remote("h", CFG), W.remote("t", CFG, 30.0, 1)  # 1-block chunks: 4 exports
        ray.get([holder.ready.remote(), target.ready.remote()])
        ray.get(holder.generate_all.remote(Request("warm", PREFIX + (9, 9), GREEDY, tenant="t1")))
        ray.get(holder.set_faults.remote(["engine_stall:120"]))
        prompt = PREFIX + (5, 6, 7)
        outs = ray.get(target.generate_all.remote(Request("r", prompt, GREEDY, tenant="t1"),
                                                  (Pull(holder, "n", 0, 4, timeout_s=20.0),)), timeout=60)
        assert outs[-1].pulled_tokens == 64 and ids(outs) == reference(tiny_model, prompt)
    finally:
        if started:
            ray.shutdown()


@pytest.mark.ray

def settled_bytes_pulled(router_actor) -> int:
    """The router's ``bytes_pulled`` once the workers' buffered reports of earlier pulls have
    landed (a worker sends its reports with its next question, else after
    ``ROUTER_REPORT_FLUSH_S``): unchanged for 4 flush intervals."""
    import ray

    from actors.worker import ROUTER_REPORT_FLUSH_S

    deadline = time.monotonic() + 30
    last, since = None, time.monotonic()
    while True:
        cur = ray.get(router_actor.metrics.remote())["bytes_pulled"]
        if cur != last:
            last, since = cur, time.monotonic()
        elif time.monotonic() - since >= 4 * ROUTER_REPORT_FLUSH_S:
            return cur
        assert time.monotonic() < deadline, "the router's pull count never settled"
        time.sleep(0.05)


def test_router_pulls_to_idle_node_and_falls_back_on_failure(tiny_model):
    import ray
    from ray.cluster_utils import Cluster

    from actors.index_actor import get_or_create_index, lookup_with_timeout
    from actors.prefix_index import prompt_chains
    from actors.router import RouterClient, get_or_create_router
    from actors.worker import Pull, worker_actor_class
    from cluster.pool import WorkerState
    from cluster.routing import CostAwareRouter
    from policies.replication import ReplicationConfig
    from policies.routing import CostConfig

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"node_c": 1}})
    try:
        c.add_node(num_cpus=1, resources={"node_a": 1})
        c.add_node(num_cpus=1, resources={"node_b": 1})
        c.wait_for_nodes()
        ray.init(address=c.address, namespace="kvmesh-pull-test", log_to_driver=False)
        index = get_or_create_index(16, liveness_s=0.5)
        W = worker_actor_class(num_gpus=0, num_cpus=1)
        wa = W.options(resources={"node_a": 1}).remote("wa", CFG)
        wb = W.options(resources={"node_b": 1}).remote("wb", CFG)
        ia, ib = ray.get([wa.ready.remote(), wb.ready.remote()], timeout=120)
        wc = W.options(resources={"node_c": 1}).remote("wc", CFG)
        ic = ray.get(wc.ready.remote(), timeout=120)
        assert len({ia["node_id"], ib["node_id"], ic["node_id"]}) == 3
        router_actor = get_or_create_router(CostConfig(block_size=16, bytes_per_token=ia["kv_bytes_per_token"]))
        ray.get([w.start_index_publisher.remote(0.05, 0.2) for w in (wa, wb, wc)], timeout=60)
        ray.get([router_actor.register.remote("wa", ia["node_id"]), router_actor.register.remote("wb", ib["node_id"])])

        states = {"wa": WorkerState("wa", wa, ia, queued={"load": 10**6}),  # A artificially loaded
                  "wb": WorkerState("wb", wb, ib),
                  "wc": WorkerState("wc", wc, ic, queued={"load": 10**5})}  # C busy, less than A
        router = CostAwareRouter(ia["model_id"], 16, index, RouterClient(router_actor, timeout_s=10.0),
                                 states.get, timeout_s=10.0, replication=ReplicationConfig(threshold=1))

        def wait_for(prefix, holdings):
            chains = prompt_chains(prefix + (1,), 16, ia["model_id"], ["t1"])
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                if asyncio.run(lookup_with_timeout(index, chains, 10.0)) == holdings:
                    return
                time.sleep(0.1)
            raise AssertionError(f"the index never showed {holdings}")

        def warm_and_wait(prefix):
            ray.get(wa.generate_all.remote(Request(f"warm{prefix[0]}", prefix + (9, 9), GREEDY, tenant="t1")))
            wait_for(prefix, {"wa": 64})

        # 1. prefix cached on A, A loaded: routed to B, which pulls A's blocks. The decision is
        # made on the router's priors (workers report measurements only from here on), so it
        # does not depend on how fast this machine happens to be.
        warm_and_wait(PREFIX)
        prompt = PREFIX + (5, 6, 7, 8)
        req = Request("p1", prompt, GREEDY, tenant="t1")
        choice = asyncio.run(router.choose(req, list(states.values())))
        assert choice.worker_id == "wb" and choice.route == "pulled" and choice.pulls
        ray.get([w.attach_router.remote(router_actor) for w in (wa, wb)])
        outs = ray.get(wb.generate_all.remote(req, choice.pulls), timeout=60)
        assert outs[-1].route == "pulled" and outs[-1].pulled_tokens == 64 and outs[-1].pull_outcome == "landed"
        assert ids(outs) == reference(tiny_model, prompt)
        # the pull made the prefix hot (threshold 1): it was replicated ahead of demand to C
        wait_for(PREFIX, {"wa": 64, "wb": 64, "wc": 64})
        assert router.replication.replications == 1

        # 2. the holder fails to export: B recomputes, same output
        prefix2 = tuple((11 * i) % 250 + 3 for i in range(70))
        warm_and_wait(prefix2)
        ray.get(wa.set_faults.remote(["export"]))
        prompt2 = prefix2 + (4, 4)
        req2 = Request("p2", prompt2, GREEDY, tenant="t1")
        pulls2 = (Pull(wa, ia["node_id"], 0, 4),)
        outs2 = ray.get(wb.generate_all.remote(req2, pulls2), timeout=60)
        assert outs2[-1].route == "recomputed" and outs2[-1].pulled_tokens == 0 and outs2[-1].pull_outcome == "failed"
        assert ray.get(wb.stats.remote())["pulls"]["failed"] == 1
        assert ids(outs2) == reference(tiny_model, prompt2)

        # light probes: B measures its link from A; the router learns it without counting pulls
        key = f"{ia['node_id']}->{ib['node_id']}"
        before = settled_bytes_pulled(router_actor)
        samples = ray.get(router_actor.estimates.remote())["links"].get(key, {}).get("samples", 0)
        probed = ray.get(wb.probe.remote([(ia["node_id"], wa), (ib["node_id"], wb)], 1 << 17))
        assert list(probed) == [ia["node_id"]]  # never itself
        deadline = time.monotonic() + 30  # the worker's report is fire and forget
        while ray.get(router_actor.estimates.remote())["links"][key]["samples"] == samples:
            assert time.monotonic() < deadline, "the probe never reached the router"
            time.sleep(0.05)
        assert ray.get(router_actor.estimates.remote())["links"][key]["samples"] == samples + 1
        assert ray.get(router_actor.metrics.remote())["bytes_pulled"] == before

        metrics = ray.get(router_actor.metrics.remote())
        assert metrics["bytes_pulled"] > 0 and metrics["pull_failures"] >= 1
        assert metrics["decisions"].get("pulled", 0) >= 1
    finally:
        ray.shutdown()
        c.shutdown()


@pytest.mark.ray
def test_chunked_pull_imports_in_order_and_stops_at_the_first_missing_chunk(tiny_model):
    """Pulls are fetched in chunks (here one block each, all requested at once): every chunk is
    imported; when the holder lacks a chunk the pull ends there and the rest is recomputed;
    outputs equal a recompute either way."""
    import ray

    from actors.worker import Pull, worker_actor_class

    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        W = worker_actor_class(num_gpus=0, num_cpus=0)
        holder, target = W.remote("h", CFG), W.remote("t", CFG, 30.0, 1)  # 1-byte chunks: 1 block each
        ray.get([holder.ready.remote(), target.ready.remote()])
        ray.get(holder.generate_all.remote(Request("warm", PREFIX + (9, 9), GREEDY, tenant="t1")))
        prompt = PREFIX + (5, 6, 7)
        outs = ray.get(target.generate_all.remote(Request("r", prompt, GREEDY, tenant="t1"), (Pull(holder, "n", 0, 4),)))
        assert outs[-1].pulled_tokens == 64 and outs[-1].num_cached_tokens == 64
        assert ids(outs) == reference(tiny_model, prompt)
        assert ray.get(holder.stats.remote())["exports"] == {"calls": 4, "blocks": 4}
        # a holder with only blocks 0-1 of another prompt: chunks 2-3 come back empty
        other = tuple(t + 1 for t in PREFIX[:40])
        ray.get(holder.generate_all.remote(Request("warm2", other[:33], GREEDY, tenant="t1")))
        prompt2 = other + (4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4)
        outs = ray.get(target.generate_all.remote(Request("r2", prompt2, GREEDY, tenant="t1"), (Pull(holder, "n", 0, 4),)))
        assert outs[-1].pulled_tokens == 32
        assert ids(outs) == reference(tiny_model, prompt2)
        assert ray.get(holder.stats.remote())["exports"] == {"calls": 8, "blocks": 6}
        # an 8-block pull from a holder with only 2 of them: the window (2 chunks ahead) stops the
        # requests after the first missing chunk: 4 export calls, not 8
        third = tuple(t + 2 for t in PREFIX[:40])
        ray.get(holder.generate_all.remote(Request("warm3", third[:33], GREEDY, tenant="t1")))
        prompt3 = third + tuple(range(10, 110))
        outs = ray.get(target.generate_all.remote(Request("r3", prompt3, GREEDY, tenant="t1"), (Pull(holder, "n", 0, 8),)))
        assert outs[-1].pulled_tokens == 32 and ids(outs) == reference(tiny_model, prompt3)
        assert ray.get(holder.stats.remote())["exports"] == {"calls": 12, "blocks": 8}
        # an abort that arrives while the request is still pulling: the request never runs
        ray.get(target.abort.remote("gone"))
        assert ray.get(target.generate_all.remote(Request("gone", prompt, GREEDY, tenant="t1"))) == []
        ray.get(target.abort.remote("gone2"))  # ... also one with a pull: what it held for it is let go
        assert ray.get(target.generate_all.remote(Request("gone2", prompt, GREEDY, tenant="t1"),
                                                  (Pull(holder, "n", 0, 4),))) == []
        stats = ray.get(target.stats.remote())
        assert stats["free_blocks"] == stats["num_blocks"]  # imported blocks are cached, none pinned
        assert stats["import_holds"]["active"] == 0 and stats["import_holds"]["released"] == 1
    finally:
        if started:
            ray.shutdown()


def test_bfloat16_engines_on_cpu_share_and_pull_a_prefix():
    """``dtype: bfloat16`` on a CPU (the fast path on AMX hosts, ``bench/dtype.py``): the cache
    is hit and a pulled prefix lands bit for bit, so the puller answers exactly as the holder
    does from its own cache (both compute the same suffix on the same KV)."""
    import torch

    from engine.model_loader import load_model

    loaded = load_model("tiny-llama", dtype=torch.bfloat16)
    assert loaded.model_id.endswith(":bfloat16") and next(loaded.model.parameters()).dtype == torch.bfloat16
    cfg = EngineConfig(model="tiny-llama", num_blocks=64, max_num_batched_tokens=256, dtype="bfloat16")
    a, b = LLMEngine(cfg, loaded=loaded), LLMEngine(cfg, loaded=loaded)
    assert a.cache.k[0].dtype == torch.bfloat16
    a.generate([Request("warm", PREFIX + (9, 9, 9), GREEDY, tenant="t1")])
    prompt = PREFIX + (5, 6, 7, 8)
    held = a.generate([Request("a", prompt, GREEDY, tenant="t1")])["a"]
    assert held[-1].num_cached_tokens == 64
    req = Request("b", prompt, GREEDY, tenant="t1")
    chains = b.prompt_chains(req)
    data = a.export_prefix(chains, 0, 4)
    assert data.dtype == "bfloat16" and data.num_blocks == 4
    assert b.import_prefix(data, 0, chains, "t1") == 64
    pulled = b.generate([req])["b"]
    assert pulled[-1].num_cached_tokens == 64
    assert ids(pulled) == ids(held) and len(ids(pulled)) == GREEDY.max_tokens
    a.pool.check_invariants()
    b.pool.check_invariants()
