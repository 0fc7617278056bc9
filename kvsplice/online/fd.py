"""Frequent Directions: a deterministic streaming sketch of the rows seen so far (Liberty 2013; Ghashami et al. 2016).

The sketch ``S`` has ``2ℓ`` rows of dimension ``d``. Incoming rows fill its zero rows; when it is full,
``U, σ, Vᵀ = svd(S)``, ``δ = σ_ℓ²`` (the ℓ-th largest, 1-based: ``σ[ℓ-1]``) and ``S ← diag(sqrt(max(σ² − δ, 0))) Vᵀ``,
so the ℓ-th row on (1-based) become zero and at least ``ℓ + 1`` rows are free again (``σ_ℓ = 0`` when ``ℓ > d``:
then nothing shrinks and the sketch is exact). With ``A`` the stream so far and ``Δ = Σ δ`` over all shrinks:

* ``0 ≤ ‖Ax‖² − ‖Sx‖² ≤ Δ`` for every unit ``x``, i.e. ``0 ⪯ AᵀA − SᵀS`` and ``‖AᵀA − SᵀS‖₂ ≤ Δ``;
* ``Δ ≤ (‖A‖_F² − ‖S‖_F²)/ℓ ≤ ‖A − A_k‖_F² / (ℓ − k)`` for every ``k < ℓ``;
* with ``V_r`` the top-``r`` right singular vectors of ``S`` (:meth:`FrequentDirections.basis`), the projection
  residual of the whole stream is ``‖A − A V_r V_rᵀ‖_F² ≤ ‖A‖_F² − ‖S_r‖_F²`` (computable:
  :meth:`FrequentDirections.residual_bound`) ``≤ ‖A − A_r‖_F² + rΔ``.

With ``decay = γ < 1`` the sketch forgets: it tracks the decayed stream whose row ``s`` weighs ``γ^{(t−s)/2}`` at
time ``t`` (so ``AᵀA = Σ_s γ^{t−s} a_s a_sᵀ``); the sketch, ``‖A‖_F²`` and ``Δ`` are all decayed by ``γ`` per row,
and the guarantees above hold for that decayed ``A`` (scaling commutes with the shrink: ``shrink(cS) = c·shrink(S)``
with ``δ → c²δ``). This lets bases seeded from the sketch follow a drifting subspace.

Everything is batched over a leading ``batch_shape`` (e.g. layers × KV heads: the sketch is ``(*batch, 2ℓ, d)``);
every batch item receives the same number of rows per :meth:`~FrequentDirections.update`, so they fill and shrink
in lockstep, and a batched sketch equals a loop of per-item sketches. The SVD runs in float32 (float64 when the
sketch is float64) on whatever device the sketch lives on.
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["FrequentDirections", "best_rank_k_residual", "fd_bound"]


def best_rank_k_residual(a: torch.Tensor, k: int) -> torch.Tensor:
    """``‖A − A_k‖_F² = Σ_{i>k} σ_i(A)²`` of ``a (..., n, d)`` → ``(...,)`` float64 (a reference, for tests/reports)."""
    s = torch.linalg.svdvals(a.double())
    return (s[..., k:] ** 2).sum(-1)


def fd_bound(tail_energy: torch.Tensor | float, k: int, ell: int) -> torch.Tensor | float:
    """The a-priori FD bound ``‖A − A_k‖_F² / (ℓ − k)`` on ``‖AᵀA − SᵀS‖₂`` (needs ``k < ℓ``)."""
    if not 0 <= k < ell:
        raise ValueError(f"the FD bound needs 0 <= k < ell, got k={k}, ell={ell}")
    return tail_energy / (ell - k)


class FrequentDirections:
    """A batch of Frequent Directions sketches ``(*batch_shape, 2ℓ, dim)``.

    ``update(rows)`` takes ``rows (*batch_shape, n, dim)`` (any dtype) and inserts them ``free`` rows at a time,
    shrinking whenever the buffer is full; ``sketch`` is the non-zero part, ``basis(r)`` the top-``r`` right singular
    vectors ``(*batch_shape, dim, r)``. ``total_energy`` tracks ``‖A‖_F²`` and ``shrinkage`` ``Δ = Σ δ`` (both
    float64, ``(*batch_shape,)``).
    """

    def __init__(self, ell: int, dim: int, batch_shape: Sequence[int] = (), *,
                 device: torch.device | str | None = None, dtype: torch.dtype = torch.float32,
                 decay: float = 1.0) -> None:
        if ell < 1 or dim < 1:
            raise ValueError(f"FrequentDirections needs ell >= 1 and dim >= 1, got ell={ell}, dim={dim}")
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self.decay = float(decay)
        if not dtype.is_floating_point:
            raise ValueError(f"the sketch dtype must be floating point, got {dtype}")
        self.ell, self.dim = int(ell), int(dim)
        self.batch_shape = tuple(int(b) for b in batch_shape)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        # fp16/bf16 sketches would lose the small directions; keep at least float32 (the sketch is tiny).
        self.dtype = torch.promote_types(dtype, torch.float32)
        self.buffer = torch.zeros(*self.batch_shape, 2 * self.ell, self.dim, dtype=self.dtype, device=self.device)
        self.reset()

    # ------------------------------------------------------------------------------------------------- state
    def reset(self) -> None:
        self.buffer.zero_()
        self.filled = 0  # rows 0..filled-1 may be non-zero; the rest are zero
        self.n_rows = 0  # rows seen per batch item
        self.n_shrinks = 0
        self.total_energy = torch.zeros(self.batch_shape, dtype=torch.float64, device=self.device)
        self.shrinkage = torch.zeros(self.batch_shape, dtype=torch.float64, device=self.device)

    @property
    def sketch(self) -> torch.Tensor:
        """The possibly non-zero rows ``(*batch, filled, d)``: at most ``2ℓ − 1`` rows, at most ``ℓ − 1`` right
        after a shrink. ``SᵀS`` of this equals that of the full buffer."""
        return self.buffer[..., : self.filled, :]

    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    # ------------------------------------------------------------------------------------------------ update
    def update(self, rows: torch.Tensor) -> "FrequentDirections":
        """Feed ``rows (*batch_shape, n, dim)``; returns self."""
        if tuple(rows.shape[:-2]) != self.batch_shape or rows.shape[-1] != self.dim:
            raise ValueError(f"rows must be (*{self.batch_shape}, n, {self.dim}), got {tuple(rows.shape)}")
        rows = rows.to(device=self.device, dtype=self.dtype)
        n = rows.shape[-2]
        if n == 0:
            return self
        if self.decay < 1.0:
            # Decay everything to the end of this chunk at once: the sketch by γ^{n/2}, row i by γ^{(n-1-i)/2}.
            # Equivalent to decaying row by row because scaling commutes with the shrink.
            g = self.decay
            self.buffer *= g ** (n / 2)
            self.total_energy *= g**n
            self.shrinkage *= g**n
            w = g ** ((n - 1 - torch.arange(n, device=self.device, dtype=torch.float64)) / 2)
            rows = rows * w.to(self.dtype)[:, None]
        self.total_energy += rows.double().pow(2).sum((-2, -1))
        self.n_rows += n
        i, cap = 0, 2 * self.ell
        while i < n:
            take = min(cap - self.filled, n - i)
            self.buffer[..., self.filled : self.filled + take, :] = rows[..., i : i + take, :]
            self.filled += take
            i += take
            if self.filled == cap:
                self._shrink()
        return self

    def _shrink(self) -> None:
        _, s, vh = torch.linalg.svd(self.buffer, full_matrices=False)  # s (*b, m), vh (*b, m, d), m = min(2ℓ, d)
        m = s.shape[-1]
        delta = s[..., self.ell - 1] ** 2 if self.ell <= m else torch.zeros_like(s[..., 0])
        s_new = (s**2 - delta[..., None]).clamp_min(0).sqrt()  # zero from index ℓ-1 on (σ sorted descending)
        keep = min(self.ell - 1, m)
        self.buffer.zero_()
        self.buffer[..., :keep, :] = s_new[..., :keep, None] * vh[..., :keep, :]
        self.filled = keep
        self.shrinkage += delta.double()
        self.n_shrinks += 1

    # ----------------------------------------------------------------------------------------------- queries
    def singular_values(self) -> torch.Tensor:
        """Singular values of the sketch ``(*batch, min(2ℓ, d))``, descending (zeros past the filled rows)."""
        return torch.linalg.svdvals(self.buffer)

    def basis(self, r: int) -> torch.Tensor:
        """Top-``r`` right singular vectors of the sketch, orthonormal columns ``(*batch, dim, r)``, ``1 ≤ r ≤ dim``.

        Directions past the sketch's rank (early in a stream) are arbitrary but still orthonormal.
        """
        if not 1 <= r <= self.dim:
            raise ValueError(f"basis rank must be in [1, {self.dim}], got {r}")
        full = r > min(2 * self.ell, self.dim)
        _, _, vh = torch.linalg.svd(self.buffer, full_matrices=full)
        return vh[..., :r, :].transpose(-1, -2).contiguous()  # (*batch, dim, r)

    def residual_bound(self, r: int) -> torch.Tensor:
        """``‖A‖_F² − ‖S_r‖_F²`` ≥ ``‖A − A V_r V_rᵀ‖_F²``: the squared residual of every row seen so far projected on
        :meth:`basis` ``(r)`` (``‖AV_r‖_F² ≥ ‖SV_r‖_F² = ‖S_r‖_F²``). It is also ``≤ ‖A − A_r‖_F² + rΔ``."""
        s = self.singular_values().double()
        return (self.total_energy - (s[..., :r] ** 2).sum(-1)).clamp_min(0)

    def tail_energy_bounds(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Bounds ``(lo, hi)`` on the unknown ``‖A − A_k‖_F²`` from the sketch: ``hi = ‖A‖_F² − ‖S_k‖_F²`` and
        ``lo = hi − kΔ`` (since ``‖S_k‖_F² ≤ ‖A_k‖_F² ≤ ‖S_k‖_F² + kΔ``)."""
        hi = self.residual_bound(k)
        return (hi - k * self.shrinkage).clamp_min(0), hi

    def __repr__(self) -> str:
        return (f"FrequentDirections(ell={self.ell}, dim={self.dim}, batch_shape={self.batch_shape}, "
                f"rows={self.n_rows}, shrinks={self.n_shrinks})")
