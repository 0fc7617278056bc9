"""The amortised merge of a :class:`~kvsplice.online.chunked.ChunkedCache` stream (rule 5 of its online rule).

Old tokens are never re-projected, except here: with ``max_chunks = J_max``, when the number of closed non-warm-up
chunks exceeds ``J_max``, the oldest ``⌊J_max/2⌋ + 2`` of them are re-projected onto the current sketch bases
(``a* = (a_j B_jᵀ) B*``) and become one chunk, leaving ``⌈J_max/2⌉``. The warm-up chunk is never merged (it stays
exact). The merged chunk's residual maxima stay upper bounds: ``‖k − P* k̂‖ ≤ ‖k − k̂‖ + ‖k̂ − P* k̂‖``.
"""

from __future__ import annotations

from typing import Optional

import torch

from kvsplice.online.chunks import StoredChunk

__all__ = ["merge_chunks", "oldest_to_merge"]


def oldest_to_merge(closed: list[StoredChunk], max_chunks: int) -> Optional[slice]:
    """The closed chunks to merge into one (the oldest ``⌊J_max/2⌋ + 2`` after the warm-up chunk), or None while at
    most ``max_chunks`` non-warm-up chunks are closed."""
    first = 1 if closed and closed[0].warmup else 0
    if len(closed) - first <= max_chunks:
        return None
    return slice(first, first + max_chunks // 2 + 2)


def _reproject(coef: torch.Tensor, basis: torch.Tensor, new_basis: torch.Tensor, res: torch.Tensor,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Coefficients ``(*bs, n, r)`` on ``new_basis`` of the approximation ``coef basisᵀ``, and the residual bound."""
    x = coef.float() @ basis.float().transpose(-1, -2)  # (*bs, n, d): the stored approximation, rebuilt
    c = x @ new_basis.float()
    extra = (x - c @ new_basis.float().transpose(-1, -2)).norm(dim=-1).amax(-1)  # (*bs,): max over the chunk's tokens
    return c.to(dtype), res + extra


def merge_chunks(old: list[StoredChunk], bk: torch.Tensor, be: torch.Tensor, dtype: torch.dtype) -> StoredChunk:
    """One chunk holding the tokens of ``old`` (consecutive, in order) on the bases ``bk (*bs, d, r_k)``,
    ``be (*bs, d_v, r_v)``; a chunk already on ``be`` (a shared value basis) keeps its value coefficients."""
    parts_a, parts_b, res_k, res_v = [], [], [], []
    for c in old:
        a, rk = _reproject(c.a, c.bk, bk, c.res_k, dtype)
        b, rv = (c.b, c.res_v) if c.be is be else _reproject(c.b, c.be, be, c.res_v, dtype)
        parts_a.append(a), parts_b.append(b), res_k.append(rk), res_v.append(rv)
    return StoredChunk(torch.cat(parts_a, -2), torch.cat(parts_b, -2), bk, be, old[0].start,
                       torch.stack(res_k).amax(0), torch.stack(res_v).amax(0))
