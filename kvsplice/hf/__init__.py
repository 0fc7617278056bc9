"""Compressed caches inside Hugging Face ``generate()``: ``transformers.Cache`` subclasses and the ``"kvsplice"``
attention implementation they plug into (see :mod:`kvsplice.hf.attention`)."""

from kvsplice.hf.attention import ATTN_IMPL, register, use_kvsplice_attention
from kvsplice.hf.base import KVSpliceHFCache
from kvsplice.hf.coefficient_cache import CoefficientHFCache
from kvsplice.hf.subset_cache import SubsetHFCache

__all__ = ["ATTN_IMPL", "CoefficientHFCache", "KVSpliceHFCache", "SubsetHFCache", "register",
           "use_kvsplice_attention"]
