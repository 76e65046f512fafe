"""The control plane's background work: idle backoff, coalesced router reports, death watches.

Pure and fake-handle tests (no Ray): ``policies.backoff.Backoff``; the index publisher's
heartbeat backing off while idle and coming back on events, and its index watch forcing a
snapshot; ``Router.batch`` applying reports in order before a question; ``RouterClient``
buffering reports onto the next question or one flush, and calling ``on_restart`` when the
router's epoch changes. The Ray side (the index dropping a killed worker by its death watch
alone, the pool replacing a worker whose engine died without polling) is in
``tests/test_index_cluster.py`` and ``tests/test_worker_replacement.py``.
"""

import asyncio
import concurrent.futures
import types

import pytest

from actors import index_publisher as ip
from actors.index_publisher import IndexPublisher, decode_batch
from actors.router import Router, RouterClient
from engine.block_pool import BlockEvent
from policies.backoff import Backoff
from policies.routing import WorkerLoad

BS = 16


# -- policies.backoff ----------------------------------------------------------------------------
def test_backoff_doubles_while_idle_up_to_the_cap_and_resets_on_change():
    b = Backoff(1.0, 8.0)
    seq, cur = [], None
    for _ in range(6):
        cur = b.next_interval(cur, changed=False)
        seq.append(cur)
    assert seq == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    assert b.next_interval(8.0, changed=True) == 1.0
    assert Backoff(0.5, 0.5).next_interval(0.5, False) == 0.5  # base == cap: a fixed interval
    assert Backoff(1.0, 10.0, factor=3).next_interval(9.0, False) == 10.0
    assert Backoff(1.0, 8.0).next_interval(0.1, False) == 1.0  # never below the base


@pytest.mark.parametrize("args", [(0.0, -1.0), (2.0, 1.0), (-1.0, 1.0), (1.0, 2.0, 0.5)])
def test_backoff_rejects_bad_bounds(args):
    with pytest.raises(ValueError):
        Backoff(*args)


# -- the index publisher's heartbeat -------------------------------------------------------------
class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def _publisher(monkeypatch, events: list, **kw):
    clock = Clock()
    monkeypatch.setattr(ip, "time", types.SimpleNamespace(monotonic=clock))  # the publisher's clock only
    sent = []

    async def drain(full):
        ev, events[:] = list(events), []
        return ev, ([] if full else None)

    async def send(payload, full):
        sent.append(decode_batch(payload))
        return {"ok": True, "epoch": "e"}

    return IndexPublisher("w1", BS, drain, send, **kw), sent, clock


def test_idle_heartbeats_back_off_and_an_event_brings_them_back(monkeypatch):
    events = []
    pub, sent, clock = _publisher(monkeypatch, events, heartbeat_s=1.0, max_heartbeat_s=8.0)

    async def run():
        await pub.flush()  # the first batch is the snapshot
        assert len(sent) == 1 and sent[0].snapshot == ()
        beats = []
        for _ in range(200):  # 20 s of idle flushes at the publisher's 10 Hz
            clock.t += 0.1
            n = len(sent)
            await pub.flush()
            if len(sent) > n:
                beats.append(round(clock.t - 1000.0, 1))
        gaps = [round(b - a, 1) for a, b in zip([0.0] + beats, beats)]
        assert gaps[:5] == [1.0, 2.0, 4.0, 8.0, 8.0][: len(gaps[:5])] and len(beats) == 4
        assert all(not b.events for b in sent[1:])  # heartbeats are empty batches
        events.append(BlockEvent("stored", b"\x01" * 16, None, "t1"))
        clock.t += 0.1
        await pub.flush()
        assert sent[-1].events and pub.heartbeat_due_s == 1.0  # events go out at once; back to base
        n = len(sent)
        clock.t += 0.9
        await pub.flush()
        assert len(sent) == n  # not yet
        clock.t += 0.2
        await pub.flush()
        assert len(sent) == n + 1 and not sent[-1].events  # a heartbeat 1 s after the event

    asyncio.run(run())


def test_a_failed_index_watch_makes_the_next_batch_a_snapshot(monkeypatch):
    events = []
    pub, sent, clock = _publisher(monkeypatch, events, heartbeat_s=1.0, max_heartbeat_s=8.0)
    fired = asyncio.Event

    async def run():
        gate = fired()

        async def watch():
            await gate.wait()
            raise RuntimeError("index died")

        pub.watch = watch
        await pub.flush()
        assert sent[-1].snapshot is not None and not pub.need_snapshot
        for _ in range(30):  # back off to a long heartbeat
            clock.t += 1.0
            await pub.flush()
        assert pub.heartbeat_due_s == 8.0
        task = asyncio.get_running_loop().create_task(pub.watch_index())
        gate.set()
        await asyncio.sleep(0.05)
        assert pub.need_snapshot and pub.heartbeat_due_s == 1.0 and pub.stats["index_restarts_seen"] == 1
        n = len(sent)
        clock.t += 0.1
        await pub.flush()  # no event, no heartbeat due: the snapshot goes anyway
        assert len(sent) == n + 1 and sent[-1].snapshot is not None
        task.cancel()

    asyncio.run(run())


# -- the router actor's batch --------------------------------------------------------------------
def test_router_batch_applies_reports_in_order_then_answers():
    r = Router()
    reports = [("register", ("w0", "n0")), ("register", ("w1", "n1")), ("remove", ("w1",)),
               ("report_load", ("w0", WorkerLoad(waiting_tokens=(100,)))), ("report_decision", ("local",)),
               ("no_such_report", ()), ("report_prefill", ("w0",))]  # bad args: only that sample is lost
    epoch, answer = r.batch(reports, "rank", (64, {"w0": 32}, ["w0"], {}))
    assert epoch == r.epoch and isinstance(answer, list) and answer
    assert set(r.model.nodes) == {"w0"} and r.decisions["local"] == 1
    assert r.batch([("report_decision", ("pulled",))]) == (r.epoch, None)
    assert r.decisions["pulled"] == 1
    with pytest.raises(ValueError):
        r.batch([], "register", ("w9", "n9"))  # a report is not a question
    assert Router().epoch != r.epoch  # a new epoch per (re)start


# -- RouterClient coalescing ---------------------------------------------------------------------
class FakeRef:
    def __init__(self, value):
        self._f = concurrent.futures.Future()
        self._f.set_result(value)

    def future(self):
        return self._f


class FakeHandle:
    """Runs a real Router in process; records every actor call."""

    def __init__(self):
        self.router = Router()
        self.calls = []
        outer = self

        class Method:
            def __init__(self, name):
                self.name = name

            def remote(self, *args):
                outer.calls.append((self.name, args))
                return FakeRef(getattr(outer.router, self.name)(*args))

        self.batch = Method("batch")
        self.register = Method("register")
        self.rank = Method("rank")


def test_reports_ride_on_the_next_question_or_one_flush():
    h = FakeHandle()

    async def run():
        c = RouterClient(h, timeout_s=1.0, flush_s=0.05)
        for i in range(4):
            c.report("register", f"w{i}", f"n{i}")
        c.report("report_load", "w0", WorkerLoad(waiting_tokens=(50,)))
        assert h.calls == []  # buffered
        ranking = await c.rank(64, {}, ["w0", "w1"])
        assert ranking is not None and len(h.calls) == 1  # one call carried 5 reports and the question
        name, (reports, method, _args) = h.calls[0]
        assert name == "batch" and method == "rank" and [r[0] for r in reports] == ["register"] * 4 + ["report_load"]
        assert set(h.router.model.nodes) == {"w0", "w1", "w2", "w3"}  # applied before ranking
        c.report("report_decision", "local")
        c.report("report_outcome", "local", 0.1, 0.2)
        await asyncio.sleep(0.15)  # no question came: one flush after flush_s
        assert len(h.calls) == 2 and h.calls[1][0] == "batch" and len(h.calls[1][1][0]) == 2
        assert h.router.decisions["local"] == 1 and "local" in h.router.metrics()["ttft_error"]
        await asyncio.sleep(0.15)
        assert len(h.calls) == 2  # nothing buffered: no call

    asyncio.run(run())


def test_unbuffered_client_sends_each_report_and_question_alone():
    h = FakeHandle()

    async def run():
        c = RouterClient(h, timeout_s=1.0)
        c.report("register", "w0", "n0")
        assert [n for n, _ in h.calls] == ["register"]
        assert await c.rank(64, {}, ["w0"]) is not None
        assert [n for n, _ in h.calls] == ["register", "rank"]

    asyncio.run(run())


def test_on_restart_fires_when_the_epoch_changes():
    h = FakeHandle()
    seen = []

    async def run():
        c = RouterClient(h, timeout_s=1.0, flush_s=0.05)
        c.on_restart = lambda: seen.append("restart")
        await c.rank(64, {}, None)
        await c.rank(64, {}, None)
        assert seen == []  # the first epoch is not a restart
        h.router = Router()  # the actor came back empty
        await c.rank(64, {}, None)
        assert seen == ["restart"]
        c.report("register", "w0", "n0")
        await asyncio.sleep(0.1)  # a flush's answer is checked too
        h.router = Router()
        c.report("register", "w0", "n0")
        await asyncio.sleep(0.1)
        assert seen == ["restart", "restart"]

    asyncio.run(run())
