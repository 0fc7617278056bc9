"""BalanceKV: token selection by discrepancy (Han, Kochetkova, Kapralov, Sheth, Zandieh, arXiv 2502.07861).

Attention of a query ``q`` over keys/values ``(k_i, v_i)`` is a ratio of two kernel sums,

    Attn(q) = Σ_i e^{⟨q,k_i⟩·s} v_i / Σ_i e^{⟨q,k_i⟩·s},        s = 1/√d,

and ``e^{⟨q,k⟩·s} = ⟨φ(q), φ(k)⟩`` for the (infinite-dimensional) feature map of the exponential dot-product
kernel. A *balanced* signing ``ε ∈ {±1}^n`` with small ``‖Σ_i ε_i φ(k_i) ⊗ v_i‖`` splits the tokens into two halves
that each carry half of both sums, so keeping one half with weight 2 approximates both sums for *every* query.
Repeating the halving ``T`` times keeps ``≈ n/2^T`` tokens with weight ``2^T``.

Pieces, following the paper:

* :func:`softmax_balance` — the self-balancing walk (Alweiss–Liu–Sawhney) run *implicitly* in feature space: the
  signed running sum ``r = Σ_{j<i} ε_j φ(x_j)`` is kept as its coefficient vector (the signs), so
  ``⟨r, φ(x_i)⟩ = Σ_{j<i} ε_j κ(x_j, x_i)`` is a sum of kernel values with
  ``κ((k,v),(k',v')) = exp(⟨k,k'⟩·s)·(⟨v,v'⟩ + λ)`` (``λ = 0`` and ``v = 1`` for the denominator instance, i.e.
  the plain exponential kernel). Sign ``+1`` with probability ``1/2 − ⟨r, φ(x_i)⟩/(2c)``; ``|⟨r, φ(x_i)⟩| > c`` is
  the walk's failure event. Returns the signs and the smaller signed half.
* :class:`MergeAndReduce` / :func:`merge_and_reduce` — the streaming wrapper: batches of ``t`` tokens, one pending
  batch per level, two batches at level ``l`` are merged and reduced (SoftmaxBalance, keep a half) into one batch at
  level ``l+1``, up to level ``T``. Every kept token carries its level (weight ``2^l``).
* :func:`balance_kv` — the full estimator: value-norm buckets (geometric in ``‖v‖``), one numerator MergeAndReduce
  per bucket, one denominator instance with unit values, and :meth:`BalanceKVSketch.estimate`.
* :func:`block_balance` — the practical, block-parallel variant the paper evaluates (and the one the token-subset
  cache uses): the tokens are cut into blocks of ``b`` consecutive tokens, every block of every head is halved
  at once by a walk with the *joint* kernel ``exp(⟨k,k'⟩s)(⟨v,v'⟩+λ)`` (numerator and denominator balanced by one
  signing), the survivors are re-blocked and halved again, ``T`` times. One index set per head plus a per-token
  log-weight ``l·ln 2`` — exactly what :class:`kvsplice.select.cache.SubsetCache` stores.

Thresholds. The paper's analysis uses ``c = 30·log(n/δ)·max_i ‖φ(x_i)‖²`` (``‖φ(x_i)‖² = κ(x_i, x_i)``), under which
the walk fails with probability ≤ δ. That constant is a worst-case one: at n ≤ a few thousand the drift
``⟨r,φ⟩/c`` it gives is so weak that the signs are statistically indistinguishable from coin flips (measured:
discrepancy ratio ≈ 1 vs. random signs). :func:`softmax_balance` keeps it as its default (``threshold="paper"``);
the practical variant uses ``c = c_scale · median_i κ(x_i, x_i)`` per instance (``threshold="median"``, default
``c_scale = 1``), clamping the probability to {0, 1} (a greedy step) when ``|⟨r,φ⟩| > c`` instead of failing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

import torch

from kvsplice.select.walk import WalkFailure, WalkResult, uniform_draws, balancing_walk, discrepancy, kernel_diag, kernel_rows, softmax_balance, walk_threshold

LN2 = math.log(2.0)

# --------------------------------------------------------------------------------------- merge and reduce
Reducer = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``reduce(k (m, d), v (m, dv)) -> keep (m,) bool`` — which of the merged points survive one halving."""


def softmax_balance_reducer(*, use_values: bool = True, **walk_kw) -> Reducer:
    """A :data:`Reducer` running :func:`softmax_balance` (values ignored → the denominator's unit values)."""

    def reduce(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return softmax_balance(k, v if use_values else None, **walk_kw).keep

    return reduce


@dataclass
class _Batch:
    idx: torch.Tensor  # (m,) original positions
    k: torch.Tensor  # (m, d)
    v: torch.Tensor  # (m, dv)

    def __len__(self) -> int:
        return int(self.idx.numel())


def _cat(a: _Batch, b: _Batch) -> _Batch:
    return _Batch(torch.cat([a.idx, b.idx]), torch.cat([a.k, b.k]), torch.cat([a.v, b.v]))


def _take(x: _Batch, mask: torch.Tensor) -> _Batch:
    return _Batch(x.idx[mask], x.k[mask], x.v[mask])


class MergeAndReduce:
    """Streaming MergeAndReduce over tokens ``(k, v)`` with ``T`` halving levels and batch size ``t``.

    Tokens are pushed in order (any chunk size). Every ``t`` tokens form a level-0 batch. Levels ``0..T-1`` hold at
    most one pending batch each; a batch arriving at an occupied level ``l < T`` is merged with the pending one
    (``2t`` points) and reduced by ``reduce`` to its kept half (``≤ t`` points), which moves to level ``l+1``.
    Batches reaching level ``T`` are final. Memory: at any moment at most ``(T+1)·t`` working points (the input
    buffer, one batch per level, the extra batch of a merge in progress) plus the level-``T`` output
    (``≤ n/2^T`` points) — :attr:`bound`, checked against the measured :attr:`max_held`.

    :meth:`result` returns every held token with its level: level-``T`` output and the pending batches at lower
    levels (weight ``2^l`` each), plus the partial input buffer at level 0.
    """

    def __init__(self, t: int, T: int, reduce: Reducer) -> None:
        if t < 1 or T < 0:
            raise ValueError(f"MergeAndReduce needs t >= 1 and T >= 0, got t={t}, T={T}")
        self.t, self.T, self.reduce = int(t), int(T), reduce
        self.levels: list[Optional[_Batch]] = [None] * self.T
        self.final: list[_Batch] = []  # level-T batches
        self.buffer: list[_Batch] = []  # partial level-0 batch
        self.n_seen = 0
        self.max_held = 0

    # ---------------------------------------------------------------------------------------- accounting
    @property
    def held(self) -> int:
        return (sum(len(b) for b in self.buffer) + sum(len(b) for b in self.levels if b is not None)
                + sum(len(b) for b in self.final))

    @property
    def n_final(self) -> int:
        return sum(len(b) for b in self.final)

    @property
    def bound(self) -> int:
        """``(T+1)·t`` working points + ``⌊n_seen/2^T⌋`` output points."""
        return (self.T + 1) * self.t + self.n_seen // (2 ** self.T)

    def _note(self, extra: int = 0) -> None:
        self.max_held = max(self.max_held, self.held + extra)

    # ---------------------------------------------------------------------------------------------- push
    def push(self, k: torch.Tensor, v: torch.Tensor, idx: Optional[torch.Tensor] = None) -> None:
        """Stream ``k (m, d)``, ``v (m, dv)`` (positions ``idx`` (m,), default: consecutive from ``n_seen``)."""
        m = k.shape[0]
        if idx is None:
            idx = torch.arange(self.n_seen, self.n_seen + m, device=k.device)
        start = 0
        while start < m:
            room = self.t - sum(len(b) for b in self.buffer)
            take = min(room, m - start)
            self.buffer.append(_Batch(idx[start:start + take], k[start:start + take], v[start:start + take]))
            self.n_seen += take
            start += take
            self._note()
            if sum(len(b) for b in self.buffer) == self.t:
                batch = self.buffer[0]
                for b in self.buffer[1:]:
                    batch = _cat(batch, b)
                self.buffer = []
                self._carry(batch, 0)

    def _carry(self, batch: _Batch, level: int) -> None:
        while level < self.T:
            pending = self.levels[level]
            if pending is None:
                self.levels[level] = batch
                self._note()
                return
            self.levels[level] = None
            merged = _cat(pending, batch)  # 2t points held during the reduce
            self._note(extra=len(merged))
            batch = _take(merged, self.reduce(merged.k, merged.v))
            level += 1
        self.final.append(batch)
        self._note()

    # -------------------------------------------------------------------------------------------- output
    def result(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(idx, k, v, level)`` of every held token, sorted by position."""
        parts: list[tuple[_Batch, int]] = [(b, self.T) for b in self.final]
        parts += [(b, lvl) for lvl, b in enumerate(self.levels) if b is not None]
        parts += [(b, 0) for b in self.buffer]
        if not parts:
            raise ValueError("MergeAndReduce.result(): no tokens were pushed")
        idx = torch.cat([b.idx for b, _ in parts])
        k = torch.cat([b.k for b, _ in parts])
        v = torch.cat([b.v for b, _ in parts])
        level = torch.cat([torch.full((len(b),), lvl, dtype=torch.long, device=idx.device) for b, lvl in parts])
        order = torch.argsort(idx)
        return idx[order], k[order], v[order], level[order]


def merge_and_reduce(stream: Iterable[tuple[torch.Tensor, torch.Tensor]], t: int, T: int,
                     reduce: Optional[Reducer] = None, **walk_kw) -> MergeAndReduce:
    """Run :class:`MergeAndReduce` over a stream of ``(k (m, d), v (m, dv))`` chunks; returns the finished state
    (``.result()``, ``.max_held``, ``.bound``). ``reduce`` defaults to SoftmaxBalance with ``walk_kw``."""
    mr = MergeAndReduce(t, T, reduce if reduce is not None else softmax_balance_reducer(**walk_kw))
    for k, v in stream:
        mr.push(k, v)
    return mr


# -------------------------------------------------------------------------------------------- BalanceKV
def value_norm_buckets(v: torch.Tensor, base: float = 2.0) -> torch.Tensor:
    """Geometric bucket of each value by norm: ``⌊log_base ‖v_i‖⌋`` (streaming-friendly: no global maximum);
    zero values (which add nothing to the numerator) get bucket ``-2**62``."""
    norm = v.norm(dim=-1)
    b = torch.floor(torch.log(norm.clamp_min(1e-300)) / math.log(base)).long()
    return torch.where(norm > 0, b, torch.full_like(b, -(2 ** 62)))


@dataclass
class BalanceKVSketch:
    """BalanceKV's compressed state for one head: numerator tokens (all buckets) and denominator tokens."""

    num_idx: torch.Tensor  # (n_num,) positions kept for the numerator
    num_level: torch.Tensor  # (n_num,)
    den_idx: torch.Tensor  # (n_den,) positions kept for the denominator
    den_level: torch.Tensor  # (n_den,)
    k_num: torch.Tensor
    v_num: torch.Tensor
    k_den: torch.Tensor
    scale: float
    max_held: int = 0
    bound: int = 0
    buckets: dict = field(default_factory=dict)  # bucket id -> tokens in that bucket

    @property
    def n_tokens(self) -> int:
        """Distinct tokens the sketch stores (a token kept by both instances is stored once)."""
        return int(torch.unique(torch.cat([self.num_idx, self.den_idx])).numel())

    def estimate(self, q: torch.Tensor) -> torch.Tensor:
        """``Σ_num 2^l e^{⟨q,k⟩s} v / Σ_den 2^l e^{⟨q,k⟩s}`` for queries q (..., d) → (..., dv), stably in log space."""
        dt = torch.promote_types(q.dtype, torch.float32)
        q = q.to(dt)
        ln = (q @ self.k_num.to(dt).T) * self.scale + self.num_level.to(dt) * LN2  # (..., n_num)
        ld = (q @ self.k_den.to(dt).T) * self.scale + self.den_level.to(dt) * LN2  # (..., n_den)
        m = torch.maximum(ln.amax(-1, keepdim=True), ld.amax(-1, keepdim=True))
        num = torch.exp(ln - m) @ self.v_num.to(dt)
        den = torch.exp(ld - m).sum(-1, keepdim=True)
        return num / den


def balance_kv(k: torch.Tensor, v: torch.Tensor, T: int, t: int = 64, *, scale: Optional[float] = None,
               bucket_base: float = 2.0, generator: Optional[torch.Generator] = None,
               chunk_size: Optional[int] = None, **walk_kw) -> BalanceKVSketch:
    """BalanceKV on one head's stream ``k (n, d)``, ``v (n, dv)``: value-norm buckets, one numerator
    MergeAndReduce per bucket (kernel ``exp(⟨k,k'⟩s)⟨v,v'⟩``), one denominator MergeAndReduce with unit values
    (kernel ``exp(⟨k,k'⟩s)``), ``T`` levels of batch size ``t``. ``T = 0`` keeps everything (exact attention).

    Tokens are streamed in order in chunks of ``chunk_size`` (default ``t``), as a decoder would produce them.
    ``walk_kw`` go to :func:`softmax_balance` (threshold rule, ``on_fail``, ...).
    """
    if k.dim() != 2 or v.dim() != 2 or k.shape[0] != v.shape[0]:
        raise ValueError(f"balance_kv takes one head: k (n, d), v (n, dv); got {tuple(k.shape)}, {tuple(v.shape)}")
    n, d = k.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    kw = dict(scale=scale, generator=generator, **walk_kw)
    den = MergeAndReduce(t, T, softmax_balance_reducer(use_values=False, **kw))
    num: dict[int, MergeAndReduce] = {}
    buckets = value_norm_buckets(v, bucket_base)
    step = chunk_size or t
    for a in range(0, n, step):
        b = min(n, a + step)
        pos = torch.arange(a, b, device=k.device)
        den.push(k[a:b], v[a:b], pos)
        for bid in torch.unique(buckets[a:b]).tolist():
            if bid == -(2 ** 62):
                continue  # zero values: nothing to add to the numerator
            sel = buckets[a:b] == bid
            if bid not in num:
                num[bid] = MergeAndReduce(t, T, softmax_balance_reducer(use_values=True, **kw))
            num[bid].push(k[a:b][sel], v[a:b][sel], pos[sel])
    d_idx, d_k, _, d_lvl = den.result()
    parts = [mr.result() for mr in num.values()]
    if parts:
        n_idx = torch.cat([p[0] for p in parts])
        n_k, n_v = torch.cat([p[1] for p in parts]), torch.cat([p[2] for p in parts])
        n_lvl = torch.cat([p[3] for p in parts])
    else:  # every value is zero
        n_idx = torch.zeros(0, dtype=torch.long, device=k.device)
        n_k, n_v, n_lvl = k[:0], v[:0], n_idx
    return BalanceKVSketch(
        num_idx=n_idx, num_level=n_lvl, den_idx=d_idx, den_level=d_lvl, k_num=n_k, v_num=n_v, k_den=d_k,
        scale=scale, max_held=den.max_held + sum(mr.max_held for mr in num.values()),
        bound=den.bound + sum(mr.bound for mr in num.values()),
        buckets={bid: mr.n_seen for bid, mr in num.items()})


# --------------------------------------------------------------------------- practical block-parallel variant
def halving_counts(m: int, T: int) -> tuple[int, list[int]]:
    """Tokens left after ``T`` block-parallel halvings of ``m`` tokens: ``(survivors, leftovers per round)``.

    Each round halves an even number of tokens exactly; when the count is odd one token (the last) sits the round
    out and is kept at that round's level. Independent of the block size.
    """
    left = []
    for _ in range(T):
        left.append(m % 2)
        m //= 2
    return m, left


def block_balance(k: torch.Tensor, v: torch.Tensor, T: int, block_size: int = 64, *,
                  scale: Optional[float] = None, c_scale: float = 1.0, value_offset: Optional[float] = None,
                  center: bool = True, generator: Optional[torch.Generator] = None,
                  dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-parallel BalanceKV halving of ``k (H, m, d)``, ``v (H, m, dv)``, ``T`` rounds.

    Each round cuts the current tokens of every head (in position order) into blocks of ``block_size``
    (the last block may be shorter; an odd token out sits the round out at its level), walks every block of every
    head at once with the joint kernel ``exp(⟨k,k'⟩s)(⟨v,v'⟩+λ)`` (keys centred per block; ``λ`` = the head's mean
    ``‖v‖²`` unless given — balancing the numerator's ``φ(k)⊗v`` and the denominator's ``φ(k)`` with one signing),
    threshold ``c = c_scale·median κ(x,x)`` per block with clamped (greedy) steps beyond it, and exact halves.
    A random side (per block) is kept. Returns ``(idx (H, m'), level (H, m'))``: positions into ``[0, m)``
    sorted, and how many halvings each survived (log-weight ``level·ln 2``). ``m'`` = :func:`halving_counts`.
    """
    if block_size < 2 or block_size % 2:
        raise ValueError(f"block_size must be an even number >= 2, got {block_size}")
    h, m, d = k.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    kk, vv = k.to(dtype), v.to(dtype)
    lam = (vv.pow(2).sum(-1).mean(-1) if value_offset is None
           else torch.full((h,), float(value_offset), dtype=dtype, device=k.device))  # (H,)
    cur = torch.arange(m, device=k.device).expand(h, m)  # (H, m_cur) positions still in play
    done_idx, done_lvl = [], []
    for rnd in range(T):
        mc = cur.shape[1]
        if mc % 2:  # the last token sits out, kept at this level
            done_idx.append(cur[:, -1:])
            done_lvl.append(torch.full((h, 1), rnd, dtype=torch.long, device=k.device))
            cur = cur[:, :-1]
            mc -= 1
        if mc == 0:
            break
        kept = []
        n_full = mc // block_size
        spans = [(0, n_full * block_size, block_size)] if n_full else []
        if mc - n_full * block_size:
            spans.append((n_full * block_size, mc, mc - n_full * block_size))
        for a, b, bs in spans:
            pos = cur[:, a:b]  # (H, nb*bs)
            nb = (b - a) // bs
            kb = torch.gather(kk, 1, pos[..., None].expand(-1, -1, d)).view(h, nb, bs, d)  # (H, nb, bs, d)
            vb = torch.gather(vv, 1, pos[..., None].expand(-1, -1, vv.shape[-1])).view(h, nb, bs, -1)  # (H, nb, bs, dv)
            if center:
                kb = kb - kb.mean(-2, keepdim=True)
            lam_b = lam[:, None].expand(h, nb)
            c = walk_threshold(kernel_diag(kb, vb, scale, lam_b), bs, threshold="median", c_scale=c_scale)
            signs, _ = balancing_walk(lambda i, j: kernel_rows(kb, vb, scale, lam_b, i, j), bs, (h, nb),
                                      c.clamp_min(torch.finfo(dtype).tiny), generator=generator,
                                      exact_half=True, chunk=bs, dtype=dtype, device=k.device)
            side = torch.where(uniform_draws((h, nb, 1), generator, dtype, k.device) < 0.5, 1.0, -1.0).to(signs)
            keep = (signs == side).view(h, nb * bs)  # exactly bs/2 per block
            kept.append(pos[keep].view(h, -1))  # (H, nb·bs/2)
        cur = torch.cat(kept, dim=1) if len(kept) > 1 else kept[0]
        cur = torch.sort(cur, dim=1).values
    done_idx.append(cur)
    done_lvl.append(torch.full_like(cur, T))
    idx = torch.cat(done_idx, dim=1)
    lvl = torch.cat(done_lvl, dim=1)
    order = torch.argsort(idx, dim=1)
    return torch.gather(idx, 1, order), torch.gather(lvl, 1, order)


__all__ = [
    "BalanceKVSketch", "MergeAndReduce", "WalkFailure", "WalkResult", "balance_kv", "balancing_walk",
    "block_balance", "discrepancy", "halving_counts", "kernel_diag", "kernel_rows", "merge_and_reduce",
    "softmax_balance", "softmax_balance_reducer", "value_norm_buckets", "walk_threshold",
]
