"""One layer of a KIVI-4 cache at SmolLM2-135M's attention shapes (``benchmarks/decode_profile.py``): the cache
filled with random post-RoPE tokens, and the keys' scores and the values' weighted sum dequantised and reduced in
one expression each (what ``torch.compile`` fuses: no float copy of the codes)."""

from __future__ import annotations

import torch

from benchmarks.harness.timing import median_of, wall_time
from models.quant import unpack_codes

__all__ = ["D", "HKV", "HQ", "kivi_layer", "median_us", "scores_fused", "weighted_fused"]

HQ, HKV, D = 9, 3, 64  # SmolLM2-135M's attention


def median_us(fn, reps: int = 40, warmup: int = 5) -> float:
    """Median wall µs of ``reps`` calls after ``warmup``."""
    return 1e6 * median_of(wall_time, fn, reps, warmup)


def kivi_layer(n: int, seed: int = 0):
    """A one-layer KIVI-4 cache holding ``n`` random post-RoPE tokens, and a decode query ``(1, Hq, 1, D)``."""
    from kvsplice.quant.cache import KIVICache

    g = torch.Generator().manual_seed(seed)
    cache = KIVICache(1, HKV, D, 1, bits=4, group=32, residual=128, capacity=n + 8)
    k, v = torch.randn(1, HKV, n, D, generator=g), torch.randn(1, HKV, n, D, generator=g)
    cache.append(0, k, v)
    return cache, k, v, torch.randn(1, HQ, 1, D, generator=g)


def scores_fused(qs, codes, s, m):
    """KIVI keys, dequantised and reduced in one expression (for torch.compile): ``qs (B, Hkv, g, D)``, packed
    ``codes (B, Hkv, n, D/2)``, per-channel ``s, m (B, Hkv, n/G, D)`` → ``(B, Hkv, g, n)``."""
    b, h, r, d = qs.shape
    x = unpack_codes(codes, 4).float()  # (B, Hkv, n, D)
    x = x.view(b, h, s.shape[2], -1, d) * s.float()[:, :, :, None] + m.float()[:, :, :, None]  # (B,Hkv,n/G,G,D)
    return (qs[:, :, :, None, :] * x.view(b, h, 1, -1, d)).sum(-1)


def weighted_fused(p, codes, s, m):
    """KIVI values: ``p (B, Hkv, g, n)``, packed ``codes (B, Hkv, n, D/2)``, per-token ``s, m (B, Hkv, n, D/G)`` →
    ``(B, Hkv, g, D)``."""
    x = unpack_codes(codes, 4).float()  # (B, Hkv, n, D)
    b, h, n, d = x.shape
    x = (x.view(b, h, n, s.shape[-1], -1) * s.float()[..., None] + m.float()[..., None]).view(b, h, 1, n, d)
    return (p[..., None] * x).sum(-2)
