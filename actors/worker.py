"""The worker actor: one engine per actor (one per GPU; CPU otherwise), streaming generation.

A thin shell: all logic lives in ``engine`` (tested without Ray). Requests stream back as a Ray
generator; cancelling the generator (client gone) aborts the request and frees its blocks.
"""

from __future__ import annotations

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


def worker_actor_class(num_gpus: float | None = None, num_cpus: float = 1):
    """The Ray actor class for Worker, asking for a GPU when the cluster has them."""
    if num_gpus is None:
        num_gpus = 1 if ray.is_initialized() and ray.cluster_resources().get("GPU", 0) >= 1 else 0
    return ray.remote(num_gpus=num_gpus, num_cpus=num_cpus, max_concurrency=1000)(Worker)
