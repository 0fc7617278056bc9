"""llama.cpp's KV cache types: their ggml type ids and their bytes, so that a cache of any type can be priced
beside ours without running llama.cpp.

llama.cpp stores each K and V row (one token, one KV head: ``head_dim`` numbers) in its cache type. The quantised
types are ggml's blocks of 32 numbers (``ggml/src/ggml-common.h``): ``q8_0`` = an fp16 scale + 32 int8 codes (34
bytes), ``q4_0`` = an fp16 scale + 32 4-bit codes (18), ``q4_1`` = an fp16 scale and minimum + 32 4-bit codes (20),
``iq4_nl`` = ``q4_0``'s layout with a non-linear codebook (18), ``q5_0`` / ``q5_1`` = 22 / 24; ``f16`` / ``bf16``
2 bytes a number, ``f32`` 4. A row of ``n`` numbers costs ``n / block · block_bytes`` (``ggml_row_size``; ``n``
must be a multiple of the block). The ids are ``enum ggml_type`` (``ggml/include/ggml.h``).

:func:`kv_bytes_per_token` is the closed form the engine's measured cache is tested against
(``tests/kvsplice/convert/test_llama_cpp_kv.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["KV_TYPES", "KvType", "kv_bytes_per_token", "kv_type"]


@dataclass(frozen=True)
class KvType:
    """One ggml cache type: its ``enum ggml_type`` id and ``block_bytes`` per ``block`` numbers."""

    name: str
    ggml_id: int
    block: int
    block_bytes: int

    def row_bytes(self, n: int) -> int:
        """Bytes of a row of ``n`` numbers (``ggml_row_size``)."""
        if n % self.block:
            raise ValueError(f"a {self.name} row holds a multiple of {self.block} numbers, not {n}")
        return n // self.block * self.block_bytes


KV_TYPES: dict[str, KvType] = {t.name: t for t in (
    KvType("f32", 0, 1, 4), KvType("f16", 1, 1, 2), KvType("bf16", 30, 1, 2),
    KvType("q8_0", 8, 32, 34), KvType("q4_0", 2, 32, 18), KvType("q4_1", 3, 32, 20),
    KvType("q5_0", 6, 32, 22), KvType("q5_1", 7, 32, 24), KvType("iq4_nl", 20, 32, 18))}


def kv_type(name: str) -> KvType:
    """The cache type called ``name`` (case-insensitive); ``ValueError`` in one line naming the known ones."""
    t = KV_TYPES.get(str(name).lower())
    if t is None:
        raise ValueError(f"unknown llama.cpp KV cache type {name!r} (known: {', '.join(KV_TYPES)})")
    return t


def kv_bytes_per_token(n_layer: int, n_kv_head: int, head_dim_k: int, head_dim_v: int, type_k: str,
                       type_v: str) -> int:
    """K + V bytes one token costs in llama.cpp's cache (every layer, every KV head): the closed form."""
    return n_layer * n_kv_head * (kv_type(type_k).row_bytes(head_dim_k) + kv_type(type_v).row_bytes(head_dim_v))
