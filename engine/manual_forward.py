"""One sequence's forward over explicit, partial KV: some rows computed, the rest given.

Remapping needs scattered queries (parameter tokens in the middle, recomputed template tokens
anywhere), keys that mix given (reused) and fresh KV at every layer, arbitrary positions (Prompt
Cache's gaps) and a set of computed rows that shrinks after a selection layer (CacheBlend). This
module is a thin wrapper over ``ModelRunner.forward``, the one forward implementation: the
sequence's dense KV becomes a flat-slot cache (slot i = row i), the computed rows one
``SeqSlice`` with a position mask (a row sees every row whose position is <= its own) and,
for CacheBlend, a row filter. With no given KV the logits equal a full prefill.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from engine.kv_cache import PagedKVCache
from engine.model_runner import ForwardBatch, ModelRunner, SeqSlice


@dataclass
class SeqKV:
    """Per-layer K (rotated at ``positions``) and V of one sequence: ``[layers, n, kv_heads, head_dim]``."""

    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor  # [n] long

    def __len__(self) -> int:
        return self.positions.shape[0]


# select(layer, rows, k_rows, v_rows) -> positions into ``rows`` that keep being computed
Selector = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def model_dims(model: torch.nn.Module) -> tuple[int, int, int, int]:
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, head_dim


@torch.inference_mode()
def partial_forward(
    model: torch.nn.Module,
    ids: torch.Tensor,
    positions: torch.Tensor,
    rows: torch.Tensor,
    given: SeqKV | None = None,
    select_layer: int | None = None,
    select: Selector | None = None,
    all_logits: bool = False,
) -> tuple[torch.Tensor, SeqKV]:
    """Run ``rows`` (sorted indices into the sequence) through every layer; every other row's
    K/V is taken from ``given`` (which must hold it, rotated at ``positions``; it is not
    modified). After layer ``select_layer`` the computed rows shrink to ``rows[select(...)]``;
    the last row must stay.

    A row attends to every row whose position is <= its own. Returns (logits of the last
    sequence row ``[vocab]`` — or of every row in ``rows`` ``[R, vocab]`` with ``all_logits``,
    which excludes ``select`` — and the sequence's K/V with the computed rows filled in).
    """
    if all_logits and select is not None:
        raise ValueError("all_logits needs every row through every layer (no select)")
    n = ids.shape[0]
    if rows.numel() == 0 or int(rows[-1]) != n - 1:
        raise ValueError("the last row must be computed (its logits are the output)")
    n_layers, _, n_kv, head_dim = model_dims(model)
    dtype = model.model.embed_tokens.weight.dtype
    if given is None:
        shape = (n_layers, n, n_kv, head_dim)
        k_all, v_all = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    else:
        k_all, v_all = given.k.to(dtype, copy=True), given.v.to(dtype, copy=True)
    mask = positions[None, :] <= positions[rows][:, None]  # [R, n]
    row_filter = None
    if select is not None:
        row_filter = lambda layer, k, v: select(layer, rows, k, v)  # noqa: E731
    seq = SeqSlice(0, rows.shape[0], n, torch.arange(n), mask, select_layer if select else None, row_filter)
    out_rows = torch.arange(rows.shape[0]) if all_logits else torch.tensor([rows.shape[0] - 1])
    batch = ForwardBatch(ids[rows], positions[rows], rows, [seq], None, None, None, out_rows)
    runner = ModelRunner(model, PagedKVCache.wrap_dense(k_all, v_all), attention="sdpa")
    logits = runner.forward(batch)
    return (logits if all_logits else logits[0]), SeqKV(k_all, v_all, positions.clone())


def full_prefill(model: torch.nn.Module, ids: list[int], positions: list[int] | None = None) -> tuple[torch.Tensor, SeqKV]:
    """Every row computed: the reference (with contiguous positions it equals HF's forward)."""
    t = torch.tensor(ids, dtype=torch.long)
    pos = torch.arange(len(ids)) if positions is None else torch.tensor(positions, dtype=torch.long)
    return partial_forward(model, t, pos, torch.arange(len(ids)))


def _followed_by(model: torch.nn.Module, kv: SeqKV, tokens: list[int], positions: torch.Tensor
                 ) -> tuple[torch.Tensor, SeqKV, torch.Tensor]:
    """(ids, given KV, computed rows) for ``tokens`` fed after ``kv`` at ``positions``."""
    m = len(tokens)
    n_layers, _, n_kv, head_dim = model_dims(model)
    pad = torch.zeros(n_layers, m, n_kv, head_dim, dtype=kv.k.dtype)
    given = SeqKV(torch.cat([kv.k, pad], 1), torch.cat([kv.v, pad], 1),
                  torch.cat([kv.positions, positions]))
    ids = torch.zeros(len(given), dtype=torch.long)
    ids[-m:] = torch.tensor(tokens, dtype=torch.long)
    return ids, given, torch.arange(len(kv), len(given))


def extend(model: torch.nn.Module, kv: SeqKV, token: int, position: int | None = None) -> tuple[torch.Tensor, SeqKV]:
    """Decode one token after ``kv`` (at the next position unless given)."""
    pos = int(kv.positions.max()) + 1 if position is None else position
    ids, given, rows = _followed_by(model, kv, [token], torch.tensor([pos]))
    return partial_forward(model, ids, given.positions, rows, given)


def teacher_force(model: torch.nn.Module, kv: SeqKV, tokens: list[int]) -> torch.Tensor:
    """Logits ``[len(tokens), vocab]`` after each of ``tokens`` fed after ``kv`` at the next
    positions, in one forward (row i sees the prompt and tokens[: i + 1])."""
    start = int(kv.positions.max()) + 1
    ids, given, rows = _followed_by(model, kv, tokens, torch.arange(start, start + len(tokens)))
    return partial_forward(model, ids, given.positions, rows, given, all_logits=True)[0]


def greedy_continue(model: torch.nn.Module, logits: torch.Tensor, kv: SeqKV, n_new: int) -> list[int]:
    """Greedy tokens after a prefill whose last logits and KV are given."""
    out = []
    for i in range(n_new):
        tok = int(logits.argmax())
        out.append(tok)
        if i + 1 < n_new:
            logits, kv = extend(model, kv, tok)
    return out
