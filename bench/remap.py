"""Quality harness for Oneiros parameter remapping on the default model (issue 6).

For every task (``bench/remap_tasks.py``) a pool of donor prompts is cached (full prefill), then
each evaluation prompt picks a donor per policy and is prefilled with reused KV. Per policy and
recompute ratio r it reports: share of prompt tokens served from shared KV (not computed), share
of KV blocks physically shared (Δ = 0, not recomputed), TTFT ratio vs full prefill (same forward,
single thread), and quality vs full prefill of the same prompt: greedy exact match of the first
``--new`` tokens, next-token top-1 agreement, mean KL(full || remapped) of the next token.
Configs with a gate (``RepairGate``) recompute a request exactly when a greedy choice in its
first tokens has a logit margin below the gate; such a request counts as reusing nothing and
pays the repair in its TTFT.

"gated" configs replay each task's evaluation prompts in order through the online quality gate
(``policies.remap.QualityGate``, one key per task, as the engine keys a template): a request
the gate serves exactly (calibration, recheck, closed) reuses only the exact prefix of the LCP
donor and matches by construction; when the gate asks, it is then shadow-checked at the gate's r
(``engine.approx.teacher_forced_agreement``: the exact greedy output teacher-forced through the
approximate KV, outside its TTFT). Requests of an open key are served approximately at the r
the gate chose and measured like every other row. ``--gate-*`` set the gate's knob; the gated
summary counts requests per mode (approx / calibration / recheck / closed / no donor).

    nice -n 10 .venv/bin/python bench/remap.py            # ~7 min on 2 shared CPU cores (when not contended)
    nice -n 10 .venv/bin/python bench/remap.py --quick    # smoke run
    nice -n 10 .venv/bin/python bench/remap.py --prompts 24 --configs "gated,exact prefix"  # gate only
Writes bench/results/remap.json and bench/results/remap_frontier.png (``--out X.json``: X_frontier.png).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.remap_tasks import make_instances  # noqa: E402
from engine.approx import teacher_forced_agreement  # noqa: E402
from engine.manual_forward import SeqKV, extend, full_prefill, greedy_continue  # noqa: E402
from engine.model_loader import load_model  # noqa: E402
from engine.remap import remap_prefill  # noqa: E402
from policies.remap import (  # noqa: E402
    GateConfig, GateState, HashRemap, IdentityRemap, LearnableRemap, QualityGate, RemapPlan, RepairGate, common_prefix,
    fixed_slot_positions, query_suffix_start, slot_usage, structural_recompute,
)

RESULTS = Path(__file__).resolve().parent / "results"
BLOCK = 16


@dataclass(frozen=True)
class Config:
    name: str
    policy: str  # prefix | identity | hash | learnable | promptcache
    r: float = 0.0
    select: str = "none"  # none | deviation | structural | learned | learned+structural
    gate: float = 0.0  # RepairGate min logit margin; 0 = no gate
    gated: bool = False  # online QualityGate: r is the first rung; prompts replayed in order


def configs(have_learned: bool) -> list[Config]:
    out = [Config("exact prefix (LCP donor)", "prefix")]
    for p, ratios in (("identity", (0.15, 0.3, 0.5)), ("hash", (0.3,))):
        out.append(Config(f"{p} r=0", p))
        for r in ratios:
            out.append(Config(f"{p} r={r} deviation@L1", p, r, "deviation"))
        out.append(Config(f"{p} structural", p, 0.0, "structural"))
    if have_learned:
        for r in (0.15, 0.3):
            out.append(Config(f"learnable r={r}", "learnable", r, "learned"))
        out.append(Config("learnable r=0.15 + gate 1.0", "learnable", 0.15, "learned", 1.0))
        out.append(Config("learnable r=0.15 + gate 2.0", "learnable", 0.15, "learned", 2.0))
    out.append(Config("hash r=0 + gate 1.0", "hash", gate=1.0))
    out.append(Config("identity r=0 + gate 1.0", "identity", gate=1.0))
    out.append(Config("promptcache Δ=0 r=0", "promptcache"))
    out.append(Config("gated identity r=0 deviation@L1", "identity", 0.0, "deviation", gated=True))
    out.append(Config("gated hash r=0.3 deviation@L1", "hash", 0.3, "deviation", gated=True))
    if have_learned:
        out.append(Config("gated learnable r=0.15", "learnable", 0.15, "learned", gated=True))
    return out


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    lp, lq = torch.log_softmax(p_logits.double(), -1), torch.log_softmax(q_logits.double(), -1)
    return float((lp.exp() * (lp - lq)).sum())


def trim_eos(toks: list[int], eos: int | None) -> list[int]:
    return toks[: toks.index(eos) + 1] if eos is not None and eos in toks else toks


def greedy_matches(model, logits: torch.Tensor, kv: SeqKV, ref: list[int], ids: list[int], gate: RepairGate | None = None) -> tuple[bool, int | None, float]:
    """Whether greedy decoding reproduces ``ref`` (stops at the first difference), the step at
    which ``gate`` replaced the approximate KV by an exact prefill (None if it did not) and the
    seconds that repair took."""
    repaired, repair_s = None, 0.0
    for i, want in enumerate(ref):
        if gate is not None and repaired is None:
            top2 = torch.topk(logits, 2).values
            if gate.repair(i, float(top2[0] - top2[1])):
                t0 = time.perf_counter()
                repaired = i
                logits, kv = full_prefill(model, ids + ref[:i])
                repair_s = time.perf_counter() - t0
        if int(logits.argmax()) != want:
            return False, repaired, repair_s
        if i + 1 < len(ref):
            logits, kv = extend(model, kv, want)
    return True, repaired, repair_s


def shared_blocks(plan: RemapPlan, pos: list[int], donor_pos: list[int]) -> tuple[int, int]:
    """(blocks physically shareable, blocks of the new prompt) in position space: a block is
    shared when every token in it is reused in place (same position, not recomputed) and the
    donor holds exactly those tokens there."""
    blocks: dict[int, list[int]] = {}
    for i, p in enumerate(pos):
        blocks.setdefault(p // BLOCK, []).append(i)
    donor_count: dict[int, int] = {}
    for p in donor_pos:
        donor_count[p // BLOCK] = donor_count.get(p // BLOCK, 0) + 1
    shared = 0
    for b, rows in blocks.items():
        full = max(rows) < len(pos) - 1 or len(rows) == BLOCK  # the last, partial block is never shared
        ok = full and all(
            plan.src[i] is not None and i not in plan.recompute and donor_pos[plan.src[i]] == pos[i] for i in rows
        )
        shared += ok and donor_count.get(b, 0) == len(rows)
    return shared, len(blocks)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="tiny smoke configuration")
    ap.add_argument("--donors", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=12, help="evaluation prompts per task")
    ap.add_argument("--new", type=int, default=8, help="greedy tokens compared")
    ap.add_argument("--suffix-tokens", type=int, default=8,
                    help="query suffix always computed: the last N tokens (or all after the last parameter)")
    ap.add_argument("--tasks", default="fewshot,translate,form")
    ap.add_argument("--learned", default=str(RESULTS / "learnable_remap.json"))
    ap.add_argument("--out", default=str(RESULTS / "remap.json"))
    ap.add_argument("--configs", default="", help="comma-separated substrings: run only configs whose name has one")
    ap.add_argument("--gate-samples", type=int, default=GateConfig.samples, help="gated: shadow checks per calibration")
    ap.add_argument("--gate-min-agreement", type=float, default=GateConfig.min_agreement)
    ap.add_argument("--gate-recheck", type=int, default=GateConfig.recheck_every, help="gated: recheck every n-th request")
    ap.add_argument("--gate-ladder", default=",".join(map(str, GateConfig.ladder)), help="gated: shares after the first")
    args = ap.parse_args()
    if args.quick:
        args.donors, args.prompts, args.new = 3, 2, 4
    gate_cfg = GateConfig(min_agreement=args.gate_min_agreement, samples=args.gate_samples, recheck_every=args.gate_recheck,
                          ladder=tuple(float(x) for x in args.gate_ladder.split(",") if x), max_check_tokens=args.new)
    torch.set_num_threads(1)  # 2 shared cores: one thread gives stable, uncontended timings
    loaded = load_model("default")
    model, tok = loaded.model, loaded.tokenizer
    eos = getattr(tok, "eos_token_id", None)
    learned: dict[str, LearnableRemap] = {}
    if Path(args.learned).is_file():
        learned = {t: LearnableRemap.from_json(d) for t, d in json.loads(Path(args.learned).read_text())["tasks"].items()}
    cfgs = configs(bool(learned))
    if args.configs:
        cfgs = [c for c in cfgs if any(w in c.name for w in args.configs.split(","))]
    gates: dict[str, QualityGate] = {}  # per task: one gate, keyed by config
    policies = {"identity": IdentityRemap(), "hash": HashRemap(length_step=8)}
    rows: dict[tuple[str, str], list[dict]] = {}
    t_start = time.perf_counter()
    for task in args.tasks.split(","):
        donors = make_instances(tok, task, args.donors, seed=1)
        evals = make_instances(tok, task, args.prompts, seed=2, uid0=1000)
        every = donors + evals
        slots = {k: max(slot_usage(i)[k] for i in every) for k in every[0].template.params}
        donor_kv: dict[int, SeqKV] = {d.uid: full_prefill(model, list(d.token_ids))[1] for d in donors}
        pc_pos = {d.uid: fixed_slot_positions(d, slots) for d in every}
        donor_pc: dict[int, SeqKV] = {d.uid: full_prefill(model, list(d.token_ids), list(pc_pos[d.uid]))[1] for d in donors}
        qgate = gates.setdefault(task, QualityGate())
        for inst in evals:
            ids = list(inst.token_ids)
            t0 = time.perf_counter()
            ref_logits, ref_kv = full_prefill(model, ids)
            t_full = time.perf_counter() - t0
            ref_out = trim_eos(greedy_continue(model, ref_logits, ref_kv, args.new), eos)
            suffix = query_suffix_start(inst, args.suffix_tokens)
            for cfg in cfgs:
                if cfg.gated:
                    rows.setdefault((task, cfg.name), []).append(_gated(
                        cfg, qgate, gate_cfg, model, inst, donors, policies, learned.get(task), donor_kv, ref_logits,
                        ref_out, t_full, suffix))
                    continue
                donor, kvs, positions = _donor(cfg, inst, donors, policies, learned.get(task), donor_kv, donor_pc)
                if donor is None:
                    plan = RemapPlan(tuple([None] * len(ids)), 0)
                    kv_d = None
                else:
                    kv_d = kvs[donor.uid]
                    plan = _plan(cfg, inst, donor, policies, learned.get(task), slots if positions == "pc" else positions)
                t0 = time.perf_counter()
                if kv_d is None:
                    logits, kv = full_prefill(model, ids)
                    computed = len(ids)
                else:
                    r_dev = cfg.r if cfg.select == "deviation" else 0.0
                    res = remap_prefill(model, ids, kv_d, plan, r=r_dev, suffix_start=suffix)
                    logits, kv, plan, computed = res.logits, res.kv, res.plan, res.computed
                t_remap = time.perf_counter() - t0
                gate = RepairGate(cfg.gate, args.new) if cfg.gate else None
                match, repaired, repair_s = greedy_matches(model, logits, kv, ref_out, ids, gate)
                if repaired is not None:  # the gated request paid a full prefill and reused nothing
                    t_remap += repair_s  # counted in TTFT even when the repair came after token 1
                    computed, plan = len(ids), RemapPlan(tuple([None] * len(ids)), 0)
                    if repaired == 0:  # the first token came from exact KV
                        logits = ref_logits
                pos = list(plan.slot_positions) if plan.slot_positions else list(range(len(ids)))
                sb, nb = shared_blocks(plan, pos, kv_d.positions.tolist()) if kv_d is not None else (0, 1)
                nb = max(nb, -(-len(ids) // BLOCK))
                rows.setdefault((task, cfg.name), []).append({
                    "tokens": len(ids), "reused": len(ids) - computed, "exact": plan.exact_prefix,
                    "shared_blocks": sb, "blocks": nb, "t_full": t_full, "t_remap": t_remap,
                    "exact_match": match, "repaired": repaired is not None, "top1": int(logits.argmax()) == int(ref_logits.argmax()),
                    "kl": kl(ref_logits, logits),
                })
        print(f"[{time.perf_counter() - t_start:6.0f}s] {task}: {len(evals)} prompts x {len(cfgs)} configs", flush=True)
    report(rows, cfgs, args, loaded.name, time.perf_counter() - t_start, gates)


def _gated(cfg, gate, gate_cfg, model, inst, donors, policies, learned, donor_kv, ref_logits, ref_out, t_full,
           suffix) -> dict:
    """One request of a gated config, served as the engine serves it (see the module docstring)."""
    ids = list(inst.token_ids)
    key = (cfg.name, "task")
    donor, _, layout = _donor(cfg, inst, donors, policies, learned, donor_kv, None)
    d = None if layout == "prefix" else gate.decide(key, gate_cfg, cfg.r)  # no donor of the class: not asked
    if d is not None and d.approximate:
        mode, served = "approx", donor
        plan = _plan(replace(cfg, r=d.r), inst, donor, policies, learned, None)
    else:
        mode = ("no_donor" if d is None else "closed" if not d.shadow
                else "recheck" if d.state == GateState.OPEN else "calibration")
        served = max(donors, key=lambda x: common_prefix(ids, x.token_ids))
        pre = common_prefix(ids, served.token_ids)
        plan = RemapPlan(tuple(list(range(pre)) + [None] * (len(ids) - pre)), pre)
    t0 = time.perf_counter()
    res = _gated_prefill(cfg, model, ids, donor_kv[served.uid], plan, d.r if mode == "approx" else 0.0, suffix)
    t_remap = time.perf_counter() - t0
    match, _, _ = greedy_matches(model, res.logits, res.kv, ref_out, ids)
    if d is not None and d.shadow:  # the shadow check, after the request (not in its TTFT)
        check = _gated_prefill(cfg, model, ids, donor_kv[donor.uid],
                               _plan(replace(cfg, r=d.r), inst, donor, policies, learned, None), d.r, suffix)
        gate.record(key, d.r, teacher_forced_agreement(model, check.logits, check.kv, ref_out, ref_out, ref_logits))
    sb, nb = shared_blocks(res.plan, list(range(len(ids))), donor_kv[served.uid].positions.tolist())
    return {"tokens": len(ids), "reused": len(ids) - res.computed, "exact": res.plan.exact_prefix,
            "shared_blocks": sb, "blocks": max(nb, -(-len(ids) // BLOCK)), "t_full": t_full, "t_remap": t_remap,
            "exact_match": match, "repaired": False, "top1": int(res.logits.argmax()) == int(ref_logits.argmax()),
            "kl": kl(ref_logits, res.logits), "mode": mode, "r": d.r if mode == "approx" else None}


def _gated_prefill(cfg, model, ids, kv, plan, r, suffix):
    """Deviation selection picks its share inside the prefill; learned selection is in the plan."""
    return remap_prefill(model, ids, kv, plan, r=r if "deviation" in cfg.select else 0.0, suffix_start=suffix)


def _donor(cfg, inst, donors, policies, learned, donor_kv, donor_pc):
    if cfg.policy == "prefix":
        best = max(donors, key=lambda d: common_prefix(inst.token_ids, d.token_ids))
        return best, donor_kv, None
    if cfg.policy == "promptcache":
        return IdentityRemap().choose_donor(inst, donors), donor_pc, "pc"
    pol = learned if cfg.policy == "learnable" else policies[cfg.policy]
    donor = pol.choose_donor(inst, donors)
    if donor is None:  # no donor of the same slot class: exact prefix only
        return max(donors, key=lambda d: common_prefix(inst.token_ids, d.token_ids)), donor_kv, "prefix"
    return donor, donor_kv, None


def _plan(cfg, inst, donor, policies, learned, layout) -> RemapPlan:
    """layout: None (contiguous), "prefix" (no donor of the slot class: exact prefix only) or
    Prompt Cache's slot table {param: reserved positions}."""
    if cfg.policy == "prefix" or layout == "prefix":
        pre = common_prefix(inst.token_ids, donor.token_ids)
        return RemapPlan(tuple(list(range(pre)) + [None] * (len(inst.token_ids) - pre)), pre)
    pol = learned if cfg.policy == "learnable" else policies.get(cfg.policy, IdentityRemap())
    plan = pol.plan(inst, donor)
    if isinstance(layout, dict):  # Prompt Cache: fixed slot lengths, template text never moves
        plan = RemapPlan(plan.src, plan.exact_prefix, plan.recompute, fixed_slot_positions(inst, layout))
    if "structural" in cfg.select:
        plan = structural_recompute(plan, inst, after_change=3)
    if "learned" in cfg.select:
        plan = learned.select(plan, inst, cfg.r)
    return plan


def report(rows, cfgs, args, model_name, elapsed, gates=None) -> None:
    table = []
    tasks = sorted({t for t, _ in rows})
    for cfg in cfgs:
        per_task = {}
        allr = []
        for t in tasks:
            rs = rows.get((t, cfg.name), [])
            allr += rs
            per_task[t] = _summary(rs)
        table.append({"config": cfg.name, "policy": cfg.policy, "r": cfg.r, "select": cfg.select, "all": _summary(allr), "tasks": per_task})
    out = {
        "model": model_name, "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch_threads": 1},
        "args": vars(args), "elapsed_s": elapsed, "block_size": BLOCK, "table": table,
        "per_prompt": {f"{t}|{c}": rs for (t, c), rs in rows.items()},
        "gates": {t: g.snapshot() for t, g in (gates or {}).items()},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    hdr = f"{'config':34s} {'reused':>6s} {'blocks':>6s} {'ttft':>5s} {'greedyEM':>8s} {'top1':>5s} {'KL':>7s} {'gated':>5s}  per task reused/EM"
    print(hdr)
    for row in table:
        a = row["all"]
        per = "  ".join(f"{t[:5]} {s['reused']:.2f}/{s['exact_match']:.2f}" for t, s in row["tasks"].items())
        print(f"{row['config']:34s} {a['reused']:6.3f} {a['blocks_shared']:6.3f} {a['ttft_ratio']:5.2f} {a['exact_match']:8.3f} {a['top1']:5.3f} {a['kl']:7.4f} {a['repaired']:5.2f}  {per}")
    gated = [row for row, cfg in zip(table, cfgs) if cfg.gated]
    if gated:
        print(f"gated (min_agreement {args.gate_min_agreement}, {args.gate_samples} samples, recheck every "
              f"{args.gate_recheck}, ladder {args.gate_ladder}): requests per mode, EM of approximately served, final r")
        for row in gated:
            a = row["all"]
            modes = " ".join(f"{m} {k}" for m, k in sorted(a["modes"].items()))
            em = "-" if a["em_approx"] is None else f"{a['em_approx']:.3f}"
            final = "  ".join(f"{t[:5]} {g['state']}@{g['r']}" for t in tasks
                              for k, g in (gates or {}).get(t, QualityGate()).snapshot().items() if k.startswith(row["config"] + "/"))
            print(f"  {row['config']:34s} {modes}; EM approx {em}; {final}")
    print(f"model {model_name}, {len(tasks)} tasks, elapsed {elapsed:.0f}s, machine {platform.machine()} x{os.cpu_count()}, 1 torch thread")
    _plot(table, Path(args.out).with_name(Path(args.out).stem + "_frontier.png"))


def _summary(rs: list[dict]) -> dict:
    if not rs:
        return {}
    n = len(rs)
    return {
        "prompts": n,
        "reused": sum(r["reused"] for r in rs) / sum(r["tokens"] for r in rs),
        "exact_prefix": sum(r["exact"] for r in rs) / sum(r["tokens"] for r in rs),
        "blocks_shared": sum(r["shared_blocks"] for r in rs) / sum(r["blocks"] for r in rs),
        "ttft_ratio": sum(r["t_remap"] for r in rs) / sum(r["t_full"] for r in rs),
        "exact_match": sum(r["exact_match"] for r in rs) / n,
        "top1": sum(r["top1"] for r in rs) / n,
        "kl": sum(r["kl"] for r in rs) / n,
        "repaired": sum(r.get("repaired", False) for r in rs) / n,
        **(_gated_summary(rs) if "mode" in rs[0] else {}),
    }


def _gated_summary(rs: list[dict]) -> dict:
    """Requests per gate mode and greedy EM of those served approximately (None if none were)."""
    modes: dict[str, int] = {}
    for r in rs:
        modes[r["mode"]] = modes.get(r["mode"], 0) + 1
    served = [r for r in rs if r["mode"] == "approx"]
    return {"modes": modes, "em_approx": sum(r["exact_match"] for r in served) / len(served) if served else None}


def _plot(table, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    marks = {"prefix": "s", "identity": "o", "hash": "^", "learnable": "*", "promptcache": "D"}
    for row in table:
        a = row["all"]
        ax.scatter(a["reused"], a["exact_match"], marker=marks.get(row["policy"], "o"), s=60, label=row["config"])
    ax.axvline(0.7, ls=":", c="grey")
    ax.axhline(0.99, ls=":", c="grey")
    ax.set_xlabel("share of prompt tokens served from shared KV")
    ax.set_ylabel("greedy exact match vs full prefill")
    ax.set_title("Remap frontier (SmolLM2-135M, all tasks)")
    ax.legend(fontsize=6, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
