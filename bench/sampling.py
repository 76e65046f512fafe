"""Sampling features on the default model: n with forked choices, and the sampler's per-step cost.

  (a) fork    16 prompts (~400 tokens) with n=4 in one LLMEngine.generate call
              vs the 64 equivalent separate requests (n=1, same seeds) in one call
              (issue 12's target: >= 3x faster). Prefix caching is on in both, as users run it.
  (b) sampler per-step time of the batched sampler (ms per engine step, masks + logprobs +
              appends) and of the whole step for 16 decoding requests: plain vs logprobs=5 vs a
              json_object grammar, with the ratios.

Usage: nice -n 5 python bench/sampling.py [--prompts 16] [--n 4] [--prompt-tokens 400]
       [--new-tokens 16] [--device cpu|cuda] [--quick]
Writes bench/results/sampling.json.
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

from bench.engine import make_prompts  # noqa: E402
from engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from engine.model_loader import load_model  # noqa: E402
from engine.sequence import GrammarSpec, Request, SamplingParams  # noqa: E402


def machine() -> dict:
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "load_avg": os.getloadavg()}


def engine(loaded, device: str) -> LLMEngine:
    return LLMEngine(EngineConfig(num_blocks=2048, max_num_seqs=64, max_num_batched_tokens=512, device=device,
                                  dtype="float32", approx=None), loaded=loaded)


def run_fork(loaded, args) -> dict:
    prompts = make_prompts(loaded.tokenizer, args.prompts, args.prompt_tokens)
    p = SamplingParams(max_tokens=args.new_tokens, temperature=0.8, seed=0, n=args.n, ignore_eos=True)
    res = {}
    for mode in ("separate", "n", "separate", "n"):  # interleaved, best of two each
        eng = engine(loaded, args.device)
        if mode == "n":
            reqs = [Request(f"r{i}", tuple(ids), p) for i, ids in enumerate(prompts)]
        else:
            reqs = [Request(f"r{i}.{c}", tuple(ids), SamplingParams(max_tokens=args.new_tokens, temperature=0.8,
                                                                    seed=c, ignore_eos=True))
                    for i, ids in enumerate(prompts) for c in range(args.n)]
        t0 = time.perf_counter()
        outs = eng.generate(reqs)
        dt = time.perf_counter() - t0
        tokens = sum(len(o.new_token_ids) for v in outs.values() for o in v)
        assert tokens == args.prompts * args.n * args.new_tokens
        row = {"seconds": dt, "forward_tokens": eng.num_forward_tokens, "steps": eng.num_steps,
               "output_tokens": tokens, "preemptions": eng.scheduler.num_preemptions}
        if mode not in res or dt < res[mode]["seconds"]:
            res[mode] = row
        print(f"  {mode:9s} {dt:7.2f} s  forward tokens {eng.num_forward_tokens:6d}  steps {eng.num_steps}", flush=True)
    res["speedup"] = res["separate"]["seconds"] / res["n"]["seconds"]
    return res


def run_sampler(loaded, args) -> dict:
    prompts = make_prompts(loaded.tokenizer, 16, 64)
    variants = {
        "plain": SamplingParams(max_tokens=args.new_tokens, temperature=0.8, seed=1),
        "logprobs5": SamplingParams(max_tokens=args.new_tokens, temperature=0.8, seed=1, logprobs=5),
        "grammar": SamplingParams(max_tokens=args.new_tokens, temperature=0.8, seed=1,
                                  grammar=GrammarSpec("json_object")),
    }
    res = {}
    for rep in range(2):
        for name, p in variants.items():
            eng = engine(loaded, args.device)
            if p.grammar is not None:
                eng.grammars.compile(p.grammar)  # compile outside the timing (cached per spec)
            reqs = [Request(f"{name}{i}", tuple(ids), p) for i, ids in enumerate(prompts)]
            for r in reqs:
                eng.add_request(r)
            while any(s.num_output == 0 for s in eng.seqs.values()):  # prefill first; time decodes only
                eng.step()
            s0, t0, n0 = eng.sample_s, time.perf_counter(), eng.num_steps
            while eng.has_unfinished():
                eng.step()
            steps = eng.num_steps - n0
            row = {"sampler_ms_per_step": 1e3 * (eng.sample_s - s0) / steps,
                   "step_ms": 1e3 * (time.perf_counter() - t0) / steps, "steps": steps}
            if name not in res or row["sampler_ms_per_step"] < res[name]["sampler_ms_per_step"]:
                res[name] = row
    for name in ("logprobs5", "grammar"):
        res[name]["sampler_ratio_vs_plain"] = res[name]["sampler_ms_per_step"] / res["plain"]["sampler_ms_per_step"]
        res[name]["step_ratio_vs_plain"] = res[name]["step_ms"] / res["plain"]["step_ms"]
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=400)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "sampling.json"))
    args = ap.parse_args()
    if args.quick:
        args.prompts, args.prompt_tokens, args.new_tokens = 4, 128, 8
    loaded = load_model("default", dtype=torch.float32, device=args.device)
    print(f"machine: {machine()}", flush=True)
    print(f"(a) {args.prompts} prompts x {args.prompt_tokens} tokens, n={args.n}, {args.new_tokens} new tokens:", flush=True)
    fork = run_fork(loaded, args)
    print(f"    n={args.n} forked {fork['n']['seconds']:.2f} s vs {args.prompts * args.n} separate "
          f"{fork['separate']['seconds']:.2f} s: {fork['speedup']:.2f}x (target >= 3x)", flush=True)
    print("(b) sampler per decode step, 16 requests:", flush=True)
    samp = run_sampler(loaded, args)
    for name, row in samp.items():
        extra = (f"  sampler x{row['sampler_ratio_vs_plain']:.2f}, step x{row['step_ratio_vs_plain']:.2f}"
                 if "sampler_ratio_vs_plain" in row else "")
        print(f"    {name:10s} sampler {row['sampler_ms_per_step']:7.3f} ms/step  step {row['step_ms']:7.2f} ms{extra}")
    out = {"machine": machine(), "device": args.device, "args": vars(args), "fork": fork, "sampler": samp}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
