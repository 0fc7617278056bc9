"""Pick the adapter of a model: :func:`adapter_for`; :func:`model_info` for post-training methods."""

from __future__ import annotations

from torch import nn

from kvsplice.adapters.base import FamilyAdapter, ModelInfo, unsupported
from kvsplice.adapters.gemma3 import Gemma3Adapter
from kvsplice.adapters.gpt2 import GPT2Adapter
from kvsplice.adapters.llama import LlamaAdapter
from kvsplice.adapters.mla_llama import MLALlamaAdapter
from kvsplice.adapters.phi3 import Phi3Adapter
from kvsplice.adapters.qwen3 import Qwen3Adapter

FAMILIES: dict[str, type[LlamaAdapter]] = {"llama": LlamaAdapter, "mistral": LlamaAdapter, "qwen2": LlamaAdapter,
                                           "qwen3": Qwen3Adapter, "phi3": Phi3Adapter, "gemma3_text": Gemma3Adapter,
                                           "gemma3": Gemma3Adapter}
"""``config.model_type`` → adapter of the HF decoder families laid out as Llama (``model.layers[i].self_attn``;
``gemma3``: ``Gemma3ForConditionalGeneration``, whose ``model.language_model`` is that decoder — text prompts)."""


def adapter_for(model: nn.Module) -> FamilyAdapter:
    """The adapter of ``model``: HF GPT-2, an HF decoder of :data:`FAMILIES` (``*ForCausalLM`` or the bare
    ``*Model``), or ``models.GPT``; anything else raises ``ValueError`` naming the supported families."""
    from models.gpt import GPT
    from models.mla_llama import MLALlama

    if isinstance(model, GPT):
        return GPT2Adapter(model, hf=False)
    if isinstance(model, MLALlama):
        return MLALlamaAdapter(model)
    mt = getattr(getattr(model, "config", None), "model_type", None)
    inner = getattr(model, "model", None)
    if mt in FAMILIES and (hasattr(model, "layers") or hasattr(inner, "layers") or hasattr(inner, "language_model")):
        return FAMILIES[mt](model)
    if mt == "gpt2" and (hasattr(model, "h") or hasattr(getattr(model, "transformer", None), "h")):
        return GPT2Adapter(model, hf=True)
    raise unsupported(model)


def model_info(model: nn.Module) -> ModelInfo:
    """Family and attention shapes of a model post-training methods support (``ValueError`` otherwise)."""
    adapter = adapter_for(model)
    adapter.require_projections()
    return adapter.info()
