"""KV-cache compression: the shared decode caches, KVSplice, byte accounting, and post-training bases."""

from models.cache import CompressedLatentCache, DecodeCache, KVCache, LatentCache
from models.splice import LearnedKVSplice

__all__ = ["CompressedLatentCache", "DecodeCache", "KVCache", "LatentCache", "LearnedKVSplice"]
