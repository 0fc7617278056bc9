"""Low-rank coefficients inside HF ``generate()``: :class:`CoefficientHFCache`.

::

    bases = KVBases.load("s260k_r4_post.safetensors")             # kvsplice fit-bases
    cache = CoefficientHFCache(model, bases)                       # switches model to the "kvsplice" attention
    out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=32)
    cache.nbytes() == cache.formula_nbytes()                       # Σ_layers Σ_kv-heads (R_k + R_v) · T · B · bytes

``KVSpliceHFCache(model, LowRank(bases, cache_quant=...))``: the numbers live in a
:class:`kvsplice.lowrank.cache.CoefficientCache` and attention is :meth:`kvsplice.lowrank.method.LowRank.attend`
(coefficient space, :mod:`kvsplice.lowrank.attention`) — the same as the package's ``Decoder`` runs. Full-rank
orthonormal bases reproduce the model (tested against ``DynamicCache``).
"""

from __future__ import annotations

from typing import Optional

import torch

from kvsplice.hf.base import KVSpliceHFCache
from kvsplice.lowrank.bases import KVBases
from kvsplice.lowrank.method import LowRank
from models.kernels import DEFAULT_DECODE_KERNEL

__all__ = ["CoefficientHFCache"]


class CoefficientHFCache(KVSpliceHFCache):
    """``KVSpliceHFCache(model, LowRank(bases, cache_quant=cache_quant))``: only key/value coefficients of fitted
    low-rank ``bases`` (``cache_quant="int8"``: int8 rows with fp16 scales, dequantised for the attention call)."""

    def __init__(self, model: torch.nn.Module, bases: KVBases, *, cache_quant: Optional[str] = None,
                 capacity: Optional[int] = None, decode_kernel: str = DEFAULT_DECODE_KERNEL) -> None:
        super().__init__(model, LowRank(bases, cache_quant=cache_quant), capacity=capacity,
                         decode_kernel=decode_kernel)
