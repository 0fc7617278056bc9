"""Our converted Llama-family MLA model (:class:`models.mla_llama.MLALlama`): like ``models.GPT`` with MLA it decodes
with its own attention modules (``ModelAttention``: the cache holds its latent and RoPE keys); it has no per-head
q/k/v projections, so post-training methods refuse it. Sliding windows are the model's own masks (its cache keeps
every token), so the decoder sees no window."""

from __future__ import annotations

from torch import nn

from kvsplice.adapters.base import FamilyAdapter, unsupported


class MLALlamaAdapter(FamilyAdapter):
    name = "mla_llama"
    block_parts = ("input_norm", "attn", "post_norm", "mlp")
    has_rope = False  # the model rotates its own RoPE keys; the decoder builds no tables

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        cfg = model.cfg
        self.n_layer, self.n_head, self.n_kv_head = cfg.n_layer, cfg.n_head, cfg.n_kv_head
        self.head_dim, self.d_model, self.max_positions = cfg.head_dim, cfg.d_model, cfg.max_positions

    def require_projections(self) -> None:
        raise unsupported(self.model, "a converted MLA model (its cache is already a latent; post-training "
                                      "methods need the source model)")

    def param(self):
        return self.model.embed.weight

    def embed(self, ids, start):
        return self.model.embed(ids)  # (B, T, d_model)

    def blocks(self):
        return self.model.layers

    def head(self, x):
        return self.model.lm_head(self.model.norm(x))

    def base_forward(self, ids):
        self.model(ids)
