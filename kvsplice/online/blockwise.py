"""Blockwise (online) softmax over chunks, FlashAttention-style, and attention over chunks with their own bases.

Per query the state is ``(m, Z, S)``: the running max of the logits seen so far, the partition
``Z = Σ_t exp(ℓ_t − m)`` and the weighted value sum ``S = Σ_t exp(ℓ_t − m) v_t``. Adding a chunk with local
``(m_j, Z_j, S_j)`` rescales both sides to the new max ``m' = max(m, m_j)``:
``Z' = e^{m − m'} Z + e^{m_j − m'} Z_j`` and the same for ``S``; ``finalize`` returns ``S / Z = Σ_t p_t v_t``.
This is exactly the softmax over the concatenated logits (up to rounding), for any logit magnitude.

* Everything is accumulated in float32 (float64 for float64 inputs), whatever the input dtype.
* ``-inf`` logits (masked keys) are safe: a chunk or a query that sees only ``-inf`` contributes nothing (no NaN);
  a query that sees no key at all finalises to 0 (plain softmax would give NaN). ``+inf``/NaN logits are not
  supported.

:func:`blockwise_attention` runs this over a list of :class:`Chunk`s, each with its own coefficient spaces: chunk
``j`` holds key coefficients ``a_t = k_t B_j`` and value coefficients ``b_t = v_t E_j``; its logits are
``scale · (q B_j) · a_t`` and its values are folded per chunk, ``(Σ_{t∈j} p_t b_t) E_jᵀ``. Chunks that share one
value basis object (e.g. a shared value basis) are accumulated together in coefficient space and reconstructed once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence

import torch

__all__ = ["Chunk", "SoftmaxState", "blockwise_attention", "chunk_state", "finalize", "init_state",
           "map_values", "merge", "update"]


class SoftmaxState(NamedTuple):
    """Online-softmax state per query: ``m (...)`` running max, ``z (...)`` partition, ``s (..., r)`` weighted sum."""

    m: torch.Tensor
    z: torch.Tensor
    s: torch.Tensor


def acc_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """float32, or float64 when any input is float64."""
    return torch.float64 if torch.float64 in dtypes else torch.float32


def init_state(shape: Sequence[int], r: int, *, device=None, dtype: torch.dtype = torch.float32) -> SoftmaxState:
    """The empty state for queries of shape ``shape`` and values of width ``r``: ``m = -inf``, ``Z = 0``, ``S = 0``."""
    shape = tuple(shape)
    return SoftmaxState(torch.full(shape, float("-inf"), device=device, dtype=dtype),
                        torch.zeros(shape, device=device, dtype=dtype),
                        torch.zeros(*shape, r, device=device, dtype=dtype))


def _safe(m: torch.Tensor) -> torch.Tensor:
    """``m`` with ``-inf`` replaced by 0, so ``x − m`` stays ``-inf`` (not NaN) when both are ``-inf``."""
    return torch.where(torch.isneginf(m), torch.zeros_like(m), m)


def chunk_state(logits: torch.Tensor, values: torch.Tensor) -> SoftmaxState:
    """The local state of one chunk of ``n`` keys. Two layouts:

    * attention layout: ``logits (..., Tq, n)``, ``values (..., n, r)`` shared by the ``Tq`` queries → state
      ``(..., Tq)``;
    * per-query values: ``logits (..., n)``, ``values (..., n, r)`` with one more dim than ``logits``.
    """
    dt = acc_dtype(logits.dtype, values.dtype)
    logits = logits.to(dt)
    m = logits.amax(-1) if logits.shape[-1] > 0 else torch.full(logits.shape[:-1], float("-inf"), dtype=dt,
                                                                  device=logits.device)
    p = torch.exp(logits - _safe(m)[..., None])  # (..., n) in [0, 1]; exp(-inf) = 0
    values = values.to(dt)
    if values.dim() == logits.dim() + 1:  # per-query values
        s = (p[..., None, :] @ values).squeeze(-2)
    elif values.dim() == logits.dim():  # attention layout
        s = p @ values
    else:
        raise ValueError(f"chunk_state: logits {tuple(logits.shape)} do not match values {tuple(values.shape)}")
    return SoftmaxState(m, p.sum(-1), s)


def merge(a: SoftmaxState, b: SoftmaxState) -> SoftmaxState:
    """Combine two states over disjoint key sets (same value space)."""
    m = torch.maximum(a.m, b.m)
    ms = _safe(m)
    ca, cb = torch.exp(a.m - ms), torch.exp(b.m - ms)  # exp(m_old − m_new) ∈ [0, 1]
    return SoftmaxState(m, ca * a.z + cb * b.z, ca[..., None] * a.s + cb[..., None] * b.s)


def update(state: SoftmaxState, logits: torch.Tensor, values: torch.Tensor) -> SoftmaxState:
    """``state`` plus a chunk of ``logits`` with ``values`` (either layout of :func:`chunk_state`)."""
    return merge(state, chunk_state(logits, values))


def map_values(state: SoftmaxState, fn) -> SoftmaxState:
    """Apply a linear map to the weighted sum (e.g. reconstruct ``S E_jᵀ``); exact, ``Σ p (b E_jᵀ) = (Σ p b) E_jᵀ``."""
    return SoftmaxState(state.m, state.z, fn(state.s))


def finalize(state: SoftmaxState) -> torch.Tensor:
    """``Σ_t p_t v_t = S / Z`` (``(..., r)``, accumulation dtype); 0 for queries that saw no (unmasked) key."""
    z = torch.where(state.z > 0, state.z, torch.ones_like(state.z))
    return state.s / z[..., None]


@dataclass
class Chunk:
    """One chunk of cached tokens in its own coefficient spaces.

    ``keys (..., n, r_k)``: key coefficients ``a = k B`` (or raw keys when ``key_basis`` is None);
    ``values (..., n, r_v)``: value coefficients ``b = v E`` (or raw values when ``value_basis`` is None);
    ``key_basis (..., d, r_k)`` and ``value_basis (..., d_v, r_v)``: the chunk's bases (None = identity);
    ``mask``: optional bool ``(..., Tq, n)`` (broadcastable), True where the query may see the key.
    """

    keys: torch.Tensor
    values: torch.Tensor
    key_basis: Optional[torch.Tensor] = None
    value_basis: Optional[torch.Tensor] = None
    mask: Optional[torch.Tensor] = None


def chunk_logits(q: torch.Tensor, chunk: Chunk, scale: float, dt: torch.dtype) -> torch.Tensor:
    """``scale · (q B_j) a_tᵀ`` with the chunk's mask applied: ``q (..., Tq, d)`` → ``(..., Tq, n)`` in ``dt``."""
    qt = q.to(dt)
    if chunk.key_basis is not None:
        qt = qt @ chunk.key_basis.to(dt)  # (..., Tq, r_k): the query in the chunk's key space, once per chunk
    logits = (qt @ chunk.keys.to(dt).transpose(-1, -2)) * scale  # (..., Tq, n)
    if chunk.mask is not None:
        logits = logits.masked_fill(~chunk.mask, float("-inf"))
    return logits


def blockwise_attention(q: torch.Tensor, chunks: Sequence[Chunk], *, scale: float,
                        out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Softmax attention of ``q (..., Tq, d)`` over the concatenation of ``chunks`` → ``(..., Tq, d_v)``.

    Equal to ``softmax(cat_j logits_j) @ cat_j V̂_j`` with ``V̂_j = b_j E_jᵀ``, computed one chunk at a time with
    the online softmax in float32 (float64 for float64 inputs). A value basis object shared by several chunks is
    reconstructed once (its chunks accumulate in coefficient space); any other chunk's weighted coefficient sum is
    reconstructed into ``d_v`` space right away. ``out_dtype`` defaults to ``q.dtype``.
    """
    if not chunks:
        raise ValueError("blockwise_attention needs at least one chunk")
    dt = acc_dtype(q.dtype, *(c.keys.dtype for c in chunks))
    counts: dict[int, int] = {}
    for c in chunks:
        if c.value_basis is not None:
            counts[id(c.value_basis)] = counts.get(id(c.value_basis), 0) + 1
    dense: Optional[SoftmaxState] = None  # accumulated in d_v space
    shared: dict[int, tuple[torch.Tensor, SoftmaxState]] = {}  # value basis id -> (basis, state in its space)
    for c in chunks:
        st = chunk_state(chunk_logits(q, c, scale, dt), c.values)
        if c.value_basis is not None and counts[id(c.value_basis)] > 1:
            key = id(c.value_basis)
            shared[key] = (c.value_basis, st if key not in shared else merge(shared[key][1], st))
            continue
        if c.value_basis is not None:
            # S (..., Tq, r_v) → (..., Tq, d_v)
            st = map_values(st, lambda s, e=c.value_basis: s @ e.to(dt).transpose(-1, -2))
        dense = st if dense is None else merge(dense, st)
    for basis, st in shared.values():
        st = map_values(st, lambda s, e=basis: s @ e.to(dt).transpose(-1, -2))  # S (..., Tq, r_v) → (..., Tq, d_v)
        dense = st if dense is None else merge(dense, st)
    return finalize(dense).to(out_dtype or q.dtype)
