"""An asyncio face for LLMEngine: the engine steps in its own thread, callers stream outputs.

Torch work releases the GIL, so one engine thread keeps an event loop (a Ray actor's or a
web server's) responsive. All engine calls happen on the engine thread; callers only post
commands and read per-request queues, so the engine needs no locks.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from typing import AsyncIterator, Callable

from engine.llm_engine import EngineConfig, LLMEngine
from engine.model_loader import LoadedModel
from engine.sequence import InvalidRequest, Request, RequestOutput


class EngineDead(RuntimeError):
    pass


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
        self._commands: queue.Queue[Callable[[], None]] = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._error: BaseException | None = None
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="kvmesh-engine", daemon=True)
        self._thread.start()

    # -- engine thread ---------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._stop:
                block = not self.engine.has_unfinished()
                try:
                    cmd = self._commands.get(timeout=0.05) if block else self._commands.get_nowait()
                except queue.Empty:
                    cmd = None
                while cmd is not None:
                    cmd()
                    try:
                        cmd = self._commands.get_nowait()
                    except queue.Empty:
                        cmd = None
                for out in self.engine.step():
                    self._deliver(out)
        except BaseException as e:  # pragma: no cover - surfaced to every waiter
            self._error = e
            for rid in list(self._streams):
                self._deliver_exc(rid, EngineDead(f"engine loop died: {e!r}"))

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
        """Run ``fn(engine)`` on the engine thread; await the result."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def run():
            try:
                res = fn(self.engine)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                loop.call_soon_threadsafe(_settle, fut, None, exc)
            else:
                loop.call_soon_threadsafe(_settle, fut, res, None)

        self._commands.put(run)
        return fut

    async def generate(self, request: Request) -> AsyncIterator[RequestOutput]:
        """Stream outputs of one request; closing the iterator early aborts it (frees blocks)."""
        if self._error is not None:
            raise EngineDead(f"engine loop died: {self._error!r}")
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request.request_id] = (asyncio.get_running_loop(), q)
        finished = False
        try:
            def add(engine: LLMEngine):
                engine.add_request(request)

            try:
                await self.call(add)
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
                self._commands.put(lambda: self.engine.abort(request.request_id))

    async def abort(self, request_id: str) -> None:
        out = await self.call(lambda e: e.abort(request_id))
        if out is not None:
            self._deliver(out)

    def shutdown(self) -> None:
        self._stop = True
        self._thread.join(timeout=5)
