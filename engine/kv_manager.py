"""Per-sequence block tables on top of the block pool: prefix hits, growth, registration, release.

Prefix matching across share domains: a request hashes its prompt under its own domain and
under every domain it may read (grants). The chain hash of block i covers the model, the
domain salt and *all* tokens up to the end of block i, so a hit at position i under any of those
domains is the same KV. Matching walks block by block taking whichever domain hits, and stops at
the first miss. New blocks are registered under the request's own domain only.

``reads[(reader tenant, label)]`` counts prompt tokens admitted from cached blocks by where each
block was stored relative to the reader (``policies.tenancy.read_label``: own domain, another
domain of its own tenant, another tenant), so tests and audits can assert that no tenant read a
domain it was not granted (see ``LLMEngine.stats``: per tenant ``reads``, ``cross_tenant_reads``).
"""

from __future__ import annotations

from engine.block_pool import Block, BlockHash, BlockPool, extra_key, hash_block, prompt_chains
from engine.sequence import Sequence
from policies.tenancy import read_label


class KVManager:
    def __init__(self, pool: BlockPool, model_id: str, enable_prefix_caching: bool = True):
        self.pool = pool
        self.block_size = pool.block_size
        self.model_id = model_id
        self.enable_prefix_caching = enable_prefix_caching
        self._extra: dict[str, bytes] = {}
        self.reads: dict[tuple[str, str], int] = {}

    def extra_key(self, domain: str) -> bytes:
        key = self._extra.get(domain)
        if key is None:
            key = self._extra[domain] = extra_key(self.model_id, domain)
        return key

    def _caching(self, seq: Sequence) -> bool:
        return self.enable_prefix_caching and seq.request.reuse != "none"

    def held_blocks(self, chains: dict[str, list[BlockHash]], start: int = 0, end: int | None = None) -> list[Block]:
        """Cached blocks at prompt positions [start, end) under any of ``chains``, up to the first
        miss (a hit at position i under any readable domain is the same KV)."""
        n = min((len(c) for c in chains.values()), default=0)
        end = n if end is None else min(end, n)
        out: list[Block] = []
        for i in range(start, end):
            block = next((b for c in chains.values() if (b := self.pool.get_cached_block(c[i])) is not None), None)
            if block is None:
                break
            out.append(block)
        return out

    def find_prefix(self, seq: Sequence) -> list[Block]:
        """Longest run of cached blocks matching the sequence's leading tokens (not yet touched).

        At most (len - 1) // block_size blocks, so at least one token is computed for logits.
        None while the sequence still needs its prompt logprobs (cached positions have no
        logits): it computes its whole prompt, and its blocks are registered as usual.
        """
        if not self._caching(seq) or (seq.prompt_lp is not None and not seq.prompt_lp_sent):
            return []
        req = seq.request
        # A waiting request is matched again every step until admitted: hash its tokens once.
        if seq.prefix_chains is None or seq.prefix_chains[0] != len(seq.tokens):
            chains = prompt_chains(seq.tokens, self.block_size, self.model_id, (req.domain, *req.read_domains))
            seq.prefix_chains = (len(seq.tokens), chains)
        chains = seq.prefix_chains[1]
        seq.block_hashes = list(chains[req.domain])
        return self.held_blocks(chains)

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
        req = seq.request
        for b in hit:
            key = (req.tenant, read_label(req.domain, self.pool.domain_of(b.block_hash) or "?"))
            self.reads[key] = self.reads.get(key, 0) + self.block_size
        self.pool.touch(hit)
        seq.blocks = list(hit)
        seq.num_computed = len(hit) * self.block_size
        if not seq.num_output:  # a resumed (preempted) sequence keeps its prompt's first hit: its
            seq.num_cached = seq.num_computed  # re-hit of its own output is no prompt reuse
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
