"""Export a converted shared-RoPE :class:`models.mla_llama.MLALlama` as a DeepSeek-V3 folder: what plain
``transformers`` (``AutoModelForCausalLM.from_pretrained``, no remote code), vLLM and SGLang load as MLA.

The mapping, per layer (``H`` query heads of ``D`` dims, ``Dr`` RoPE dims, latent ``R``):

* ``q_proj`` (``q_lora_rank: null``): per head ``[q_nope (D) ; q_rope (Dr)]`` = ``[W_q,i ; A_iᵀ W_q,i]``, times
  ``scale / (D + Dr)^-0.5`` — DeepSeek's softmax scale is fixed at ``(nope + rope)^-0.5``;
* ``kv_a_proj_with_mqa`` = ``[w_dkv ; Bᵀ W_k]`` (latent, then the one shared RoPE key), ``kv_a_layernorm`` = the
  latent RMSNorm, ``kv_b_proj`` = per query head ``[w_uk ; w_uv]`` of its KV group (``num_key_value_heads =
  num_attention_heads``: keys are expanded per head);
* a **norm-free** model (the training-free conversion's best, and what fine-tuning starts from) is written with the
  latent RMSNorm in its *linear regime* (:func:`linear_regime`): DeepSeek-V3 always normalises the latent,
  ``c / sqrt(mean(c²) + ε) · w``, and for ``mean(c²) ≪ ε`` that is ``c / sqrt(ε) · w`` — linear. The export scales
  the latent rows of ``kv_a_proj_with_mqa`` by ``γ`` so that ``mean((γc)²) ≤ ρ ε`` for *every* input the layer
  can see (a bound from the weights: ``‖c‖ ≤ σ_max(w_dkv · diag(g)) · sqrt(d)`` for the input RMSNorm's output
  ``x = g ⊙ x̂``, ``‖x̂‖² < d``; ``ρ = 1e-4``: each token's latent is off by at most 0.005 %), and sets ``w =
  sqrt(ε) / γ``, so the cached normed latent *is* the norm-free latent ``c``. To keep every stored weight and
  activation in f16's range (llama.cpp's converter writes f16 by default), ``s = sqrt(γ)`` moves between the
  input RMSNorm (``× s``), ``q_proj`` and the RoPE rows (``/ s``) and the latent rows (``γ / s``). ``ε`` is the
  one eps every engine uses for the latent: transformers hard-codes 1e-6 for ``kv_a_layernorm``, llama.cpp and vLLM
  use ``rms_norm_eps``, so such an export writes ``rms_norm_eps = 1e-6`` (the other norms' change: SmolLM2's
  perplexity 13.208 → 13.207; ~1e-3 on the logits of a model with small hidden states, docs/conversion.md);
* RoPE: ``rope_interleave: true`` (vLLM's DeepSeek layout), so the RoPE columns go from rotate-half
  ``[x_0..x_{n-1}, y_0..y_{n-1}]`` to ``[x_0, y_0, x_1, y_1, ...]``; ``rope_theta = θ^(Dr/D)`` reproduces the
  highest ``Dr/2`` source frequencies the shared layout keeps;
* dense MLPs everywhere (``first_k_dense_replace = num_hidden_layers``), untied ``lm_head``;
* ``pad_latent`` / ``pad_rope`` (``to_mla --pad-latent 512 --pad-rope 64``: vLLM's CPU MLA kernel takes only that
  row): the latent zero-padded *through* its RMSNorm (rows × sqrt(P/R), norm weight ÷ sqrt(P/R): the mean over P
  dims is the mean over R, so a real latent norm and the linear regime stay exact) and the RoPE pairs spread at
  their own frequencies, ``q_proj`` scaled for DeepSeek's ``(D + Dr')^-½`` (:mod:`kvsplice.convert.latent_pad`).

Refused with one line: the per-head layout (DeepSeek-V3 has one RoPE key per token), biases (Qwen2), per-head q/k
norms (Qwen3), sliding windows, a RoPE table that is not DeepSeek's geometric one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import torch

from kvsplice.convert import latent_pad
from models.mla_llama import MLALlama

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
    if cfg.attention_bias or cfg.head_norms:
        raise ValueError("--format deepseek_v3: DeepSeek-V3 has no q/k/v biases (Qwen2) nor per-head q/k norms "
                         "(Qwen3)")
    if any(cfg.windows):
        raise ValueError("--format deepseek_v3: DeepSeek-V3 has no sliding-window attention")
    if abs(cfg.rope_attention_scaling - 1.0) > 1e-12:
        raise ValueError("--format deepseek_v3: the source's RoPE scales cos/sin (attention_scaling != 1)")
    _rope_theta(model)


LINEAR_EPS = 1e-6
"""``rms_norm_eps`` of a linear-regime export: transformers' fixed ``kv_a_layernorm`` eps (llama.cpp / vLLM read
the latent's eps from ``rms_norm_eps``)."""
LINEAR_RHO = 1e-4
"""Largest ``mean(c²) / ε`` of a linear-regime latent over every possible input (per-token error ≤ ρ/2)."""


@torch.no_grad()
def linear_regime(model: MLALlama) -> list[tuple[float, float]]:
    """Per layer ``(γ, s)`` of the linear-regime export of a norm-free model (module docstring)."""
    out = []
    for blk in model.layers:
        w = blk.attn.kv_down.weight.double() * blk.input_norm.weight.double()[None]  # (R, d): W diag(g)
        sigma = float(torch.linalg.matrix_norm(w, ord=2))
        r, d = w.shape
        max_ms = sigma ** 2 * d / r  # mean(c²) ≤ ‖c‖² / R ≤ σ² d / R
        gamma = (LINEAR_RHO * LINEAR_EPS / max(max_ms, 1e-30)) ** 0.5
        out.append((gamma, gamma ** 0.5))
    return out


def check_pad(model: MLALlama, pad_latent: Optional[int], pad_rope: Optional[int] = None) -> tuple[int, int]:
    """The exported ``(kv_lora_rank, qk_rope_head_dim)``: the model's, or ``pad_latent`` / ``pad_rope`` (padded
    exactly by :mod:`kvsplice.convert.latent_pad`, so that an engine that takes only some row sizes runs the model:
    vLLM's MLA takes latent + RoPE of 320 / 512 / 576, its CPU kernel 512 + 64). ValueError (one line) for a size
    smaller than the model's or a RoPE size that is not a multiple of it."""
    cfg = model.cfg
    return latent_pad.padded_row(cfg.d_latent, cfg.rope_dims, pad_latent, pad_rope)


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
        "num_experts_per_tok": 1, "n_group": None, "topk_group": None,  # null: llama.cpp asserts n_expert_groups < n_expert
        "routed_scaling_factor": 1.0, "norm_topk_prob": True,
        "hidden_act": "silu", "max_position_embeddings": max_position_embeddings, "rms_norm_eps": rms_norm_eps,
        "rope_interleave": True, "rope_theta": rope_theta,  # transformers 4.x reads this one
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": False, "use_cache": True,
        "torch_dtype": torch_dtype, "kvsplice": kvsplice,
    }


def deepseek_v3_config(model: MLALlama, pad_latent: Optional[int] = None,
                       pad_rope: Optional[int] = None) -> dict[str, Any]:
    """The ``config.json`` of the export."""
    cfg = model.cfg
    rank, rope = check_pad(model, pad_latent, pad_rope)
    # a real latent norm (eps 1e-6 = transformers' fixed kv_a_layernorm eps): rms_norm_eps = norm_eps, so transformers
    # computes our model exactly; llama.cpp / vLLM normalise the latent with rms_norm_eps (a 1e-5 source: a small
    # difference, docs/conversion.md). The linear regime needs one eps in every engine: 1e-6 (the other norms then
    # move slightly when the source's eps was larger: docs/conversion.md)
    eps = cfg.norm_eps if cfg.latent_norm else LINEAR_EPS
    latent = ({"latent_norm_eps": cfg.latent_norm_eps} if cfg.latent_norm else
              {"latent_norm": f"linear regime of a norm-free model (rho {LINEAR_RHO}, eps {LINEAR_EPS})"})
    latent["source_rms_norm_eps"] = cfg.norm_eps
    if (rank, rope) != (cfg.d_latent, cfg.rope_dims):
        latent["padded"] = {"kv_lora_rank": [cfg.d_latent, rank], "qk_rope_head_dim": [cfg.rope_dims, rope]}
    return dense_mla_config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff, num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head, kv_lora_rank=rank, qk_rope_head_dim=rope,
        qk_nope_head_dim=cfg.head_dim, v_head_dim=cfg.head_dim, max_position_embeddings=cfg.max_positions,
        rms_norm_eps=eps, rope_theta=_rope_theta(model), torch_dtype=str(model.embed.weight.dtype).replace("torch.", ""),
        kvsplice={"source": cfg.source, **latent})


def interleave_index(n: int) -> torch.Tensor:
    """Index ``(2n,)`` taking rotate-half ``[x_0..x_{n-1}, y_0..y_{n-1}]`` to ``[x_0, y_0, x_1, y_1, ...]``."""
    return torch.stack([torch.arange(n), torch.arange(n) + n], dim=1).flatten()


@torch.no_grad()
def deepseek_v3_state_dict(model: MLALlama, pad_latent: Optional[int] = None,
                           pad_rope: Optional[int] = None) -> dict[str, torch.Tensor]:
    """The export's weights (transformers' DeepSeek-V3 names), from ``model`` (checked by :func:`check_exportable`);
    ``pad_latent`` / ``pad_rope``: :func:`check_pad`."""
    check_exportable(model)
    cfg = model.cfg
    rank, rope = check_pad(model, pad_latent, pad_rope)
    h, d, dr, g = cfg.n_head, cfg.head_dim, cfg.rope_dims, cfg.n_head // cfg.n_kv_head
    perm = interleave_index(dr // 2)
    fold = cfg.scale / (d + rope) ** -0.5  # DeepSeek multiplies scores by (D + Dr')^-0.5
    sd: dict[str, torch.Tensor] = {"model.embed_tokens.weight": model.embed.weight,
                                   "model.norm.weight": model.norm.weight, "lm_head.weight": model.lm_head.weight}
    regime = None if cfg.latent_norm else linear_regime(model)
    for i, blk in enumerate(model.layers):
        at, pre = blk.attn, f"model.layers.{i}."
        gamma, s = (1.0, 1.0) if regime is None else regime[i]
        wq = at.q_proj.weight.view(h, d, -1)  # (H, D, d_model)
        q_rope = torch.einsum("hde,hdm->hem", at.q_rope.to(wq), wq)[:, perm]  # (H, Dr, d_model), interleaved
        q_rope = latent_pad.spread_rope_rows(q_rope, rope)  # (H, Dr', d_model): same frequencies
        sd[pre + "self_attn.q_proj.weight"] = (torch.cat([wq, q_rope], dim=1) * (fold / s)).flatten(0, 1)
        k_rope = latent_pad.spread_rope_rows((at.k_rope.to(wq).T @ at.k_proj.weight)[perm], rope)  # (Dr', d_model)
        if regime is None:
            norm_w = at.kv_norm.weight
        else:  # c' = γ c, mean(c'²) ≤ ρ ε: norm(c') · sqrt(ε)/γ = c (to ρ/2)
            norm_w = at.kv_down.weight.new_full((cfg.d_latent,), LINEAR_EPS ** 0.5 / gamma)
        # padded through the norm: rows × sqrt(P/R), weight ÷ sqrt(P/R) (mean(c²) over P dims unchanged)
        down, norm_w = latent_pad.pad_normed_latent(at.kv_down.weight * (gamma / s), norm_w, rank)  # (P, d), (P,)
        sd[pre + "self_attn.kv_a_proj_with_mqa.weight"] = torch.cat([down, k_rope / s])  # (P + Dr', d_model)
        sd[pre + "self_attn.kv_a_layernorm.weight"] = norm_w
        wuk = at.k_up.weight.view(cfg.n_kv_head, d, -1).repeat_interleave(g, 0)  # (H, D, R)
        wuv = at.v_up.weight.view(cfg.n_kv_head, d, -1).repeat_interleave(g, 0)  # (H, D, R)
        kv_b = torch.cat([wuk, wuv], dim=1).flatten(0, 1)  # (H·2D, R)
        sd[pre + "self_attn.kv_b_proj.weight"] = latent_pad.pad_columns(kv_b, rank)  # (H·2D, P)
        sd[pre + "self_attn.o_proj.weight"] = at.o_proj.weight
        sd[pre + "input_layernorm.weight"] = blk.input_norm.weight * s
        sd[pre + "post_attention_layernorm.weight"] = blk.post_norm.weight
        for name in ("gate_proj", "up_proj", "down_proj"):
            sd[pre + f"mlp.{name}.weight"] = getattr(blk, name).weight
    return {k: v.detach().cpu().contiguous().clone() for k, v in sd.items()}


def save_deepseek_v3(model: MLALlama, folder: Path, tokenizer: Optional[Any] = None,
                     pad_latent: Optional[int] = None, pad_rope: Optional[int] = None) -> None:
    """Write the export into ``folder`` (a fresh temporary folder of :func:`kvsplice.io.outputs.write_dir`)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    sd = deepseek_v3_state_dict(model, pad_latent, pad_rope)
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(deepseek_v3_config(model, pad_latent, pad_rope), indent=2) + "\n",
                                        encoding="utf-8")
    if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(str(folder))
        portable_tokenizer_config(folder)


def portable_tokenizer_config(folder: Path) -> None:
    """Make ``tokenizer_config.json`` readable by transformers 4.x and 5.x: transformers 5 saves ``tokenizer_class:
    TokenizersBackend``, a class 4.x (llama.cpp's converter pins 4.57) does not have; ``PreTrainedTokenizerFast`` reads
    the same ``tokenizer.json`` in both."""
    p = Path(folder) / "tokenizer_config.json"
    if not p.is_file():
        return
    tc = json.loads(p.read_text(encoding="utf-8"))
    if tc.get("tokenizer_class") in ("TokenizersBackend", None):
        tc["tokenizer_class"] = "PreTrainedTokenizerFast"
        p.write_text(json.dumps(tc, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
