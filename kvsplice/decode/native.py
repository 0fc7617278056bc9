"""``ModelAttention``: decode with the model's own attention modules — for ``models.GPT`` that is MHA (full K/V),
MLA (the latent) or MLA + KVSplice (the compressed latent), naive or absorbed as the model is configured.

It replaces the whole attention block (:meth:`~kvsplice.core.method.CompressionMethod.block`), not ``attend``: the
model's module projects and caches its own latent, so it has no q/k/v to hand over and no HF door (``models.GPT`` is
not a transformers model).
"""

from __future__ import annotations

from kvsplice.core.method import CompressionMethod
from models.stream_cache import DecodeCache

__all__ = ["OWN_ATTENTION", "ModelAttention"]

OWN_ATTENTION = ("gpt", "mla_llama")
"""Adapter names of the models that decode with their own attention modules (and caches)."""


class ModelAttention(CompressionMethod):
    name = "model"
    needs_projections = False

    def _prepare(self, adapter, *, dtype, device):
        if adapter.name not in OWN_ATTENTION:
            raise ValueError("ModelAttention decodes models.GPT and converted MLA models with their own attention "
                             "modules; for HF models use DenseKV or a compression method")

    def new_cache(self, batch_size, capacity=None, *, dtype, device):
        return self._bound().model.new_cache(batch_size, capacity, dtype=dtype, device=device)

    def check_cache(self, cache):
        if not isinstance(cache, DecodeCache) or cache.n_layer != self._bound().model.cfg.n_layer:
            raise TypeError(f"ModelAttention needs the model's own cache (model.new_cache()), got "
                            f"{type(cache).__name__}")

    def bytes_formula(self, batch_size, n_held, dtype):
        model = self._bound().model
        if not hasattr(model, "cache_bytes_formula"):
            return None
        return model.cache_bytes_formula(batch_size, n_held if isinstance(n_held, int) else max(n_held), dtype)

    def block(self, layer, h, cache, step, mask=None):  # models.GPT has no sliding windows: mask is None
        return step.adapter.attention_module(layer)(h, cache=cache, layer=layer)  # (B, T, d_model)
