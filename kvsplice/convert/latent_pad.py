"""Zero-pad a DeepSeek-V3 export's cache row, exactly: the latent (``kv_lora_rank``) from ``r`` to ``P`` dims *through*
its RMSNorm, and the RoPE key (``qk_rope_head_dim``) from ``Dr`` to ``Dr'`` dims without changing its frequencies.

Why: vLLM's MLA backends take ``kv_lora_rank + qk_rope_head_dim`` of 320, 512 or 576 only, and its CPU decode kernel
(``csrc/cpu/mla_decode.cpp``) exactly ``kv_lora_rank = 512`` and ``qk_rope_head_dim = 64`` (it dispatches on
``head_dim == 576 && v_head_dim == 512``, the latent being the value), so a model whose latent is 6, 26 or 128 dims
and whose RoPE key is 8 or 16 dims is served only with a wider row (docs/conversion.md, "vLLM").

**Latent.** The rule, per layer (``s = W_down x``, the ``r``-dim latent before ``kv_a_layernorm``, whose weight is
``w``)::

    W_down' = [a · W_down ; 0]        (P, d)   a = sqrt(P / r)
    w'      = [w / a      ; 0]        (P,)
    W_b'    = [W_b        , 0]        (·, P)   kv_b_proj: zero columns

Exactness: the padded latent is ``s' = [a s ; 0]``, so ``mean_P(s'²) = a² · (r/P) · mean_r(s²) = mean_r(s²)``: the
RMS the norm divides by — and so the ``eps`` added to it — is the unpadded one, and ``norm(s')`` is
``[a s / sqrt(mean_r(s²) + ε) · w / a ; 0] = [norm(s) ; 0]``. ``kv_b_proj``'s zero columns read nothing from the
padded dims. Every engine thus computes the unpadded model; only the float rounding of ``× a`` and ``/ a`` differs
(≈1e-7 relative in fp32). Plain zero-padding (``a = 1``) is *not* exact: the RMS is taken over ``P`` dims, i.e.
``sqrt(r/P)`` times the true one, and ``eps`` weighs ``P/r`` times more — for ``r = 6, P = 512`` every latent is
scaled by ``sqrt(512/6) ≈ 9.2``.

**RoPE key.** DeepSeek's RoPE (interleaved, ``rope_interleave: true``) rotates pair ``j`` (dims ``2j, 2j + 1``) of
``q_rope`` and ``k_rope`` by ``pos · θ^(-2j/Dr)``. With ``Dr' = k · Dr`` and the same ``θ``, pair ``k·i`` of the
padded key turns at ``θ^(-2ki/(k Dr)) = θ^(-2i/Dr)``, the frequency of pair ``i`` of the model:
:func:`spread_rope_rows` moves pair ``i`` of the ``q_rope`` / ``k_rope`` projection rows to pair ``k·i`` and leaves the other pairs zero (a
rotated zero is zero), so every ``q_rope · k_rope`` is unchanged. The softmax scale is ``(qk_nope + qk_rope)^-½`` in
DeepSeek-V3, so the padded export multiplies ``q_proj`` by ``sqrt((hs + Dr') / (hs + Dr))``
(:func:`softmax_scale_fold`), which makes every score the model's again.

The padded dims cost cache memory: the engine caches ``P + Dr'`` numbers per token and layer instead of ``r + Dr``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["MAX_PAD_LATENT", "MAX_PAD_ROPE", "check_bounds", "pad_columns", "pad_normed_latent", "padded_latent", "padded_rope", "padded_row", "softmax_scale_fold",
           "spread_rope_rows"]


MAX_PAD_LATENT = 4096
"""Largest ``--pad-latent`` (above a latent already wider): 8× the 512 an engine asks for (vLLM's CPU MLA kernel);
a padded latent costs its cache row in every engine, and a typo (``1000000000``) would ask for terabytes."""
MAX_PAD_ROPE = 1024
"""Largest ``--pad-rope`` (above a RoPE key already wider): 16× the 64 an engine asks for."""


def _check_int(value, option: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{option} {value!r} must be a whole number")
    return value


def check_bounds(pad_latent: int | None, pad_rope: int | None) -> None:
    """ValueError (one line) for a pad beyond :data:`MAX_PAD_LATENT` / :data:`MAX_PAD_ROPE` — checkable before the
    model is at hand (a command refuses it before any work); the model's own dims: :func:`padded_row`."""
    if pad_latent is not None:
        padded_latent(1, pad_latent)
    if pad_rope is not None and _check_int(pad_rope, "--pad-rope") > MAX_PAD_ROPE:
        padded_rope(1, pad_rope)


def padded_latent(rank: int, pad_latent: int | None) -> int:
    """The exported ``kv_lora_rank``: ``rank``, or ``pad_latent`` when given (ValueError, one line, if smaller than
    ``rank`` or larger than ``max(rank, MAX_PAD_LATENT)``)."""
    if pad_latent is None:
        return rank
    pad_latent = _check_int(pad_latent, "--pad-latent")
    if pad_latent < rank:
        raise ValueError(f"--pad-latent {pad_latent} is smaller than the latent ({rank})")
    if pad_latent > max(rank, MAX_PAD_LATENT):
        raise ValueError(f"--pad-latent {pad_latent} is larger than {MAX_PAD_LATENT} (engines ask for 512; every "
                         f"padded dim is cached per token and layer)")
    return int(pad_latent)


def padded_row(rank: int, rope_dims: int, pad_latent: int | None, pad_rope: int | None) -> tuple[int, int]:
    """The exported ``(kv_lora_rank, qk_rope_head_dim)`` of a cache row of ``rank`` latent + ``rope_dims`` RoPE
    numbers: :func:`padded_latent` and :func:`padded_rope` (ValueError, one line, for a size they refuse)."""
    return padded_latent(rank, pad_latent), padded_rope(rope_dims, pad_rope)


def pad_normed_latent(down: torch.Tensor, norm_weight: torch.Tensor, padded: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(W_down', w')`` of the module docstring: ``down`` (r, d) and ``norm_weight`` (r,) padded to ``padded`` rows,
    the rows scaled by ``a = sqrt(padded / r)`` and the norm weight by ``1 / a``: the RMSNorm's output is unchanged."""
    r = down.shape[0]
    if norm_weight.shape != (r,):
        raise ValueError(f"the latent norm's weight {tuple(norm_weight.shape)} does not match the latent ({r})")
    a = math.sqrt(padded_latent(r, padded) / r)
    zeros = down.new_zeros(padded - r, down.shape[1])
    return torch.cat([down * a, zeros]), F.pad(norm_weight / a, (0, padded - r))  # (P, d), (P,)


def pad_columns(w: torch.Tensor, padded: int) -> torch.Tensor:
    """``w`` (..., r) with zero columns appended to ``padded`` (``kv_b_proj``: nothing read from the padded dims)."""
    return F.pad(w, (0, padded_latent(w.shape[-1], padded) - w.shape[-1]))


def padded_rope(rope_dims: int, pad_rope: int | None) -> int:
    """The exported ``qk_rope_head_dim``: ``rope_dims``, or ``pad_rope`` (a multiple of it, at most
    ``max(rope_dims, MAX_PAD_ROPE)``; ValueError, one line)."""
    if pad_rope is None:
        return rope_dims
    pad_rope = _check_int(pad_rope, "--pad-rope")
    if pad_rope > max(rope_dims, MAX_PAD_ROPE):
        raise ValueError(f"--pad-rope {pad_rope} is larger than {MAX_PAD_ROPE} (engines ask for 64; every padded "
                         f"dim is cached per token and layer)")
    if pad_rope < rope_dims or pad_rope % rope_dims:
        raise ValueError(f"--pad-rope {pad_rope} must be a multiple of the RoPE key ({rope_dims}) so that its "
                         f"frequencies stay the model's")
    return int(pad_rope)


def spread_rope_rows(w: torch.Tensor, padded: int) -> torch.Tensor:
    """RoPE projection rows ``w`` (..., Dr, d) in interleaved pairs, spread to (..., ``padded``, d): pair ``i`` moves
    to pair ``i · padded / Dr`` (same frequency at the same ``θ``, module docstring), every other row zero."""
    dr = w.shape[-2]
    k = padded_rope(dr, padded) // dr
    out = w.new_zeros(*w.shape[:-2], dr // 2, k, 2, w.shape[-1])  # (..., Dr/2 pairs, k slots, 2, d)
    out[..., :, 0, :, :] = w.unflatten(-2, (dr // 2, 2))  # pair i -> slot 0 of group i = pair k·i
    return out.flatten(-4, -2)  # (..., Dr/2 · k · 2 = padded, d)


def softmax_scale_fold(head_dim: int, rope_dims: int, padded_rope: int) -> float:
    """Factor on ``q_proj`` keeping DeepSeek's ``(qk_nope + qk_rope)^-½`` scores when the RoPE key is padded."""
    return math.sqrt((head_dim + padded_rope) / (head_dim + rope_dims))
