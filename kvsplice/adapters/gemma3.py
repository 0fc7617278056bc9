"""HF Gemma-3 text (``Gemma3ForCausalLM``, model_type ``gemma3_text``): the Llama layout with

* an RMSNorm over each head of ``q`` and ``k`` before RoPE (``q_norm`` / ``k_norm``) and the softmax scale
  ``query_pre_attn_scalar ** -0.5`` (the module's ``scaling``);
* a RoPE base per layer type: sliding-window layers rotate with ``rope_local_base_freq``, full-attention layers with
  ``rope_theta`` (transformers 5: one rotary module taking the layer type; 4.x: ``rotary_emb`` / ``rotary_emb_local``);
* sliding-window layers per ``config.layer_types`` (each module's ``sliding_window``);
* four norms per block (``post_attention_layernorm`` on the attention output, ``pre_`` / ``post_feedforward_layernorm``
  around the MLP), a scaled embedding (the model's ``embed_tokens``) and ``final_logit_softcapping`` of the logits
  (as transformers: in ``Gemma3ForCausalLM``, not in the multimodal ``Gemma3ForConditionalGeneration``, model_type
  ``gemma3``, whose language model this adapter runs for text prompts).

``attn_logit_softcapping`` is not applied: transformers' Gemma-3 attention does not pass it to its attention
functions (4.57 – 5.23), so the model attends without it and so do we.
"""

from __future__ import annotations

import torch

from kvsplice.adapters.llama import LlamaAdapter


class LayerTypeRotary:
    """One layer type's view of transformers 5's Gemma-3 rotary module (``rotary(x, positions, layer_type)``) as a
    plain ``rotary(x, positions) -> cos, sin`` with its ``rope_type`` and ``attention_scaling``."""

    def __init__(self, module: torch.nn.Module, layer_type: str) -> None:
        self.module, self.layer_type = module, layer_type
        types = getattr(module, "rope_type", {})
        self.rope_type = types.get(layer_type, "default") if isinstance(types, dict) else types
        self.attention_scaling = getattr(module, f"{layer_type}_attention_scaling", 1.0)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor):
        return self.module(x, positions, self.layer_type)


class Gemma3Adapter(LlamaAdapter):
    def __init__(self, model) -> None:
        super().__init__(model)
        types = getattr(self.config, "layer_types", None) or \
            ["sliding_attention" if w else "full_attention" for w in self.windows]
        if hasattr(self.m, "rotary_emb_local"):  # transformers 4.x: a second module for the local base
            rot = {t: self.m.rotary_emb_local if t == "sliding_attention" else self.m.rotary_emb for t in set(types)}
        else:
            rot = {t: LayerTypeRotary(self.m.rotary_emb, t) for t in set(types)}
        self.rotaries = [rot[t] for t in types]  # one object per layer type: layers of a type share their tables
        self.softcap = getattr(self.config, "final_logit_softcapping", None) \
            if model.config.model_type == "gemma3_text" else None  # transformers caps only in Gemma3ForCausalLM

    def rotary_embedding(self, layer=0):
        return self.rotaries[layer]

    def head_norm(self, layer, kind, x):
        attn = self.m.layers[layer].self_attn
        return (attn.q_norm if kind == "q" else attn.k_norm)(x)  # over the head dim of (B, H, T, D)

    def after_attn(self, layer, x, y):
        b = self.blocks()[layer]
        x = x + b.post_attention_layernorm(y)
        return x + b.post_feedforward_layernorm(b.mlp(b.pre_feedforward_layernorm(x)))

    def head(self, x):
        logits = super().head(x)
        return logits if self.softcap is None else torch.tanh(logits / self.softcap) * self.softcap
