"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds."""

from __future__ import annotations

import torch

from engine.sequence import SamplingParams


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """One token per row of ``logits`` [S, V] (float32)."""
    out = logits.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        row = logits[i] / p.temperature
        if p.top_k and p.top_k < row.numel():
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sorted_p, order = probs.sort(descending=True)
            cum = sorted_p.cumsum(0)
            # keep the smallest prefix whose mass reaches top_p (always at least one token)
            drop = (cum - sorted_p) >= p.top_p
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
        out[i] = int(torch.multinomial(probs, 1, generator=generators[i]).item())
    return out
