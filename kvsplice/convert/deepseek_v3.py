"""Export a converted shared-RoPE :class:`models.mla_llama.MLALlama` as a DeepSeek-V3 folder: what plain
``transformers`` (``AutoModelForCausalLM.from_pretrained``, no remote code), vLLM and SGLang load as MLA.

The mapping, per layer (``H`` query heads of ``D`` dims, ``Dr`` RoPE dims, latent ``R``):

* ``q_proj`` (``q_lora_rank: null``): per head ``[q_nope (D) ; q_rope (Dr)]`` = ``[W_q,i ; A_iᵀ W_q,i]``, times
  ``scale / (D + Dr)^-0.5`` — DeepSeek's softmax scale is fixed at ``(nope + rope)^-0.5``;
* ``kv_a_proj_with_mqa`` = ``[w_dkv ; Bᵀ W_k]`` (latent, then the one shared RoPE key), ``kv_a_layernorm`` = the
  latent RMSNorm (DeepSeek always has it: a norm-free model is refused), ``kv_b_proj`` = per query head
  ``[w_uk ; w_uv]`` of its KV group (``num_key_value_heads = num_attention_heads``: keys are expanded per head);
* RoPE: ``rope_interleave: true`` (vLLM's DeepSeek layout), so the RoPE columns go from rotate-half
  ``[x_0..x_{n-1}, y_0..y_{n-1}]`` to ``[x_0, y_0, x_1, y_1, ...]``; ``rope_theta = θ^(Dr/D)`` reproduces the
  highest ``Dr/2`` source frequencies the shared layout keeps;
* dense MLPs everywhere (``first_k_dense_replace = num_hidden_layers``), untied ``lm_head``.

Refused with one line: the per-head layout (DeepSeek-V3 has one RoPE key per token), biases (Qwen2), per-head q/k
norms (Qwen3), sliding windows, a RoPE table that is not DeepSeek's geometric one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import torch

from models.mla_llama import LATENT_NORM_EPS, MLALlama

__all__ = ["check_exportable", "dense_mla_config", "deepseek_v3_config", "deepseek_v3_state_dict", "interleave_index",
           "save_deepseek_v3"]


def _rope_theta(model: MLALlama) -> float:
    """DeepSeek's ``rope_theta`` whose table ``1/θ^(2i/Dr)`` is the model's (same in every layer), or ValueError."""
    inv = model.layers[0].attn.inv_freq.double()[0]  # (Dr/2,)
    dr = model.cfg.rope_dims
    theta = float(inv[1] ** (-dr / 2)) if dr > 2 else 10000.0
    want = 1.0 / theta ** (torch.arange(0, dr, 2, dtype=torch.float64) / dr)
    for blk in model.layers:
        if not torch.allclose(blk.attn.inv_freq.double()[0], want, rtol=1e-5, atol=0):
            raise ValueError("the RoPE frequencies are not one geometric table 1/θ^(2i/Dr) shared by every layer, "
                             "which DeepSeek-V3's rotary computes")
    return theta


def check_exportable(model: MLALlama) -> None:
    """Raise ``ValueError`` (one line) unless ``model`` maps onto DeepSeek-V3 exactly."""
    cfg = model.cfg
    if cfg.rope_layout != "shared":
        raise ValueError("--format deepseek_v3 needs --rope-layout shared: DeepSeek-V3 caches one RoPE key per "
                         "token, the per-head layout one per KV head")
    if not cfg.latent_norm:
        raise ValueError("--format deepseek_v3 needs the latent RMSNorm (DeepSeek's kv_a_layernorm): convert with "
                         "--latent-norm")
    if cfg.attention_bias or cfg.head_norms:
        raise ValueError("--format deepseek_v3: DeepSeek-V3 has no q/k/v biases (Qwen2) nor per-head q/k norms "
                         "(Qwen3)")
    if any(cfg.windows):
        raise ValueError("--format deepseek_v3: DeepSeek-V3 has no sliding-window attention")
    if abs(cfg.rope_attention_scaling - 1.0) > 1e-12:
        raise ValueError("--format deepseek_v3: the source's RoPE scales cos/sin (attention_scaling != 1)")
    _rope_theta(model)


def dense_mla_config(*, vocab_size: int, hidden_size: int, intermediate_size: int, num_hidden_layers: int,
                     num_attention_heads: int, kv_lora_rank: int, qk_rope_head_dim: int, qk_nope_head_dim: int,
                     v_head_dim: int, max_position_embeddings: int, rms_norm_eps: float, rope_theta: float,
                     torch_dtype: str, kvsplice: dict[str, Any]) -> dict[str, Any]:
    """The ``config.json`` of a dense DeepSeek-V3 MLA without q-LoRA: every DeepSeek-V3 export of the package (this
    module's converted models, :mod:`kvsplice.convert.gpt_deepseek`'s trained ones) is written from here."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "vocab_size": vocab_size, "hidden_size": hidden_size, "intermediate_size": intermediate_size,
        "moe_intermediate_size": intermediate_size, "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": num_attention_heads, "num_key_value_heads": num_attention_heads,
        "q_lora_rank": None, "kv_lora_rank": kv_lora_rank, "qk_rope_head_dim": qk_rope_head_dim,
        "qk_nope_head_dim": qk_nope_head_dim, "v_head_dim": v_head_dim,
        "first_k_dense_replace": num_hidden_layers, "n_routed_experts": 1, "n_shared_experts": 1,
        "num_experts_per_tok": 1, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0, "norm_topk_prob": True,
        "hidden_act": "silu", "max_position_embeddings": max_position_embeddings, "rms_norm_eps": rms_norm_eps,
        "rope_interleave": True, "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": False, "use_cache": True,
        "torch_dtype": torch_dtype, "kvsplice": kvsplice,
    }


def deepseek_v3_config(model: MLALlama) -> dict[str, Any]:
    """The ``config.json`` of the export."""
    cfg = model.cfg
    return dense_mla_config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff, num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head, kv_lora_rank=cfg.d_latent, qk_rope_head_dim=cfg.rope_dims,
        qk_nope_head_dim=cfg.head_dim, v_head_dim=cfg.head_dim, max_position_embeddings=cfg.max_positions,
        rms_norm_eps=cfg.norm_eps, rope_theta=_rope_theta(model),
        torch_dtype=str(model.embed.weight.dtype).replace("torch.", ""),
        kvsplice={"source": cfg.source, "latent_norm_eps": LATENT_NORM_EPS})


def interleave_index(n: int) -> torch.Tensor:
    """Index ``(2n,)`` taking rotate-half ``[x_0..x_{n-1}, y_0..y_{n-1}]`` to ``[x_0, y_0, x_1, y_1, ...]``."""
    return torch.stack([torch.arange(n), torch.arange(n) + n], dim=1).flatten()


@torch.no_grad()
def deepseek_v3_state_dict(model: MLALlama) -> dict[str, torch.Tensor]:
    """The export's weights (transformers' DeepSeek-V3 names), from ``model`` (checked by :func:`check_exportable`)."""
    check_exportable(model)
    cfg = model.cfg
    h, d, dr, g = cfg.n_head, cfg.head_dim, cfg.rope_dims, cfg.n_head // cfg.n_kv_head
    perm = interleave_index(dr // 2)
    fold = cfg.scale / (d + dr) ** -0.5  # DeepSeek multiplies scores by (D + Dr)^-0.5
    sd: dict[str, torch.Tensor] = {"model.embed_tokens.weight": model.embed.weight,
                                   "model.norm.weight": model.norm.weight, "lm_head.weight": model.lm_head.weight}
    for i, blk in enumerate(model.layers):
        at, pre = blk.attn, f"model.layers.{i}."
        wq = at.q_proj.weight.view(h, d, -1)  # (H, D, d_model)
        q_rope = torch.einsum("hde,hdm->hem", at.q_rope.to(wq), wq)[:, perm]  # (H, Dr, d_model), interleaved
        sd[pre + "self_attn.q_proj.weight"] = (torch.cat([wq, q_rope], dim=1) * fold).flatten(0, 1)
        k_rope = (at.k_rope.to(wq).T @ at.k_proj.weight)[perm]  # (Dr, d_model)
        sd[pre + "self_attn.kv_a_proj_with_mqa.weight"] = torch.cat([at.kv_down.weight, k_rope])
        sd[pre + "self_attn.kv_a_layernorm.weight"] = at.kv_norm.weight
        wuk = at.k_up.weight.view(cfg.n_kv_head, d, -1).repeat_interleave(g, 0)  # (H, D, R)
        wuv = at.v_up.weight.view(cfg.n_kv_head, d, -1).repeat_interleave(g, 0)  # (H, D, R)
        sd[pre + "self_attn.kv_b_proj.weight"] = torch.cat([wuk, wuv], dim=1).flatten(0, 1)  # (H·2D, R)
        sd[pre + "self_attn.o_proj.weight"] = at.o_proj.weight
        sd[pre + "input_layernorm.weight"] = blk.input_norm.weight
        sd[pre + "post_attention_layernorm.weight"] = blk.post_norm.weight
        for name in ("gate_proj", "up_proj", "down_proj"):
            sd[pre + f"mlp.{name}.weight"] = getattr(blk, name).weight
    return {k: v.detach().cpu().contiguous().clone() for k, v in sd.items()}


def save_deepseek_v3(model: MLALlama, folder: Path, tokenizer: Optional[Any] = None) -> None:
    """Write the export into ``folder`` (a fresh temporary folder of :func:`kvsplice.io.outputs.write_dir`)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    sd = deepseek_v3_state_dict(model)
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(deepseek_v3_config(model), indent=2) + "\n", encoding="utf-8")
    if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(str(folder))
