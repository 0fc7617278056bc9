"""Online decoding with frequent-directions bases (no calibration), and the §3.5 error diagnostics for any bases.

:class:`OnlineDecoder` decodes HF ``GPT2LMHeadModel``, HF ``LlamaForCausalLM`` (GQA, RoPE) and our MHA
``models.GPT`` layer by layer through the family adapter of :mod:`kvsplice.lowrank.apply` (embeddings, norms, MLPs, RoPE,
LM head are the model's own modules). Each layer's **post-RoPE** keys and its values go into a
:class:`~kvsplice.online.chunked.ChunkedCache` (online FD-seeded bases per chunk, thresholds ``τ_k``/``τ_v``, max chunk
length ``L``, merge cap ``J_max``, warm-up ``W``); attention is :meth:`ChunkedCache.attend_chunked` (blockwise
softmax over chunks, values reconstructed per chunk as ``(Σ_t p_t b_t) E_jᵀ``), then the model's ``o_proj`` /
``c_proj``::

    dec = OnlineDecoder(model, rank_k=4, rank_v=4, ell=8, tau_k=1.0, max_chunk_len=64, max_chunks=8)
    cache = dec.new_cache(batch_size=1)                # a ChunkedCache
    logits = dec(prompt_ids, cache)                    # prefill (B, T, V)
    logits = dec(next_ids, cache)                      # decode (B, 1, V)
    ppl = dec.perplexity(ids, chunk_size=1)            # token by token, every token over the compressed cache
    logits, diag = dec.diagnose(ids)                   # one prefill + per-layer observed errors vs bounds
    tau = calibrate_thresholds(model, calib_ids, percentile=99, rank_k=4, ell=8, max_chunk_len=64)
    dec = OnlineDecoder(model, rank_k=4, ell=8, max_chunk_len=64, tau_k=tau["tau_k"], tau_v=tau["tau_v"])

**Diagnostics** (:mod:`kvsplice.online.bounds`): per layer, with exact ``q, k, v`` and approximate ``k̂, v̂`` (causal),
the observed logit error ``ε = ‖ℓ − ℓ̂‖∞``, softmax L1 error ``‖α − α̂‖₁`` and head-output error ``‖o − ô‖``
next to their bounds: ``ε ≤ s‖q‖ max_t ‖k_t − k̂_t‖``; ``‖α − α̂‖₁ ≤ 2 tanh(δ̄/4)`` (tight) ``≤ 2 sinh(δ̄/2)``
(the issue's form) with ``δ̄ = 2 × logit bound``; ``‖o − ô‖ ≤ ‖α − α̂‖₁ max‖v‖ + max‖v − v̂‖``. Reported as
the max over queries, heads and sequences, plus the *slack* ``bound / observed`` (ratio of the maxima, and the
tightest per-query ratio ``*_tightest``, which is ≥ 1 exactly when the bound holds for every query).

* :meth:`OnlineDecoder.diagnose` — in-run: the layer's own ``q, k, v`` in the online run vs the cache's
  reconstruction (so ``ô`` is exactly what the decoder computed), with the cache's recorded residual maxima
  (``τ`` guarantee) and the FD residual bound ``‖K − K V_r V_rᵀ‖_F ≤ (‖K‖_F² − ‖S_r‖_F²)^½`` of each stream's
  final sketch basis.
* :func:`online_qkv_diagnostics` — teacher-forced: the *exact* model's ``q, k, v``
  (:func:`kvsplice.lowrank.calibrate.extract_qkv`) fed into a fresh chunked cache, layer by layer (no error propagation):
  apples to apples with :func:`bases_diagnostics`.
* :func:`bases_diagnostics` — global bases: ``k̂ = k k_enc k_decᵀ`` (what the coefficient logits
  ``(q k_dec)·(k k_enc)`` compute, oblique bases included) and ``v̂ = v v_enc v_decᵀ``; pre-RoPE bases rebuild
  ``k̂`` before RoPE and rotate it.
* :func:`attention_diagnostics` — the generic per-layer function on ``(B, H, T, d)`` tensors.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from kvsplice.lowrank.apply import _heads, _merge, family_adapter, perplexity as _perplexity
from kvsplice.lowrank.bases import KVBases
from kvsplice.online.bounds import logit_error_bound, logit_oscillation, output_error_bound, softmax_l1_bound
from kvsplice.online.chunked import ChunkedCache
from models.attention import causal_mask

__all__ = ["OnlineDecoder", "attention_diagnostics", "bases_diagnostics", "calibrate_thresholds",
           "format_diagnostics", "online_qkv_diagnostics"]


# ============================================================================================== decoder
class OnlineDecoder:
    """Prefill / decode driver over a :class:`ChunkedCache`; see the module docstring.

    Cache options are :class:`ChunkedCache`'s: ``rank_k``, ``rank_v`` [rank_k], ``ell`` [2·max rank], ``tau_k``,
    ``tau_v`` [None], ``max_chunk_len`` [256], ``max_chunks`` [None], ``warmup`` [16], ``shared_value_basis``
    [False]; any other keyword (``min_chunk_len``, ``fd_decay``, ``fit_first_token``, ``relative``,
    ``granularity``, ``value_bases``) is passed through. ``dec(input_ids (B, T), cache) -> logits (B, T, V)``.
    """

    def __init__(self, model: nn.Module, *, rank_k: int, rank_v: Optional[int] = None, ell: Optional[int] = None,
                 tau_k: Optional[float] = None, tau_v: Optional[float] = None, max_chunk_len: int = 256,
                 max_chunks: Optional[int] = None, warmup: int = 16, shared_value_basis: bool = False,
                 **cache_kw) -> None:
        self.model = model
        self.fam = family_adapter(model)
        self.family = self.fam.name
        p = self.fam.param()
        self.dtype, self.device = p.dtype, p.device
        self.scales = [self.fam.scale(l) for l in range(self.fam.n_layer)]
        self.cache_kw = dict(rank_k=rank_k, rank_v=rank_v, ell=ell, tau_k=tau_k, tau_v=tau_v,
                             max_chunk_len=max_chunk_len, max_chunks=max_chunks, warmup=warmup,
                             shared_value_basis=shared_value_basis, **cache_kw)
        self.new_cache(1)  # validate the options now

    # ------------------------------------------------------------------------------------------- caches
    def new_cache(self, batch_size: int, capacity: Optional[int] = None, *, dtype: Optional[torch.dtype] = None,
                  device=None) -> ChunkedCache:
        """An empty :class:`ChunkedCache` for this model (``capacity`` is accepted for interface parity and
        ignored: chunks grow on their own)."""
        f = self.fam
        kw = dict(self.cache_kw)
        kw.setdefault("dtype", dtype or torch.promote_types(self.dtype, torch.float32))
        return ChunkedCache(f.n_layer, f.n_kv_head, f.head_dim, batch_size, device=device or self.device, **kw)

    def _check_cache(self, cache, b: int, t: int) -> None:
        if not isinstance(cache, ChunkedCache) or cache.n_layer != self.fam.n_layer \
                or cache.n_kv_head != self.fam.n_kv_head or cache.head_size != self.fam.head_dim:
            raise TypeError("this decoder needs a ChunkedCache with the model's shapes; use decoder.new_cache()")
        self.fam.check_room(cache.batch_size, cache.seq_len, b, t)

    # ------------------------------------------------------------------------------------------- forward
    def _qkv(self, l: int, h: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (B, Hq, T, D), k, v (B, Hkv, T, D) with the original weights; q and k rotated (post-RoPE)."""
        f, P = self.fam, self.fam.proj(l)
        q = _heads(F.linear(h, P.wq, P.bq), f.n_head)
        k = _heads(F.linear(h, P.wk, P.bk), f.n_kv_head)
        v = _heads(F.linear(h, P.wv, P.bv), f.n_kv_head)
        if rope is not None:
            q, k = f.rotate_qk(q, k, *rope)
        return q, k, v

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, cache: ChunkedCache, *, last_only: bool = False,
                 _record: Optional[list] = None) -> torch.Tensor:
        if input_ids.dim() != 2 or input_ids.shape[1] < 1:
            raise ValueError(f"input_ids must be (B, T) with T >= 1, got shape {tuple(input_ids.shape)}")
        b, t = input_ids.shape
        self._check_cache(cache, b, t)
        start = cache.seq_len
        f = self.fam
        x = f.embed(input_ids, start)
        rope = None
        if f.has_rope:
            rope = f.rope_tables(x, torch.arange(start, start + t, device=x.device))
        for l in range(f.n_layer):
            q, k, v = self._qkv(l, f.attn_in(l, x), rope)
            cache.append(l, k=k, v=v)
            z = cache.attend_chunked(l, q, self.scales[l])  # (B, Hq, T, D): values rebuilt per chunk
            if _record is not None:
                _record.append({"q": q, "k": k, "v": v, "z": z})
            P = f.proj(l)
            x = f.after_attn(l, x, F.linear(_merge(z), P.wo, P.bo))
        if last_only:
            x = x[:, -1:]
        return f.head(x)

    forward = __call__

    def perplexity(self, input_ids: torch.Tensor, chunk_size: Optional[int] = 1) -> float:
        """``exp`` of the mean next-token NLL of ``input_ids (B, T)`` fed through a fresh cache in chunks of
        ``chunk_size`` tokens (default 1: true online decoding; ``None``: one prefill call — identical unless
        ``max_chunks`` merges re-project old tokens, which a prefill's earlier queries would then see)."""
        return _perplexity(self, input_ids, chunk_size)

    # ------------------------------------------------------------------------------------------- diagnostics
    @torch.no_grad()
    def diagnose(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, list[dict]]:
        """Prefill ``input_ids`` into a fresh cache and return ``(logits, per-layer diagnostics)``.

        Each layer compares its own exact attention (the run's ``q, k, v``) with the cache's (``k̂, v̂`` from
        :meth:`ChunkedCache.reconstruct`); ``output_err`` is checked against the decoder's actual output
        (``attend_matches`` = max deviation of the computed output from ``softmax(ℓ̂) v̂``). Adds chunk counts
        ``J`` and the FD residual bound (see :func:`_fd_report`)."""
        cache = self.new_cache(input_ids.shape[0])
        rec: list = []
        logits = self(input_ids, cache, _record=rec)
        out = []
        for l, r in enumerate(rec):
            k_hat, v_hat = cache.reconstruct(l)
            rk, rv = cache.residual_maxima(l)
            d = attention_diagnostics(r["q"], r["k"], r["v"], k_hat, v_hat, self.scales[l],
                                      key_residual_recorded=rk, value_residual_recorded=rv, out_hat=r["z"])
            d.update(_chunk_report(cache, l))
            d.update(_fd_report(cache, l, r["k"], r["v"]))
            out.append(d)
        return logits, out

    def __repr__(self) -> str:
        kw = ", ".join(f"{k}={v}" for k, v in self.cache_kw.items() if v is not None)
        return f"OnlineDecoder({self.family}, {kw})"


@torch.no_grad()
def calibrate_thresholds(model: nn.Module, batches_or_ids, *, percentile: float, rank_k: int,
                         rank_v: Optional[int] = None, ell: Optional[int] = None, relative: bool = False,
                         **cache_options) -> dict:
    """``τ_k``, ``τ_v`` from residual percentiles on calibration tokens (issue 6).

    ``batches_or_ids``: token ids ``(B, T)`` or an iterable of such batches; each is prefilled into a fresh cache
    of an :class:`OnlineDecoder` with the given options and **thresholds disabled** (``tau_k``/``tau_v`` in
    ``cache_options`` are ignored: chunks close only at ``max_chunk_len``), recording every token's criterion
    ``ρ_k``, ``ρ_v`` (relative to ``‖k‖``/``‖v‖`` if ``relative``) against the bases of its chunk
    (``ChunkedCache(record_residuals=True)``; warm-up tokens excluded; a chunk's first token against its own fresh
    bases). ``τ = percentile``-th percentile (linear interpolation; 100 = the maximum) of the recorded values.

    :class:`ChunkedCache` takes one τ for all layers, so the thresholds are **single scalars**, pooled over layers,
    sequences and KV heads. Returns ``{"tau_k": float, "tau_v": float | None (None with a shared value basis,
    which ignores τ_v), "percentile": p, "n_tokens": calibration tokens fed, "n_residuals": recorded per kind}``.
    """
    import numpy as np

    p = float(percentile)
    if not 0.0 <= p <= 100.0:
        raise ValueError(f"percentile must be in [0, 100], got {percentile}")
    opts = {k: v for k, v in cache_options.items() if k not in ("tau_k", "tau_v")}
    dec = OnlineDecoder(model, rank_k=rank_k, rank_v=rank_v, ell=ell, relative=relative, record_residuals=True,
                        **opts)
    batches = [batches_or_ids] if isinstance(batches_or_ids, torch.Tensor) else list(batches_or_ids)
    rk, rv, n_tokens = [], [], 0
    for ids in batches:
        ids = ids[None] if ids.dim() == 1 else ids
        cache = dec.new_cache(ids.shape[0])
        dec(ids.to(dec.device), cache, last_only=True)
        k, v = cache.recorded_residuals()
        rk.append(k), rv.append(v)
        n_tokens += ids.numel()
    rk, rv = torch.cat(rk) if rk else torch.zeros(0), torch.cat(rv) if rv else torch.zeros(0)
    if rk.numel() == 0:
        raise ValueError(f"no residuals recorded from {n_tokens} calibration tokens: every token fell in the "
                         f"warm-up (use longer calibration sequences or a smaller warmup)")
    tau_k = float(np.percentile(rk.double().numpy(), p))
    tau_v = None if dec.new_cache(1).shared_value_basis else float(np.percentile(rv.double().numpy(), p))
    return {"tau_k": tau_k, "tau_v": tau_v, "percentile": p, "n_tokens": n_tokens, "n_residuals": int(rk.numel())}


# ============================================================================================== diagnostics
def _cummax(x: torch.Tensor) -> torch.Tensor:
    return torch.cummax(x, dim=-1).values


def attention_diagnostics(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_hat: torch.Tensor,
                          v_hat: torch.Tensor, scale: float, *, causal: bool = True,
                          key_residual_recorded: Optional[torch.Tensor] = None,
                          value_residual_recorded: Optional[torch.Tensor] = None,
                          out_hat: Optional[torch.Tensor] = None, rel_floor: float = 1e-6) -> dict:
    """Observed errors vs bounds for one layer → a dict of floats (max over queries, heads and sequences).

    ``q (B, Hq, Tq, d)``; ``k, k_hat (B, Hkv, T, d)``; ``v, v_hat (B, Hkv, T, d_v)``; query head ``h`` reads KV
    head ``h // (Hq/Hkv)``; ``causal``: query ``i`` sits at position ``T − Tq + i``. Computed in float64.
    ``key_residual_recorded`` / ``value_residual_recorded`` ``(B, Hkv)``: a cache's own residual maxima, reported
    (and used for a second, a-priori logit bound ``logit_bound_recorded``). ``out_hat (B, Hq, Tq, d_v)``: an
    approximate output computed elsewhere (e.g. the decoder's), compared with ``softmax(ℓ̂) v̂``.

    Keys: ``logit_err``, ``logit_bound`` (``s‖q‖ max_{t≤i} ρ_k(t)``), ``softmax_l1``, ``softmax_bound``
    (``2 tanh(δ̄/4)``), ``softmax_bound_sinh`` (``2 sinh(δ̄/2)``), ``softmax_bound_obs`` / ``…_sinh_obs`` (from
    the observed oscillation ``δ``), ``output_err``, ``output_bound`` / ``output_bound_sinh``; ``*_slack`` =
    max bound / max observed; ``*_tightest`` = min over queries of bound / observed (queries whose observed error
    is below ``rel_floor`` × its max are skipped); ``holds`` (every bound ≥ observed for every query, to 1e-9
    relative); ``rel_output_err`` = ``(Σ‖o − ô‖² / Σ‖o‖²)^½``; ``rel_logit_err`` = ``max ε / max |ℓ|``;
    ``key_residual``, ``value_residual`` (max observed ρ), ``v_norm``.
    """
    b, hq, tq, d = q.shape
    hkv, t = k.shape[1], k.shape[2]
    if hq % hkv or k.shape != k_hat.shape or v.shape != v_hat.shape or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"shapes do not fit: q {tuple(q.shape)}, k {tuple(k.shape)}, k_hat {tuple(k_hat.shape)}, "
                         f"v {tuple(v.shape)}, v_hat {tuple(v_hat.shape)}")
    g = hq // hkv
    q5 = q.double().reshape(b, hkv, g, tq, d)
    k, k_hat, v, v_hat = (x.double()[:, :, None] for x in (k, k_hat, v, v_hat))  # (B, Hkv, 1, T, ·)
    logits = scale * q5 @ k.transpose(-1, -2)  # (B, Hkv, g, Tq, T)
    logits_hat = scale * q5 @ k_hat.transpose(-1, -2)
    mask = causal_mask(tq, t, q.device) if causal else torch.ones(tq, t, dtype=torch.bool, device=q.device)
    logits = logits.masked_fill(~mask, -math.inf)
    logits_hat = logits_hat.masked_fill(~mask, -math.inf)
    alpha, alpha_hat = torch.softmax(logits, -1), torch.softmax(logits_hat, -1)
    o, o_hat = alpha @ v, alpha_hat @ v_hat  # (B, Hkv, g, Tq, d_v)

    # per-token residuals and value norms, then the max over the keys each query sees
    rho_k = (k - k_hat).norm(dim=-1)  # (B, Hkv, 1, T)
    rho_v = (v - v_hat).norm(dim=-1)
    v_norm = v.norm(dim=-1)
    pos = torch.arange(t - tq, t, device=q.device) if causal else torch.full((tq,), t - 1, device=q.device)

    def seen_max(x: torch.Tensor) -> torch.Tensor:  # (B, Hkv, 1, T) → (B, Hkv, 1, Tq)
        return _cummax(x)[..., pos]

    vis = torch.isfinite(logits)
    err = torch.where(vis, (logits - logits_hat).abs(), torch.zeros_like(logits)).amax(-1)  # ε (B, Hkv, g, Tq)
    osc = logit_oscillation(logits, logits_hat)
    l1 = (alpha - alpha_hat).abs().sum(-1)
    oerr = (o - o_hat).norm(dim=-1)
    eps_b = logit_error_bound(q5, seen_max(rho_k), scale)
    vmax, dvmax = seen_max(v_norm), seen_max(rho_v)
    sm_b, sm_bs = softmax_l1_bound(2 * eps_b), softmax_l1_bound(2 * eps_b, kind="sinh")
    sm_o, sm_os = softmax_l1_bound(osc), softmax_l1_bound(osc, kind="sinh")
    out_b, out_bs = output_error_bound(sm_b, vmax, dvmax), output_error_bound(sm_bs, vmax, dvmax)

    def mx(x: torch.Tensor) -> float:
        return float(x.max()) if x.numel() else 0.0

    def slack(bound: torch.Tensor, obs: torch.Tensor) -> float:
        return mx(bound) / mx(obs) if mx(obs) > 0 else math.inf

    def tightest(bound: torch.Tensor, obs: torch.Tensor) -> float:
        sel = obs > rel_floor * mx(obs)
        return float((bound[sel] / obs[sel]).min()) if mx(obs) > 0 and bool(sel.any()) else math.inf

    pairs = {"logit": (eps_b, err), "softmax": (sm_b, l1), "softmax_sinh": (sm_bs, l1),
             "softmax_obs": (sm_o, l1), "output": (out_b, oerr), "output_sinh": (out_bs, oerr)}
    tol = 1e-9
    holds = all(bool((obs <= bound * (1 + tol) + tol * (1 + mx(obs))).all()) for bound, obs in pairs.values())
    ref = torch.where(vis, logits.abs(), torch.zeros_like(logits))
    rep = {
        "logit_err": mx(err), "logit_bound": mx(eps_b), "rel_logit_err": mx(err) / max(mx(ref), 1e-300),
        "oscillation": mx(osc),
        "softmax_l1": mx(l1), "softmax_bound": mx(sm_b), "softmax_bound_sinh": mx(sm_bs),
        "softmax_bound_obs": mx(sm_o), "softmax_bound_sinh_obs": mx(sm_os),
        "output_err": mx(oerr), "output_bound": mx(out_b), "output_bound_sinh": mx(out_bs),
        "rel_output_err": math.sqrt(float(((o - o_hat) ** 2).sum()) / max(float((o**2).sum()), 1e-300)),
        "key_residual": mx(rho_k), "value_residual": mx(rho_v), "v_norm": mx(v_norm), "holds": holds,
    }
    for name, (bound, obs) in pairs.items():
        rep[f"{name}_slack"] = slack(bound, obs)
        rep[f"{name}_tightest"] = tightest(bound, obs)
    if key_residual_recorded is not None:
        rk = key_residual_recorded.double().reshape(b, hkv, 1, 1)
        rep["key_residual_recorded"] = mx(rk)
        rec_b = logit_error_bound(q5, rk, scale)  # a-priori: from the cache's own residual maxima
        rep["logit_bound_recorded"] = mx(rec_b)
        # the recorded maxima are exact up to float32 rounding of the stored numbers
        rep["holds_recorded"] = bool((err <= rec_b + 1e-5 * (1 + mx(err))).all())
    if value_residual_recorded is not None:
        rep["value_residual_recorded"] = mx(value_residual_recorded.double())
    if out_hat is not None:
        oh = out_hat.double().reshape(b, hkv, g, tq, -1)
        rep["attend_matches"] = mx((oh - o_hat).abs())
    return rep


def _chunk_report(cache: ChunkedCache, layer: int) -> dict:
    """Chunk counts ``J`` (closed + active, warm-up included) over the layer's streams: max and mean."""
    lens = cache.chunk_lengths(layer)
    js = [len(x) for x in lens]
    return {"chunks_max": max(js), "chunks_mean": sum(js) / len(js)}


def _fd_report(cache: ChunkedCache, layer: int, k: torch.Tensor, v: torch.Tensor) -> dict:
    """The FD residual bound per stream: ``‖K − K V_r V_rᵀ‖_F ≤ (‖K‖_F² − ‖S_r‖_F²)^½`` for the final sketch's
    top-``r`` basis ``V_r`` (:meth:`FrequentDirections.residual_bound`), with ``‖K − K_r‖_F`` (exact SVD) for
    reference; max over (sequence, KV head) of the observed value, the bound and the best rank-``r`` residual.
    Needs every key of the stream (``k (B, Hkv, T, d)``) and no sketch decay."""
    out = {}
    for name, x, fd, r in (("k", k, cache.fd_k[layer], cache.rank_k), ("v", v, cache.fd_v[layer], cache.rank_v)):
        if fd.decay != 1.0 or fd.n_rows != x.shape[2]:
            continue
        x = x.double()
        basis = fd.basis(r).double()  # (B, Hkv, d, r)
        obs = (x - x @ basis @ basis.transpose(-1, -2)).norm(dim=(-2, -1))
        bound = fd.residual_bound(r).sqrt()
        best = torch.linalg.svdvals(x)[..., r:].pow(2).sum(-1).sqrt()
        out[f"fd_residual_{name}"] = float(obs.max())
        out[f"fd_residual_bound_{name}"] = float(bound.max())
        out[f"fd_best_residual_{name}"] = float(best.max())
        out[f"fd_holds_{name}"] = bool((obs <= bound * (1 + 1e-6) + 1e-6).all())
    return out


def _exact_qkv(model: nn.Module, input_ids: torch.Tensor, rope: Optional[str]) -> list[dict[str, torch.Tensor]]:
    """The exact model's per-layer q, k, v as ``(B, H, T, d)`` (post-RoPE unless ``rope="pre"``)."""
    from kvsplice.lowrank.calibrate import extract_qkv

    qkv = extract_qkv(model, input_ids, rope=rope)
    return [{n: x.transpose(1, 2).contiguous() for n, x in layer.items()} for layer in qkv]


@torch.no_grad()
def online_qkv_diagnostics(model: nn.Module, input_ids: torch.Tensor, **cache_kw) -> list[dict]:
    """Teacher-forced online diagnostics: the exact model's post-RoPE ``q, k, v`` on ``input_ids`` are appended
    to a fresh :class:`ChunkedCache` (options as :class:`OnlineDecoder`'s) layer by layer, and each layer's
    chunked attention is compared with the exact one (:func:`attention_diagnostics`, plus ``J`` and the FD
    residual bound). Every layer sees exact inputs, so this matches :func:`bases_diagnostics`."""
    dec = OnlineDecoder(model, **cache_kw)
    cache = dec.new_cache(input_ids.shape[0])
    out = []
    for l, x in enumerate(_exact_qkv(model, input_ids, "post")):
        cache.append(l, k=x["k"], v=x["v"])
        k_hat, v_hat = cache.reconstruct(l)
        rk, rv = cache.residual_maxima(l)
        z = cache.attend_chunked(l, x["q"], dec.scales[l])
        d = attention_diagnostics(x["q"], x["k"], x["v"], k_hat, v_hat, dec.scales[l], key_residual_recorded=rk,
                                  value_residual_recorded=rv, out_hat=z)
        d.update(_chunk_report(cache, l))
        d.update(_fd_report(cache, l, x["k"], x["v"]))
        out.append(d)
    return out


@torch.no_grad()
def bases_diagnostics(model: nn.Module, bases: KVBases, input_ids: torch.Tensor) -> list[dict]:
    """Diagnostics of global bases on ``input_ids``: exact ``q, k, v`` from
    :func:`~kvsplice.lowrank.calibrate.extract_qkv` (in the bases' RoPE mode), ``k̂ = k k_enc k_decᵀ`` (exactly the
    coefficient logits ``(q k_dec)·(k k_enc)`` for oblique pairs too), ``v̂ = v v_enc v_decᵀ``; for pre-RoPE bases
    ``q``, ``k`` and ``k̂`` are rotated after the rebuild. Returns one :func:`attention_diagnostics` dict per layer."""
    fam = family_adapter(model)
    if bases.n_layer != fam.n_layer or bases.n_kv_head != fam.n_kv_head:
        raise ValueError(f"bases ({bases.n_layer} layers × {bases.n_kv_head} KV heads) do not fit the model "
                         f"({fam.n_layer} × {fam.n_kv_head})")
    mode = bases.rope if fam.has_rope else "none"
    qkv = _exact_qkv(model, input_ids, "pre" if mode == "pre" else ("post" if fam.has_rope else None))
    rope = None
    if mode == "pre":
        t = input_ids.shape[1]
        rope = fam.rope_tables(qkv[0]["q"].transpose(1, 2), torch.arange(t, device=input_ids.device))
    out = []
    for l, x in enumerate(qkv):
        heads = bases.layers[l]
        k, v, q = x["k"].double(), x["v"].double(), x["q"].double()
        k_hat = torch.stack([k[:, j] @ (h.k_enc.double() @ h.k_dec.double().T) for j, h in enumerate(heads)], 1)
        v_hat = torch.stack([v[:, j] @ (h.v_enc.double() @ h.v_dec.double().T) for j, h in enumerate(heads)], 1)
        if rope is not None:
            cos, sin = (r.double() for r in rope)
            q, k, k_hat = (fam.rotate(y, cos, sin) for y in (q, k, k_hat))
        out.append(attention_diagnostics(q, k, v, k_hat, v_hat, fam.scale(l)))
    return out


_COLS = [("logit_err", "ε obs"), ("logit_bound", "ε bound"), ("softmax_l1", "‖Δα‖₁ obs"),
         ("softmax_bound", "2tanh(δ̄/4)"), ("softmax_bound_sinh", "2sinh(δ̄/2)"), ("softmax_bound_obs", "2tanh(δ/4)"),
         ("output_err", "‖Δo‖ obs"), ("output_bound", "‖Δo‖ bound"), ("logit_tightest", "slack ε"),
         ("softmax_obs_tightest", "slack α(δ)"), ("output_tightest", "slack o"), ("holds", "holds")]


def format_diagnostics(diag: list[dict], title: str = "") -> str:
    """A markdown table of per-layer diagnostics (max over queries/heads; slack = tightest bound/observed)."""

    def fmt(x) -> str:
        if isinstance(x, bool):
            return "yes" if x else "NO"
        if x is None:
            return "—"
        return "inf" if x == math.inf else f"{x:.3g}"

    extra = [c for c in (("chunks_max", "J max"), ("fd_residual_k", "FD res k"),
                         ("fd_residual_bound_k", "FD bound k")) if any(c[0] in d for d in diag)]
    cols = _COLS + extra
    lines = [f"**{title}**", ""] if title else []
    lines.append("| layer | " + " | ".join(h for _, h in cols) + " |")
    lines.append("|---" * (len(cols) + 1) + "|")
    for l, d in enumerate(diag):
        lines.append(f"| {l} | " + " | ".join(fmt(d.get(k)) for k, _ in cols) + " |")
    return "\n".join(lines)
