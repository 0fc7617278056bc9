"""Token-subset cache: a per-head subset of the prefill tokens with per-token log-weights, plus exact new tokens.

:class:`SubsetCache` is a :class:`~models.cache.DecodeCache` with three streams per layer — ``k (B, Hkv, T, d)``,
``v (B, Hkv, T, dv)`` and the log-weights ``w (B, Hkv, T, 1)``. Prefill is compressed once
(:meth:`SubsetCache.compress_prefill`: a :class:`~kvsplice.select.selectors.TokenSelector` picks per KV head on the
prefill keys/values); tokens appended afterwards are kept exactly with log-weight 0. ``nbytes()`` counts all three
streams: ``L·B·Hkv·n·(d + dv + 1)·bytes``.

Attention over the cache is :func:`weighted_attend`, ``softmax(q·Kᵀ·scale + logw)·V`` with the bottom-right causal
mask of :func:`models.attention.attend` — with ``logw = 0`` it *is* ``attend`` (tested), and with log-weights it is
the selectors' estimator ``Σ_i w_i e^{q·k_i·s} v_i / Σ_i w_i e^{q·k_i·s}``.

:func:`run_with_token_selection` drives an MHA :class:`models.GPT` layer by layer from its submodules: exact
full-attention prefill of the prompt, compression of every layer's K/V into the cache, then decode of the
continuation (teacher-forced, chunked) with weighted attention, scoring its perplexity.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from models.cache import DecodeCache
from kvsplice.select.selectors import TokenSelector
from models.attention import attend


# ---------------------------------------------------------------------------------------------- attention
def weighted_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, logw: Optional[torch.Tensor], *,
                    scale: float) -> torch.Tensor:
    """``softmax(q·Kᵀ·scale + logw)·V`` with :func:`models.attention.attend`'s layout and causal convention.

    q (B, Hq, Tq, D), k (B, Hkv, Tk, D), v (B, Hkv, Tk, Dv), logw (B, Hkv, Tk, 1) / (B, Hkv, Tk) / None,
    ``Hq % Hkv == 0`` (query head h reads KV head ``h // (Hq // Hkv)``); query ``i`` sits at key position
    ``Tk - Tq + i`` and sees keys ``<=`` it (the last ``Tq`` keys are the queries' own). → (B, Hq, Tq, Dv).
    Scores are formed in float32 at least.
    """
    if logw is not None and logw.dim() == 4:
        logw = logw.squeeze(-1)  # (B, Hkv, Tk)
    dt = torch.promote_types(q.dtype, torch.float32)
    y = attend(q.to(dt), k.to(dt), v.to(dt), scale=scale, backend="sdpa",
               bias=None if logw is None else logw.to(dt))  # (B, Hq, Tq, Dv)
    return y.to(q.dtype)


# -------------------------------------------------------------------------------------------------- cache
class SubsetCache(DecodeCache):
    """Per layer ``k (B, Hkv, T, d)``, ``v (B, Hkv, T, dv)``, ``w (B, Hkv, T, 1)`` (log-weights).

    ``seq_len`` is the tokens *held*; ``n_seen`` the tokens the sequence has (positions: the next token's absolute
    position is ``n_seen``, not ``seq_len``).
    """

    kind = "subset"

    def __init__(self, n_layer: int, n_kv_head: int, head_size: int, batch_size: int, *,
                 v_head_size: Optional[int] = None, **kw) -> None:
        dv = head_size if v_head_size is None else v_head_size
        spec = {"k": (n_kv_head, head_size), "v": (n_kv_head, dv), "w": (n_kv_head, 1)}
        super().__init__([spec] * n_layer, batch_size, **kw)
        self.n_kv_head, self.head_size, self.v_head_size = n_kv_head, head_size, dv
        self._seen = [0] * n_layer

    @staticmethod
    def bytes_formula(n_layer: int, batch_size: int, n_kv_head: int, head_size: int, v_head_size: int,
                      n_held: int, dtype: torch.dtype = torch.float32) -> int:
        """Bytes of ``n_held`` tokens per layer: ``L·B·Hkv·n·(d + dv + 1)·element_size``."""
        el = torch.empty((), dtype=dtype).element_size()
        return n_layer * batch_size * n_kv_head * n_held * (head_size + v_head_size + 1) * el

    @property
    def n_seen(self) -> int:
        return min(self._seen) if self._seen else 0

    def append(self, layer: int, **new: torch.Tensor) -> dict[str, torch.Tensor]:
        """Append tokens; ``w`` may be omitted (log-weight 0: kept exactly)."""
        if "w" not in new and "k" in new:
            kt = new["k"]
            new["w"] = torch.zeros(*kt.shape[:-1], 1, dtype=self.dtype, device=kt.device)
        out = super().append(layer, **new)
        self._seen[layer] += next(iter(new.values())).shape[-2]
        return out

    def compress_prefill(self, layer: int, k: torch.Tensor, v: torch.Tensor, selector: TokenSelector,
                         budget: int) -> dict[str, torch.Tensor]:
        """Select per sequence and KV head from the prefill ``k (B, Hkv, T, d)``, ``v (B, Hkv, T, dv)`` (one
        ``selector.select`` call on ``(B·Hkv, T, ·)``: every (sequence, head) row is an independent instance); store
        the kept keys/values and their log-weights. The layer must be empty. Returns the views after the append."""
        if self.layer_len(layer) != 0:
            raise ValueError(f"compress_prefill: layer {layer} already holds {self.layer_len(layer)} tokens")
        b, h, t = k.shape[:3]
        # heads are independent instances for every selector: fold the batch into the head axis, select once
        idx, logw = selector.select(k.reshape(b * h, t, -1), v.reshape(b * h, t, -1), budget)  # (B·Hkv, n_keep)
        n_keep = idx.shape[-1]
        idx = idx.to(k.device)
        kk = torch.gather(k.reshape(b * h, t, -1), 1, idx[..., None].expand(-1, -1, k.shape[-1]))
        vv = torch.gather(v.reshape(b * h, t, -1), 1, idx[..., None].expand(-1, -1, v.shape[-1]))
        out = super().append(layer, k=kk.reshape(b, h, n_keep, -1), v=vv.reshape(b, h, n_keep, -1),
                             w=logw.reshape(b, h, n_keep, 1).to(dtype=self.dtype, device=k.device))
        self._seen[layer] += t
        return out

    def reset(self) -> None:
        super().reset()
        self._seen = [0] * self.n_layer

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` held tokens per layer (``n_seen`` drops by as many tokens as are dropped)."""
        if not hasattr(DecodeCache, "truncate"):
            raise NotImplementedError("DecodeCache.truncate is not available")
        before = [self.layer_len(i) for i in range(self.n_layer)]
        super().truncate(n)
        self._seen = [s - (b - int(n)) for s, b in zip(self._seen, before)]


# ------------------------------------------------------------------------------------------------- driver
@dataclass
class TokenSelectionResult:
    nll: float  # mean next-token negative log-likelihood over the scored continuation tokens
    ppl: float
    n_scored: int  # B · (T - prompt_len)
    prompt_len: int
    budget: int
    n_keep: int  # prefill tokens held per head after compression
    cache_nbytes: int  # bytes the subset cache holds at the end (k, v, w; all layers)
    full_nbytes: int  # bytes a full K/V cache of the same tokens would hold
    cache: SubsetCache
    logits: Optional[torch.Tensor] = None  # (B, T - prompt_len, V): predictions for idx[:, prompt_len:]


def _qkv(attn, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    b, t, c = x.shape
    q, k, v = attn.c_attn(x).split(c, dim=2)
    return tuple(z.view(b, t, attn.n_head, attn.head_size).transpose(1, 2) for z in (q, k, v))  # (B, H, T, hs)


def _merge_heads(attn, y: torch.Tensor) -> torch.Tensor:
    b, h, t, hs = y.shape
    return attn.c_proj(y.transpose(1, 2).reshape(b, t, h * hs))


@torch.no_grad()
def run_with_token_selection(model, idx: torch.Tensor, selector: TokenSelector, budget: int, *,
                             prompt_len: Optional[int] = None, decode_chunk: Optional[int] = None,
                             return_logits: bool = False,
                             cache_dtype: Optional[torch.dtype] = None) -> TokenSelectionResult:
    """Prefill ``idx[:, :prompt_len]`` exactly, compress each layer's K/V to ``budget`` tokens per head with
    ``selector``, decode the rest with weighted attention, and score ``idx[:, prompt_len:]``.

    The first continuation token is predicted by the (exact) prefill's last position; each later one by the decode
    of its predecessor. Decoding is teacher-forced in chunks of ``decode_chunk`` tokens (default: the whole
    continuation at once — identical to one token at a time, since decoded tokens are kept exactly and the causal
    mask is bottom-right). ``prompt_len`` defaults to half the sequence. MHA models only.
    """
    cfg = model.cfg
    if cfg.attention != "mha":
        raise ValueError(f"run_with_token_selection drives MHA models; got attention={cfg.attention!r}")
    b, t = idx.shape
    p = t // 2 if prompt_len is None else int(prompt_len)
    if not 1 <= p < t:
        raise ValueError(f"prompt_len must be in [1, {t - 1}], got {p}")
    if t > cfg.block_size:
        raise ValueError(f"sequence of {t} tokens exceeds block_size={cfg.block_size}")
    tr = model.transformer
    h = tr.h
    dtype = cache_dtype or tr.wte.weight.dtype
    n_keep = min(budget, p)
    cache = SubsetCache(cfg.n_layer, cfg.n_head, cfg.head_size, b, dtype=dtype, device=idx.device,
                        capacity=n_keep + (t - 1 - p))
    was_training = model.training
    model.eval()
    try:
        # ---- exact prefill, compressing each layer's K/V as it goes
        x = tr.wte(idx[:, :p]) + tr.wpe(torch.arange(p, device=idx.device))
        for i, block in enumerate(h):
            a = block.attn
            q, k, v = _qkv(a, block.ln_1(x))
            y = a._attend(q, k, v)  # the model's own full causal attention (attend)
            cache.compress_prefill(i, k, v, selector, budget)
            x = x + _merge_heads(a, y)
            x = x + block.mlp(block.ln_2(x))
        logits = [model.lm_head(tr.ln_f(x[:, -1:]))]  # (B, 1, V)
        # ---- decode the continuation (inputs idx[:, p : t-1]) with weighted attention
        step = decode_chunk or max(1, t - 1 - p)
        for s0 in range(p, t - 1, step):
            s1 = min(t - 1, s0 + step)
            x = tr.wte(idx[:, s0:s1]) + tr.wpe(torch.arange(s0, s1, device=idx.device))
            for i, block in enumerate(h):
                a = block.attn
                q, k, v = _qkv(a, block.ln_1(x))
                kv = cache.append(i, k=k.to(dtype), v=v.to(dtype))
                y = weighted_attend(q, kv["k"], kv["v"], kv["w"], scale=a.scale)
                x = x + _merge_heads(a, y)
                x = x + block.mlp(block.ln_2(x))
            logits.append(model.lm_head(tr.ln_f(x)))
    finally:
        model.train(was_training)
    logits = torch.cat(logits, dim=1)  # (B, t - p, V)
    nll = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), idx[:, p:].reshape(-1)).item()
    el = torch.empty((), dtype=dtype).element_size()
    full = 2 * cfg.n_layer * b * cfg.n_head * (t - 1) * cfg.head_size * el
    return TokenSelectionResult(nll=nll, ppl=math.exp(nll), n_scored=b * (t - p), prompt_len=p, budget=budget,
                                n_keep=n_keep, cache_nbytes=cache.nbytes(), full_nbytes=full, cache=cache,
                                logits=logits if return_logits else None)


__all__ = ["SubsetCache", "TokenSelectionResult", "run_with_token_selection", "weighted_attend"]
