"""Decode over a shared prefix: the shared form (one gather of the rows' key union) vs the padded
form (each row's keys gathered, SDPA), side by side in one run on the default model.

B concurrent requests, spread over G groups; each request is a group's system prompt (512 tokens
by default, cached before timing, as on a worker holding the group) plus its own question, with
16 new tokens. Decode time = time of the batch with 16 new tokens minus the same batch with 1.
The two forms alternate per configuration (best of --reps); their greedy tokens are compared.

Usage: python bench/shared_decode.py [--rows 1,2,4,8,16] [--groups 1,2,4] [--reps 2] [--threads 1]
Writes bench/results/shared_decode.json and shared_decode.png.
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

import numpy as np  # noqa: E402
import torch  # noqa: E402

import engine.model_runner as mr  # noqa: E402
from engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from engine.model_loader import load_model  # noqa: E402
from engine.sequence import Request, SamplingParams  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def tokens(seed: int, n: int, vocab: int) -> tuple[int, ...]:
    return tuple(int(x) for x in np.random.default_rng(seed).integers(100, vocab - 100, n))


def run(engine: LLMEngine, prompts, new_tokens: int, tag: str) -> tuple[float, dict]:
    reqs = [Request(f"{tag}{i}", p, SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True))
            for i, p in enumerate(prompts)]
    t = time.perf_counter()
    out = engine.generate(reqs)
    wall = time.perf_counter() - t
    return wall, {k[len(tag):]: [t for o in v for t in o.new_token_ids] for k, v in out.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--groups", default="1,2,4")
    ap.add_argument("--system-tokens", type=int, default=512)
    ap.add_argument("--question-tokens", type=int, default=40)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (a kvmesh worker runs one)")
    ap.add_argument("--out", default=str(RESULTS / "shared_decode.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model("default")
    vocab = loaded.model.config.vocab_size
    engine = LLMEngine(EngineConfig(num_blocks=4096, max_num_batched_tokens=1024, max_num_seqs=64), loaded=loaded)
    machine = {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
               "processor": platform.processor() or platform.machine(), "python": platform.python_version()}
    print(f"machine: {machine}")
    print(f"{'rows':>4s} {'groups':>6s} {'padded decode s':>16s} {'shared decode s':>16s} {'ratio':>6s} "
          f"{'shared used':>11s} {'tokens equal':>12s}")
    margin = mr.SHARED_DECODE_MARGIN
    rows_out = []
    for b in [int(x) for x in args.rows.split(",")]:
        for g in [int(x) for x in args.groups.split(",")]:
            if g > b or (g > 1 and b == 1):
                continue
            heads = [tokens(1000 + i, args.system_tokens, vocab) for i in range(g)]
            prompts = [heads[i % g] + tokens(i, args.question_tokens, vocab) for i in range(b)]
            run(engine, prompts, 1, "warm")  # the prefixes and questions are cached from here on
            best = {"padded": [float("inf"), float("inf")], "shared": [float("inf"), float("inf")]}
            outs, used = {}, []
            real = mr.attend_decode_shared
            mr.attend_decode_shared = lambda q, *a: used.append(q.shape[0]) or real(q, *a)
            try:
                for _ in range(args.reps):
                    for mode in ("padded", "shared"):
                        mr.SHARED_DECODE_MARGIN = 0 if mode == "padded" else margin
                        full, outs[mode] = run(engine, prompts, args.new_tokens, mode)
                        one, _ = run(engine, prompts, 1, mode + "1_")
                        best[mode] = [min(best[mode][0], full), min(best[mode][1], one)]
            finally:
                mr.attend_decode_shared, mr.SHARED_DECODE_MARGIN = real, margin
            dec = {m: best[m][0] - best[m][1] for m in best}
            row = {"rows": b, "groups": g, "padded": {"total_s": best["padded"][0], "decode_s": dec["padded"]},
                   "shared": {"total_s": best["shared"][0], "decode_s": dec["shared"]},
                   "decode_ratio_padded_over_shared": dec["padded"] / dec["shared"],
                   "decode_tok_s": {m: b * (args.new_tokens - 1) / dec[m] for m in dec},
                   "shared_form_used": bool(used), "tokens_equal": outs["padded"] == outs["shared"]}
            rows_out.append(row)
            print(f"{b:4d} {g:6d} {dec['padded']:16.3f} {dec['shared']:16.3f} {row['decode_ratio_padded_over_shared']:6.2f} "
                  f"{str(bool(used)):>11s} {str(row['tokens_equal']):>12s}", flush=True)
    out = {"bench": "shared_decode", "machine": machine, "args": vars(args), "rows": rows_out}
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    print(f"wrote {path}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for g in sorted({r["groups"] for r in rows_out}):
        rs = [r for r in rows_out if r["groups"] == g]
        for mode, style in (("padded", "--"), ("shared", "-")):
            ax.plot([r["rows"] for r in rs], [r["decode_tok_s"][mode] for r in rs], style, marker="o",
                    label=f"{mode}, {g} group(s)")
    ax.set_xlabel("concurrent decode rows")
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"decode over cached {args.system_tokens}-token prefixes, {args.threads} thread(s)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=110)
    print(f"wrote {path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
