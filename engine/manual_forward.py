"""A forward over a HF Llama-family model with explicit, partial KV: some rows computed, the rest given.

Why not ``ModelRunner``: its prefill chunk is one contiguous run of positions after a cached
context. Remapping needs scattered queries (parameter tokens in the middle, recomputed template
tokens anywhere), keys that mix given (reused) and fresh KV at every layer, arbitrary positions
(Prompt Cache's gaps) and a set of computed rows that shrinks after a selection layer
(CacheBlend). A hook in ``ModelRunner`` that accepted explicit query rows and a position mask
per sequence would let the engine run this path in its batches.

Numerics follow ``ModelRunner.forward`` (the same modules, ``apply_rope`` and SDPA), so with no
given KV the logits equal a full prefill.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from engine.model_runner import apply_rope


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
) -> tuple[torch.Tensor, SeqKV]:
    """Run ``rows`` (sorted indices into the sequence) through every layer; every other row's
    K/V is taken from ``given`` (which must hold it, rotated at ``positions``). After layer
    ``select_layer`` the computed rows shrink to ``rows[select(...)]``; the last row must stay.

    A row attends to every row whose position is <= its own. Returns (logits of the last
    sequence row ``[vocab]``, the sequence's K/V with the computed rows filled in).
    """
    n_layers, n_heads, n_kv, head_dim = model_dims(model)
    n = ids.shape[0]
    if given is None:
        shape = (n_layers, n, n_kv, head_dim)
        k_all, v_all = torch.zeros(shape), torch.zeros(shape)
    else:
        k_all, v_all = given.k.clone(), given.v.clone()
    inner = model.model
    h = inner.embed_tokens(ids[rows])
    cos, sin = inner.rotary_emb(h[None], positions[rows][None])
    cos, sin = cos[0], sin[0]
    scale = head_dim**-0.5
    for layer_idx, layer in enumerate(inner.layers):
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        q = attn.q_proj(x).view(-1, n_heads, head_dim)
        k = attn.k_proj(x).view(-1, n_kv, head_dim)
        v = attn.v_proj(x).view(-1, n_kv, head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k_all[layer_idx, rows] = k
        v_all[layer_idx, rows] = v
        mask = positions[None, :] <= positions[rows][:, None]  # [R, n]
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k_all[layer_idx].transpose(0, 1)[None], v_all[layer_idx].transpose(0, 1)[None],
            attn_mask=mask, scale=scale, enable_gqa=True,
        )[0].transpose(0, 1)
        h = h + attn.o_proj(o.reshape(-1, n_heads * head_dim))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        if select is not None and layer_idx == select_layer:
            keep = select(layer_idx, rows, k, v)
            rows, h, cos, sin = rows[keep], h[keep], cos[keep], sin[keep]
    if int(rows[-1]) != n - 1:
        raise ValueError("the last row must be computed (its logits are the output)")
    logits = model.lm_head(inner.norm(h[-1:])).float()[0]
    return logits, SeqKV(k_all, v_all, positions.clone())


def full_prefill(model: torch.nn.Module, ids: list[int], positions: list[int] | None = None) -> tuple[torch.Tensor, SeqKV]:
    """Every row computed: the reference (with contiguous positions it equals HF's forward)."""
    t = torch.tensor(ids, dtype=torch.long)
    pos = torch.arange(len(ids)) if positions is None else torch.tensor(positions, dtype=torch.long)
    return partial_forward(model, t, pos, torch.arange(len(ids)))


def extend(model: torch.nn.Module, kv: SeqKV, token: int, position: int | None = None) -> tuple[torch.Tensor, SeqKV]:
    """Decode one token after ``kv`` (at the next position unless given)."""
    pos = int(kv.positions.max()) + 1 if position is None else position
    n_layers, _, n_kv, head_dim = model_dims(model)
    pad = torch.zeros(n_layers, 1, n_kv, head_dim)
    given = SeqKV(torch.cat([kv.k, pad], 1), torch.cat([kv.v, pad], 1), torch.cat([kv.positions, torch.tensor([pos])]))
    ids = torch.zeros(len(given), dtype=torch.long)
    ids[-1] = token
    return partial_forward(model, ids, given.positions, torch.tensor([len(given) - 1]), given)


def greedy_continue(model: torch.nn.Module, logits: torch.Tensor, kv: SeqKV, n_new: int) -> list[int]:
    """Greedy tokens after a prefill whose last logits and KV are given."""
    out = []
    for i in range(n_new):
        tok = int(logits.argmax())
        out.append(tok)
        if i + 1 < n_new:
            logits, kv = extend(model, kv, tok)
    return out
