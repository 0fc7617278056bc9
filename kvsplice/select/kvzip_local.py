"""KVzip's reconstruction scores without re-reading the context (``kvzip(recon=local)``): the prefill's own queries
stand in for the repeat's, each looking at the prompt around the token it would copy.

KVzip's exact pass (:class:`~kvsplice.select.kvzip.KVzipSelection`, ``recon=exact``) feeds the instruction
``repeat`` and then the whole prompt again through every layer — a second prefill of ``R + T`` tokens whose queries
see ``T + R + i`` keys each: at 2k tokens 2–3× a plain prefill, at 8k 4–5× on a CPU. Here only the instruction's
``R`` tokens are run through the layers (exactly as the exact pass runs them: its queries score the prompt and its
keys enter the softmax below); the repeat of prompt token ``i`` is approximated by the prefill's own query of token
``i``, moved to the repeat's position ``T + R + i`` by one more RoPE rotation (rotations compose), and attends to

* the prompt's keys ``j`` with ``|i − j| <= window`` and its first ``sinks`` tokens — the token it copies next
  (``i + 1``) and its neighbours: where a reconstruction query puts its weight on the prompt —,
* the instruction's ``R`` keys (from the short pass), and
* the repeat's own keys ``j <= i`` within ``window`` and the first ``sinks``: under RoPE these logits are the
  prefill's own ``q_i·k_j`` (equal relative positions), so the prefill's keys serve.

A prompt token's score is the largest softmax weight over those keys that any such query (any query head of its KV
head) gives it, as in the exact pass. What is left out: the repeat's hidden states (each query is the prefill's, not
one that has read the whole context and the instruction) and the weight on keys farther than ``window`` (left out of
the softmax too). The cost is ``T · (2·window + chunk + 2·sinks)`` logits per query head and layer instead of
``(T + R) · (T + R/2)``, and no projections or MLPs over the repeat. Equality with a dense masked softmax over the same
keys is tested (``tests/kvsplice/select/test_kvzip_local.py``); what it changes on tasks and perplexity is in docs/tasks.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["LocalRepeat"]


@dataclass(frozen=True)
class LocalRepeat:
    """The local reconstruction scores: ``window`` prompt tokens either side of the copied one, ``sinks`` first
    tokens always seen, ``chunk`` queries per block (small: a block's keys span ``chunk + 2·window``)."""

    window: int = 64
    sinks: int = 4
    chunk: int = 64

    def score(self, q: torch.Tensor, k: torch.Tensor, kr: torch.Tensor, shift: tuple[torch.Tensor, torch.Tensor],
              scale: float, scores: torch.Tensor) -> None:
        """Max the local reconstruction weights into ``scores (B, Hkv, T)``: ``q (B, Hq, T, D)`` the prefill's
        post-RoPE queries, ``k (B, Hkv, T, D)`` its keys, ``kr (B, Hkv, R, D)`` the instruction's keys (at
        positions ``T .. T+R-1``), ``shift`` the RoPE ``(cos, sin)`` of position ``T + R`` (``None``: no RoPE)."""
        from kvsplice.adapters.base import apply_rope

        b, hkv, t, d = k.shape
        g = q.shape[1] // hkv
        qf = q.float() * scale
        qs = qf if shift is None else apply_rope(qf, *shift)  # (B, Hq, T, D): the repeat's queries at T + R + i
        qf, qs = qf.reshape(b, hkv, g, t, d), qs.reshape(b, hkv, g, t, d)
        kf, krf = k.float(), kr.float()
        n_sink = min(self.sinks, t)
        w, c = self.window, self.chunk
        for s in range(0, t, c):
            e = min(t, s + c)
            lo, hi = max(n_sink, s - w), min(t, e + w)  # the prompt keys the block's windows reach (sinks apart)
            lo_own = max(n_sink, s - w)  # the repeat's own keys (causal)
            qi = torch.arange(s, e, device=k.device)[:, None]  # (c, 1) query positions (in the prompt's frame)
            jp = torch.cat([torch.arange(n_sink, device=k.device), torch.arange(lo, hi, device=k.device)])[None]
            far = ((jp - qi).abs() > w) & (jp >= n_sink)  # (c, S + hi - lo): out of reach (the sinks never are)
            jo = torch.cat([torch.arange(n_sink, device=k.device), torch.arange(lo_own, e, device=k.device)])[None]
            hide_own = (jo > qi) | ((qi - jo > w) & (jo >= n_sink))
            keys = torch.cat([kf[:, :, :n_sink], kf[:, :, lo:hi]], 2)[:, :, None]  # (B, Hkv, 1, S + hi - lo, D)
            own_keys = torch.cat([kf[:, :, :n_sink], kf[:, :, lo_own:e]], 2)[:, :, None]
            lp = (qs[:, :, :, s:e] @ keys.transpose(-1, -2)).masked_fill_(far, float("-inf"))  # (B, Hkv, g, c, ·)
            li = qs[:, :, :, s:e] @ krf[:, :, None].transpose(-1, -2)  # (B, Hkv, g, c, R): the instruction
            lo_ = (qf[:, :, :, s:e] @ own_keys.transpose(-1, -2)).masked_fill_(hide_own, float("-inf"))  # own keys
            m = torch.maximum(torch.maximum(lp.amax(-1, keepdim=True), li.amax(-1, keepdim=True)),
                              lo_.amax(-1, keepdim=True))  # (B, Hkv, g, c, 1): each row's largest logit
            ep = lp.sub_(m).exp_()  # the prompt keys' exp(logit - max), in place
            z = ep.sum(-1, keepdim=True) + li.sub_(m).exp_().sum(-1, keepdim=True) + lo_.sub_(m).exp_().sum(
                -1, keepdim=True)  # (B, Hkv, g, c, 1): the softmax's denominator over every key seen
            p = ep.div_(z).amax(dim=(2, 3))  # (B, Hkv, S + hi - lo): the best weight each key gets
            torch.maximum(scores[..., :n_sink], p[..., :n_sink], out=scores[..., :n_sink])
            torch.maximum(scores[..., lo:hi], p[..., n_sink:], out=scores[..., lo:hi])
