"""Error diagnostics for approximate attention: observed errors and a-priori bounds (logits, softmax, head output).

Notation per query: exact logits ``ℓ_t = s · q·k_t`` and approximate ``ℓ̂_t = s · q·k̂_t`` (``s`` the scale;
``k̂_t = B_j B_jᵀ k_t`` for a token of chunk ``j``, which is what ``(q B_j)·a_t`` computes), attention weights
``α = softmax(ℓ)``, ``α̂ = softmax(ℓ̂)``, outputs ``o = Σ α_t v_t`` and ``ô = Σ α̂_t v̂_t``. Let ``e_t = ℓ_t − ℓ̂_t``.

1. **Logits.** ``|e_t| = s |q·(k_t − k̂_t)| ≤ s ‖q‖ ‖k_t − k̂_t‖`` (Cauchy–Schwarz), so
   ``ε := ‖ℓ − ℓ̂‖∞ ≤ s ‖q‖ max_t ρ_k(t)`` with ``ρ_k(t) = ‖k_t − k̂_t‖`` (:func:`logit_error_bound`). (With an
   orthogonal projection the tighter ``s ‖(I − P_j) q‖ ρ_k(t)`` also holds, since ``k − P_j k ⊥ range P_j``.)
2. **Softmax.** Softmax ignores a constant shift of the logits, so what matters is the *oscillation*
   ``δ := max_t e_t − min_t e_t`` (``≤ 2ε``). Then ``‖α − α̂‖₁ ≤ 2 tanh(δ/4)``, and this is tight.
   *Proof.* ``α̂_t = α_t w_t / E_α[w]`` with ``w_t = e^{−e_t} ∈ [a, a e^δ]``, so
   ``‖α − α̂‖₁ = E_α|w − E_α w| / E_α w``. For a fixed mean, ``E|w − Ew|`` is convex in the law of ``w``, so the
   maximum is at a two-point law on ``{a, a e^δ}``; with mass ``p`` on the top,
   ``f(p) = 2p(1−p)(R−1)/(1 + p(R−1))``, ``R = e^δ``, is maximal at ``p = 1/(√R + 1)`` where
   ``f = 2(√R − 1)/(√R + 1) = 2 tanh(δ/4)``. Two tokens with ``α = (1/(1+e^{δ/2}), e^{δ/2}/(1+e^{δ/2}))`` (in
   the right order) attain it. Consequently ``‖α − α̂‖₁ ≤ 2 tanh(ε/2) ≤ ε``.
   The looser ``2 sinh(δ/2)`` is also a valid bound (``tanh(δ/4) ≤ δ/4 ≤ sinh(δ/2)``) but looser: about
   ``2×`` for small ``δ`` and unbounded (past the trivial 2) for large ``δ``; :func:`softmax_l1_bound` computes
   either (``kind="tanh"`` by default).
3. **Output.** ``o − ô = Σ_t (α_t − α̂_t) v_t + Σ_t α̂_t (v_t − v̂_t)``, so
   ``‖o − ô‖ ≤ ‖α − α̂‖₁ · max_t ‖v_t‖ + ΔV`` with ``ΔV := max_t ‖v_t − v̂_t‖`` (:func:`output_error_bound`).
   Since ``Σ_t (α_t − α̂_t) = 0`` the first term can use ``½ ‖α − α̂‖₁ · diam{v_t}`` instead (``v_diameter``).

All functions are pure and batched over leading dims; logits ``(..., T)``, values ``(..., T, d_v)``. Masked keys are
``-inf`` in both logit sets (or given by ``mask``, True = visible) and are ignored.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from kvsplice.core.attention import reference_attention

__all__ = ["attention_error_report", "logit_error", "logit_error_bound", "logit_oscillation", "output_error",
           "output_error_bound", "softmax_l1_bound", "softmax_l1_error"]


def _visible(logits: torch.Tensor, logits_hat: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    vis = torch.isfinite(logits) & torch.isfinite(logits_hat)
    return vis if mask is None else vis & mask


def logit_error(logits: torch.Tensor, logits_hat: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Observed ``ε = max_t |ℓ_t − ℓ̂_t|`` over visible keys → ``(...)``."""
    vis = _visible(logits, logits_hat, mask)
    e = torch.where(vis, (logits - logits_hat).abs(), torch.zeros_like(logits))
    return e.amax(-1)


def logit_oscillation(logits: torch.Tensor, logits_hat: torch.Tensor,
                      mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``δ = max_t (ℓ_t − ℓ̂_t) − min_t (ℓ_t − ℓ̂_t)`` over visible keys → ``(...)`` (0 with < 2 visible keys)."""
    vis = _visible(logits, logits_hat, mask)
    e = torch.where(vis, logits - logits_hat, torch.zeros_like(logits))
    hi = torch.where(vis, e, torch.full_like(e, -math.inf)).amax(-1)
    lo = torch.where(vis, e, torch.full_like(e, math.inf)).amin(-1)
    return torch.where(vis.any(-1), hi - lo, torch.zeros_like(hi))


def softmax_l1_error(logits: torch.Tensor, logits_hat: torch.Tensor,
                     mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Observed ``‖softmax(ℓ) − softmax(ℓ̂)‖₁`` → ``(...)``."""
    if mask is not None:
        logits = logits.masked_fill(~mask, -math.inf)
        logits_hat = logits_hat.masked_fill(~mask, -math.inf)
    return (torch.softmax(logits, -1) - torch.softmax(logits_hat, -1)).abs().sum(-1)


def output_error(out: torch.Tensor, out_hat: torch.Tensor) -> torch.Tensor:
    """Observed ``‖o − ô‖₂`` over the last dim → ``(...)``."""
    return (out - out_hat).norm(dim=-1)


def logit_error_bound(q: torch.Tensor, key_residual_max: torch.Tensor | float, scale: float = 1.0) -> torch.Tensor:
    """``ε ≤ scale · ‖q‖ · max_t ρ_k(t)``: ``q (..., d)`` and ``key_residual_max`` = ``max_t ‖k_t − k̂_t‖`` over the
    keys the query sees (broadcastable to ``q.shape[:-1]``) → ``(...)``."""
    return scale * q.norm(dim=-1) * key_residual_max


def softmax_l1_bound(delta: torch.Tensor | float, kind: str = "tanh") -> torch.Tensor:
    """Bound on ``‖α − α̂‖₁`` from the logit-error oscillation ``δ`` (use ``δ ≤ 2ε`` from an ``ε`` bound).

    ``kind="tanh"``: ``2 tanh(δ/4)`` (tight); ``kind="sinh"``: ``2 sinh(δ/2)`` (the common form; valid, looser).
    """
    delta = delta if isinstance(delta, torch.Tensor) else torch.tensor(delta, dtype=torch.float64)
    if kind == "tanh":
        return 2 * torch.tanh(delta / 4)
    if kind == "sinh":
        return 2 * torch.sinh(delta / 2)
    raise ValueError(f"kind must be 'tanh' or 'sinh', got {kind!r}")


def output_error_bound(softmax_l1: torch.Tensor | float, v_norm_max: torch.Tensor | float,
                       dv_max: torch.Tensor | float, v_diameter: torch.Tensor | float | None = None) -> torch.Tensor:
    """``‖o − ô‖ ≤ ‖α − α̂‖₁ · max_t ‖v_t‖ + max_t ‖v_t − v̂_t‖``; with ``v_diameter = max_{s,t} ‖v_s − v_t‖``
    the first term becomes ``½ ‖α − α̂‖₁ · v_diameter`` (never larger, since diam ≤ 2 max‖v‖)."""
    first = softmax_l1 * (v_norm_max if v_diameter is None else 0.5 * v_diameter)
    return torch.as_tensor(first + dv_max)


def attention_error_report(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_hat: torch.Tensor,
                           v_hat: torch.Tensor, scale: float, mask: Optional[torch.Tensor] = None) -> dict:
    """Observed errors and bounds for ``q (..., Tq, d)`` over ``k, k_hat (..., T, d)``, ``v, v_hat (..., T, d_v)``.

    ``mask (Tq, T)`` (True = visible; e.g. :func:`models.attention.causal_mask`). Returns per-query tensors
    ``(..., Tq)``: observed ``logit_err`` (ε), ``oscillation`` (δ), ``softmax_l1``, ``output_err`` and the bounds
    ``logit_bound`` (from ‖q‖ max ρ_k), ``softmax_bound`` (2 tanh(δ̄/4), δ̄ = 2·logit_bound), ``softmax_bound_observed``
    (2 tanh(δ/4) from the observed δ) and ``output_bound`` (from softmax_bound).
    """
    q, k, v, k_hat, v_hat = (x.double() for x in (q, k, v, k_hat, v_hat))
    logits, alpha, out = reference_attention(q, k, v, scale, mask)
    logits_hat, alpha_hat, out_hat = reference_attention(q, k_hat, v_hat, scale, mask)
    vis = torch.ones_like(logits, dtype=torch.bool) if mask is None else mask.expand_as(logits)
    rho_k = (k - k_hat).norm(dim=-1)[..., None, :].expand_as(logits)  # (..., Tq, T)
    rho_k = torch.where(vis, rho_k, torch.zeros_like(rho_k))
    v_norm = torch.where(vis, v.norm(dim=-1)[..., None, :].expand_as(logits), torch.zeros_like(logits)).amax(-1)
    dv = torch.where(vis, (v - v_hat).norm(dim=-1)[..., None, :].expand_as(logits), torch.zeros_like(logits)).amax(-1)
    eps_bound = logit_error_bound(q, rho_k.amax(-1), scale)
    sm_bound = softmax_l1_bound(2 * eps_bound)
    osc = logit_oscillation(logits, logits_hat)
    return {
        "logit_err": logit_error(logits, logits_hat), "oscillation": osc,
        "softmax_l1": (alpha - alpha_hat).abs().sum(-1), "output_err": output_error(out, out_hat),
        "logit_bound": eps_bound, "softmax_bound": sm_bound, "softmax_bound_observed": softmax_l1_bound(osc),
        "output_bound": output_error_bound(sm_bound, v_norm, dv),
    }
