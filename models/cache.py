"""The decode-cache interface every cache in the project implements (:class:`Cache`).

The caches: full K/V, MLA latent and KVSplice compressed latent (:mod:`models.stream_cache`: named streams
``(B, *lead, T, D)``, time the second-to-last dim), and the post-training coefficient / chunk / token-subset caches.

The interface:

* ``append(layer, **new)`` — write a layer's new entries (each ``(B, *lead, T_new, D)``) and return views of the
  whole stream ``(B, *lead, T, D)`` after the append (or ``None``: a cache with another layout);
* ``seq_len`` — tokens held (the same for every layer between forward calls);
* ``position`` — the absolute position of the next token: tokens the sequence has seen. Every decode path
  (``GPT.forward`` included) takes positions from it. It equals ``seq_len`` unless a method drops tokens (token
  selection keeps a subset of the prompt, its ``position`` stays the prompt length);
* ``nbytes()`` — bytes of what the cache holds (sum of the live views' sizes);
* ``storage_nbytes()`` — bytes of the allocated buffers (== ``nbytes()`` when ``capacity`` was exact);
* ``tensors()`` — the live views, for independent measurement;
* ``reset()`` — forget all tokens, keep the buffers;
* ``truncate(n)`` — keep only the first ``n`` tokens of every layer, keep the buffers (roll back a decode step).
"""

from __future__ import annotations

from typing import Iterator

import torch

__all__ = ["Cache"]


class Cache:
    """The decode-cache interface every cache implements (see the module docstring).

    :class:`~models.stream_cache.DecodeCache` implements it with preallocated named streams; a cache with another
    layout (the online method's chunks) implements it directly. ``append`` may return views of what the layer holds
    (stream caches do) or ``None``.
    """

    kind: str = "cache"
    quant: str | None = None
    fixed_shape: bool = False
    """Every step sees the same shapes (a fixed-capacity view for CUDA graphs): kernels that plan per shape pay once."""
    batch_size: int
    dtype: torch.dtype
    device: torch.device

    @property
    def n_layer(self) -> int:
        raise NotImplementedError

    @property
    def seq_len(self) -> int:
        """Tokens held per layer."""
        raise NotImplementedError

    @property
    def position(self) -> int:
        """Absolute position of the next token (tokens the sequence has seen)."""
        raise NotImplementedError

    def append(self, layer: int, **new: torch.Tensor):
        raise NotImplementedError

    def positions(self, t: int, device: torch.device) -> torch.Tensor:
        """Absolute positions ``(t,)`` of the next ``t`` tokens (a fixed-capacity view reads them from the device)."""
        return torch.arange(self.position, self.position + t, device=device)

    def key_bias(self) -> torch.Tensor | None:
        """An additive per-key bias ``(1, 1, Tk)`` every attention over what :meth:`append` returned must add, or
        None: a fixed-capacity view (:class:`models.static_cache.StaticCacheView`) returns its whole storage and
        masks the rows not written yet with ``-inf``."""
        return None

    def key_lengths(self) -> torch.Tensor | None:
        """The keys held, ``(1,)`` on the device, when :meth:`append` returns more rows than that (a fixed-capacity
        view, whose :meth:`key_bias` masks the rest): a kernel that takes lengths reads only these rows. Else None."""
        return None

    def tensors(self) -> Iterator[torch.Tensor]:
        """Every tensor the cache holds (the live views), for independent measurement."""
        raise NotImplementedError

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def storage_nbytes(self) -> int:
        raise NotImplementedError

    def elements_per_token(self) -> float:
        raise NotImplementedError

    def reset(self) -> None:
        raise NotImplementedError

    def truncate(self, n: int) -> None:
        raise NotImplementedError
