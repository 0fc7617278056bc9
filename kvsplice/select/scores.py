"""Attention-score token selectors: keep the prompt tokens the prompt's own queries attend to most (kvpress's
``SnapKVPress`` and ``ObservedAttentionPress``; H2O's heavy hitters at prefill). Both get the post-RoPE prefill
queries of each KV head (``needs_queries``) and keep their tokens with log-weight 0 (evicted tokens are not
re-weighted, as in the presses).

* :class:`SnapKVSelector` (Li et al. 2024) — the last ``window`` prompt queries vote: their softmax attention over
  the prompt, summed over the window and the KV head's query heads, smoothed along tokens by a ``kernel``-wide
  average pool; the window itself is always kept, the rest of the budget goes to the highest votes.
* :class:`ObservedAttentionSelector` — every prompt query votes: the causal softmax attention summed over all
  queries and the KV head's query heads, divided by the number of queries that can see each token (so late tokens,
  seen by few queries, are not penalised), as ``ObservedAttentionPress``.

Scores are formed in float32 from ``q (Hkv, g·T, d)`` — rows ordered (query head in group, position) — and the
keys ``k (Hkv, T, d)`` (:class:`~kvsplice.select.selectors.TokenSelector`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvsplice.core.args import bool_arg, int_arg
from kvsplice.select.selectors import TokenSelector

__all__ = ["ObservedAttentionSelector", "SnapKVSelector", "causal_attention_weights"]


def causal_attention_weights(q: torch.Tensor, k: torch.Tensor, scale: float, first: int = 0) -> torch.Tensor:
    """Softmax attention of the queries at positions ``first .. T-1`` over the keys they see (causal):
    ``q (H, g·T, d)``, ``k (H, T, d)`` → ``(H, g, T - first, T)`` float32 (zero above the diagonal)."""
    h, t, d = k.shape
    g = q.shape[1] // t
    qw = q.reshape(h, g, t, d)[:, :, first:].float() * scale  # (H, g, Tw, d), the scale on the smaller side
    logits = qw @ k.float().transpose(-1, -2)[:, None]  # (H, g, Tw, T)
    pos = torch.arange(first, t, device=k.device)[:, None]  # (Tw, 1) absolute query positions
    later = torch.arange(first, t, device=k.device)[None, :] > pos  # (Tw, T - first): keys after the query
    logits[..., first:].masked_fill_(later, float("-inf"))  # keys before ``first`` are seen by every query
    return torch.softmax(logits, dim=-1)


def _top(scores: torch.Tensor, budget: int, keep: torch.Tensor | None = None) -> torch.Tensor:
    """Sorted indices of the ``budget`` highest ``scores (H, T)``, the tokens in ``keep (T,)`` bool first."""
    if keep is not None:
        scores = scores.masked_fill(keep, float("inf"))
    return scores.topk(budget, dim=-1).indices.sort(dim=-1).values


class SnapKVSelector(TokenSelector):
    """SnapKV: votes of the last ``window`` prompt queries, average-pooled over ``kernel`` tokens; the window kept."""

    name = "snapkv"
    needs_queries = True
    _fields = ("window", "kernel")

    def __init__(self, window: int = 64, kernel: int = 5, seed: int = 0) -> None:
        super().__init__(seed)
        window, kernel = int_arg("window", window, 1), int_arg("kernel", kernel, 1, 1 << 16)
        if kernel % 2 == 0:
            raise ValueError(f"kernel must be an odd number >= 1, got {kernel}")
        self.window, self.kernel = window, kernel

    def _select(self, k, v, budget, *, q, scale):
        h, t = k.shape[:2]
        w = min(self.window, budget, t)
        votes = causal_attention_weights(q, k, scale, first=t - w).sum(dim=(1, 2))  # (H, T)
        if self.kernel > 1:
            votes = F.avg_pool1d(votes[:, None], self.kernel, stride=1, padding=self.kernel // 2,
                                 count_include_pad=False)[:, 0]  # (H, T)
        keep = torch.zeros(t, dtype=torch.bool, device=k.device)
        keep[t - w:] = True
        idx = _top(votes, budget, keep)
        return idx, torch.zeros(idx.shape, dtype=torch.float32, device=k.device)


class ObservedAttentionSelector(TokenSelector):
    """ObservedAttention (H2O at prefill): mean attention each token receives from the prompt queries that see it.
    ``stride``: only every ``stride``-th query votes (the last prompt query and every ``stride``-th before it), each
    token's votes divided by the number of those that see it — ``1/stride`` of the softmax work, which at 8k tokens
    is several times the prefill's own attention on a CPU (``1``: every query, the press's own)."""

    name = "observed_attention"
    needs_queries = True
    _fields = ("normalize", "stride")

    def __init__(self, normalize: bool = True, chunk: int = 64, stride: int = 1, seed: int = 0) -> None:
        super().__init__(seed)
        self.normalize, self.chunk = bool_arg("normalize", normalize), int_arg("chunk", chunk, 1)
        self.stride = int_arg("stride", stride, 1)

    @property
    def votes_key(self) -> tuple:
        """Selectors with equal keys give equal :meth:`votes` for the same ``k, q`` (a context's votes may be kept
        and reused by every method that mixes this selector in: KVzip's ``mix``)."""
        return (self.name, self.normalize, self.stride, self.chunk)

    def _select(self, k, v, budget, *, q, scale):
        idx = _top(self.votes(k, q, scale), budget)
        return idx, torch.zeros(idx.shape, dtype=torch.float32, device=k.device)

    def votes(self, k: torch.Tensor, q: torch.Tensor, scale: float) -> torch.Tensor:
        """Each token's (normalised) votes ``(H, T)`` float32 from ``k (H, T, d)``, ``q (H, g·T, d)``: the scores
        the selection keeps the top of."""
        h, t, d = k.shape
        g = q.shape[1] // t
        qg = q.reshape(h, g, t, d)
        pos = torch.arange(t - 1, -1, -self.stride, device=k.device).flip(0)  # (Ts,) the voting queries' positions
        votes = torch.zeros(h, t, dtype=torch.float32, device=k.device)
        for s in range(0, pos.numel(), self.chunk):  # voting queries in chunks: (H, g, chunk, e) at a time
            p = pos[s:s + self.chunk]
            e = int(p[-1]) + 1  # the chunk's queries see keys 0 .. e-1
            logits = (qg[:, :, p].float() * scale) @ k[:, :e].float().transpose(-1, -2)[:, None]  # (H, g, c, e)
            logits.masked_fill_(torch.arange(e, device=k.device)[None, :] > p[:, None], float("-inf"))  # causal
            votes[:, :e] += torch.softmax(logits, dim=-1).sum(dim=(1, 2))
        if self.normalize:  # token j is seen by the voting queries at positions >= j
            seen = pos.numel() - torch.searchsorted(pos, torch.arange(t, device=k.device))  # (T,)
            votes = votes / seen.clamp_min(1).to(torch.float32)
        return votes
