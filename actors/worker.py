"""The worker actor: one engine per actor (one per GPU; CPU otherwise), streaming generation.

A thin shell: all logic lives in ``engine`` (tested without Ray). Requests stream back as a Ray
generator; cancelling the generator (client gone) aborts the request and frees its blocks.
"""

from __future__ import annotations

import asyncio
import os

import ray

from engine.async_engine import AsyncEngine
from engine.llm_engine import EngineConfig
from engine.sequence import Request, RequestOutput


class Worker:
    def __init__(self, worker_id: str, config: EngineConfig):
        self.worker_id = worker_id
        self.config = config
        self.engine = AsyncEngine(config)

    def ready(self) -> dict:
        e = self.engine.engine
        return {"worker_id": self.worker_id, "model": e.loaded.name, "model_id": e.loaded.model_id,
                "max_model_len": e.max_model_len, "block_size": e.config.block_size,
                "node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}

    async def generate(self, request: Request):
        async for out in self.engine.generate(request):
            yield out

    async def generate_all(self, request: Request) -> list[RequestOutput]:
        return [out async for out in self.engine.generate(request)]

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    async def stats(self) -> dict:
        return await self.engine.call(lambda e: e.stats())

    # -- global prefix index (issue 4) -----------------------------------------------------
    async def snapshot(self) -> list[tuple[bytes, bytes | None, str | None]]:
        """This worker's prefix cache: [(block hash, parent hash, share domain)]."""
        return await self.engine.call(lambda e: e.pool.cached_hashes())

    async def start_index_publisher(self, interval_s: float = 0.1, heartbeat_s: float = 1.0) -> bool:
        """Publish block events to the cluster's index actor in batches (idempotent)."""
        from actors.index_actor import get_or_create_index
        from actors.index_publisher import IndexPublisher

        if getattr(self, "index_publisher", None) is not None:
            return True
        index = await asyncio.to_thread(get_or_create_index, self.config.block_size)
        me = ray.get_runtime_context().current_actor

        async def drain(full: bool):
            return await self.engine.call(lambda e: (e.pool.take_events(), e.pool.cached_hashes() if full else None))

        async def send(payload: bytes, full: bool) -> dict:
            return await index.publish.remote(payload, me if full else None)

        self.index_publisher = IndexPublisher(self.worker_id, self.config.block_size, drain, send,
                                              interval_s=interval_s, heartbeat_s=heartbeat_s)
        self.index_publisher.start()
        return True


def worker_actor_class(num_gpus: float | None = None, num_cpus: float = 1):
    """The Ray actor class for Worker, asking for a GPU when the cluster has them."""
    if num_gpus is None:
        num_gpus = 1 if ray.is_initialized() and ray.cluster_resources().get("GPU", 0) >= 1 else 0
    return ray.remote(num_gpus=num_gpus, num_cpus=num_cpus, max_concurrency=1000)(Worker)
