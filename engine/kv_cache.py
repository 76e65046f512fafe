"""KV storage for the block pool: one K and one V tensor per layer, addressed by slot.

Slot ``s = block_id * block_size + offset`` holds the rotated key and the value of one token,
shape ``[num_kv_heads, head_dim]``. Keeping slots flat makes writes one ``index_copy_`` and reads
one gather, and the same tensors view as ``[num_blocks, block_size, kv_heads, head_dim]`` for
flash-attn's paged kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class KVBlocks:
    """Exported KV of whole blocks as plain arrays, portable across workers.

    ``k``/``v``: ``[num_layers, num_blocks, block_size, num_kv_heads, head_dim]``.
    ``positions[i]`` is the absolute position of the first token of block i (keys are stored
    RoPE-rotated at those positions). ``hashes`` are the blocks' chain hashes when known.
    """

    k: np.ndarray
    v: np.ndarray
    positions: tuple[int, ...]
    model_id: str
    hashes: tuple[bytes, ...] = ()
    dtype: str = "float32"  # torch dtype of the cache; bfloat16 travels as int16 bits (numpy has none)
    digest: bytes = b""  # sha256 over everything above (``kv_digest``), set by the exporting worker

    def with_digest(self) -> "KVBlocks":
        from dataclasses import replace

        return replace(self, digest=kv_digest(self))

    def digest_ok(self) -> bool:
        """True iff ``digest`` is set and matches the content (catches blocks corrupted between
        the holder's export and the import; KV that was already wrong on the holder is not)."""
        return bool(self.digest) and kv_digest(self) == self.digest

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1]

    def head(self, n: int) -> "KVBlocks":
        """The first ``n`` blocks (no digest: set it again)."""
        return KVBlocks(self.k[:, :n], self.v[:, :n], self.positions[:n], self.model_id, self.hashes[:n], self.dtype)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


def kv_digest(data: KVBlocks) -> bytes:
    """sha256 of a ``KVBlocks``' arrays, positions, hashes, model id and dtype (~1 GB/s here)."""
    import hashlib

    h = hashlib.sha256()
    for a in (data.k, data.v):
        h.update(repr((a.dtype.str, a.shape)).encode())
        h.update(memoryview(np.ascontiguousarray(a)).cast("B"))
    h.update(repr((data.positions, data.model_id, data.dtype)).encode())
    for x in data.hashes:
        h.update(x)
    return h.digest()


def token_slots(block_table: list[int], block_size: int, start: int, end: int) -> list[int]:
    """Cache slots of positions [start, end) of a sequence with ``block_table``."""
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]


class PagedKVCache:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ):
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim, self.dtype = num_kv_heads, head_dim, dtype
        shape = (num_blocks * block_size, num_kv_heads, head_dim)
        # zeros, not empty: writing the zeros faults every page in now, so the pool's memory is
        # committed at start-up (RSS flat as blocks fill; short memory fails here, not mid-run).
        # tests/test_kv_commit.py checks it.
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @classmethod
    def wrap_dense(cls, k: torch.Tensor, v: torch.Tensor) -> PagedKVCache:
        """A cache over one sequence's dense KV ``[layers, n, kv_heads, head_dim]``: block size 1,
        slot i = row i. It shares ``k``/``v``'s memory (no copy): writes land in them."""
        if k.dim() != 4 or k.shape != v.shape or k.dtype != v.dtype:
            raise ValueError(f"dense KV must be two [layers, n, kv_heads, head_dim] tensors, got {k.shape} / {v.shape}")
        cache = cls.__new__(cls)
        cache.num_layers, cache.num_blocks, cache.block_size = k.shape[0], k.shape[1], 1
        cache.num_kv_heads, cache.head_dim, cache.dtype = k.shape[2], k.shape[3], k.dtype
        cache.k, cache.v = list(k.unbind(0)), list(v.unbind(0))
        return cache

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store rotated keys and values ``[n, kv_heads, head_dim]`` at ``slots`` ``[n]``."""
        self.k[layer].index_copy_(0, slots, k)
        self.v[layer].index_copy_(0, slots, v)

    def paged(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        return self.k[layer].view(shape), self.v[layer].view(shape)

    def export_blocks(self, block_ids: list[int], positions: list[int], model_id: str, hashes=()) -> KVBlocks:
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.k[0].device)
        shape = (self.num_layers, len(block_ids), self.block_size, self.num_kv_heads, self.head_dim)
        ks = torch.empty(shape, dtype=self.dtype, device=self.k[0].device)  # one copy, gathered in place
        vs = torch.empty(shape, dtype=self.dtype, device=self.k[0].device)
        for layer in range(self.num_layers):
            pk, pv = self.paged(layer)
            torch.index_select(pk, 0, idx, out=ks[layer])
            torch.index_select(pv, 0, idx, out=vs[layer])
        return KVBlocks(_to_numpy(ks), _to_numpy(vs), tuple(positions), model_id, tuple(hashes),
                        str(self.dtype).removeprefix("torch."))

    def import_blocks(self, block_ids: list[int], data: KVBlocks) -> None:
        expected = (self.num_layers, len(block_ids), self.block_size, self.num_kv_heads, self.head_dim)
        if data.k.shape != expected or data.v.shape != expected:
            raise ValueError(f"KV blocks of shape {data.k.shape} do not fit this cache {expected}")
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.k[0].device)
        k = _from_numpy(data.k, data.dtype).to(device=self.k[0].device, dtype=self.dtype)
        v = _from_numpy(data.v, data.dtype).to(device=self.k[0].device, dtype=self.dtype)
        for layer in range(self.num_layers):
            pk, pv = self.paged(layer)
            pk.index_copy_(0, idx, k[layer])
            pv.index_copy_(0, idx, v[layer])


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.cpu()
    return t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()


def _from_numpy(a: np.ndarray, dtype: str) -> torch.Tensor:
    t = torch.from_numpy(a)
    return t.view(torch.bfloat16) if dtype == "bfloat16" else t
