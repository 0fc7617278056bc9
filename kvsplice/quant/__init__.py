"""Low-bit KV storage: KIVI-style asymmetric quantisation (keys per channel, values per token, groups of ``group``
numbers with an fp16 scale and minimum each, the most recent ``residual`` tokens kept at full precision) as one
storage method, :class:`~kvsplice.quant.method.KIVI` — alone, or holding a token selection's subset — and its
variants over Hadamard-rotated K/V (:class:`RotatedKIVI`) and over keys before RoPE (:class:`PreRopeKIVI`)."""

from kvsplice.quant.cache import KIVICache, kivi_bytes
from kvsplice.quant.method import KIVI
from kvsplice.quant.prerope import PreRopeKIVI
from kvsplice.quant.rotated import RotatedKIVI, hadamard

__all__ = ["KIVI", "KIVICache", "PreRopeKIVI", "RotatedKIVI", "hadamard", "kivi_bytes"]
