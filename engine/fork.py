"""n choices from one prompt: choice 0 prefills, the others fork from it, sharing its KV.

When choice 0's prompt is computed (the step that samples its first token), each other choice
becomes a Sequence whose block table holds the prompt's *full* blocks by reference (refcount + 1
per choice, nothing copied: KV is append-only, a full block is never written again) and a
private copy of the partial last block (copy-on-write, done eagerly: every choice writes its next
token there). A forked choice samples its first token from choice 0's logits row in the same
step, with its own generator, so the prompt is prefilled once.

A choice that cannot get its copy block (pool full) or a sequence slot waits in the queue as an
ordinary sequence over the prompt: when admitted it takes the full blocks from the prefix cache
and recomputes only the rest. Preemption and abort release a choice's references like any
sequence's, so pool accounting stays exact.
"""

from __future__ import annotations

import torch

from engine.kv_cache import PagedKVCache
from engine.kv_manager import KVManager
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SequenceStatus


def copy_block_prefix(cache: PagedKVCache, src: int, dst: int, num_tokens: int) -> None:
    """KV of the first ``num_tokens`` slots of block ``src`` into block ``dst`` (every layer)."""
    bs = cache.block_size
    s = torch.arange(src * bs, src * bs + num_tokens, device=cache.k[0].device)
    d = torch.arange(dst * bs, dst * bs + num_tokens, device=cache.k[0].device)
    for layer in range(cache.num_layers):
        cache.k[layer].index_copy_(0, d, cache.k[layer].index_select(0, s))
        cache.v[layer].index_copy_(0, d, cache.v[layer].index_select(0, s))


def fork(parent: Sequence, child: Sequence, kv: KVManager, cache: PagedKVCache, scheduler: Scheduler,
         max_num_seqs: int) -> bool:
    """Give ``child`` (tokens = the prompt, no blocks) ``parent``'s computed prompt KV and make it
    running. False (nothing allocated or referenced) if there is no room: the caller queues it."""
    n, bs = parent.num_prompt, kv.block_size
    assert parent.num_computed >= n and len(child.tokens) == n and not child.blocks
    full, partial = divmod(n, bs)
    if len(scheduler.running) >= max_num_seqs:
        return False
    if partial and kv.pool.num_free_blocks(child.request.tenant) < 1:
        return False
    shared = parent.blocks[:full]
    kv.pool.touch(shared)
    child.blocks = list(shared)
    if partial:
        (block,) = kv.pool.allocate(1, child.request.tenant)
        copy_block_prefix(cache, parent.blocks[full].block_id, block.block_id, partial)
        child.blocks.append(block)
    child.num_computed = n
    child.num_cached = parent.num_cached
    child.block_hashes = list(parent.block_hashes[:full])
    child.num_registered = min(parent.num_registered, full)
    child.status = SequenceStatus.RUNNING
    scheduler.running.append(child)
    return True
