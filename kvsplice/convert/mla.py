"""Turn a trained MHA / GQA ``models.GPT`` into an MLA model, and insert KVSplice into a trained MLA model.

MHA → MLA (MHA2MLA-style joint factorisation of keys and values). Per layer, the stacked key/value projection
``W = [W_k; W_v]`` (2·d_model × d_model; GQA KV heads repeated to every query head) is replaced by a rank-``R``
product ``W ≈ [w_uk; w_uv] · w_dkv`` — ``w_dkv`` (R × d_model) makes the cached latent, ``w_uk``/``w_uv``
(d_model × R) expand it. Biases are carried (``b_dkv = 0``, ``b_uk = b_k``, ``b_uv = b_v``), so the map stays affine
and ``R = d_model`` reproduces the model exactly.

* weights-only: ``W_R`` = the truncated SVD of ``W`` (best in Frobenius norm on the weights);
* activation-aware: ``W_R = P Pᵀ W`` with ``P`` the top-``R`` left singular vectors of ``W G^½``, ``G = Σ x xᵀ`` the
  streamed Gram of the attention inputs on calibration text (no activations stored). This minimises
  ``Σ_x ‖(W − W_R) x‖²``, the error of the keys and values the model actually computes.

Either ``W_R`` is split evenly, ``W_R = (U S^½)(S^½ Vᵀ)``, so neither factor carries all the scale (what AdamW's
weight decay sees when fine-tuning). Queries, output projections, MLPs and embeddings are copied unchanged.

KVSplice into MLA: ``compress`` = the top ``r`` principal directions (eigenvectors of ``Σ c cᵀ``) of the calibration
latents, ``expand = compressᵀ``: ``E C`` is then the best rank-``r`` projection of the latents the model produces,
instead of a random orthogonal one.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch.nn.utils import parametrize
from tqdm.auto import tqdm

from kvsplice.adapters.registry import adapter_for
from models.gpt import GPT

__all__ = ["attention_input_grams", "insert_kvsplice", "kv_relative_error", "kv_rows", "kvsplice_as_mla", "latent_grams",
           "mha_to_mla"]


# ------------------------------------------------------------------------------------------------ calibration
@torch.no_grad()
def _stream_grams(model: GPT, batches: Iterable[torch.Tensor], dim: int, feature, desc: str,
                  progress: bool) -> tuple[list[torch.Tensor], int]:
    """Σ f(x) f(x)ᵀ per layer (float64, ``(dim, dim)``) for ``f = feature(attn, x)`` of each attention input ``x``."""
    grams = [torch.zeros(dim, dim, dtype=torch.float64) for _ in model.transformer.h]
    handles = []
    for i, block in enumerate(model.transformer.h):
        def hook(mod, args, kwargs, i=i):
            f = feature(mod, args[0]).detach().to(torch.float64)  # (B, T, dim)
            f = f.reshape(-1, f.shape[-1])  # (B·T, dim)
            grams[i] += (f.T @ f).cpu()
        handles.append(block.attn.register_forward_pre_hook(hook, with_kwargs=True))
    was_training, n = model.training, 0
    model.eval()
    try:
        for ids in tqdm(list(batches), desc=desc, unit="batch", disable=not progress, leave=False):
            model(ids.to(model.transformer.wte.weight.device))
            n += ids.numel()
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return grams, n


def attention_input_grams(model: GPT, batches: Iterable[torch.Tensor], progress: bool = False
                          ) -> tuple[list[torch.Tensor], int]:
    """Per layer ``Σ_t x_t x_tᵀ`` (d_model × d_model, float64) of the attention inputs (after ``ln_1``), and the
    number of tokens streamed."""
    return _stream_grams(model, batches, model.cfg.d_model, lambda attn, x: x, "calibrate (attention inputs)",
                         progress)


def latent_grams(model: GPT, batches: Iterable[torch.Tensor], progress: bool = False
                 ) -> tuple[list[torch.Tensor], int]:
    """Per layer ``Σ_t c_t c_tᵀ`` (d_latent × d_latent) of an MLA model's latents (after ``latent_norm``), before any
    KVSplice compression."""
    if model.cfg.attention != "mla":
        raise ValueError(f"latent_grams needs an MLA model, got attention={model.cfg.attention!r}")
    return _stream_grams(model, batches, model.cfg.d_latent, lambda attn, x: attn._c(x), "calibrate (latents)",
                         progress)


# ------------------------------------------------------------------------------------------------ MHA -> MLA
def _sqrt_psd(g: torch.Tensor) -> torch.Tensor:
    """A square root ``L`` with ``L Lᵀ = g`` of a symmetric PSD matrix (eigendecomposition; negatives clipped)."""
    evals, evecs = torch.linalg.eigh(g)
    return evecs * evals.clamp_min(0).sqrt()  # (d, d)


def _low_rank(w: torch.Tensor, rank: int, gram: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Factors ``(B (m × R), A (R × n))`` of the rank-``R`` approximation of ``w`` (m × n, float64): truncated SVD,
    or with ``gram`` the one minimising ``tr((w − BA) G (w − BA)ᵀ)``; split evenly as ``U S^½`` and ``S^½ Vᵀ``."""
    if gram is not None:
        gram = gram.to(w)  # the Grams are streamed to the CPU; the weights may sit on a GPU
        p = torch.linalg.svd(w @ _sqrt_psd(gram), full_matrices=False)[0][:, :rank]  # (m, R) output directions
        w = p @ (p.T @ w)  # (m, n), rank <= R
    u, s, vh = torch.linalg.svd(w, full_matrices=False)
    root = s[:rank].sqrt()
    return u[:, :rank] * root, root[:, None] * vh[:rank]  # (m, R), (R, n)


def kv_rows(model: GPT, layer: int) -> tuple[torch.Tensor, ...]:
    """``(w_q, w_k, w_v, b_q, b_k, b_v)`` (float64) of an MHA/GQA layer, from the family adapter's projections, with
    the KV heads repeated to all ``n_head`` heads (query head ``h`` reads KV head ``h // g``); zero biases when the
    model has none."""
    cfg = model.cfg
    p = adapter_for(model).proj(layer)
    hs, kv = cfg.head_size, cfg.kv_heads
    g = cfg.n_head // kv

    def f64(w: Optional[torch.Tensor], rows: int) -> torch.Tensor:
        return torch.zeros(rows, dtype=torch.float64) if w is None else w.detach().to(torch.float64)

    wq, wk, wv = (f64(w, 0) for w in (p.wq, p.wk, p.wv))  # (d, d), 2 × (kv·hs, d)
    bq, bk, bv = f64(p.bq, cfg.d_model), f64(p.bk, kv * hs), f64(p.bv, kv * hs)
    if g > 1:
        wk, wv, bk, bv = (z.unflatten(0, (kv, hs)).repeat_interleave(g, 0).flatten(0, 1)
                          for z in (wk, wv, bk, bv))  # (d, d) and (d,)
    return wq, wk, wv, bq, bk, bv


def _copy_shared(src: GPT, dst: GPT) -> None:
    """Copy every weight whose name and shape both models share (embeddings, norms, MLPs, output projections)."""
    theirs = src.state_dict()
    mine = dst.state_dict()
    dst.load_state_dict({k: theirs[k] if k in theirs and theirs[k].shape == v.shape else v
                         for k, v in mine.items()})


@torch.no_grad()
def mha_to_mla(model: GPT, d_latent: int, grams: Optional[list[torch.Tensor]] = None) -> GPT:
    """An MLA ``GPT`` with a ``d_latent`` latent from an MHA / GQA ``GPT`` (weights-only, or activation-aware with
    ``grams`` from :func:`attention_input_grams`). ``d_latent = d_model`` reproduces ``model`` exactly."""
    cfg = model.cfg
    if cfg.attention != "mha":
        raise ValueError(f"mha_to_mla needs an MHA/GQA model, got attention={cfg.attention!r}")
    if not 1 <= d_latent <= cfg.d_model:
        raise ValueError(f"d_latent must be in [1, d_model={cfg.d_model}], got {d_latent}")
    if not cfg.bias:
        raise ValueError("mha_to_mla needs a model with biases (bias=True), like GPT-2")
    if grams is not None and len(grams) != cfg.n_layer:
        raise ValueError(f"need one Gram per layer ({cfg.n_layer}), got {len(grams)}")
    new_cfg = cfg.replace(attention="mla", d_latent=d_latent, n_kv_head=None, kvsplice_keep=None, latent_norm=False)
    dtype = model.transformer.wte.weight.dtype
    out = GPT(new_cfg).to(device=model.transformer.wte.weight.device, dtype=dtype)
    _copy_shared(model, out)
    d = cfg.d_model
    for i, (src, dst) in enumerate(zip(model.transformer.h, out.transformer.h)):
        wq, wk, wv, bq, bk, bv = kv_rows(model, i)
        up, down = _low_rank(torch.cat([wk, wv]), d_latent, None if grams is None else grams[i])  # (2d, R), (R, d)
        a = dst.attn
        a.w_q.weight.copy_(wq)
        a.w_q.bias.copy_(bq)
        a.w_dkv.weight.copy_(down)
        a.w_dkv.bias.zero_()
        a.w_uk.weight.copy_(up[:d])
        a.w_uk.bias.copy_(bk)
        a.w_uv.weight.copy_(up[d:])
        a.w_uv.bias.copy_(bv)
        a.c_proj.load_state_dict(src.attn.c_proj.state_dict())
    return out.eval()


@torch.no_grad()
def kv_relative_error(src: GPT, dst: GPT, grams: list[torch.Tensor]) -> list[float]:
    """Per layer ``Σ_x ‖(W − W_R) x‖² / Σ_x ‖W x‖²``: the error of ``dst``'s stacked key/value map
    ``[w_uk; w_uv] w_dkv`` against ``src``'s ``[W_k; W_v]`` on the inputs whose Grams are ``grams``."""
    out = []
    for i, (g, b) in enumerate(zip(grams, dst.transformer.h)):
        _, wk, wv, *_ = kv_rows(src, i)
        w = torch.cat([wk, wv])  # (2d, d)
        up = torch.cat([b.attn.w_uk.weight, b.attn.w_uv.weight]).to(torch.float64)  # (2d, R)
        err = w - up @ b.attn.w_dkv.weight.to(torch.float64)  # (2d, d)
        g = g.to(w)
        out.append(float(torch.trace(err @ g @ err.T) / torch.trace(w @ g @ w.T)))
    return out


# ------------------------------------------------------------------------------------------------ KVSplice
def _set_weight(lin: torch.nn.Linear, w: torch.Tensor) -> None:
    if parametrize.is_parametrized(lin, "weight"):
        lin.weight = w.to(lin.weight)  # through the parametrisation's right_inverse (device and dtype of the layer)
    else:
        lin.weight.copy_(w)


@torch.no_grad()
def insert_kvsplice(model: GPT, ratio: float, grams: Optional[list[torch.Tensor]] = None, *,
                    orthogonal: bool = False, seed: int = 0) -> GPT:
    """``model`` (MLA, no KVSplice) with KVSplice of ``ratio`` (``d_compressed = round(d_latent·ratio)``) inserted:
    ``compress`` = the top principal directions of the latents (``grams`` from :func:`latent_grams`) or, without
    ``grams``, a random orthogonal init (seeded); ``expand = compressᵀ`` either way."""
    cfg = model.cfg
    if cfg.attention != "mla" or cfg.kvsplice_keep is not None:
        raise ValueError(f"insert_kvsplice needs an MLA model without KVSplice, got {cfg.variant}")
    from kvsplice.convert.kvsplice_keep import kept_dims

    kept_dims(ratio, cfg.d_latent)
    with torch.random.fork_rng(devices=[]):  # seeded init of the new pair; the caller's RNG stream is untouched
        torch.manual_seed(seed)
        out = GPT(cfg.replace(kvsplice_keep=ratio, kvsplice_orthogonal=orthogonal)).to(model.transformer.wte.weight)
    _copy_shared(model, out)
    if grams is not None:
        r = out.cfg.d_compressed
        for g, block in zip(grams, out.transformer.h):
            evecs = torch.linalg.eigh(g)[1]  # ascending eigenvalues
            c = evecs[:, -r:].flip(-1).T  # (r, d_latent), orthonormal rows, largest variance first
            _set_weight(block.attn.splice.compress, c)
            _set_weight(block.attn.splice.expand, c.T)
    return out.eval()


@torch.no_grad()
def kvsplice_as_mla(model: GPT) -> GPT:
    """The plain MLA model a KVSplice model *is* when no norm sits between ``w_dkv`` and the compress
    (``latent_norm=False``): ``s = C (W x + b)`` is one affine map of ``d_compressed`` outputs and ``w_uk E`` /
    ``w_uv E`` are ordinary up-projections of ``s``. So ``w_dkv' = C W`` (``b' = C b``), ``w_uk' = w_uk E``,
    ``w_uv' = w_uv E``, and ``kvsplice_norm`` (RMSNorm after the compress) becomes the MLA ``latent_norm``. The result
    has the same logits (to round-off) and the same cache bytes: KVSplice of a ``d_latent`` latent spans no more than
    MLA with a ``d_compressed`` latent; it only factorises the same maps (and trains them differently)."""
    cfg = model.cfg
    if cfg.attention != "mla" or cfg.kvsplice_keep is None:
        raise ValueError(f"kvsplice_as_mla needs an MLA + KVSplice model, got {cfg.variant}")
    if cfg.latent_norm:
        raise ValueError("with latent_norm the RMSNorm of the d_latent latent sits between w_dkv and the compress: "
                         "the pair is not one affine map (train with latent_norm false, kvsplice_norm true)")
    r = cfg.d_compressed
    new_cfg = cfg.replace(d_latent=r, kvsplice_keep=None, kvsplice_orthogonal=False, kvsplice_norm=False,
                          latent_norm=cfg.kvsplice_norm)
    out = GPT(new_cfg).to(model.transformer.wte.weight)
    _copy_shared(model, out)
    for src, dst in zip(model.transformer.h, out.transformer.h):
        a, b = src.attn, dst.attn
        c, e = a.splice.compress_weight(), a.splice.expand_weight()  # (r, d_latent), (d_latent, r)
        b.w_q.load_state_dict(a.w_q.state_dict())
        b.w_dkv.weight.copy_(c @ a.w_dkv.weight)  # (r, d_model)
        if a.w_dkv.bias is not None:
            b.w_dkv.bias.copy_(c @ a.w_dkv.bias)
        for name in ("w_uk", "w_uv"):
            src_lin, dst_lin = getattr(a, name), getattr(b, name)
            dst_lin.weight.copy_(src_lin.weight @ e)  # (d_model, r)
            if src_lin.bias is not None:
                dst_lin.bias.copy_(src_lin.bias)
        if a.splice_norm is not None:
            b.kv_norm.load_state_dict(a.splice_norm.state_dict())
    return out.eval()
