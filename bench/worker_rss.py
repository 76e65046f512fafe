"""Where does a worker's RSS go? One engine in this process (no Ray), the soak's request mix.

What the soak (``bench/soak.py``) saw: worker RSS rising in steps after warm-up. This script
separates the candidates:

1. The KV pool: RSS before/after ``LLMEngine`` builds its ``PagedKVCache`` against the pool's
   bytes (``num_blocks x bytes_per_block``); then the pool's pages are written block by block
   (``first_write``) and again (``reuse``) with RSS measured around each pass: a pool committed at
   allocation grows by ~0 on the first write, a lazily allocated one by ~pool bytes.
2. Python objects: ``tracemalloc``'s traced bytes and the gc object count per sample.
3. The C heap (glibc malloc: torch's CPU tensors come from it): ``mallinfo2`` in use / free /
   mmapped bytes per sample, and RSS before/after ``malloc_trim(0)`` at the end (memory freed
   but kept by malloc comes back on a trim; a leak does not).
4. Engine structures that could grow without bound: sequences, cached blocks, approximate-reuse
   donors/slots, grammar cache, quality-gate keys, shadow jobs.

  nice -n 5 .venv/bin/python bench/worker_rss.py [--model default] [--requests 600]
Writes bench/results/worker_rss.json.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import platform
import random
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psutil  # noqa: E402
import torch  # noqa: E402

from bench.soak import TEMPLATES  # noqa: E402
from bench.stream_load import WORDS, make_prompts  # noqa: E402
from engine.kv_cache import PagedKVCache  # noqa: E402
from engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from engine.sequence import Request, SamplingParams  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
MIB = 2**20
_libc = ctypes.CDLL("libc.so.6")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]


_libc.mallinfo2.restype = _MallInfo2


def rss() -> float:
    return psutil.Process().memory_info().rss / MIB


def heap() -> dict:
    m = _libc.mallinfo2()
    return {"arena_mib": round(m.arena / MIB, 1), "in_use_mib": round(m.uordblks / MIB, 1),
            "free_kept_mib": round(m.fordblks / MIB, 1), "mmapped_mib": round(m.hblkhd / MIB, 1)}


def structures(e: LLMEngine) -> dict:
    out = {"seqs": len(e.seqs), "shadow_jobs": len(e._shadow_jobs), "tenant_metrics": len(e.tenant_metrics),  # noqa: SLF001
           "approx_reads": len(e.approx_reads), "free_blocks": e.pool.num_free_blocks()}
    if e.approx is not None:
        out["donors"] = len(e.approx.pool)
        out["donor_mib"] = round(e.approx.pool.nbytes / MIB, 1)
    return out


def pool_pages(e: LLMEngine) -> dict:
    """RSS around writing every block of the pool once (first write) and once more (reuse)."""
    c = e.cache
    passes = {}
    for name in ("first_write", "reuse"):
        r0 = rss()
        for layer in range(c.num_layers):
            c.k[layer].fill_(1.0 if name == "reuse" else 0.5)
            c.v[layer].fill_(1.0 if name == "reuse" else 0.5)
        passes[f"{name}_rss_growth_mib"] = round(rss() - r0, 1)
    for layer in range(c.num_layers):  # leave it as the engine expects nothing about it: zeros
        c.k[layer].zero_()
        c.v[layer].zero_()
    return passes


def body(rng: random.Random, prompts: list[str]) -> tuple[str, dict]:
    tenant = rng.choices(["exact", "grantee", "approx", "limited"], [4, 2, 2, 1])[0]
    if tenant != "approx":
        return tenant, {"text": rng.choice(prompts)}
    tid = rng.choice(sorted(TEMPLATES))
    params = {"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12)))}
    if tid == "review":
        params["product"] = rng.choice(["a kettle", "the lamp", "this phone", "a bicycle", "the chair"])
    text = TEMPLATES[tid]
    for k, v in params.items():
        text = text.replace("{" + k + "}", v)
    return tenant, {"text": text, "template": tid, "params": params}


def request(e: LLMEngine, i: int, tenant: str, b: dict, max_tokens: int) -> Request:
    """As the soak's tenants: grantee reads exact's KV (a grant), approx uses its templates."""
    kw = {}
    if "template" in b:
        kw = {"reuse": "approximate", "template": b["template"], "template_text": TEMPLATES[b["template"]],
              "template_params": b["params"]}
    return Request(f"r{i}", tuple(e.encode(b["text"])), SamplingParams(max_tokens=max_tokens, temperature=0.0),
                   tenant=tenant, read_domains=("exact",) if tenant == "grantee" else (), **kw)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--kv-cache-mb", type=int, default=160)
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--concurrency", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--disconnect-p", type=float, default=0.1)
    ap.add_argument("--sample-every", type=int, default=25)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--out", default=str(RESULTS / "worker_rss.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)
    prompts = make_prompts(4, 16, 110, args.seed)

    from engine.model_loader import load_model

    r_start = rss()
    loaded = load_model(args.model)
    r_model = rss()
    cfg = EngineConfig(model=args.model, kv_cache_bytes=args.kv_cache_mb << 20, max_num_seqs=32)
    e = LLMEngine(cfg, loaded)
    r_engine = rss()
    c = e.cache
    pool_bytes = c.num_blocks * PagedKVCache.bytes_per_block(c.num_layers, c.block_size, c.num_kv_heads, c.head_dim,
                                                             c.dtype)
    pages = pool_pages(e)
    print(f"model {r_model - r_start:.0f} MiB; engine (KV pool {pool_bytes / MIB:.1f} MiB, {c.num_blocks} blocks) "
          f"+{r_engine - r_model:.1f} MiB at construction; {pages}", flush=True)

    tracemalloc.start()
    samples, t0 = [], time.monotonic()
    sent = done = 0
    live: dict[str, int] = {}  # request id -> outputs until a simulated disconnect (0: none)

    def sample() -> None:
        gc.collect()
        samples.append({"done": done, "t_s": round(time.monotonic() - t0, 1), "rss_mib": round(rss(), 1), **heap(),
                        "py_traced_mib": round(tracemalloc.get_traced_memory()[0] / MIB, 2),
                        "gc_objects": len(gc.get_objects()), **structures(e)})
        s = samples[-1]
        print(f"  {done:5d} done  rss {s['rss_mib']:.1f}  heap in use {s['in_use_mib']} free {s['free_kept_mib']} "
              f"mmapped {s['mmapped_mib']}  py {s['py_traced_mib']}  objs {s['gc_objects']}", flush=True)

    sample()
    while done < args.requests:
        while sent < args.requests and len(live) < args.concurrency:
            tenant, b = body(rng, prompts)
            req = request(e, sent, tenant, b, args.max_tokens)
            e.add_request(req)
            live[req.request_id] = rng.randint(1, 3) if rng.random() < args.disconnect_p else 0
            sent += 1
        for out in e.step():
            rid = out.request_id
            if rid not in live:
                continue
            if out.finished:
                del live[rid]
                done += 1
                if done % args.sample_every == 0:
                    sample()
            elif live[rid] > 0:
                live[rid] -= 1
                if live[rid] == 0:
                    e.abort(rid)
                    del live[rid]
                    done += 1
                    if done % args.sample_every == 0:
                        sample()
    while e.has_unfinished():
        e.step()
    sample()
    before_trim = rss()
    _libc.malloc_trim(0)
    after_trim = rss()
    warm = samples[len(samples) // 5]
    res = {"bench": "worker_rss", "args": vars(args),
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "loadavg": os.getloadavg(),
                       "torch": torch.__version__},
           "kv_pool": {"num_blocks": c.num_blocks, "pool_mib": round(pool_bytes / MIB, 1),
                       "rss_growth_at_construction_mib": round(r_engine - r_model, 1), **pages},
           "model_rss_mib": round(r_model - r_start, 1),
           "after_warmup": warm, "end": samples[-1],
           "growth_after_warmup": {k: round(samples[-1][k] - warm[k], 2) for k in
                                   ("rss_mib", "in_use_mib", "free_kept_mib", "mmapped_mib", "arena_mib",
                                    "py_traced_mib", "gc_objects")},
           "rss_before_trim_mib": round(before_trim, 1), "rss_after_malloc_trim_mib": round(after_trim, 1),
           "samples": samples}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(json.dumps({k: res[k] for k in ("kv_pool", "growth_after_warmup", "rss_before_trim_mib",
                                          "rss_after_malloc_trim_mib")}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
