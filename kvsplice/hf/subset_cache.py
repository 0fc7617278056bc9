"""Token selection inside HF ``generate()``: :class:`SubsetHFCache`.

::

    cache = SubsetHFCache(model, make_selector("balancekv"), budget=128)
    out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=32)
    cache.nbytes() == cache.bytes_formula()        # L · B · Hkv · n_held · (d + d + 1) · bytes

The numbers live in a :class:`kvsplice.select.cache.SubsetCache` (kept keys, values and log-weights per KV head),
as in :class:`kvsplice.select.method.TokenSelection`:

* prefill (the first call, on an empty cache) is exact: the prompt attends over all its keys/values (transient,
  the module's own tensors) with transformers' mask; then each (sequence, KV head) keeps ``min(budget, T)`` tokens
  chosen by the selector (keys post-RoPE, i.e. rotated at their positions) with their log-weights. Left padding:
  the selector sees only a row's real tokens; a row with fewer real tokens than the others keeps all of them and
  fills its remaining slots with a padding token whose log-weight is ``-inf`` (never attended), so a batch stacks
  and each row attends exactly as it would alone;
* decode: new tokens are appended exactly (log-weight 0) and attend with ``softmax(q·Kᵀ·s + logw)·V``
  (:func:`kvsplice.select.cache.weighted_attend`); padding was folded into the log-weights at prefill, so
  transformers' mask (numbered over all seen positions) is not needed any more.

``get_seq_length()`` is the tokens seen (positions continue after dropped tokens); ``seq_len`` the tokens held.
"""

from __future__ import annotations

from typing import Optional

import torch

from kvsplice.hf.attention import masked_attend
from kvsplice.hf.base import KVSpliceHFCache
from kvsplice.select.cache import SubsetCache, weighted_attend
from kvsplice.select.selectors import TokenSelector

__all__ = ["SubsetHFCache"]


class SubsetHFCache(KVSpliceHFCache):
    """A ``transformers.Cache`` holding a weighted subset of ``budget`` prompt tokens per KV head + new tokens."""

    def __init__(self, model: torch.nn.Module, selector: TokenSelector, budget: int, *,
                 capacity: Optional[int] = None) -> None:
        if not isinstance(selector, TokenSelector):
            raise TypeError(f"selector must be a kvsplice.select.selectors.TokenSelector, got {type(selector).__name__}")
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise ValueError(f"budget must be an integer >= 1, got {budget!r}")
        super().__init__(model, capacity=capacity)
        self.selector, self.budget = selector, budget

    def _build_store(self, batch_size, dtype, device):
        a = self.adapter
        self.store = SubsetCache(a.n_layer, a.n_kv_head, a.head_dim, batch_size, dtype=dtype, device=device,
                                 capacity=self.capacity)

    def bytes_formula(self, n_held: Optional[int] = None) -> int:
        """``L · B · Hkv · n_held · (d + dv + 1) · bytes`` (``n_held`` defaults to the tokens held)."""
        if self.store is None:
            return 0
        a, s = self.adapter, self.store
        return SubsetCache.bytes_formula(a.n_layer, s.batch_size, a.n_kv_head, a.head_dim, a.head_dim,
                                         s.seq_len if n_held is None else n_held, s.dtype)

    # -------------------------------------------------------------------------------------------- attention
    def attend(self, layer, q, k, v, mask, scale):
        s = self.store
        k, v = k.to(s.dtype), v.to(s.dtype)
        if s.layer_len(layer) == 0:  # prefill: exact, then keep a weighted subset
            y = masked_attend(q, k.to(q.dtype), v.to(q.dtype), mask, scale=scale)  # (B, Hq, T, D)
            self._compress(layer, k, v, mask)
            return y
        kv = s.append(layer, k=k, v=v)  # new tokens exactly, log-weight 0
        return weighted_attend(q, kv["k"], kv["v"], kv["w"], scale=scale).to(q.dtype)  # (B, Hq, Tq, D)

    def _compress(self, layer: int, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor]) -> None:
        b, h, t, d = k.shape
        n_keep = min(self.budget, t)
        real = None
        if mask is not None:
            real = mask[:, 0, -1, :] if mask.dtype == torch.bool else mask[:, 0, -1, :] > torch.finfo(mask.dtype).min / 2
            real = real.expand(b, t)  # (B, T): the prompt's real (non-padding) tokens
        if real is None or bool(real.all()):
            # every row is complete: one selection over (B·Hkv) independent instances
            idx, logw = self.selector.select(k.reshape(b * h, t, d), v.reshape(b * h, t, -1), self.budget)
            idx, logw = idx.reshape(b, h, n_keep).to(k.device), logw.reshape(b, h, n_keep)
        else:
            idx = torch.zeros(b, h, n_keep, dtype=torch.long, device=k.device)
            logw = torch.full((b, h, n_keep), float("-inf"))
            for i in range(b):
                cols = real[i].nonzero().flatten()  # (n_real,) positions of the real tokens
                ri, rw = self.selector.select(k[i][:, cols], v[i][:, cols], self.budget)  # (Hkv, min(budget, n_real))
                m = ri.shape[-1]
                idx[i, :, n_keep - m:] = cols[ri.to(cols.device)]  # fillers (log-weight -inf) first, then the kept
                logw[i, :, n_keep - m:] = rw
                pad = (~real[i]).nonzero().flatten()
                if m < n_keep:  # a filler slot holds a padding token that is never attended
                    idx[i, :, :n_keep - m] = pad[0] if pad.numel() else 0
        gather = lambda x: torch.gather(x, 2, idx[..., None].expand(-1, -1, -1, x.shape[-1]))  # noqa: E731  (B, Hkv, n_keep, ·)
        s = self.store
        s.append(layer, k=gather(k), v=gather(v), w=logw[..., None].to(dtype=s.dtype, device=k.device))
        s.advance(layer, t - n_keep)  # dropped prompt tokens still count as seen: positions continue
