"""float32 vs bfloat16 weights and KV for kvmesh's engine on this CPU, side by side in one run.

  prefill   engine tokens/s for a 512-token prompt (not cached) and a 40-token question after a
            cached 512-token prefix (the shared-prefix workload's hit), best of 3 alternating
  decode    seconds per decode step with 1 and 8 rows (16 new tokens, decode-only: the same run
            with 1 new token subtracted)
  quality   greedy 16-token answers to chat prompts: the share identical to float32's, the share
            whose first token equals float32's; each dtype served from its own prefix cache vs
            recomputed (the cache's exactness in that dtype)

Whether bfloat16 pays depends on the CPU: with AMX (``amx_bf16``) or AVX512-BF16 oneDNN runs its
matmuls natively; without them they are emulated. The machine's flags are printed and recorded.

Usage: python bench/dtype.py [--prompts 24] [--threads 1]. Writes bench/results/dtype.json.
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

import torch  # noqa: E402

from engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from engine.model_loader import load_model  # noqa: E402
from engine.sequence import Request, SamplingParams  # noqa: E402

DTYPES = ("float32", "bfloat16")
QUESTIONS = ["What is the capital of France?", "Name three primary colours.", "How many legs does a spider have?",
             "What is 12 times 7?", "Why is the sky blue?", "Give a synonym for happy.", "What do bees make?",
             "Translate 'good morning' to Spanish.", "What is the boiling point of water in Celsius?",
             "Who wrote Romeo and Juliet?", "What is photosynthesis?", "Name a mammal that can fly.",
             "What is the largest ocean?", "How many minutes are in an hour?", "What is the opposite of cold?",
             "Which planet is known as the red planet?", "What gas do plants absorb?", "Spell the word 'cat' backwards.",
             "What is 15 plus 27?", "Name a fruit that is yellow.", "What language is spoken in Brazil?",
             "How many continents are there?", "What is the freezing point of water in Fahrenheit?",
             "What instrument has 88 keys?", "Who painted the Mona Lisa?", "What is the square root of 81?",
             "Name a country in Africa.", "What is the chemical symbol for gold?", "How many sides has a hexagon?",
             "What is the main ingredient of guacamole?", "Which animal is the largest on land?", "What is H2O?"]
SYSTEM = ("You are a concise, friendly assistant for a travel company. Answer in one short sentence. "
          "Never invent facts; if unsure, say so. ") * 6


def cpu_flags() -> list[str]:
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return []
    return sorted(f for f in flags if f in ("amx_bf16", "amx_tile", "avx512_bf16", "avx512f", "avx2", "avx512_vnni"))


def timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def greedy(engine, prompts, tag, max_tokens=16, reuse="none"):
    reqs = [Request(f"{tag}{i}", tuple(p), SamplingParams(max_tokens=max_tokens, temperature=0), reuse=reuse)
            for i, p in enumerate(prompts)]
    outs = engine.generate(reqs)
    return [tuple(t for o in outs[r.request_id] for t in o.new_token_ids) for r in reqs]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=24, help="chat prompts for the quality comparison")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: one worker host's share)")
    ap.add_argument("--out", default="bench/results/dtype.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    machine = {"cpus": os.cpu_count(), "torch_threads": args.threads, "torch": torch.__version__,
               "cpu_flags": cpu_flags(), "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
               "python": platform.python_version()}
    print(f"machine: {machine}", flush=True)

    engines = {}
    for dt in DTYPES:
        loaded = load_model("default", dtype=getattr(torch, dt))
        engines[dt] = LLMEngine(EngineConfig(num_blocks=1024, dtype=dt, max_num_batched_tokens=1024), loaded=loaded)
    tok = loaded.tokenizer

    def chat(q):
        ids = tok.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
                                      add_generation_prompt=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    prompts = [chat(q) for q in (QUESTIONS * 2)[: args.prompts]]
    cold = list(tok.encode("Write a detailed essay about the history of Rome. " * 60, add_special_tokens=False))[:512]
    prefix_len = len(prompts[0]) - 24  # the shared system part (the question differs after it)

    # -- speed: alternate the dtypes, best of 3 ----------------------------------------------
    speed = {dt: {"prefill_512_s": [], "question_s": [], "decode1_s": [], "decode8_s": []} for dt in DTYPES}
    for dt in DTYPES:  # warm-up (and the shared system prompt into each cache)
        greedy(engines[dt], [cold], f"w{dt}", 1)
        greedy(engines[dt], prompts[:1], f"wq{dt}", 1, reuse="exact")
    for rep in range(3):
        for dt, eng in engines.items():
            s = speed[dt]
            s["prefill_512_s"].append(timed(lambda: greedy(eng, [cold], f"c{dt}{rep}", 1)))
            s["question_s"].append(timed(lambda: greedy(eng, [prompts[1 + rep]], f"q{dt}{rep}", 1, reuse="exact")))
            for rows in (1, 8):
                batch = [cold[: 64 + i] for i in range(rows)]
                full = timed(lambda: greedy(eng, batch, f"d{rows}{dt}{rep}", 17))
                one = timed(lambda: greedy(eng, batch, f"e{rows}{dt}{rep}", 1))
                s[f"decode{rows}_s"].append(max(0.0, full - one) / 16)
    best = {dt: {k: min(v) for k, v in s.items()} for dt, s in speed.items()}
    best_tok_s = {dt: {"prefill_512_tok_s": 512 / b["prefill_512_s"], "question_tokens": len(prompts[1]) - prefix_len,
                       **b} for dt, b in best.items()}
    f32, b16 = best["float32"], best["bfloat16"]
    ratios = {k: f32[k] / b16[k] for k in f32}  # > 1: bfloat16 faster
    print("speed (best of 3, seconds; ratio = float32 / bfloat16, > 1: bfloat16 faster):")
    for k in f32:
        print(f"  {k:14s} float32 {f32[k]:.4f}  bfloat16 {b16[k]:.4f}  ratio {ratios[k]:.2f}")

    # -- quality: greedy answers vs float32's; bfloat16 cached vs recomputed ------------------
    ref = greedy(engines["float32"], prompts, "rf", reuse="none")
    ref_cached = greedy(engines["float32"], prompts, "cf", reuse="exact")
    got = greedy(engines["bfloat16"], prompts, "rb", reuse="none")
    cached = greedy(engines["bfloat16"], prompts, "cb", reuse="exact")

    def same(a, b):
        return sum(x == y for x, y in zip(a, b)) / len(a)
    quality = {
        "prompts": len(prompts),
        "bf16_identical_to_f32": same(ref, got),
        "bf16_first_token_equal_f32": same([a[:1] for a in ref], [b[:1] for b in got]),
        "f32_cached_identical_to_recomputed": same(ref, ref_cached),
        "bf16_cached_identical_to_recomputed": same(got, cached),
        "examples": [{"f32": tok.decode(a), "bf16": tok.decode(b)} for a, b in zip(ref, got) if a != b][:5],
    }
    print(f"quality over {len(prompts)} greedy 16-token answers: bf16 identical to f32 "
          f"{quality['bf16_identical_to_f32']:.2f}, first token equal {quality['bf16_first_token_equal_f32']:.2f}; "
          f"served from the prefix cache identical to recomputed: float32 "
          f"{quality['f32_cached_identical_to_recomputed']:.2f}, bfloat16 {quality['bf16_cached_identical_to_recomputed']:.2f}")
    for ex in quality["examples"][:3]:
        print(f"  f32: {ex['f32']!r}\n  b16: {ex['bf16']!r}")
    doc = {"bench": "dtype", "machine": machine, "speed_best_s": best_tok_s, "ratio_f32_over_bf16": ratios,
           "quality": quality, "samples_s": speed}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
