"""Export a trained ``deepseek_v3``-layout :class:`models.GPT` as a folder plain ``transformers`` loads (no remote
code): its MLA and MLA + KVSplice variants as DeepSeek-V3 (``DeepseekV3ForCausalLM``), its standard attention as a
Llama (``LlamaForCausalLM``). ``python -m training.export --format deepseek_v3 | llama`` calls this.

DeepSeek-V3, per layer (``H`` heads of ``hs``, RoPE ``Dr``, cached latent ``r``):

* ``q_proj`` (``q_lora_rank: null``) = per head ``[w_q[h] ; w_qr[h]]`` — the scale is ours already,
  ``(hs + Dr)^-½``;
* ``kv_a_proj_with_mqa`` = ``[C w_dkv ; w_kr]`` (the cached latent, then the shared RoPE key); ``kv_a_layernorm`` =
  the one RMSNorm before our cache (``kv_norm`` for MLA, ``splice_norm`` for KVSplice);
* ``kv_b_proj`` = per head ``[w_uk[h] E ; w_uv[h] E]``; ``o_proj`` = ``c_proj``; without KVSplice ``C = E = I``.
* RoPE columns (``w_qr``, ``w_kr``) go from our rotate-half pairs ``(i, i + Dr/2)`` to DeepSeek's interleaved
  ``(2i, 2i + 1)`` (``rope_interleave: true``, :func:`kvsplice.convert.deepseek_v3.interleave_index`).

**Why KVSplice-r exports exactly as MLA with ``kv_lora_rank = r``.** Our KVSplice model computes
``k, v = W_b E · norm(C · w_dkv x)``: the compress ``C`` follows the down-projection with nothing between them (the
layout refuses a norm on the uncompressed latent), so ``C w_dkv`` is one ``r``-row down-projection; the RMSNorm acts
on the ``r``-dim compressed latent, exactly where DeepSeek's ``kv_a_layernorm`` sits; and the expand ``E`` feeds
only linear up-projections, so ``w_uk E`` / ``w_uv E`` are ``kv_b_proj``'s columns. Every product is a weight
product; the export differs from our model by float round-off only.

The config comes from :func:`kvsplice.convert.deepseek_v3.dense_mla_config` (the converted models' export uses it
too); ``rms_norm_eps`` is :data:`models.config.RMS_NORM_EPS`, the eps of every norm here, including the latent's.

``pad_latent`` / ``pad_rope`` (``training.export --pad-latent P --pad-rope D``) write ``kv_lora_rank = P`` /
``qk_rope_head_dim = D``, exactly (:mod:`kvsplice.convert.latent_pad`: the latent zero-padded through its RMSNorm,
rows × sqrt(P/r) and norm weight ÷ sqrt(P/r); the RoPE pairs spread to keep their frequencies, ``q_proj`` × the
softmax-scale fold), for engines that take only some sizes (vLLM's CPU MLA kernel: 512 + 64).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import torch

from kvsplice.convert.deepseek_v3 import dense_mla_config, interleave_index
from kvsplice.convert.latent_pad import pad_columns, pad_normed_latent, padded_row, softmax_scale_fold, spread_rope_rows
from models.config import DEEPSEEK_V3, RMS_NORM_EPS, GPTConfig

__all__ = ["deepseek_v3_config", "deepseek_v3_state_dict", "llama_model", "save_deepseek_v3"]


def _check(cfg: GPTConfig, attention: str, fmt: str) -> None:
    if cfg.layout != DEEPSEEK_V3 or cfg.attention != attention:
        raise ValueError(f"--format {fmt} exports a layout=deepseek_v3 model with attention={attention!r}, got "
                         f"layout={cfg.layout!r} attention={cfg.attention!r} ({cfg.variant})")


def _common(model, i: int) -> dict[str, torch.Tensor]:
    """A block's norms and SwiGLU MLP under transformers' Llama / DeepSeek-V3 names."""
    blk, pre = model.transformer.h[i], f"model.layers.{i}."
    sd = {pre + "input_layernorm.weight": blk.ln_1.weight, pre + "post_attention_layernorm.weight": blk.ln_2.weight,
          pre + "self_attn.o_proj.weight": blk.attn.c_proj.weight}
    for name in ("gate_proj", "up_proj", "down_proj"):
        sd[pre + f"mlp.{name}.weight"] = getattr(blk.mlp, name).weight
    return sd


def _outer(model) -> dict[str, torch.Tensor]:
    """Embedding, final norm and an untied ``lm_head`` (a copy when our model ties it)."""
    t = model.transformer
    return {"model.embed_tokens.weight": t.wte.weight, "model.norm.weight": t.ln_f.weight,
            "lm_head.weight": model.lm_head.weight}


# ------------------------------------------------------------------------------------------------ DeepSeek-V3
def deepseek_v3_config(model, pad_latent: Optional[int] = None, pad_rope: Optional[int] = None) -> dict[str, Any]:
    """The ``config.json``: ``kv_lora_rank`` is the cached latent (``d_compressed`` for KVSplice) or ``pad_latent``,
    ``qk_rope_head_dim`` the RoPE key or ``pad_rope``."""
    cfg: GPTConfig = model.cfg
    _check(cfg, "mla", "deepseek_v3")
    rank, rope = padded_row(cfg.d_cached_latent, cfg.qk_rope_head_dim, pad_latent, pad_rope)
    extra = {}
    if (rank, rope) != (cfg.d_cached_latent, cfg.qk_rope_head_dim):
        extra["padded"] = {"kv_lora_rank": [cfg.d_cached_latent, rank],
                           "qk_rope_head_dim": [cfg.qk_rope_head_dim, rope]}
    return dense_mla_config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.ff_width,
        num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head, kv_lora_rank=rank,
        qk_rope_head_dim=rope, qk_nope_head_dim=cfg.head_size, v_head_dim=cfg.head_size,
        max_position_embeddings=cfg.block_size, rms_norm_eps=RMS_NORM_EPS, rope_theta=float(cfg.rope_theta),
        torch_dtype=str(model.transformer.wte.weight.dtype).replace("torch.", ""),
        kvsplice={"variant": cfg.variant, "d_latent": cfg.d_latent, "latent_norm_eps": RMS_NORM_EPS, **extra})


@torch.no_grad()
def deepseek_v3_state_dict(model, pad_latent: Optional[int] = None,
                           pad_rope: Optional[int] = None) -> dict[str, torch.Tensor]:
    """The weights under transformers' DeepSeek-V3 names, KVSplice folded into the projections; ``pad_latent`` /
    ``pad_rope``: the latent / RoPE key padded exactly to that many dims (:mod:`kvsplice.convert.latent_pad`)."""
    cfg: GPTConfig = model.cfg
    _check(cfg, "mla", "deepseek_v3")
    h, hs, dr = cfg.n_head, cfg.head_size, cfg.qk_rope_head_dim
    rank, rope = padded_row(cfg.d_cached_latent, dr, pad_latent, pad_rope)
    fold = softmax_scale_fold(hs, dr, rope)  # 1.0 unpadded
    perm = interleave_index(dr // 2)  # (Dr,): rotate-half rows -> interleaved pairs
    sd = _outer(model)
    for i, blk in enumerate(model.transformer.h):
        a, pre = blk.attn, f"model.layers.{i}.self_attn."
        wq = a.w_q.weight.view(h, hs, -1)  # (H, hs, d)
        wqr = spread_rope_rows(a.w_qr.weight.view(h, dr, -1)[:, perm], rope)  # (H, Dr', d), interleaved
        sd[pre + "q_proj.weight"] = torch.cat([wq, wqr], dim=1).flatten(0, 1) * fold  # (H·(hs + Dr'), d)
        down, norm = a.w_dkv.weight, a.kv_norm  # (d_latent, d)
        w_uk, w_uv = a.w_uk.weight, a.w_uv.weight  # (H·hs, d_latent) each
        if a.splice is not None:
            c, e = a.splice.compress_weight(), a.splice.expand_weight()  # (r, d_latent), (d_latent, r)
            down, norm, w_uk, w_uv = c @ down, a.splice_norm, w_uk @ e, w_uv @ e  # (r, d), -, (H·hs, r) x 2
        down, norm_w = pad_normed_latent(down, norm.weight, rank)  # (P, d), (P,); P = r unpadded
        k_rope = spread_rope_rows(a.w_kr.weight[perm], rope)  # (Dr', d), interleaved
        sd[pre + "kv_a_proj_with_mqa.weight"] = torch.cat([down, k_rope])  # (P + Dr', d)
        sd[pre + "kv_a_layernorm.weight"] = norm_w
        kv_b = torch.cat([w_uk.view(h, hs, -1), w_uv.view(h, hs, -1)], dim=1)  # (H, 2·hs, r): [k_nope ; v] per head
        sd[pre + "kv_b_proj.weight"] = pad_columns(kv_b.flatten(0, 1), rank)  # (H·2·hs, P)
        sd.update(_common(model, i))
    return {k: v.detach().cpu().contiguous().clone() for k, v in sd.items()}


def save_deepseek_v3(model, folder: Path, pad_latent: Optional[int] = None, pad_rope: Optional[int] = None) -> None:
    """Write ``config.json`` and ``model.safetensors`` into ``folder`` (``pad_latent`` / ``pad_rope``: the module)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    sd = deepseek_v3_state_dict(model, pad_latent, pad_rope)
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(deepseek_v3_config(model, pad_latent, pad_rope), indent=2) + "\n",
                                        encoding="utf-8")


# ------------------------------------------------------------------------------------------------------ Llama
@torch.no_grad()
def llama_model(model, eot_id: Optional[int] = None):
    """Our standard-attention model as a ``transformers.LlamaForCausalLM`` with the same weights (``c_attn`` split
    into ``q_proj`` / ``k_proj`` / ``v_proj``; RoPE is rotate-half in both); BOS/EOS = ``eot_id``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg: GPTConfig = model.cfg
    _check(cfg, "mha", "llama")
    hf_cfg = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.ff_width,
                         num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head,
                         num_key_value_heads=cfg.kv_heads, head_dim=cfg.head_size, hidden_act="silu",
                         max_position_embeddings=cfg.block_size, rms_norm_eps=RMS_NORM_EPS,
                         rope_theta=float(cfg.rope_theta), attention_bias=False, mlp_bias=False,
                         tie_word_embeddings=False, bos_token_id=eot_id, eos_token_id=eot_id)
    d_kv = cfg.kv_heads * cfg.head_size
    sd = _outer(model)
    for i, blk in enumerate(model.transformer.h):
        q, k, v = blk.attn.c_attn.weight.split([cfg.d_model, d_kv, d_kv])  # (d, d), (Hkv·hs, d) x 2
        pre = f"model.layers.{i}.self_attn."
        sd.update({pre + "q_proj.weight": q, pre + "k_proj.weight": k, pre + "v_proj.weight": v})
        sd.update(_common(model, i))
    hf = LlamaForCausalLM(hf_cfg).eval()
    hf.load_state_dict({n: w.detach().clone() for n, w in sd.items()}, strict=True)
    return hf
