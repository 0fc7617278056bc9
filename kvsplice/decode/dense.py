"""``DenseKV``: the full K/V cache (post-RoPE keys and values) — the uncompressed reference every method is
compared against, and the plain storage under a token selection. Rows may be stored as int8 (a scale per row) or
int4 (4-bit codes in groups of 32 numbers, an fp16 scale and minimum per group: :mod:`models.quant`), and with
``rotate=True`` rotated by an orthonormal Hadamard matrix first (:class:`~kvsplice.core.rotation.HadamardFrame`, as
``kivi_rotated``): a rotation spreads a key's outlier channels over the whole row, so a per-row 4-bit grid does not
spend its levels on one channel; exact at full precision."""

from __future__ import annotations

from kvsplice.core.args import choice_arg
from kvsplice.core.coded import Segment, coded_attend, seen_bias, stream_rows
from kvsplice.core.method import CompressionMethod, layer_tokens
from kvsplice.core.rotation import HadamardFrame
from models.quant import SCALE, row_bytes
from models.stream_cache import KVCache

__all__ = ["DenseKV"]


class DenseKV(HadamardFrame, CompressionMethod):
    """Full keys and values; ``cache_quant="int8"`` stores them as int8 rows with fp16 scales (the baseline of
    quantisation on its own), ``"int4"`` as 4-bit rows; ``value_quant``: the values' rows another way than the
    keys' (``cache_quant="int8", value_quant="int4"``: a key's digits and outlier channels keep 8 bits, a value 4;
    ``None``: as the keys); ``rotate``: Hadamard-rotated rows (see the module docstring)."""

    name = "dense"
    cache_type = KVCache
    is_storage = True

    def __init__(self, *, cache_quant: str | None = None, value_quant: str | None = None,
                 rotate: bool = False) -> None:
        self.cache_quant = choice_arg("cache_quant", cache_quant, (None, "int8", "int4"))
        self.value_quant = choice_arg("value_quant", value_quant, (None, "int8", "int4"))
        if self.value_quant is not None and self.cache_quant is None:
            raise ValueError("value_quant sets the values' rows apart from the keys' (cache_quant): set cache_quant "
                             "too, e.g. dense(cache_quant=int8,value_quant=int4)")
        if self.value_quant == self.cache_quant:
            self.value_quant = None
        if not isinstance(rotate, bool):
            raise ValueError(f"rotate must be true or false, got {rotate!r}")
        self.rotate = rotate

    def _prepare(self, adapter, *, dtype, device):
        super()._prepare(adapter, dtype=dtype, device=device)
        self.set_rotation(adapter.head_dim if self.rotate else None, dtype, device)

    @property
    def quant(self) -> str | None | dict[str, str]:
        """The cache's ``quant``: ``cache_quant``, or per stream ``{"k": cache_quant, "v": value_quant}``."""
        return self.cache_quant if self.value_quant is None else {"k": self.cache_quant, "v": self.value_quant}

    def new_cache(self, batch_size, capacity=None, *, dtype, device):
        a = self._bound()
        return KVCache(a.n_layer, a.n_kv_head, a.head_dim, batch_size, dtype=dtype, device=device,
                       capacity=capacity, quant=self.quant)

    def bytes_formula(self, batch_size, n_held, dtype):
        """``2 · L · Hkv · D · T · B · bytes``; int8: 1 byte per number + a 2-byte scale per row (token, head, k/v);
        int4: ``D/2`` code bytes + an fp16 scale and minimum per group of 32 a row (:func:`models.quant.row_bytes`).
        The rotation is not stored per token."""
        a = self._bound()
        rows = a.n_kv_head * layer_tokens(n_held, a.n_layer) * batch_size  # a key row (and a value row) per head, token
        d = a.head_dim
        return rows * (row_bytes(self.cache_quant, d, dtype) + row_bytes(self.value_quant or self.cache_quant, d, dtype))

    def append(self, layer, k, v, cache, step):
        cache.append(layer, k=self.rotated(k), v=self.rotated(v))

    def attend(self, layer, q, k, v, cache, step, mask=None, logw=None):
        if self.rot is not None:  # attend in the rotated frame, the output back
            return self.unrotated(self._attend(layer, self.rotated(q), self.rotated(k), self.rotated(v), cache, step,
                                               mask, logw))
        return self._attend(layer, q, k, v, cache, step, mask, logw)

    def _attend(self, layer, q, k, v, cache, step, mask, logw):
        if k.dtype != cache.dtype:
            k, v = k.to(cache.dtype), v.to(cache.dtype)
        # one-token step: the split-KV kernel reads the rows as stored (int8 + scales; not int4 codes)
        if self.quant in (None, "int8") and step.kernel(q):
            rows = cache.append_rows(layer, k=k, v=v)  # (B, Hkv, Tk, D) each; "k.scale" (B, Hkv, Tk, 1) when int8
            return step.decode_attend(layer, q, rows["k"], rows["v"], mask, logw, k_scale=rows.get("k" + SCALE),
                                      v_scale=rows.get("v" + SCALE))  # (B, Hq, 1, D)
        if self.quant is not None and q.shape[2] == 1 and (mask is None or mask.shape[-1] == cache.layer_len(layer) + 1):
            # a decode step: attend from the codes as stored (kvsplice.core.coded: no dequantised copy)
            cache.append_rows(layer, k=k, v=v)
            rows_k, rows_v = stream_rows(cache, layer, "k"), stream_rows(cache, layer, "v")
            b, h, n = rows_k.data.shape[:3]
            bias = seen_bias(mask, b, h, n)
            if logw is not None:
                bias = logw if bias is None else bias + logw
            return coded_attend(q, [Segment(rows_k, rows_v, bias)], scale=step.scales[layer])  # (B, Hq, 1, D)
        kv = cache.append(layer, k=k, v=v)  # (B, Hkv, Tk, D) each
        return step.attend(layer, q, kv["k"], kv["v"], mask=mask, logw=logw)  # (B, Hq, Tq, D)

    def __repr__(self) -> str:
        args = ([f"cache_quant={self.cache_quant!r}"] * bool(self.cache_quant)
                + [f"value_quant={self.value_quant!r}"] * bool(self.value_quant) + ["rotate=True"] * self.rotate)
        return f"DenseKV({', '.join(args)})"
