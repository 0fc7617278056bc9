"""KV-cache compression: the shared decode caches, KVSplice, byte accounting, and post-training bases."""

from kvsplice.cache import CompressedLatentCache, DecodeCache, KVCache, LatentCache
from kvsplice.splice import LearnedKVSplice

__all__ = ["CompressedLatentCache", "DecodeCache", "KVCache", "LatentCache", "LearnedKVSplice"]
