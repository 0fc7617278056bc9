"""One measurement for every method and stack: perplexity of a continuation after a compressed prompt, and the
bytes per token the compressed cache costs — what the SmolLM2 frontier, the budget planner and ``eval_bases
--plan`` report.

Per window ``(B, T)`` of token ids: the first ``prompt_len`` tokens are prefilled into a fresh cache of
``Decoder(model, method)`` (a token selection compresses them there; a storage method — low rank, int8, KIVI —
stores every token compressed as it enters), the remaining ``T − prompt_len`` are decoded teacher-forced over the
cache in chunks of ``decode_chunk`` (:func:`kvsplice.decode.score_continuation`) and scored (the prefill's last
position predicts the first). ``prompt_len = 0`` is the whole-window protocol instead: every token of the window
attends over the compressed cache (as :func:`kvsplice.decode.sequence_nll`, in chunks of ``decode_chunk``).

Bytes: the cache is measured from its tensors at the end of each batch and must equal the method's closed form
(:meth:`~kvsplice.core.method.CompressionMethod.bytes_formula`); the reported cost is that formula per prompt token
at ``storage_dtype`` (fp16 by default: the deployed cache, whatever dtype the model computes in) for the tokens held
after the prefill, against the fp16 full K/V cache ``2·L·Hkv·d·2`` bytes per token.
"""

from __future__ import annotations

import math
import time
from typing import Any, Optional

import torch

from kvsplice.core.method import CompressionMethod
from kvsplice.decode import Decoder, score_continuation
from kvsplice.decode.decoder import chunked_nll
from kvsplice.select.replay import can_replay, prefill_kept
from kvsplice.report.memory import measure_cache

__all__ = ["ProtocolError", "evaluate", "full_bytes_per_token", "held_after_prefill"]


class ProtocolError(RuntimeError):
    """Measured bytes differ from the method's formula (a bug, never a user error)."""


def full_bytes_per_token(adapter, dtype: torch.dtype = torch.float16) -> int:
    """The full K/V cache per token: ``2·L·Hkv·d·element size``."""
    return 2 * adapter.n_layer * adapter.n_kv_head * adapter.head_dim * torch.empty((), dtype=dtype).element_size()


def held_after_prefill(method: CompressionMethod, prompt_len: int) -> int:
    """Tokens per layer a bound ``method`` holds right after a ``prompt_len``-token prefill."""
    return min(getattr(method, "budget", prompt_len), prompt_len)


@torch.no_grad()
def evaluate(model, method: Optional[CompressionMethod], windows: torch.Tensor, *, prompt_len: int,
             batch_size: int = 4, decode_chunk: int = 64, storage_dtype: torch.dtype = torch.float16,
             progress=None, kept=None) -> dict[str, Any]:
    """The module's measurement of ``method`` (``None``: the full K/V cache) on ``windows (N, T)``; ``kept``: one
    window's kept exact prefill of its prompt, replayed into a token selection's cache
    (:func:`~kvsplice.decode.decoder.score_continuation`)."""
    dec = Decoder(model, method)
    n, t = windows.shape
    whole = prompt_len == 0
    p = t if whole else int(prompt_len)
    if not whole and not 1 <= p < t:
        raise ValueError(f"prompt_len must be 0 (whole windows) or in [1, {t - 1}], got {prompt_len}")
    total, scored, t0 = 0.0, 0, time.perf_counter()
    measured = []
    for ids in windows.split(batch_size):
        if hasattr(dec.method, "selector"):
            dec.method.selector.reseed()
        if whole:  # every token over the cache, chunk by chunk (keeping the cache to measure)
            nll, n_pred, cache = chunked_nll(dec, ids, decode_chunk)
            total, scored = total + nll, scored + n_pred
        else:
            nll, _, cache = score_continuation(dec, ids, p, decode_chunk=decode_chunk, kept=kept)
            k = ids.shape[0] * (t - p)
            total, scored = total + nll * k, scored + k
        live = measure_cache(cache).live_bytes
        formula = dec.formula_nbytes(cache)  # per layer on sliding-window models
        if formula is not None and live != formula:
            raise ProtocolError(f"{dec.method!r}: measured {live} bytes != formula {formula}")
        measured.append({"batch": ids.shape[0], "held": cache.seq_len, "seen": cache.position, "bytes": live,
                         "formula_match": formula is not None})
        if progress is not None:
            progress()
    held = held_after_prefill(dec.method, p)
    per_tok = dec.method.bytes_formula(1, held, storage_dtype)
    full = full_bytes_per_token(dec.adapter)
    nll = total / max(scored, 1)
    return {"method": repr(dec.method), "ppl": math.exp(nll), "nll": nll, "scored_tokens": scored,
            "prompt_len": 0 if whole else p, "window": t, "windows": n,
            "held_after_prefill": held, "bytes_per_token": None if per_tok is None else per_tok / p,
            "full_fp16_bytes_per_token": full,
            "ratio_vs_fp16_full": None if per_tok is None else full * p / per_tok,
            "storage_dtype": str(storage_dtype).replace("torch.", ""), "measured": measured,
            "seconds": time.perf_counter() - t0}


def evaluate_each(model, method_for, windows: torch.Tensor, *, prompt_len: int,
                  contexts: Optional[list] = None, **kw) -> dict[str, Any]:
    """:func:`evaluate` window by window with ``method_for(prompt ids (1, P))`` — for methods built from the prompt
    itself (KVzip re-reads it) — the NLLs pooled over the windows (``prompt_len`` >= 1). ``contexts``: one dict
    per window, kept by the caller across methods: ``method_for(ids, shared=contexts[i])`` keeps per-context work
    there and reuses another method's (:func:`~kvsplice.core.build.per_prompt`: KVzip's reconstruction pass),
    and a token selection replays the window's exact prefill, made once (:mod:`kvsplice.select.replay`)."""
    if not prompt_len:
        raise ValueError("a method built from its prompt needs prompt_len >= 1")
    if contexts is not None and len(contexts) != windows.shape[0]:
        raise ValueError(f"contexts: one dict per window ({windows.shape[0]}), got {len(contexts)}")
    kw.pop("batch_size", None)
    rows = []
    for i, w in enumerate(windows):
        ids = w[None, :prompt_len]  # (1, P)
        if contexts is None:
            rows.append(evaluate(model, method_for(ids), w[None], prompt_len=prompt_len, batch_size=1, **kw))
            continue
        method = method_for(ids, shared=contexts[i])
        kept = None
        if can_replay(model, method):  # the window's exact prefill, made once for every token selection
            kept = contexts[i].get(("prefill", prompt_len))
            if kept is None:
                kept = contexts[i][("prefill", prompt_len)] = prefill_kept(model, ids, prompt_len)
                kept.cache = None  # only the kept q, k, v and the last logits are replayed
        rows.append(evaluate(model, method, w[None], prompt_len=prompt_len, batch_size=1, kept=kept, **kw))
    n = sum(r["scored_tokens"] for r in rows)
    nll = sum(r["nll"] * r["scored_tokens"] for r in rows) / n
    return {**rows[0], "ppl": math.exp(nll), "nll": nll, "scored_tokens": n, "windows": len(rows),
            "measured": [m for r in rows for m in r["measured"]], "seconds": sum(r["seconds"] for r in rows)}
