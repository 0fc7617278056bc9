"""``to-mla --ratio N``: the latent and RoPE widths of a cache ``N`` times smaller than the source's K/V, chosen by
measurement.

A converted layer caches ``R`` latent numbers and one shared RoPE key of ``Dr`` per token: ``R + Dr = 2·Hkv·D / N``.
More RoPE dims keep more positional information, fewer leave more latent for the no-RoPE keys and the values; which
wins depends on the model and the ratio. Each candidate ``Dr`` (``D``, ``D/2``, ``D/4``, the ones that leave a
latent) is fitted in closed form and the one with the lowest mean attention-output error over the layers (on the
calibration windows the conversion keeps) is taken. With KVSplice (``keep``) the latent is converted at the size
whose kept part makes up the budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

from kvsplice.core.amounts import check_times_smaller

__all__ = ["CacheSplit", "choose_split", "rope_candidates", "split_cache"]


@dataclass(frozen=True)
class CacheSplit:
    """One way to spend a token's cached numbers per layer: ``rope_dims`` RoPE dims + ``d_latent`` latent dims (after
    KVSplice when ``keep`` is set; ``convert_latent``: the latent converted, before it), and the mean over layers of
    its attention-output ``error`` on the calibration windows (None: not measured)."""

    rope_dims: int
    d_latent: int
    convert_latent: int
    error: Optional[float] = None


def split_cache(ratio: float, n_kv: int, head_dim: int) -> int:
    """Numbers cached per token and layer for a cache ``ratio`` times smaller than the source's K/V (same dtype)."""
    return max(1, round(2 * n_kv * head_dim / check_times_smaller("ratio", ratio)))


def _convert_latent(final: int, keep: Optional[float], full: int) -> Optional[int]:
    """The latent to convert to so that KVSplice keeping ``keep`` of it leaves ``final`` (None: not reachable)."""
    if keep is None:
        return final if final <= full else None
    from kvsplice.convert.kvsplice_keep import kept_dims

    for r in range(max(1, math.floor(final / keep) - 1), full + 1):
        if r * keep >= 1 and kept_dims(keep, r) == final:
            return r
    return None


def rope_candidates(cache_dim: int, head_dim: int, full_latent, keep: Optional[float] = None) -> list[CacheSplit]:
    """The splits tried: ``Dr`` in ``D, D/2, D/4`` (even, ≥ 2) leaving a latent of at least 1 (``full_latent(Dr)``:
    the largest latent that conversion can fit)."""
    out = []
    for dr in sorted({head_dim, head_dim // 2, head_dim // 4}, reverse=True):
        if dr < 2 or dr % 2 or cache_dim - dr < 1:
            continue
        r0 = _convert_latent(cache_dim - dr, keep, full_latent(dr))
        if r0 is not None:
            out.append(CacheSplit(dr, cache_dim - dr, r0))
    if not out:
        raise ValueError(f"a cache of {cache_dim} numbers per token leaves no latent beside a RoPE key of at least "
                         f"2 dims (give a smaller ratio)")
    return out


def choose_split(model, stats, candidates: list[CacheSplit], fit, progress: bool = False, **convert
                 ) -> tuple[list[CacheSplit], object]:
    """``(candidates with their measured error, best first; the best one's converted model)``: the error is the mean
    over layers of the attention-output error on the kept windows (closed form, no correction). ``stats`` must keep
    windows (:func:`~kvsplice.convert.llama_mla.calibrate_layers`); ``convert``: more arguments of
    :func:`~kvsplice.convert.llama_mla.convert_llama` (``source``, ``latent_norm``)."""
    from kvsplice.convert.llama_mla import convert_llama, output_error

    if not all(s.windows for s in stats):
        raise ValueError("choosing the split needs calibration windows (calibrate_layers(keep_windows=1))")
    scored, best = [], None
    for c in candidates:
        mla = convert_llama(model, stats, d_latent=c.convert_latent, rope_dims=c.rope_dims, layout="shared",
                            fit=replace(fit, refine_steps=0), progress=progress, **convert)
        err = sum(output_error(blk.attn, s.windows) for blk, s in zip(mla.layers, stats)) / len(stats)
        scored.append(replace(c, error=err))
        if best is None or err < best[0]:
            best = (err, mla)
        del mla
    return sorted(scored, key=lambda c: c.error), best[1]
