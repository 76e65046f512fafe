"""Our own forward over a HF Llama/Qwen2/Mistral model's weights, reading and writing the paged cache.

Why our own forward rather than transformers' cache hooks: a continuous batch mixes prefill
chunks (with or without cached context) and single-token decodes of many sequences in one
flattened token array. Linear layers run once over all tokens; only attention is per sequence
(SDPA on CPU) or one varlen kernel (flash-attn on CUDA). The HF modules supply the weights,
norms, MLP and rotary embedding, so numerics match ``model.forward``.

Decode rows that share a cached prefix (rows whose block tables start with the same block) attend
as one group: the union of their keys is gathered once and each KV head scores all of the group's
queries in one matmul (``plan_decode``; 1.2-2.2x faster decode at 4-16 rows over a 512-token
prefix on one CPU thread, ``bench/shared_decode.py``). Other rows keep the padded per-row gather.

A slice may also carry an explicit key-visibility mask (query rows at arbitrary positions and
slots, e.g. KV remapping's scattered recomputed tokens among reused ones) and a row filter that
drops some of its query rows after a given layer (CacheBlend); ``engine/manual_forward.py`` runs
single sequences over dense KV this way.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Callable

import torch
import torch.nn.functional as F

from engine.kv_cache import PagedKVCache, token_slots
from engine.step_interrupt import StepInterrupted


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos/sin: [T, head_dim]."""
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]


_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


@functools.lru_cache(maxsize=4)
def _context_mask(q_len: int, past: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask [q_len, past + q_len] in the queries' dtype (SDPA's CUDA kernels reject or
    misread a bias of another dtype): a chunk sees all ``past`` keys and itself causally. Built
    once per shape (not once per layer): the 30 layers of a forward share it."""
    visible = torch.ones(q_len, past + q_len, dtype=torch.bool, device=device).tril(diagonal=past)
    return torch.zeros(visible.shape, device=device, dtype=dtype).masked_fill_(~visible, float("-inf"))


def attend_with_context(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int, scale: float) -> torch.Tensor:
    """A chunk's attention over ``past`` cached keys plus itself (causal), bottom-right aligned.

    q: [1, H, L, D]; k, v: [1, KVH, past + L, D]. A chunk at least as long as its context (e.g. a
    prompt whose shorter prefix was cached) runs two unmasked CPU flash kernels, dense over the
    past and causal over the chunk, merged by their log-sum-exps: the masked half of the chunk's
    own square is never computed (17 -> 13.7 ms a layer for 720 new tokens after 304 cached, on 2
    cores). A shorter chunk wastes little on masked pairs (L^2/2 of L(past + L)) and one masked
    kernel is cheaper than two plus the merge (3.2 vs 3.9 ms at 208 after 816; 0.3 vs 0.7 ms at
    16 after 1,008), so it runs one kernel with an additive mask built once per shape.
    """
    L = q.shape[2]
    if _FLASH_CPU is not None and q.device.type == "cpu" and L >= past > 0:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        o1, l1 = _FLASH_CPU(q, k[:, :, :past], v[:, :, :past], scale=scale)[:2]
        o2, l2 = _FLASH_CPU(q, k[:, :, past:], v[:, :, past:], is_causal=True, scale=scale)[:2]
        lse = torch.logaddexp(l1, l2)
        return o1 * torch.exp(l1 - lse)[..., None] + o2 * torch.exp(l2 - lse)[..., None]
    if L * (past + L) <= _MASK_CACHE_MAX:
        mask = _context_mask(L, past, q.device, q.dtype)
    else:
        mask = torch.ones(L, past + L, dtype=torch.bool, device=q.device).tril(diagonal=past)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


_MASK_CACHE_MAX = 1 << 21  # elements (8 MiB fp32) per cached mask; larger ones are built per call


# row_filter(layer, k, v) with the slice's fresh rotated keys and values [q_len, kv_heads, head_dim]
# at that layer -> sorted indices (into the slice's query rows) that continue through later layers
RowFilter = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class SeqSlice:
    """One sequence's part of a flattened batch: query rows ``q_start .. q_start + q_len``.

    Without ``mask`` the queries are the last ``q_len`` of ``ctx_len`` keys (causal, bottom-right
    aligned). With ``mask`` ([q_len, ctx_len] bool, True = visible) queries and keys may sit at any
    positions and slots; visibility is exactly the mask. With ``row_filter``, after layer
    ``filter_layer`` only the rows it returns stay in the batch (logits rows must stay); in
    later layers a dropped row's keys and values are whatever its slots hold, so the caller must
    have written the KV it means there (``partial_forward`` writes the donor's KV).
    """

    q_start: int
    q_len: int
    ctx_len: int  # keys visible after this step: cached context + this chunk
    ctx_slots: torch.Tensor | None  # [ctx_len] cache slots of all keys; None when ctx_len == q_len
    mask: torch.Tensor | None = None  # [q_len, ctx_len] bool; None: the causal rule
    filter_layer: int | None = None
    row_filter: RowFilter | None = None

    def __post_init__(self) -> None:
        if self.mask is not None and tuple(self.mask.shape) != (self.q_len, self.ctx_len):
            raise ValueError(f"mask of shape {tuple(self.mask.shape)} for {self.q_len} queries x {self.ctx_len} keys")
        if (self.row_filter is None) != (self.filter_layer is None):
            raise ValueError("row_filter and filter_layer go together")


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T] where each token's K/V is written
    prefills: list[SeqSlice]  # chunks (q_len > 1) and masked slices of any length
    decode_rows: torch.Tensor | None  # [B] rows of single-token queries
    decode_slots: torch.Tensor | None  # [B, max_ctx] key slots (padded with 0)
    decode_mask: torch.Tensor | None  # [B, 1, 1, max_ctx] True where a key is visible
    logits_rows: torch.Tensor  # [S] rows whose logits are needed
    # groups of decode rows that share cached blocks (a common prefix): (the group's indices into
    # decode_rows [b], the union of its blocks' slots [N], per row the keys it must not see [b, N]);
    # see ``plan_decode``
    decode_shared: tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], ...] = ()
    # with groups: indices into decode_rows of the rows that take the padded form; None: all rows
    # do (no groups)
    decode_rest: torch.Tensor | None = None


# The shared form pays off when the decode rows' key union N is small against the sum of their
# lengths: it gathers each of the N keys once, then every one of the B rows scores every key (rows
# mask out the others' keys). Measured on this CPU (one thread, SmolLM2's 3 KV heads x 64), a key
# gathered costs about 19 query-key scorings, so the break-even is N (B + 19) ~ 20 x the summed
# lengths (0.9 of it at 2 rows, 0.7 at 8); the form is used from 0.8 of that break-even.
# 8 rows of 550 keys sharing 512: 2.4 -> 0.7 ms a layer; nothing shared would go 2.3 -> 3.9 ms.
SHARED_DECODE_KEY_COST = 19
SHARED_DECODE_MARGIN = 16


def shared_decode_keys(
    tables: list[list[int]], lens: list[int], block_size: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(slots [N], hidden [B, N]) over the union of the decode rows' blocks, or None when rows
    share too little (``SHARED_DECODE_MARGIN``). Row b sees the first ``lens[b]`` keys of its block
    table ``tables[b]``; every other key of the union is hidden from it."""
    if len(tables) < 2:
        return None
    used = [(n + block_size - 1) // block_size for n in lens]
    pos: dict[int, int] = {}
    for table, u in zip(tables, used):
        for blk in table[:u]:
            pos.setdefault(blk, len(pos))
    if len(pos) * block_size * (len(tables) + SHARED_DECODE_KEY_COST) > SHARED_DECODE_MARGIN * sum(lens):
        return None
    hidden = torch.ones(len(tables), len(pos), block_size, dtype=torch.bool)
    for b, (table, n, u) in enumerate(zip(tables, lens, used)):
        idx = torch.tensor([pos[blk] for blk in table[:u]], dtype=torch.long)
        hidden[b, idx] = False
        hidden[b, idx[-1], n - (u - 1) * block_size :] = True
    blocks = torch.tensor(list(pos), dtype=torch.long)
    slots = (blocks[:, None] * block_size + torch.arange(block_size)).reshape(-1)
    return slots.to(device), hidden.view(len(tables), -1).to(device)


def plan_decode(tables: list[list[int]], lens: list[int], block_size: int, device: torch.device | str = "cpu"
                ) -> tuple[tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], ...], torch.Tensor | None]:
    """Decode rows grouped by their first block (rows of one prefix); each group that shares enough
    (``shared_decode_keys``) takes the shared form. Returns (groups, rows left to the padded form,
    None when no group formed)."""
    by_first: dict[int, list[int]] = {}
    for i, table in enumerate(tables):
        by_first.setdefault(table[0], []).append(i)
    groups, rest = [], []
    for rows in by_first.values():
        keys = shared_decode_keys([tables[i] for i in rows], [lens[i] for i in rows], block_size, device)
        if keys is None:
            rest.extend(rows)
        else:
            groups.append((torch.tensor(rows, dtype=torch.long, device=device), *keys))
    if not groups:
        return (), None
    return tuple(groups), torch.tensor(sorted(rest), dtype=torch.long, device=device)


def attend_decode_shared(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, slots: torch.Tensor,
                         hidden: torch.Tensor, scale: float) -> torch.Tensor:
    """Single-token queries q [B, H, D] over one shared key set: keys and values of ``slots`` [N]
    gathered once from the cache [slots, KVH, D], each row masked by ``hidden`` [B, N]; each KV
    head's query groups of all rows go through one matmul. Returns [B, H, D]."""
    B, H, D = q.shape
    kvh = kc.shape[1]
    g = H // kvh
    k, v = kc[slots], vc[slots]  # [N, KVH, D]
    qh = q.reshape(B, kvh, g, D).transpose(0, 1).reshape(kvh, B * g, D)
    s = torch.matmul(qh, k.permute(1, 2, 0)).view(kvh, B, g, -1) * scale
    s = s.masked_fill_(hidden[None, :, None, :], float("-inf"))
    p = torch.softmax(s, -1, dtype=torch.float32).to(q.dtype).view(kvh, B * g, -1)
    o = torch.matmul(p, v.transpose(0, 1))  # [KVH, B * g, D]
    return o.view(kvh, B, g, D).transpose(0, 1).reshape(B, H, D)


def build_batch(
    chunks: list[tuple[list[int], int, int, list[int]]], block_size: int, device: torch.device | str = "cpu"
) -> ForwardBatch:
    """chunks: (token ids of the chunk, start position, want_logits, block table) per sequence."""
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    prefills: list[SeqSlice] = []
    dec_rows: list[int] = []
    dec_slots: list[list[int]] = []
    dec_tables: list[list[int]] = []
    logits_rows: list[int] = []
    for tokens, start, want_logits, table in chunks:
        q_start, q_len = len(ids), len(tokens)
        ctx_len = start + q_len
        all_slots = token_slots(table, block_size, 0, ctx_len)
        ids.extend(tokens)
        pos.extend(range(start, ctx_len))
        slots.extend(all_slots[start:])
        if q_len == 1:
            dec_rows.append(q_start)
            dec_slots.append(all_slots)
            dec_tables.append(table)
        else:
            ctx = torch.tensor(all_slots, dtype=torch.long, device=device) if start > 0 else None
            prefills.append(SeqSlice(q_start, q_len, ctx_len, ctx))
        if want_logits:
            logits_rows.append(q_start + q_len - 1)
    t = lambda x: torch.tensor(x, dtype=torch.long, device=device)  # noqa: E731
    decode_rows = decode_slots = decode_mask = rest = None
    shared = ()
    if dec_rows:
        max_ctx = max(len(s) for s in dec_slots)
        decode_rows = t(dec_rows)
        decode_slots = t([s + [0] * (max_ctx - len(s)) for s in dec_slots])
        lens = t([len(s) for s in dec_slots])
        decode_mask = (torch.arange(max_ctx, device=device)[None, :] < lens[:, None])[:, None, None, :]
        shared, rest = plan_decode(dec_tables, [len(s) for s in dec_slots], block_size, device)
    return ForwardBatch(t(ids), t(pos), t(slots), prefills, decode_rows, decode_slots, decode_mask, t(logits_rows),
                        shared, rest)


def _filter_rows(
    layer_idx: int, batch: ForwardBatch, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, ForwardBatch]:
    """Apply the row filters of ``layer_idx``: the batch rows that stay ([T'] into the current
    T rows) and the batch over them. A filtered slice's keys stay where they are: its causal rule
    becomes an explicit mask and an implicit context (ctx_slots None) its rows' slots."""
    keep_parts: list[torch.Tensor] = []
    prefills: list[SeqSlice] = []
    start, new_start, device = 0, 0, batch.slot_mapping.device
    for s in sorted(batch.prefills, key=lambda s: s.q_start):  # rows outside every slice (decodes) stay
        keep_parts.append(torch.arange(start, s.q_start, device=device))
        new_start += s.q_start - start
        rows = slice(s.q_start, s.q_start + s.q_len)
        if s.row_filter is None or s.filter_layer != layer_idx:
            local = torch.arange(s.q_len, device=device)
            prefills.append(replace(s, q_start=new_start))
        else:
            local = s.row_filter(layer_idx, k[rows], v[rows]).to(device=device, dtype=torch.long)
            mask = s.mask
            if mask is None:
                mask = torch.ones(s.q_len, s.ctx_len, dtype=torch.bool, device=device).tril(s.ctx_len - s.q_len)
            ctx = batch.slot_mapping[rows] if s.ctx_slots is None else s.ctx_slots
            prefills.append(replace(s, q_start=new_start, q_len=len(local), ctx_slots=ctx, mask=mask[local],
                                    filter_layer=None, row_filter=None))
        keep_parts.append(s.q_start + local)
        new_start += len(local)
        start = s.q_start + s.q_len
    keep_parts.append(torch.arange(start, batch.slot_mapping.shape[0], device=device))
    keep = torch.cat(keep_parts)
    new_index = torch.full_like(batch.slot_mapping, -1)
    new_index[keep] = torch.arange(keep.shape[0], device=device)
    logits_rows = new_index[batch.logits_rows]
    if bool((logits_rows < 0).any()):
        raise ValueError(f"a row filter at layer {layer_idx} dropped a row whose logits are wanted")
    decode_rows = None if batch.decode_rows is None else new_index[batch.decode_rows]
    return keep, replace(batch, input_ids=batch.input_ids[keep], positions=batch.positions[keep],
                         slot_mapping=batch.slot_mapping[keep], prefills=prefills, decode_rows=decode_rows,
                         logits_rows=logits_rows)


def _flash_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


class ModelRunner:
    """Runs a ForwardBatch through the model, reading/writing ``cache``; returns logits rows."""

    def __init__(self, model: torch.nn.Module, cache: PagedKVCache, attention: str = "auto"):
        self.model = model
        self.cache = cache
        cfg = model.config
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.scale = self.head_dim**-0.5
        self.layers = model.model.layers
        if attention == "auto":
            attention = "flash" if _flash_available() else "sdpa"
        if attention == "flash" and not _flash_available():
            raise RuntimeError("attention='flash' needs CUDA and the flash-attn package (extra 'gpu')")
        if attention not in ("sdpa", "flash"):
            raise ValueError(f"unknown attention backend {attention!r}: expected auto, sdpa or flash")
        self.attention = attention

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, hidden_rows: torch.Tensor | None = None,
                interrupt: Callable[[], bool] | None = None):
        """Logits [S, vocab] (float32) of ``batch.logits_rows``. With ``hidden_rows`` (batch row
        indices; no row filters), also the final-norm hidden states of those rows, for callers
        that reduce their logits chunk by chunk (prompt logprobs): returns (logits, hidden).
        ``interrupt`` is asked after every layer; True raises ``StepInterrupted`` (the K/V written
        so far sits in slots the rerun rewrites with the same values: engine/step_interrupt.py)."""
        model = self.model.model
        h = model.embed_tokens(batch.input_ids)  # [T, hidden]
        cos, sin = model.rotary_emb(h[None], batch.positions[None])
        cos, sin = cos[0], sin[0]
        filter_layers = {s.filter_layer for s in batch.prefills if s.row_filter is not None}
        # flash-attn's varlen kernel knows only the causal rule: masked or row-filtered slices (a
        # filter turns its slice into a masked one) take SDPA for the whole batch
        flash = self.attention == "flash" and all(s.mask is None and s.row_filter is None for s in batch.prefills)
        for layer_idx, layer in enumerate(self.layers):
            residual = h
            x = layer.input_layernorm(h)
            attn = layer.self_attn
            q = attn.q_proj(x).view(-1, self.num_heads, self.head_dim)
            k = attn.k_proj(x).view(-1, self.num_kv_heads, self.head_dim)
            v = attn.v_proj(x).view(-1, self.num_kv_heads, self.head_dim)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            self.cache.write(layer_idx, batch.slot_mapping, k, v)
            if flash:
                o = self._attend_flash(layer_idx, q, k, v, batch)
            else:
                o = self._attend_sdpa(layer_idx, q, k, v, batch)
            h = residual + attn.o_proj(o.reshape(-1, self.num_heads * self.head_dim))
            residual = h
            h = residual + layer.mlp(layer.post_attention_layernorm(h))
            if layer_idx in filter_layers:
                keep, batch = _filter_rows(layer_idx, batch, k, v)
                h, cos, sin = h[keep], cos[keep], sin[keep]
            if interrupt is not None and interrupt():
                raise StepInterrupted(f"after layer {layer_idx}")
        if hidden_rows is None:
            return self.model.lm_head(model.norm(h[batch.logits_rows])).float()
        if filter_layers:
            raise ValueError("hidden_rows cannot be combined with row filters")
        n = batch.logits_rows.shape[0]
        hn = model.norm(h[torch.cat([batch.logits_rows, hidden_rows])])
        return self.model.lm_head(hn[:n]).float(), hn[n:]

    def _attend_sdpa(self, layer_idx, q, k, v, batch: ForwardBatch) -> torch.Tensor:
        out = torch.empty_like(q)
        kc, vc = self.cache.k[layer_idx], self.cache.v[layer_idx]
        for s in batch.prefills:
            qs = q[s.q_start : s.q_start + s.q_len].transpose(0, 1)[None]  # [1, H, L, D]
            if s.ctx_slots is None:
                ks = k[s.q_start : s.q_start + s.q_len].transpose(0, 1)[None]
                vs = v[s.q_start : s.q_start + s.q_len].transpose(0, 1)[None]
            else:
                ks = kc[s.ctx_slots].transpose(0, 1)[None]
                vs = vc[s.ctx_slots].transpose(0, 1)[None]
            if s.mask is not None:
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=s.mask, scale=self.scale, enable_gqa=True)
            elif s.ctx_slots is None:
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=self.scale, enable_gqa=True)
            else:
                o = attend_with_context(qs, ks, vs, s.ctx_len - s.q_len, self.scale)
            out[s.q_start : s.q_start + s.q_len] = o[0].transpose(0, 1)
        for idx, slots, hidden in batch.decode_shared:
            rows = batch.decode_rows[idx]
            out[rows] = attend_decode_shared(q[rows], kc, vc, slots, hidden, self.scale)
        if batch.decode_rows is not None and (batch.decode_rest is None or batch.decode_rest.numel()):
            rows, dslots, dmask = batch.decode_rows, batch.decode_slots, batch.decode_mask
            if batch.decode_rest is not None:
                rows, dslots, dmask = rows[batch.decode_rest], dslots[batch.decode_rest], dmask[batch.decode_rest]
            qd = q[rows][:, :, None, :]  # [B, H, 1, D]
            kd = kc[dslots].transpose(1, 2)  # [B, KVH, L, D]
            vd = vc[dslots].transpose(1, 2)
            o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=dmask, scale=self.scale, enable_gqa=True)
            out[rows] = o[:, :, 0, :]
        return out

    def _attend_flash(self, layer_idx, q, k, v, batch: ForwardBatch) -> torch.Tensor:  # pragma: no cover - CUDA only
        """One varlen kernel over every sequence, keys gathered from the paged cache.

        flash-attn's causal mask is aligned bottom-right, which is what a chunk with cached
        context needs. (Its paged ``block_table`` path requires block_size % 256 == 0, so we
        gather instead; that keeps kvmesh's 16-token blocks.)
        """
        from flash_attn import flash_attn_varlen_func

        kc, vc = self.cache.k[layer_idx], self.cache.v[layer_idx]
        q_rows, k_parts, v_parts, cu_q, cu_k = [], [], [], [0], [0]
        for s in batch.prefills:
            rows = torch.arange(s.q_start, s.q_start + s.q_len, device=q.device)
            q_rows.append(rows)
            if s.ctx_slots is None:
                k_parts.append(k[rows]), v_parts.append(v[rows])
            else:
                k_parts.append(kc[s.ctx_slots]), v_parts.append(vc[s.ctx_slots])
            cu_q.append(cu_q[-1] + s.q_len)
            cu_k.append(cu_k[-1] + s.ctx_len)
        if batch.decode_rows is not None:
            lens = batch.decode_mask[:, 0, 0, :].sum(-1).tolist()
            for i, row in enumerate(batch.decode_rows.tolist()):
                q_rows.append(torch.tensor([row], device=q.device))
                slots = batch.decode_slots[i, : lens[i]]
                k_parts.append(kc[slots]), v_parts.append(vc[slots])
                cu_q.append(cu_q[-1] + 1)
                cu_k.append(cu_k[-1] + lens[i])
        rows = torch.cat(q_rows)
        cu_q_t = torch.tensor(cu_q, dtype=torch.int32, device=q.device)
        cu_k_t = torch.tensor(cu_k, dtype=torch.int32, device=q.device)
        o = flash_attn_varlen_func(
            q[rows], torch.cat(k_parts), torch.cat(v_parts), cu_q_t, cu_k_t,
            max(b - a for a, b in zip(cu_q, cu_q[1:])), max(b - a for a, b in zip(cu_k, cu_k[1:])),
            softmax_scale=self.scale, causal=True,
        )
        out = torch.empty_like(q)
        out[rows] = o
        return out
