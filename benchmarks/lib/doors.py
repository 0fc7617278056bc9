"""A compression method scored through both doors: the continuation's perplexity through the package's ``Decoder``
and through transformers' forward (:func:`hf_nll`: with ``KVSpliceHFCache``, or any transformers cache), and the
cache's bytes measured in each against the method's formula."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kvsplice.decode import Decoder, score_continuation
from kvsplice.evaluation.protocol import full_bytes_per_token
from kvsplice.hf import KVSpliceHFCache
from kvsplice.hf.measure import continuation_logits
from kvsplice.report.memory import measure_cache
from kvsplice.select import TokenSelection

__all__ = ["evaluate", "hf_nll"]


@torch.no_grad()
def hf_nll(model, cache, ids: torch.Tensor, p: int, **kw) -> float:
    """The mean NLL of ``ids[:, p:]`` through transformers' forward with ``cache`` (``kw``: of
    :func:`~kvsplice.hf.measure.continuation_logits`)."""
    logits = continuation_logits(model, cache, ids, p, **kw).float()  # (B, T - p, V)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, p:].reshape(-1)).item()


def evaluate(model, windows: torch.Tensor, p: int, name: str, method) -> dict:
    """``method`` on every window (prompt ``p`` prefilled, the rest scored) in both doors."""
    nll = {"decoder": 0.0, "hf": 0.0}
    reseed = method.selector.reseed if isinstance(method, TokenSelection) else lambda: None  # the same picks in both
    for w in windows:
        ids = w[None]
        reseed()
        n_dec, _, c_dec = score_continuation(Decoder(model, method), ids, p)
        reseed()
        c_hf = KVSpliceHFCache(model, method, capacity=method.capacity(p, ids.shape[1] - p))
        nll["decoder"] += n_dec / len(windows)
        nll["hf"] += hf_nll(model, c_hf, ids, p) / len(windows)
    bound, t_seen, held = Decoder(model, method).method, windows.shape[1] - 1, c_dec.seq_len
    measured = {"decoder": measure_cache(c_dec).live_bytes, "hf": measure_cache(c_hf).live_bytes}
    formula = bound.bytes_formula(1, held, c_dec.dtype)
    full_fp16 = full_bytes_per_token(bound.adapter) * t_seen
    return {"name": name, "ppl": math.exp(nll["decoder"]), "ppl_hf": math.exp(nll["hf"]),
            "tokens_seen": t_seen, "tokens_held": held, "bytes": measured["decoder"], "bytes_hf": measured["hf"],
            "bytes_formula": formula, "bytes_per_token": measured["decoder"] / t_seen,
            "ratio_vs_fp16_full": full_fp16 / measured["decoder"],
            "bytes_match": measured["decoder"] == measured["hf"] == formula == c_dec.nbytes()}
