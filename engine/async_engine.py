"""An asyncio face for LLMEngine: the engine steps in its own thread, callers stream outputs.

Torch work releases the GIL, so one engine thread keeps an event loop (a Ray actor's or a
web server's) responsive. All engine calls happen on the engine thread; callers only post
commands and read per-request queues, so the engine needs no locks. The one exception is the
grammar cache (thread-safe): a request's ``response_format`` grammar compiles on a thread of its
own before the request is queued, so a slow compile never holds up other requests' steps.

Failures: a request that fails alone inside a step gets its last output with ``error`` set
(``LLMEngine._fail``); the loop goes on. A step that raises without naming a request fails every
request in flight (they are aborted, freeing their blocks) and the loop goes on only if the
block pool's accounting then checks out exact with nothing in use; otherwise, or when the step
keeps failing (``EngineBroken``), the loop dies. A dead loop is final and visible: ``alive`` is
False, every waiter and every later ``call``/``generate`` gets ``EngineDead`` at once (never a
hang), so the worker reports itself unhealthy and the pool replaces it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator, Callable

from engine.grammar_compile import lower_priority
from engine.llm_engine import EngineBroken, EngineConfig, LLMEngine
from engine.model_loader import LoadedModel
from engine.redact import describe_exc
from engine.sequence import InvalidRequest, Request, RequestOutput


log = logging.getLogger(__name__)


class EngineDead(RuntimeError):
    """The engine loop has died; this engine serves nothing any more (replace the worker)."""


class EngineStepFailed(RuntimeError):
    """An engine step failed without naming a request: every request in flight was ended."""


MAX_UNATTRIBUTED_FAILURES = 3  # step failures in a row not tied to one request before the loop dies


def _settle(fut: asyncio.Future, result, exc: BaseException | None) -> None:
    if fut.done():  # the caller gave up (cancelled)
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


class AsyncEngine:
    def __init__(self, config: EngineConfig = EngineConfig(), loaded: LoadedModel | None = None,
                 engine: LLMEngine | None = None):
        self.engine = engine or LLMEngine(config, loaded)
        self._commands: queue.Queue[tuple[Callable[[], None], Callable[[BaseException], None]]] = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._error: BaseException | None = None
        self._kill: BaseException | None = None  # test hook (``die``): the loop raises this next
        self._stop = False
        self.step_failures = 0  # unattributed step failures survived (all in-flight requests ended)
        self._thread = threading.Thread(target=self._loop, name="kvmesh-engine", daemon=True)
        self._thread.start()
        # response_format grammars compile here, one at a time, never on the engine thread: a big
        # schema takes seconds (engine/grammar.py) that every other request would otherwise wait
        self._grammar_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvmesh-grammar",
                                                initializer=lower_priority)  # the engine's steps first

    @property
    def alive(self) -> bool:
        """The engine loop runs (False for good once it died, or once ``die`` ordered its end)."""
        return self._error is None and self._kill is None and self._thread.is_alive()

    @property
    def error(self) -> BaseException | None:
        return self._error if self._error is not None else self._kill

    def die(self, exc: BaseException) -> None:
        """Fault injection: end the engine loop with ``exc`` as if a step had raised it fatally."""
        self._kill = exc
        self._commands.put((lambda: None, lambda _e: None))  # wake an idle loop

    def stall(self, seconds: float) -> None:
        """Fault injection: the engine thread sleeps ``seconds`` at its next step boundary, as
        during one long step (calls that need the thread wait; nothing is lost)."""
        self._commands.put((lambda: time.sleep(seconds), lambda _e: None))

    # -- engine thread ---------------------------------------------------------------------
    def _apply_nice(self) -> None:
        """Add ``config.thread_nice`` to this (the engine) thread's niceness; a refusal is logged."""
        n = self.engine.config.thread_nice
        if not n:
            return
        try:
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + n)
        except (OSError, AttributeError) as e:  # no permission for < 0 (not root), or not Linux
            log.warning("engine thread niceness %+d not applied: %s", n, e)

    def _loop(self) -> None:
        failures = 0
        self._apply_nice()
        try:
            while not self._stop:
                if self._kill is not None:
                    raise self._kill
                block = not self.engine.has_work()
                try:
                    cmd = self._commands.get(timeout=0.05) if block else self._commands.get_nowait()
                except queue.Empty:
                    cmd = None
                while cmd is not None:
                    if self._kill is not None:  # ordered to die: this command fails with the rest
                        self._commands.put(cmd)
                        raise self._kill
                    cmd[0]()
                    try:
                        cmd = self._commands.get_nowait()
                    except queue.Empty:
                        cmd = None
                if self._kill is not None:
                    raise self._kill
                try:
                    outs = self.engine.step()
                except EngineBroken:
                    raise
                except Exception as e:  # noqa: BLE001 - not tied to one request: end them all, check, go on
                    failures += 1
                    if failures >= MAX_UNATTRIBUTED_FAILURES or not self._recover(e):
                        raise
                    continue
                failures = 0
                for out in outs:
                    self._deliver(out)
        except BaseException as e:  # noqa: BLE001 - surfaced to every waiter and every later call
            self._error = e
            log.error("engine loop died: %s", describe_exc(e, traceback=True))
            for rid in list(self._streams):
                self._deliver_exc(rid, EngineDead(f"engine loop died: {describe_exc(e)}"))
            self._fail_pending()

    def _recover(self, err: BaseException) -> bool:
        """After a step raised ``err`` without naming a request: abort every request in flight
        (their streams get ``EngineStepFailed``) and report whether the pool's accounting is exact
        with nothing in use, i.e. whether the engine may go on."""
        log.warning("engine step failed: ending the %d requests in flight: %s", len(self.engine.seqs),
                    describe_exc(err, traceback=True))
        try:
            for rid in list(self.engine.seqs):
                self.engine.abort(rid)
                self._deliver_exc(rid, EngineStepFailed(
                    f"an engine step failed ({type(err).__name__}); the request was ended, retry it"))
            self.engine.pool.check_invariants()
            ok = self.engine.pool.num_in_use() == 0 and not self.engine.scheduler.has_unfinished()
        except Exception as e:  # noqa: BLE001 - cannot even clean up: the loop dies
            log.error("engine recovery failed: %s", describe_exc(e, traceback=True))
            return False
        self.step_failures += ok
        return ok

    def _fail_pending(self) -> None:
        """Fail every queued command with EngineDead (the loop will never run them)."""
        exc = EngineDead(f"engine loop died: {self._error!r}")
        while True:
            try:
                _, fail = self._commands.get_nowait()
            except queue.Empty:
                return
            fail(exc)

    def _deliver(self, out: RequestOutput) -> None:
        entry = self._streams.get(out.request_id)
        if entry is None:
            return
        loop, q = entry
        loop.call_soon_threadsafe(q.put_nowait, out)
        if out.finished:
            self._streams.pop(out.request_id, None)

    def _deliver_exc(self, request_id: str, exc: BaseException) -> None:
        entry = self._streams.pop(request_id, None)
        if entry is not None:
            entry[0].call_soon_threadsafe(entry[1].put_nowait, exc)

    # -- caller side -----------------------------------------------------------------------
    def call(self, fn: Callable[[LLMEngine], object]) -> "asyncio.Future":
        """Run ``fn(engine)`` on the engine thread; await the result (EngineDead once the loop died)."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        if not self.alive:
            fut.set_exception(EngineDead(f"engine loop died: {self.error!r}" if self.error else "engine loop stopped"))
            return fut

        def run():
            try:
                res = fn(self.engine)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                loop.call_soon_threadsafe(_settle, fut, None, exc)
            else:
                loop.call_soon_threadsafe(_settle, fut, res, None)

        def fail(exc: BaseException):
            loop.call_soon_threadsafe(_settle, fut, None, exc)

        self._commands.put((run, fail))
        if self._error is not None:  # died while we queued: the loop will not drain it any more
            self._fail_pending()
        return fut

    async def generate(self, request: Request) -> AsyncIterator[RequestOutput]:
        """Stream outputs of one request; closing the iterator early aborts it (frees blocks)."""
        if self._error is not None:
            raise EngineDead(f"engine loop died: {self._error!r}")
        spec = request.params.grammar
        compiled = None
        if spec is not None:  # InvalidRequest here: nothing was queued
            compiled = await asyncio.get_running_loop().run_in_executor(
                self._grammar_pool, self.engine.grammars.compile, spec)
        arrival = time.perf_counter()  # the engine thread takes it between steps: that wait is queueing
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request.request_id] = (asyncio.get_running_loop(), q)
        finished = False
        try:
            # a guarded (latency_guard) tenant's request may cut short a lower-class step already
            # running: the engine thread sees the note between layers (engine/step_interrupt.py)
            quota = self.engine.pool.eviction.quota(request.tenant)
            guarded = (quota.priority if quota.latency_guard and not request.guest
                       and self.engine.config.interrupt_for_guarded else None)
            arrivals = self.engine.arrivals

            def add(engine: LLMEngine):
                try:
                    if compiled is not None:  # kept again if evicted meanwhile: no compile on this thread
                        engine.grammars.keep(spec, compiled)
                    engine.add_request(request, arrival)
                finally:
                    if guarded is not None:
                        arrivals.done(guarded)

            if self.engine.trace.on:
                self.engine.trace.write({"ev": "gen", "t": time.time(), "tenant": request.tenant})
            if guarded is not None:
                arrivals.note(guarded)
            try:
                fut = self.call(add)
            except BaseException:
                if guarded is not None:
                    arrivals.done(guarded)
                raise
            if guarded is not None and fut.done():  # refused at once (dead loop): add never runs
                arrivals.done(guarded)
            try:
                await fut
            except InvalidRequest:
                self._streams.pop(request.request_id, None)
                raise
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self._streams.pop(request.request_id, None)
                if self._error is None:
                    self._commands.put((lambda: self.engine.abort(request.request_id), lambda _e: None))

    async def abort(self, request_id: str) -> None:
        out = await self.call(lambda e: e.abort(request_id))
        if out is not None:
            self._deliver(out)

    def shutdown(self) -> None:
        self._stop = True
        self._grammar_pool.shutdown(wait=False, cancel_futures=True)
        self._thread.join(timeout=5)
        self.engine.grammars.close()
