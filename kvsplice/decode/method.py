"""The compression-method interface: one small class per way of caching and attending.

A :class:`CompressionMethod` decides, for one layer of one forward call, what goes into the cache and how the new
queries attend over it; the :class:`~kvsplice.decode.decoder.Decoder` does everything else (embeddings, norms,
MLPs, RoPE tables, LM head, positions, checks) the same way for every method. Methods in the package:

=============================================  ==========================================  ========================
method                                         cache                                       module
=============================================  ==========================================  ========================
``DenseKV``: full K/V (the reference)          ``KVCache``                                 ``kvsplice.decode.dense``
``ModelAttention``: the model's own attention  ``models.GPT.new_cache`` (MHA K/V, MLA       ``kvsplice.decode.native``
(MLA latents, KVSplice)                        latent, KVSplice compressed latent)
``LowRank``: fitted bases, coefficients        ``CoefficientCache``                        ``kvsplice.lowrank.method``
``OnlineFD``: per-chunk frequent-directions    ``ChunkedCache``                            ``kvsplice.online.method``
bases
``TokenSelection``: a weighted token subset    ``SubsetCache``                             ``kvsplice.select.method``
=============================================  ==========================================  ========================
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from kvsplice.adapters.base import FamilyAdapter
from models.attention import attend, select_backend
from models.cache import DecodeCache

__all__ = ["CompressionMethod", "Step"]


@dataclass
class Step:
    """What a method sees of one forward call: ``t`` new tokens at absolute positions ``start .. start + t - 1``.

    ``rope`` holds ``cos, sin (1, t, D)`` at the new positions (``None`` without RoPE); :meth:`rope_upto` gives the
    tables for every position up to the new tokens (pre-RoPE keys are rotated at their positions each call).
    """

    adapter: FamilyAdapter
    start: int
    t: int
    x: torch.Tensor
    scales: list[float]
    backend: str = "auto"
    rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None
    _rope_all: Optional[tuple[torch.Tensor, torch.Tensor]] = field(default=None, repr=False)

    def rope_upto(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin (1, start + t, D)``: positions ``0 .. start + t - 1`` (computed once per call)."""
        if self._rope_all is None:
            self._rope_all = self.adapter.rope(self.x, 0, self.start + self.t)
        return self._rope_all

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """:func:`models.attention.attend` with the layer's scale: ``q (B, Hq, Tq, d)`` over ``k (B, Hkv, Tk, d)``,
        ``v (B, Hkv, Tk, dv)`` → ``(B, Hq, Tq, dv)`` (an additive ``bias`` needs SDPA)."""
        backend = "sdpa" if bias is not None else select_backend(self.backend, q.device, q.dtype, q.shape[-1],
                                                                  v.shape[-1])
        return attend(q, k, v, scale=self.scales[layer], backend=backend, bias=bias)


class CompressionMethod:
    """One way of caching and attending, plugged into :class:`~kvsplice.decode.decoder.Decoder`.

    Override :meth:`new_cache`, :meth:`attention` and, where the method has settings to check against the model or
    weights to precompute, :meth:`bind`. ``needs_projections`` (default True): the method computes attention from
    the layer's q/k/v/o weights (post-training methods; models whose cache is already a latent are refused).
    """

    name: str = "method"
    needs_projections: bool = True
    cache_type: type = DecodeCache

    def bind(self, adapter: FamilyAdapter, *, dtype: torch.dtype, device: torch.device) -> None:
        """Called once by the decoder: check the model, precompute what the method needs (folded weights)."""
        if self.needs_projections:
            adapter.require_projections()

    def new_cache(self, adapter: FamilyAdapter, batch_size: int, capacity: Optional[int] = None, *,
                  dtype: torch.dtype, device: torch.device) -> DecodeCache:
        """An empty cache for ``batch_size`` sequences (``capacity``: tokens held per layer, preallocated)."""
        raise NotImplementedError

    def check_cache(self, cache: DecodeCache) -> None:
        """Raise ``TypeError`` for a cache this method cannot use."""
        if not isinstance(cache, self.cache_type):
            raise TypeError(f"{type(self).__name__} needs a {self.cache_type.__name__} from decoder.new_cache(), got "
                            f"{type(cache).__name__}")

    def capacity(self, prompt_len: int, max_new_tokens: int) -> int:
        """Tokens the cache holds at the end of ``generate`` (exact preallocation)."""
        return prompt_len + max(max_new_tokens, 1) - 1

    def attention(self, layer: int, h: torch.Tensor, cache: DecodeCache, step: Step) -> torch.Tensor:
        """The attention block of ``layer`` for the normalised hidden states ``h (B, T, d_model)`` of the new
        tokens: update ``cache`` with them and return the block's output ``(B, T, d_model)`` (output projection
        included)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
