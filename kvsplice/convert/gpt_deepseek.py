"""A trained ``deepseek_v3``-layout :class:`models.GPT` with standard attention as a Llama (``LlamaForCausalLM``,
:func:`llama_model`), a folder plain ``transformers`` loads (no remote code): ``kvsplice export --format llama``.
Its MLA and MLA + KVSplice variants export as DeepSeek-V3 through the one DeepSeek-V3 exporter
(:func:`kvsplice.convert.deepseek_v3.save_deepseek_v3`, this family's writer :mod:`kvsplice.convert.deepseek_v3_gpt`).
"""

from __future__ import annotations

from typing import Optional

import torch

from kvsplice.convert.deepseek_v3_gpt import check_layout, common_weights, outer_weights
from models.config import RMS_NORM_EPS, GPTConfig

__all__ = ["llama_model"]


# ------------------------------------------------------------------------------------------------------ Llama
@torch.no_grad()
def llama_model(model, eot_id: Optional[int] = None):
    """Our standard-attention model as a ``transformers.LlamaForCausalLM`` with the same weights (``c_attn`` split
    into ``q_proj`` / ``k_proj`` / ``v_proj``; RoPE is rotate-half in both); BOS/EOS = ``eot_id``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg: GPTConfig = model.cfg
    check_layout(cfg, "mha", "llama")
    hf_cfg = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.ff_width,
                         num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head,
                         num_key_value_heads=cfg.kv_heads, head_dim=cfg.head_size, hidden_act="silu",
                         max_position_embeddings=cfg.block_size, rms_norm_eps=RMS_NORM_EPS,
                         rope_theta=float(cfg.rope_theta), attention_bias=False, mlp_bias=False,
                         tie_word_embeddings=False, bos_token_id=eot_id, eos_token_id=eot_id)
    d_kv = cfg.kv_heads * cfg.head_size
    sd = outer_weights(model)
    for i, blk in enumerate(model.transformer.h):
        q, k, v = blk.attn.c_attn.weight.split([cfg.d_model, d_kv, d_kv])  # (d, d), (Hkv·hs, d) x 2
        pre = f"model.layers.{i}.self_attn."
        sd.update({pre + "q_proj.weight": q, pre + "k_proj.weight": k, pre + "v_proj.weight": v})
        sd.update({f"model.layers.{i}." + k: v for k, v in common_weights(model, i).items()})
    hf = LlamaForCausalLM(hf_cfg).eval()
    hf.load_state_dict({n: w.detach().clone() for n, w in sd.items()}, strict=True)
    return hf
