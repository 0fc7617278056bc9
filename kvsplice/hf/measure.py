"""Scoring and byte counting for any ``transformers.Cache`` — the HF door's ``KVSpliceHFCache``, transformers' own
``DynamicCache`` / ``QuantizedCache`` — so every comparison in the model's own forward runs the same loop and counts
bytes the same way.

::

    logits = continuation_logits(model, cache, ids, prompt_len)           # (B, T - prompt_len, V)
    nbytes = cache_nbytes(cache)                                           # every tensor its layers hold
"""

from __future__ import annotations

from typing import Callable, Iterator, Optional

import torch

__all__ = ["TensorsView", "cache_nbytes", "cache_tensors", "continuation_logits"]


@torch.no_grad()
def continuation_logits(model, cache, ids: torch.Tensor, prompt_len: int, decode_chunk: Optional[int] = None,
                        after_prefill: Optional[Callable[[], None]] = None) -> torch.Tensor:
    """The model's forward with ``cache``: prefill ``ids[:, :prompt_len]``, then ``ids[:, prompt_len:-1]``
    teacher-forced in chunks of ``decode_chunk`` (default all at once; 1: token by token). Returns the logits that
    predict ``ids[:, prompt_len:]`` ``(B, T - prompt_len, V)`` — the first from the prefill's last position.
    ``after_prefill``: called once the prompt is in the cache (to measure it there)."""
    b, t = ids.shape
    p = int(prompt_len)
    if not 1 <= p < t:
        raise ValueError(f"prompt_len must be in [1, {t - 1}], got {prompt_len}")
    logits = [model(ids[:, :p], past_key_values=cache, use_cache=True).logits[:, -1:]]  # (B, 1, V)
    if after_prefill is not None:
        after_prefill()
    step = decode_chunk or max(1, t - 1 - p)
    for s in range(p, t - 1, step):
        logits.append(model(ids[:, s:min(t - 1, s + step)], past_key_values=cache, use_cache=True).logits)
    return torch.cat(logits, 1)  # (B, T - p, V)


def _flat(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """A tensor, or the inner tensors of a tensor subclass (quanto's packed ``QBitsTensor``)."""
    if hasattr(t, "__tensor_flatten__") and type(t) is not torch.Tensor:
        names, _ = t.__tensor_flatten__()
        for n in names:
            yield from _flat(getattr(t, n))
    else:
        yield t


def cache_tensors(cache) -> Iterator[torch.Tensor]:
    """Every tensor a transformers cache's layers hold (keys, values, quantised states and their scales, lists of
    them), tensor subclasses by their inner tensors; a cache with its own ``tensors()`` (``KVSpliceHFCache``) gives
    those."""
    if hasattr(cache, "tensors"):
        yield from cache.tensors()
        return
    for layer in cache.layers:
        for v in vars(layer).values():
            for t in (v if isinstance(v, (list, tuple)) else [v]):
                if isinstance(t, torch.Tensor):
                    yield from _flat(t)


def cache_nbytes(cache) -> int:
    """Bytes of :func:`cache_tensors`."""
    return sum(t.numel() * t.element_size() for t in cache_tensors(cache))


class TensorsView:
    """A transformers cache as :func:`kvsplice.report.memory.measure_cache` reads it (``tensors()``, ``seq_len``)."""

    def __init__(self, cache) -> None:
        self.cache = cache

    def tensors(self) -> Iterator[torch.Tensor]:
        return cache_tensors(self.cache)

    def nbytes(self) -> int:
        return cache_nbytes(self.cache)

    @property
    def seq_len(self) -> int:
        return self.cache.get_seq_length()
