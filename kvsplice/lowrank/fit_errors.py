"""Errors of fitted low-rank bases from the calibration Grams alone (no activations): relative score, value and
reconstruction errors per head, Lesens' gap between the K-only SVD and the attention-aware fit, and
:func:`bases_errors` over a whole model. Uses ``‖X Z Yᵀ‖_F² = tr(Zᵀ G_X Z G_Y)`` (notation of
:mod:`kvsplice.lowrank.fits`)."""

from __future__ import annotations

import math
from typing import Literal

import torch

from kvsplice.lowrank.bases import KVBases
from kvsplice.lowrank.calibrate import CalibrationStats
from kvsplice.lowrank.fits import RCOND, _eigh_desc, _oblique_parts, _sym, _wo_gram

__all__ = ["bases_errors", "gram_error", "lesens_gap", "lesens_gaps", "lesens_terms", "reconstruction_error",
           "score_error", "value_error"]


def gram_error(g: torch.Tensor, gq: torch.Tensor, enc: torch.Tensor, dec: torch.Tensor) -> tuple[float, float]:
    """``(‖X (I − enc decᵀ) Yᵀ‖_F², ‖X Yᵀ‖_F²)`` from ``G_X = g``, ``G_Y = gq``: ``‖X Z Yᵀ‖² = tr(Zᵀ G_X Z G_Y)``."""
    g, gq = _sym(g).double(), _sym(gq).double()
    z = torch.eye(g.shape[0], dtype=torch.float64) - enc.double() @ dec.double().T
    num = float(torch.trace(z.T @ g @ z @ gq))
    den = float(torch.trace(g @ gq))
    return max(num, 0.0), den


def _rel(num: float, den: float) -> float:
    return math.sqrt(num / den) if den > 0 else 0.0


def score_error(kk: torch.Tensor, qq: torch.Tensor, k_enc: torch.Tensor, k_dec: torch.Tensor) -> float:
    """Relative attention-score error ``‖K Qᵀ − K A Bᵀ Qᵀ‖_F / ‖K Qᵀ‖_F`` from the Grams alone
    (``‖K X Qᵀ‖_F² = tr(Xᵀ KᵀK X QᵀQ)``). Pass the concat or sum query Gram for the GQA objective of choice."""
    return _rel(*gram_error(kk, qq, k_enc, k_dec))


def value_error(vv: torch.Tensor, wo: torch.Tensor, v_enc: torch.Tensor, v_dec: torch.Tensor) -> float:
    """Relative output error ``‖V Wᵀ − V E Dᵀ Wᵀ‖_F / ‖V Wᵀ‖_F`` (``wo``: slices or their Gram, as in
    :func:`fit_values_wo`)."""
    return _rel(*gram_error(vv, _wo_gram(wo), v_enc, v_dec))


def reconstruction_error(gram: torch.Tensor, enc: torch.Tensor, dec: torch.Tensor) -> float:
    """Relative reconstruction error ``‖X − X enc decᵀ‖_F / ‖X‖_F`` (e.g. rebuilt pre-RoPE keys ``k̂ = a k_decᵀ``)."""
    eye = torch.eye(gram.shape[0], dtype=torch.float64)
    return _rel(*gram_error(gram, eye, enc, dec))


def lesens_terms(kk: torch.Tensor, qq: torch.Tensor, rank: int, rcond: float = RCOND) -> dict[str, float]:
    """Squared score errors at rank R from the Grams: ``total = ‖KQᵀ‖²``, ``err_kq = Σ_{i>R} σ_i(M)²`` (optimal,
    attention-aware), ``err_konly = ‖KQᵀ − K P Pᵀ Qᵀ‖²`` with ``P = V_K[:, :R]`` (K-only SVD), and Lesens' gap
    ``gap = err_konly − err_kq = Σ_{i≤R} σ_i(M)² − ‖Σ_K[:R] V_K[:, :R]ᵀ V_Q Σ_Q‖_F² ≥ 0`` (the second term is the
    squared norm of the first R rows of ``M``, i.e. ``Σ_{i≤R} (M Mᵀ)_ii`` in the V_K basis)."""
    _, _, _, c = _oblique_parts(_sym(kk).double(), _sym(qq).double(), rcond)
    s2, _ = _eigh_desc(c)
    total = float(torch.trace(c))
    top = float(s2[:rank].sum())
    rows = float(torch.diagonal(c)[:rank].sum())
    return {"total": total, "err_kq": max(total - top, 0.0), "err_konly": max(total - rows, 0.0),
            "gap": max(top - rows, 0.0)}


def lesens_gap(kk: torch.Tensor, qq: torch.Tensor, rank: int) -> float:
    """Lesens' gap ``ε = err_K-only − err_KQᵀ ≥ 0`` (squared Frobenius, in the units of the Grams)."""
    return lesens_terms(kk, qq, rank)["gap"]


def lesens_gaps(stats: CalibrationStats, rank: int, gqa: Literal["concat", "sum"] = "concat"
                ) -> list[list[float]]:
    """Relative gap ``ε / ‖KQᵀ‖_F²`` per layer and KV head at rank R (the score-error energy K-only SVD gives up)."""
    out = []
    for l in range(stats.n_layer):
        row = []
        for j in range(stats.n_kv_head):
            t = lesens_terms(stats.key_gram(l, j, True), stats.query_gram(l, j, gqa, True), rank)
            row.append(t["gap"] / t["total"] if t["total"] > 0 else 0.0)
        out.append(row)
    return out


def bases_errors(stats: CalibrationStats, bases: KVBases) -> dict[str, list[list[float]]]:
    """Relative errors of ``bases`` per layer and KV head, from the (held-out or calibration) Grams in ``stats``:

    * ``scores``      ``‖K Q_catᵀ − K A Bᵀ Q_catᵀ‖/‖K Q_catᵀ‖`` (per-query-head scores, the group concatenated);
    * ``scores_sum``  the same for the summed group queries (GQA sum objective; = ``scores`` for MHA);
    * ``keys``        ``‖K − K A Bᵀ‖/‖K‖`` (rebuilt keys; what matters for pre-RoPE application);
    * ``values``      ``‖V Wᵀ − V E Dᵀ Wᵀ‖/‖V Wᵀ‖`` (the heads' contribution to the layer output);
    * ``values_plain`` ``‖V − V E Dᵀ‖/‖V‖``.
    """
    if bases.n_layer != stats.n_layer or bases.n_kv_head != stats.n_kv_head:
        raise ValueError(f"bases ({bases.n_layer} layers × {bases.n_kv_head} KV heads) do not match the stats "
                         f"({stats.n_layer} × {stats.n_kv_head})")
    out: dict[str, list[list[float]]] = {k: [] for k in ("scores", "scores_sum", "keys", "values", "values_plain")}
    for l in range(stats.n_layer):
        rows: dict[str, list[float]] = {k: [] for k in out}
        for j in range(stats.n_kv_head):
            h = bases.layers[l][j]
            kk, vv = stats.key_gram(l, j, True), stats.value_gram(l, j, True)
            rows["scores"].append(score_error(kk, stats.query_gram(l, j, "concat", True), h.k_enc, h.k_dec))
            rows["scores_sum"].append(score_error(kk, stats.query_gram(l, j, "sum", True), h.k_enc, h.k_dec))
            rows["keys"].append(reconstruction_error(kk, h.k_enc, h.k_dec))
            rows["values"].append(value_error(vv, stats.output_gram(l, j), h.v_enc, h.v_dec))
            rows["values_plain"].append(reconstruction_error(vv, h.v_enc, h.v_dec))
        for k in out:
            out[k].append(rows[k])
    return out
