"""Token-subset cache: the kept tokens of each KV head, held by a storage method, and their per-token log-weights.

:class:`SubsetCache` pairs two caches with the same layers and tokens: ``kept`` — whatever the storage method keeps
of the kept tokens (full keys/values ``k (B, Hkv, T, d)``, ``v (B, Hkv, T, dv)`` by default; low-rank
coefficients, int8 rows, ... with ``TokenSelection(..., store=...)``) — and ``weights``, the log-weights
``w (B, Hkv, T, 1)`` at the model's precision (never quantised). Prefill is compressed once
(:meth:`SubsetCache.compress_prefill`: :func:`choose_tokens` picks per sequence and KV head on the prefill
keys/values, left padding excluded); tokens appended afterwards are kept exactly with log-weight 0. ``nbytes()``
counts both: ``L·B·Hkv·n·(d + dv + 1)·bytes`` for full keys/values (:meth:`SubsetCache.bytes_formula`).

Attention over the cache is ``softmax(q·Kᵀ·scale + logw)·V`` (:func:`kvsplice.core.attention.weighted_attend`, or
the storage method's own attention with ``logw``), the selectors' estimator
``Σ_i w_i e^{q·k_i·s} v_i / Σ_i w_i e^{q·k_i·s}``. The method that fills it is
:class:`kvsplice.select.method.TokenSelection`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch

from kvsplice.select.selectors import TokenSelector
from models.cache import Cache
from models.stream_cache import DecodeCache

__all__ = ["SubsetCache", "TokenSelectionResult", "choose_tokens", "gather_tokens", "subset_bytes"]


# ---------------------------------------------------------------------------------------------- selection
def choose_tokens(selector: TokenSelector, k: torch.Tensor, v: torch.Tensor, budget: int,
                  real: Optional[torch.Tensor] = None, q: Optional[torch.Tensor] = None,
                  scale: Optional[float] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence and KV head, which of the prefill tokens ``k (B, Hkv, T, d)``, ``v (B, Hkv, T, dv)`` to keep:
    ``(idx, logw)``, each ``(B, Hkv, n_keep)`` with ``n_keep = min(budget, T)`` (on ``k``'s device).

    ``real (B or 1, T)`` bool: a row's real tokens (left padding excluded, from transformers' mask). Every row
    complete: one ``selector.select`` call on ``(B·Hkv, T, ·)`` (rows are independent instances). Otherwise per
    row on its real tokens; a row with fewer real tokens than ``n_keep`` fills its first slots with a padding token
    of log-weight ``-inf`` (never attended), so a batch stacks and each row attends exactly as it would alone.
    ``q (B, Hq, T, d)`` and ``scale``: the prefill queries, for selectors that score tokens by attention
    (``selector.needs_queries``); the ``g`` query heads of a KV head are handed over as its rows ``(g·T, d)``.
    """
    b, h, t, d = k.shape
    n_keep = min(budget, t)
    qs = None
    if selector.needs_queries:
        if q is None:
            raise ValueError(f"{type(selector).__name__} scores tokens by attention: it needs the prefill queries")
        qs = q.reshape(b, h, -1, t, d)  # (B, Hkv, g, T, d): the query heads of each KV head
    real = None if real is None else real.expand(b, t)  # (B, T)
    if real is None or bool(real.all()):
        qf = None if qs is None else qs.reshape(b * h, -1, d)  # (B·Hkv, g·T, d)
        idx, logw = selector.select(k.reshape(b * h, t, d), v.reshape(b * h, t, -1), budget, q=qf, scale=scale)
        return idx.reshape(b, h, n_keep).to(k.device), logw.reshape(b, h, n_keep).to(k.device)
    idx = torch.zeros(b, h, n_keep, dtype=torch.long, device=k.device)
    logw = torch.full((b, h, n_keep), float("-inf"), device=k.device)
    for i in range(b):
        cols = real[i].nonzero().flatten()  # (n_real,) positions of the real tokens
        qi = None if qs is None else qs[i][:, :, cols].reshape(h, -1, d)  # (Hkv, g·n_real, d)
        ri, rw = selector.select(k[i][:, cols], v[i][:, cols], budget, q=qi, scale=scale)  # (Hkv, min(budget, n_real))
        m = ri.shape[-1]
        idx[i, :, n_keep - m:] = cols[ri.to(cols.device)]  # fillers (log-weight -inf) first, then the kept
        logw[i, :, n_keep - m:] = rw.to(k.device)
        pad = (~real[i]).nonzero().flatten()
        if m < n_keep:  # a filler slot holds a padding token that is never attended
            idx[i, :, :n_keep - m] = pad[0] if pad.numel() else 0
    return idx, logw


def gather_tokens(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``x (B, Hkv, T, c)`` at ``idx (B, Hkv, n)`` per sequence and head → ``(B, Hkv, n, c)``."""
    return torch.gather(x, 2, idx[..., None].expand(-1, -1, -1, x.shape[-1]))


# -------------------------------------------------------------------------------------------------- cache
def subset_bytes(n_layer: int, batch_size: int, n_kv_head: int, head_size: int, v_head_size: int, n_held: int,
                 dtype: torch.dtype = torch.float32) -> int:
    """Bytes of ``n_held`` full keys/values + log-weights per layer: ``L·B·Hkv·n·(d + dv + 1)·element_size`` (a
    selection over full K/V: ``TokenSelection(...).bytes_formula`` for ``DenseKV`` storage)."""
    el = torch.empty((), dtype=dtype).element_size()
    return n_layer * batch_size * n_kv_head * n_held * (head_size + v_head_size + 1) * el


class SubsetCache(Cache):
    """A per-head token subset: ``kept`` (the storage method's cache of the kept tokens) + ``weights``
    (``w (B, Hkv, T, 1)`` log-weights). ``SubsetCache(n_layer, n_kv_head, head_size, batch_size)`` holds full keys
    and values; :meth:`over` wraps any storage cache.

    ``seq_len`` is the tokens *held*; ``n_seen`` the tokens the sequence has (positions: the next token's absolute
    position is ``n_seen``, not ``seq_len``).
    """

    kind = "subset"

    def __init__(self, n_layer: int, n_kv_head: int, head_size: int, batch_size: int, *,
                 v_head_size: Optional[int] = None, **kw) -> None:
        if kw.get("quant") is not None:
            raise ValueError("SubsetCache does not quantise its log-weights (they need full precision); quantise the "
                             "kept tokens with TokenSelection(selector, budget, store=DenseKV(cache_quant='int8'))")
        dv = head_size if v_head_size is None else v_head_size
        kept = DecodeCache([{"k": (n_kv_head, head_size), "v": (n_kv_head, dv)}] * n_layer, batch_size, **kw)
        self._init(kept, n_kv_head, kw.get("capacity"))

    @classmethod
    def over(cls, kept: DecodeCache, n_kv_head: int, capacity: Optional[int] = None) -> "SubsetCache":
        """A subset cache whose kept tokens live in ``kept`` (any storage method's cache, e.g. int8 coefficients)."""
        self = cls.__new__(cls)
        self._init(kept, n_kv_head, capacity)
        return self

    def _init(self, kept: DecodeCache, n_kv_head: int, capacity: Optional[int]) -> None:
        self.kept, self.n_kv_head = kept, int(n_kv_head)
        self.weights = DecodeCache([{"w": (self.n_kv_head, 1)}] * kept.n_layer, kept.batch_size, dtype=kept.dtype,
                                   device=kept.device, capacity=capacity)
        self.batch_size, self.dtype, self.device = kept.batch_size, kept.dtype, kept.device

    # ----------------------------------------------------------------------------------------- interface
    @property
    def n_layer(self) -> int:
        return self.kept.n_layer

    @property
    def seq_len(self) -> int:
        return self.kept.seq_len

    @property
    def position(self) -> int:
        return self.kept.position

    @property
    def n_seen(self) -> int:
        """Tokens the sequence has seen (= :attr:`position`)."""
        return self.position

    def layer_len(self, layer: int) -> int:
        return self.kept.layer_len(layer)

    def advance(self, layer: int, n: int) -> None:
        """Count ``n`` dropped tokens as seen by ``layer`` (positions continue after them)."""
        self.kept.advance(layer, n)
        self.weights.advance(layer, n)

    def append(self, layer: int, **new: torch.Tensor) -> dict[str, torch.Tensor]:
        """Append the kept streams' new entries and ``w`` (omitted: log-weight 0, kept exactly); the full views."""
        w = new.pop("w", None)
        out = dict(self.kept.append(layer, **new))
        if w is None:
            first = next(iter(out.values()))
            w = torch.zeros(self.batch_size, self.n_kv_head, next(iter(new.values())).shape[-2], 1, dtype=self.dtype,
                            device=first.device)
        out["w"] = self.weights.append(layer, w=w)["w"]
        return out

    def get(self, layer: int) -> dict[str, torch.Tensor]:
        return {**self.kept.get(layer), "w": self.weights.get(layer)["w"]}

    def compress_prefill(self, layer: int, k: torch.Tensor, v: torch.Tensor, selector: TokenSelector, budget: int,
                         *, real: Optional[torch.Tensor] = None, q: Optional[torch.Tensor] = None,
                         scale: Optional[float] = None,
                         append_kept: Optional[Callable[[torch.Tensor, torch.Tensor], None]] = None
                         ) -> Optional[dict[str, torch.Tensor]]:
        """Keep :func:`choose_tokens` of the prefill ``k (B, Hkv, T, d)``, ``v (B, Hkv, T, dv)`` (``real``, ``q``,
        ``scale`` as there) with their log-weights; the dropped tokens still count as seen. ``append_kept(k_kept,
        v_kept)`` puts the kept tokens into :attr:`kept` (a storage method's ``append``); by default they are
        appended as they are, and the views after the append are returned. The layer must be empty."""
        if self.layer_len(layer) != 0:
            raise ValueError(f"compress_prefill: layer {layer} already holds {self.layer_len(layer)} tokens")
        t = k.shape[2]
        idx, logw = choose_tokens(selector, k, v, budget, real, q, scale)  # (B, Hkv, n_keep) each
        kk, vv = gather_tokens(k, idx), gather_tokens(v, idx)  # (B, Hkv, n_keep, d), (B, Hkv, n_keep, dv)
        if append_kept is None:
            self.kept.append(layer, k=kk, v=vv)
        else:
            append_kept(kk, vv)
        self.weights.append(layer, w=logw[..., None].to(self.dtype))  # (B, Hkv, n_keep, 1)
        self.advance(layer, t - idx.shape[-1])  # the dropped prompt tokens still count as seen: positions continue
        return self.get(layer) if append_kept is None else None

    # ------------------------------------------------------------------------------------------------ bytes
    def tensors(self) -> Iterator[torch.Tensor]:
        return itertools.chain(self.kept.tensors(), self.weights.tensors())

    def storage_nbytes(self) -> int:
        return self.kept.storage_nbytes() + self.weights.storage_nbytes()

    def elements_per_token(self) -> int:
        return self.kept.elements_per_token() + self.weights.elements_per_token()

    def reset(self) -> None:
        self.kept.reset()
        self.weights.reset()

    def truncate(self, n: int) -> None:
        self.kept.truncate(n)
        self.weights.truncate(n)

    def __repr__(self) -> str:
        return (f"SubsetCache(kept={type(self.kept).__name__}, layers={self.n_layer}, batch={self.batch_size}, "
                f"seq_len={self.seq_len}, position={self.position}, nbytes={self.nbytes()})")


# ------------------------------------------------------------------------------------------------- driver
@dataclass
class TokenSelectionResult:
    nll: float  # mean next-token negative log-likelihood over the scored continuation tokens
    ppl: float
    n_scored: int  # B · (T - prompt_len)
    prompt_len: int
    budget: int
    n_keep: int  # prefill tokens held per head after compression
    cache_nbytes: int  # bytes the subset cache holds at the end (kept tokens + log-weights; all layers)
    full_nbytes: int  # bytes a full K/V cache of the same tokens would hold
    cache: SubsetCache
    logits: Optional[torch.Tensor] = None  # (B, T - prompt_len, V): predictions for idx[:, prompt_len:]
