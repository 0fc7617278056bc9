"""A token selection whose KV heads draw from one pool per layer: head ``h`` keeps ``n_h`` of the prompt's tokens,
``Σ_h n_h = Hkv · n_keep`` — the heads that spread their attention keep more, the ones that look at few tokens
fewer (KVzip's non-uniform head budgets; the same bytes as ``n_keep`` tokens in every head).

:class:`PooledSubsetCache` holds per layer:

* ``pooled`` — the kept prompt entries of all heads as one row sequence ``k, v (B, 1, N, D)`` (``N = Hkv · n_keep``),
  head by head (head 0's entries, then head 1's, ...), as ``DenseKV`` stores rows (full precision, int8, int4, or
  int8 keys with int4 values; a rotated store hands them over rotated);
* ``counts`` — how many of them each head owns, ``(B, Hkv)`` int32 (4 bytes per head and layer);
* ``recent`` — the tokens decoded after the prompt, ``k, v (B, Hkv, T, D)``, every head's own (a ``KVCache``; its
  rows as the pool's, or their own way: ``decoded_quant``).

Attention of the query heads of KV head ``h`` runs over the pooled entries with a bias of 0 on head ``h``'s and
``-inf`` on the others', then over the recent tokens (causal, bottom-right): :func:`pooled_attend`. No log-weights
are stored (the kept tokens weigh 1, as KVzip keeps them). Bytes: ``L · B · (Hkv · n_held · row bytes(k, v) +
Hkv · 4)`` with ``n_held`` the tokens held per head on average (``seq_len``).
"""

from __future__ import annotations

import itertools
from typing import Iterator, Optional

import torch
import torch.nn.functional as F

from kvsplice.core.coded import Segment, coded_attend, stream_rows
from kvsplice.select.scores import _top
from models.cache import Cache
from models.stream_cache import KVCache

__all__ = ["PooledSubsetCache", "coded_pooled_attend", "own_tokens", "pool_tokens", "pooled_attend", "pooled_bias"]


def pool_tokens(scores: torch.Tensor, n_keep: int) -> torch.Tensor:
    """The ``Hkv · n_keep`` highest of ``scores (B, Hkv, T)`` per sequence, drawn from all heads together →
    flat indices ``h · T + t`` ``(B, Hkv · n_keep)``, sorted (so head by head, each head's tokens in order)."""
    b, h, t = scores.shape
    return _top(scores.reshape(b, h * t), h * n_keep)  # (B, Hkv·n_keep); head h's tokens at h·T .. h·T + T - 1


def own_tokens(scores: torch.Tensor, n_keep: int) -> torch.Tensor:
    """Each head's own ``n_keep`` highest of ``scores (B, Hkv, T)``, as flat pool indices ``h · T + t``
    ``(B, Hkv · n_keep)``, sorted (equal counts: a layer that does not pool, held in the same cache)."""
    b, h, t = scores.shape
    idx = _top(scores.reshape(b * h, t), n_keep).view(b, h, n_keep)  # (B, Hkv, n_keep): each head's, in order
    return (idx + torch.arange(h, device=idx.device)[None, :, None] * t).reshape(b, h * n_keep)


def pooled_bias(counts: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
    """``counts (B, Hkv)`` entries per head, laid out head by head over ``n`` pooled entries → the additive bias
    ``(B, Hkv, n)``: 0 where the entry is the head's own, ``-inf`` elsewhere."""
    b, h = counts.shape
    ends = counts.to(torch.long).cumsum(-1)  # (B, Hkv): one past each head's last entry
    owner = torch.searchsorted(ends, torch.arange(n, device=counts.device).expand(b, n).contiguous(), right=True)
    mine = owner[:, None, :] == torch.arange(h, device=counts.device)[None, :, None]  # (B, Hkv, n)
    return torch.zeros(b, h, n, dtype=dtype, device=counts.device).masked_fill_(~mine, float("-inf"))


def pooled_attend(step, layer: int, q: torch.Tensor, pooled: dict[str, torch.Tensor], counts: torch.Tensor,
                  recent: dict[str, torch.Tensor]) -> torch.Tensor:
    """``q (B, Hq, Tq, D)`` over a layer's pooled entries ``pooled["k"|"v"] (B, 1, N, D)`` (owned per ``counts
    (B, Hkv)``) and its recent tokens ``recent["k"|"v"] (B, Hkv, Tr, D)`` (the queries' own last, causal) →
    ``(B, Hq, Tq, D)`` through the step's attention with log-weights."""
    kr, vr = recent["k"], recent["v"]
    b, h, tr, _ = kr.shape
    n = pooled["k"].shape[2]
    k = torch.cat([pooled["k"].expand(b, h, n, -1), kr], 2)  # (B, Hkv, N + Tr, D): every head sees the pool
    v = torch.cat([pooled["v"].expand(b, h, n, -1), vr], 2)  # (B, Hkv, N + Tr, Dv)
    dt = torch.promote_types(q.dtype, torch.float32)
    logw = torch.cat([pooled_bias(counts, n, dt), torch.zeros(b, h, tr, dtype=dt, device=kr.device)], -1)
    return step.attend(layer, q, k, v, logw=logw)  # (B, Hq, Tq, Dv)


def coded_pooled_attend(step, layer: int, q: torch.Tensor, pooled: KVCache, counts: torch.Tensor,
                        recent: KVCache) -> torch.Tensor:
    """:func:`pooled_attend` of one decode query per head ``q (B, Hq, 1, D)`` straight from the stored rows
    (:func:`kvsplice.core.coded.coded_attend`): the pool is one row sequence every query head scores (each KV head's
    queries see only its own entries, by :func:`pooled_bias`), not a copy per head → ``(B, Hq, 1, D)``."""
    n = pooled.layer_len(layer)
    segments = [Segment(stream_rows(recent, layer, "k"), stream_rows(recent, layer, "v"))]
    if n:
        bias = pooled_bias(counts, n, torch.float32)  # (B, Hkv, N)
        segments.insert(0, Segment(stream_rows(pooled, layer, "k"), stream_rows(pooled, layer, "v"), bias,
                                   shared=True))
    return coded_attend(q, segments, scale=step.scales[layer])


class PooledSubsetCache(Cache):
    """Per layer: the pooled prompt entries (``pooled``, one row sequence), each head's share of them (``counts``)
    and the decoded tokens (``recent``); see the module docstring. ``quant``: the rows' ``KVCache`` quantisation
    (``None``, ``"int8"``, ``"int4"`` or per stream ``{"k": "int8", "v": "int4"}``), ``decoded_quant``: the
    recent tokens' (the same forms; ``None``: at ``dtype``);
    ``capacity``: decoded tokens preallocated, ``pool_capacity``: pooled entries (``Hkv · n_keep``: exact bytes)."""

    kind = "pooled_subset"

    def __init__(self, n_layer: int, n_kv_head: int, head_size: int, batch_size: int, *,
                 v_head_size: Optional[int] = None, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", capacity: Optional[int] = None, quant: Optional[str] = None,
                 pool_capacity: Optional[int] = None,
                 decoded_quant: Optional[str | dict[str, str]] = None) -> None:
        dv = head_size if v_head_size is None else v_head_size
        if dv != head_size:
            raise ValueError("PooledSubsetCache holds keys and values of the same width")
        kw = {"dtype": dtype, "device": device}
        self.pooled = KVCache(n_layer, 1, head_size, batch_size, capacity=pool_capacity, quant=quant,
                              **kw)  # Hkv · n_keep rows
        self.recent = KVCache(n_layer, n_kv_head, head_size, batch_size, capacity=capacity, quant=decoded_quant, **kw)
        self.counts: list[Optional[torch.Tensor]] = [None] * n_layer  # (B, Hkv) int32 per layer after prefill
        self.n_kv_head, self.batch_size, self.quant = int(n_kv_head), batch_size, quant
        self.dtype, self.device = self.recent.dtype, self.recent.device

    # ----------------------------------------------------------------------------------------- interface
    @property
    def n_layer(self) -> int:
        return self.recent.n_layer

    def layer_len(self, layer: int) -> int:
        """Tokens ``layer`` holds per head on average: its pooled entries / Hkv + the recent tokens."""
        return self.pooled.layer_len(layer) // self.n_kv_head + self.recent.layer_len(layer)

    @property
    def seq_len(self) -> int:
        return min(self.layer_len(l) for l in range(self.n_layer))

    @property
    def position(self) -> int:
        """Tokens the sequence has seen (the prompt's, dropped ones included, + the decoded ones)."""
        return self.recent.position

    def fill(self, layer: int, k: torch.Tensor, v: torch.Tensor, flat: torch.Tensor) -> None:
        """Keep the prompt entries ``flat (B, N)`` (indices ``h · T + t``, sorted: :func:`pool_tokens`) of the
        prompt's ``k, v (B, Hkv, T, D)`` in the empty ``layer``; the whole prompt counts as seen."""
        if self.pooled.layer_len(layer) or self.recent.layer_len(layer):
            raise ValueError(f"fill: layer {layer} already holds tokens")
        b, h, t, d = k.shape
        idx = flat[:, None, :, None].expand(-1, -1, -1, d)  # (B, 1, N, D)
        kk = k.reshape(b, 1, h * t, d).gather(2, idx)  # (B, 1, N, D): head by head
        vv = v.reshape(b, 1, h * t, v.shape[-1]).gather(2, idx)
        self.pooled.append(layer, k=kk.to(self.dtype), v=vv.to(self.dtype))
        self.counts[layer] = F.one_hot(flat // t, h).sum(1).to(torch.int32)  # (B, Hkv): entries per head
        self.recent.advance(layer, t)  # positions continue after the whole prompt

    def attend(self, step, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Append the decoded ``k, v (B, Hkv, Tq, D)`` of ``layer``, attend ``q (B, Hq, Tq, D)`` over the pool and
        the recent tokens → ``(B, Hq, Tq, D)``."""
        if q.shape[2] == 1:  # a decode step: from the rows as stored, the pool read once for every head
            self.recent.append_rows(layer, k=k.to(self.dtype), v=v.to(self.dtype))
            return coded_pooled_attend(step, layer, q, self.pooled, self.counts[layer], self.recent)
        recent = self.recent.append(layer, k=k.to(self.dtype), v=v.to(self.dtype))  # (B, Hkv, Tr, D) each
        return pooled_attend(step, layer, q, self.pooled.get(layer), self.counts[layer], recent)

    def tensors(self) -> Iterator[torch.Tensor]:
        return itertools.chain(self.pooled.tensors(), self.recent.tensors(), (c for c in self.counts if c is not None))

    def storage_nbytes(self) -> int:
        counts = sum(c.numel() * c.element_size() for c in self.counts if c is not None)
        return self.pooled.storage_nbytes() + self.recent.storage_nbytes() + counts

    def elements_per_token(self) -> float:
        return self.recent.elements_per_token()

    def reset(self) -> None:
        self.pooled.reset()
        self.recent.reset()
        self.counts = [None] * self.n_layer

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` tokens held: the pool and ``n - n_keep`` recent tokens (the pool is not cut)."""
        keep = min(self.pooled.layer_len(l) // self.n_kv_head for l in range(self.n_layer))
        if n < keep:
            raise ValueError(f"truncate({n}): the pooled prompt holds {keep} tokens per head; it cannot be cut")
        self.recent.truncate(n - keep)

    def __repr__(self) -> str:
        return (f"PooledSubsetCache(layers={self.n_layer}, batch={self.batch_size}, seq_len={self.seq_len}, "
                f"position={self.position}, nbytes={self.nbytes()})")
