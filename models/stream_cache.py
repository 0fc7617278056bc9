"""Decode caches of named streams (:class:`DecodeCache`), and the model caches built on it: full K/V
(:class:`KVCache`), the MLA latent (:class:`LatentCache`) and the KVSplice compressed latent
(:class:`CompressedLatentCache`); the interface they implement is :class:`models.cache.Cache`.

A cache holds, per layer, a few named *streams*. A stream stores one tensor of shape ``(B, *lead, T, D)`` — time is
always the second-to-last dim — so full K/V is ``{"k": (H, hs), "v": (H, hs)}`` → ``(B, H, T, hs)`` and an MLA
latent is ``{"c": (d_latent,)}`` → ``(B, T, d_latent)``.

Storage is preallocated and grows geometrically, so appending one token copies only that token (no
``torch.cat`` of the whole cache per step). Pass ``capacity`` when the final length is known (``generate`` and the
memory tools do) and the storage is exactly the logical size, so measured bytes equal the formula.
"""

from __future__ import annotations

import math
from typing import Iterator, Mapping, Sequence

import torch

from models.cache import Cache
from models.quant import QUANT_MODES, Quantizer, row_quantizer

StreamSpec = Mapping[str, Sequence[int]]
"""name -> per-token shape ``(*lead, D)``; stored as ``(B, *lead, T, D)``."""

__all__ = ["CompressedLatentCache", "DecodeCache", "KVCache", "LatentCache", "StreamSpec"]


class DecodeCache(Cache):
    """Per-layer named streams with amortised O(1) appends along the time axis (dim -2).

    ``quant`` (:data:`models.quant.QUANT_MODES`): ``None`` stores the streams at ``dtype``; ``"int8"`` each token's
    row as int8 with one fp16 absmax scale per row (per token, layer, stream and leading index such as the head);
    ``"int4"`` each row as 4-bit codes, two per byte, in groups of 32 numbers (or the whole row) with an fp16 scale
    and minimum each (:mod:`models.quant`: the quantiser, its parts ``name``, ``name.scale``, ``name.min`` and bytes).
    A mapping ``{stream: mode}`` quantises each stream its own way (``{"k": "int8", "v": "int4"}``; a stream it does
    not name is stored at ``dtype``)."""

    kind: str = "generic"

    def __init__(
        self,
        specs: Sequence[StreamSpec],
        batch_size: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        capacity: int | None = None,
        quant: str | None | Mapping[str, str | None] = None,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if capacity is not None and capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.specs = [{name: tuple(int(s) for s in shape) for name, shape in spec.items()} for spec in specs]
        names = {name for spec in self.specs for name in spec}
        if isinstance(quant, Mapping):
            if not set(quant) <= names or any(m not in QUANT_MODES for m in quant.values()):
                raise ValueError(f"quant must map streams of {sorted(names)} to one of {QUANT_MODES}, got {quant!r}")
            modes = {name: quant.get(name) for name in names}
            if len(set(modes.values())) == 1:  # one mode for every stream: the plain form
                quant = next(iter(modes.values()))
            else:
                quant = dict(sorted(modes.items()))
        elif quant not in QUANT_MODES:
            raise ValueError(f"quant must be one of {QUANT_MODES} or a mapping of streams to them, got {quant!r}")
        self._modes = dict(quant) if isinstance(quant, dict) else {name: quant for name in names}
        self._quantizers = {name: row_quantizer(mode) for name, mode in self._modes.items()}
        if any(self._modes[name] == "int4" and shape[-1] % 2 for spec in self.specs for name, shape in spec.items()):
            raise ValueError("an int4 cache packs two numbers per byte: every int4 stream's last dim must be even")
        self.batch_size = int(batch_size)
        self.dtype = dtype
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.quant = quant
        self._ws: dict[str, torch.Tensor] = {}
        self._initial_capacity = capacity
        self._layouts = [self._layout(spec) for spec in self.specs]
        self._buffers: list[dict[str, torch.Tensor]] = [
            {name: self._alloc(shape, dt, capacity or 0) for name, (shape, dt) in layout.items()}
            for layout in self._layouts
        ]
        self._lengths = [0] * len(self.specs)
        self._seen = [0] * len(self.specs)

    # ----------------------------------------------------------------------------------------------- storage
    def _layout(self, spec: dict[str, tuple[int, ...]]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Storage buffers of one layer: name -> (per-token shape, dtype); a quantised stream adds its scales."""
        out = {}
        for name, shape in spec.items():
            q = self._quantizers[name]
            if q is None:
                out[name] = (shape, self.dtype)
                continue
            for part, (width, dt) in q.parts(shape[-1]).items():  # the codes, their scales (and minima)
                out[name + part] = ((*shape[:-1], width), dt)
        return out

    def _alloc(self, shape: tuple[int, ...], dtype: torch.dtype, capacity: int) -> torch.Tensor:
        *lead, d = shape
        return torch.empty(self.batch_size, *lead, capacity, d, dtype=dtype, device=self.device)

    def _ensure(self, layer: int, needed: int) -> None:
        bufs = self._buffers[layer]
        cap = next(iter(bufs.values())).shape[-2] if bufs else 0
        if needed <= cap:
            return
        new_cap = max(needed, 2 * cap, 16)
        n = self._lengths[layer]
        for name, buf in bufs.items():
            shape, dt = self._layouts[layer][name]
            grown = self._alloc(shape, dt, new_cap)
            grown[..., :n, :] = buf[..., :n, :]
            bufs[name] = grown

    # --------------------------------------------------------------------------------------------- interface
    @property
    def n_layer(self) -> int:
        return len(self.specs)

    @property
    def seq_len(self) -> int:
        return min(self._lengths) if self._lengths else 0

    @property
    def position(self) -> int:
        """Absolute position of the next token (tokens seen, the same for every layer between forward calls)."""
        return min(self._seen) if self._seen else 0

    def advance(self, layer: int, n: int) -> None:
        """Count ``n`` tokens as seen by ``layer`` without storing them (a method that drops tokens)."""
        self._seen[layer] += int(n)

    def layer_len(self, layer: int) -> int:
        return self._lengths[layer]

    @property
    def capacity(self) -> int:
        """Tokens every layer's storage holds before it must grow."""
        return min(next(iter(b.values())).shape[-2] for b in self._buffers) if self._buffers else 0

    def storage(self, layer: int) -> dict[str, torch.Tensor]:
        """The whole storage of ``layer`` per buffer, ``(B, *lead, capacity, D)``, rows past :meth:`layer_len`
        included (a fixed-capacity view writes and reads it in place)."""
        return self._buffers[layer]

    def append(self, layer: int, **new: torch.Tensor) -> dict[str, torch.Tensor]:
        """Append ``new[name]`` of shape ``(B, *lead, T_new, D)`` to every stream of ``layer``; return full views."""
        return self._append(layer, new, dequantized=True)

    def append_rows(self, layer: int, **new: torch.Tensor) -> dict[str, torch.Tensor]:
        """:meth:`append`, returning the stored rows as they are: for a quantised cache the int8 rows and their fp16
        ``name.scale`` views (:meth:`stored`), with no dequantised copy — for a kernel that dequantises as it reads
        (:mod:`models.kernels`)."""
        self._append(layer, new, dequantized=False)
        return self.stored(layer)

    def _append(self, layer: int, new: dict[str, torch.Tensor], dequantized: bool) -> dict[str, torch.Tensor]:
        spec = self.specs[layer]
        if set(new) != set(spec):
            raise KeyError(f"layer {layer} holds streams {sorted(spec)}, got {sorted(new)}")
        t_new = {t.shape[-2] for t in new.values()}
        if len(t_new) != 1:
            raise ValueError(f"all streams must append the same number of tokens, got {sorted(t_new)}")
        (t_new,) = t_new
        n = self._lengths[layer]
        self._ensure(layer, n + t_new)
        out = {}
        for name, x in new.items():
            expect = (self.batch_size, *spec[name][:-1], t_new, spec[name][-1])
            if tuple(x.shape) != expect:
                raise ValueError(f"stream {name!r} of layer {layer}: expected shape {expect}, got {tuple(x.shape)}")
            buf = self._buffers[layer][name]
            if self._modes[name] is None:
                buf[..., n : n + t_new, :] = x
                out[name] = buf[..., : n + t_new, :]
            else:  # quantised rows; the attention call reads them dequantised into the workspace
                self._quantize_into(layer, name, x, n)
                if not dequantized:
                    continue
                shape = (*buf.shape[:-1], spec[name][-1])  # (B, *lead, capacity, D)
                out[name] = self._dequantized(layer, name, n + t_new, self._workspace(name, shape))
        self._lengths[layer] = n + t_new
        self._seen[layer] += t_new
        return out

    def _quantize_into(self, layer: int, name: str, x: torch.Tensor, n: int) -> None:
        """Store rows ``x (B, *lead, T, D)`` of stream ``name`` quantised at rows ``n:n + T``."""
        bufs, t = self._buffers[layer], x.shape[-2]
        for part, rows in self._quantizers[name].quantize(x).items():  # (B, *lead, T, width) each
            bufs[name + part][..., n : n + t, :] = rows

    def _dequantized(self, layer: int, name: str, n: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """The first ``n`` rows of quantised stream ``name`` at ``dtype``, ``(B, *lead, n, D)`` (into the first ``n``
        rows of ``out`` when given)."""
        q, bufs, d = self._quantizers[name], self._buffers[layer], self.specs[layer][name][-1]
        parts = {part: bufs[name + part][..., :n, :] for part in q.parts(d)}  # (B, *lead, n, width) each
        return q.dequantize(parts, d, self.dtype, None if out is None else out[..., :n, :])

    def reserve(self, layer: int, t_new: int, *, written: bool = False) -> tuple[int, dict[str, torch.Tensor]]:
        """An append without a temporary (unquantised caches): make room for ``t_new`` more tokens of ``layer``, count
        them as held and seen, and return ``(t0, buffers)`` — the length before and the layer's whole storage per
        stream, ``(B, *lead, capacity, D)``. The caller writes ``[..., t0:t0 + t_new, :]`` (e.g. as the ``out=`` of
        its projection) before it reads ``[..., :t0 + t_new, :]``; bytes and :meth:`tensors` are those of
        :meth:`append` (same buffers, same lengths). The buffers are replaced when the cache grows. ``written``: the
        rows are in the storage already, int8 ones with their scales (a fixed-capacity view counts its step)."""
        if self.quant is not None and not written:
            raise ValueError("reserve() writes rows in place; a quantised cache appends with append()")
        t0 = self._lengths[layer]
        self._ensure(layer, t0 + t_new)  # grows geometrically (a no-op when there is room)
        self._lengths[layer] = t0 + t_new
        self._seen[layer] += t_new
        return t0, self._buffers[layer]

    def _workspace(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The scratch a quantised stream is dequantised into for one attention call: one buffer per stream name,
        shared by all layers (each layer's call overwrites it), so the views ``append`` returns are valid until the
        next ``append`` of that stream. Reusing it avoids allocating (and page-faulting) a full-size tensor per
        layer per step; it holds one layer's rows at ``dtype`` and is not part of the cache (:meth:`workspace_nbytes`)."""
        ws = self._ws.get(name)
        if ws is None or tuple(ws.shape) != tuple(shape):
            ws = torch.empty(shape, dtype=self.dtype, device=self.device)
            self._ws[name] = ws
        return ws

    def workspace_nbytes(self) -> int:
        """Bytes of the dequantisation scratch (0 unless quantised): transient, one layer's streams at ``dtype``."""
        return sum(w.numel() * w.element_size() for w in self._ws.values())

    def get(self, layer: int) -> dict[str, torch.Tensor]:
        """What ``layer`` holds, ``(B, *lead, T, D)`` per stream at ``dtype``: views, or transient dequantised
        tensors for a quantised cache."""
        if self.quant is None:
            return self.stored(layer)
        n, bufs = self._lengths[layer], self._buffers[layer]
        return {name: bufs[name][..., :n, :] if self._modes[name] is None else self._dequantized(layer, name, n)
                for name in self.specs[layer]}

    def quantizer(self, name: str) -> Quantizer | None:
        """The quantiser of stream ``name`` (:mod:`models.quant`), None when it is stored at ``dtype``."""
        return self._quantizers[name]

    def mode(self, name: str) -> str | None:
        """How stream ``name`` is stored: ``None`` (at ``dtype``), ``"int8"`` or ``"int4"``
        (:data:`models.quant.QUANT_MODES`)."""
        return self._modes[name]

    def stored(self, layer: int) -> dict[str, torch.Tensor]:
        """Views of the storage of ``layer`` (int8 values and fp16 ``name.scale`` rows when quantised; int4: packed
        codes, ``name.scale`` and ``name.min``)."""
        n = self._lengths[layer]
        return {name: buf[..., :n, :] for name, buf in self._buffers[layer].items()}

    def tensors(self) -> Iterator[torch.Tensor]:
        for layer in range(self.n_layer):
            yield from self.stored(layer).values()

    def storage_nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for bufs in self._buffers for b in bufs.values())

    def elements_per_token(self) -> int:
        """Elements stored per token per sequence, summed over layers and streams (scales not counted)."""
        return sum(math.prod(shape) for spec in self.specs for shape in spec.values())

    def bytes_per_token(self) -> int:
        """Bytes stored per token per sequence over layers and streams: ``D·element size`` per row, and with
        a quantised stream :meth:`models.quant.Quantizer.row_bytes` a row."""
        return sum(math.prod(shape) * torch.empty((), dtype=dt).element_size()
                   for layout in self._layouts for shape, dt in layout.values())

    def reset(self) -> None:
        self._lengths = [0] * len(self.specs)
        self._seen = [0] * len(self.specs)

    def truncate(self, n: int) -> None:
        """Keep only the first ``n`` tokens of every layer (buffers are kept; later appends overwrite the rest).

        ``truncate(seq_len - k)`` undoes the last ``k`` appended tokens (``position`` goes back by ``k`` too), e.g. to
        time decode steps at a fixed context length, or to roll back speculative tokens. ``truncate(0)`` is
        ``reset()``.
        """
        n = int(n)
        if n < 0 or any(n > length for length in self._lengths):
            raise ValueError(f"truncate({n}): must be between 0 and the tokens held by every layer "
                             f"({min(self._lengths) if self._lengths else 0})")
        dropped = min(self._lengths) - n
        self._lengths = [n] * len(self.specs)
        self._seen = [s - dropped for s in self._seen]

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(layers={self.n_layer}, batch={self.batch_size}, seq_len={self.seq_len}, "
            f"position={self.position}, quant={self.quant}, "
            f"dtype={self.dtype}, nbytes={self.nbytes()})"
        )


class KVCache(DecodeCache):
    """Full keys and values (standard multi-head attention): ``k, v`` as ``(B, H, T, hs)`` per layer."""

    kind = "kv"

    def __init__(self, n_layer: int, n_head: int, head_size: int, batch_size: int, **kw) -> None:
        spec = {"k": (n_head, head_size), "v": (n_head, head_size)}
        super().__init__([spec] * n_layer, batch_size, **kw)


class LatentCache(DecodeCache):
    """MLA: one shared latent ``c`` per token per layer, ``(B, T, d_latent)``; K and V are derived from it."""

    kind = "latent"

    def __init__(self, n_layer: int, d_latent: int, batch_size: int, **kw) -> None:
        super().__init__([{"c": (d_latent,)}] * n_layer, batch_size, **kw)


class CompressedLatentCache(LatentCache):
    """MLA + KVSplice: the compressed latent ``s = C c`` per token per layer, ``(B, T, d_compressed)``.

    Stored under the same stream name ``"c"`` as :class:`LatentCache` so the attention code reads either.
    """

    kind = "compressed_latent"
