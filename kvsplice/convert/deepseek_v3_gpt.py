"""The DeepSeek-V3 writer of a trained ``layout="deepseek_v3"`` :class:`models.GPT` with MLA or MLA + KVSplice
(``training.export --format deepseek_v3``): a folder plain ``transformers`` loads without remote code.

Its own part of the mapping (the shared part: :mod:`kvsplice.convert.deepseek_v3_writer`), per layer (``H`` heads of
``hs``, RoPE ``Dr``, cached latent ``r``):

* ``q_nope`` / ``q_rope`` = ``w_q[h]`` / ``w_qr[h]`` — the scale is ours already, ``(hs + Dr)^-½`` (× the fold of a
  padded RoPE key, :func:`kvsplice.convert.latent_pad.softmax_scale_fold`);
* the latent = ``C w_dkv``, its norm the one RMSNorm before our cache (``kv_norm`` for MLA, ``splice_norm`` for
  KVSplice); the RoPE key ``w_kr``; ``kv_b_proj`` per head ``[w_uk[h] E ; w_uv[h] E]``; without KVSplice
  ``C = E = I``; ``o_proj`` = ``c_proj``.

**Why KVSplice-r exports exactly as MLA with ``kv_lora_rank = r``.** Our KVSplice model computes
``k, v = W_b E · norm(C · w_dkv x)``: the compress ``C`` follows the down-projection with nothing between them (the
layout refuses a norm on the uncompressed latent), so ``C w_dkv`` is one ``r``-row down-projection; the RMSNorm acts
on the ``r``-dim compressed latent, exactly where DeepSeek's ``kv_a_layernorm`` sits; and the expand ``E`` feeds
only linear up-projections, so ``w_uk E`` / ``w_uv E`` are ``kv_b_proj``'s columns. Every product is a weight
product; the export differs from our model by float round-off only.

``rms_norm_eps`` is :data:`models.config.RMS_NORM_EPS`, the eps of every norm here, including the latent's.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

from kvsplice.convert.deepseek_v3_writer import DeepSeekV3Writer, MLALayer, interleave_index, register
from kvsplice.convert.latent_pad import softmax_scale_fold
from models.config import DEEPSEEK_V3, RMS_NORM_EPS, GPTConfig

__all__ = ["TrainedGPTWriter", "check_layout", "common_weights", "outer_weights"]


def check_layout(cfg: GPTConfig, attention: str, fmt: str) -> None:
    """ValueError (one line) unless ``cfg`` is a ``layout=deepseek_v3`` model with ``attention``."""
    if cfg.layout != DEEPSEEK_V3 or cfg.attention != attention:
        raise ValueError(f"--format {fmt} exports a layout=deepseek_v3 model with attention={attention!r}, got "
                         f"layout={cfg.layout!r} attention={cfg.attention!r} ({cfg.variant})")


def common_weights(model, i: int) -> dict[str, torch.Tensor]:
    """Block ``i``'s norms, ``o_proj`` and SwiGLU MLP under transformers' Llama / DeepSeek-V3 names (no prefix)."""
    blk = model.transformer.h[i]
    sd = {"input_layernorm.weight": blk.ln_1.weight, "post_attention_layernorm.weight": blk.ln_2.weight,
          "self_attn.o_proj.weight": blk.attn.c_proj.weight}
    for name in ("gate_proj", "up_proj", "down_proj"):
        sd[f"mlp.{name}.weight"] = getattr(blk.mlp, name).weight
    return sd


def outer_weights(model) -> dict[str, torch.Tensor]:
    """Embedding, final norm and an untied ``lm_head`` (a copy when our model ties it)."""
    t = model.transformer
    return {"model.embed_tokens.weight": t.wte.weight, "model.norm.weight": t.ln_f.weight,
            "lm_head.weight": model.lm_head.weight}


@register
class TrainedGPTWriter(DeepSeekV3Writer):
    """A trained ``layout="deepseek_v3"`` GPT with MLA (``kv_lora_rank``: the cached latent, ``d_compressed`` for
    KVSplice)."""

    family = "trained deepseek_v3-layout GPT"

    @classmethod
    def accepts(cls, model: Any) -> bool:
        from models.gpt import GPT

        return isinstance(model, GPT)

    def check(self) -> None:
        check_layout(self.model.cfg, "mla", "deepseek_v3")

    def row(self) -> tuple[int, int]:
        return self.model.cfg.d_cached_latent, self.model.cfg.qk_rope_head_dim

    def config_fields(self) -> dict[str, Any]:
        cfg: GPTConfig = self.model.cfg
        return dict(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.ff_width,
                    num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head, qk_nope_head_dim=cfg.head_size,
                    v_head_dim=cfg.head_size, max_position_embeddings=cfg.block_size, rms_norm_eps=RMS_NORM_EPS,
                    rope_theta=float(cfg.rope_theta),
                    torch_dtype=str(self.model.transformer.wte.weight.dtype).replace("torch.", ""),
                    kvsplice={"variant": cfg.variant, "d_latent": cfg.d_latent, "latent_norm_eps": RMS_NORM_EPS})

    def outer(self) -> dict[str, torch.Tensor]:
        return outer_weights(self.model)

    def layers(self, padded_rope: int) -> Iterator[MLALayer]:
        model = self.model
        cfg: GPTConfig = model.cfg
        h, hs, dr = cfg.n_head, cfg.head_size, cfg.qk_rope_head_dim
        fold = softmax_scale_fold(hs, dr, padded_rope)  # 1.0 unpadded
        perm = interleave_index(dr // 2)  # (Dr,): rotate-half rows -> interleaved pairs
        for i, blk in enumerate(model.transformer.h):
            a = blk.attn
            down, norm = a.w_dkv.weight, a.kv_norm  # (d_latent, d)
            w_uk, w_uv = a.w_uk.weight, a.w_uv.weight  # (H·hs, d_latent) each
            if a.splice is not None:
                c, e = a.splice.compress_weight(), a.splice.expand_weight()  # (r, d_latent), (d_latent, r)
                down, norm, w_uk, w_uv = c @ down, a.splice_norm, w_uk @ e, w_uv @ e  # (r, d), -, (H·hs, r) x 2
            yield MLALayer(q_nope=a.w_q.weight.view(h, hs, -1), q_rope=a.w_qr.weight.view(h, dr, -1)[:, perm],
                           q_scale=fold, down=down, norm=norm.weight, k_rope=a.w_kr.weight[perm],
                           w_uk=w_uk.view(h, hs, -1), w_uv=w_uv.view(h, hs, -1), rest=common_weights(model, i))
