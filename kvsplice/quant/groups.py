"""The group quantisation of KIVI and of the int4 decode caches, written once in :mod:`models.group_quant` (the
model-side caches use it too; models cannot import kvsplice) and re-exported here for the quantisation methods."""

from models.group_quant import BITS, dequantize, pack_codes, quantize, unpack_codes

__all__ = ["BITS", "dequantize", "pack_codes", "quantize", "unpack_codes"]
