"""The self-balancing walk of BalanceKV in kernel feature space: kernels, the walk, :func:`softmax_balance`.

See :mod:`kvsplice.select.balance` for the method; this module is its signing step (Alweiss–Liu–Sawhney run
implicitly on ``κ((k,v),(k',v')) = exp(⟨k,k'⟩·s)·(⟨v,v'⟩ + λ)``) and the thresholds it uses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

ON_FAIL = ("clamp", "restart", "raise")
THRESHOLDS = ("paper", "median")


class WalkFailure(RuntimeError):
    """The self-balancing walk crossed its threshold (``|⟨r, φ(x_i)⟩| > c``) and ``on_fail='raise'``."""


# ----------------------------------------------------------------------------------------------- kernels
def kernel_rows(k: torch.Tensor, v: Optional[torch.Tensor], scale: float, value_offset: float | torch.Tensor,
                a: int, b: int) -> torch.Tensor:
    """``κ(x_i, x_j)`` for ``i ∈ [a, b)``, ``j ∈ [0, b)``: ``(..., b-a, b)``.

    ``κ = exp(⟨k_i,k_j⟩·scale) · (⟨v_i,v_j⟩ + value_offset)``; ``v=None`` is the plain exponential kernel.
    ``value_offset`` may be a tensor broadcasting over the leading dims (one λ per instance).
    """
    g = torch.exp((k[..., a:b, :] @ k[..., :b, :].transpose(-1, -2)) * scale)  # (..., b-a, b)
    if v is None:
        return g
    off = value_offset if not torch.is_tensor(value_offset) else value_offset[..., None, None]
    return g * ((v[..., a:b, :] @ v[..., :b, :].transpose(-1, -2)) + off)  # (..., b-a, b)


def kernel_diag(k: torch.Tensor, v: Optional[torch.Tensor], scale: float,
                value_offset: float | torch.Tensor) -> torch.Tensor:
    """``κ(x_i, x_i) = ‖φ(x_i)‖²``: ``(..., n)``."""
    g = torch.exp(k.pow(2).sum(-1) * scale)
    if v is None:
        return g
    off = value_offset if not torch.is_tensor(value_offset) else value_offset[..., None]
    return g * (v.pow(2).sum(-1) + off)


def discrepancy(k: torch.Tensor, v: Optional[torch.Tensor], signs: torch.Tensor, *, scale: Optional[float] = None,
                value_offset: float = 0.0, chunk: int = 1024) -> torch.Tensor:
    """``‖Σ_i ε_i φ(x_i)‖ = sqrt(εᵀ G ε)`` computed through the kernel (never materialising ``G`` whole).

    k (..., n, d), v (..., n, dv) or None, signs (..., n) (any real coefficients) → (...,).
    """
    scale = 1.0 / math.sqrt(k.shape[-1]) if scale is None else scale
    k = k.double()
    v = v.double() if v is not None else None
    e = signs.double()
    n = k.shape[-2]
    total = torch.zeros(e.shape[:-1], dtype=torch.float64, device=k.device)
    for a in range(0, n, chunk):
        b = min(n, a + chunk)
        g = torch.exp((k[..., a:b, :] @ k.transpose(-1, -2)) * scale)  # (..., b-a, n)
        if v is not None:
            g = g * ((v[..., a:b, :] @ v.transpose(-1, -2)) + value_offset)  # (..., b-a, n)
        total = total + (e[..., a:b, None] * g * e[..., None, :]).sum((-1, -2))
    return total.clamp_min(0).sqrt()


# ------------------------------------------------------------------------------------------------ the walk
def uniform_draws(shape: Sequence[int], generator: Optional[torch.Generator], dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
    """Uniform draws from ``generator`` (a CPU generator works for any device: drawn on its device, then moved)."""
    gdev = generator.device if generator is not None else torch.device("cpu")
    return torch.rand(*shape, generator=generator, dtype=dtype, device=gdev).to(device)


def balancing_walk(rows: Callable[[int, int], torch.Tensor], n: int, batch_shape: Sequence[int],
                   c: torch.Tensor, *, generator: Optional[torch.Generator] = None, exact_half: bool = False,
                   chunk: int = 256, dtype: torch.dtype = torch.float64,
                   device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """The self-balancing walk over ``n`` points, batched over independent instances ``batch_shape``.

    ``rows(a, b)`` returns ``κ(x_i, x_j)`` for ``i ∈ [a, b)``, ``j < b`` as ``(*batch, b-a, b)``; ``c`` (*batch) is
    the threshold. Point ``i`` gets ``+1`` with probability ``clamp(1/2 − ⟨r, φ(x_i)⟩/(2c), 0, 1)`` where
    ``⟨r, φ(x_i)⟩ = Σ_{j<i} ε_j κ(x_j, x_i)``. With ``exact_half`` (n even) a side that already holds ``n/2``
    points takes no more (the rest are forced to the other side), so both halves have exactly ``n/2`` points.

    Returns ``signs`` (*batch, n) in {±1} and ``crossings`` (*batch) — how many steps had ``|⟨r,φ⟩| > c`` (the
    paper's failure event; 0 means the walk succeeded).
    """
    device = torch.device(device)
    signs = torch.zeros(*batch_shape, n, dtype=dtype, device=device)
    u = uniform_draws((*batch_shape, n), generator, dtype, device)
    crossings = torch.zeros(tuple(batch_shape), dtype=torch.long, device=device)
    c = c.to(dtype=dtype, device=device)
    half = n // 2
    n_plus = torch.zeros(tuple(batch_shape), dtype=torch.long, device=device)
    one = torch.ones((), dtype=dtype, device=device)
    for a in range(0, n, chunk):
        b = min(n, a + chunk)
        r = rows(a, b).to(dtype)  # (*batch, b-a, b)
        for i in range(a, b):
            inner = (r[..., i - a, :i] * signs[..., :i]).sum(-1)  # ⟨r, φ(x_i)⟩, (*batch)
            crossings += inner.abs() > c
            p_plus = (0.5 - inner / (2 * c)).clamp(0.0, 1.0)
            s = torch.where(u[..., i] < p_plus, one, -one)
            if exact_half:
                n_minus = i - n_plus
                s = torch.where(n_plus >= half, -one, torch.where(n_minus >= half, one, s))
                n_plus += s > 0
            signs[..., i] = s
    return signs, crossings


@dataclass
class WalkResult:
    """Output of :func:`softmax_balance` for ``(..., n)`` points."""

    signs: torch.Tensor  # (..., n) in {±1}
    keep: torch.Tensor  # (..., n) bool: the smaller signed half (ties: the −1 side)
    c: torch.Tensor  # (...,) thresholds used
    crossings: torch.Tensor  # (...,) threshold crossings of the final run (0 = the walk succeeded)
    restarts: int = 0

    @property
    def failed(self) -> torch.Tensor:
        return self.crossings > 0

    def indices(self) -> torch.Tensor | list[torch.Tensor]:
        """Kept indices: a 1-D tensor for one instance, else a list (halves differ in size across instances)."""
        if self.keep.dim() == 1:
            return self.keep.nonzero().squeeze(-1)
        flat = self.keep.reshape(-1, self.keep.shape[-1])  # (∏batch, n): one row per instance
        return [row.nonzero().squeeze(-1) for row in flat]


def walk_threshold(diag: torch.Tensor, n: int, *, threshold: str = "paper", delta: float = 0.01,
                   c_factor: float = 30.0, c_scale: float = 1.0) -> torch.Tensor:
    """The walk's ``c`` per instance from the diagonal ``κ(x_i,x_i)`` (..., n).

    ``paper``: ``c_factor · log(n/δ) · max_i κ(x_i,x_i)`` (the analysis' constant; ``c_factor = 30``).
    ``median``: ``c_scale · median_i κ(x_i,x_i)`` (the practical one).
    """
    if threshold == "paper":
        return c_factor * math.log(max(n, 2) / delta) * diag.amax(-1)
    if threshold == "median":
        return c_scale * diag.median(-1).values
    raise ValueError(f"threshold must be one of {THRESHOLDS}, got {threshold!r}")


def softmax_balance(k: torch.Tensor, v: Optional[torch.Tensor] = None, *, scale: Optional[float] = None,
                    c: Optional[float | torch.Tensor] = None, threshold: str = "paper", delta: float = 0.01,
                    c_factor: float = 30.0, c_scale: float = 1.0, value_offset: float = 0.0,
                    center: bool = False, on_fail: str = "restart", max_restarts: int = 3,
                    exact_half: bool = False, generator: Optional[torch.Generator] = None,
                    chunk: int = 256, dtype: torch.dtype = torch.float64) -> WalkResult:
    """SoftmaxBalance: a balanced signing of the points ``φ(k_i) ⊗ v_i`` (or ``φ(k_i)`` when ``v is None``).

    k (..., n, d), v (..., n, dv) or None; leading dims are independent instances (heads), walked in lockstep.
    ``c`` overrides the threshold rule (see :func:`walk_threshold`). ``center`` subtracts the instance's mean key
    first (softmax is shift-invariant: ``φ(k−μ)`` at any query is ``φ(k)`` times a per-query constant).
    ``on_fail``: ``"clamp"`` keeps the clamped (greedy) step; ``"restart"`` re-runs the instances that crossed
    the threshold with fresh randomness up to ``max_restarts`` times, then keeps the clamped result;
    ``"raise"`` raises :class:`WalkFailure` after the restarts.
    """
    if on_fail not in ON_FAIL:
        raise ValueError(f"on_fail must be one of {ON_FAIL}, got {on_fail!r}")
    n, d = k.shape[-2], k.shape[-1]
    batch = tuple(k.shape[:-2])
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    kk = k.to(dtype)
    if center:
        kk = kk - kk.mean(-2, keepdim=True)
    vv = v.to(dtype) if v is not None else None
    if c is None:
        c_t = walk_threshold(kernel_diag(kk, vv, scale, value_offset), n, threshold=threshold, delta=delta,
                             c_factor=c_factor, c_scale=c_scale)
    else:
        c_t = torch.as_tensor(c, dtype=dtype, device=k.device).expand(batch).clone()
    c_t = c_t.clamp_min(torch.finfo(dtype).tiny)

    def rows(a: int, b: int) -> torch.Tensor:
        return kernel_rows(kk, vv, scale, value_offset, a, b)

    signs, crossings = balancing_walk(rows, n, batch, c_t, generator=generator, exact_half=exact_half,
                                      chunk=chunk, dtype=dtype, device=k.device)
    restarts = 0
    while on_fail != "clamp" and bool((crossings > 0).any()) and restarts < max_restarts:
        restarts += 1
        s2, c2 = balancing_walk(rows, n, batch, c_t, generator=generator, exact_half=exact_half, chunk=chunk,
                                dtype=dtype, device=k.device)
        redo = crossings > 0
        signs = torch.where(redo[..., None], s2, signs)
        crossings = torch.where(redo, c2, crossings)
    if on_fail == "raise" and bool((crossings > 0).any()):
        raise WalkFailure(f"self-balancing walk crossed its threshold after {restarts} restarts "
                          f"(crossings per instance: {crossings.tolist()})")
    n_plus = (signs > 0).sum(-1, keepdim=True)
    keep_sign = torch.where(n_plus < n - n_plus, 1.0, -1.0).to(signs)
    return WalkResult(signs=signs, keep=signs == keep_sign, c=c_t, crossings=crossings, restarts=restarts)
