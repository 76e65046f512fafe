"""Per-sequence block tables on top of the block pool: prefix hits, growth, registration, release.

Prefix matching across share domains: a request hashes its prompt under its own domain and
under every domain it may read (grants). The chain hash of block i covers the model, the
domain salt and *all* tokens up to the end of block i, so a hit at position i under any of those
domains is the same KV. Matching walks block by block taking whichever domain hits, and stops at
the first miss. New blocks are registered under the request's own domain only.
"""

from __future__ import annotations

from engine.block_pool import Block, BlockHash, BlockPool, hash_block
from engine.sequence import Sequence


class KVManager:
    def __init__(self, pool: BlockPool, model_id: str, enable_prefix_caching: bool = True):
        self.pool = pool
        self.block_size = pool.block_size
        self.model_id = model_id
        self.enable_prefix_caching = enable_prefix_caching
        self._extra: dict[str, bytes] = {}

    def extra_key(self, domain: str) -> bytes:
        key = self._extra.get(domain)
        if key is None:
            key = self._extra[domain] = f"{self.model_id}\x00{domain}".encode()
        return key

    def _hashes(self, seq: Sequence, domain: str, n_blocks: int) -> list[BlockHash]:
        extra, bs, parent, out = self.extra_key(domain), self.block_size, None, []
        for i in range(n_blocks):
            parent = hash_block(parent, seq.tokens[i * bs : (i + 1) * bs], extra)
            out.append(parent)
        return out

    def _caching(self, seq: Sequence) -> bool:
        return self.enable_prefix_caching and seq.request.reuse != "none"

    def find_prefix(self, seq: Sequence) -> list[Block]:
        """Longest run of cached blocks matching the sequence's leading tokens (not yet touched).

        At most (len - 1) // block_size blocks, so at least one token is computed for logits.
        """
        if not self._caching(seq):
            return []
        n = (len(seq.tokens) - 1) // self.block_size
        own = self._hashes(seq, seq.request.domain, n)
        seq.block_hashes = list(own)
        chains = [own] + [self._hashes(seq, d, n) for d in seq.request.read_domains if d != seq.request.domain]
        hit: list[Block] = []
        for i in range(n):
            block = None
            for chain in chains:
                block = self.pool.get_cached_block(chain[i])
                if block is not None:
                    break
            if block is None:
                break
            hit.append(block)
        return hit

    def blocks_needed(self, seq: Sequence, num_tokens: int, hit: list[Block] = ()) -> int:
        """Free blocks an allocation up to ``num_tokens`` would consume, to compare with
        ``pool.num_free_blocks()`` (hits that are evictable leave the free count when touched).

        Other tenants' guaranteed minimums count in ``num_free_blocks()`` but this tenant cannot
        take them, so they are added here: ``blocks_needed(...) <= pool.num_free_blocks()`` holds
        exactly when the tenant's allocation will succeed.
        """
        have = len(seq.blocks) + len(hit)
        new = max(0, -(-num_tokens // self.block_size) - have)
        reserved = self.pool.num_free_blocks() - self.pool.num_free_blocks(seq.request.tenant)
        return new + sum(1 for b in hit if b.ref_cnt == 0) + reserved

    def admit(self, seq: Sequence, hit: list[Block]) -> None:
        self.pool.touch(hit)
        seq.blocks = list(hit)
        seq.num_computed = seq.num_cached = len(hit) * self.block_size
        seq.num_registered = len(hit)

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Make the block table cover ``num_tokens`` tokens (caller checked capacity)."""
        missing = -(-num_tokens // self.block_size) - len(seq.blocks)
        if missing > 0:
            seq.blocks.extend(self.pool.allocate(missing, seq.request.tenant))

    def commit(self, seq: Sequence) -> None:
        """Register blocks that became full with computed KV in the prefix cache."""
        if not self._caching(seq):
            return
        full = seq.num_computed // self.block_size
        extra = self.extra_key(seq.request.domain)
        while len(seq.block_hashes) < full:
            i = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            seq.block_hashes.append(hash_block(parent, seq.tokens[i * self.block_size : (i + 1) * self.block_size], extra))
        for i in range(seq.num_registered, full):
            parent = seq.block_hashes[i - 1] if i else None
            self.pool.cache_full_block(seq.blocks[i], seq.block_hashes[i], parent, seq.request.tenant, seq.request.domain)
        seq.num_registered = full

    def release(self, seq: Sequence) -> None:
        self.pool.free(seq.blocks)
        seq.blocks = []
        seq.num_registered = 0
