"""Layer-local correction of a converted attention layer: after the closed form, a few optimiser steps make each
layer's output match the source layer's on calibration activations.

The closed form fits keys and values (weighted by what attention does with them) one linear map at a time; the
softmax between them is not linear. Here the converted layer runs on the source layer's own inputs ``x`` and
its latent maps (``w_dkv``, ``w_uk``, ``w_uv``) move to minimise ``‖attn(x) − y‖² / ‖y‖²``, ``y`` the source
layer's attention output. Every layer is corrected alone (no backward through the model), so it costs a few
attention forwards and backwards per layer: minutes on a CPU for a 135M model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

__all__ = ["REFINED", "RefineResult", "refine_attention"]

REFINED = ("w_dkv", "w_uk", "w_uv")
"""The converted layer's maps the correction trains (the latent's; queries, RoPE maps and outputs stay the
source's)."""


@dataclass
class RefineResult:
    """Relative output error of one layer on its calibration windows before and after the correction."""

    before: float
    after: float


def _relative_error(attn: nn.Module, xs: Sequence[torch.Tensor], ys: Sequence[torch.Tensor]) -> float:
    with torch.no_grad():
        num = sum(float(((attn(x) - y) ** 2).sum()) for x, y in zip(xs, ys))
        return num / max(sum(float((y ** 2).sum()) for y in ys), 1e-30)


def refine_attention(attn: nn.Module, xs: Sequence[torch.Tensor], ys: Sequence[torch.Tensor], *, steps: int,
                     lr: float = 3e-4) -> RefineResult:
    """Train ``attn``'s :data:`REFINED` maps for ``steps`` Adam steps (one window ``x`` ``(1, T, d)`` a step, in
    turn) towards the outputs ``ys``; the weights are left as trained, the other parameters untouched."""
    params = [p for name in REFINED for p in getattr(attn, name).parameters()]
    dtype = params[0].dtype
    xs = [x.to(dtype) for x in xs]
    ys = [y.to(dtype) for y in ys]
    before = _relative_error(attn, xs, ys)
    if steps <= 0 or not xs:
        return RefineResult(before, before)
    flags = {p: p.requires_grad for p in attn.parameters()}
    for p in attn.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=lr)
    try:
        for step in range(steps):
            x, y = xs[step % len(xs)], ys[step % len(xs)]
            loss = ((attn(x) - y) ** 2).sum() / (y ** 2).sum().clamp_min(1e-30)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    finally:
        for p, flag in flags.items():
            p.requires_grad_(flag)
            p.grad = None
    return RefineResult(before, _relative_error(attn, xs, ys))
