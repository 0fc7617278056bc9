"""``TokenSelection``: exact prefill, then a weighted subset of each layer's prompt tokens per KV head.

::

    dec = TokenSelectionDecoder(model, make_selector("balancekv"), budget=256)   # Decoder(model, TokenSelection(...))
    cache = dec.new_cache(batch_size=B)
    logits = dec.prefill(prompt_ids, cache)       # (B, P, V): exact full causal attention over the prompt, then
                                                  # every layer's K/V compressed to `budget` tokens per KV head
    logits = dec(next_ids, cache)                 # decode one or more tokens over the compressed cache
    res = run_token_selection(model, ids, selector, budget, prompt_len=P)   # perplexity of ids[:, P:]

* Prefill is exact: the prompt's own queries see every prompt key (the model's logits for the prompt are the
  model's). Each layer's keys — **post-RoPE** for Llama, i.e. rotated at their true positions — and values are then
  handed to the selector, one independent selection per (sequence, KV head) (GQA: the ``g`` query heads of a KV head
  share its selection), and stored with their log-weights in a :class:`~kvsplice.select.cache.SubsetCache`.
* Decode: new tokens are appended exactly (log-weight 0) and attend with ``softmax(q·Kᵀ·s + logw)·V``
  (:func:`~kvsplice.select.cache.weighted_attend`, i.e. ``attend(..., bias=logw)``) over kept + new tokens.
* Positions: a token decoded after a compressed prefill sits at absolute position ``cache.position`` (tokens the
  sequence has seen), not ``cache.seq_len`` (tokens held) — the decoder takes positions from ``position`` for every
  method, so RoPE angles and GPT-2's learned position embeddings are those of the uncompressed sequence.

With ``budget >= prompt length`` every selector keeps every token with log-weight 0 and the decoder reproduces the
model's own logits (tested to 1e-4 against HF for tiny random GPT-2 and GQA Llama).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from kvsplice.decode.decoder import Decoder
from kvsplice.decode.method import CompressionMethod
from kvsplice.select.cache import SubsetCache, TokenSelectionResult, weighted_attend
from kvsplice.select.selectors import TokenSelector

__all__ = ["TokenSelection", "TokenSelectionDecoder", "run_token_selection"]


class TokenSelection(CompressionMethod):
    """Keep ``budget`` prompt tokens per (sequence, KV head), chosen by ``selector``, with their log-weights."""

    name = "select"
    cache_type = SubsetCache

    def __init__(self, selector: TokenSelector, budget: int) -> None:
        if not isinstance(selector, TokenSelector):
            raise TypeError(f"selector must be a kvsplice.select.selectors.TokenSelector, got "
                            f"{type(selector).__name__}")
        if budget < 1:
            raise ValueError(f"budget must be >= 1, got {budget}")
        self.selector, self.budget = selector, int(budget)

    def new_cache(self, adapter, batch_size, capacity=None, *, dtype, device):
        return SubsetCache(adapter.n_layer, adapter.n_kv_head, adapter.head_dim, batch_size, dtype=dtype,
                           device=device, capacity=capacity)

    def capacity(self, prompt_len: int, max_new_tokens: int) -> int:
        return min(self.budget, prompt_len) + max(max_new_tokens, 1) - 1

    def attention(self, layer, h, cache, step):
        a = step.adapter
        q, k, v = a.qkv(layer, h, step.rope)  # post-RoPE: keys rotated at their true positions
        k, v = k.to(cache.dtype), v.to(cache.dtype)
        if step.start == 0:  # prefill: exact attention over the prompt, then keep a weighted subset per KV head
            y = step.attend(layer, q, k, v)  # (B, Hq, T, D)
            cache.compress_prefill(layer, k, v, self.selector, self.budget)
        else:
            kv = cache.append(layer, k=k, v=v)  # new tokens kept exactly, log-weight 0
            y = weighted_attend(q, kv["k"], kv["v"], kv["w"], scale=step.scales[layer]).to(h.dtype)
        return a.out(layer, y)

    def __repr__(self) -> str:
        return f"TokenSelection({self.selector!r}, budget={self.budget})"


class TokenSelectionDecoder(Decoder):
    """``Decoder(model, TokenSelection(selector, budget))`` with an explicit :meth:`prefill` (on an empty cache)
    and decode calls (on a prefilled one)."""

    def __init__(self, model: nn.Module, selector: TokenSelector, budget: int) -> None:
        super().__init__(model, TokenSelection(selector, budget))
        self.selector, self.budget = selector, int(budget)

    def bytes_formula(self, batch_size: int, n_held: int, dtype: Optional[torch.dtype] = None) -> int:
        a = self.adapter
        return SubsetCache.bytes_formula(a.n_layer, batch_size, a.n_kv_head, a.head_dim, a.head_dim, n_held,
                                         dtype or self.dtype)

    def prefill(self, input_ids: torch.Tensor, cache: SubsetCache, *, last_only: bool = False) -> torch.Tensor:
        """Exact causal forward of the prompt; every layer's K/V compressed into the (empty) ``cache``."""
        if isinstance(cache, SubsetCache) and (cache.seq_len != 0 or cache.position != 0):
            raise ValueError("prefill needs an empty cache (use new_cache() or cache.reset())")
        return Decoder.__call__(self, input_ids, cache, last_only=last_only)

    def __call__(self, input_ids: torch.Tensor, cache: SubsetCache, *, last_only: bool = False) -> torch.Tensor:
        """Decode ``input_ids (B, T)`` (one token or a teacher-forced chunk) over the compressed cache."""
        if isinstance(cache, SubsetCache) and cache.position == 0:
            raise ValueError("decode needs a prefilled cache: call prefill() first")
        return Decoder.__call__(self, input_ids, cache, last_only=last_only)

    decode = __call__


@torch.no_grad()
def run_token_selection(model: nn.Module, idx: torch.Tensor, selector: TokenSelector, budget: int, *,
                        prompt_len: Optional[int] = None, decode_chunk: Optional[int] = None,
                        return_logits: bool = False,
                        cache_dtype: Optional[torch.dtype] = None) -> TokenSelectionResult:
    """Prefill ``idx[:, :prompt_len]`` exactly, compress every layer's K/V to ``budget`` tokens per KV head, decode
    ``idx[:, prompt_len:-1]`` teacher-forced (chunks of ``decode_chunk``; default all at once — identical to one at a
    time since decoded tokens are kept exactly and the mask is bottom-right) and score ``idx[:, prompt_len:]``.
    The first continuation token is predicted by the exact prefill. ``prompt_len`` defaults to half the sequence."""
    b, t = idx.shape
    p = t // 2 if prompt_len is None else int(prompt_len)
    if not 1 <= p < t:
        raise ValueError(f"prompt_len must be in [1, {t - 1}], got {p}")
    dec = TokenSelectionDecoder(model, selector, budget)
    n_keep = min(budget, p)
    cache = dec.new_cache(b, capacity=n_keep + (t - 1 - p), dtype=cache_dtype)
    was_training = model.training
    model.eval()
    try:
        logits = [dec.prefill(idx[:, :p], cache, last_only=True)]
        step = decode_chunk or max(1, t - 1 - p)
        for s0 in range(p, t - 1, step):
            logits.append(dec(idx[:, s0:min(t - 1, s0 + step)], cache))
    finally:
        model.train(was_training)
    logits = torch.cat(logits, dim=1)  # (B, t - p, V)
    # (B·(t-p), V) logits vs (B·(t-p),) targets
    nll = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), idx[:, p:].reshape(-1)).item()
    el = torch.empty((), dtype=cache.dtype).element_size()
    a = dec.adapter
    full = 2 * a.n_layer * b * a.n_kv_head * (t - 1) * a.head_dim * el
    return TokenSelectionResult(nll=nll, ppl=math.exp(nll), n_scored=b * (t - p), prompt_len=p, budget=budget,
                                n_keep=n_keep, cache_nbytes=cache.nbytes(), full_nbytes=full, cache=cache,
                                logits=logits if return_logits else None)
