"""A fixed-capacity view of a decode cache: every step has the same shapes, so a decode step can be captured once as
a CUDA graph and replayed (:mod:`models.graph_decode`).

A normal cached step attends over the ``T`` tokens held, and ``T`` grows by one per step: the shapes change, so the
step cannot be replayed from a graph, and on a GPU each new key length can even cost a new kernel plan. The view
instead hands the attention the whole preallocated storage ``(B, *lead, capacity, D)`` and a per-key bias ``(1, 1,
capacity)`` of 0 for the rows held and ``-inf`` for the rest, and writes the new token's row at a position held in a
device tensor. The step's work is that of attending over ``capacity`` keys (as transformers' ``StaticCache`` does over
its maximum length); the bytes cached are the cache's own — the view allocates only the bias, a length and two index tensors (and, for an int8 cache, a dequantisation
workspace of one layer's storage when the eager attention reads it).

Exactness: the masked rows get probability exactly 0, so the result equals the step over the ``T`` rows held
(``tests/models/test_graph_decode.py``). Rows never written are zeroed when the view is made (uninitialised memory could
hold NaN, and ``0·NaN`` is NaN).
"""

from __future__ import annotations

from typing import Iterator

import torch

from models.cache import Cache
from models.stream_cache import DecodeCache


class StaticCacheView(Cache):
    """One-token steps over ``cache`` at fixed shapes (stream caches, int8 ones included; every layer the same
    length).

    A step is ``view.sync()`` (Python: :attr:`pos` from the cache's length), then the part a CUDA graph captures —
    ``view.begin_step()`` (the bias for that length, computed on the device) and ``model(tok, cache=view)``, whose
    ``append`` calls write at :attr:`pos` — then ``view.commit()`` (Python: count the token in the cache).
    """

    kind = "static_view"
    fixed_shape = True

    def __init__(self, cache: DecodeCache) -> None:
        if not isinstance(cache, DecodeCache):
            raise TypeError(f"a fixed-capacity view needs a DecodeCache, got {type(cache).__name__}")
        lengths = {cache.layer_len(i) for i in range(cache.n_layer)}
        if len(lengths) != 1:
            raise ValueError(f"every layer must hold the same number of tokens, got {sorted(lengths)}")
        if cache.quant not in (None, "int8"):
            raise ValueError(f"a fixed-capacity view covers full-precision and int8 caches, not {cache.quant!r}")
        self.inner = cache
        self.batch_size, self.dtype, self.device, self.quant = cache.batch_size, cache.dtype, cache.device, cache.quant
        cap = cache.capacity
        n = cache.seq_len
        if n >= cap:
            raise ValueError(f"the cache is full ({n} of {cap} tokens): build it with a capacity for the tokens to "
                             f"decode (model.new_cache(batch, capacity=prompt + new tokens))")
        with torch.no_grad():
            for layer in range(cache.n_layer):
                for buf in cache.storage(layer).values():
                    buf[..., n:, :].zero_()  # never-written rows: finite, so masking them is exact
        self.pos = torch.full((), n, dtype=torch.long, device=self.device)  # row the next step writes
        self._keys = torch.arange(cap, device=self.device)  # (capacity,)
        self._bias = torch.zeros(1, 1, cap, dtype=self.dtype, device=self.device)  # (1, 1, capacity)
        self._lengths = torch.full((1,), n + 1, dtype=torch.int32, device=self.device)  # rows <= pos: (1,)

    # ---------------------------------------------------------------------------------------- the step
    def begin_step(self) -> None:
        """Bias for the step about to run: 0 for rows ``<= pos`` (held + the new one), ``-inf`` after."""
        visible = (self._keys <= self.pos).view(1, 1, -1)  # (1, 1, capacity)
        self._bias.copy_(torch.where(visible, 0.0, float("-inf")))
        self._lengths.copy_(self.pos + 1)  # the same rows as a length (kernels that read only those)

    def append(self, layer: int, **new: torch.Tensor) -> dict[str, torch.Tensor]:
        """Write one token's rows ``(B, *lead, 1, D)`` at :attr:`pos`; return the whole storage of ``layer`` (int8
        rows dequantised into a capacity-sized workspace shared by the layers: fixed shapes)."""
        bufs = self.append_rows(layer, **new)
        if self.quant is None:
            return {name: bufs[name] for name in new}
        out = {}
        for name in new:
            ws = self.inner._workspace(name, tuple(bufs[name].shape))  # (B, *lead, capacity, D) at dtype
            out[name] = self.inner._dequantized(layer, name, ws.shape[-2], ws)  # every row of the storage
        return out

    def append_rows(self, layer: int, **new: torch.Tensor) -> dict[str, torch.Tensor]:
        """Write one token's rows at :attr:`pos`; return the whole stored rows of ``layer`` as they are (int8 rows
        with their ``name.scale`` buffers when quantised: for a kernel that dequantises as it reads)."""
        bufs = self.inner.storage(layer)
        for name, x in new.items():
            if x.shape[-2] != 1:
                raise ValueError(f"a fixed-capacity view appends one token per step, got {x.shape[-2]}")
            q = self.inner.quantizer(name)
            for part, rows in ({"": x} if q is None else q.quantize(x)).items():  # (B, *lead, 1, width) each
                bufs[name + part].index_copy_(-2, self.pos.view(1), rows)  # (B, *lead, capacity, width), row pos
        return bufs

    def key_bias(self) -> torch.Tensor:
        return self._bias  # (1, 1, capacity)

    def key_lengths(self) -> torch.Tensor:
        return self._lengths  # (1,) int32: pos + 1 rows held after this step's append

    def positions(self, t: int, device: torch.device) -> torch.Tensor:
        return self.pos.view(1) + torch.arange(t, device=device)  # (t,)

    def sync(self) -> None:
        """Set :attr:`pos` from the underlying cache's length, before a step; refuse a full cache (the storage must
        never grow under a captured graph)."""
        n = self.inner.seq_len
        if n >= self.inner.capacity:
            raise ValueError(f"the cache is full ({n} of {self.inner.capacity} tokens): build it with a capacity "
                             f"for every token to decode")
        self.pos.fill_(n)

    def commit(self) -> None:
        """Count the token the step wrote in the underlying cache (its lengths; the rows are written already)."""
        for layer in range(self.inner.n_layer):
            self.inner.reserve(layer, 1, written=True)  # lengths += 1; sync() checked there is room, so nothing grows

    # ---------------------------------------------------------------------------------------- Cache interface
    @property
    def n_layer(self) -> int:
        return self.inner.n_layer

    @property
    def seq_len(self) -> int:
        return self.inner.seq_len

    @property
    def position(self) -> int:
        return self.inner.position

    def tensors(self) -> Iterator[torch.Tensor]:
        return self.inner.tensors()

    def storage_nbytes(self) -> int:
        return self.inner.storage_nbytes()

    def elements_per_token(self) -> float:
        return self.inner.elements_per_token()

    def reset(self) -> None:
        self.inner.reset()
        self.pos.fill_(0)

    def truncate(self, n: int) -> None:
        self.inner.truncate(n)
