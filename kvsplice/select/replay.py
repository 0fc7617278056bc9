"""One exact prefill, replayed into any token selection's cache.

A token selection's prefill is exact (every prompt query attends over every prompt key) and compresses each layer
from that layer's exact ``q, k, v``; so the prefill of the full cache, with every layer's ``q, k, v`` kept
(:func:`prefill_kept`), is the prefill of *every* selection (any selector, any storage under it, KVzip).
:meth:`Kept.replay` hands the kept ``q, k, v`` to a selection's ``compress_prefill`` layer by layer — exactly the cache
the ``Decoder`` would build, without the attention output the kept prefill already has (its last logits). Used by
the task runs (:class:`kvsplice.tasks.shared.SharedPrefill`) and the planner's tuning perplexity
(:func:`kvsplice.evaluation.protocol.evaluate_each` with ``contexts``). Methods that are no selection (int8, KIVI)
attend over their own lossy cache at prefill: they cannot replay.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from kvsplice.adapters.registry import adapter_for
from kvsplice.core.method import Step
from kvsplice.decode.decoder import Decoder
from kvsplice.decode.dense import DenseKV
from kvsplice.decode.native import OWN_ATTENTION
from kvsplice.select.method import TokenSelection
from models.cache import Cache

__all__ = ["Kept", "KeepQKV", "can_replay", "prefill_kept"]


class KeepQKV(DenseKV):
    """The full cache, keeping the prefill's ``q, k, v`` of every layer."""

    def __init__(self) -> None:
        super().__init__()
        self.kept: dict[int, tuple] = {}

    def attend(self, layer, q, k, v, cache, step, mask=None, logw=None):
        if cache.layer_len(layer) == 0:
            self.kept[layer] = (q, k, v)
        return super().attend(layer, q, k, v, cache, step, mask=mask, logw=logw)


@dataclass
class Kept:
    """A kept exact prefill: ``qkv[layer] = (q (1, Hq, P, D), k, v (1, Hkv, P, D))``, the last position's
    ``logits (1, 1, V)``, the full ``decoder`` and its ``cache`` (the full cache's own, to go on decoding with)."""

    qkv: dict[int, tuple]
    logits: torch.Tensor
    decoder: Decoder
    cache: Optional[Cache]  # None once the full cache's own answer is not needed

    @property
    def nbytes(self) -> int:
        """Bytes of the kept ``q, k, v``."""
        return sum(t.numel() * t.element_size() for qkv in self.qkv.values() for t in qkv)

    @torch.no_grad()
    def replay(self, dec: Decoder, cache: Cache) -> None:
        """``dec``'s token selection's prefill cache of the kept prompt into the empty ``cache`` (exactly what its
        own prefill builds)."""
        p = next(iter(self.qkv.values()))[1].shape[2]
        step = Step(dec.adapter, 0, p, dec.scales, dec.attn_backend)
        for layer, m in enumerate(dec.layer_methods):
            m.compress_prefill(layer, *self.qkv[layer], cache, step)  # (its attention output is the full one's)


def can_replay(model, method=None) -> bool:
    """Whether ``model``'s prefill can be kept and replayed (not a model with its own cache, nor one the ``Decoder``
    evicts from as it goes: sliding windows) — into ``method`` if given (a token selection)."""
    a = adapter_for(model)
    ok = not (a.name in OWN_ATTENTION or any(a.window(l) for l in range(a.n_layer)))
    return ok and (method is None or isinstance(method, TokenSelection))


@torch.no_grad()
def prefill_kept(model, ids: torch.Tensor, capacity: int) -> Kept:
    """The full cache's exact prefill of ``ids (1, P)`` in a cache of ``capacity`` tokens, every layer's ``q, k, v``
    kept."""
    keep = KeepQKV()
    dec = Decoder(model, keep)
    cache = dec.new_cache(ids.shape[0], capacity=capacity)
    logits = dec(ids, cache, last_only=True)  # (B, 1, V): exact
    return Kept(keep.kept, logits, dec, cache)
