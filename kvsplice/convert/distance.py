"""How far back attention looks, and what a key pair that loses RoPE should be replaced by.

A key pair at frequency ``θ`` that is cached without RoPE contributes ``Re(q conj(z))`` to every score instead of
``Re(q conj(z) e^{iθΔ})`` at distance ``Δ``. Over the distances attention actually uses, the best fixed stand-in is
``z · E[e^{-iθΔ}]``: a low frequency (``θΔ`` small) keeps its pair nearly whole, a high one (whose rotation averages
out) fades to zero instead of adding a score that RoPE would have spread. ``E`` is over the source's attention
weights on calibration windows (:func:`distance_profile`), per KV head.
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["damping_map", "distance_profile"]


@torch.no_grad()
def distance_profile(adapter, layer: int, xs: Sequence[torch.Tensor]) -> torch.Tensor:
    """``(Hkv, T)``: the share of the source layer's attention weight at each distance ``Δ = t − s`` (summed over
    the query heads of each KV head and the windows ``xs`` ``(1, T, d)`` of attention inputs)."""
    a = adapter
    t = max(x.shape[1] for x in xs)
    hist = torch.zeros(a.n_kv_head, t, dtype=torch.float64)
    g = a.n_head // a.n_kv_head
    w = a.window(layer)
    for x in xs:
        x = x.to(a.param())
        n = x.shape[1]
        q, k, _ = a.qkv(layer, x, a.rope(x, 0, n, layer))  # (1, H, T, D), (1, Hkv, T, D)
        dist = torch.arange(n)[:, None] - torch.arange(n)[None]  # (T, T): t − s
        mask = (dist >= 0) & ((dist < w) if w else True)
        for h in range(a.n_head):
            s = (q[0, h] @ k[0, h // g].T).float() * a.scale(layer)  # (T, T)
            p = s.masked_fill(~mask, float("-inf")).softmax(-1)
            hist[h // g, :n] += torch.bincount(dist.clamp_min(0).flatten(), weights=p.flatten().double(),
                                               minlength=n)
    return hist / hist.sum(-1, keepdim=True).clamp_min(1e-30)


def damping_map(profile: torch.Tensor, inv_freq: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``(Hkv·D, Hkv·D)``: every key pair ``(f, f + D/2)`` of each KV head multiplied by ``E[e^{-iθ_f Δ}]`` under
    ``profile`` ``(Hkv, T)`` (rotate-half layout; ``inv_freq`` ``(D/2,)`` the source's frequencies)."""
    n_kv, half = profile.shape[0], head_dim // 2
    dist = torch.arange(profile.shape[1], dtype=torch.float64)
    c = (profile.double()[:, None, :] * torch.exp(-1j * inv_freq.double()[None, :, None] * dist)).sum(-1)  # (Hkv, D/2)
    out = torch.zeros(n_kv * head_dim, n_kv * head_dim, dtype=torch.float64)
    for g in range(n_kv):
        r1 = g * head_dim + torch.arange(half)
        r2 = r1 + half
        out[r1, r1], out[r1, r2] = c[g].real, -c[g].imag  # x1' = c_r x1 − c_i x2
        out[r2, r1], out[r2, r2] = c[g].imag, c[g].real  # x2' = c_i x1 + c_r x2
    return out
