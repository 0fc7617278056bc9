"""What a :class:`~kvsplice.online.chunked.ChunkedCache` holds, by kind, for its byte counts.

The coefficients, every basis the cache holds (each shared value basis once; none for identity chunks) and the FD
sketches (fixed ``2 · 2ℓ · (d + d_v)`` floats per layer, KV head and sequence). ``nbytes()`` is their sum;
``storage_nbytes()`` adds the unused tail of the active chunks' grown buffers.
"""

from __future__ import annotations

from typing import Iterable, Iterator, Sequence

import torch

from kvsplice.online.chunks import Stream
from kvsplice.online.fd import FrequentDirections

__all__ = ["KINDS", "held_tensors", "nbytes_by_kind", "unused_tail_nbytes"]

KINDS = ("key_coefficients", "value_coefficients", "key_bases", "value_bases", "sketch")
"""The kinds of tensor a chunked cache holds (the keys of ``nbytes_breakdown()``)."""


def held_tensors(streams: Sequence[Sequence[Stream]], fd_k: Sequence[FrequentDirections],
                 fd_v: Sequence[FrequentDirections]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(kind, tensor)`` for every tensor held: per layer its streams' chunks (``streams[layer]``) and sketches."""
    for layer, layer_streams in enumerate(streams):
        for s in layer_streams:
            for c in s.chunks():
                yield "key_coefficients", c.a
                yield "value_coefficients", c.b
                if c.bk is not None:
                    yield "key_bases", c.bk
                if c.be is not None and c.be is not s.shared_e:
                    yield "value_bases", c.be
            if s.shared_e is not None:
                yield "value_bases", s.shared_e
        yield "sketch", fd_k[layer].buffer
        yield "sketch", fd_v[layer].buffer


def nbytes_by_kind(held: Iterable[tuple[str, torch.Tensor]]) -> dict[str, int]:
    """Bytes of ``held`` (:func:`held_tensors`) per kind of :data:`KINDS`."""
    out = dict.fromkeys(KINDS, 0)
    for kind, x in held:
        out[kind] += x.numel() * x.element_size()
    return out


def unused_tail_nbytes(streams: Sequence[Sequence[Stream]]) -> int:
    """Bytes allocated past the tokens of every active chunk (its buffers grow geometrically)."""
    extra = 0
    for layer_streams in streams:
        for s in layer_streams:
            if s.active is not None:
                for buf in (s.active.a_buf, s.active.b_buf):
                    extra += (buf.shape[-2] - s.active.n) * buf[..., :1, :].numel() * buf.element_size()
    return extra
