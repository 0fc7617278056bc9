"""Token selection inside HF ``generate()``: :class:`SubsetHFCache`.

::

    cache = SubsetHFCache(model, make_selector("balancekv"), budget=128)
    out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=32)
    cache.nbytes() == cache.formula_nbytes()        # L · B · Hkv · n_held · (d + d + 1) · bytes

``KVSpliceHFCache(model, TokenSelection(selector, budget, store=store))``: exact prefill with transformers' mask,
then ``budget`` tokens per (sequence, KV head) with their log-weights (left padding excluded: a padded row keeps
only real tokens and fills its spare slots with log-weight ``-inf``), new tokens kept exactly — the method of
:mod:`kvsplice.select.method`, the same as the package's ``Decoder`` runs. ``get_seq_length()`` is the tokens seen
(positions continue after dropped tokens); ``seq_len`` the tokens held.
"""

from __future__ import annotations

from typing import Optional

import torch

from kvsplice.core.method import CompressionMethod
from kvsplice.hf.base import KVSpliceHFCache
from kvsplice.select.method import TokenSelection
from kvsplice.select.selectors import TokenSelector
from models.kernels import DEFAULT_DECODE_KERNEL

__all__ = ["SubsetHFCache"]


class SubsetHFCache(KVSpliceHFCache):
    """``KVSpliceHFCache(model, TokenSelection(selector, budget, store=store))``: a weighted subset of ``budget``
    prompt tokens per KV head + new tokens (``store``: the storage of the kept tokens, default full keys/values)."""

    def __init__(self, model: torch.nn.Module, selector: TokenSelector, budget: int, *,
                 store: Optional[CompressionMethod] = None, capacity: Optional[int] = None,
                 decode_kernel: str = DEFAULT_DECODE_KERNEL) -> None:
        super().__init__(model, TokenSelection(selector, budget, store=store), capacity=capacity,
                         decode_kernel=decode_kernel)
