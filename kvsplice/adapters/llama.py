"""HF ``LlamaForCausalLM`` / ``LlamaModel``: GQA and RoPE (``rotary_emb`` tables, rotated with ``apply_rope``)."""

from __future__ import annotations

import torch
from torch import nn

from kvsplice.adapters.base import FamilyAdapter, Projections, Sink, apply_rope


class LlamaAdapter(FamilyAdapter):
    name = "llama"
    has_rope = True

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.m = model.model if hasattr(model, "model") and hasattr(model.model, "layers") else model
        cfg = model.config
        self.n_layer = cfg.num_hidden_layers
        self.n_head = cfg.num_attention_heads
        self.n_kv_head = getattr(cfg, "num_key_value_heads", None) or self.n_head
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_head
        self.d_model = cfg.hidden_size
        self.max_positions = getattr(cfg, "max_position_embeddings", None)

    def param(self):
        return self.m.embed_tokens.weight

    def embed(self, ids, start):
        return self.m.embed_tokens(ids)  # (B, T, d_model)

    def attn_in(self, layer, x):
        return self.m.layers[layer].input_layernorm(x)

    def attention_module(self, layer):
        return self.m.layers[layer].self_attn

    def after_attn(self, layer, x, y):
        block = self.m.layers[layer]
        x = x + y
        return x + block.mlp(block.post_attention_layernorm(x))

    def head(self, x):
        if not hasattr(self.model, "lm_head"):
            raise ValueError("decoding needs the LM head: pass LlamaForCausalLM, not the bare LlamaModel")
        return self.model.lm_head(self.m.norm(x))

    def proj(self, layer):
        a = self.m.layers[layer].self_attn
        return Projections(a.q_proj.weight, a.q_proj.bias, a.k_proj.weight, a.k_proj.bias, a.v_proj.weight,
                           a.v_proj.bias, a.o_proj.weight, a.o_proj.bias)

    def scale(self, layer):
        return float(self.m.layers[layer].self_attn.scaling)

    def rope(self, x, start, t):
        pos = torch.arange(start, start + t, device=x.device)
        return self.m.rotary_emb(x, pos[None])  # cos, sin (1, T, D)

    def rotary_embedding(self):
        return self.m.rotary_emb

    def base_forward(self, ids):
        self.m(input_ids=ids, use_cache=False)

    def attach_qkv_hooks(self, sink: Sink, rope: str) -> list:
        handles, pos_emb = [], {}
        d = self.head_dim
        for i, layer in enumerate(self.m.layers):
            attn = layer.self_attn

            def pre(mod, args, kwargs, i=i):
                pe = kwargs.get("position_embeddings")
                if pe is None and len(args) > 1:
                    pe = args[1]
                pos_emb[i] = pe

            def tap(kind, i=i):
                def hook(mod, inp, out):
                    x = out.view(*out.shape[:-1], -1, d).transpose(1, 2)  # (B, H, T, d)
                    if rope == "post" and kind in ("q", "k"):
                        if pos_emb.get(i) is None:
                            raise RuntimeError("post-RoPE calibration needs the position embeddings passed to "
                                               "self_attn; this transformers version does not pass them")
                        x = apply_rope(x, *pos_emb[i])  # cos, sin (B, T, d)
                    sink(i, kind, x)
                return hook

            handles.append(attn.register_forward_pre_hook(pre, with_kwargs=True))
            handles += [attn.q_proj.register_forward_hook(tap("q")), attn.k_proj.register_forward_hook(tap("k")),
                        attn.v_proj.register_forward_hook(tap("v"))]
        return handles
