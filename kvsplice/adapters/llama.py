"""HF decoders laid out as Llama (``model.layers[i].self_attn.{q,k,v,o}_proj``, ``input_layernorm``,
``post_attention_layernorm``, ``mlp``, ``model.norm``, ``model.rotary_emb``): Llama, and as they are Mistral and
Qwen2 (q/k/v biases ride in :class:`~kvsplice.adapters.base.Projections`). GQA, RoPE, sliding windows; Qwen3, Phi-3 and
Gemma-3 subclass it for what differs (``qwen3.py``, ``phi3.py``, ``gemma3.py``)."""

from __future__ import annotations

import torch
from torch import nn

from kvsplice.adapters.base import FamilyAdapter, Projections, Sink, apply_rope, split_heads

_UNSET = object()


class LlamaAdapter(FamilyAdapter):
    has_rope = True

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        inner = getattr(model, "model", None)
        self.m = inner.language_model if hasattr(inner, "language_model") else \
            inner if hasattr(inner, "layers") else model  # the decoder (of a multimodal model: its language model)
        cfg = self.config = getattr(self.m, "config", model.config)
        self.name = model.config.model_type  # the wrapper's (gemma3), not its language model's
        self.n_layer = cfg.num_hidden_layers
        self.n_head = cfg.num_attention_heads
        self.n_kv_head = getattr(cfg, "num_key_value_heads", None) or self.n_head
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_head
        self.d_model = cfg.hidden_size
        self.max_positions = getattr(cfg, "max_position_embeddings", None)
        self.windows = [self._window(layer.self_attn) for layer in self.m.layers]

    def _window(self, attn: nn.Module):
        """The module's own ``sliding_window`` (Qwen2/3, Gemma-3: per layer type), else the config's (Mistral,
        Phi-3: every layer) — what transformers' masks use."""
        w = getattr(attn, "sliding_window", _UNSET)
        w = getattr(self.config, "sliding_window", None) if w is _UNSET else w
        return int(w) if w else None

    def window(self, layer):
        return self.windows[layer]

    def param(self):
        return self.m.embed_tokens.weight

    def embed(self, ids, start):
        return self.m.embed_tokens(ids)  # (B, T, d_model)

    def blocks(self):
        return self.m.layers

    def head(self, x):
        if not hasattr(self.model, "lm_head"):
            raise ValueError(f"decoding needs the LM head: pass the {self.name} *ForCausalLM model, not the bare "
                             f"decoder")
        return self.model.lm_head(self.m.norm(x))

    def proj(self, layer):
        a = self.m.layers[layer].self_attn
        return Projections(a.q_proj.weight, a.q_proj.bias, a.k_proj.weight, a.k_proj.bias, a.v_proj.weight,
                           a.v_proj.bias, a.o_proj.weight, a.o_proj.bias)

    def scale(self, layer):
        return float(self.m.layers[layer].self_attn.scaling)

    def rotary_embedding(self, layer=0):
        return self.m.rotary_emb

    def base_forward(self, ids):
        self.m(input_ids=ids, use_cache=False)

    # -------------------------------------------------------------------------------------------- calibration
    def tap_projections(self, attn: nn.Module, emit) -> list:
        """Forward hooks on ``attn``'s projections calling ``emit(kind, out (B, T, H·D))`` for q, k and v."""
        def tap(kind):
            return lambda mod, inp, out: emit(kind, out)
        return [attn.q_proj.register_forward_hook(tap("q")), attn.k_proj.register_forward_hook(tap("k")),
                attn.v_proj.register_forward_hook(tap("v"))]

    def attach_qkv_hooks(self, sink: Sink, rope: str) -> list:
        handles, pos_emb = [], {}
        for i, layer in enumerate(self.m.layers):
            attn = layer.self_attn

            def pre(mod, args, kwargs, i=i):
                pe = kwargs.get("position_embeddings")
                if pe is None and len(args) > 1:
                    pe = args[1]
                pos_emb[i] = pe

            def emit(kind, out, i=i):
                x = split_heads(out, out.shape[-1] // self.head_dim)  # (B, H, T, d)
                if kind != "v":
                    x = self.head_norm(i, kind, x)
                    if rope == "post":
                        if pos_emb.get(i) is None:
                            raise RuntimeError("post-RoPE calibration needs the position embeddings passed to "
                                               "self_attn; this transformers version does not pass them")
                        x = apply_rope(x, *pos_emb[i])  # cos, sin (B, T, r)
                sink(i, kind, x)

            handles.append(attn.register_forward_pre_hook(pre, with_kwargs=True))
            handles += self.tap_projections(attn, emit)
        return handles
