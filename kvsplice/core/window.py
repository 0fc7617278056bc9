"""Sliding-window layers (Mistral, Qwen2/3, Phi-3, Gemma-3): a query at position ``p`` of a layer with window ``W``
sees the keys at ``p - W + 1 .. p`` (transformers' convention), so between forward calls such a layer needs only its
last ``W - 1`` tokens — what transformers' own ``DynamicSlidingWindowLayer`` keeps.

Both doors treat a windowed layer the same way, whatever the method: it runs the method's variant for a window
(:meth:`~kvsplice.core.method.CompressionMethod.for_window`; a token selection keeps the window's most recent tokens),
attends with a mask that hides what lies outside the window (:func:`window_mask` in the ``Decoder``; transformers'
sliding mask in the HF door) and, once the layer is done with a call, :func:`evict` drops every token but the last
``W - 1`` from its cache. So a windowed layer never holds or attends a token outside its window, its budget is at
most the window, and its bytes are those of the tokens it holds (:func:`held_per_layer`).

Eviction needs a cache whose rows are the layer's tokens in order of position: the stream caches
(:class:`models.stream_cache.DecodeCache`: full K/V, coefficients, int8 rows) and a token subset over one (its
``kept`` and ``weights``). Caches of another layout (the online method's chunks) are refused by :func:`check_evictable`.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from models.cache import Cache
from models.stream_cache import DecodeCache

__all__ = ["check_evictable", "evict", "held_per_layer", "window_mask"]


def window_mask(start: int, t_q: int, t_k: int, window: int, device: torch.device) -> Optional[torch.Tensor]:
    """Causal + sliding-window mask ``(1, 1, Tq, Tk)`` (True = attend) of ``Tq`` queries at positions ``start ..``
    over the ``Tk`` keys a layer holds after appending them (the last ``Tq`` keys are the queries' own, the held ones
    precede them contiguously); ``None`` when no key is outside any query's window (``Tk <= window``): plain causal."""
    if t_k <= window:
        return None
    q_pos = start + torch.arange(t_q, device=device)[:, None]  # (Tq, 1)
    k_pos = (start + t_q - t_k) + torch.arange(t_k, device=device)[None]  # (1, Tk)
    return ((k_pos <= q_pos) & (k_pos > q_pos - window))[None, None]  # (1, 1, Tq, Tk)


def _streams(cache: Cache) -> Optional[tuple[DecodeCache, ...]]:
    """The stream caches holding ``cache``'s rows (a token subset: its kept tokens and their log-weights)."""
    if isinstance(cache, DecodeCache):
        return (cache,)
    parts = (getattr(cache, "kept", None), getattr(cache, "weights", None))
    if all(isinstance(p, DecodeCache) for p in parts):
        return parts  # type: ignore[return-value]
    return None


def check_evictable(cache: Cache, windows: Sequence[Optional[int]]) -> None:
    """Raise ``ValueError`` when the model has sliding-window layers and ``cache`` cannot drop their old tokens."""
    if any(windows) and _streams(cache) is None:
        lw = [l for l, w in enumerate(windows) if w]
        raise ValueError(f"{type(cache).__name__} cannot drop the tokens that leave a sliding window (layers {lw} "
                         f"see only their last {max(w for w in windows if w)} tokens); use full K/V, low-rank bases "
                         f"or a token selection on this model")


def evict(cache: Cache, layer: int, keep: int) -> None:
    """Keep only the newest ``keep`` tokens of ``layer`` (in place; the tokens seen and the buffers stay)."""
    streams = _streams(cache)
    if streams is None:
        raise ValueError(f"{type(cache).__name__} cannot drop the tokens that leave layer {layer}'s sliding window")
    for c in streams:
        n = c.layer_len(layer)
        if n <= keep:
            continue
        for buf in c.storage(layer).values():  # (B, *lead, capacity, D) per stream, scales included
            buf[..., :keep, :] = buf[..., n - keep:n, :].clone()
        c._lengths[layer] = keep  # DecodeCache has no public per-layer shrink; lengths are its own bookkeeping


def held_per_layer(cache: Cache) -> list[int]:
    """Tokens each layer of ``cache`` holds (fewer on sliding-window layers once the window is full)."""
    return [cache.layer_len(l) for l in range(cache.n_layer)]
