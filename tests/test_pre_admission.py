"""A replica's pre-admission (policies/pre_admission.py) refuses only what the controller would.

Three levels: the pure ``LocalAdmission`` against the real ``Admission`` (exact cases and a
hypothesis simulation of replicas, latencies and lease lifetimes: every local refusal is one the
controller would give at that instant); ``ControllerClient`` feeding it around each lease (fake
controller and worker handles, no Ray); and the HTTP ingress (tests/ingress_harness.py): an
over-limit request is refused before its body is read (an invalid body gets 429, not 400) and the
controller never sees it, and the counts return to zero however a request ends.
"""

import asyncio
import copy
import heapq
import json
from types import SimpleNamespace

import httpx
import pytest
from hypothesis import given, settings, strategies as st

from policies.pre_admission import LocalAdmission
from policies.tenancy import Admission, Tenants


def tenants(**limits) -> Tenants:
    return Tenants.from_dict({"tenants": [{"name": "t", "api_keys": ["sk-t"], "limits": limits},
                                          {"name": "free", "api_keys": ["sk-free"]}]})


# -- LocalAdmission alone ------------------------------------------------------------------------
def test_concurrency_held_leases_refuse_and_release():
    local = LocalAdmission(tenants(max_concurrent=2))
    a, b = local.sent("t", 0.0), local.sent("t", 0.0)
    assert local.check("t", 0.0).ok  # sent, not admitted: holds nothing yet
    local.admitted(a, 0.1)
    local.admitted(b, 0.1)
    d = local.check("t", 0.2)
    assert not d.ok and d.reason == "concurrency" and d.retry_after_s > 0
    assert local.check("free", 0.2).ok  # another tenant is not affected
    local.released(a)
    local.released(a)  # idempotent
    assert local.check("t", 0.3).ok and local.held["t"] == 1
    refused = local.sent("t", 0.3)
    local.refused(refused, "concurrency", 1.0, 0.4)
    local.released(refused)  # a refused request holds nothing
    local.released(b)
    assert local.held["t"] == 0 and local.refused_here == 1


def test_rate_refusal_is_remembered_until_a_token_can_exist():
    local = LocalAdmission(tenants(requests_per_s=2.0, burst=1))
    assert local.check("t", 10.0).ok  # no answer yet: the full bucket
    tk = local.sent("t", 10.0)
    local.refused(tk, "rate", 0.4, 10.05)  # the controller: one token in 0.4 s from when it looked
    d = local.check("t", 10.1)
    assert not d.ok and d.reason == "rate" and d.retry_after_s <= 0.3 + 1e-9
    assert local.check("t", 10.4 + 1e-6).ok  # ts + w: the controller may have a token by then


def test_admission_takes_a_token_from_the_bound():
    local = LocalAdmission(tenants(requests_per_s=1.0, burst=2))
    a = local.sent("t", 0.0)
    local.admitted(a, 0.0)
    assert local.check("t", 0.0).ok  # one token left at most
    b = local.sent("t", 0.0)
    local.admitted(b, 0.0)
    d = local.check("t", 0.0)
    assert not d.ok and d.reason == "rate" and d.retry_after_s == pytest.approx(1.0)
    assert local.check("t", 1.0).ok


def test_reset_forgets_the_old_controller_and_update_drops_changed_limits():
    local = LocalAdmission(tenants(max_concurrent=1, requests_per_s=1.0, burst=1))
    a = local.sent("t", 0.0)
    local.admitted(a, 0.0)
    assert not local.check("t", 0.0).ok
    local.reset()  # a new controller counts none of the old leases
    assert local.check("t", 0.0).ok
    local.released(a)  # an old-epoch lease ending changes nothing
    assert local.held.get("t", 0) == 0
    b = local.sent("t", 0.0)
    local.admitted(b, 0.0)
    local.released(b)
    assert not local.check("t", 0.0).ok  # the bucket bound: no token
    local.update(tenants(max_concurrent=1, requests_per_s=5.0, burst=3))  # new limits: a fresh bucket
    assert local.check("t", 0.0).ok


@settings(max_examples=60, deadline=None)
@given(rate=st.sampled_from([0.5, 2.0, 10.0]), burst=st.integers(1, 4), conc=st.integers(1, 3),
       events=st.lists(st.tuples(st.integers(0, 1), st.floats(0.0, 0.5), st.floats(0.0, 0.05),
                                 st.floats(0.0, 0.05), st.floats(0.0, 1.0)), min_size=1, max_size=60))
def test_simulation_local_refusals_are_controller_refusals(rate, burst, conc, events):
    """Two replicas, one controller; each request: arrival gap, send->controller and
    controller->reply latencies, lease duration. Whenever a replica refuses locally, a copy of the
    controller's admission asked at that instant refuses too."""
    ts = tenants(requests_per_s=rate, burst=burst, max_concurrent=conc)
    ctl = Admission(ts)
    replicas = [LocalAdmission(ts), LocalAdmission(ts)]
    q: list = []  # (time, seq, kind, payload)
    seq = 0
    t = 0.0
    for who, gap, d_in, d_out, hold in events:
        t += gap
        heapq.heappush(q, (t, seq, "arrive", (who, d_in, d_out, hold)))
        seq += 1
    local_refusals = 0
    while q:
        now, _, kind, p = heapq.heappop(q)
        if kind == "arrive":
            who, d_in, d_out, hold = p
            local = replicas[who]
            d = local.check("t", now)
            if not d.ok:
                local_refusals += 1
                probe = copy.deepcopy(ctl)
                assert not probe.admit("t", now).ok, "a local refusal the controller would have admitted"
                continue
            ticket = local.sent("t", now)
            heapq.heappush(q, (now + d_in, seq, "controller", (who, ticket, d_out, hold)))
        elif kind == "controller":
            who, ticket, d_out, hold = p
            dec = ctl.admit("t", now)
            heapq.heappush(q, (now + d_out, seq, "reply", (who, ticket, dec, hold)))
        elif kind == "reply":
            who, ticket, dec, hold = p
            if dec.ok:
                replicas[who].admitted(ticket, now)
                heapq.heappush(q, (now + hold, seq, "end", (who, ticket)))
            else:
                replicas[who].refused(ticket, dec.reason, dec.retry_after_s, now)
        elif kind == "end":  # the replica forgets the lease, then the controller gets end()
            who, ticket = p
            replicas[who].released(ticket)
            heapq.heappush(q, (now + 0.01, seq, "ctl_end", None))
        else:
            ctl.release("t")
        seq += 1
    assert all(r.held.get("t", 0) == 0 for r in replicas) and ctl.inflight.get("t", 0) == 0


# -- ControllerClient feeding it (fake controller and worker handles, no Ray) -----------------------
class _Method:
    def __init__(self, fn):
        self.remote = fn


class _Worker:
    """A worker actor whose generate streams ``n`` outputs (the last finished), or raises ``error``."""

    def __init__(self, n: int = 3, error: Exception | None = None):
        self.n, self.error = n, error
        self.generate = _Method(self._generate)
        self.abort = _Method(lambda request_id: None)

    def _generate(self, request, pulls, donor_pulls):
        from engine.sequence import RequestOutput

        async def refs():
            for i in range(self.n):
                async def ref(i=i):
                    if self.error is not None:
                        raise self.error
                    return RequestOutput(request.request_id, [5], "x", i == self.n - 1, None, 20, 0, i + 1)
                yield ref()
        return refs()


class _Controller:
    """The controller handle: ``begin`` answers a lease or raises ``reject``; ``end`` is recorded
    together with the client's held count when it was sent, once it reaches the controller
    (``end_delay_s`` later; None: never), like an actor call: it runs whether or not it is awaited."""

    def __init__(self, client_box: list, worker: _Worker, reject=None, begin_delay_s: float = 0.0,
                 end_delay_s: float | None = 0.0):
        self.ends, self.begins = [], 0

        async def begin(client_id, request, timeout):
            from cluster.controller import Lease
            from cluster.pool import RouteChoice

            self.begins += 1
            await asyncio.sleep(begin_delay_s)
            if reject is not None:
                raise reject
            return Lease(request.request_id, "w0", worker, RouteChoice("w0"))

        self.begin = _Method(begin)
        self.started = _Method(lambda *a: None)

        def end(lid, fin, dead=False, output_tokens=None):
            held = client_box[0].local.held.get("acme", 0)

            async def deliver():
                if end_delay_s is None:
                    await asyncio.Event().wait()
                await asyncio.sleep(end_delay_s)
                self.ends.append((lid, fin, held))
            return asyncio.get_running_loop().create_task(deliver())

        self.end = _Method(end)


def _client(worker: _Worker, **kw):
    from cluster.controller import ControllerClient
    from tests.ingress_harness import TENANTS

    data = json.loads(json.dumps(TENANTS))
    data["tenants"][0]["limits"] = {"max_concurrent": 1, "requests_per_s": 1.0, "burst": 2}
    c = ControllerClient("app", SimpleNamespace(app="app"), data)
    box = [c]
    c.handle = _Controller(box, worker, **kw)
    return c


def _request(rid: str = "r1"):
    from engine.sequence import Request, SamplingParams

    return Request(rid, tuple(range(3, 23)), SamplingParams(max_tokens=4, temperature=0), tenant="acme")


async def test_client_counts_a_lease_while_it_streams_and_releases_before_end():
    c = _client(_Worker(n=3))
    stream = c.generate(_request())
    await stream.__anext__()
    d = c.pre_admit("acme")
    assert not d.ok and d.reason == "concurrency"
    assert c.pre_admit("globex").ok
    async for _ in stream:
        pass
    assert c.local.held["acme"] == 0 and c.pre_admit("acme").ok
    assert c.handle.ends == [("r1", True, 0)]  # end() sent after the replica forgot the lease


async def test_client_releases_on_disconnect_on_worker_error_and_on_cancel():
    import ray

    from cluster.pool import WorkerDied

    c = _client(_Worker(n=50))
    stream = c.generate(_request("gone"))
    await stream.__anext__()
    await stream.aclose()  # the HTTP client went away mid-stream
    assert c.local.held["acme"] == 0
    await asyncio.sleep(0.05)  # its end was sent without waiting: it reaches the controller after
    assert c.handle.ends == [("gone", False, 0)]

    c = _client(_Worker(error=ray.exceptions.ActorDiedError()))
    with pytest.raises(WorkerDied):  # (begun twice: the retry's worker died too)
        await c.generate(_request("dead")).__anext__()
    d = c.pre_admit("acme")  # both leases released; the two begins took the rate bucket's two tokens
    assert c.local.held["acme"] == 0 and c.handle.begins == 2 and not d.ok and d.reason == "rate"

    c = _client(_Worker(), begin_delay_s=5.0)
    task = asyncio.get_running_loop().create_task(c.generate(_request("cancelled")).__anext__())
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert c.local.held.get("acme", 0) == 0 and c.pre_admit("acme").ok


async def test_a_finished_stream_ends_only_once_the_controller_has_ended_its_lease():
    # the client may send its next request at once, to another ingress replica: that replica's
    # begin must not find this lease still open (a spurious 429 at exactly max_concurrent)
    c = _client(_Worker(n=3), end_delay_s=0.2)
    async for _ in c.generate(_request()):
        pass
    assert c.handle.ends == [("r1", True, 0)]


async def test_a_controller_that_never_acknowledges_an_end_does_not_hold_the_stream():
    c = _client(_Worker(n=3), end_delay_s=None)
    c.call_timeout_s = 0.1

    async def drain():
        return [out async for _, _, out in c.generate(_request())]
    outs = await asyncio.wait_for(drain(), 10)
    assert [o.finished for o in outs] == [False, False, True] and c.handle.ends == []
    assert c.local.held["acme"] == 0 and c.pre_admit("acme").ok


class _Ref:
    """Like a Ray ObjectRef: awaiting it again gives the same outcome, and cancelling whoever
    awaits it does not cancel the call."""

    def __init__(self, coro):
        self.task = asyncio.get_running_loop().create_task(coro)

    def __await__(self):
        return asyncio.shield(self.task).__await__()


@pytest.mark.parametrize("answer", ["cancelled", "lease", "rejected"])
async def test_a_client_gone_while_begin_is_in_flight_ends_the_lease_unless_begin_refused(answer):
    # Serve cancels a request's child tasks too: begin's answer can be a TaskCancelledError though
    # the controller opened the lease; the client ends it by its id all the same (before: only
    # after a lease came back, and ~10% of requests cancelled 50-80 ms in leaked their lease)
    import ray

    from cluster.controller import Lease, Rejected
    from cluster.pool import RouteChoice

    c = _client(_Worker())

    async def begin(client_id, request, timeout):
        await asyncio.sleep(0.1)
        if answer == "cancelled":
            raise ray.exceptions.TaskCancelledError()
        if answer == "rejected":
            raise Rejected("concurrency", 1.0)
        return Lease(request.request_id, "w0", None, RouteChoice("w0"))

    c.handle.begin = _Method(lambda *a: _Ref(begin(*a)))
    task = asyncio.get_running_loop().create_task(c.generate(_request("gone-early")).__anext__())
    await asyncio.sleep(0.02)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0.3)
    assert [e[0] for e in c.handle.ends] == ([] if answer == "rejected" else ["gone-early"])
    assert c.local.held.get("acme", 0) == 0 and c.pre_admit("acme").ok


def _controller(**kw):
    import dataclasses

    from cluster.app import AppSettings, pool_config
    from cluster.controller import Controller
    from engine.llm_engine import EngineConfig
    from tests.ingress_harness import TENANTS, TINY

    tenants = Tenants.from_dict(TENANTS)
    cfg = dataclasses.replace(pool_config(AppSettings(model=TINY), tenants), engine=EngineConfig(model=TINY))
    return Controller("local", cfg, TENANTS, **kw)


async def test_an_end_that_reaches_the_controller_while_begin_routes_opens_nothing():
    from cluster.pool import RouteChoice, WorkerUnavailable
    from engine.sequence import Request, SamplingParams

    ctl = _controller()
    routed = asyncio.Event()

    async def acquire(request, timeout):
        await routed.wait()
        return SimpleNamespace(worker_id="w0", actor=None), RouteChoice("w0")

    ctl.pool.acquire = acquire
    req = lambda rid: Request(rid, (5, 6, 7), SamplingParams(max_tokens=2), tenant="acme")  # noqa: E731
    begin = asyncio.get_running_loop().create_task(ctl.begin("replica", req("r1"), 5.0))
    await asyncio.sleep(0.01)
    assert ctl.admission.inflight["acme"] == 1  # admitted, routing
    ctl.end("r1", False)  # its client left; the replica ends it by id, begin has not answered yet
    routed.set()
    with pytest.raises(WorkerUnavailable):
        await begin
    assert not ctl._open and ctl.admission.inflight["acme"] == 0 and "r1" not in ctl._early_ends
    ctl.end("r2", False)  # an end before its begin even started: that begin admits nothing
    with pytest.raises(WorkerUnavailable):
        await ctl.begin("replica", req("r2"), 5.0)
    assert ctl.admission.inflight.get("acme", 0) == 0
    lease = await ctl.begin("replica", req("r3"), 5.0)  # a lease as usual, ended as usual
    assert lease.lease_id == "r3" and ctl.admission.inflight["acme"] == 1
    ctl.end("r3", True)
    assert not ctl._open and ctl.admission.inflight["acme"] == 0 and not ctl._early_ends


class _DiesOnce(_Worker):
    """A worker whose first stream fails after ``after`` outputs (the actor died); later ones run."""

    def __init__(self, n: int = 3, after: int = 0):
        super().__init__(n)
        self.calls, self.after = 0, after

    def _generate(self, request, pulls, donor_pulls):
        import ray

        from engine.sequence import RequestOutput

        self.calls += 1
        fail = self.calls == 1

        async def refs():
            for i in range(self.n):
                async def ref(i=i):
                    if fail and i >= self.after:
                        raise ray.exceptions.ActorDiedError()
                    return RequestOutput(request.request_id, [5], "x", i == self.n - 1, None, 20, 0, i + 1)
                yield ref()
        return refs()


async def test_a_worker_that_dies_before_the_first_output_costs_the_client_nothing():
    from cluster.pool import WorkerDied

    c = _client(_DiesOnce())
    outs = [out async for _, _, out in c.generate(_request("r"))]
    assert [o.num_output_tokens for o in outs] == [1, 2, 3] and outs[-1].finished
    assert c.handle.begins == 2 and [e[0] for e in c.handle.ends] == ["r", "r-retry1"]  # a new lease id
    assert c.local.held.get("acme", 0) == 0
    # after an output has gone out the stream fails: the client holds part of an answer
    c = _client(_DiesOnce(after=1))
    got = []
    with pytest.raises(WorkerDied, match="died; retry the request$"):  # Ray's text (pid, address) is not sent
        async for _, _, out in c.generate(_request("s")):
            got.append(out)
    assert len(got) == 1 and c.handle.begins == 1 and c.local.held.get("acme", 0) == 0


async def test_client_learns_a_rate_refusal():
    from cluster.controller import Rejected

    c = _client(_Worker(), reject=Rejected("rate", 0.8))
    with pytest.raises(Rejected):
        await c.generate(_request()).__anext__()
    d = c.pre_admit("acme")
    assert not d.ok and d.reason == "rate" and 0 < d.retry_after_s <= 0.8
    assert c.local.held.get("acme", 0) == 0


# -- the HTTP ingress ---------------------------------------------------------------------------
LIMITED = {"tenants": [
    {"name": "acme", "api_keys": ["sk-acme"], "cache": {"min_blocks": 8}},  # others may hold 8 of 16 blocks
    {"name": "single", "api_keys": ["sk-single"], "limits": {"max_concurrent": 1}},
    {"name": "pair", "api_keys": ["sk-pair"], "limits": {"max_concurrent": 2}},
    {"name": "slow", "api_keys": ["sk-slow"], "limits": {"requests_per_s": 0.001, "burst": 1}},
]}


@pytest.fixture
async def served(tiny_model, monkeypatch):
    from tests.ingress_harness import make_ingress

    app, ing, engine = make_ingress(tiny_model, monkeypatch, tenants_data=LIMITED, num_blocks=16)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app, raise_app_exceptions=False),
                                 base_url="http://test", timeout=60) as client:
        yield client, ing, engine
    engine.shutdown()


def _post(client, key, content: bytes):
    return client.post("/v1/completions", headers={"Authorization": f"Bearer {key}",
                                                    "Content-Type": "application/json"}, content=content)


def _good(prompt="hello", **kw) -> bytes:
    from tests.ingress_harness import TINY

    return json.dumps({"model": TINY, "prompt": prompt, "max_tokens": 2, "temperature": 0, **kw}).encode()


def _rejected(ing, tenant, reason) -> float:
    return ing.metrics.rejected.labels(tenant=tenant, reason=reason)._value.get()


async def test_over_the_concurrency_limit_is_429_before_the_body_is_read(served):
    from engine.sequence import Request, SamplingParams
    from tests.ingress_harness import pool_idle

    client, ing, engine = served
    held = ing.pool.generate(Request("held", tuple(range(3, 13)), SamplingParams(max_tokens=100, ignore_eos=True),
                                     tenant="single"))
    await held.__anext__()  # "single" holds its one lease
    begun = ing.pool.begun
    r = await _post(client, "sk-single", b"{not json at all")
    assert r.status_code == 429, r.text  # not 400: the body was never read
    assert r.json()["error"]["code"] == "rate_limit_exceeded" and int(r.headers["Retry-After"]) >= 1
    assert ing.pool.begun == begun  # the controller never saw it
    assert _rejected(ing, "single", "concurrency") == 1
    assert (await _post(client, "sk-acme", _good())).status_code == 200  # another tenant is served
    await held.aclose()  # the lease ends (as on a client disconnect)
    assert ing.pool.local.held["single"] == 0
    r = await _post(client, "sk-single", _good())
    assert r.status_code == 200, r.text  # under the limit again: admitted
    assert ing.pool.local.held["single"] == 0 and not any(ing.pool.controller.admission.inflight.values())
    assert await pool_idle(engine)


async def test_over_the_rate_limit_is_429_without_the_controller(served):
    client, ing, engine = served
    begun = ing.pool.begun
    assert (await _post(client, "sk-slow", _good())).status_code == 200  # the bucket's one token, taken here too
    assert ing.pool.begun == begun + 1
    r = await _post(client, "sk-slow", b"\x00garbage")
    assert r.status_code == 429 and ing.pool.begun == begun + 1  # refused here, body unread
    assert r.json()["error"]["code"] == "rate_limit_exceeded" and int(r.headers["Retry-After"]) >= 1
    assert _rejected(ing, "slow", "rate") == 1
    assert (await _post(client, "sk-acme", _good())).status_code == 200


async def test_counts_return_to_zero_after_errors(served):
    from tests.ingress_harness import pool_idle

    client, ing, engine = served
    # admitted, then refused by the engine (200 tokens > the 8 blocks "single" may hold): a 400 after admission
    begun = ing.pool.begun
    r = await _post(client, "sk-single", _good(prompt=list(range(3, 203)), max_tokens=1))
    assert ing.pool.begun == begun + 1
    assert r.status_code == 400, r.text
    assert ing.pool.local.held["single"] == 0 and not any(ing.pool.controller.admission.inflight.values())
    r = await _post(client, "sk-single", _good(stream=True))  # streamed to the end
    assert r.status_code == 200 and "[DONE]" in r.text
    assert ing.pool.local.held["single"] == 0
    assert (await _post(client, "sk-single", b"[1, 2]")).status_code == 400  # invalid body, under the limit
    assert ing.pool.local.held["single"] == 0 and (await _post(client, "sk-single", _good())).status_code == 200
    assert await pool_idle(engine)


async def test_an_early_retry_gets_the_same_429_held_and_the_first_one_at_once(served):
    from policies.reject_delay import RejectionDelay

    client, ing, engine = served
    ing.reject_delay = RejectionDelay(max_delay_s=0.05, max_held=8)  # the default holds 1 s
    assert (await _post(client, "sk-slow", _good())).status_code == 200
    first = await _post(client, "sk-slow", _good())
    assert first.status_code == 429 and ing.reject_delay.num_delayed == 0  # first refusal: sent at once
    again = await _post(client, "sk-slow", _good())  # inside its Retry-After: held, then the same refusal
    assert again.status_code == 429 and ing.reject_delay.num_delayed == 1 and ing.reject_delay.held == 0
    assert again.json() == first.json() and int(again.headers["Retry-After"]) >= 1
    assert (await _post(client, "sk-acme", _good())).status_code == 200  # another tenant: not held
    assert ing.reject_delay.num_delayed == 1 and _rejected(ing, "slow", "rate") == 2
    from tests.ingress_harness import pool_idle

    assert await pool_idle(engine)


def _held(ing, tenant: str, rid: str = "held"):
    from engine.sequence import Request, SamplingParams

    return ing.pool.generate(Request(rid, tuple(range(3, 13)), SamplingParams(max_tokens=100, ignore_eos=True),
                                     tenant=tenant))


def _idle_leases(ing) -> bool:
    return not any(ing.pool.local.held.values()) and not any(ing.pool.controller.admission.inflight.values())


async def test_a_batch_larger_than_the_concurrency_limit_runs_its_prompts_in_turn(served):
    from tests.ingress_harness import pool_idle

    client, ing, engine = served
    begun = ing.pool.begun
    r = await _post(client, "sk-single", _good(prompt=["one", "two", "three"], max_tokens=3))
    assert r.status_code == 200, r.text  # before: a 429 that no retry could fix (3 prompts, 1 lease)
    choices = r.json()["choices"]
    assert sorted(c["index"] for c in choices) == [0, 1, 2] and all(c["finish_reason"] for c in choices)
    assert r.json()["usage"]["completion_tokens"] == 9
    assert ing.pool.begun == begun + 3  # one prompt in flight at a time: never refused
    assert _rejected(ing, "single", "concurrency") == 0 and _idle_leases(ing)
    r = await _post(client, "sk-single", _good(prompt=["four", "five"], max_tokens=2, stream=True))
    assert r.status_code == 200 and r.text.count('"finish_reason": "length"') == 2 and "[DONE]" in r.text
    assert _idle_leases(ing) and await pool_idle(engine)


async def test_a_batch_waits_for_leases_another_request_holds_and_fails_only_when_none_is_free(served):
    from tests.ingress_harness import pool_idle

    client, ing, engine = served
    held = _held(ing, "pair")
    await held.__anext__()  # another request of "pair" holds one of its two leases
    begun = ing.pool.begun
    r = await _post(client, "sk-pair", _good(prompt=["a", "b", "c"], max_tokens=2))
    assert r.status_code == 200, r.text  # the batch ran through the one lease left
    assert len(r.json()["choices"]) == 3
    assert ing.pool.begun > begun + 3  # the second prompt was refused while the first ran, then admitted
    held2 = _held(ing, "pair", "held2")
    await held2.__anext__()  # now both leases are held: nothing of a batch can run
    begun = ing.pool.begun
    r = await _post(client, "sk-pair", _good(prompt=["a", "b"], max_tokens=2))
    assert r.status_code == 429 and ing.pool.begun == begun  # refused by pre-admission, as a single prompt
    # the controller's own refusal of every prompt (another replica's leases: pre-admission cannot know)
    ing.pool.pre_admit = lambda tenant: SimpleNamespace(ok=True)
    r = await _post(client, "sk-pair", _good(prompt=["a", "b"], max_tokens=2))
    assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
    assert ing.pool.begun == begun + 2  # asked once each, refused, not retried
    await held.aclose()
    await held2.aclose()
    assert _idle_leases(ing) and await pool_idle(engine)
    # a rate-limited tenant's bucket holds one token: the second prompt cannot be admitted for
    # ~1000 s, longer than the batch waits, so the batch is a 429 (its first prompt's lease ended)
    r = await _post(client, "sk-slow", _good(prompt=["x", "y"], max_tokens=2))
    assert r.status_code == 429, r.text
    assert _idle_leases(ing) and await pool_idle(engine)


async def test_a_whole_response_whose_client_went_away_counts_as_499(served):
    from tests.ingress_harness import pool_idle

    client, ing, engine = served
    task = asyncio.get_running_loop().create_task(_post(client, "sk-acme", _good(max_tokens=200, ignore_eos=True)))
    for _ in range(500):  # until its first token has come: the response is being assembled
        await asyncio.sleep(0.01)
        if ing.metrics.ttft.labels(tenant="acme")._sum.get() > 0:
            break
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    count = ing.metrics.requests.labels(tenant="acme", endpoint="completions", code="499")._value.get()
    assert count == 1
    assert ing.metrics.requests.labels(tenant="acme", endpoint="completions", code="200")._value.get() == 0
    for _ in range(100):
        if _idle_leases(ing):
            break
        await asyncio.sleep(0.01)
    assert _idle_leases(ing) and await pool_idle(engine)


@pytest.fixture(autouse=True, scope="module")
def _leave_no_ray_behind():
    """The fake-handle client tests reach ``ray.cancel`` in ``stream_outputs``' clean-up, which
    starts a local Ray when none runs; shut it down so later modules can ``ray.init`` their own."""
    import ray

    was = ray.is_initialized()
    yield
    if not was and ray.is_initialized():
        ray.shutdown()


class _DictStore:
    """``TemplateStore`` over a dict (Ray's GCS in the app)."""

    def __init__(self):
        self.d = {}

    def load(self):
        return dict(self.d)

    def put(self, tenant, template_id, text):
        self.d[(tenant, template_id)] = text

    def delete(self, tenant, template_id):
        self.d.pop((tenant, template_id), None)


def test_registered_templates_outlive_a_controller_crash_not_a_deleted_app():
    store = _DictStore()
    ctl = _controller(template_store=store)
    ctl.register_template("acme", "fr", "Translate to French: {text}")
    ctl.register_template("acme", "fr", "Traduis : {text}")  # replaced, in the store too
    ctl.register_template("globex", "sum", "Summarize: {text}")
    again = _controller(template_store=store)  # the actor crashed; the next call made it anew
    assert again.template("acme", "fr") == "Traduis : {text}" and again.template("globex", "sum") == "Summarize: {text}"
    assert _controller(template_store=None).template("acme", "fr") is None  # (no store: none)
    again.clients["replica"] = SimpleNamespace(last_seen=0.0, leases=set())
    again._spawn = lambda coro: coro.close()  # (the shutdown task: not in this test)
    again.reap(now=1000.0)  # a replica silent too long (crashed): stopped, the templates kept
    assert again._closing and store.d
    last = _controller(template_store=store)
    last._spawn = lambda coro: coro.close()
    last.detach("gone-replica")
    last._detached_at = 0.0
    last.reap(now=1000.0)  # the last replica detached and none came back (the app was deleted)
    assert last._closing and not store.d
