"""HF Qwen3 (``Qwen3ForCausalLM``): the Llama layout plus an RMSNorm over each head of ``q`` and ``k`` before RoPE
(``self_attn.q_norm`` / ``k_norm``); sliding-window layers per ``config.layer_types``."""

from __future__ import annotations

from kvsplice.adapters.llama import LlamaAdapter


class Qwen3Adapter(LlamaAdapter):
    def head_norm(self, layer, kind, x):
        attn = self.m.layers[layer].self_attn
        return (attn.q_norm if kind == "q" else attn.k_norm)(x)  # over the head dim of (B, H, T, D)
