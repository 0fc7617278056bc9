"""The one generation loop: prefill a prompt into a fresh cache, then sample one token at a time from the cache.

Every decoder of the package (``GPT.generate``, :class:`kvsplice.decode.Decoder` with any compression method) calls
:func:`generate_tokens` with its own ``step(ids, cache) -> logits`` and cache; the loop and the argument checks are
written once, here.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from models.stream_cache import DecodeCache

DecodeStep = Callable[[torch.Tensor, DecodeCache], torch.Tensor]
"""``step(ids (B, T), cache) -> logits (B, T', V)``: appends ``ids`` to ``cache``; the last row predicts next."""


MAX_TEMPERATURE = 100.0
"""Above it every token is drawn uniformly to float precision (logits span ~50): a typo, not a setting."""


def check_temperature(temperature: float) -> float:
    """A sampling temperature is a number in [0, :data:`MAX_TEMPERATURE`] (0 = greedy); NaN or inf would sample
    noise."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not math.isfinite(temperature) \
            or not 0 <= temperature <= MAX_TEMPERATURE:
        raise ValueError(f"temperature must be a number in [0, {MAX_TEMPERATURE:g}] (0 = greedy; above, every token "
                         f"is equally likely), got {temperature!r}")
    return temperature


def check_sampling(max_new_tokens: int, temperature: float, top_k: Optional[int]) -> None:
    """One ``ValueError`` line for arguments no sampler can use."""
    if isinstance(max_new_tokens, bool) or int(max_new_tokens) != max_new_tokens or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    check_temperature(temperature)
    if top_k is not None and (isinstance(top_k, bool) or int(top_k) != top_k or top_k < 1):
        raise ValueError(f"top_k must be an integer >= 1 or None, got {top_k!r}")


def check_prompt(idx: torch.Tensor, vocab_size: Optional[int] = None) -> None:
    """``idx`` must be a non-empty ``(B, T)`` integer tensor of ids in ``[0, vocab_size)``."""
    if not isinstance(idx, torch.Tensor) or idx.dim() != 2 or idx.shape[0] < 1 or idx.shape[1] < 1:
        shape = tuple(idx.shape) if isinstance(idx, torch.Tensor) else type(idx).__name__
        raise ValueError(f"prompt must be a non-empty (B, T) tensor of token ids, got {shape}")
    if idx.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
        raise ValueError(f"prompt token ids must be integers, got {idx.dtype}")
    if vocab_size is not None:
        lo, hi = int(idx.min()), int(idx.max())
        if lo < 0 or hi >= vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(f"prompt holds token id {bad}, outside the model's vocabulary [0, {vocab_size})")


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_k: Optional[int] = None,
                generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Next tokens ``(B, 1)`` from last-position logits ``(B, V)``; ``temperature=0`` → argmax. A non-finite or
    negative temperature is a ``ValueError``."""
    if check_temperature(temperature) == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k is not None:
        v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
        logits = logits.masked_fill(logits < v[:, [-1]], float("-inf"))
    return torch.multinomial(F.softmax(logits, dim=-1), num_samples=1, generator=generator)


@torch.no_grad()
def generate_tokens(step: DecodeStep, cache: DecodeCache, idx: torch.Tensor, max_new_tokens: int,
                    temperature: float = 0.0, top_k: Optional[int] = None,
                    generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Prefill ``idx (B, T)`` into the empty ``cache`` with ``step``, then decode ``max_new_tokens`` one at a time
    from it. ``temperature=0`` is greedy. Returns ``(B, T + max_new_tokens)``. Check the arguments with
    :func:`check_sampling` / :func:`check_prompt` first (the callers do)."""
    if max_new_tokens == 0:
        return idx
    logits = step(idx, cache)[:, -1]  # (B, V)
    out = [idx]
    for i in range(max_new_tokens):
        nxt = sample_next(logits, temperature, top_k, generator)  # (B, 1)
        out.append(nxt)
        if i + 1 < max_new_tokens:
            logits = step(nxt, cache)[:, -1]
    return torch.cat(out, dim=1)
