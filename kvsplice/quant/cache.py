"""``KIVICache``: per layer and KV head, KIVI-style quantised keys and values plus a full-precision recent window.

Of the ``n`` tokens a layer holds, the oldest ``n_q = G·⌊max(0, n − R)/G⌋`` are quantised (``G`` = ``group``,
``R`` = ``residual``) and the rest, at least the last ``R``, stay at the cache dtype; every append re-applies the
rule, so the split depends on ``n`` only. Quantised streams (each a :class:`models.stream_cache.DecodeCache`, time on
dim -2):

* ``codes`` — ``k, v (B, Hkv, n_q, D·bits/8)`` uint8: ``8/bits`` codes per byte;
* ``kstat`` — keys per channel over groups of ``G`` tokens: ``s, m (B, Hkv, n_q/G, D)`` fp16 (time = groups);
* ``vstat`` — values per token over groups of ``G`` channels: ``s, m (B, Hkv, n_q, D/G)`` fp16;

and the residual ``k, v (B, Hkv, n − n_q, D)``. Bytes (:func:`kivi_bytes`), per layer, KV head and sequence:
``2·n_q·D·bits/8 + 2·(n_q/G)·D·2 + 2·n_q·(D/G)·2 + 2·(n − n_q)·D·el`` — 4-bit, ``G = 32``: 5 bits per number.
"""

from __future__ import annotations

import itertools
from typing import Iterator, Optional

import torch

from kvsplice.core.coded import ChannelGroupKeys, Rows, Segment
from models.cache import Cache
from models.quant import MIN, SCALE, GroupRows
from models.stream_cache import DecodeCache

__all__ = ["KIVICache", "kivi_bytes", "n_quantised"]


def n_quantised(n: int, group: int, residual: int) -> int:
    """Tokens of ``n`` held that are quantised: whole groups beyond the ``residual`` most recent."""
    return group * (max(0, n - residual) // group)


def kivi_bytes(n_layer: int, n_kv_head: int, head_dim: int, batch_size: int, n_held: int, *, bits: int, group: int,
               residual: int, dtype: torch.dtype) -> int:
    """Bytes a :class:`KIVICache` holds for ``n_held`` tokens per layer (see the module docstring)."""
    nq = n_quantised(n_held, group, residual)
    el = torch.empty((), dtype=dtype).element_size()
    per_head = (2 * nq * head_dim * bits // 8 + 2 * (nq // group) * head_dim * 2 + 2 * nq * (head_dim // group) * 2
                + 2 * (n_held - nq) * head_dim * el)
    return n_layer * n_kv_head * batch_size * per_head


class KIVICache(Cache):
    """See the module docstring. :meth:`append` stores new post-RoPE ``k, v (B, Hkv, T, D)`` and returns the layer's
    keys and values at the cache dtype (quantised part dequantised into a shared workspace, then the residual)."""

    kind = "kivi"

    def __init__(self, n_layer: int, n_kv_head: int, head_dim: int, batch_size: int, *, bits: int = 4,
                 group: int = 32, residual: int = 128, dtype: torch.dtype = torch.float32,
                 device: Optional[torch.device | str] = None, capacity: Optional[int] = None) -> None:
        if head_dim % group or (head_dim * bits) % 8:
            raise ValueError(f"head_dim {head_dim} must be a multiple of group {group} (and of {8 // bits} codes "
                             f"per byte)")
        h, d = n_kv_head, head_dim
        kw = dict(device=device, capacity=capacity)
        self.codes = DecodeCache([{"k": (h, d * bits // 8), "v": (h, d * bits // 8)}] * n_layer, batch_size,
                                 dtype=torch.uint8, **kw)
        self.kstat = DecodeCache([{"s": (h, d), "m": (h, d)}] * n_layer, batch_size, dtype=torch.float16,
                                 device=device, capacity=None if capacity is None else capacity // group)
        self.vstat = DecodeCache([{"s": (h, d // group), "m": (h, d // group)}] * n_layer, batch_size,
                                 dtype=torch.float16, **kw)
        empty = torch.empty(batch_size, h, 0, d, dtype=dtype, device=device)
        self.res_k = [empty] * n_layer  # (B, Hkv, n − n_q, D) per layer
        self.res_v = [empty] * n_layer
        self.bits, self.group, self.residual = bits, group, residual
        self.quantizer = GroupRows(bits, group)  # keys: groups along tokens, values: along channels
        self.n_kv_head, self.head_dim = h, d
        self.batch_size, self.dtype = batch_size, dtype
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._seen = [0] * n_layer
        self._ws: dict[str, torch.Tensor] = {}

    # ------------------------------------------------------------------------------------------- interface
    @property
    def n_layer(self) -> int:
        return self.codes.n_layer

    def layer_len(self, layer: int) -> int:
        return self.codes.layer_len(layer) + self.res_k[layer].shape[2]

    @property
    def seq_len(self) -> int:
        return min(self.layer_len(l) for l in range(self.n_layer))

    @property
    def position(self) -> int:
        return min(self._seen)

    def advance(self, layer: int, n: int) -> None:
        """Count ``n`` dropped tokens as seen (a token selection's)."""
        self._seen[layer] += int(n)

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
        self._append(layer, k, v)
        return self.get(layer)

    def _append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        rk = torch.cat([self.res_k[layer], k.to(self.dtype)], 2)  # (B, Hkv, r + T, D)
        rv = torch.cat([self.res_v[layer], v.to(self.dtype)], 2)
        n_q0 = self.codes.layer_len(layer)
        flush = n_quantised(n_q0 + rk.shape[2], self.group, self.residual) - n_q0  # whole groups leaving the window
        if flush > 0:
            self._quantise(layer, rk[:, :, :flush], rv[:, :, :flush])
            rk, rv = rk[:, :, flush:], rv[:, :, flush:]
        self.res_k[layer], self.res_v[layer] = rk.contiguous(), rv.contiguous()
        self._seen[layer] += k.shape[2]

    def append_segments(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> list[Segment]:
        """:meth:`append`, returning what ``layer`` holds as it is stored, for :func:`kvsplice.core.coded.coded_attend`:
        the quantised tokens (codes, their groups' scales and minima; 4 bits) and the full-precision window — no
        dequantised copy."""
        self._append(layer, k, v)
        out = []
        nq = self.codes.layer_len(layer)
        if nq:
            codes, ks, vs = self.codes.stored(layer), self.kstat.stored(layer), self.vstat.stored(layer)
            out.append(Segment(ChannelGroupKeys(codes["k"], ks["s"], ks["m"], self.bits),
                               Rows("int4", codes["v"], vs["s"], vs["m"])))
        if self.res_k[layer].shape[2]:
            out.append(Segment(Rows("float", self.res_k[layer]), Rows("float", self.res_v[layer])))
        return out

    def _quantise(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        kq = self.quantizer.quantize_tokens(k)  # per channel over G tokens: codes (B, H, n, D·bits/8), (B, H, n/G, D)
        vq = self.quantizer.quantize(v)  # per token over G channels: codes (B, H, n, D·bits/8), stats (B, H, n, D/G)
        self.codes.append(layer, k=kq[""], v=vq[""])
        self.kstat.append(layer, s=kq[SCALE], m=kq[MIN])  # (B, H, n/G, D)
        self.vstat.append(layer, s=vq[SCALE], m=vq[MIN])  # (B, H, n, D/G)

    def get(self, layer: int) -> dict[str, torch.Tensor]:
        """Keys and values of ``layer`` at the cache dtype, ``(B, Hkv, n, D)`` each (oldest first)."""
        nq = self.codes.layer_len(layer)
        if nq == 0:
            return {"k": self.res_k[layer], "v": self.res_v[layer]}
        b, h, d = self.batch_size, self.n_kv_head, self.head_dim
        codes, ks, vs = self.codes.stored(layer), self.kstat.stored(layer), self.vstat.stored(layer)
        n = nq + self.res_k[layer].shape[2]
        q = self.quantizer
        held = {"k": q.dequantize_tokens({"": codes["k"], SCALE: ks["s"], MIN: ks["m"]}, self.dtype),  # (B, H, n_q, D)
                "v": q.dequantize({"": codes["v"], SCALE: vs["s"], MIN: vs["m"]}, d, self.dtype)}  # (B, H, n_q, D)
        out = {}
        for name, res in (("k", self.res_k[layer]), ("v", self.res_v[layer])):
            ws = self._workspace(name, (b, h, n, d))  # (B, H, n, D): the quantised tokens, then the window
            ws[:, :, :nq], ws[:, :, nq:] = held[name], res
            out[name] = ws
        return out

    def _workspace(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """One dequantisation scratch per stream shared by all layers (each call overwrites it; not cache bytes)."""
        ws = self._ws.get(name)
        if ws is None or ws.shape[2] < shape[2] or ws.shape[:2] != shape[:2]:
            ws = torch.empty(shape[0], shape[1], max(shape[2], 2 * (0 if ws is None else ws.shape[2])), shape[3],
                             dtype=self.dtype, device=self.device)
            self._ws[name] = ws
        return ws[:, :, :shape[2]]

    # ----------------------------------------------------------------------------------------------- bytes
    def tensors(self) -> Iterator[torch.Tensor]:
        return itertools.chain(self.codes.tensors(), self.kstat.tensors(), self.vstat.tensors(), self.res_k,
                               self.res_v)

    def storage_nbytes(self) -> int:
        return (self.codes.storage_nbytes() + self.kstat.storage_nbytes() + self.vstat.storage_nbytes()
                + sum(t.numel() * t.element_size() for t in itertools.chain(self.res_k, self.res_v)))

    def elements_per_token(self) -> float:
        return 2 * self.n_layer * self.n_kv_head * self.head_dim

    def formula_nbytes(self) -> int:
        """:func:`kivi_bytes` of the tokens held (== :meth:`nbytes`)."""
        return kivi_bytes(self.n_layer, self.n_kv_head, self.head_dim, self.batch_size, self.seq_len, bits=self.bits,
                          group=self.group, residual=self.residual, dtype=self.dtype)

    def reset(self) -> None:
        for c in (self.codes, self.kstat, self.vstat):
            c.reset()
        empty = self.res_k[0][:, :, :0]
        self.res_k = [empty] * self.n_layer
        self.res_v = [empty] * self.n_layer
        self._seen = [0] * self.n_layer

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` tokens of every layer: only full-precision (residual) tokens can go — quantised
        tokens share their groups' statistics (``ValueError`` otherwise)."""
        for layer in range(self.n_layer):
            nq = self.codes.layer_len(layer)
            if not nq <= n <= self.layer_len(layer):
                raise ValueError(f"truncate({n}): a KIVI cache can drop only its {self.layer_len(layer) - nq} "
                                 f"full-precision tokens (layer {layer} holds {self.layer_len(layer)})")
            dropped = self.layer_len(layer) - n
            self.res_k[layer], self.res_v[layer] = self.res_k[layer][:, :, :n - nq], self.res_v[layer][:, :, :n - nq]
            self._seen[layer] -= dropped

    def __repr__(self) -> str:
        return (f"KIVICache(bits={self.bits}, group={self.group}, residual={self.residual}, layers={self.n_layer}, "
                f"batch={self.batch_size}, seq_len={self.seq_len}, nbytes={self.nbytes()})")
