"""Token-subset cache: a per-head subset of the prefill tokens with per-token log-weights, plus exact new tokens.

:class:`SubsetCache` is a :class:`~models.cache.DecodeCache` with three streams per layer — ``k (B, Hkv, T, d)``,
``v (B, Hkv, T, dv)`` and the log-weights ``w (B, Hkv, T, 1)``. Prefill is compressed once
(:meth:`SubsetCache.compress_prefill`: a :class:`~kvsplice.select.selectors.TokenSelector` picks per KV head on the
prefill keys/values); tokens appended afterwards are kept exactly with log-weight 0. ``nbytes()`` counts all three
streams: ``L·B·Hkv·n·(d + dv + 1)·bytes``.

Attention over the cache is :func:`weighted_attend`, ``softmax(q·Kᵀ·scale + logw)·V`` with the bottom-right causal
mask of :func:`models.attention.attend` — with ``logw = 0`` it *is* ``attend`` (tested), and with log-weights it is
the selectors' estimator ``Σ_i w_i e^{q·k_i·s} v_i / Σ_i w_i e^{q·k_i·s}``.

The decode method that fills it is :class:`kvsplice.select.method.TokenSelection`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from models.cache import DecodeCache
from kvsplice.select.selectors import TokenSelector
from models.attention import attend


# ---------------------------------------------------------------------------------------------- attention
def weighted_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, logw: Optional[torch.Tensor], *,
                    scale: float) -> torch.Tensor:
    """``softmax(q·Kᵀ·scale + logw)·V`` with :func:`models.attention.attend`'s layout and causal convention.

    q (B, Hq, Tq, D), k (B, Hkv, Tk, D), v (B, Hkv, Tk, Dv), logw (B, Hkv, Tk, 1) / (B, Hkv, Tk) / None,
    ``Hq % Hkv == 0`` (query head h reads KV head ``h // (Hq // Hkv)``); query ``i`` sits at key position
    ``Tk - Tq + i`` and sees keys ``<=`` it (the last ``Tq`` keys are the queries' own). → (B, Hq, Tq, Dv).
    Scores are formed in float32 at least.
    """
    if logw is not None and logw.dim() == 4:
        logw = logw.squeeze(-1)  # (B, Hkv, Tk)
    dt = torch.promote_types(q.dtype, torch.float32)
    y = attend(q.to(dt), k.to(dt), v.to(dt), scale=scale, backend="sdpa",
               bias=None if logw is None else logw.to(dt))  # (B, Hq, Tq, Dv)
    return y.to(q.dtype)


# -------------------------------------------------------------------------------------------------- cache
class SubsetCache(DecodeCache):
    """Per layer ``k (B, Hkv, T, d)``, ``v (B, Hkv, T, dv)``, ``w (B, Hkv, T, 1)`` (log-weights).

    ``seq_len`` is the tokens *held*; ``n_seen`` the tokens the sequence has (positions: the next token's absolute
    position is ``n_seen``, not ``seq_len``).
    """

    kind = "subset"

    def __init__(self, n_layer: int, n_kv_head: int, head_size: int, batch_size: int, *,
                 v_head_size: Optional[int] = None, **kw) -> None:
        if kw.get("quant") is not None:
            raise ValueError("SubsetCache does not quantise (its log-weights need full precision); quant must be None")
        dv = head_size if v_head_size is None else v_head_size
        spec = {"k": (n_kv_head, head_size), "v": (n_kv_head, dv), "w": (n_kv_head, 1)}
        super().__init__([spec] * n_layer, batch_size, **kw)
        self.n_kv_head, self.head_size, self.v_head_size = n_kv_head, head_size, dv

    @staticmethod
    def bytes_formula(n_layer: int, batch_size: int, n_kv_head: int, head_size: int, v_head_size: int,
                      n_held: int, dtype: torch.dtype = torch.float32) -> int:
        """Bytes of ``n_held`` tokens per layer: ``L·B·Hkv·n·(d + dv + 1)·element_size``."""
        el = torch.empty((), dtype=dtype).element_size()
        return n_layer * batch_size * n_kv_head * n_held * (head_size + v_head_size + 1) * el

    @property
    def n_seen(self) -> int:
        """Tokens the sequence has seen (= :attr:`position`)."""
        return self.position

    def append(self, layer: int, **new: torch.Tensor) -> dict[str, torch.Tensor]:
        """Append tokens; ``w`` may be omitted (log-weight 0: kept exactly)."""
        if "w" not in new and "k" in new:
            kt = new["k"]
            new["w"] = torch.zeros(*kt.shape[:-1], 1, dtype=self.dtype, device=kt.device)
        return super().append(layer, **new)

    def compress_prefill(self, layer: int, k: torch.Tensor, v: torch.Tensor, selector: TokenSelector,
                         budget: int) -> dict[str, torch.Tensor]:
        """Select per sequence and KV head from the prefill ``k (B, Hkv, T, d)``, ``v (B, Hkv, T, dv)`` (one
        ``selector.select`` call on ``(B·Hkv, T, ·)``: every (sequence, head) row is an independent instance); store
        the kept keys/values and their log-weights. The layer must be empty. Returns the views after the append."""
        if self.layer_len(layer) != 0:
            raise ValueError(f"compress_prefill: layer {layer} already holds {self.layer_len(layer)} tokens")
        b, h, t = k.shape[:3]
        # heads are independent instances for every selector: fold the batch into the head axis, select once
        idx, logw = selector.select(k.reshape(b * h, t, -1), v.reshape(b * h, t, -1), budget)  # (B·Hkv, n_keep)
        n_keep = idx.shape[-1]
        idx = idx.to(k.device)
        kk = torch.gather(k.reshape(b * h, t, -1), 1, idx[..., None].expand(-1, -1, k.shape[-1]))  # (B·Hkv, n_keep, d)
        vv = torch.gather(v.reshape(b * h, t, -1), 1, idx[..., None].expand(-1, -1, v.shape[-1]))  # (B·Hkv, n_keep, dv)
        # k (B, Hkv, n_keep, d), v (B, Hkv, n_keep, dv), w (B, Hkv, n_keep, 1)
        out = super().append(layer, k=kk.reshape(b, h, n_keep, -1), v=vv.reshape(b, h, n_keep, -1),
                             w=logw.reshape(b, h, n_keep, 1).to(dtype=self.dtype, device=k.device))
        self.advance(layer, t - n_keep)  # the dropped prompt tokens still count as seen: positions continue
        return out


# ------------------------------------------------------------------------------------------------- driver
@dataclass
class TokenSelectionResult:
    nll: float  # mean next-token negative log-likelihood over the scored continuation tokens
    ppl: float
    n_scored: int  # B · (T - prompt_len)
    prompt_len: int
    budget: int
    n_keep: int  # prefill tokens held per head after compression
    cache_nbytes: int  # bytes the subset cache holds at the end (k, v, w; all layers)
    full_nbytes: int  # bytes a full K/V cache of the same tokens would hold
    cache: SubsetCache
    logits: Optional[torch.Tensor] = None  # (B, T - prompt_len, V): predictions for idx[:, prompt_len:]


__all__ = ["SubsetCache", "TokenSelectionResult", "weighted_attend"]
