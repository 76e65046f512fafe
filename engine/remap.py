"""Oneiros remap mechanism: build a new prompt's KV from a donor's KV and a ``RemapPlan``.

Given the donor's per-layer K/V (keys rotated at the donor's positions) and a plan
(``policies/remap.py``): aligned template tokens reuse the donor's KV, keys re-rotated by
Δ = new position - donor position in fp32 (rotations compose, so this equals applying RoPE at
the new position); tokens without a donor token (parameters), the plan's recompute set and the
query suffix are computed fresh. Optionally a share ``r`` of the approximately reused tokens is
recomputed, chosen by KV deviation at an early layer (CacheBlend): layers 0..``select_layer``
run over every token beyond the exact prefix, later layers only over the chosen ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.manual_forward import SeqKV, partial_forward
from engine.model_runner import apply_rope
from policies.remap import RemapPlan, top_r_by_deviation


def rope_cos_sin(model: torch.nn.Module, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of rotation angles ``delta * inv_freq`` ([n, head_dim]), computed in float64 and
    returned in fp32, without the rotary module's attention scaling (a re-rotation of an already
    scaled key must not scale it again)."""
    inv_freq = model.model.rotary_emb.inv_freq.double()
    freqs = delta.double()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().float(), emb.sin().float()


def rerotate(model: torch.nn.Module, k: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """Keys ``[layers, n, kv_heads, head_dim]`` rotated at p, returned rotated at p + delta ([n])."""
    cos, sin = rope_cos_sin(model, delta)
    layers = k.shape[0]
    flat = k.float().permute(1, 0, 2, 3).reshape(k.shape[1], -1, k.shape[-1])  # [n, L*kvh, d]
    out = apply_rope(flat, cos, sin)
    return out.reshape(k.shape[1], layers, k.shape[2], k.shape[3]).permute(1, 0, 2, 3).to(k.dtype)


@dataclass
class RemapResult:
    logits: torch.Tensor  # next-token logits [vocab]
    kv: SeqKV  # the new prompt's KV (for decoding on)
    plan: RemapPlan  # final plan (recompute set includes the deviation-selected tokens)
    computed: int  # tokens computed through the last layer


def gather_donor(model: torch.nn.Module, donor: SeqKV, plan: RemapPlan, positions: torch.Tensor) -> SeqKV:
    """The new prompt's given KV: donor rows per ``plan.src`` re-rotated to ``positions``; zeros
    where the plan has no donor token (those rows are always computed)."""
    n = len(plan.src)
    reused = torch.tensor([i for i, s in enumerate(plan.src) if s is not None], dtype=torch.long)
    srcs = torch.tensor([s for s in plan.src if s is not None], dtype=torch.long)
    shape = (donor.k.shape[0], n) + tuple(donor.k.shape[2:])
    k, v = torch.zeros(shape, dtype=donor.k.dtype), torch.zeros(shape, dtype=donor.v.dtype)
    if len(reused):
        delta = positions[reused] - donor.positions[srcs]
        dk = donor.k[:, srcs]
        moved = delta != 0
        if bool(moved.any()):
            dk = dk.clone()
            dk[:, moved] = rerotate(model, dk[:, moved], delta[moved])
        k[:, reused] = dk
        v[:, reused] = donor.v[:, srcs]
    return SeqKV(k, v, positions)


def remap_prefill(
    model: torch.nn.Module,
    ids: list[int],
    donor: SeqKV,
    plan: RemapPlan,
    r: float = 0.0,
    select_layer: int = 1,
    suffix_start: int | None = None,
    deviation: str = "v",
) -> RemapResult:
    """Prefill ``ids`` reusing ``donor`` per ``plan``; tokens from ``suffix_start`` on (default:
    the last token) are always computed; with ``r > 0`` the top-r reused tokens by ``deviation``
    ("v", "k" or "kv": L2 distance of fresh vs reused at ``select_layer``) are recomputed too."""
    n = len(ids)
    if len(plan.src) != n:
        raise ValueError("plan and prompt lengths differ")
    positions = torch.tensor(plan.slot_positions, dtype=torch.long) if plan.slot_positions else torch.arange(n)
    given = gather_donor(model, donor, plan, positions)
    suffix = n - 1 if suffix_start is None else min(suffix_start, n - 1)
    if plan.exact_prefix > suffix:  # the suffix is computed even when the donor holds it exactly
        plan = RemapPlan(plan.src, suffix, frozenset(i for i in plan.recompute if i >= suffix), plan.slot_positions)
    must = sorted({i for i, s in enumerate(plan.src) if s is None} | set(plan.recompute) | set(range(suffix, n)))
    plan = plan.with_recompute(range(suffix, n))
    t_ids = torch.tensor(ids, dtype=torch.long)
    if r <= 0:
        rows = torch.tensor(must, dtype=torch.long)
        logits, kv = partial_forward(model, t_ids, positions, rows, given)
        return RemapResult(logits, kv, plan, len(must))

    chosen: dict[str, RemapPlan] = {}
    rows = torch.arange(plan.exact_prefix, n)

    def select(layer: int, rows_: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        dev = torch.zeros(n)
        if deviation in ("v", "kv"):
            dev[rows_] += (v - given.v[layer, rows_]).float().norm(dim=(-2, -1))
        if deviation in ("k", "kv"):
            dev[rows_] += (k - given.k[layer, rows_]).float().norm(dim=(-2, -1))
        final = top_r_by_deviation(plan, dev.tolist(), r)
        chosen["plan"] = final
        keep_set = {i for i, s in enumerate(final.src) if s is None} | set(final.recompute)
        return torch.tensor([j for j, i in enumerate(rows_.tolist()) if i in keep_set], dtype=torch.long)

    logits, kv = partial_forward(model, t_ids, positions, rows, given, select_layer, select)
    final = chosen["plan"]
    return RemapResult(logits, kv, final, sum(s is None for s in final.src) + len(final.recompute))
