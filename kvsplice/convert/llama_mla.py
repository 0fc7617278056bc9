"""Pretrained Llama-family model (Llama, Mistral, Qwen2, Qwen3) → :class:`models.mla_llama.MLALlama`.

Per layer, from calibration activations (the attention inputs ``x``, the queries and keys before RoPE):

1. **Decoupled RoPE.** A fixed orthonormal map ``B`` (``(Hkv·D, Hr·Dr)``) picks the key directions that keep RoPE:

   * ``per-head`` (MHA2MLA): per KV head the ``Dr/2`` rotary frequency pairs with the largest mean
     ``‖q_pair‖·‖k_pair‖`` (queries averaged over the head's group) — one RoPE key per KV head;
   * ``shared`` (TransMLA): the ``Dr/2`` highest frequencies; per frequency the keys of all KV heads are rotated
     by the top eigenvector ``u_f`` of their Gram across heads (both components of a pair alike, so the rotation
     commutes with RoPE) and the first component is the one shared RoPE key. Highest frequencies: their table is
     ``1/θ'^(2i/Dr)`` with ``θ' = θ^(Dr/D)``, what DeepSeek-V3's rotary computes (the export needs it).

   Query head ``i`` of group ``g`` reads ``q_i · (B Bᵀ k)_g`` through its RoPE query ``q_i A_i``
   (``A_i = B[g rows, its RoPE head's columns]``); the residual ``k_nope = (I − B Bᵀ) k`` loses RoPE (the
   approximation; none with ``--rope-dims all`` per head).
2. **Joint latent.** ``Y = [α k_nope; v]`` (all KV heads; ``α²`` = value energy / key energy, so neither dominates)
   is a linear map ``M x`` for Llama / Mistral / Qwen2, and for Qwen3 (per-head key RMSNorm) its least-squares
   regression on ``x``. The latent is the top-``R`` principal subspace ``P`` of ``M x`` on the calibration text:
   ``w_dkv = Pᵀ M``, ``[w_uk; w_uv] = [P_k / α; P_v]``; at ``R`` = the rank of ``M`` this is exact.
3. **Latent RMSNorm** (``latent_norm``, DeepSeek's ``kv_a_layernorm``): ``c / rms(c) · w`` rescales each token's
   latent, which no weight can undo, so a normed model is exact at no rank; its weight starts at the calibration
   latents' mean RMS. Full-rank exactness holds for the norm-free variant (the default of ``per-head``).

KVSplice (:func:`shrink_latent`) of a converted norm-free model: the top principal directions ``C`` of its latents
on calibration text give ``w_dkv' = C w_dkv``, ``w_uk' = w_uk Cᵀ``, ``w_uv' = w_uv Cᵀ`` — a smaller latent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

import torch
from tqdm.auto import tqdm

from kvsplice.adapters.llama import LlamaAdapter
from models.mla_llama import MLALlama, MLALlamaConfig

__all__ = ["CONVERTIBLE", "LayerStats", "calibrate_layers", "convert_llama", "full_latent", "shrink_latent"]

CONVERTIBLE = ("llama", "mistral", "qwen2", "qwen3")
"""``model_type`` of the families :func:`convert_llama` converts (Llama layout, SiLU-gated MLP, full rotary)."""


@dataclass
class LayerStats:
    """Streamed second moments of one layer (float64): ``xx`` ``(d, d)``, ``kx`` ``(Hkv·D, d)``, ``kk``
    ``(Hkv·D, Hkv·D)`` (keys after any head norm, before RoPE) and ``pair`` ``(Hkv, D/2)``: summed
    ``mean_group ‖q_pair‖ · ‖k_pair‖``; ``n`` tokens."""

    xx: torch.Tensor
    kx: torch.Tensor
    kk: torch.Tensor
    pair: torch.Tensor
    n: int = 0


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
def calibrate_layers(model, batches: Iterable[torch.Tensor], progress: bool = False) -> list[LayerStats]:
    """Stream :class:`LayerStats` of every layer over ``batches`` of token ids ``(B, T)``."""
    a = check_convertible(model)
    d, kvd, half = a.d_model, a.n_kv_head * a.head_dim, a.head_dim // 2
    stats = [LayerStats(torch.zeros(d, d, dtype=torch.float64), torch.zeros(kvd, d, dtype=torch.float64),
                        torch.zeros(kvd, kvd, dtype=torch.float64), torch.zeros(a.n_kv_head, half,
                                                                                dtype=torch.float64))
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
            qn = pair_norms(q).unflatten(1, (a.n_kv_head, -1)).mean(2)  # (B, Hkv, T, D/2): group mean
            s.pair += (qn * pair_norms(z)).sum((0, 2)).cpu()
            s.n += xf.shape[0]

    handles = a.attach_qkv_hooks(sink, rope="pre")
    for i in range(a.n_layer):
        def pre(mod, args, kwargs, i=i):
            seen[(i, "x")] = kwargs.get("hidden_states", args[0] if args else None)
        handles.append(a.attention_module(i).register_forward_pre_hook(pre, with_kwargs=True))
    try:
        for ids in tqdm(list(batches), desc="calibrate", unit="batch", disable=not progress, leave=False):
            a.base_forward(ids.to(a.param().device))
    finally:
        for h in handles:
            h.remove()
    return stats


# ------------------------------------------------------------------------------------------------ RoPE split
def rope_basis(stats: LayerStats, n_kv: int, head_dim: int, rope_dims: int, layout: str
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B, pairs)``: the orthonormal map ``(Hkv·D, Hr·Dr)`` from keys to RoPE keys (float64) and the source
    frequency index of each RoPE pair, ``(Hr, Dr/2)``. Columns of RoPE head ``r`` are ``[first halves, second
    halves]`` (rotate-half layout)."""
    half, m = head_dim // 2, rope_dims // 2
    if layout == "per-head":
        pairs = stats.pair.topk(m, dim=1).indices.sort(dim=1).values  # (Hkv, m) largest mean ‖q‖·‖k‖
        b = torch.zeros(n_kv * head_dim, n_kv * rope_dims, dtype=torch.float64)
        for h in range(n_kv):
            for j, f in enumerate(pairs[h].tolist()):
                b[h * head_dim + f, h * rope_dims + j] = 1.0
                b[h * head_dim + f + half, h * rope_dims + m + j] = 1.0
        return b, pairs
    pairs = torch.arange(m)[None]  # (1, m): the highest frequencies
    b = torch.zeros(n_kv * head_dim, rope_dims, dtype=torch.float64)
    rows = torch.arange(n_kv) * head_dim  # first row of each KV head
    for j in range(m):
        idx = torch.cat([rows + j, rows + j + half])  # the pair's two components in every KV head
        g = stats.kk[idx][:, idx]  # (2·Hkv, 2·Hkv)
        g = g[:n_kv, :n_kv] + g[n_kv:, n_kv:]  # (Hkv, Hkv): both components alike
        u = torch.linalg.eigh(g)[1][:, -1]  # (Hkv,) top eigenvector
        u = u * (1.0 if u.sum() >= 0 else -1.0)
        b[rows + j, j] = u
        b[rows + j + half, m + j] = u
    return b, pairs


# ------------------------------------------------------------------------------------------------ latent
def full_latent(n_kv: int, head_dim: int, rope_dims: int, layout: str, d_model: int) -> int:
    """The latent size at which the conversion is exact (norm-free, linear keys): the rank of ``[k_nope; v]``."""
    rope_heads = n_kv if layout == "per-head" else 1
    return min(d_model, 2 * n_kv * head_dim - rope_heads * rope_dims)


def _latent_maps(m: torch.Tensor, xx: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(P (rows × R), Pᵀ M (R × d))``: the top-``R`` principal subspace of ``M x`` for inputs of second moment
    ``xx`` (left singular vectors of ``M xx^½``)."""
    evals, evecs = torch.linalg.eigh(xx)
    root = evecs * evals.clamp_min(0).sqrt()  # (d, d): root rootᵀ = xx
    p = torch.linalg.svd(m @ root, full_matrices=False)[0][:, :rank]  # (rows, R)
    return p, p.T @ m


@torch.no_grad()
def convert_llama(model, stats: list[LayerStats], *, d_latent: Optional[int], rope_dims: int, layout: str,
                  latent_norm: bool = False, source: Optional[dict] = None) -> MLALlama:
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
    for i, (st, blk) in enumerate(zip(stats, out.layers)):
        src = a.m.layers[i]
        blk.input_norm.weight.copy_(src.input_layernorm.weight)
        blk.post_norm.weight.copy_(src.post_attention_layernorm.weight)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(blk, name).load_state_dict(getattr(src.mlp, name).state_dict())
        sa, at = src.self_attn, blk.attn
        for name in ("q_proj", "k_proj", "o_proj") + (("q_norm", "k_norm") if qwen3 else ()):
            getattr(at, name).load_state_dict(getattr(sa, name).state_dict())
        _fit_attention(at, a, i, st, r, rope_dims, layout, src_inv, qwen3)
    return out.eval()


def _fit_attention(at, a: LlamaAdapter, layer: int, st: LayerStats, r: int, rope_dims: int, layout: str,
                   src_inv: torch.Tensor, nonlinear_keys: bool) -> None:
    """Set one layer's RoPE maps, latent projections and latent norm (see the module docstring)."""
    n_kv, hd, g = a.n_kv_head, a.head_dim, a.n_head // a.n_kv_head
    p = a.proj(layer)
    wk, wv = p.wk.double().cpu(), p.wv.double().cpu()  # (Hkv·D, d)
    b, pairs = rope_basis(st, n_kv, hd, rope_dims, layout)  # (Hkv·D, Hr·Dr), (Hr, Dr/2)
    rope_heads = b.shape[1] // rope_dims
    resid = torch.eye(n_kv * hd, dtype=torch.float64) - b @ b.T  # (Hkv·D, Hkv·D): keys that lose RoPE
    if nonlinear_keys:  # keys after a per-head RMSNorm: regress them on x
        eye = torch.eye(st.xx.shape[0], dtype=torch.float64) * 1e-6 * st.xx.diagonal().mean()
        wk_lin = torch.linalg.solve(st.xx + eye, st.kx.T).T  # (Hkv·D, d): k ≈ wk_lin x
    else:
        wk_lin = wk
    mk = resid @ wk_lin  # (Hkv·D, d)
    ek, ev = torch.trace(mk @ st.xx @ mk.T), torch.trace(wv @ st.xx @ wv.T)
    alpha = float((ev / ek).sqrt()) if ek > 1e-12 * max(float(ev), 1e-30) else 1.0
    proj, down = _latent_maps(torch.cat([alpha * mk, wv]), st.xx, r)  # (2·Hkv·D, R), (R, d)
    kvd = n_kv * hd
    at.kv_down.weight.copy_(down)
    at.k_up.weight.copy_(proj[:kvd] / alpha)
    at.v_up.weight.copy_(proj[kvd:])
    if p.bk is not None:
        bias_k = p.bk.double().cpu() if not nonlinear_keys else torch.zeros(kvd, dtype=torch.float64)
        at.k_up.bias.copy_(resid @ bias_k)
        at.v_up.bias.copy_(p.bv)
    if at.kv_norm is not None:  # start at the calibration latents' RMS: c / rms(c) · w ≈ c on average
        rms = (torch.trace(down @ st.xx @ down.T) / (max(st.n, 1) * r)).sqrt()
        at.kv_norm.weight.fill_(float(rms))
    at.k_rope.copy_(b)
    q_rope = torch.zeros(a.n_head, hd, rope_dims, dtype=torch.float64)
    for i in range(a.n_head):
        kv_h = i // g
        rh = kv_h if rope_heads > 1 else 0
        q_rope[i] = b[kv_h * hd:(kv_h + 1) * hd, rh * rope_dims:(rh + 1) * rope_dims]  # (D, Dr)
    at.q_rope.copy_(q_rope)
    at.inv_freq.copy_(src_inv[pairs])  # (Hr, Dr/2)


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
        handles.append((blk.attn.kv_norm or blk.attn.kv_down).register_forward_hook(hook))
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
                         if not any(s in k for s in ("kv_down", "k_up.weight", "v_up.weight"))}, strict=False)
    for g, src, dst in zip(grams, model.layers, out.layers):
        c = torch.linalg.eigh(g)[1][:, -r:].flip(-1).T.to(src.attn.kv_down.weight)  # (r, R) top directions
        dst.attn.kv_down.weight.copy_(c @ src.attn.kv_down.weight)
        dst.attn.k_up.weight.copy_(src.attn.k_up.weight @ c.T)
        dst.attn.v_up.weight.copy_(src.attn.v_up.weight @ c.T)
    return out.eval()

