"""The joint latent of a converted layer, fitted to what attention outputs rather than to the keys and values alone.

The no-RoPE keys ``k = M_k x`` and the values ``v = W_v x`` of every KV head share one latent ``c = w_dkv x`` of
``R`` numbers: ``k ≈ w_uk c``, ``v ≈ w_uv c``. An error ``e_k`` in a key moves the scores of its group's query heads
by ``q_i · e_k``, and an error ``e_v`` in a value moves the output by ``W_o,i e_v``; so per KV head ``g``

    S_k[g] = Σ_{i ∈ g} E[q_i q_iᵀ] · scale²        S_v[g] = Σ_{i ∈ g} W_o,iᵀ W_o,i

weigh the two errors as attention sees them (query- and output-aware; identity weights give the plain key/value
fit). The latent is the top-``R`` principal subspace ``P`` of ``Y x`` with ``Y = [α S_k^½ M_k; S_v^½ W_v]`` on the
calibration inputs (second moment ``xx``): ``w_dkv = Pᵀ Y``, ``w_uk = S_k^-½ P_k / α``, ``w_uv = S_v^-½ P_v``.
``α`` balances the two (score errors and output errors are not in one unit): by default their energies are made
equal; :func:`kvsplice.convert.llama_mla.convert_llama` picks it per layer by the measured attention-output error.
At ``R`` = the rank of ``Y`` the fit is exact for any weights.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["LatentFitter", "attention_weights", "fit_latent", "psd_power"]


def psd_power(s: torch.Tensor, power: float, floor: float = 1e-4) -> torch.Tensor:
    """``s^power`` of a symmetric PSD matrix, eigenvalues floored at ``floor ×`` their mean (so ``power < 0`` is
    defined and a direction the data never visits is not blown up)."""
    s = (s + s.T) / 2
    e, v = torch.linalg.eigh(s)
    e = e.clamp_min(max(float(floor * e.clamp_min(0).mean()), 1e-300))
    return (v * e.pow(power)) @ v.T


def attention_weights(qq: torch.Tensor, wo: torch.Tensor, n_head: int, n_kv: int, head_dim: int, scale: float
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(S_k, S_v)``, block-diagonal ``(Hkv·D, Hkv·D)`` (module docstring), from the queries' second moment ``qq``
    ``(H·D, H·D)`` (before RoPE) and the output projection ``wo`` ``(d, H·D)``."""
    g, kvd = n_head // n_kv, n_kv * head_dim
    sk = torch.zeros(kvd, kvd, dtype=torch.float64)
    sv = torch.zeros_like(sk)
    for i in range(n_head):
        kv, qs = slice((i // g) * head_dim, (i // g + 1) * head_dim), slice(i * head_dim, (i + 1) * head_dim)
        sk[kv, kv] += qq[qs, qs] * scale ** 2
        sv[kv, kv] += wo[:, qs].T @ wo[:, qs]
    return sk, sv


class LatentFitter:
    """The fit of one layer's latent for any key / value maps: the roots of ``xx``, ``S_k`` and ``S_v`` are taken
    once (a layer tries several key maps and balances)."""

    def __init__(self, xx: torch.Tensor, sk: Optional[torch.Tensor] = None, sv: Optional[torch.Tensor] = None
                 ) -> None:
        self.xx = xx
        self.x_root = psd_power(xx, 0.5, floor=0.0)  # (d, d): root rootᵀ = xx
        n = (sk if sk is not None else sv).shape[0] if (sk is not None or sv is not None) else None
        eye = None if n is None else torch.eye(n, dtype=torch.float64)
        self.sk = (eye, eye) if sk is None else (psd_power(sk, 0.5), psd_power(sk, -0.5))
        self.sv = (eye, eye) if sv is None else (psd_power(sv, 0.5), psd_power(sv, -0.5))

    def fit(self, mk: torch.Tensor, wv: torch.Tensor, rank: int, alpha_mult: float = 1.0
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
        """``(w_dkv (R, d), w_uk (Hkv·D, R), w_uv (Hkv·D, R), α)`` for the no-RoPE key map ``mk`` and the value map
        ``wv`` ``(Hkv·D, d)``; ``α`` = ``alpha_mult`` × the energy balance."""
        kvd = mk.shape[0]
        eye = torch.eye(kvd, dtype=torch.float64)
        (sk_r, sk_ri), (sv_r, sv_ri) = ((e if e is not None else eye for e in pair) for pair in (self.sk, self.sv))
        yk, yv = sk_r @ mk, sv_r @ wv  # (Hkv·D, d) each
        ek, ev = torch.trace(yk @ self.xx @ yk.T), torch.trace(yv @ self.xx @ yv.T)
        alpha = (float((ev / ek).sqrt()) if ek > 1e-12 * max(float(ev), 1e-30) else 1.0) * alpha_mult
        y = torch.cat([alpha * yk, yv])  # (2·Hkv·D, d)
        p = torch.linalg.svd(y @ self.x_root, full_matrices=False)[0][:, :rank]  # (2·Hkv·D, R)
        return p.T @ y, sk_ri @ p[:kvd] / alpha, sv_ri @ p[kvd:], alpha


def fit_latent(mk: torch.Tensor, wv: torch.Tensor, xx: torch.Tensor, rank: int, *, sk: Optional[torch.Tensor] = None,
               sv: Optional[torch.Tensor] = None, alpha_mult: float = 1.0
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """:meth:`LatentFitter.fit` once: the latent of ``mk`` / ``wv`` on inputs of second moment ``xx``, weighted by
    ``sk`` / ``sv`` (None: identity)."""
    return LatentFitter(xx, sk, sv).fit(mk, wv, rank, alpha_mult)
