"""KVzip-style, query-agnostic token selection (Kim et al. 2025): keep the context tokens the model needs to
*reconstruct* the context.

After the (exact) prefill of a layer, a second pass — ``recon_ids``: a "Repeat the previous context:" prompt followed
by the context itself, at the positions after it — runs through the same layer over the layer's full cache; every
context token is scored by the largest attention it receives from any reconstruction query of any query head of its
KV head, and each KV head keeps its ``budget`` highest-scored tokens (log-weight 0). The reconstruction pass is carried
layer to layer (its hidden states live in the call's ``step.memo``) with the model's own weights through the family
adapter, so it runs inside either door: the package's ``Decoder`` and transformers' ``generate()`` call the same
``attend``. The question is never needed: a cache compressed this way serves any later question.

::

    recon = torch.tensor([tok.encode("\\n\\nRepeat the previous context exactly.\\n") + ctx_ids[1:]])
    method = KVzipSelection(budget=len(ctx_ids) // 4, recon_ids=recon, store=DenseKV(cache_quant="int8"))

Cost: one more pass over the context (the reconstruction) at prefill; nothing at decode. Models with sliding-window
layers are refused (a window keeps its most recent tokens anyway).
"""

from __future__ import annotations

from typing import Optional

import torch

from kvsplice.core.args import int_arg
from kvsplice.core.method import CompressionMethod
from kvsplice.select.method import TokenSelection
from kvsplice.select.scores import _top
from kvsplice.select.selectors import TokenSelector

__all__ = ["KVzipSelection", "REPEAT_PROMPT", "ReconstructionScores"]

REPEAT_PROMPT = "\n\nRepeat the previous context exactly.\n"
"""The instruction before the context in the reconstruction pass."""


class ReconstructionScores(TokenSelector):
    """Keeps the ``budget`` tokens of the highest scores set by :class:`KVzipSelection` for the layer being
    compressed (``scores (B·Hkv, T)``); log-weights 0. Not registered with ``make_selector``: its scores come from
    the reconstruction pass."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        self.scores: Optional[torch.Tensor] = None

    def _select(self, k, v, budget):
        if self.scores is None or self.scores.shape != k.shape[:2]:
            raise ValueError("kvzip scores come from the reconstruction pass: use KVzipSelection, not make_selector")
        idx = _top(self.scores.to(k.device), budget)
        return idx, torch.zeros(idx.shape, dtype=torch.float32, device=k.device)


class KVzipSelection(TokenSelection):
    """Keep ``budget`` prompt tokens per KV head, scored by the reconstruction pass of ``recon_ids (B or 1, Tr)``;
    held by ``store`` (default full K/V). ``chunk``: reconstruction queries per score block. Not registered with
    :func:`kvsplice.build_method`: it holds the prompt's own token ids, so no spec rebuilds it (the task suite's
    ``kvzip@KEEP`` builds one per prompt, :func:`kvsplice.tasks.methods.parse_method`)."""

    def __init__(self, budget: int, *, recon_ids: torch.Tensor, store: Optional[CompressionMethod] = None,
                 chunk: int = 512, shared_scores: Optional[dict] = None) -> None:
        super().__init__(ReconstructionScores(), budget, store=store)
        if not isinstance(recon_ids, torch.Tensor) or recon_ids.dim() != 2 or recon_ids.shape[1] < 1:
            raise ValueError("recon_ids must be token ids (B or 1, Tr) with Tr >= 1")
        self.recon_ids, self.chunk = recon_ids, int_arg("chunk", chunk, 1)
        self.shared_scores = shared_scores  # {layer: scores} of a finished pass over the same context, reused

    def _prepare(self, adapter, *, dtype, device):
        super()._prepare(adapter, dtype=dtype, device=device)
        if any(adapter.window(l) for l in range(adapter.n_layer)):
            raise ValueError("KVzipSelection does not support sliding-window layers")
        self.selector = ReconstructionScores()  # the bound copy's own (scores are set per layer at prefill)
        self.layer_scores: dict[int, torch.Tensor] = {}  # the last prefill's scores (B, Hkv, T) per layer

    def attend(self, layer, q, k, v, cache, step, mask=None, logw=None):
        if cache.layer_len(layer) == 0:
            shared = self.shared_scores
            if shared is not None and len(shared) == self.adapter.n_layer and shared[layer].shape == (*k.shape[:2],
                                                                                                       k.shape[2]):
                self.layer_scores[layer] = shared[layer]  # the same context's pass, done once for every budget
            else:
                self.layer_scores[layer] = self._scores(layer, k, v, step)  # (B, Hkv, T)
                if shared is not None and layer == self.adapter.n_layer - 1:
                    shared.update(self.layer_scores)
            self.selector.scores = self.layer_scores[layer].reshape(-1, k.shape[2])  # (B·Hkv, T)
        return super().attend(layer, q, k, v, cache, step, mask=mask, logw=logw)

    def _scores(self, layer: int, k: torch.Tensor, v: torch.Tensor, step) -> torch.Tensor:
        """The reconstruction pass through ``layer`` over the context's ``k, v (B, Hkv, T, D)`` (post-RoPE) →
        max attention per context token ``(B, Hkv, T)``; the pass's hidden states move on to the next layer."""
        if step.pads is not None and bool((step.pads > 0).any()):
            raise ValueError("KVzipSelection needs unpadded prompts (one sequence per call, or equal lengths)")
        a = self._bound()
        b, hkv, t, d = k.shape
        ids = self.recon_ids.to(k.device).expand(b, -1)  # (B, Tr)
        tr = ids.shape[1]
        key = ("kvzip", id(self))
        x = step.memo.get(key)
        if layer == 0 or x is None:
            x = a.embed(ids, t)  # (B, Tr, d_model) at positions t .. t + Tr - 1
        rope = a.rope(x, t, tr, layer) if a.has_rope else None
        qr, kr, vr = a.qkv(layer, a.attn_in(layer, x), rope)  # (B, Hq, Tr, D), (B, Hkv, Tr, D) × 2
        kk = torch.cat([k.to(qr.dtype), kr], dim=2)  # (B, Hkv, T + Tr, D): the full cache + the pass's own
        vv = torch.cat([v.to(qr.dtype), vr], dim=2)
        step.memo[key] = a.after_attn(layer, x, a.out(layer, step.attend(layer, qr, kk, vv)))  # causal, bottom-right
        g = qr.shape[1] // hkv
        qg = qr.reshape(b, hkv, g, tr, d).float()  # (B, Hkv, g, Tr, D)
        scores = torch.zeros(b, hkv, t, dtype=torch.float32, device=k.device)
        cols = torch.arange(t + tr, device=k.device)
        for s in range(0, tr, self.chunk):
            e = min(tr, s + self.chunk)
            logits = torch.einsum("bhgqd,bhkd->bhgqk", qg[:, :, :, s:e], kk.float()) * step.scales[layer]
            logits = logits.masked_fill(cols > t + torch.arange(s, e, device=k.device)[:, None], float("-inf"))
            p = torch.softmax(logits, dim=-1)[..., :t]  # (B, Hkv, g, e - s, T): attention on the context
            scores = torch.maximum(scores, p.amax(dim=(2, 3)))
        return scores

    def __repr__(self) -> str:
        return f"KVzipSelection(budget={self.budget}, store={self.store!r})"
