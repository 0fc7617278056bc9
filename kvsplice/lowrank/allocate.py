"""Rank allocation under a budget (Palu-style search, in loss units): key and value ranks per layer and KV head.

Every (layer, KV head, keys/values) group has a cost curve ``c(r)``, the predicted per-token NLL increase of the
method's rank-``r`` basis, ``½·tr(Zᵀ G Z G_F)`` with ``Z = I − enc_r dec_rᵀ``, ``G`` the group's Gram and ``G_F``
the Gram of the loss gradients (:mod:`kvsplice.lowrank.sensitivity`). All groups are then in one unit, keys and
values alike — the K/V split follows the calibration loss, not the energy — and a budget of ``N`` cached numbers
per token (``Σ ranks``) is spent greedily where it removes the most predicted loss per number (with look-ahead over
flat stretches of a curve). The ``fisher`` fit minimises this same cost, so its curves are its spectrum tails;
other methods' nested bases (rank-r = the first r columns of the rank-d fit) are scored with the trace formula.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Optional

import torch

from kvsplice.lowrank.calibrate import CalibrationStats
from kvsplice.lowrank.fit_errors import gram_error
from kvsplice.lowrank.fits import RCOND, _fit_head, oblique_basis

__all__ = ["Allocation", "allocate_ranks", "cost_curves", "greedy_ranks"]


@dataclass
class Allocation:
    """Ranks ``{"k": [[R per head] per layer], "v": ...}``, the numbers per token they cache, and the predicted
    per-token NLL increase (sum of the groups' costs; an additive proxy, not a measurement)."""

    ranks: dict[str, list[list[int]]]
    numbers_per_token: int
    predicted_nll: float
    method: str

    def split(self) -> dict[str, float]:
        """Mean key and value rank, and the keys' share of the cached numbers."""
        k = [r for row in self.ranks["k"] for r in row]
        v = [r for row in self.ranks["v"] for r in row]
        return {"mean_rank_k": sum(k) / len(k), "mean_rank_v": sum(v) / len(v),
                "key_share": sum(k) / max(sum(k) + sum(v), 1)}


def cost_curves(stats: CalibrationStats, method: str, rcond: float = RCOND) -> dict[tuple[int, int, str], list[float]]:
    """``(layer, head, "k"/"v") → [c(0), c(1), …, c(d)]``, predicted per-token NLL increase at each rank."""
    if not stats.has_sensitivity:
        raise ValueError("rank allocation needs loss-gradient statistics (kvsplice.lowrank.sensitivity.calibrate_all, "
                         "or fit_bases --calib-stats made with them)")
    d = stats.head_dim
    out = {}
    if method == "fisher":  # the fit minimises this very cost with nested bases: c(r) = ½ Σ_{i>r} σ_i² of its spectrum
        for l in range(stats.n_layer):
            for j in range(stats.n_kv_head):
                for kind, gram in (("k", stats.key_gram(l, j, True)), ("v", stats.value_gram(l, j, True))):
                    f = stats.grad_gram(kind, l, j)
                    s2 = oblique_basis(gram, f, d, rcond=rcond).spectrum.double()  # (d,) descending
                    tail = s2.flip(0).cumsum(0).flip(0)  # tail[r] = Σ_{i≥r} σ_i²
                    total = 0.5 * float(torch.trace(gram.double() @ f.double()))
                    out[(l, j, kind)] = [total] + [0.5 * float(tail[r]) if r < d else 0.0 for r in range(1, d + 1)]
        return out
    for l in range(stats.n_layer):
        for j in range(stats.n_kv_head):
            full = _fit_head(stats, method, l, j, (d, None), (d, None), rcond)
            for kind, gram, enc, dec in (("k", stats.key_gram(l, j, True), full.k_enc, full.k_dec),
                                         ("v", stats.value_gram(l, j, True), full.v_enc, full.v_dec)):
                f = stats.grad_gram(kind, l, j)
                total = 0.5 * float(torch.trace(gram.double() @ f.double()))
                curve = [total] + [0.5 * gram_error(gram, f, enc[:, :r], dec[:, :r])[0] for r in range(1, d + 1)]
                out[(l, j, kind)] = curve
    return out


def greedy_ranks(curves: dict, numbers: int, max_rank: int, min_rank: int = 1) -> dict:
    """Group → rank with ``Σ ranks == numbers`` (``min_rank ≤ rank ≤ max_rank``), spent greedily on the largest
    cost reduction per number of the groups' curves ``[c(0), …, c(max_rank)]`` (look-ahead over flat stretches)."""
    groups = sorted(curves)
    lo, hi = min_rank * len(groups), max_rank * len(groups)
    if not lo <= numbers <= hi:
        raise ValueError(f"numbers_per_token must be in [{lo}, {hi}] ({len(groups)} groups of rank {min_rank}.."
                         f"{max_rank}), got {numbers}")
    rank = {g: min_rank for g in groups}
    left = numbers - lo

    def best_step(g):
        """(gain per number, step) of the best look-ahead step from the group's current rank."""
        c, r = curves[g], rank[g]
        steps = [((c[r] - c[r + s]) / s, s) for s in range(1, max_rank - r + 1)]
        return max(steps) if steps else None

    heap = []
    for g in groups:
        b = best_step(g)
        if b is not None:
            heapq.heappush(heap, (-b[0], b[1], g))
    while left > 0 and heap:
        _, s, g = heapq.heappop(heap)
        s = min(s, left)
        rank[g] += s
        left -= s
        b = best_step(g)
        if b is not None:
            heapq.heappush(heap, (-b[0], b[1], g))
    return rank


def allocate_ranks(stats: CalibrationStats, numbers_per_token: int, method: str = "fisher", *, min_rank: int = 1,
                   curves: Optional[dict] = None) -> Allocation:
    """Ranks for every layer, KV head and kind with ``Σ ranks == numbers_per_token`` (at most ``2·L·Hkv·d``, at least
    ``min_rank`` per group) spent greedily on the largest predicted-NLL reduction per number."""
    curves = curves or cost_curves(stats, method)
    rank = greedy_ranks(curves, numbers_per_token, stats.head_dim, min_rank)
    ranks = {kind: [[rank[(l, j, kind)] for j in range(stats.n_kv_head)] for l in range(stats.n_layer)]
             for kind in ("k", "v")}
    return Allocation(ranks, sum(rank.values()), sum(curves[g][rank[g]] for g in rank), method)
