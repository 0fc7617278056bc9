"""Export a trained ``deepseek_v3``-layout :class:`models.GPT` as a folder plain ``transformers`` loads (no remote
code): its MLA and MLA + KVSplice variants as DeepSeek-V3 (``DeepseekV3ForCausalLM``, written by the one DeepSeek-V3
exporter, :mod:`kvsplice.convert.deepseek_v3`, through this family's writer :mod:`kvsplice.convert.deepseek_v3_gpt`),
its standard attention as a Llama (``LlamaForCausalLM``, :func:`llama_model`). ``kvsplice export --format
deepseek_v3 | llama`` calls this.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch

from kvsplice.convert import deepseek_v3
from kvsplice.convert.deepseek_v3_gpt import check_layout, common_weights, outer_weights
from models.config import RMS_NORM_EPS, GPTConfig

__all__ = ["deepseek_v3_config", "deepseek_v3_state_dict", "llama_model", "save_deepseek_v3"]


# ------------------------------------------------------------------------------------------------ DeepSeek-V3
def deepseek_v3_config(model, pad_latent: Optional[int] = None, pad_rope: Optional[int] = None) -> dict[str, Any]:
    """The ``config.json``: ``kv_lora_rank`` is the cached latent (``d_compressed`` for KVSplice) or ``pad_latent``,
    ``qk_rope_head_dim`` the RoPE key or ``pad_rope`` (:func:`kvsplice.convert.deepseek_v3.deepseek_v3_config`)."""
    check_layout(model.cfg, "mla", "deepseek_v3")
    return deepseek_v3.deepseek_v3_config(model, pad_latent, pad_rope)


def deepseek_v3_state_dict(model, pad_latent: Optional[int] = None,
                           pad_rope: Optional[int] = None) -> dict[str, torch.Tensor]:
    """The weights under transformers' DeepSeek-V3 names, KVSplice folded into the projections."""
    check_layout(model.cfg, "mla", "deepseek_v3")
    return deepseek_v3.deepseek_v3_state_dict(model, pad_latent, pad_rope)


def save_deepseek_v3(model, folder: Path, pad_latent: Optional[int] = None, pad_rope: Optional[int] = None) -> None:
    """Write ``config.json`` and ``model.safetensors`` into ``folder`` (``pad_latent`` / ``pad_rope``: padded
    exactly)."""
    check_layout(model.cfg, "mla", "deepseek_v3")
    deepseek_v3.save_deepseek_v3(model, folder, pad_latent=pad_latent, pad_rope=pad_rope)


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
