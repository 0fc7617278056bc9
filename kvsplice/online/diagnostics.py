"""The online method's diagnostics: chunk counts, the FD residual bound, and the teacher-forced attention-error diagnostics of a
chunked cache (the generic per-layer function is :func:`kvsplice.core.diagnostics.attention_diagnostics`).

* :meth:`kvsplice.online.method.OnlineDecoder.diagnose` — in-run (the decoder's own q, k, v and output).
* :func:`online_qkv_diagnostics` — teacher-forced: the *exact* model's ``q, k, v``
  (:func:`kvsplice.adapters.capture.extract_qkv`) fed into a fresh chunked cache, layer by layer.
"""

from __future__ import annotations

import torch
from torch import nn

from kvsplice.adapters import adapter_for
from kvsplice.adapters.capture import extract_qkv
from kvsplice.core.diagnostics import attention_diagnostics
from kvsplice.online.attention import chunked_attention
from kvsplice.online.chunked import ChunkedCache

__all__ = ["chunk_report", "fd_report", "online_qkv_diagnostics"]


def chunk_report(cache: ChunkedCache, layer: int) -> dict:
    """Chunk counts ``J`` (closed + active, warm-up included) over the layer's streams: max and mean."""
    lens = cache.chunk_lengths(layer)
    js = [len(x) for x in lens]
    return {"chunks_max": max(js), "chunks_mean": sum(js) / len(js)}


def fd_report(cache: ChunkedCache, layer: int, k: torch.Tensor, v: torch.Tensor) -> dict:
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
        obs = (x - x @ basis @ basis.transpose(-1, -2)).norm(dim=(-2, -1))  # (B, Hkv)
        bound = fd.residual_bound(r).sqrt()
        best = torch.linalg.svdvals(x)[..., r:].pow(2).sum(-1).sqrt()
        out[f"fd_residual_{name}"] = float(obs.max())
        out[f"fd_residual_bound_{name}"] = float(bound.max())
        out[f"fd_best_residual_{name}"] = float(best.max())
        out[f"fd_holds_{name}"] = bool((obs <= bound * (1 + 1e-6) + 1e-6).all())
    return out


@torch.no_grad()
def online_qkv_diagnostics(model: nn.Module, input_ids: torch.Tensor, **cache_kw) -> list[dict]:
    """Teacher-forced online diagnostics: the exact model's post-RoPE ``q, k, v`` on ``input_ids`` are appended
    to a fresh :class:`ChunkedCache` (options as :class:`~kvsplice.online.method.OnlineFD`'s) layer by layer, and each layer's
    chunked attention is compared with the exact one (:func:`attention_diagnostics`, plus ``J`` and the FD
    residual bound). Every layer sees exact inputs, so this matches :func:`kvsplice.lowrank.diagnostics.bases_diagnostics`."""
    adapter = adapter_for(model)
    adapter.require_projections()
    p = adapter.param()
    cache_kw.setdefault("dtype", torch.promote_types(p.dtype, torch.float32))
    cache = ChunkedCache(adapter.n_layer, adapter.n_kv_head, adapter.head_dim, input_ids.shape[0], device=p.device,
                         **cache_kw)
    out = []
    for l, x in enumerate(extract_qkv(model, input_ids, rope="post")):
        cache.append(l, k=x["k"], v=x["v"])
        k_hat, v_hat = cache.reconstruct(l)
        rk, rv = cache.residual_maxima(l)
        z = chunked_attention(cache, l, x["q"], adapter.scale(l))
        d = attention_diagnostics(x["q"], x["k"], x["v"], k_hat, v_hat, adapter.scale(l), key_residual_recorded=rk,
                                  value_residual_recorded=rv, out_hat=z)
        d.update(chunk_report(cache, l))
        d.update(fd_report(cache, l, x["k"], x["v"]))
        out.append(d)
    return out
