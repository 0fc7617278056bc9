"""HF Phi-3 (``Phi3ForCausalLM``): the Llama layout with one fused ``self_attn.qkv_proj`` (rows ``q | k | v``),
a fused MLP (run as the model's module) and possibly partial rotary (``partial_rotary_factor``: the first
``rotary_dim`` dims of a head rotate); a sliding window on every layer when ``config.sliding_window`` is set."""

from __future__ import annotations

from kvsplice.adapters.base import Projections
from kvsplice.adapters.llama import LlamaAdapter


class Phi3Adapter(LlamaAdapter):
    def __init__(self, model) -> None:
        super().__init__(model)
        self.qkv_sizes = [self.n_head * self.head_dim] + [self.n_kv_head * self.head_dim] * 2  # qkv_proj's q | k | v

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * getattr(self.config, "partial_rotary_factor", 1.0))

    def proj(self, layer):
        a = self.m.layers[layer].self_attn
        wq, wk, wv = a.qkv_proj.weight.split(self.qkv_sizes, dim=0)  # (Hq·D, d_model), 2 × (Hkv·D, d_model)
        b = a.qkv_proj.bias
        bq, bk, bv = b.split(self.qkv_sizes) if b is not None else (None, None, None)
        return Projections(wq, bq, wk, bk, wv, bv, a.o_proj.weight, a.o_proj.bias)

    def tap_projections(self, attn, emit):
        def hook(mod, inp, out):
            for kind, x in zip("qkv", out.split(self.qkv_sizes, dim=-1)):  # (B, T, Hq·D), 2 × (B, T, Hkv·D)
                emit(kind, x)
        return [attn.qkv_proj.register_forward_hook(hook)]
