"""EngineConfig.thread_nice: the engine thread's niceness is changed, the caller's is not (Linux)."""

import os
import sys
import threading

import pytest

from engine.async_engine import AsyncEngine
from engine.llm_engine import EngineConfig

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness is Linux's")


def _nice_here(_engine=None) -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@pytest.mark.parametrize("nice", [0, 3])
async def test_engine_thread_gets_the_added_niceness(tiny_model, nice):
    mine = _nice_here()
    eng = AsyncEngine(EngineConfig(model="tiny-llama", num_blocks=16, approx=None, thread_nice=nice), loaded=tiny_model)
    try:
        assert await eng.call(_nice_here) == min(19, mine + nice)
        assert _nice_here() == mine  # the caller's thread is untouched
    finally:
        eng.shutdown()


async def test_a_refused_precedence_leaves_the_engine_running(tiny_model, monkeypatch):
    def refuse(*_):  # as for a process without CAP_SYS_NICE asking for a lower niceness
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "setpriority", refuse)
    mine = _nice_here()
    eng = AsyncEngine(EngineConfig(model="tiny-llama", num_blocks=16, approx=None, thread_nice=-5), loaded=tiny_model)
    try:
        assert await eng.call(_nice_here) == mine and eng.alive
    finally:
        eng.shutdown()
