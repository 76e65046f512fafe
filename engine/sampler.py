"""Batched token sampling over the rows of one engine step.

Every option is a tensor operation over the rows that use it (never a Python loop over the
vocabulary); rows without options stay on the fast path (one argmax, one softmax + multinomial).
Processing order, per row: repetition penalty (prompt + output tokens, HF/vLLM rule), frequency
and presence penalties (output tokens, OpenAI rule), logit_bias, the grammar mask, banned ids
(min_tokens: EOS and stop ids; not where they are all the grammar allows, i.e. its output is
complete: the grammar's constraint is hard, min_tokens yields), then temperature, top_k, min_p,
top_p and the draw. Greedy rows (temperature < 1e-5) take the argmax of the processed logits.

Logprobs are ``log_softmax`` of the raw logits (before any processing), as vLLM's default.

Invariants: no input makes a NaN reach ``multinomial``; a row whose distribution is unusable
(all tokens masked, non-finite logits) gets an error string instead of a token and the other
rows are sampled as usual. ``sample`` never raises for a bad row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sequence import SamplingParams, TokenLogprob


@dataclass
class SampleRow:
    params: SamplingParams
    generator: torch.Generator | None = None
    tokens: list[int] | None = None  # prompt + generated ids (penalties); None if not penalized
    num_prompt: int = 0
    banned: tuple[int, ...] = ()  # token ids this row may not draw this step (min_tokens: EOS, stop ids)


@dataclass
class SampleResult:
    tokens: list[int]  # -1 where the row failed
    logprobs: list[TokenLogprob | None]
    errors: list[str | None]


def _idx(rows: list[int], device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long, device=device)


def _token_counts(lists: list[list[int]], vocab: int, device) -> torch.Tensor:
    """[R, vocab] float counts of each row's token ids (one scatter over a padded matrix)."""
    width = max(1, max(len(x) for x in lists))
    mat = torch.full((len(lists), width), vocab, dtype=torch.long)
    for j, ids in enumerate(lists):
        if ids:
            mat[j, : len(ids)] = torch.as_tensor(ids, dtype=torch.long)
    mat = mat.to(device)
    counts = torch.zeros(len(lists), vocab + 1, device=device)
    counts.scatter_add_(1, mat, torch.ones_like(mat, dtype=counts.dtype))
    return counts[:, :vocab]


def apply_penalties(x: torch.Tensor, rows: list[SampleRow]) -> None:
    """Repetition, frequency/presence penalties and logit_bias, in place on ``x`` [S, V]."""
    V, dev = x.shape[1], x.device
    rep = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
    if rep:
        idx = _idx(rep, dev)
        seen = _token_counts([rows[i].tokens for i in rep], V, dev) > 0
        pen = torch.tensor([rows[i].params.repetition_penalty for i in rep], device=dev)[:, None]
        sub = x[idx]
        # a penalty below ~1e-38 is 0 in float32: the quotient saturates at the largest finite
        # logit instead of reaching inf (which would leave the row with nothing to sample)
        up = (sub / pen).clamp(max=torch.finfo(x.dtype).max)
        x[idx] = torch.where(seen, torch.where(sub > 0, up, sub * pen), sub)
    fp = [i for i, r in enumerate(rows) if r.params.frequency_penalty or r.params.presence_penalty]
    if fp:
        idx = _idx(fp, dev)
        counts = _token_counts([rows[i].tokens[rows[i].num_prompt :] for i in fp], V, dev)
        freq = torch.tensor([rows[i].params.frequency_penalty for i in fp], device=dev)[:, None]
        pres = torch.tensor([rows[i].params.presence_penalty for i in fp], device=dev)[:, None]
        x[idx] = x[idx] - freq * counts - pres * (counts > 0).float()
    bias = [(i, t, b) for i, r in enumerate(rows) for t, b in r.params.logit_bias if t < V]
    if bias:
        r_, t_, b_ = zip(*bias)
        x.index_put_((_idx(list(r_), dev), _idx(list(t_), dev)), torch.tensor(b_, device=dev), accumulate=True)


def apply_bans(x: torch.Tensor, rows: list[SampleRow]) -> None:
    """Each row's banned ids to -inf, in place on ``x`` [S, V], where that leaves the row a token
    to draw: where the ids are all a grammar allows (its JSON is complete), the row keeps them.
    One gather, one scatter and one reduction over the banned rows, whatever their number."""
    V, dev = x.shape[1], x.device
    ban = [(i, t) for i, r in enumerate(rows) for t in r.banned if t < V]
    if not ban:
        return
    banned_rows = sorted({i for i, _ in ban})
    at = {i: j for j, i in enumerate(banned_rows)}
    kept = x[_idx(banned_rows, dev)]  # a copy
    kept[_idx([at[i] for i, _ in ban], dev), _idx([t for _, t in ban], dev)] = float("-inf")
    left = torch.isfinite(kept.max(dim=-1).values)  # a token is left to draw
    x[_idx(banned_rows, dev)[left]] = kept[left]


def _filtered_probs(z: torch.Tensor, top_k: list[int], top_p: list[float], min_p: list[float]) -> torch.Tensor:
    """Probabilities [R, V] after top_k, min_p and top_p (each row keeps at least its best token)."""
    V = z.shape[1]
    if all((k == 0 or k >= V) for k in top_k) and all(p >= 1.0 for p in top_p) and not any(min_p):
        return torch.softmax(z, dim=-1)
    dev = z.device
    sz, order = z.sort(dim=-1, descending=True)
    ranks = torch.arange(V, device=dev)[None, :]
    k = torch.tensor([kk if 0 < kk < V else V for kk in top_k], device=dev)[:, None]
    sz = sz.masked_fill(ranks >= k, float("-inf"))
    ps = torch.softmax(sz, dim=-1)
    drop = torch.zeros_like(ps, dtype=torch.bool)
    if any(min_p):
        drop |= ps < torch.tensor(min_p, device=dev)[:, None] * ps[:, :1]
        ps = ps.masked_fill(drop, 0.0)
        ps = ps / ps.sum(dim=-1, keepdim=True)
    if any(p < 1.0 for p in top_p):
        cum = ps.cumsum(dim=-1)
        drop |= (cum - ps) >= torch.tensor(top_p, device=dev)[:, None]
    drop[:, 0] = False
    ps = ps.masked_fill(drop, 0.0)
    return torch.zeros_like(ps).scatter_(1, order, ps)


def sample(logits: torch.Tensor, rows: list[SampleRow], mask_fn=None) -> SampleResult:
    """One token per row of ``logits`` [S, V]. ``mask_fn(x)``, if given, masks the processed
    logits in place (the grammar bitmask of the grammar rows; others untouched)."""
    S = logits.shape[0]
    logits = logits.float()
    errors: list[str | None] = [None] * S
    want_lp = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    raw_lp = torch.log_softmax(logits[_idx(want_lp, logits.device)], dim=-1) if want_lp else None
    adjusted = any(r.params.penalized or r.banned for r in rows)
    processed = mask_fn is not None or adjusted
    x = logits.clone() if processed else logits
    if adjusted:
        apply_penalties(x, rows)
    if mask_fn is not None:
        mask_fn(x)
    apply_bans(x, rows)
    row_max = x.max(dim=-1).values
    ok = torch.isfinite(row_max).tolist()  # NaN anywhere or every token masked -> unusable
    for i in range(S):
        if not ok[i]:
            errors[i] = "no token can be sampled (every token masked or non-finite logits)"
    tokens = x.argmax(dim=-1).tolist()
    rand = [i for i, r in enumerate(rows) if ok[i] and not r.params.greedy]
    if rand:
        idx = _idx(rand, x.device)
        temp = torch.tensor([rows[i].params.temperature for i in rand], device=x.device)[:, None]
        z = torch.nan_to_num(x[idx] / temp, nan=float("-inf"), posinf=torch.finfo(torch.float32).max)
        probs = _filtered_probs(z, [rows[i].params.top_k for i in rand], [rows[i].params.top_p for i in rand],
                                [rows[i].params.min_p for i in rand])
        sums = probs.sum(dim=-1)
        good = (torch.isfinite(sums) & (sums > 0)).tolist()
        free = [j for j, i in enumerate(rand) if good[j] and rows[i].generator is None]
        if free:
            drawn = torch.multinomial(probs[_idx(free, x.device)], 1).flatten().tolist()
            for j, t in zip(free, drawn):
                tokens[rand[j]] = t
        for j, i in enumerate(rand):
            if not good[j]:
                errors[i] = "the sampling distribution is empty or not finite"
            elif rows[i].generator is not None:
                try:
                    tokens[i] = int(torch.multinomial(probs[j], 1, generator=rows[i].generator).item())
                except RuntimeError as e:  # e.g. a generator on another device
                    errors[i] = f"sampling failed: {e}"
    lps: list[TokenLogprob | None] = [None] * S
    if want_lp:
        chosen_ids = torch.tensor([max(tokens[i], 0) for i in want_lp], device=raw_lp.device)[:, None]
        chosen = raw_lp.gather(1, chosen_ids).flatten().tolist()
        kmax = max(rows[i].params.logprobs for i in want_lp)
        top_v = top_i = None
        if kmax:
            tv, ti = raw_lp.topk(kmax, dim=-1)
            top_v, top_i = tv.tolist(), ti.tolist()
        for j, i in enumerate(want_lp):
            if errors[i] is None:
                k = rows[i].params.logprobs
                top = tuple(zip(top_i[j][:k], top_v[j][:k])) if k else ()
                lps[i] = TokenLogprob(tokens[i], chosen[j], top)
    for i in range(S):
        if errors[i] is not None:
            tokens[i] = -1
    return SampleResult(tokens, lps, errors)


def sample_isolated(logits: torch.Tensor, rows: list[SampleRow], mask_rows=None) -> SampleResult:
    """``sample`` row by row: used when the batched call raised, so that one bad row fails alone.
    ``mask_rows(i)`` returns the mask function of row i alone (or None)."""
    out = SampleResult([], [], [])
    for i, row in enumerate(rows):
        try:
            r = sample(logits[i : i + 1], [row], mask_rows(i) if mask_rows else None)
        except Exception as e:  # noqa: BLE001 - this row fails, the step goes on
            r = SampleResult([-1], [None], [f"sampling failed: {e!r}"])
        out.tokens += r.tokens
        out.logprobs += r.logprobs
        out.errors += r.errors
    return out
