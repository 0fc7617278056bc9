"""Pretrained Llama-family model (Llama, Mistral, Qwen2, Qwen3) → :class:`models.mla_llama.MLALlama`.

Per layer, from calibration activations (the attention inputs ``x``, the queries and keys before RoPE, and a few
whole windows of inputs and attention outputs):

1. **Decoupled RoPE** (:mod:`kvsplice.convert.rope_split`): ``shared`` keeps, per each of the ``Dr/2`` highest
   frequencies, the top complex component of the KV heads' key pairs (weighted by query energy), one RoPE key for
   all heads as DeepSeek-V3 caches it; ``per-head`` keeps each KV head's ``Dr/2`` pairs of largest mean
   ``‖q‖·‖k‖`` (MHA2MLA). The rest of the keys, ``(I − U Bᵀ) k``, loses RoPE.
2. **Joint latent** (:mod:`kvsplice.convert.latent_fit`): no-RoPE keys and values share one latent of ``R``,
   fitted to what attention does with them — key errors weighted by the queries that read them, value errors by the
   output projection — with the key/value balance ``α`` picked per layer by the measured attention-output error on
   the kept windows. Keys are a linear map of ``x`` (Llama / Mistral / Qwen2) or, for Qwen3's per-head key RMSNorm,
   their least-squares regression on ``x``. At ``R`` = the rank of the no-RoPE keys and values the fit is exact.
3. **Layer-local correction** (:mod:`kvsplice.convert.refine`, ``refine_steps``): a few optimiser steps per layer
   move the latent maps so the layer's output matches the source layer's on the kept windows.
4. **Latent RMSNorm** (``latent_norm``, DeepSeek's ``kv_a_layernorm``): ``c / rms(c) · w``; its weight starts at the
   calibration latents' mean RMS. Full-rank exactness holds for the norm-free variant (the default).

KVSplice (:func:`shrink_latent`) of a converted norm-free model: the top principal directions ``C`` of its latents
on calibration text give ``w_dkv' = C w_dkv``, ``w_uk' = w_uk Cᵀ``, ``w_uv' = w_uv Cᵀ`` — a smaller latent.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional

import torch
from tqdm.auto import tqdm

from kvsplice.adapters.llama import LlamaAdapter
from kvsplice.convert.distance import damping_map, distance_profile
from kvsplice.convert.latent_fit import LatentFitter, attention_weights
from kvsplice.convert.refine import refine_attention
from kvsplice.convert.rope_split import RopeSplit, per_head_split, shared_split
from models.mla_llama import MLALlama, MLALlamaConfig

__all__ = ["CONVERTIBLE", "FitOptions", "LayerStats", "calibrate_layers", "convert_llama", "full_latent", "output_error",
           "refine_layers",
           "shrink_latent"]

CONVERTIBLE = ("llama", "mistral", "qwen2", "qwen3")
"""``model_type`` of the families :func:`convert_llama` converts (Llama layout, SiLU-gated MLP, full rotary)."""


@dataclass
class LayerStats:
    """Streamed second moments of one layer (float64): ``xx`` ``(d, d)``, ``kx`` ``(Hkv·D, d)``, ``kk``
    ``(Hkv·D, Hkv·D)`` and ``qq`` ``(H·D, H·D)`` (keys and queries after any head norm, before RoPE) and ``pair``
    ``(Hkv, D/2)``: summed ``mean_group ‖q_pair‖ · ‖k_pair‖``; ``n`` tokens. ``windows``: a few whole calibration
    windows ``(x, y)`` of the layer's attention inputs and outputs ``(1, T, d)`` (float32), what the key/value
    balance is measured on and the layer-local correction trains on."""

    xx: torch.Tensor
    kx: torch.Tensor
    kk: torch.Tensor
    pair: torch.Tensor
    n: int = 0
    qq: Optional[torch.Tensor] = None
    windows: list = field(default_factory=list)
    profile: Optional[torch.Tensor] = None  # (Hkv, T) attention's distances on the windows, once measured


@dataclass(frozen=True)
class FitOptions:
    """How each layer is fitted (the defaults: the best measured on SmolLM2, docs/conversion.md). Every pair of
    ``damping`` (no-RoPE key pairs replaced by their mean over attention's distances,
    :mod:`kvsplice.convert.distance`, or kept whole) and ``alphas`` (multipliers of the energy-balanced key/value
    weight) is fitted per layer and the lowest attention-output error on the kept windows wins; ``refine_steps``:
    Adam steps of the layer-local correction (0: none)."""

    query_weighted_rope: bool = True
    attention_weighted: bool = True
    damping: tuple = (False, True)
    alphas: tuple = (1.0, 0.5, 2.0)  # the first alone when nothing is measured: the energy balance
    refine_steps: int = 0
    refine_lr: float = 3e-4


def check_convertible(model) -> LlamaAdapter:
    """The model's adapter, or ``ValueError`` (one line) for a family the conversion does not cover."""
    from kvsplice.adapters.registry import adapter_for

    a = adapter_for(model)
    mt = getattr(model.config, "model_type", None)
    if mt not in CONVERTIBLE or not isinstance(a, LlamaAdapter):
        raise ValueError(f"conversion to MLA covers model_type {', '.join(CONVERTIBLE)} (and our GPT checkpoints); "
                         f"got {mt!r}")
    cfg = a.config
    if getattr(cfg, "hidden_act", "silu") != "silu" or getattr(cfg, "mlp_bias", False):
        raise ValueError(f"{mt}: conversion needs the SiLU-gated MLP without biases")
    if a.rotary_dim != a.head_dim or a.head_dim % 2:
        raise ValueError(f"{mt}: conversion needs full rotary on an even head_dim")
    if a.m.layers[0].self_attn.o_proj.bias is not None:
        raise ValueError(f"{mt}: an output-projection bias is not supported")
    return a


@torch.no_grad()
def calibrate_layers(model, batches: Iterable[torch.Tensor], progress: bool = False, keep_windows: int = 0
                     ) -> list[LayerStats]:
    """Stream :class:`LayerStats` of every layer over ``batches`` of token ids ``(B, T)``, keeping the first
    ``keep_windows`` windows' attention inputs and outputs."""
    a = check_convertible(model)
    d, kvd, qd, half = a.d_model, a.n_kv_head * a.head_dim, a.n_head * a.head_dim, a.head_dim // 2
    stats = [LayerStats(torch.zeros(d, d, dtype=torch.float64), torch.zeros(kvd, d, dtype=torch.float64),
                        torch.zeros(kvd, kvd, dtype=torch.float64), torch.zeros(a.n_kv_head, half,
                                                                                dtype=torch.float64),
                        qq=torch.zeros(qd, qd, dtype=torch.float64))
             for _ in range(a.n_layer)]
    seen: dict[tuple[int, str], torch.Tensor] = {}

    def pair_norms(z: torch.Tensor) -> torch.Tensor:  # (B, H, T, D) -> (B, H, T, D/2): ‖(z_f, z_{f+D/2})‖
        return torch.sqrt(z[..., :half].double() ** 2 + z[..., half:].double() ** 2)

    def sink(i: int, kind: str, z: torch.Tensor) -> None:
        seen[(i, kind)] = z
        if kind == "k":
            s = stats[i]
            x = seen.pop((i, "x"))  # (B, T, d)
            k = z.transpose(1, 2).flatten(2).reshape(-1, kvd).double()  # (B·T, Hkv·D)
            xf = x.reshape(-1, d).double()  # (B·T, d)
            s.xx += (xf.T @ xf).cpu()
            s.kx += (k.T @ xf).cpu()
            s.kk += (k.T @ k).cpu()
            q = seen.pop((i, "q"))  # (B, Hq, T, D)
            qf = q.transpose(1, 2).flatten(2).reshape(-1, qd).double()  # (B·T, H·D)
            s.qq += (qf.T @ qf).cpu()
            qn = pair_norms(q).unflatten(1, (a.n_kv_head, -1)).mean(2)  # (B, Hkv, T, D/2): group mean
            s.pair += (qn * pair_norms(z)).sum((0, 2)).cpu()
            s.n += xf.shape[0]
            room = keep_windows - len(s.windows)
            if room > 0:
                seen[(i, "keep")] = x[:room].detach().float().cpu()  # (b, T, d): joined with the output below

    handles = a.attach_qkv_hooks(sink, rope="pre")
    for i in range(a.n_layer):
        def pre(mod, args, kwargs, i=i):
            seen[(i, "x")] = kwargs.get("hidden_states", args[0] if args else None)

        def post(mod, args, kwargs, out, i=i):
            x = seen.pop((i, "keep"), None)
            if x is not None:
                y = (out[0] if isinstance(out, tuple) else out)[: len(x)].detach().float().cpu()  # (b, T, d)
                stats[i].windows.extend(zip(x.split(1), y.split(1)))
        handles.append(a.attention_module(i).register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(a.attention_module(i).register_forward_hook(post, with_kwargs=True))
    try:
        for ids in tqdm(list(batches), desc="calibrate", unit="batch", disable=not progress, leave=False):
            a.base_forward(ids.to(a.param().device))
    finally:
        for h in handles:
            h.remove()
    return stats


# ------------------------------------------------------------------------------------------------ latent
def full_latent(n_kv: int, head_dim: int, rope_dims: int, layout: str, d_model: int) -> int:
    """The latent size at which the conversion is exact (norm-free, linear keys): the rank of ``[k_nope; v]``."""
    rope_heads = n_kv if layout == "per-head" else 1
    return min(d_model, 2 * n_kv * head_dim - rope_heads * rope_dims)


@torch.no_grad()
def convert_llama(model, stats: list[LayerStats], *, d_latent: Optional[int], rope_dims: int, layout: str,
                  latent_norm: bool = False, source: Optional[dict] = None, fit: FitOptions = FitOptions(),
                  progress: bool = False) -> MLALlama:
    """An :class:`MLALlama` from an HF Llama-family ``model`` and its :func:`calibrate_layers` statistics;
    ``d_latent=None`` is :func:`full_latent` (exact without ``latent_norm``)."""
    a = check_convertible(model)
    cfg_src, n_kv, hd, d = a.config, a.n_kv_head, a.head_dim, a.d_model
    if rope_dims % 2 or not 2 <= rope_dims <= hd:
        raise ValueError(f"rope dims must be even and in [2, head_dim={hd}], got {rope_dims}")
    full = full_latent(n_kv, hd, rope_dims, layout, d)
    r = full if d_latent is None else d_latent
    if not 1 <= r <= full:
        raise ValueError(f"d_latent must be in [1, {full}] (the rank of the no-RoPE keys and values), got {r}")
    attn0 = a.attention_module(0)
    qwen3 = hasattr(attn0, "k_norm")
    rot = a.rotary_embedding()
    cfg = MLALlamaConfig(
        vocab_size=a.param().shape[0], d_model=d, n_layer=a.n_layer, n_head=a.n_head, n_kv_head=n_kv, head_dim=hd,
        d_ff=cfg_src.intermediate_size, d_latent=r, rope_dims=rope_dims, rope_layout=layout,
        latent_norm=latent_norm, norm_eps=float(cfg_src.rms_norm_eps), attention_bias=attn0.q_proj.bias is not None,
        head_norms=qwen3, softmax_scale=a.scale(0), rope_attention_scaling=float(getattr(rot, "attention_scaling", 1.0)),
        max_positions=a.max_positions or 2048, tie_embeddings=bool(getattr(cfg_src, "tie_word_embeddings", False)),
        windows=[a.window(i) for i in range(a.n_layer)], source=dict(source or {}, model_type=cfg_src.model_type))
    out = MLALlama(cfg).to(a.param().dtype)
    src_inv = rot.inv_freq.detach().double().cpu()  # (D/2,)
    out.embed.weight.copy_(a.m.embed_tokens.weight)
    out.norm.weight.copy_(a.m.norm.weight)
    if not cfg.tie_embeddings:
        out.lm_head.weight.copy_(model.lm_head.weight)
    for i, (st, blk) in enumerate(tqdm(list(zip(stats, out.layers)), desc="fit layers", unit="layer",
                                       disable=not progress, leave=False)):
        src = a.m.layers[i]
        blk.input_norm.weight.copy_(src.input_layernorm.weight)
        blk.post_norm.weight.copy_(src.post_attention_layernorm.weight)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(blk, name).load_state_dict(getattr(src.mlp, name).state_dict())
        sa, at = src.self_attn, blk.attn
        for name in ("q_proj", "k_proj", "o_proj") + (("q_norm", "k_norm") if qwen3 else ()):
            getattr(at, name).load_state_dict(getattr(sa, name).state_dict())
        _fit_attention(at, a, i, st, r, rope_dims, layout, src_inv, qwen3, fit)
    if fit.refine_steps > 0 and all(st.windows for st in stats):
        refine_layers(out, stats, fit.refine_steps, fit.refine_lr, progress=progress)
    return out.eval()


def _split(a: LlamaAdapter, st: LayerStats, rope_dims: int, layout: str, fit: FitOptions) -> RopeSplit:
    if layout == "per-head":
        return per_head_split(st.pair, a.n_head, a.n_kv_head, a.head_dim, rope_dims)
    return shared_split(st.kk, st.qq, a.n_head, a.n_kv_head, a.head_dim, rope_dims, fit.query_weighted_rope)


def output_error(at, windows) -> float:
    """Relative error ``Σ‖at(x) − y‖² / Σ‖y‖²`` of a converted attention layer on source windows ``(x, y)``."""
    with torch.no_grad():
        num = sum(float(((at(x.to(at.o_proj.weight)) - y.to(at.o_proj.weight)) ** 2).sum()) for x, y in windows)
        return num / max(sum(float((y ** 2).sum()) for _, y in windows), 1e-30)


def _fit_attention(at, a: LlamaAdapter, layer: int, st: LayerStats, r: int, rope_dims: int, layout: str,
                   src_inv: torch.Tensor, nonlinear_keys: bool, fit: FitOptions) -> None:
    """Set one layer's RoPE maps, latent projections and latent norm (see the module docstring)."""
    n_kv, hd = a.n_kv_head, a.head_dim
    p = a.proj(layer)
    wk, wv = p.wk.double().cpu(), p.wv.double().cpu()  # (Hkv·D, d)
    split = _split(a, st, rope_dims, layout, fit)
    resid = split.residual()  # (Hkv·D, Hkv·D): keys that lose RoPE
    if nonlinear_keys:  # keys after a per-head RMSNorm: regress them on x
        eye = torch.eye(st.xx.shape[0], dtype=torch.float64) * 1e-6 * st.xx.diagonal().mean()
        wk_lin = torch.linalg.solve(st.xx + eye, st.kx.T).T  # (Hkv·D, d): k ≈ wk_lin x
    else:
        wk_lin = wk
    kvd = n_kv * hd
    at.k_rope.copy_(split.b)
    at.q_rope.copy_(split.q_rope)
    at.inv_freq.copy_(src_inv[split.pairs])  # (Hr, Dr/2)
    bias_k = None
    if p.bk is not None:
        bias_k = p.bk.double().cpu() if not nonlinear_keys else torch.zeros(kvd, dtype=torch.float64)
        at.w_uv.bias.copy_(p.bv)
    weights = (None, None)
    if fit.attention_weighted and st.qq is not None:
        weights = attention_weights(st.qq, at.o_proj.weight.double().cpu(), a.n_head, n_kv, hd, a.scale(layer))
    measured = bool(st.windows) and len(fit.damping) * len(fit.alphas) > 1
    damps = [resid]
    if measured and True in fit.damping:
        if st.profile is None:
            st.profile = distance_profile(a, layer, [x for x, _ in st.windows])
        damps = ([resid] if False in fit.damping else []) + [damping_map(st.profile, src_inv, hd) @ resid]
    fitter = LatentFitter(st.xx, *weights)
    best = None
    for keys in damps:
        mk = keys @ wk_lin  # (Hkv·D, d)
        for mult in fit.alphas if measured else fit.alphas[:1]:
            down, w_uk, w_uv, _ = fitter.fit(mk, wv, r, alpha_mult=mult)
            at.w_dkv.weight.copy_(down)
            at.w_uk.weight.copy_(w_uk)
            at.w_uv.weight.copy_(w_uv)
            if bias_k is not None:
                at.w_uk.bias.copy_(keys @ bias_k)
            if at.kv_norm is not None:  # start at the calibration latents' RMS: c / rms(c) · w ≈ c on average
                rms = (torch.trace(down @ st.xx @ down.T) / (max(st.n, 1) * r)).sqrt()
                at.kv_norm.weight.fill_(float(rms))
            if measured:
                err = output_error(at, st.windows)
                if best is None or err < best[0]:
                    best = (err, {k: v.clone() for k, v in at.state_dict().items()})
    if best is not None:
        at.load_state_dict(best[1])


def refine_layers(model: MLALlama, stats: list[LayerStats], steps: int, lr: float = 3e-4,
                  progress: bool = False) -> list:
    """The layer-local correction (:func:`kvsplice.convert.refine.refine_attention`) of every layer of a converted
    ``model`` on its calibration windows; the per-layer errors before and after."""
    out = []
    for blk, st in tqdm(list(zip(model.layers, stats)), desc="refine layers", unit="layer", disable=not progress,
                        leave=False):
        with torch.enable_grad():
            out.append(refine_attention(blk.attn, [x for x, _ in st.windows], [y for _, y in st.windows],
                                        steps=steps, lr=lr))
    return out


# ------------------------------------------------------------------------------------------------ KVSplice
@torch.no_grad()
def latent_gram(model: MLALlama, batches: Iterable[torch.Tensor], progress: bool = False) -> list[torch.Tensor]:
    """Per layer ``Σ c cᵀ`` (float64, ``(R, R)``) of the model's latents on ``batches``."""
    grams = [torch.zeros(model.cfg.d_latent, model.cfg.d_latent, dtype=torch.float64) for _ in model.layers]
    handles = []
    for i, blk in enumerate(model.layers):
        def hook(mod, inp, out, i=i):
            c = out.reshape(-1, out.shape[-1]).double()  # (B·T, R)
            grams[i] += (c.T @ c).cpu()
        handles.append((blk.attn.kv_norm or blk.attn.w_dkv).register_forward_hook(hook))
    try:
        for ids in tqdm(list(batches), desc="calibrate (latents)", unit="batch", disable=not progress, leave=False):
            model(ids.to(model.embed.weight.device))
    finally:
        for h in handles:
            h.remove()
    return grams


@torch.no_grad()
def shrink_latent(model: MLALlama, ratio: float, grams: list[torch.Tensor]) -> MLALlama:
    """KVSplice into a converted norm-free model: keep ``round(R·ratio)`` principal directions of its latents."""
    cfg = model.cfg
    if cfg.latent_norm:
        raise ValueError("KVSplice of a model with a latent RMSNorm: the norm sits between w_dkv and the compress, "
                         "so the pair is not one smaller latent; convert without --latent-norm")
    from kvsplice.convert.kvsplice_keep import kept_dims

    r = kept_dims(ratio, cfg.d_latent)
    from dataclasses import replace

    out = MLALlama(replace(cfg, d_latent=r, source=dict(cfg.source, kvsplice_ratio=ratio))).to(model.embed.weight)
    out.load_state_dict({k: v for k, v in model.state_dict().items()
                         if not any(s in k for s in ("w_dkv", "w_uk.weight", "w_uv.weight"))}, strict=False)
    for g, src, dst in zip(grams, model.layers, out.layers):
        c = torch.linalg.eigh(g)[1][:, -r:].flip(-1).T.to(src.attn.w_dkv.weight)  # (r, R) top directions
        dst.attn.w_dkv.weight.copy_(c @ src.attn.w_dkv.weight)
        dst.attn.w_uk.weight.copy_(src.attn.w_uk.weight @ c.T)
        dst.attn.w_uv.weight.copy_(src.attn.w_uv.weight @ c.T)
    return out.eval()

