"""One family adapter per supported model family (HF GPT-2, HF Llama, our GPT), used by every method.

``adapter_for(model)`` picks the adapter; ``model_info`` / ``model_fingerprint`` describe a model for bases files.
"""

from __future__ import annotations

from kvsplice.adapters.base import (SUPPORTED_FAMILIES, FamilyAdapter, ModelInfo, Projections, apply_rope,
                                    merge_heads, rotate_half, split_heads, unsupported)
from kvsplice.adapters.fingerprint import model_fingerprint
from kvsplice.adapters.gpt2 import GPT2Adapter
from kvsplice.adapters.llama import LlamaAdapter
from kvsplice.adapters.registry import adapter_for, model_info

__all__ = ["FamilyAdapter", "GPT2Adapter", "LlamaAdapter", "ModelInfo", "Projections", "SUPPORTED_FAMILIES",
           "adapter_for", "apply_rope", "merge_heads", "model_fingerprint", "model_info", "rotate_half",
           "split_heads", "unsupported"]
