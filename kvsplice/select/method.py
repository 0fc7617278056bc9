"""``TokenSelection``: exact prefill, then a weighted subset of each layer's prompt tokens per KV head, held by any
storage method (full keys/values by default; low-rank coefficients, int8, ... — a stack).

::

    dec = Decoder(model, TokenSelection(make_selector("balancekv"), budget=256))
    cache = dec.new_cache(batch_size=B)                 # a SubsetCache
    logits = dec(prompt_ids, cache)                     # (B, P, V): exact full causal attention over the prompt, then
                                                        # every layer's K/V compressed to `budget` tokens per KV head
    logits = dec(next_ids, cache)                       # decode one or more tokens over the compressed cache
    res = run_token_selection(model, ids, selector, budget, prompt_len=P)   # perplexity of ids[:, P:]
    stack = TokenSelection(selector, 64, store=LowRank(bases, cache_quant="int8"))   # subset → coefficients → int8
    hf_cache = KVSpliceHFCache(model, stack)            # the same method inside transformers' generate()

* Prefill is exact: the prompt's own queries see every prompt key (the model's logits for the prompt are the
  model's). Each layer's keys — **post-RoPE** for Llama, i.e. rotated at their true positions — and values are then
  handed to the selector, one independent selection per (sequence, KV head) (GQA: the ``g`` query heads of a KV head
  share its selection; left padding under transformers' mask is excluded, :func:`~kvsplice.select.cache.choose_tokens`),
  and the kept tokens go to the storage method (:meth:`~kvsplice.core.method.CompressionMethod.append`) with their
  log-weights beside them in a :class:`~kvsplice.select.cache.SubsetCache`.
* Decode: new tokens are stored exactly (log-weight 0) and attend with ``softmax(q·Kᵀ·s + logw)·V`` — the storage
  method's own :meth:`~kvsplice.core.method.CompressionMethod.attend` with ``logw``.
* Positions: a token decoded after a compressed prefill sits at absolute position ``cache.position`` (tokens the
  sequence has seen), not ``cache.seq_len`` (tokens held) — both doors take positions from ``position``, so RoPE
  angles and GPT-2's learned position embeddings are those of the uncompressed sequence.

With ``budget >= prompt length`` every selector keeps every token with log-weight 0 and the decoder reproduces the
storage method's logits (the model's own for full keys/values; tested to 1e-4 against HF for tiny random GPT-2 and
GQA Llama). Storage that needs positions (pre-RoPE coefficients, ``kivi_prerope``) cannot hold a subset and is refused.
"""

from __future__ import annotations

import copy
import math
from typing import Optional

import torch
from torch import nn

from kvsplice.core.attention import keys_seen
from kvsplice.core.method import CompressionMethod, layer_tokens
from kvsplice.decode.decoder import Decoder, score_continuation
from kvsplice.decode.dense import DenseKV
from kvsplice.select.cache import SubsetCache, TokenSelectionResult
from kvsplice.select.selectors import StreamingLLMSelector, TokenSelector

__all__ = ["TokenSelection", "TokenSelectionDecoder", "run_token_selection"]


class TokenSelection(CompressionMethod):
    """Keep ``budget`` prompt tokens per (sequence, KV head), chosen by ``selector``, with their log-weights, held by
    the storage method ``store`` (default :class:`~kvsplice.decode.dense.DenseKV`: full keys and values)."""

    name = "token_selection"
    cache_type = SubsetCache
    spec_nested = {"selector": "selector", "store": "method"}
    window: Optional[int] = None  # set on the variant for a sliding-window layer (for_window)

    def __init__(self, selector: TokenSelector, budget: int, *, store: Optional[CompressionMethod] = None) -> None:
        if not isinstance(selector, TokenSelector):
            raise TypeError(f"selector must be a kvsplice.select.selectors.TokenSelector, got "
                            f"{type(selector).__name__}")
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise ValueError(f"budget must be an integer >= 1, got {budget!r}")
        store = DenseKV() if store is None else store
        if not isinstance(store, CompressionMethod) or not store.is_storage:
            raise TypeError(f"store must be a storage method (DenseKV, LowRank, ...), got {type(store).__name__}")
        self.selector, self.budget, self.store = selector, budget, store

    def _prepare(self, adapter, *, dtype, device):
        super()._prepare(adapter, dtype=dtype, device=device)
        self.store = self.store.bind(adapter, dtype=dtype, device=device)
        if self.store.key_rope == "pre":
            raise ValueError(f"{self.store!r} keeps pre-RoPE numbers and needs its keys' positions; a token subset "
                             f"is held out of order: use a post-RoPE store (post-RoPE bases, kivi)")

    def for_window(self, window):
        """A sliding-window layer keeps the most recent ``min(budget, window - 1)`` prompt tokens (with log-weight 0,
        exact when the budget covers the window): any other subset would leave the window token by token as
        decoding moves on. Decode calls attend through the window's mask (the doors evict what leaves it)."""
        w = copy.copy(self)
        w.selector, w.budget, w.window = StreamingLLMSelector(n_sink=0), min(self.budget, window - 1), window
        return w

    def new_cache(self, batch_size, capacity=None, *, dtype, device):
        kept = self.store.new_cache(batch_size, capacity, dtype=dtype, device=device)
        return SubsetCache.over(kept, self._bound().n_kv_head, capacity)

    def check_cache(self, cache):
        super().check_cache(cache)
        self.store.check_cache(cache.kept)

    def capacity(self, prompt_len: int, max_new_tokens: int) -> int:
        return min(self.budget, prompt_len) + max(max_new_tokens, 1) - 1

    def bytes_formula(self, batch_size, n_held, dtype):
        """The storage method's bytes of ``n_held`` tokens + their log-weights ``L·B·Hkv·n_held·bytes``."""
        a = self._bound()
        el = torch.empty((), dtype=dtype).element_size()
        weights = layer_tokens(n_held, a.n_layer) * batch_size * a.n_kv_head * el
        return self.store.bytes_formula(batch_size, n_held, dtype) + weights

    def attend(self, layer, q, k, v, cache, step, mask=None, logw=None):
        if logw is not None:
            raise ValueError("a token selection does not hold another selection's log-weights")
        if cache.layer_len(layer) == 0:  # prefill: exact attention over the prompt, then keep a weighted subset
            kc, vc = k.to(cache.dtype), v.to(cache.dtype)
            y = step.attend(layer, q, kc.to(q.dtype), vc.to(q.dtype), mask=mask)  # (B, Hq, T, D)
            self.compress_prefill(layer, q, k, v, cache, step, mask=mask)
            return y
        # decode: new tokens kept exactly (log-weight 0); padding was folded into the log-weights at prefill
        b, h, t = k.shape[:3]
        w = cache.weights.append(layer, w=torch.zeros(b, h, t, 1, dtype=cache.dtype, device=k.device))["w"]
        return self.store.attend(layer, q, k, v, cache.kept, step, mask=mask if self.window else None,
                                 logw=w[..., 0])  # (B, Hq, Tq, Dv)

    def compress_prefill(self, layer, q, k, v, cache, step, mask=None) -> None:
        """The prefill's cache without its attention output: the prompt's ``k, v (B, Hkv, T, D)`` of ``layer``
        (``q (B, Hq, T, D)`` for selectors that read queries) → the kept, weighted subset in the empty ``cache``.
        :meth:`attend` is this plus the exact attention; a caller that has the prefill's output already (one exact
        prefill shared by many selections: :func:`kvsplice.tasks.shared.answer_many`) calls this alone."""
        k, v = k.to(cache.dtype), v.to(cache.dtype)
        cache.compress_prefill(layer, k, v, self.selector, self.budget, real=keys_seen(mask), q=q,
                               scale=step.scales[layer],
                               append_kept=lambda kk, vv: self.store.append(layer, kk, vv, cache.kept, step))

    def __repr__(self) -> str:
        store = "" if isinstance(self.store, DenseKV) and self.store.cache_quant is None else f", store={self.store!r}"
        return f"TokenSelection({self.selector!r}, budget={self.budget}{store})"


class TokenSelectionDecoder(Decoder):
    """``Decoder(model, TokenSelection(selector, budget, store=store))`` — calling it means what calling any
    ``Decoder`` means (the first call on an empty cache prefills) — with two checked steps: :meth:`prefill` (an empty
    cache only) and :meth:`decode` (a prefilled one only)."""

    def __init__(self, model: nn.Module, selector: TokenSelector, budget: int, *,
                 store: Optional[CompressionMethod] = None) -> None:
        super().__init__(model, TokenSelection(selector, budget, store=store))
        self.selector, self.budget = selector, int(budget)

    def prefill(self, input_ids: torch.Tensor, cache: SubsetCache, *, last_only: bool = False) -> torch.Tensor:
        """Exact causal forward of the prompt; every layer's K/V compressed into the (empty) ``cache``."""
        if isinstance(cache, SubsetCache) and (cache.seq_len != 0 or cache.position != 0):
            raise ValueError("prefill needs an empty cache (use new_cache() or cache.reset())")
        return Decoder.__call__(self, input_ids, cache, last_only=last_only)

    def decode(self, input_ids: torch.Tensor, cache: SubsetCache, *, last_only: bool = False) -> torch.Tensor:
        """Decode ``input_ids (B, T)`` (one token or a teacher-forced chunk) over the compressed cache."""
        if isinstance(cache, SubsetCache) and cache.position == 0:
            raise ValueError("decode needs a prefilled cache: call prefill() first")
        return Decoder.__call__(self, input_ids, cache, last_only=last_only)


def run_token_selection(model: nn.Module, idx: torch.Tensor, selector: TokenSelector, budget: int, *,
                        prompt_len: Optional[int] = None, decode_chunk: Optional[int] = None,
                        return_logits: bool = False, cache_dtype: Optional[torch.dtype] = None,
                        store: Optional[CompressionMethod] = None) -> TokenSelectionResult:
    """Prefill ``idx[:, :prompt_len]`` exactly, compress every layer's K/V to ``budget`` tokens per KV head, decode
    ``idx[:, prompt_len:-1]`` teacher-forced (chunks of ``decode_chunk``; default all at once — identical to one at a
    time since decoded tokens are kept exactly and the mask is bottom-right) and score ``idx[:, prompt_len:]``
    (:func:`kvsplice.decode.score_continuation`). ``prompt_len`` defaults to half the sequence; ``store``: the
    storage method of the kept tokens (default full keys/values)."""
    b, t = idx.shape
    p = t // 2 if prompt_len is None else int(prompt_len)
    if not 1 <= p < t:
        raise ValueError(f"prompt_len must be in [1, {t - 1}], got {p}")
    dec = TokenSelectionDecoder(model, selector, budget, store=store)
    nll, logits, cache = score_continuation(dec, idx, p, decode_chunk=decode_chunk, cache_dtype=cache_dtype)
    el = torch.empty((), dtype=cache.dtype).element_size()
    a = dec.adapter
    held = [min(t - 1, w - 1) if w else t - 1 for w in dec.windows]  # a full cache's tokens per layer (windows)
    full = 2 * sum(held) * b * a.n_kv_head * a.head_dim * el
    return TokenSelectionResult(nll=nll, ppl=math.exp(nll), n_scored=b * (t - p), prompt_len=p, budget=budget,
                                n_keep=min(budget, p), cache_nbytes=cache.nbytes(), full_nbytes=full, cache=cache,
                                logits=logits if return_logits else None)
