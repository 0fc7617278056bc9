"""Byte accounting: the theoretical cache size of any config at any dtype, and measurement of a live cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]


def bytes_per_element(dtype: str | torch.dtype) -> int:
    return torch.empty((), dtype=parse_dtype(dtype)).element_size()


def cache_elements_per_token(cfg) -> int:
    """Elements cached per token per sequence over all layers: MHA ``2·L·d_model`` (GQA/MQA ``2·L·n_kv_head·hs``),
    MLA ``L·d_latent``, KVSplice ``L·d_compressed``."""
    return cfg.n_layer * cfg.cache_dim


def cache_rows_per_token(cfg) -> int:
    """Rows (vectors along the last dim) cached per token per sequence over all layers: MHA ``2·L·n_kv_head`` (K and
    V per KV head), MLA / KVSplice ``L`` — each row carries one scale when the cache is quantised."""
    return cfg.n_layer * (2 * cfg.kv_heads if cfg.attention == "mha" else 1)


def cache_bytes_formula(cfg, seq_len: int, dtype: str | torch.dtype, batch_size: int = 1) -> int:
    """Theoretical cache bytes for ``batch_size`` sequences of ``seq_len`` tokens: at ``dtype``, or, when
    ``cfg.cache_quant == "int8"``, one byte per number plus a 2-byte fp16 scale per row
    (:func:`cache_rows_per_token`)."""
    if getattr(cfg, "cache_quant", None) == "int8":
        per_token = cache_elements_per_token(cfg) + 2 * cache_rows_per_token(cfg)
    else:
        per_token = cache_elements_per_token(cfg) * bytes_per_element(dtype)
    return batch_size * seq_len * per_token


@dataclass(frozen=True)
class CacheMeasurement:
    live_bytes: int  # sum of the live views' sizes (what the cache holds)
    storage_bytes: int  # bytes of the distinct underlying storages (what was allocated)
    dtypes: tuple[str, ...]
    n_tensors: int


def measure_cache(cache) -> CacheMeasurement:
    """Measure a live cache from its tensors, independently of ``cache.nbytes()``."""
    tensors = list(cache.tensors())
    live = sum(t.numel() * t.element_size() for t in tensors)
    storages = {}
    for t in tensors:
        st = t.untyped_storage()
        storages[st.data_ptr()] = st.nbytes()
    dtypes = tuple(sorted({str(t.dtype).replace("torch.", "") for t in tensors}))
    return CacheMeasurement(live, sum(storages.values()), dtypes, len(tensors))


# ------------------------------------------------------------------------------------- reporting helpers
def dtype_name(dtype: str | torch.dtype) -> str:
    """``fp32`` / ``fp16`` / ``bf16`` for a dtype or its short name."""
    dt = parse_dtype(dtype)
    return next(name for name, d in DTYPES.items() if d == dt)


def mha_cache_bytes(cfg, seq_len: int, dtype: str | torch.dtype, batch_size: int = 1) -> int:
    """Bytes a standard-MHA cache of the same shapes (``2·n_layer·d_model`` per token) would take: the baseline of
    every "compression vs MHA" figure."""
    return batch_size * seq_len * 2 * cfg.n_layer * cfg.d_model * bytes_per_element(dtype)


def sequences_in_budget(budget_bytes: int, bytes_per_sequence: int) -> int:
    """How many caches of ``bytes_per_sequence`` fit in ``budget_bytes`` (``floor``; 0 when one does not fit)."""
    if bytes_per_sequence <= 0:
        raise ValueError(f"bytes_per_sequence must be > 0, got {bytes_per_sequence}")
    return int(budget_bytes // bytes_per_sequence)

