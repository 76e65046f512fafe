"""A worker's memory is committed at start-up: the KV pool when the engine is built (not as
blocks are first written), the model's weights when they are loaded (not by the first request).

So a worker's RSS is flat after start-up as its pool fills (the soak's RSS growth is not the pool),
and a machine short of memory fails the worker at start-up, not mid-run. A behaviour check with a
generous tolerance: RSS after construction covers >= 80% of the pool's bytes, and writing every
slot of the pool afterwards adds < 25% of them. The pool is large enough (256 MiB: 64 MiB per
tensor, above glibc's largest mmap threshold) that its pages are fresh, never recycled heap.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil

MIB = 2**20


def rss() -> int:
    return psutil.Process().memory_info().rss


# Run in a fresh interpreter: in a long test process, memory freed by earlier tests stays
# resident in the allocator's arenas and may back the new pool, which hides whether it is committed.
_POOL_CHECK = """
import json, psutil
from engine.kv_cache import PagedKVCache
from engine.llm_engine import EngineConfig, LLMEngine
from engine.model_loader import load_model
rss = lambda: psutil.Process().memory_info().rss
loaded = load_model("tiny-llama")
r0 = rss()
eng = LLMEngine(EngineConfig(model="tiny-llama", kv_cache_bytes=256 << 20, approx=None), loaded=loaded)
grown = rss() - r0
c = eng.cache
pool = c.num_blocks * PagedKVCache.bytes_per_block(c.num_layers, c.block_size, c.num_kv_heads, c.head_dim, c.dtype)
r1 = rss()
for layer in range(c.num_layers):  # every block written once, as a long run would
    c.k[layer].fill_(1.0)
    c.v[layer].fill_(1.0)
print(json.dumps({"pool": pool, "grown": grown, "written": rss() - r1}))
"""


def test_pool_committed_at_construction():
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-c", _POOL_CHECK], capture_output=True, text=True, timeout=300, env=env,
                         cwd=root)
    assert out.returncode == 0, out.stderr[-2000:]
    m = json.loads(out.stdout.strip().splitlines()[-1])
    pool, grown = m["pool"], m["grown"]
    assert pool > 200 * MIB
    assert grown >= 0.8 * pool, f"RSS grew {grown / MIB:.0f} MiB for a {pool / MIB:.0f} MiB pool: allocated lazily?"
    assert m["written"] < 0.25 * pool


def test_weights_resident_after_load():
    """The default model's weights (mmapped from the safetensors cache) are paged in by
    ``load_model``, not by the first request: a first forward adds < 10% of their bytes to RSS."""
    import torch

    from engine.model_loader import load_model

    loaded = load_model("default")  # a fresh mapping of the file: only what load touched is in RSS
    weights = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    r0 = rss()
    with torch.no_grad():
        loaded.model(torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]]))
    assert rss() - r0 < 0.1 * weights, f"a first forward paged in {(rss() - r0) / MIB:.0f} MiB of weights"
