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
    """Elements cached per token per sequence over all layers: MHA ``2·L·d_model``, MLA ``L·d_latent``,
    KVSplice ``L·d_compressed``."""
    return cfg.n_layer * cfg.cache_dim


def cache_bytes_formula(cfg, seq_len: int, dtype: str | torch.dtype, batch_size: int = 1) -> int:
    """Theoretical cache bytes for ``batch_size`` sequences of ``seq_len`` tokens at ``dtype``."""
    return batch_size * seq_len * cache_elements_per_token(cfg) * bytes_per_element(dtype)


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
