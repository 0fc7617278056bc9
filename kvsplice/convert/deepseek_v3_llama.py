"""The DeepSeek-V3 writer of a converted shared-RoPE :class:`models.mla_llama.MLALlama` (``to_mla --format
deepseek_v3``): what plain ``transformers`` (no remote code), vLLM, SGLang and llama.cpp load as MLA.

Its own part of the mapping (the shared part: :mod:`kvsplice.convert.deepseek_v3_writer`), per layer (``H`` query
heads of ``D`` dims, ``Dr`` RoPE dims):

* ``q_nope`` / ``q_rope`` = ``W_q,i`` / ``A_iᵀ W_q,i``, scaled by ``scale / (D + Dr')^-0.5`` — DeepSeek's softmax
  scale is fixed at ``(nope + rope)^-0.5``; the latent = ``w_dkv``, the RoPE key ``Bᵀ W_k``; ``kv_b_proj`` per query
  head of its KV group (``num_key_value_heads = num_attention_heads``: keys are expanded per head);
* a **norm-free** model (the training-free conversion's best, and what fine-tuning starts from) is written with the
  latent RMSNorm in its *linear regime* (:func:`linear_regime`): DeepSeek-V3 always normalises the latent,
  ``c / sqrt(mean(c²) + ε) · w``, and for ``mean(c²) ≪ ε`` that is ``c / sqrt(ε) · w`` — linear. The export scales
  the latent rows by ``γ`` so that ``mean((γc)²) ≤ ρ ε`` for *every* input the layer can see (a bound from the
  weights: ``‖c‖ ≤ σ_max(w_dkv · diag(g)) · sqrt(d)`` for the input RMSNorm's output ``x = g ⊙ x̂``, ``‖x̂‖² < d``;
  ``ρ = 1e-4``: each token's latent is off by at most 0.005 %), and sets ``w = sqrt(ε) / γ``, so the cached normed
  latent *is* the norm-free latent ``c``. To keep every stored weight and activation in f16's range (llama.cpp's
  converter writes f16 by default), ``s = sqrt(γ)`` moves between the input RMSNorm (``× s``), ``q_proj`` and the
  RoPE rows (``/ s``) and the latent rows (``γ / s``). ``ε`` is the one eps every engine uses for the latent:
  transformers hard-codes 1e-6 for ``kv_a_layernorm``, llama.cpp and vLLM use ``rms_norm_eps``, so such an export
  writes ``rms_norm_eps = 1e-6`` (the other norms' change: SmolLM2's perplexity 13.208 → 13.207; ~1e-3 on the
  logits of a model with small hidden states, docs/conversion.md);
* ``rope_theta = θ^(Dr/D)`` reproduces the highest ``Dr/2`` source frequencies the shared layout keeps.

Refused with one line: the per-head layout (DeepSeek-V3 has one RoPE key per token), biases (Qwen2), per-head q/k
norms (Qwen3), sliding windows, a RoPE table that is not DeepSeek's geometric one.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

from kvsplice.convert.deepseek_v3_writer import DeepSeekV3Writer, MLALayer, interleave_index, register
from models.mla_llama import MLALlama

__all__ = ["LINEAR_EPS", "LINEAR_RHO", "ConvertedLlamaWriter", "linear_regime"]

LINEAR_EPS = 1e-6
"""``rms_norm_eps`` of a linear-regime export: transformers' fixed ``kv_a_layernorm`` eps (llama.cpp / vLLM read
the latent's eps from ``rms_norm_eps``)."""
LINEAR_RHO = 1e-4
"""Largest ``mean(c²) / ε`` of a linear-regime latent over every possible input (per-token error ≤ ρ/2)."""


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


@torch.no_grad()
def linear_regime(model: MLALlama) -> list[tuple[float, float]]:
    """Per layer ``(γ, s)`` of the linear-regime export of a norm-free model (module docstring)."""
    out = []
    for blk in model.layers:
        w = blk.attn.w_dkv.weight.double() * blk.input_norm.weight.double()[None]  # (R, d): W diag(g)
        sigma = float(torch.linalg.matrix_norm(w, ord=2))
        r, d = w.shape
        max_ms = sigma ** 2 * d / r  # mean(c²) ≤ ‖c‖² / R ≤ σ² d / R
        gamma = (LINEAR_RHO * LINEAR_EPS / max(max_ms, 1e-30)) ** 0.5
        out.append((gamma, gamma ** 0.5))
    return out


@register
class ConvertedLlamaWriter(DeepSeekV3Writer):
    """A converted Llama-family model (:class:`models.mla_llama.MLALlama`, shared RoPE layout)."""

    family = "converted Llama-family model"

    @classmethod
    def accepts(cls, model: Any) -> bool:
        return isinstance(model, MLALlama)

    def check(self) -> None:
        cfg = self.model.cfg
        if cfg.rope_layout != "shared":
            raise ValueError("--format deepseek_v3 needs --rope-layout shared: DeepSeek-V3 caches one RoPE key per "
                             "token, the per-head layout one per KV head")
        if cfg.attention_bias or cfg.head_norms:
            raise ValueError("--format deepseek_v3: DeepSeek-V3 has no q/k/v biases (Qwen2) nor per-head q/k norms "
                             "(Qwen3)")
        if any(cfg.windows):
            raise ValueError("--format deepseek_v3: DeepSeek-V3 has no sliding-window attention")
        if abs(cfg.rope_attention_scaling - 1.0) > 1e-12:
            raise ValueError("--format deepseek_v3: the source's RoPE scales cos/sin (attention_scaling != 1)")
        _rope_theta(self.model)

    def row(self) -> tuple[int, int]:
        return self.model.cfg.d_latent, self.model.cfg.rope_dims

    def config_fields(self) -> dict[str, Any]:
        model = self.model
        cfg = model.cfg
        # a real latent norm (eps 1e-6 = transformers' fixed kv_a_layernorm eps): rms_norm_eps = norm_eps, so
        # transformers computes our model exactly; llama.cpp / vLLM normalise the latent with rms_norm_eps (a 1e-5
        # source: a small difference, docs/conversion.md). The linear regime needs one eps in every engine: 1e-6 (the
        # other norms then move slightly when the source's eps was larger: docs/conversion.md)
        eps = cfg.norm_eps if cfg.latent_norm else LINEAR_EPS
        latent = ({"latent_norm_eps": cfg.latent_norm_eps} if cfg.latent_norm else
                  {"latent_norm": f"linear regime of a norm-free model (rho {LINEAR_RHO}, eps {LINEAR_EPS})"})
        latent["source_rms_norm_eps"] = cfg.norm_eps
        return dict(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
                    num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head, qk_nope_head_dim=cfg.head_dim,
                    v_head_dim=cfg.head_dim, max_position_embeddings=cfg.max_positions, rms_norm_eps=eps,
                    rope_theta=_rope_theta(model),
                    torch_dtype=str(model.embed.weight.dtype).replace("torch.", ""),
                    kvsplice={"source": cfg.source, **latent})

    def outer(self) -> dict[str, torch.Tensor]:
        m = self.model
        return {"model.embed_tokens.weight": m.embed.weight, "model.norm.weight": m.norm.weight,
                "lm_head.weight": m.lm_head.weight}

    def layers(self, padded_rope: int) -> Iterator[MLALayer]:
        model = self.model
        cfg = model.cfg
        h, d, g = cfg.n_head, cfg.head_dim, cfg.n_head // cfg.n_kv_head
        perm = interleave_index(cfg.rope_dims // 2)
        fold = cfg.scale / (d + padded_rope) ** -0.5  # DeepSeek multiplies scores by (D + Dr')^-0.5
        regime = None if cfg.latent_norm else linear_regime(model)
        for i, blk in enumerate(model.layers):
            at = blk.attn
            gamma, s = (1.0, 1.0) if regime is None else regime[i]
            wq = at.q_proj.weight.view(h, d, -1)  # (H, D, d_model)
            if regime is None:
                norm_w = at.kv_norm.weight
            else:  # c' = γ c, mean(c'²) ≤ ρ ε: norm(c') · sqrt(ε)/γ = c (to ρ/2)
                norm_w = at.w_dkv.weight.new_full((cfg.d_latent,), LINEAR_EPS ** 0.5 / gamma)
            rest = {"self_attn.o_proj.weight": at.o_proj.weight, "input_layernorm.weight": blk.input_norm.weight * s,
                    "post_attention_layernorm.weight": blk.post_norm.weight}
            rest.update({f"mlp.{n}.weight": getattr(blk, n).weight for n in ("gate_proj", "up_proj", "down_proj")})
            yield MLALayer(
                q_nope=wq, q_rope=torch.einsum("hde,hdm->hem", at.q_rope.to(wq), wq)[:, perm],  # (H, Dr, d_model)
                q_scale=fold / s, down=at.w_dkv.weight * (gamma / s), norm=norm_w,
                k_rope=(at.k_rope.to(wq).T @ at.k_proj.weight)[perm] / s,  # (Dr, d_model), interleaved
                w_uk=at.w_uk.weight.view(cfg.n_kv_head, d, -1).repeat_interleave(g, 0),  # (H, D, R)
                w_uv=at.w_uv.weight.view(cfg.n_kv_head, d, -1).repeat_interleave(g, 0),  # (H, D, R)
                rest=rest)
