"""Weight folding for absorbed low-rank decoding: one layer's bases folded into its attention projections.

Per KV head ``j`` with bases ``k_enc, k_dec, v_enc, v_dec`` (:mod:`kvsplice.lowrank.bases`) and ``g`` query heads per
KV head (query head ``h`` reads KV head ``h // g``):

* values: ``v_enc`` folds into the value projection (``b = x (W_v v_enc) + b_v v_enc``) and ``v_decᵀ`` into the
  output projection (``W_o[:, head h] v_dec``), so values never exist;
* keys, by RoPE mode: ``post`` keeps the plain key projection (keys are rotated, then projected with ``k_enc``);
  ``pre`` / ``none`` fold ``k_enc`` into the key projection; ``none`` also folds ``k_dec`` into the query projection
  (``q̃ = x (W_q k_dec) + b_q k_dec``).

Computed in float64, then cast to the model's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from kvsplice.adapters.base import Projections
from kvsplice.lowrank.bases import HeadBases

__all__ = ["Group", "LayerPlan", "plan_layer"]


@dataclass
class Group:
    """KV heads ``[kv0, kv0 + n)`` of a layer that share ranks and one cache stream (+ one attend call)."""

    kv0: int
    n: int
    rk: int
    rv: int
    k_enc: torch.Tensor  # (n, D, R_k) — post-RoPE: applied to the rotated new keys
    k_dec: torch.Tensor  # (n, D, R_k) — post-RoPE: query projection; pre-RoPE: key rebuild


@dataclass
class LayerPlan:
    """One layer's folded weights for the absorbed path."""

    w_in: torch.Tensor  # fused input projection: [query part | key part | value coefficients]
    b_in: Optional[torch.Tensor]
    split: tuple[int, int, int]
    groups: list[Group]
    w_out: torch.Tensor  # (d_model, Σ_h R_v(h)): W_o[:, h] v_dec folded
    b_out: Optional[torch.Tensor]


def _blocks(w: torch.Tensor, n: int, size: int) -> list[torch.Tensor]:
    """Split the rows of ``w`` into ``n`` blocks of ``size`` (per-head rows of a projection)."""
    return [w[i * size:(i + 1) * size] for i in range(n)]


def _fold_rows(w: torch.Tensor, b: Optional[torch.Tensor], mats: Sequence[torch.Tensor], d: int):
    """Per head ``i``: rows ``mats[i]ᵀ W_i`` (R_i, d_model) and bias ``mats[i]ᵀ b_i``; concatenated over heads."""
    rows = torch.cat([m.T @ wi for m, wi in zip(mats, _blocks(w, len(mats), d))], dim=0)
    bias = None if b is None else torch.cat([m.T @ bi for m, bi in zip(mats, _blocks(b, len(mats), d))])
    return rows, bias


def _cat_bias(parts: Sequence[Optional[torch.Tensor]], sizes: Sequence[int], like: torch.Tensor):
    if all(p is None for p in parts):
        return None
    return torch.cat([p if p is not None else like.new_zeros(s) for p, s in zip(parts, sizes)])


def plan_layer(P: Projections, heads: list[HeadBases], *, mode: str, n_head: int, head_dim: int,
               dtype: torch.dtype, device: torch.device) -> LayerPlan:
    """Fold ``heads`` (one :class:`HeadBases` per KV head) into the projections ``P`` for RoPE ``mode``."""
    D, hq, hkv = head_dim, n_head, len(heads)
    g = hq // hkv
    P64 = Projections(*(t.detach().double() if t is not None else None for t in vars(P).values()))
    k_enc = [h.k_enc.detach().double() for h in heads]
    k_dec = [h.k_dec.detach().double() for h in heads]
    v_enc = [h.v_enc.detach().double() for h in heads]
    v_dec = [h.v_dec.detach().double() for h in heads]
    per_q = lambda mats: [mats[h // g] for h in range(hq)]  # noqa: E731  query head h reads KV head h // g

    # query part: rope none → q̃ = x (W_q k_dec) + b_q k_dec; else the plain query (projected after RoPE)
    wq, bq = _fold_rows(P64.wq, P64.bq, per_q(k_dec), D) if mode == "none" else (P64.wq, P64.bq)
    # key part: post → plain keys (rotated, then projected); pre / none → a = x (W_k k_enc) + b_k k_enc
    wk, bk = (P64.wk, P64.bk) if mode == "post" else _fold_rows(P64.wk, P64.bk, k_enc, D)
    wv, bv = _fold_rows(P64.wv, P64.bv, v_enc, D)  # value coefficients b = x (W_v v_enc) + b_v v_enc
    split = (wq.shape[0], wk.shape[0], wv.shape[0])
    w_in = torch.cat([wq, wk, wv], dim=0)
    b_in = _cat_bias([bq, bk, bv], split, w_in)
    # output: Σ_h W_o[:, h] v̂_h = Σ_h (W_o[:, h] v_dec_j) (Σ_t p_t b_t)
    w_out = torch.cat([wo_h @ m for wo_h, m in zip(P64.wo.split(D, dim=1), per_q(v_dec))], dim=1)

    uniform = len({h.rank_k for h in heads}) == 1 and len({h.rank_v for h in heads}) == 1
    spans = [(0, hkv)] if uniform else [(j, 1) for j in range(hkv)]
    cast = dict(dtype=dtype, device=device)
    groups = [Group(kv0, n, heads[kv0].rank_k, heads[kv0].rank_v,
                    torch.stack(k_enc[kv0:kv0 + n]).to(**cast), torch.stack(k_dec[kv0:kv0 + n]).to(**cast))
              for kv0, n in spans]
    return LayerPlan(w_in.to(**cast), None if b_in is None else b_in.to(**cast), split, groups, w_out.to(**cast),
                     None if P.bo is None else P.bo)
