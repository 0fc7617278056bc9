"""The one layer-wise decoder every compression method plugs into.

::

    dec = Decoder(model, LowRank(bases))               # HF GPT-2, HF Llama (GQA + RoPE) or models.GPT
    cache = dec.new_cache(batch_size=1)
    logits = dec(prompt_ids, cache)                    # prefill (B, T, V): appends T tokens
    logits = dec(next_ids, cache)                      # decode one token (or a chunk of several)
    out = dec.generate(prompt_ids, max_new_tokens=20)  # greedy by default (models.generate.generate_tokens)
    ppl = perplexity(dec, ids)                         # every token attends over the (compressed) cache

Per call the decoder embeds the new tokens at ``cache.position`` (the next absolute position, also after a method
dropped tokens), builds the RoPE tables once, and per layer runs the model's norm, the method's attention block
(:meth:`~kvsplice.core.method.CompressionMethod.block`: the layer's q/k/v projected and rotated with the model's
weights, the method's :meth:`~kvsplice.core.method.CompressionMethod.attend` — the same function the HF door calls —
and the output projection) and the model's residual + MLP; then the LM head. A sliding-window layer runs the
method's ``for_window`` variant with a window mask and keeps only its last ``window - 1`` tokens
(:mod:`kvsplice.core.window`). Inference only: no dropout, no gradients. ``method=None`` is the model's own cache:
``ModelAttention`` for ``models.GPT`` (MHA / MLA / KVSplice), ``DenseKV`` (full K/V) for HF models. The decoder holds
``method.bind(...)``, a copy prepared for this model: the method passed in stays unbound and can serve other models.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from kvsplice.adapters.registry import adapter_for
from kvsplice.core.limits import check_fits
from kvsplice.core.method import CompressionMethod, Step
from kvsplice.core.build import build_method
from kvsplice.core.window import check_evictable, evict, held_per_layer, window_mask
from kvsplice.decode.dense import DenseKV
from kvsplice.decode.native import OWN_ATTENTION, ModelAttention
from models.cache import Cache
from models.generate import check_prompt, check_sampling, generate_tokens
from models.kernels import DEFAULT_DECODE_KERNEL, resolve_decode_kernel

__all__ = ["Decoder", "chunked_nll", "perplexity", "score_continuation", "sequence_nll"]

BACKENDS = ("auto", "flash", "sdpa")


class Decoder:
    """Prefill / decode ``model`` with ``method``; ``dec(input_ids (B, T), cache) -> logits (B, T, V)``
    (``last_only=True``: only the last position's, ``(B, 1, V)``).

    ``decode_kernel``: whether one-token steps of the methods that hold rows (``DenseKV``, ``LowRank``'s
    coefficients, what a ``TokenSelection`` keeps, int8 included) run the split-KV Triton kernel
    (:mod:`models.kernels`): ``auto`` on CUDA with triton installed, ``triton`` always (CPU: Triton's interpreter),
    ``eager`` never. Resolved once, here. A ``models.GPT`` decodes through its own attention (``cfg.decode_kernel``)."""

    def __init__(self, model: nn.Module, method: Optional[CompressionMethod | str | dict] = None, *,
                 attn_backend: str = "auto", decode_kernel: str = DEFAULT_DECODE_KERNEL) -> None:
        if attn_backend not in BACKENDS:
            raise ValueError(f"attn_backend must be one of {BACKENDS}, got {attn_backend!r}")
        self.decode_kernel, self.kernel_on = decode_kernel, resolve_decode_kernel(decode_kernel)  # once
        self.model = model
        self.adapter = adapter_for(model)
        if method is None:
            method = ModelAttention() if self.adapter.name in OWN_ATTENTION else DenseKV()
        if isinstance(method, (str, dict)):  # a spec: kvsplice.core.build
            method = build_method(method)
        if not isinstance(method, CompressionMethod):
            raise TypeError(f"method must be a kvsplice.decode.CompressionMethod, got {type(method).__name__}")
        self.attn_backend = attn_backend
        p = self.adapter.param()
        self.dtype, self.device = p.dtype, p.device
        self.method = method.bind(self.adapter, dtype=self.dtype, device=self.device)  # a prepared copy
        self.windows = [self.adapter.window(l) for l in range(self.adapter.n_layer)]
        self.layer_methods = [self.method.for_window(w) if w else self.method for w in self.windows]
        self.scales = [self.adapter.scale(l) for l in range(self.adapter.n_layer)] \
            if method.needs_projections else []

    @property
    def family(self) -> str:
        return self.adapter.name

    # ---------------------------------------------------------------------------------------------- cache
    def new_cache(self, batch_size: int, capacity: Optional[int] = None, *, dtype: Optional[torch.dtype] = None,
                  device=None) -> Cache:
        """An empty cache of the method; dtype / device default to the model's, ``capacity`` preallocates."""
        cache = self.method.new_cache(batch_size, capacity, dtype=dtype or self.dtype, device=device or self.device)
        check_evictable(cache, self.windows)
        return cache

    def held(self, cache: Cache):
        """Tokens ``cache`` holds per layer as ``bytes_formula`` takes them: ``seq_len``, or a list per layer for a
        model with sliding-window layers."""
        return held_per_layer(cache) if any(self.windows) else cache.seq_len

    def formula_nbytes(self, cache: Cache) -> Optional[int]:
        """The method's ``bytes_formula`` for what ``cache`` holds (``None``: no closed form) — equal to
        ``cache.nbytes()``. (This door holds no cache of its own: it takes the one it runs.)"""
        return self.method.bytes_formula(cache.batch_size, self.held(cache), cache.dtype)

    # -------------------------------------------------------------------------------------------- forward
    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, cache: Cache, *, last_only: bool = False) -> torch.Tensor:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[1] < 1:
            shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
            raise ValueError(f"input_ids must be (B, T) with T >= 1, got shape {shape}")
        input_ids = input_ids.to(self.device)  # token ids made on the CPU (text windows, tasks) meet a CUDA model
        b, t = input_ids.shape
        self.method.check_cache(cache)
        a = self.adapter
        start = cache.position  # absolute position of the first new token
        a.check_room(cache.batch_size, start, b, t)
        x = a.embed(input_ids, start)  # (B, T, d_model)
        step = Step(a, start, t, self.scales, self.attn_backend, a.rope(x, start, t),  # rope: None without RoPE
                    k_rotated=self.method.key_rope != "pre", decode_kernel=self.decode_kernel,
                    kernel_on=self.kernel_on)  # pre-RoPE storage gets its keys un-rotated
        for layer, (method, w) in enumerate(zip(self.layer_methods, self.windows)):
            mask = None if w is None else window_mask(start, t, cache.layer_len(layer) + t, w, x.device)
            x = a.after_attn(layer, x, method.block(layer, a.attn_in(layer, x), cache, step, mask=mask))
            if w is not None:
                evict(cache, layer, w - 1)  # the next token sees only the last w - 1 of them
        return a.head(x[:, -1:] if last_only else x)

    forward = __call__

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
                 top_k: Optional[int] = None, generator: Optional[torch.Generator] = None) -> torch.Tensor:
        """Prefill ``idx (B, T)`` into a fresh cache, then decode ``max_new_tokens`` one at a time from it
        (``temperature=0``: greedy). Returns ``(B, T + max_new_tokens)``."""
        check_sampling(max_new_tokens, temperature, top_k)
        check_prompt(idx, self.adapter.param().shape[0])
        self.check_generate_size(idx.shape[0], idx.shape[1], max_new_tokens)
        cache = self.new_cache(idx.shape[0], capacity=self.method.capacity(idx.shape[1], max_new_tokens))
        step = lambda ids, c: Decoder.__call__(self, ids, c, last_only=True)  # noqa: E731  (prefill, then decode)
        return generate_tokens(step, cache, idx, max_new_tokens, temperature, top_k, generator)

    def check_generate_size(self, batch: int, prompt_len: int, max_new_tokens: int) -> None:
        """Refuse, before the cache is allocated, a generation longer than the model's positions or whose cache
        (the method's closed form, when it has one) exceeds the memory free on the model's device."""
        total = prompt_len + int(max_new_tokens)
        mp = self.adapter.max_positions
        if mp is not None and total > mp:
            raise ValueError(f"max_new_tokens={max_new_tokens}: a prompt of {prompt_len} tokens + {max_new_tokens} "
                             f"new exceeds the model's {mp} positions")
        capacity = self.method.capacity(prompt_len, max_new_tokens)
        windows = [min(w, capacity) if w else capacity for w in self.windows] if any(self.windows) else capacity
        nbytes = self.method.bytes_formula(batch, windows, self.dtype)
        if nbytes is not None:
            check_fits(f"max_new_tokens={max_new_tokens}", nbytes, f"a cache of {capacity} tokens", self.device)

    def __repr__(self) -> str:
        return f"Decoder({self.family}, {self.method!r})"


@torch.no_grad()
def chunked_nll(decoder: Decoder, input_ids: torch.Tensor, chunk_size: Optional[int] = None
                ) -> tuple[float, int, Cache]:
    """:func:`sequence_nll` and the cache it filled (to measure): the one chunked next-token NLL loop."""
    input_ids = input_ids.to(decoder.device)  # (B, T) on the model's device: the targets meet its logits
    b, t = input_ids.shape
    cache = decoder.new_cache(b, capacity=t)
    step = t if chunk_size is None else int(chunk_size)
    if step < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    total = 0.0
    for s in range(0, t, step):
        logits = decoder(input_ids[:, s:s + step], cache).float()  # (B, c, V)
        tgt = input_ids[:, s + 1:s + step + 1]  # next tokens (the last chunk predicts one fewer)
        if tgt.numel():
            logits = logits[:, :tgt.shape[1]]
            # (B·c, V) logits vs (B·c,) targets
            total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), reduction="sum").item()
    return total, b * (t - 1), cache


def sequence_nll(decoder: Decoder, input_ids: torch.Tensor, chunk_size: Optional[int] = None
                 ) -> tuple[float, int]:
    """Summed next-token NLL of ``input_ids (B, T)`` and the number of predicted tokens, feeding the sequence
    through a fresh cache of the decoder in chunks of ``chunk_size`` (None: one prefill call; 1: token by token).
    Every token attends over the decoder's cache (compressed or full), so full vs compressed is apples to apples."""
    total, n, _ = chunked_nll(decoder, input_ids, chunk_size)
    return total, n


def perplexity(decoder: Decoder, input_ids: torch.Tensor, chunk_size: Optional[int] = None) -> float:
    """``exp`` of the mean next-token NLL (see :func:`sequence_nll`)."""
    total, n = sequence_nll(decoder, input_ids, chunk_size)
    return math.exp(total / max(n, 1))


@torch.no_grad()
def score_continuation(decoder: Decoder, idx: torch.Tensor, prompt_len: int, *, decode_chunk: Optional[int] = None,
                       cache_dtype: Optional[torch.dtype] = None, kept=None) -> tuple[float, torch.Tensor, Cache]:
    """Prefill ``idx[:, :prompt_len]`` into a fresh cache (exact for a token selection, which compresses it then),
    decode ``idx[:, prompt_len:-1]`` teacher-forced in chunks of ``decode_chunk`` (default: all at once) and score
    ``idx[:, prompt_len:]``: the first continuation token is predicted by the prefill's last position. ``kept``: the
    full cache's kept exact prefill of that prompt (:class:`kvsplice.select.replay.Kept`), replayed into a token
    selection's cache instead of a prefill of its own.

    Returns ``(mean NLL, logits (B, T - prompt_len, V), cache)``; the model is in eval mode for the call."""
    b, t = idx.shape
    p = int(prompt_len)
    if not 1 <= p < t:
        raise ValueError(f"prompt_len must be in [1, {t - 1}], got {prompt_len}")
    method, model = decoder.method, decoder.model
    idx = idx.to(decoder.device)  # (B, T) on the model's device: the targets below meet its logits
    cache = decoder.new_cache(b, capacity=method.capacity(p, t - p), dtype=cache_dtype)
    was_training = model.training
    model.eval()
    try:
        if kept is None:
            logits = [Decoder.__call__(decoder, idx[:, :p], cache, last_only=True)]
        else:
            kept.replay(decoder, cache)
            logits = [kept.logits.to(decoder.device)]
        step = decode_chunk or max(1, t - 1 - p)
        for s0 in range(p, t - 1, step):
            logits.append(Decoder.__call__(decoder, idx[:, s0:min(t - 1, s0 + step)], cache))
    finally:
        model.train(was_training)
    out = torch.cat(logits, dim=1)  # (B, t - p, V)
    # (B·(t-p), V) logits vs (B·(t-p),) targets
    nll = F.cross_entropy(out.float().reshape(-1, out.shape[-1]), idx[:, p:].reshape(-1)).item()
    return nll, out, cache
