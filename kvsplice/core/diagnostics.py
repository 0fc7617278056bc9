"""The attention-error diagnostics of approximate attention: observed errors next to their bounds, for any method that
yields approximate keys/values (online FD chunks, global low-rank bases).

Per layer, with exact ``q, k, v`` and approximate ``k̂, v̂`` (causal): the observed logit error
``ε = ‖ℓ − ℓ̂‖∞``, softmax L1 error ``‖α − α̂‖₁`` and head-output error ``‖o − ô‖`` next to their bounds
(:mod:`kvsplice.core.bounds`): ``ε ≤ s‖q‖ max_t ‖k_t − k̂_t‖``; ``‖α − α̂‖₁ ≤ 2 tanh(δ̄/4)`` (tight)
``≤ 2 sinh(δ̄/2)`` with ``δ̄ = 2 × logit bound``; ``‖o − ô‖ ≤ ‖α − α̂‖₁ max‖v‖ + max‖v − v̂‖``. Reported as the max
over queries, heads and sequences, plus the *slack* ``bound / observed``.

Users: :meth:`kvsplice.online.method.OnlineDecoder.diagnose` (in-run), :func:`kvsplice.online.diagnostics.online_qkv_diagnostics`
(teacher-forced), :func:`kvsplice.lowrank.diagnostics.bases_diagnostics` (global bases).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from kvsplice.core.attention import reference_attention
from kvsplice.core.bounds import logit_error_bound, logit_oscillation, output_error_bound, softmax_l1_bound
from models.attention import causal_mask

__all__ = ["attention_diagnostics", "format_diagnostics"]


def _cummax(x: torch.Tensor) -> torch.Tensor:
    return torch.cummax(x, dim=-1).values


def attention_diagnostics(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_hat: torch.Tensor,
                          v_hat: torch.Tensor, scale: float, *, causal: bool = True,
                          key_residual_recorded: Optional[torch.Tensor] = None,
                          value_residual_recorded: Optional[torch.Tensor] = None,
                          out_hat: Optional[torch.Tensor] = None, rel_floor: float = 1e-6) -> dict:
    """Observed errors vs bounds for one layer → a dict of floats (max over queries, heads and sequences).

    ``q (B, Hq, Tq, d)``; ``k, k_hat (B, Hkv, T, d)``; ``v, v_hat (B, Hkv, T, d_v)``; query head ``h`` reads KV
    head ``h // (Hq/Hkv)``; ``causal``: query ``i`` sits at position ``T − Tq + i``. Computed in float64.
    ``key_residual_recorded`` / ``value_residual_recorded`` ``(B, Hkv)``: a cache's own residual maxima, reported
    (and used for a second, a-priori logit bound ``logit_bound_recorded``). ``out_hat (B, Hq, Tq, d_v)``: an
    approximate output computed elsewhere (e.g. the decoder's), compared with ``softmax(ℓ̂) v̂``.

    Keys: ``logit_err``, ``logit_bound`` (``s‖q‖ max_{t≤i} ρ_k(t)``), ``softmax_l1``, ``softmax_bound``
    (``2 tanh(δ̄/4)``), ``softmax_bound_sinh`` (``2 sinh(δ̄/2)``), ``softmax_bound_obs`` / ``…_sinh_obs`` (from
    the observed oscillation ``δ``), ``output_err``, ``output_bound`` / ``output_bound_sinh``; ``*_slack`` =
    max bound / max observed; ``*_tightest`` = min over queries of bound / observed (queries whose observed error
    is below ``rel_floor`` × its max are skipped); ``holds`` (every bound ≥ observed for every query, to 1e-9
    relative); ``rel_output_err`` = ``(Σ‖o − ô‖² / Σ‖o‖²)^½``; ``rel_logit_err`` = ``max ε / max |ℓ|``;
    ``key_residual``, ``value_residual`` (max observed ρ), ``v_norm``.
    """
    b, hq, tq, d = q.shape
    hkv, t = k.shape[1], k.shape[2]
    if hq % hkv or k.shape != k_hat.shape or v.shape != v_hat.shape or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"shapes do not fit: q {tuple(q.shape)}, k {tuple(k.shape)}, k_hat {tuple(k_hat.shape)}, "
                         f"v {tuple(v.shape)}, v_hat {tuple(v_hat.shape)}")
    g = hq // hkv
    q5 = q.double().reshape(b, hkv, g, tq, d)  # (B, Hkv, g, Tq, d): the g query heads of each KV head
    k, k_hat, v, v_hat = (x.double()[:, :, None] for x in (k, k_hat, v, v_hat))  # (B, Hkv, 1, T, ·)
    mask = causal_mask(tq, t, q.device) if causal else None
    logits, alpha, o = reference_attention(q5, k, v, scale, mask)  # (B, Hkv, g, Tq, T), ..., (B, Hkv, g, Tq, d_v)
    logits_hat, alpha_hat, o_hat = reference_attention(q5, k_hat, v_hat, scale, mask)

    # per-token residuals and value norms, then the max over the keys each query sees
    rho_k = (k - k_hat).norm(dim=-1)  # (B, Hkv, 1, T)
    rho_v = (v - v_hat).norm(dim=-1)
    v_norm = v.norm(dim=-1)
    pos = torch.arange(t - tq, t, device=q.device) if causal else torch.full((tq,), t - 1, device=q.device)

    def seen_max(x: torch.Tensor) -> torch.Tensor:  # (B, Hkv, 1, T) → (B, Hkv, 1, Tq)
        return _cummax(x)[..., pos]

    vis = torch.isfinite(logits)
    err = torch.where(vis, (logits - logits_hat).abs(), torch.zeros_like(logits)).amax(-1)  # ε (B, Hkv, g, Tq)
    osc = logit_oscillation(logits, logits_hat)
    l1 = (alpha - alpha_hat).abs().sum(-1)
    oerr = (o - o_hat).norm(dim=-1)
    eps_b = logit_error_bound(q5, seen_max(rho_k), scale)
    vmax, dvmax = seen_max(v_norm), seen_max(rho_v)
    sm_b, sm_bs = softmax_l1_bound(2 * eps_b), softmax_l1_bound(2 * eps_b, kind="sinh")
    sm_o, sm_os = softmax_l1_bound(osc), softmax_l1_bound(osc, kind="sinh")
    out_b, out_bs = output_error_bound(sm_b, vmax, dvmax), output_error_bound(sm_bs, vmax, dvmax)

    def mx(x: torch.Tensor) -> float:
        return float(x.max()) if x.numel() else 0.0

    def slack(bound: torch.Tensor, obs: torch.Tensor) -> float:
        return mx(bound) / mx(obs) if mx(obs) > 0 else math.inf

    def tightest(bound: torch.Tensor, obs: torch.Tensor) -> float:
        sel = obs > rel_floor * mx(obs)
        return float((bound[sel] / obs[sel]).min()) if mx(obs) > 0 and bool(sel.any()) else math.inf

    pairs = {"logit": (eps_b, err), "softmax": (sm_b, l1), "softmax_sinh": (sm_bs, l1),
             "softmax_obs": (sm_o, l1), "output": (out_b, oerr), "output_sinh": (out_bs, oerr)}
    tol = 1e-9
    holds = all(bool((obs <= bound * (1 + tol) + tol * (1 + mx(obs))).all()) for bound, obs in pairs.values())
    ref = torch.where(vis, logits.abs(), torch.zeros_like(logits))
    rep = {
        "logit_err": mx(err), "logit_bound": mx(eps_b), "rel_logit_err": mx(err) / max(mx(ref), 1e-300),
        "oscillation": mx(osc),
        "softmax_l1": mx(l1), "softmax_bound": mx(sm_b), "softmax_bound_sinh": mx(sm_bs),
        "softmax_bound_obs": mx(sm_o), "softmax_bound_sinh_obs": mx(sm_os),
        "output_err": mx(oerr), "output_bound": mx(out_b), "output_bound_sinh": mx(out_bs),
        "rel_output_err": math.sqrt(float(((o - o_hat) ** 2).sum()) / max(float((o**2).sum()), 1e-300)),
        "key_residual": mx(rho_k), "value_residual": mx(rho_v), "v_norm": mx(v_norm), "holds": holds,
    }
    for name, (bound, obs) in pairs.items():
        rep[f"{name}_slack"] = slack(bound, obs)
        rep[f"{name}_tightest"] = tightest(bound, obs)
    if key_residual_recorded is not None:
        rk = key_residual_recorded.double().reshape(b, hkv, 1, 1)  # (B, Hkv, 1, 1)
        rep["key_residual_recorded"] = mx(rk)
        rec_b = logit_error_bound(q5, rk, scale)  # a-priori: from the cache's own residual maxima
        rep["logit_bound_recorded"] = mx(rec_b)
        # the recorded maxima are exact up to float32 rounding of the stored numbers
        rep["holds_recorded"] = bool((err <= rec_b + 1e-5 * (1 + mx(err))).all())
    if value_residual_recorded is not None:
        rep["value_residual_recorded"] = mx(value_residual_recorded.double())
    if out_hat is not None:
        oh = out_hat.double().reshape(b, hkv, g, tq, -1)  # (B, Hkv, g, Tq, d_v)
        rep["attend_matches"] = mx((oh - o_hat).abs())
    return rep


_COLS = [("logit_err", "ε obs"), ("logit_bound", "ε bound"), ("softmax_l1", "‖Δα‖₁ obs"),
         ("softmax_bound", "2tanh(δ̄/4)"), ("softmax_bound_sinh", "2sinh(δ̄/2)"), ("softmax_bound_obs", "2tanh(δ/4)"),
         ("output_err", "‖Δo‖ obs"), ("output_bound", "‖Δo‖ bound"), ("logit_tightest", "slack ε"),
         ("softmax_obs_tightest", "slack α(δ)"), ("output_tightest", "slack o"), ("holds", "holds")]


def format_diagnostics(diag: list[dict], title: str = "") -> str:
    """A markdown table of per-layer diagnostics (max over queries/heads; slack = tightest bound/observed)."""

    def fmt(x) -> str:
        if isinstance(x, bool):
            return "yes" if x else "NO"
        if x is None:
            return "—"
        return "inf" if x == math.inf else f"{x:.3g}"

    extra = [c for c in (("chunks_max", "J max"), ("fd_residual_k", "FD res k"),
                         ("fd_residual_bound_k", "FD bound k")) if any(c[0] in d for d in diag)]
    cols = _COLS + extra
    lines = [f"**{title}**", ""] if title else []
    lines.append("| layer | " + " | ".join(h for _, h in cols) + " |")
    lines.append("|---" * (len(cols) + 1) + "|")
    for l, d in enumerate(diag):
        lines.append(f"| {l} | " + " | ".join(fmt(d.get(k)) for k, _ in cols) + " |")
    return "\n".join(lines)
