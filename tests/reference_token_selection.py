"""An independent reference for token-selection decoding: an MHA ``models.GPT`` driven block by block from its own
submodules (``c_attn``, ``_attend``, ``c_proj``, MLP), not through the package's adapter and decoder — so the
tests can check :func:`kvsplice.select.method.run_token_selection` against a second implementation."""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from kvsplice.core.attention import weighted_attend
from kvsplice.select.cache import SubsetCache, TokenSelectionResult
from kvsplice.select.selectors import TokenSelector


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
