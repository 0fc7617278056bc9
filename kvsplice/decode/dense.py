"""``DenseKV``: the full K/V cache (post-RoPE keys and values) — the uncompressed reference every method is
compared against."""

from __future__ import annotations

from kvsplice.decode.method import CompressionMethod
from models.cache import KVCache

__all__ = ["DenseKV"]


class DenseKV(CompressionMethod):
    """Full keys and values; ``cache_quant="int8"`` stores them as int8 rows with fp16 scales (the baseline of
    quantisation on its own)."""

    name = "dense"
    cache_type = KVCache

    def __init__(self, *, cache_quant: str | None = None) -> None:
        self.cache_quant = cache_quant

    def new_cache(self, adapter, batch_size, capacity=None, *, dtype, device):
        return KVCache(adapter.n_layer, adapter.n_kv_head, adapter.head_dim, batch_size, dtype=dtype, device=device,
                       capacity=capacity, quant=self.cache_quant)

    def attention(self, layer, h, cache, step):
        q, k, v = step.adapter.qkv(layer, h, step.rope)  # (B, Hq, T, D), (B, Hkv, T, D) × 2, post-RoPE
        kv = cache.append(layer, k=k, v=v)  # (B, Hkv, Tk, D) each
        return step.adapter.out(layer, step.attend(layer, q, kv["k"], kv["v"]))
