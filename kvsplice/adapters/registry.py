"""Pick the adapter of a model: :func:`adapter_for`; :func:`model_info` for post-training methods."""

from __future__ import annotations

from torch import nn

from kvsplice.adapters.base import FamilyAdapter, ModelInfo, unsupported
from kvsplice.adapters.gpt2 import GPT2Adapter
from kvsplice.adapters.llama import LlamaAdapter


def adapter_for(model: nn.Module) -> FamilyAdapter:
    """The adapter of ``model``: HF ``GPT2LMHeadModel``/``GPT2Model``, HF ``LlamaForCausalLM``/``LlamaModel``, or
    ``models.GPT``; anything else raises ``ValueError`` naming the supported families."""
    from models.gpt import GPT

    if isinstance(model, GPT):
        return GPT2Adapter(model, hf=False)
    mt = getattr(getattr(model, "config", None), "model_type", None)
    if mt == "llama" and (hasattr(model, "layers") or hasattr(getattr(model, "model", None), "layers")):
        return LlamaAdapter(model)
    if mt == "gpt2" and (hasattr(model, "h") or hasattr(getattr(model, "transformer", None), "h")):
        return GPT2Adapter(model, hf=True)
    raise unsupported(model)


def model_info(model: nn.Module) -> ModelInfo:
    """Family and attention shapes of a model post-training methods support (``ValueError`` otherwise)."""
    adapter = adapter_for(model)
    adapter.require_projections()
    return adapter.info()
