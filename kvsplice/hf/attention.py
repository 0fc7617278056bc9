"""The ``"kvsplice"`` attention implementation registered with transformers' ``AttentionInterface``.

An HF attention module (``LlamaAttention``, ``GPT2Attention``) computes ``q, k, v`` (keys rotated for Llama), calls
``past_key_values.update(k, v, layer_idx)`` and hands what ``update`` returned to the attention function named by
``config._attn_implementation``. A kvsplice cache (:class:`kvsplice.hf.base.KVSpliceHFCache`) does not rebuild
full keys/values in ``update``: it returns the new ``k, v`` tagged with ``(cache, layer)`` and
:func:`kvsplice_attention` lets the cache's method compress, store and attend
(``cache.attend(layer, q, k_new, v_new, mask, scale)`` → the method's
:meth:`~kvsplice.core.method.CompressionMethod.attend`). Untagged calls (another cache, no cache) run transformers'
own SDPA attention, so a model switched to ``"kvsplice"`` still works with ``DynamicCache``.

Masks: ``"kvsplice"`` is registered with transformers' ``AttentionMaskInterface`` as ``sdpa_mask`` — a boolean
``(B, 1, Tq, Tk)`` mask (True = attend) over the absolute positions ``0 .. Tk-1``, or ``None`` when the pattern is
purely causal (no padding); every method takes either.
"""

from __future__ import annotations

from typing import Optional

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

__all__ = ["ATTN_IMPL", "TAG", "kvsplice_attention", "register", "tag", "use_kvsplice_attention"]

ATTN_IMPL = "kvsplice"
TAG = "_kvsplice_ctx"
"""Attribute a kvsplice cache sets on the key tensor ``update`` returns: ``(cache, layer)``."""


def tag(k: torch.Tensor, cache, layer: int) -> torch.Tensor:
    """Mark ``k`` (what ``update`` returns) as belonging to ``cache``'s ``layer``; returns ``k`` itself."""
    setattr(k, TAG, (cache, layer))
    return k


def kvsplice_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: Optional[torch.Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
                       **kwargs):
    """transformers' attention-function signature: ``query (B, Hq, Tq, D)``, ``key/value (B, Hkv, T, D)`` →
    ``(output (B, Tq, Hq, D), None)``."""
    ctx = getattr(key, TAG, None)
    if ctx is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    cache, layer = ctx
    if kwargs.get("softcap") is not None:
        raise ValueError(f"attention logit soft-capping (softcap={kwargs['softcap']}) is not supported by kvsplice "
                         f"caches: no method computes capped scores")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    y = cache.attend(layer, query, key, value, attention_mask, scale)  # (B, Hq, Tq, D)
    return y.transpose(1, 2), None  # (B, Tq, Hq, D), as transformers' attention functions return


_registered = False


def register() -> None:
    """Register ``"kvsplice"`` with transformers' attention and mask interfaces (idempotent)."""
    global _registered
    if not _registered:
        AttentionInterface.register(ATTN_IMPL, kvsplice_attention)
        ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPL, sdpa_mask)
        _registered = True


def use_kvsplice_attention(model: torch.nn.Module) -> None:
    """Switch ``model`` to the ``"kvsplice"`` attention implementation (untagged calls still run SDPA)."""
    register()
    if getattr(model.config, "_attn_implementation", None) != ATTN_IMPL:
        model.set_attn_implementation(ATTN_IMPL)
