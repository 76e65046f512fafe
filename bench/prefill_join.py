"""A burst of requests with one new system prompt: the in-flight prefix join on vs off.

Requests that share a system prompt nobody has sent before arrive close together (a new
application's first users, a deployment's first minute, a batch job). Without the join
(``EngineConfig.join_inflight_prefill=False``) each request the step budget admits computes the
uncached prompt blocks beside the first one; with it they wait for the first one's blocks and take
them as hits (engine/scheduler.py). Same engine, default model, one CPU thread, side by side:
per burst size, ``--reps`` bursts with a fresh system prompt each, on and off alternating on one
engine each (so the machine's noise falls on both), every burst's requests added ``--gap-s`` apart
to a stepping engine. Reports TTFT p50/max, the burst's makespan and the prompt tokens computed
(not taken from the cache), and the ratios off/on.

    .venv/bin/python bench/prefill_join.py            # about 4 min here
Writes bench/results/prefill_join.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from engine.model_loader import load_model  # noqa: E402
from engine.sequence import Request, SamplingParams  # noqa: E402

SUBJECTS = ["a hardware store", "a travel agency", "a city library", "a bicycle repair shop", "a bakery",
            "a dental clinic", "a tax office", "a zoo", "a hotel front desk", "a train operator"]
QUESTIONS = ["What are your opening hours?", "Can I pay by card?", "Where are you located?",
             "Do you have parking?", "Can I book online?", "Is there a student discount?",
             "How do I cancel an order?", "Do you deliver?"]


def system_prompt(tok, i: int, length: int) -> list[int]:
    subject = SUBJECTS[i % len(SUBJECTS)]
    text = (f"You are the assistant of {subject} (branch {i}). Answer briefly and politely. ")
    rule = 0
    ids = tok.encode(text, add_special_tokens=False)
    while len(ids) < length:
        rule += 1
        text += f"Rule {rule} for {subject} branch {i}: never invent facts, quote prices exactly, and stay on topic. "
        ids = tok.encode(text, add_special_tokens=False)
    return ids[:length]


def burst(eng: LLMEngine, prompts: list[list[int]], gap_s: float, max_tokens: int, tag: str) -> dict:
    """Add the prompts ``gap_s`` apart to a stepping engine; per request TTFT and cached tokens."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    sent: dict[str, float] = {}
    first: dict[str, float] = {}
    cached: dict[str, int] = {}
    i = 0
    while i < len(prompts) or eng.has_unfinished():
        now = time.perf_counter() - t0
        while i < len(prompts) and now >= i * gap_s:
            rid = f"{tag}-{i}"
            eng.add_request(Request(rid, tuple(prompts[i]), params, tenant="acme"))
            sent[rid] = now
            i += 1
        if not eng.has_unfinished():
            time.sleep(max(0.0, i * gap_s - now))
            continue
        for out in eng.step():
            t = time.perf_counter() - t0
            if out.new_token_ids and out.request_id not in first:
                first[out.request_id] = t - sent[out.request_id]
            if out.finished:
                cached[out.request_id] = out.num_cached_tokens
    makespan = time.perf_counter() - t0
    ttft = [first[r] for r in sent]
    computed = sum(len(p) for p in prompts) - sum(cached.values())
    return {"ttft_s": ttft, "makespan_s": makespan, "computed_prompt_tokens": computed,
            "cached_tokens": [cached[r] for r in sent]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="2,4,8", help="requests per burst")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--system-tokens", type=int, default=600)
    ap.add_argument("--gap-s", type=float, default=0.1, help="between a burst's arrivals")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "prefill_join.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    loaded = load_model("default")
    tok = loaded.tokenizer
    engines = {join: LLMEngine(EngineConfig(model=loaded.name, num_threads=1, kv_cache_bytes=256 << 20,
                                            join_inflight_prefill=join), loaded=loaded)
               for join in (True, False)}
    sizes = [int(x) for x in args.sizes.split(",")]
    rows = []
    k = 0
    for n in sizes:
        for rep in range(args.reps):
            for join in ((True, False) if rep % 2 == 0 else (False, True)):
                k += 1  # a system prompt neither engine has seen
                system = system_prompt(tok, k, args.system_tokens)
                prompts = [system + tok.encode(QUESTIONS[j % len(QUESTIONS)] + f" (user {j})",
                                               add_special_tokens=False) for j in range(n)]
                r = burst(engines[join], prompts, args.gap_s, args.max_tokens, f"b{k}")
                rows.append({"size": n, "rep": rep, "join": join, **r})
                print(f"burst of {n}, join {'on ' if join else 'off'}: TTFT p50 {np.median(r['ttft_s']):.2f} s "
                      f"max {max(r['ttft_s']):.2f} s, makespan {r['makespan_s']:.2f} s, "
                      f"computed {r['computed_prompt_tokens']} prompt tokens", flush=True)
    summary = {}
    for n in sizes:
        per = {}
        for join in (True, False):
            rs = [r for r in rows if r["size"] == n and r["join"] == join]
            per["on" if join else "off"] = {
                "ttft_p50_s": float(np.median([t for r in rs for t in r["ttft_s"]])),
                "ttft_max_s": float(np.median([max(r["ttft_s"]) for r in rs])),
                "makespan_s": float(np.median([r["makespan_s"] for r in rs])),
                "computed_prompt_tokens": float(np.median([r["computed_prompt_tokens"] for r in rs]))}
        per["off_over_on"] = {key: per["off"][key] / per["on"][key] for key in per["on"] if per["on"][key]}
        summary[str(n)] = per
        print(f"burst of {n}: off/on TTFT p50 {per['off_over_on']['ttft_p50_s']:.2f}x, "
              f"max {per['off_over_on']['ttft_max_s']:.2f}x, makespan {per['off_over_on']['makespan_s']:.2f}x, "
              f"prompt tokens computed {per['off_over_on']['computed_prompt_tokens']:.2f}x")
    doc = {"bench": "prefill_join", "args": vars(args),
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "threads": 1,
                       "load_avg_end": os.getloadavg()},
           "engine": {"max_num_batched_tokens": engines[True].config.max_num_batched_tokens},
           "summary": summary, "bursts": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
