"""One family adapter per supported model family (HF GPT-2; HF Llama, Mistral, Qwen2 — one Llama-layout adapter;
Qwen3, Phi-3, Gemma-3 — a small subclass each; our GPT), used by every method.

``adapter_for(model)`` picks the adapter; ``model_info`` / ``model_fingerprint`` describe a model for bases files.
"""

from __future__ import annotations

from kvsplice.adapters.base import (SUPPORTED_FAMILIES, FamilyAdapter, ModelInfo, Projections, apply_rope,
                                    merge_heads, split_heads, unsupported)
from kvsplice.adapters.fingerprint import model_fingerprint
from kvsplice.adapters.gemma3 import Gemma3Adapter
from kvsplice.adapters.gpt2 import GPT2Adapter
from kvsplice.adapters.llama import LlamaAdapter
from kvsplice.adapters.phi3 import Phi3Adapter
from kvsplice.adapters.qwen3 import Qwen3Adapter
from kvsplice.adapters.registry import FAMILIES, adapter_for, model_info

__all__ = ["FAMILIES", "FamilyAdapter", "GPT2Adapter", "Gemma3Adapter", "LlamaAdapter", "ModelInfo", "Phi3Adapter",
           "Projections", "Qwen3Adapter", "SUPPORTED_FAMILIES",
           "adapter_for", "apply_rope", "merge_heads", "model_fingerprint", "model_info", "split_heads",
           "unsupported"]
