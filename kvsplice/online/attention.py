"""Attention over a :class:`~kvsplice.online.chunked.ChunkedCache`: the blockwise softmax, chunk by chunk.

Logits ``scale · (q B_j) · a_t`` and outputs ``(Σ_{t∈j} p_t b_t) E_jᵀ`` per chunk ``j``, merged with the blockwise
softmax (:mod:`kvsplice.online.blockwise`): no cached token is expanded back to ``d`` numbers.
"""

from __future__ import annotations

import torch

from kvsplice.online.blockwise import Chunk, blockwise_attention
from kvsplice.online.chunked import ChunkedCache

__all__ = ["chunked_attention"]


def chunked_attention(cache: ChunkedCache, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of ``q (B, Hq, Tq, d)`` over every chunk of ``layer`` → ``(B, Hq, Tq, d_v)``.

    The last ``Tq`` cached tokens are the queries' own (bottom-right alignment: query ``i`` sits at position
    ``T − Tq + i``); query head ``h`` reads KV head ``h // (Hq // Hkv)``. Blockwise softmax in float32.
    """
    b, hq, tq, d = q.shape
    h = cache.n_kv_head
    t = cache.layer_len(layer)
    if b != cache.batch_size or hq % h or d != cache.head_size or not 1 <= tq <= t:
        raise ValueError(f"chunked_attention: q {tuple(q.shape)} does not fit batch {cache.batch_size}, {h} KV heads, "
                         f"head size {cache.head_size}, {t} cached tokens")
    g = hq // h
    q5 = q.reshape(b, h, g * tq, d)  # rows ordered (head in group, query), as in attend()
    q_pos = torch.arange(t - tq, t, device=q.device)
    out = torch.empty(b, h, g * tq, cache.value_head_size, dtype=q.dtype, device=q.device)
    for s in cache.streams(layer):
        chunks = []
        for c in s.chunks():
            mask = None
            if c.start + c.n - 1 > t - tq:  # some key lies after the first query
                mask = (torch.arange(c.start, c.start + c.n, device=q.device)[None, :] <= q_pos[:, None])
                mask = mask.repeat(g, 1)  # (g*Tq, n)
            chunks.append(Chunk(c.a, c.b, c.bk, c.be, mask))
        out[s.sel] = blockwise_attention(q5[s.sel], chunks, scale=scale)
    return out.reshape(b, hq, tq, cache.value_head_size)  # (B, Hq, Tq, d_v)
