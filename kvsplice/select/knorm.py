"""``KnormSelector``: keep the tokens whose keys have the smallest L2 norm (Devoto et al. 2024, kvpress's
``KnormPress``) — the worked example of adding a method (README, "Add a compression method").

Low key norm goes with high attention in trained LMs, so the smallest-norm keys are the ones to keep. The whole
method is this class: ``TokenSelection(KnormSelector(), budget)`` plugs it into the one decoder, with the token-subset
cache, its byte accounting and every decode path (prefill, decode, ``generate``, ``run_token_selection``) unchanged.
"""

from __future__ import annotations

import torch

from kvsplice.core.args import int_arg
from kvsplice.select.selectors import TokenSelector

__all__ = ["KnormSelector"]


class KnormSelector(TokenSelector):
    """Per KV head: the first ``n_sink`` tokens plus the ``budget - n_sink`` other tokens with the smallest ``‖k‖``,
    all with log-weight 0 (dropped tokens are not re-weighted, as in KnormPress)."""

    name = "knorm"
    _fields = ("n_sink",)

    def __init__(self, n_sink: int = 0, seed: int = 0) -> None:
        super().__init__(seed)
        self.n_sink = int_arg("n_sink", n_sink)

    def _select(self, k: torch.Tensor, v: torch.Tensor, budget: int) -> tuple[torch.Tensor, torch.Tensor]:
        h, t = k.shape[:2]  # k (Hkv, T, d); budget < T here
        s = min(self.n_sink, budget)
        norms = k.float().norm(dim=-1)  # (Hkv, T)
        norms[:, :s] = -1.0  # sinks first: every norm is >= 0
        idx = norms.topk(budget, dim=-1, largest=False).indices.sort(dim=-1).values  # (Hkv, budget), sorted
        return idx, torch.zeros(h, budget, dtype=torch.float32, device=k.device)
