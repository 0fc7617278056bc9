"""Expected-Attention-style selection (after kvpress's ``ExpectedAttentionPress``): score each prompt token by the
attention that *future* queries are expected to pay it, estimated from the statistics of the prompt's own last
queries — no question needed.

Per KV head, the last ``window`` prompt queries of its ``g`` query heads give a mean ``μ`` and covariance ``Σ``; for
``q ~ N(μ, Σ)`` the expected unnormalised attention on key ``k`` is ``E[exp(s·q·k)] = exp(s·μ·k + ½ s²·kᵀΣk)``.
A token's score is that expectation, normalised over the prompt (a softmax of the exponents), times the norm of its
value (a token whose value is small changes the output little); the ``n_sink`` first tokens and the window itself are
always kept, the rest of the budget goes to the highest scores (log-weight 0). Simplified against kvpress: the
queries' statistics are those of the last prompt positions, not projected forward through RoPE.
"""

from __future__ import annotations

import torch

from kvsplice.core.args import bool_arg, int_arg
from kvsplice.select.scores import _top
from kvsplice.select.selectors import TokenSelector

__all__ = ["ExpectedAttentionSelector"]


class ExpectedAttentionSelector(TokenSelector):
    """Keep the tokens with the highest expected attention of future queries (see the module docstring)."""

    name = "expected_attention"
    needs_queries = True
    _fields = ("window", "n_sink", "cov")

    def __init__(self, window: int = 64, n_sink: int = 4, cov: bool = True, seed: int = 0) -> None:
        super().__init__(seed)
        self.window, self.n_sink = int_arg("window", window, 2), int_arg("n_sink", n_sink)
        self.cov = bool_arg("cov", cov)

    def scores(self, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor, scale: float) -> torch.Tensor:
        """``(Hkv, T)`` expected attention × ‖v‖ of every token (float32)."""
        h, t, d = k.shape
        g = q.shape[1] // t
        w = min(self.window, t)
        qw = q.reshape(h, g, t, d)[:, :, t - w:].reshape(h, g * w, d).float()  # (Hkv, g·w, d) the last queries
        mu = qw.mean(dim=1)  # (Hkv, d)
        kf = k.float()
        logits = scale * torch.einsum("hd,htd->ht", mu, kf)  # (Hkv, T)
        if self.cov:
            c = qw - mu[:, None]
            sigma = torch.einsum("hnd,hne->hde", c, c) / max(g * w - 1, 1)  # (Hkv, d, d)
            logits = logits + 0.5 * scale**2 * torch.einsum("htd,hde,hte->ht", kf, sigma, kf)
        return torch.softmax(logits, dim=-1) * v.float().norm(dim=-1)

    def _select(self, k, v, budget, *, q, scale):
        t = k.shape[1]
        keep = torch.zeros(t, dtype=torch.bool, device=k.device)
        keep[: min(self.n_sink, budget)] = True
        w = min(self.window, budget - int(keep.sum()), t)
        if w > 0:
            keep[t - w:] = True
        idx = _top(self.scores(k, v, q, scale), budget, keep)
        return idx, torch.zeros(idx.shape, dtype=torch.float32, device=k.device)
