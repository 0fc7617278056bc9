"""The HF door: any compression method inside Hugging Face ``generate()`` — :class:`KVSpliceHFCache`
(a ``transformers.Cache``; :class:`CoefficientHFCache` and :class:`SubsetHFCache` build it for low-rank bases and
token selection) and the ``"kvsplice"`` attention implementation it plugs into (see :mod:`kvsplice.hf.attention`)."""

from kvsplice.hf.attention import ATTN_IMPL, register, use_kvsplice_attention
from kvsplice.hf.base import KVSpliceHFCache
from kvsplice.hf.coefficient_cache import CoefficientHFCache
from kvsplice.hf.subset_cache import SubsetHFCache

__all__ = ["ATTN_IMPL", "CoefficientHFCache", "KVSpliceHFCache", "SubsetHFCache", "register",
           "use_kvsplice_attention"]
