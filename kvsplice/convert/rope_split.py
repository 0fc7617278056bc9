"""Which key directions keep RoPE when a Llama-family model becomes MLA: the maps between the source keys and the
RoPE part of the cache.

RoPE turns frequency pair ``f`` of every KV head by the same angle, so the pair of head ``g`` is best read as one
complex number ``z_g = k[g, f] + i·k[g, f + D/2]`` and a position multiplies every ``z_g`` by ``e^{iθ_f t}``. Any
complex-linear map of ``(z_1 … z_Hkv)`` commutes with it. Per kept frequency the conversion keeps one complex
component ``s_f = Σ_g a_g z_g`` (two real dims of the RoPE key) and rebuilds ``z_g ≈ u_g s_f``:

* ``shared`` (TransMLA's RoRoPE, generalised to complex weights): ``u`` is the top eigenvector of the Hermitian
  Gram ``E[z zᴴ]`` across heads, weighted by each head's query energy at that frequency (the score error
  ``Re(q conj(z − u s))`` counts a head by its queries); the ``Dr/2`` highest frequencies, one key for all heads,
  which DeepSeek-V3's rotary reproduces (``rope_theta = θ^(Dr/D)``);
* ``per-head`` (MHA2MLA): per KV head the ``Dr/2`` pairs with the largest mean ``‖q_pair‖·‖k_pair‖``, one RoPE key
  per KV head.

Query head ``i`` of group ``g`` reads ``Re(q_f conj(u_g s_f))`` = ``Re((q_f conj(u_g)) conj(s_f))``: its RoPE query is
its own pair turned by ``conj(u_g)`` (``q_rope``). What the RoPE key leaves, ``(I − U Bᵀ) k``, is cached without
RoPE in the latent.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["RopeSplit", "per_head_split", "shared_split"]


@dataclass
class RopeSplit:
    """``b`` ``(Hkv·D, Hr·Dr)``: keys → RoPE keys (``kr = k b``); ``u`` (same shape): RoPE keys → the key part they
    rebuild (``k ≈ kr uᵀ`` there); ``q_rope`` ``(H, D, Dr)``: each query head's map to its RoPE query; ``pairs``
    ``(Hr, Dr/2)``: the source frequency index of each RoPE pair. Columns of RoPE head ``r`` are ``[first halves,
    second halves]`` (rotate-half layout). All float64."""

    b: torch.Tensor
    u: torch.Tensor
    q_rope: torch.Tensor
    pairs: torch.Tensor

    def residual(self) -> torch.Tensor:
        """``I − U Bᵀ`` ``(Hkv·D, Hkv·D)``: the part of the keys cached without RoPE."""
        return torch.eye(self.b.shape[0], dtype=self.b.dtype) - self.u @ self.b.T


def _complex_gram(kk: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor) -> torch.Tensor:
    """``E[z zᴴ]`` ``(Hkv, Hkv)`` of ``z_g = k[r1[g]] + i·k[r2[g]]`` from the real second moment ``kk``."""
    return (kk[r1][:, r1] + kk[r2][:, r2]) + 1j * (kk[r2][:, r1] - kk[r1][:, r2])


def shared_split(kk: torch.Tensor, qq: torch.Tensor, n_head: int, n_kv: int, head_dim: int, rope_dims: int,
                 query_weighted: bool = True) -> RopeSplit:
    """One RoPE key of ``rope_dims`` shared by all heads: per frequency ``f < Dr/2`` the top complex component
    across KV heads. ``kk`` ``(Hkv·D, Hkv·D)`` and ``qq`` ``(H·D, H·D)`` are the second moments of the keys and
    queries before RoPE."""
    half, m, kvd, g = head_dim // 2, rope_dims // 2, n_kv * head_dim, n_head // n_kv
    b = torch.zeros(kvd, rope_dims, dtype=torch.float64)
    u_map = torch.zeros_like(b)
    q_rope = torch.zeros(n_head, head_dim, rope_dims, dtype=torch.float64)
    heads = torch.arange(n_kv) * head_dim
    for f in range(m):
        r1, r2 = heads + f, heads + f + half
        gram = _complex_gram(kk.double(), r1, r2)  # (Hkv, Hkv) Hermitian
        if query_weighted:
            qi = torch.arange(n_head) * head_dim + f
            w = (qq[qi, qi] + qq[qi + half, qi + half]).double().view(n_kv, g).sum(1)  # (Hkv,) query energy
            w = (w / w.mean().clamp_min(1e-30)).clamp_min(1e-6)
        else:
            w = torch.ones(n_kv, dtype=torch.float64)
        sw = w.sqrt().to(gram.dtype)
        v = torch.linalg.eigh(sw[:, None] * gram * sw[None, :])[1][:, -1]  # (Hkv,) top, in weighted coordinates
        phase = v.sum() / v.sum().abs() if v.sum().abs() > 1e-12 else 1.0
        v = v / phase  # a fixed global phase: the same input gives the same maps
        a, u = v.conj() * sw, v / sw  # s = Σ a_g z_g;  z_g ≈ u_g s
        # s = Σ (a_r + i a_i)(x1 + i x2): real column f, imaginary column f + m
        b[r1, f], b[r2, f], b[r1, f + m], b[r2, f + m] = a.real, -a.imag, a.imag, a.real
        # z_g ≈ u_g s: x1 = u_r s_r − u_i s_i, x2 = u_i s_r + u_r s_i
        u_map[r1, f], u_map[r1, f + m], u_map[r2, f], u_map[r2, f + m] = u.real, -u.imag, u.imag, u.real
        for i in range(n_head):  # q conj(u_g): (q1 u_r + q2 u_i) + i (q2 u_r − q1 u_i)
            ur, ui = u.real[i // g], u.imag[i // g]
            q_rope[i, f, f], q_rope[i, f + half, f], q_rope[i, f, f + m], q_rope[i, f + half, f + m] = ur, ui, -ui, ur
    return RopeSplit(b, u_map, q_rope, torch.arange(m)[None])


def per_head_split(pair_score: torch.Tensor, n_head: int, n_kv: int, head_dim: int, rope_dims: int) -> RopeSplit:
    """A RoPE key per KV head: its ``Dr/2`` frequency pairs of largest ``pair_score`` ``(Hkv, D/2)`` (mean
    ``‖q_pair‖·‖k_pair‖``), selected as they are."""
    half, m, g = head_dim // 2, rope_dims // 2, n_head // n_kv
    pairs = pair_score.topk(m, dim=1).indices.sort(dim=1).values  # (Hkv, m)
    b = torch.zeros(n_kv * head_dim, n_kv * rope_dims, dtype=torch.float64)
    for h in range(n_kv):
        for j, f in enumerate(pairs[h].tolist()):
            b[h * head_dim + f, h * rope_dims + j] = 1.0
            b[h * head_dim + f + half, h * rope_dims + m + j] = 1.0
    q_rope = torch.stack([b[(i // g) * head_dim:(i // g + 1) * head_dim, (i // g) * rope_dims:(i // g + 1) * rope_dims]
                          for i in range(n_head)])  # (H, D, Dr)
    return RopeSplit(b, b.clone(), q_rope, pairs)
