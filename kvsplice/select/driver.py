"""Token selection on pretrained models: exact prefill, per-KV-head compression into a subset cache, weighted decode.

:class:`TokenSelectionDecoder` drives any model :func:`kvsplice.lowrank.apply.family_adapter` supports — HF
``GPT2LMHeadModel``, HF ``LlamaForCausalLM`` (GQA + RoPE) and our ``models.GPT`` (MHA) — through its own submodules
(embeddings, norms, MLPs, rotary tables, LM head) and does the attention itself with
:func:`models.attention.attend`::

    dec = TokenSelectionDecoder(model, make_selector("balancekv"), budget=256)
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
* Positions: a token decoded after a compressed prefill sits at absolute position ``cache.n_seen`` (tokens the
  sequence has), **not** ``cache.seq_len`` (tokens held). RoPE angles and GPT-2's learned position embeddings both
  use ``n_seen``; the kept keys were rotated at their original positions before compression, so relative positions
  are exactly those of the uncompressed sequence.

With ``budget >= prompt length`` every selector keeps every token with log-weight 0 and the decoder reproduces the
model's own logits (tested to 1e-4 against HF for tiny random GPT-2 and GQA Llama).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from kvsplice.lowrank.apply import _heads, _merge, family_adapter
from kvsplice.select.cache import SubsetCache, TokenSelectionResult, weighted_attend
from kvsplice.select.selectors import TokenSelector
from models.attention import attend

__all__ = ["TokenSelectionDecoder", "run_token_selection"]


class TokenSelectionDecoder:
    """Exact prefill + compressed K/V (one selection per sequence and KV head) + weighted-attention decode.

    ``selector`` is a :class:`~kvsplice.select.selectors.TokenSelector`; ``budget`` the prefill tokens kept per KV head
    (``min(budget, prompt length)``). Inference only (no dropout, no gradients); attention runs on SDPA (the
    additive log-weights need it).
    """

    def __init__(self, model: nn.Module, selector: TokenSelector, budget: int) -> None:
        if budget < 1:
            raise ValueError(f"budget must be >= 1, got {budget}")
        self.model = model
        self.fam = family_adapter(model)
        self.family = self.fam.name
        self.selector, self.budget = selector, int(budget)
        p = self.fam.param()
        self.dtype, self.device = p.dtype, p.device
        self.scales = [self.fam.scale(l) for l in range(self.fam.n_layer)]
        self.n_layer, self.n_head, self.n_kv_head = self.fam.n_layer, self.fam.n_head, self.fam.n_kv_head
        self.head_dim = self.fam.head_dim

    # ------------------------------------------------------------------------------------------------ cache
    def new_cache(self, batch_size: int, capacity: Optional[int] = None, *,
                  dtype: Optional[torch.dtype] = None) -> SubsetCache:
        """An empty :class:`SubsetCache` (``capacity``: tokens held per layer, for an exact preallocation)."""
        return SubsetCache(self.n_layer, self.n_kv_head, self.head_dim, batch_size, dtype=dtype or self.dtype,
                           device=self.device, capacity=capacity)

    def bytes_formula(self, batch_size: int, n_held: int, dtype: Optional[torch.dtype] = None) -> int:
        return SubsetCache.bytes_formula(self.n_layer, batch_size, self.n_kv_head, self.head_dim, self.head_dim,
                                         n_held, dtype or self.dtype)

    # ---------------------------------------------------------------------------------------------- helpers
    def _check(self, ids: torch.Tensor, cache: SubsetCache) -> tuple[int, int]:
        if ids.dim() != 2 or ids.shape[1] < 1:
            raise ValueError(f"input_ids must be (B, T) with T >= 1, got shape {tuple(ids.shape)}")
        if not isinstance(cache, SubsetCache):
            raise TypeError(f"TokenSelectionDecoder needs a SubsetCache from new_cache(), got {type(cache).__name__}")
        b, t = ids.shape
        self.fam.check_room(cache.batch_size, cache.n_seen, b, t)  # positions continue from n_seen
        return b, t

    def _rope(self, x: torch.Tensor, start: int, t: int):
        if not self.fam.has_rope:
            return None
        return self.fam.rope_tables(x, torch.arange(start, start + t, device=x.device))  # cos, sin (1, T, D)

    def _qkv(self, l: int, h: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        P = self.fam.proj(l)
        q = _heads(F.linear(h, P.wq, P.bq), self.n_head)
        k = _heads(F.linear(h, P.wk, P.bk), self.n_kv_head)
        v = _heads(F.linear(h, P.wv, P.bv), self.n_kv_head)
        if rope is not None:
            q, k = self.fam.rotate_qk(q, k, rope[0], rope[1])  # post-RoPE: keys rotated at their true positions
        return q, k, v

    def _out(self, l: int, z: torch.Tensor) -> torch.Tensor:
        P = self.fam.proj(l)
        return F.linear(_merge(z), P.wo, P.bo)

    # ---------------------------------------------------------------------------------------------- forward
    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, cache: SubsetCache, *, last_only: bool = False) -> torch.Tensor:
        """Exact causal forward of the prompt; every layer's K/V compressed into the (empty) ``cache``.
        Returns the prompt's logits ``(B, T, V)`` (``last_only``: ``(B, 1, V)``)."""
        b, t = self._check(input_ids, cache)
        if cache.seq_len != 0 or cache.n_seen != 0:
            raise ValueError("prefill needs an empty cache (use new_cache() or cache.reset())")
        x = self.fam.embed(input_ids, 0)
        rope = self._rope(x, 0, t)
        for l in range(self.n_layer):
            q, k, v = self._qkv(l, self.fam.attn_in(l, x), rope)
            y = attend(q, k, v, scale=self.scales[l], backend="sdpa")  # full attention over the prompt
            cache.compress_prefill(l, k.to(cache.dtype), v.to(cache.dtype), self.selector, self.budget)
            x = self.fam.after_attn(l, x, self._out(l, y))
        return self.fam.head(x[:, -1:] if last_only else x)

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, cache: SubsetCache, *, last_only: bool = False) -> torch.Tensor:
        """Decode ``input_ids (B, T)`` (one token or a teacher-forced chunk) over the compressed cache; the new
        tokens are appended exactly. Positions start at ``cache.n_seen``."""
        b, t = self._check(input_ids, cache)
        if cache.n_seen == 0:
            raise ValueError("decode needs a prefilled cache: call prefill() first")
        start = cache.n_seen  # absolute position of the first new token (not cache.seq_len: tokens were dropped)
        x = self.fam.embed(input_ids, start)
        rope = self._rope(x, start, t)
        for l in range(self.n_layer):
            q, k, v = self._qkv(l, self.fam.attn_in(l, x), rope)
            kv = cache.append(l, k=k.to(cache.dtype), v=v.to(cache.dtype))
            y = weighted_attend(q, kv["k"], kv["v"], kv["w"], scale=self.scales[l]).to(x.dtype)
            x = self.fam.after_attn(l, x, self._out(l, y))
        return self.fam.head(x[:, -1:] if last_only else x)

    decode = __call__

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
                 top_k: Optional[int] = None, generator: Optional[torch.Generator] = None) -> torch.Tensor:
        """Prefill ``idx`` (compressed), then sample ``max_new_tokens`` one at a time (greedy by default)."""
        from models.gpt import sample_next

        if max_new_tokens <= 0:
            return idx
        cache = self.new_cache(idx.shape[0], capacity=min(self.budget, idx.shape[1]) + max_new_tokens - 1)
        logits = self.prefill(idx, cache, last_only=True)[:, -1]
        out = [idx]
        for step in range(max_new_tokens):
            nxt = sample_next(logits, temperature, top_k, generator)
            out.append(nxt)
            if step + 1 < max_new_tokens:
                logits = self(nxt, cache)[:, -1]
        return torch.cat(out, dim=1)

    def __repr__(self) -> str:
        return f"TokenSelectionDecoder({self.family}, {self.selector!r}, budget={self.budget})"


@torch.no_grad()
def run_token_selection(model: nn.Module, idx: torch.Tensor, selector: TokenSelector, budget: int, *,
                        prompt_len: Optional[int] = None, decode_chunk: Optional[int] = None,
                        return_logits: bool = False,
                        cache_dtype: Optional[torch.dtype] = None) -> TokenSelectionResult:
    """Prefill ``idx[:, :prompt_len]`` exactly, compress every layer's K/V to ``budget`` tokens per KV head, decode
    ``idx[:, prompt_len:-1]`` teacher-forced (chunks of ``decode_chunk``; default all at once — identical to one at a
    time since decoded tokens are kept exactly and the mask is bottom-right) and score ``idx[:, prompt_len:]``.
    The first continuation token is predicted by the exact prefill. ``prompt_len`` defaults to half the sequence.
    Same result type as :func:`kvsplice.select.cache.run_with_token_selection` (which drives our MHA GPT only)."""
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
    nll = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), idx[:, p:].reshape(-1)).item()
    el = torch.empty((), dtype=cache.dtype).element_size()
    full = 2 * dec.n_layer * b * dec.n_kv_head * (t - 1) * dec.head_dim * el
    return TokenSelectionResult(nll=nll, ppl=math.exp(nll), n_scored=b * (t - p), prompt_len=p, budget=budget,
                                n_keep=n_keep, cache_nbytes=cache.nbytes(), full_nbytes=full, cache=cache,
                                logits=logits if return_logits else None)
