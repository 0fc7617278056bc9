"""``OnlineFD``: online decoding with frequent-directions bases (no calibration) over a chunked cache.

Each layer's **post-RoPE** keys and its values go into a :class:`~kvsplice.online.chunked.ChunkedCache` (online
FD-seeded bases per chunk, thresholds ``τ_k``/``τ_v``, max chunk length ``L``, merge cap ``J_max``, warm-up ``W``);
attention is :func:`~kvsplice.online.attention.chunked_attention` (blockwise softmax over chunks, values rebuilt per
chunk as ``(Σ_t p_t b_t) E_jᵀ``), then the model's output projection::

    dec = OnlineDecoder(model, rank_k=4, rank_v=4, ell=8, tau_k=1.0, max_chunk_len=64, max_chunks=8)
    cache = dec.new_cache(batch_size=1)                # a ChunkedCache
    logits = dec(prompt_ids, cache)                    # prefill (B, T, V)
    ppl = dec.perplexity(ids, chunk_size=1)            # token by token, every token over the compressed cache
    logits, diag = dec.diagnose(ids)                   # one prefill + per-layer observed errors vs bounds
    tau = calibrate_thresholds(model, calib_ids, percentile=99, rank_k=4, ell=8, max_chunk_len=64)

``OnlineDecoder(model, **options)`` is ``Decoder(model, OnlineFD(**options))`` plus :meth:`~OnlineDecoder.diagnose`.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from kvsplice.core.attention import keys_seen
from kvsplice.core.diagnostics import attention_diagnostics
from kvsplice.core.method import CompressionMethod
from kvsplice.decode.decoder import Decoder, perplexity as _perplexity
from kvsplice.online.attention import chunked_attention
from kvsplice.online.chunked import ChunkedCache
from kvsplice.online.diagnostics import chunk_report, fd_report

__all__ = ["OnlineDecoder", "OnlineFD", "calibrate_thresholds"]


class OnlineFD(CompressionMethod):
    """Chunked online low-rank K/V. Options are :class:`ChunkedCache`'s: ``rank_k``, ``rank_v`` [rank_k], ``ell``
    [2·max rank], ``tau_k``, ``tau_v`` [None], ``max_chunk_len`` [256], ``max_chunks`` [None], ``warmup`` [16],
    ``shared_value_basis`` [False]; any other keyword (``min_chunk_len``, ``fd_decay``, ``fit_first_token``,
    ``relative``, ``granularity``, ``value_bases``, ``record_residuals``) is passed through."""

    name = "fd-online"
    cache_type = ChunkedCache

    def __init__(self, *, rank_k: int, rank_v: Optional[int] = None, ell: Optional[int] = None,
                 tau_k: Optional[float] = None, tau_v: Optional[float] = None, max_chunk_len: int = 256,
                 max_chunks: Optional[int] = None, warmup: int = 16, shared_value_basis: bool = False,
                 **cache_kw) -> None:
        self.cache_kw = dict(rank_k=rank_k, rank_v=rank_v, ell=ell, tau_k=tau_k, tau_v=tau_v,
                             max_chunk_len=max_chunk_len, max_chunks=max_chunks, warmup=warmup,
                             shared_value_basis=shared_value_basis, **cache_kw)
        self.record: Optional[list] = None  # set to a list to keep every layer's q, k, v and output (diagnose)

    def spec(self):
        """Its name and the options that differ from the defaults (:meth:`CompressionMethod.spec`)."""
        import inspect

        defaults = {n: p.default for n, p in inspect.signature(OnlineFD.__init__).parameters.items()}
        return {"name": self.name, **{k: v for k, v in self.cache_kw.items()
                                      if k not in defaults or v != defaults[k]}}

    def _prepare(self, adapter, *, dtype, device):
        super()._prepare(adapter, dtype=dtype, device=device)
        self._shape = (adapter.n_layer, adapter.n_kv_head, adapter.head_dim)
        self._new(adapter, 1, torch.promote_types(dtype, torch.float32), device)  # check the options

    def _new(self, adapter, batch_size, dtype, device) -> ChunkedCache:
        kw = dict(self.cache_kw)
        kw.setdefault("dtype", torch.promote_types(dtype, torch.float32))
        return ChunkedCache(adapter.n_layer, adapter.n_kv_head, adapter.head_dim, batch_size, device=device, **kw)

    def new_cache(self, batch_size, capacity=None, *, dtype, device):
        """An empty :class:`ChunkedCache` (chunks grow on their own: ``capacity`` does not apply). Coefficients are
        stored in at least float32 unless the options say otherwise."""
        return self._new(self._bound(), batch_size, dtype, device)

    def check_cache(self, cache):
        if not isinstance(cache, ChunkedCache) or (cache.n_layer, cache.n_kv_head, cache.head_size) != self._shape:
            raise TypeError("this decoder needs a ChunkedCache with the model's shapes; use decoder.new_cache()")

    def attend(self, layer, q, k, v, cache, step, mask=None, logw=None):
        if logw is not None or (mask is not None and not bool(keys_seen(mask).all())):
            raise NotImplementedError("OnlineFD attends causally over whole sequences: no padding (left-padded "
                                      "batches) and no token-subset log-weights")
        cache.append(layer, k=k, v=v)
        z = chunked_attention(cache, layer, q, step.scales[layer])  # (B, Hq, T, D): values rebuilt per chunk
        if self.record is not None:
            self.record.append({"q": q, "k": k, "v": v, "z": z})
        return z

    def __repr__(self) -> str:
        kw = ", ".join(f"{k}={v}" for k, v in self.cache_kw.items() if v is not None)
        return f"OnlineFD({kw})"


class OnlineDecoder(Decoder):
    """``Decoder(model, OnlineFD(**options))`` with :meth:`perplexity` (token by token by default) and
    :meth:`diagnose`."""

    def __init__(self, model: nn.Module, *, attn_backend: str = "auto", **options) -> None:
        super().__init__(model, OnlineFD(**options), attn_backend=attn_backend)
        self.cache_kw = self.method.cache_kw

    def perplexity(self, input_ids: torch.Tensor, chunk_size: Optional[int] = 1) -> float:
        """``exp`` of the mean next-token NLL of ``input_ids (B, T)`` fed through a fresh cache in chunks of
        ``chunk_size`` tokens (default 1: true online decoding; ``None``: one prefill call — identical unless
        ``max_chunks`` merges re-project old tokens, which a prefill's earlier queries would then see)."""
        return _perplexity(self, input_ids, chunk_size)

    @torch.no_grad()
    def diagnose(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, list[dict]]:
        """Prefill ``input_ids`` into a fresh cache and return ``(logits, per-layer diagnostics)``.

        Each layer compares its own exact attention (the run's ``q, k, v``) with the cache's (``k̂, v̂`` from
        :meth:`ChunkedCache.reconstruct`); ``output_err`` is checked against the decoder's actual output
        (``attend_matches`` = max deviation of the computed output from ``softmax(ℓ̂) v̂``). Adds chunk counts
        ``J`` and the FD residual bound (see :func:`~kvsplice.online.diagnostics.fd_report`)."""
        cache = self.new_cache(input_ids.shape[0])
        self.method.record = rec = []
        try:
            logits = self(input_ids, cache)
        finally:
            self.method.record = None
        out = []
        for l, r in enumerate(rec):
            k_hat, v_hat = cache.reconstruct(l)
            rk, rv = cache.residual_maxima(l)
            d = attention_diagnostics(r["q"], r["k"], r["v"], k_hat, v_hat, self.scales[l],
                                      key_residual_recorded=rk, value_residual_recorded=rv, out_hat=r["z"])
            d.update(chunk_report(cache, l))
            d.update(fd_report(cache, l, r["k"], r["v"]))
            out.append(d)
        return logits, out

    def __repr__(self) -> str:
        return f"OnlineDecoder({self.family}, {self.method!r})"


@torch.no_grad()
def calibrate_thresholds(model: nn.Module, batches_or_ids, *, percentile: float, rank_k: int,
                         rank_v: Optional[int] = None, ell: Optional[int] = None, relative: bool = False,
                         **cache_options) -> dict:
    """``τ_k``, ``τ_v`` from residual percentiles on calibration tokens.

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
