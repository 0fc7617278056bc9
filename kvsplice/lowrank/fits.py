"""SVD-family low-rank KV bases fitted from calibration Grams (no activations needed).

Notation for one KV head (head dim ``d``): ``K (N, d)`` keys, ``Q (N', d)`` the queries that read them (one head,
the group's heads concatenated, or their sum — see GQA below), ``V (N, d)`` values, ``W (m, d)`` the output
projection slice(s) that read the values. Only the Grams ``G_K = KᵀK``, ``G_Q = QᵀQ``, ``G_V = VᵀV`` and
``G_W = WᵀW`` are used. Bases follow :mod:`kvsplice.lowrank.bases`: cached ``a = k @ k_enc``, projected query
``q̃ = q @ k_dec``, score ``q̃·a = q k_dec k_encᵀ kᵀ``; cached ``b = v @ v_enc``, ``v̂ = b @ v_decᵀ``.

Methods (``R`` = rank):

* ``ksvd`` — K-only SVD (Palu / LoRC): ``P`` = top-R eigenvectors of ``G_K``, ``k_enc = k_dec = P``; minimises
  ``‖K − K P Pᵀ‖_F`` (Eckart–Young). Values likewise from ``G_V``.
* ``eigen`` — joint SVD of ``[K; Q]``: ``P`` = top-R eigenvectors of ``G_K + G_Q`` (``G_Q`` = the group's summed
  query Grams ``Σ_h Q_hᵀQ_h``, raw queries without the softmax scale), ``k_enc = k_dec = P``; minimises
  ``‖[K; Q] − [K; Q] P Pᵀ‖_F``. Values: V-only SVD (as ``ksvd``).
* ``kq`` — attention-aware (Lesens et al.): best rank-R approximation of the score matrix ``K Qᵀ`` with an oblique
  pair (:func:`oblique_basis`). Values: :func:`fit_values_wo` (best rank-R approximation of ``V Wᵀ``).
* ``gqa-sum`` — ``kq`` with the Gram of the group-summed queries ``(Σ_h Q_h)ᵀ(Σ_h Q_h)``: minimises the error of
  the summed scores ``‖Σ_h K Q_hᵀ − Σ_h K A Bᵀ Q_hᵀ‖_F`` (seed 001's closed form).
* ``gqa-concat`` — ``kq`` with ``Σ_h Q_hᵀQ_h``: minimises the per-head objective ``Σ_h ‖K Q_hᵀ − K A Bᵀ Q_hᵀ‖²``
  (queries concatenated). Allowing a separate decoder ``B_h`` per query head gives the same optimum (for a fixed
  cached subspace the best ``B_h`` is the projection, ``B_h = V_K Σ_K U_R`` for every h), so one ``k_dec`` per
  KV head loses nothing. For MHA (g = 1) ``gqa-sum`` = ``gqa-concat`` = ``kq``.

* ``fisher`` — loss-aware: keys min ``tr(Zᵀ G_K Z G_F)`` with ``G_F`` the Gram of the loss gradients ``∂NLL/∂k``
  (the predicted NLL increase, :mod:`kvsplice.lowrank.sensitivity`), values likewise with ``∂NLL/∂v``: the
  oblique construction with the gradient Gram in place of the query / W_O Gram. Needs stats with sensitivities.

Values for ``kq``/``gqa-*`` always use the concatenated W_O slices of the group (each query head mixes the values
with its own attention weights, so the per-head contributions ``V W_hᵀ`` are the natural targets).

Scale: fits invariant to scaling of ``G_Q``/``G_W``; scaling ``G_K`` by ``c`` scales ``k_enc`` by ``1/√c`` and
``k_dec`` by ``√c`` (the product is invariant). :func:`fit_bases` uses per-token Grams (``Σ/N``), which makes the
attention-aware coefficients whitened: ``E[a aᵀ] = I`` over the calibration tokens — good for fp16 caches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Optional

import torch

from kvsplice.lowrank.bases import HeadBases, KVBases
from kvsplice.lowrank.calibrate import CalibrationStats

Method = Literal["ksvd", "eigen", "kq", "gqa-sum", "gqa-concat", "fisher"]
FITS = ("ksvd", "eigen", "kq", "gqa-sum", "gqa-concat", "fisher")
"""The fits (``fit_bases(stats, fit)``): how bases are fitted to the calibration statistics."""
RCOND = 1e-6
"""Relative cutoff on σ_K: directions with ``σ_K,i ≤ RCOND·σ_K,max`` are treated as absent (pseudo-inverse)."""

__all__ = [
    "Basis", "FITS", "HeadFit", "RCOND", "select_rank", "ksvd_basis", "joint_basis", "oblique_basis",
    "fit_ksvd", "fit_eigen", "fit_kq", "fit_gqa_sum", "fit_gqa_concat", "fit_values_wo", "fit_bases",
]


# ------------------------------------------------------------------------------------------------ primitives
@dataclass
class Basis:
    """An encoder/decoder pair ``(d, R)`` with the spectrum of the fit's objective (descending) and the retained
    fraction ``Σ_{i≤R} s_i / Σ s_i`` of that spectrum (``s_i`` = squared singular values)."""

    enc: torch.Tensor
    dec: torch.Tensor
    spectrum: torch.Tensor
    rank: int

    @property
    def retained(self) -> float:
        tot = float(self.spectrum.sum())
        return float(self.spectrum[: self.rank].sum()) / tot if tot > 0 else 1.0


def _sym(g: torch.Tensor) -> torch.Tensor:
    if g.dim() != 2 or g.shape[0] != g.shape[1]:
        raise ValueError(f"expected a square Gram matrix, got shape {tuple(g.shape)}")
    return 0.5 * (g + g.T)


def _eigh_desc(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenvalues (descending, clamped ≥ 0) and eigenvectors of a PSD matrix."""
    lam, vec = torch.linalg.eigh(_sym(g))
    return lam.flip(0).clamp_min(0), vec.flip(1)


def select_rank(spectrum: torch.Tensor, rank: Optional[int] = None, energy: Optional[float] = None) -> int:
    """``rank`` as given (1 ≤ rank ≤ d), or the smallest R with ``Σ_{i≤R} s_i / Σ s_i ≥ energy`` for a descending
    spectrum of squared singular values ``s`` (exactly one of ``rank`` / ``energy``)."""
    d = spectrum.numel()
    if (rank is None) == (energy is None):
        raise ValueError(f"give exactly one of rank / energy, got rank={rank}, energy={energy}")
    if rank is not None:
        if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank <= d:
            raise ValueError(f"rank must be an integer in [1, {d}] (head dim), got {rank!r}")
        return rank
    if not 0.0 < float(energy) <= 1.0:
        raise ValueError(f"energy must be in (0, 1], got {energy!r}")
    s = spectrum.double().clamp_min(0)
    tot = float(s.sum())
    if tot <= 0:
        return 1
    frac = torch.cumsum(s, 0) / tot
    # tolerance: a cumulative sum that equals E up to rounding counts as reaching it
    ok = (frac >= float(energy) - 1e-12).nonzero()
    return int(ok[0]) + 1 if ok.numel() else d


def ksvd_basis(gram: torch.Tensor, rank: Optional[int] = None, energy: Optional[float] = None) -> Basis:
    """Top-R eigenvectors ``P`` of ``gram = XᵀX``: ``enc = dec = P`` minimises ``‖X − X P Pᵀ‖_F`` over rank-R
    projections (Eckart–Young). Spectrum: the eigenvalues of ``gram`` (= σ_i(X)²)."""
    lam, vec = _eigh_desc(gram)
    r = select_rank(lam, rank, energy)
    p = vec[:, :r].contiguous()
    return Basis(p, p.clone(), lam, r)


def joint_basis(gk: torch.Tensor, gq: torch.Tensor, rank: Optional[int] = None,
                energy: Optional[float] = None) -> Basis:
    """Eigen method: top-R eigenvectors of ``G_K + G_Q`` (joint SVD of ``[K; Q]``), ``enc = dec = P``."""
    return ksvd_basis(_sym(gk) + _sym(gq), rank, energy)


def _oblique_parts(gk: torch.Tensor, gq: torch.Tensor, rcond: float):
    """``V_K``, truncated ``σ_K``, its pseudo-inverse, and ``C = M Mᵀ = Σ_K V_Kᵀ G_Q V_K Σ_K`` (all in V_K basis)."""
    lam, vk = _eigh_desc(gk)
    sk = lam.sqrt()
    keep = sk > rcond * sk.max() if float(sk.max()) > 0 else torch.zeros_like(sk, dtype=torch.bool)
    sk = torch.where(keep, sk, torch.zeros_like(sk))
    sk_inv = torch.where(keep, 1.0 / torch.where(keep, sk, torch.ones_like(sk)), torch.zeros_like(sk))
    c = sk[:, None] * (vk.T @ _sym(gq) @ vk) * sk[None, :]  # (d, d) = M Mᵀ
    return vk, sk, sk_inv, _sym(c)


def oblique_basis(gk: torch.Tensor, gq: torch.Tensor, rank: Optional[int] = None, energy: Optional[float] = None,
                  rcond: float = RCOND) -> Basis:
    """Attention-aware oblique pair: ``K A Bᵀ Qᵀ`` = the best rank-R approximation of ``K Qᵀ``.

    With ``G_K = V_K Σ_K² V_Kᵀ`` (so ``K = U_K Σ_K V_Kᵀ``), ``Q = U_Q Σ_Q V_Qᵀ`` and
    ``M = Σ_K V_Kᵀ V_Q Σ_Q = U Σ Wᵀ`` we have ``K Qᵀ = U_K M U_Qᵀ = (U_K U) Σ (U_Q W)ᵀ``, an SVD. Take

        ``A = enc = V_K Σ_K⁻¹ U_R``   (so ``K A = U_K U_R``: orthonormal columns / whitened coefficients),
        ``B = dec = V_K Σ_K U_R``     (so ``Bᵀ Qᵀ = U_Rᵀ Σ_K V_Kᵀ Qᵀ = U_Rᵀ M U_Qᵀ``),

    then ``K A Bᵀ Qᵀ = U_K U_R U_Rᵀ M U_Qᵀ`` — the rank-R truncation. ``U`` and ``Σ²`` come from the symmetric
    ``M Mᵀ = Σ_K V_Kᵀ G_Q V_K Σ_K``, so ``G_Q`` is never factored and a rank-deficient ``Q`` needs no care.
    ``Σ_K⁻¹`` is a pseudo-inverse: directions with ``σ_K,i ≤ rcond·σ_K,max`` are dropped from both ``A`` and
    ``B`` (they carry at most a relative ``rcond`` of ``K``). Spectrum: ``σ_i(M)² = σ_i(K Qᵀ)²``.
    """
    vk, sk, sk_inv, c = _oblique_parts(gk, gq, rcond)
    s2, u = _eigh_desc(c)
    r = select_rank(s2, rank, energy)
    ur = u[:, :r]
    enc = vk @ (sk_inv[:, None] * ur)
    dec = vk @ (sk[:, None] * ur)
    return Basis(enc.contiguous(), dec.contiguous(), s2, r)


# ------------------------------------------------------------------------------------------------ head fits
def _wo_gram(wo: torch.Tensor) -> torch.Tensor:
    """``Σ_h W_hᵀ W_h`` for slices ``(g, d_model, d)`` or one slice ``(d_model, d)``; a ``(d, d)`` Gram passes."""
    if wo.dim() == 3:
        return torch.einsum("gmd,gme->de", wo, wo)
    if wo.dim() == 2 and wo.shape[0] != wo.shape[1]:
        return wo.T @ wo
    return wo  # already a (d, d) Gram (a square slice d_model == d is ambiguous: pass it as (1, d_model, d))


def _vspec(rank, energy, rank_v, energy_v):
    return (rank_v, energy_v) if (rank_v is not None or energy_v is not None) else (rank, energy)


@dataclass
class HeadFit(HeadBases):
    """:class:`HeadBases` of one fitted KV head with the retained fraction of each fit's spectrum
    (:attr:`Basis.retained`), which :func:`fit_bases` records in the bases' metadata."""

    retained_k: float = 1.0
    retained_v: float = 1.0


def _head(kb: Basis, vb: Basis) -> HeadFit:
    return HeadFit(kb.enc, kb.dec, vb.enc, vb.dec, kb.retained, vb.retained)


def fit_values_wo(vv: torch.Tensor, wo: torch.Tensor, rank: Optional[int] = None, energy: Optional[float] = None,
                  rcond: float = RCOND) -> Basis:
    """Value bases aware of the output projection: ``V E Dᵀ Wᵀ`` = best rank-R approximation of ``V Wᵀ``.

    ``W`` is the stack of the W_O slices ``(d_model, d)`` of the query heads reading this KV head (``wo``: slices
    ``(g, d_model, d)``, one slice, or the Gram ``Σ_h W_hᵀW_h``), so the objective is ``Σ_h ‖V W_hᵀ −
    V E Dᵀ W_hᵀ‖_F²`` — each head's contribution to the layer output. The oblique construction of
    :func:`oblique_basis` with ``K → V``, ``Q → W``: ``v_enc = E = V_V Σ_V⁻¹ U_R``, ``v_dec = D = V_V Σ_V U_R``
    with ``U`` from ``Σ_V V_Vᵀ G_W V_V Σ_V``. The apply path folds ``v_decᵀ W_hᵀ`` into the output projection.
    """
    return oblique_basis(vv, _wo_gram(wo), rank, energy, rcond)


def fit_ksvd(kk: torch.Tensor, vv: torch.Tensor, *, rank: Optional[int] = None, energy: Optional[float] = None,
             rank_v: Optional[int] = None, energy_v: Optional[float] = None) -> HeadFit:
    """K-only / V-only SVD: ``k_enc = k_dec`` = top-R eigenvectors of ``KᵀK`` (min ``‖K − K P Pᵀ‖_F``),
    ``v_enc = v_dec`` = top-R_v eigenvectors of ``VᵀV`` (min ``‖V − V P Pᵀ‖_F``)."""
    return _head(ksvd_basis(kk, rank, energy), ksvd_basis(vv, *_vspec(rank, energy, rank_v, energy_v)))


def fit_eigen(kk: torch.Tensor, qq: torch.Tensor, vv: torch.Tensor, *, rank: Optional[int] = None,
              energy: Optional[float] = None, rank_v: Optional[int] = None,
              energy_v: Optional[float] = None) -> HeadFit:
    """Joint SVD of ``[K; Q]``: ``k_enc = k_dec`` = top-R eigenvectors of ``KᵀK + QᵀQ`` (min
    ``‖[K; Q] − [K; Q] P Pᵀ‖_F``; ``qq`` = ``Σ_h Q_hᵀQ_h`` of the group). Values: V-only SVD."""
    return _head(joint_basis(kk, qq, rank, energy), ksvd_basis(vv, *_vspec(rank, energy, rank_v, energy_v)))


def fit_kq(kk: torch.Tensor, qq: torch.Tensor, vv: torch.Tensor, wo: torch.Tensor, *, rank: Optional[int] = None,
           energy: Optional[float] = None, rank_v: Optional[int] = None, energy_v: Optional[float] = None,
           rcond: float = RCOND) -> HeadFit:
    """Attention-aware: keys min ``‖K Qᵀ − K A Bᵀ Qᵀ‖_F`` (:func:`oblique_basis` with ``G_Q = qq``), values min
    ``‖V Wᵀ − V E Dᵀ Wᵀ‖_F`` (:func:`fit_values_wo`)."""
    kb = oblique_basis(kk, qq, rank, energy, rcond)
    vb = fit_values_wo(vv, wo, *_vspec(rank, energy, rank_v, energy_v), rcond=rcond)
    return _head(kb, vb)


def fit_gqa_sum(kk: torch.Tensor, qsum: torch.Tensor, vv: torch.Tensor, wo: torch.Tensor, **spec) -> HeadFit:
    """GQA, summed scores: min ``‖Σ_h K Q_hᵀ − Σ_h K A Bᵀ Q_hᵀ‖_F = ‖K Q_Σᵀ − K A Bᵀ Q_Σᵀ‖_F`` with
    ``Q_Σ = Σ_h Q_h``; ``qsum = Q_Σᵀ Q_Σ``. Values as :func:`fit_values_wo` (concatenated W_O slices)."""
    return fit_kq(kk, qsum, vv, wo, **spec)


def fit_gqa_concat(kk: torch.Tensor, qq_heads: torch.Tensor, vv: torch.Tensor, wo: torch.Tensor,
                   **spec) -> HeadFit:
    """GQA, per-head scores: min ``Σ_h ‖K Q_hᵀ − K A Bᵀ Q_hᵀ‖_F² = ‖K Q_catᵀ − K A Bᵀ Q_catᵀ‖_F²`` with
    ``Q_cat = [Q_1; …; Q_g]``, whose Gram is ``Σ_h Q_hᵀQ_h`` (``qq_heads``: the g per-head Grams ``(g, d, d)``, or
    their sum ``(d, d)``). Values as :func:`fit_values_wo`."""
    qq = qq_heads.sum(0) if qq_heads.dim() == 3 else qq_heads
    return fit_kq(kk, qq, vv, wo, **spec)


# ------------------------------------------------------------------------------------------------ model fit
def _fit_head(stats: CalibrationStats, method: str, layer: int, j: int, kspec, vspec, rcond: float) -> HeadFit:
    """Head ``j`` of ``layer`` by ``method``'s head fit, on the per-token Grams of ``stats``."""
    kk = stats.key_gram(layer, j, normalize=True)
    vv = stats.value_gram(layer, j, normalize=True)
    spec = dict(rank=kspec[0], energy=kspec[1], rank_v=vspec[0], energy_v=vspec[1])
    if method == "ksvd":
        return fit_ksvd(kk, vv, **spec)
    if method == "eigen":
        return fit_eigen(kk, stats.query_gram(layer, j, "concat", normalize=True), vv, **spec)
    if method == "fisher":  # loss-aware: min ½ tr(Zᵀ G_K Z G_F), G_F the loss-gradient Gram (sensitivity.py)
        return fit_kq(kk, stats.grad_gram("k", layer, j), vv, stats.grad_gram("v", layer, j), rcond=rcond, **spec)
    wo = stats.output_gram(layer, j)
    if method == "gqa-sum":
        return fit_gqa_sum(kk, stats.query_gram(layer, j, "sum", normalize=True), vv, wo, rcond=rcond, **spec)
    fit = fit_kq if method == "kq" else fit_gqa_concat  # kq == gqa-concat; for MHA all three coincide
    return fit(kk, stats.query_gram(layer, j, "concat", normalize=True), vv, wo, rcond=rcond, **spec)


def fit_bases(stats: CalibrationStats, method: Method, rank: Optional[int] = None, energy: Optional[float] = None,
              rank_v: Optional[int] = None, energy_v: Optional[float] = None, *, uniform_ranks: bool = False,
              rcond: float = RCOND, dtype: torch.dtype = torch.float32,
              ranks: Optional[dict[str, list[list[int]]]] = None) -> KVBases:
    """Fit bases for every layer and KV head of a calibrated model.

    Keys use ``rank`` or ``energy``; values use ``rank_v`` / ``energy_v`` if either is given, else the key spec.
    With ``energy`` each head gets the smallest rank retaining that fraction of its objective's spectrum (ranks may
    differ per head); ``uniform_ranks=True`` then raises every head of a layer to the layer's largest rank.
    ``kq`` uses the per-head (``concat``) query Gram — identical to ``gqa-concat``; for GQA models compare it with
    ``gqa-sum``. Fits run in float64 on per-token Grams; the bases are returned in ``dtype``. Metadata: method,
    RoPE mode, ranks, retained energy per head, calibration tokens, model fingerprint and shapes.
    """
    if method not in FITS:
        raise ValueError(f"unknown fit {method!r}; choose one of {FITS}")
    if stats.n_tokens <= 0:
        raise ValueError("calibration stats are empty (n_tokens == 0)")
    if method == "fisher" and not stats.has_sensitivity:
        raise ValueError("the fisher fit needs loss-gradient statistics (kvsplice.lowrank.sensitivity.calibrate_all)")
    kspec, vspec = (rank, energy), _vspec(rank, energy, rank_v, energy_v)
    if ranks is not None:  # explicit per-layer, per-head ranks (kvsplice.lowrank.allocate)
        fitted = [[_fit_head(stats, method, l, j, (ranks["k"][l][j], None), (ranks["v"][l][j], None), rcond)
                   for j in range(stats.n_kv_head)] for l in range(stats.n_layer)]
        kspec = vspec = (None, None)
    else:
        for name, (r, e) in (("keys", kspec), ("values", vspec)):
            if (r is None) == (e is None):
                raise ValueError(f"{name}: give exactly one of rank / energy (got rank={r}, energy={e})")
        fitted = [[_fit_head(stats, method, l, j, kspec, vspec, rcond) for j in range(stats.n_kv_head)]
                  for l in range(stats.n_layer)]
    if uniform_ranks:
        for l, row in enumerate(fitted):
            rk, rv = max(h.rank_k for h in row), max(h.rank_v for h in row)
            fitted[l] = [_fit_head(stats, method, l, j, (rk, None), (rv, None), rcond) for j in range(len(row))]

    layers = [[HeadBases(*(t.to(dtype) for t in (h.k_enc, h.k_dec, h.v_enc, h.v_dec))) for h in row] for row in fitted]
    meta: dict[str, Any] = {
        "method": method, "rope": stats.rope, "calibration_tokens": stats.n_tokens,
        "model_family": stats.family, "n_head": stats.n_head, "n_kv_head": stats.n_kv_head,
        "head_dim": stats.head_dim, "rank": rank, "energy": energy, "rank_v": vspec[0], "energy_v": vspec[1],
        "uniform_ranks": uniform_ranks,
        "values": {"ksvd": "v-svd", "eigen": "v-svd", "fisher": "loss-gradient"}.get(method, "wo-aware"),
        "query_gram": {"ksvd": None, "eigen": "concat", "kq": "concat", "gqa-sum": "sum",
                       "gqa-concat": "concat", "fisher": "loss-gradient"}[method],
        "allocated": ranks is not None,
        "retained_k": [[round(h.retained_k, 6) for h in row] for row in fitted],
        "retained_v": [[round(h.retained_v, 6) for h in row] for row in fitted],
    }
    if stats.fingerprint:
        meta["model_fingerprint"] = stats.fingerprint
    return KVBases(layers, method, stats.rope, meta)
