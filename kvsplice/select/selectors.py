"""Token selection behind one interface: BalanceKV (block-parallel) and the eviction/sampling baselines.

A :class:`TokenSelector` looks at one sequence's prefill keys/values of every KV head and returns, per head, which
tokens to keep and a log-weight for each. Attention over the kept set with the log-weights added to the logits,
``softmax(q·Kᵀ·s + logw)·V``, is the selector's estimate of full attention (see
:func:`kvsplice.core.attention.weighted_attend`): a token that stands for ``w`` tokens gets ``log w``.

* :class:`BalanceKVSelector` — first ``n_sink`` tokens and the most recent ones intact (log-weight 0), the middle
  halved by :func:`kvsplice.select.balance.block_balance` (a token that survived ``l`` halvings gets ``l·ln 2``). The middle
  is a run of segments halved ``T, T-1, ..., 1`` times (oldest most), sized by :func:`balance_plan` so the kept
  count is exactly the budget; whatever is left after them stays intact.
* :class:`UniformSelector` — same sinks and recent window, the rest of the budget sampled uniformly without
  replacement from the middle per head, log-weight ``ln(n_middle / n_sampled)`` (unbiased numerator and denominator).
* :class:`StreamingLLMSelector` — attention sinks + the most recent window, log-weights 0.

Every selector keeps all tokens with log-weight 0 when ``budget >= T`` (so decoding reproduces the model exactly),
and the same number of tokens for every head (``n_keep = min(budget, T)``), so batches stack.
"""

from __future__ import annotations

import inspect
import math
from typing import Optional

import torch

from kvsplice.core.args import bool_arg, float_arg, int_arg
from kvsplice.core.registry import SELECTORS, register, spec_of
from kvsplice.select.balance import LN2, block_balance

# SELECTORS (kvsplice.core.registry): selector name → class; every subclass of TokenSelector that sets ``name``
# registers itself (one name, one meaning across methods and selectors).

MAX_HALVINGS = 40
"""BalanceKV halves at most 2^40 tokens' worth (more rounds than any prompt has tokens' bits)."""


class TokenSelector:
    """``select(k (Hkv, T, d), v (Hkv, T, dv), budget) -> (indices (Hkv, n_keep), log_weights (Hkv, n_keep))``.

    Indices are sorted per head; ``n_keep == min(budget, T)``. Rows are independent instances (nothing is shared
    across heads), so a caller may fold a batch into the head axis: ``select(k.reshape(B·Hkv, T, d), ...)``.

    A new selector is one subclass with a ``name`` (registered for :func:`make_selector`) and
    ``_select(k, v, budget)`` for ``budget < T``. A selector that scores tokens by attention sets
    ``needs_queries = True`` and implements ``_select(k, v, budget, q=q, scale=scale)``: ``q (Hkv, g·T, d)`` are
    the post-RoPE prefill queries of each row's KV head (its ``g`` query heads, each over positions ``0 .. T-1``),
    ``scale`` the layer's softmax scale; both doors pass them (:func:`kvsplice.select.cache.choose_tokens`).
    """

    name = "base"
    needs_queries = False

    def __init_subclass__(cls, **kw) -> None:
        super().__init_subclass__(**kw)
        if "name" in cls.__dict__:
            register("selector", cls)

    def spec(self) -> dict:
        """``{"name": ..., **arguments that differ from their defaults}``: :func:`make_selector` rebuilds it."""
        return spec_of(self)

    def __init__(self, seed: int = 0) -> None:
        self.seed = int_arg("seed", seed, 0, 2 ** 63 - 1)
        self.generator = torch.Generator().manual_seed(seed)

    def reseed(self, seed: Optional[int] = None) -> "TokenSelector":
        self.generator = torch.Generator().manual_seed(self.seed if seed is None else seed)
        return self

    def select(self, k: torch.Tensor, v: torch.Tensor, budget: int, *, q: Optional[torch.Tensor] = None,
               scale: Optional[float] = None) -> tuple[torch.Tensor, torch.Tensor]:
        h, t = self._check(k, v, budget)
        if budget >= t:
            return _keep_all(h, t, k)
        if self.needs_queries:
            if q is None or q.shape[0] != h or q.shape[-1] != k.shape[-1] or q.shape[1] % t:
                raise ValueError(f"{type(self).__name__} needs the queries q (Hkv, g·T, d) = ({h}, g·{t}, "
                                 f"{k.shape[-1]}), got {None if q is None else tuple(q.shape)}")
            idx, logw = self._select(k, v, budget, q=q, scale=scale)
        else:
            idx, logw = self._select(k, v, budget)
        assert idx.shape == (h, budget) and logw.shape == (h, budget), (idx.shape, logw.shape)
        return idx, logw

    def _select(self, k: torch.Tensor, v: torch.Tensor, budget: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    @staticmethod
    def _check(k: torch.Tensor, v: torch.Tensor, budget: int) -> tuple[int, int]:
        if k.dim() != 3 or v.dim() != 3 or k.shape[:2] != v.shape[:2]:
            raise ValueError(f"select takes k (Hkv, T, d), v (Hkv, T, dv); got {tuple(k.shape)}, {tuple(v.shape)}")
        if budget < 1:
            raise ValueError(f"budget must be >= 1, got {budget}")
        return k.shape[0], k.shape[1]

    def __repr__(self) -> str:
        fields = ", ".join(f"{a}={getattr(self, a)!r}" for a in getattr(self, "_fields", ()))
        return f"{type(self).__name__}({fields})"


def _keep_all(h: int, t: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    idx = torch.arange(t, device=like.device).expand(h, t).contiguous()
    return idx, torch.zeros(h, t, dtype=torch.float32, device=like.device)


def _sinks_recent(h: int, t: int, n_sink: int, n_recent: int, device) -> torch.Tensor:
    idx = torch.cat([torch.arange(n_sink, device=device), torch.arange(t - n_recent, t, device=device)])
    return idx.expand(h, -1).contiguous()


def split_sink_recent(t: int, budget: int, n_sink: int, n_recent: int) -> tuple[int, int]:
    """``(sinks, recent)`` that fit ``budget < t`` tokens: sinks first, then the recent window (each clipped)."""
    s = min(n_sink, budget)
    r = min(n_recent, budget - s)
    return s, r


class StreamingLLMSelector(TokenSelector):
    """StreamingLLM (Xiao et al.): the first ``n_sink`` tokens + the most recent ``budget - n_sink``; weights 0."""

    name = "streaming_llm"
    _fields = ("n_sink",)

    def __init__(self, n_sink: int = 4, seed: int = 0) -> None:
        super().__init__(seed)
        self.n_sink = int_arg("n_sink", n_sink)

    def _select(self, k, v, budget):
        h, t = k.shape[:2]
        s = min(self.n_sink, budget)
        idx = _sinks_recent(h, t, s, budget - s, k.device)
        return idx, torch.zeros(idx.shape, dtype=torch.float32, device=k.device)


class UniformSelector(TokenSelector):
    """Sinks + recent window intact; the rest of the budget sampled uniformly (per head, without replacement) from
    the middle, each sample with log-weight ``ln(n_middle / n_sampled)``."""

    name = "uniform"
    _fields = ("n_sink", "n_recent", "seed")

    def __init__(self, n_sink: int = 4, n_recent: int = 16, seed: int = 0) -> None:
        super().__init__(seed)
        self.n_sink, self.n_recent = int_arg("n_sink", n_sink), int_arg("n_recent", n_recent)

    def _select(self, k, v, budget):
        h, t = k.shape[:2]
        s, r = split_sink_recent(t, budget, self.n_sink, self.n_recent)
        n_mid, n_samp = t - s - r, budget - s - r
        fixed = _sinks_recent(h, t, s, r, k.device)
        if n_samp == 0:
            return fixed, torch.zeros(fixed.shape, dtype=torch.float32, device=k.device)
        noise = torch.rand(h, n_mid, generator=self.generator).to(k.device)
        mid = s + torch.topk(noise, n_samp, dim=1).indices  # uniform subset per head
        idx = torch.cat([fixed, mid], dim=1)
        logw = torch.cat([torch.zeros(h, s + r), torch.full((h, n_samp), math.log(n_mid / n_samp))], dim=1)
        order = torch.argsort(idx, dim=1)
        return torch.gather(idx, 1, order), torch.gather(logw.to(k.device), 1, order)


def balance_plan(t: int, budget: int, n_sink: int, n_recent: int,
                 n_halvings: Optional[int] = None) -> tuple[int, list[tuple[int, int, int]]]:
    """How BalanceKV keeps exactly ``budget < t`` tokens: ``(sinks, segments)`` with segments
    ``(start, length, halvings)`` tiling the middle after the sinks; everything after the last segment stays intact.

    ``R = t - budget`` tokens must go. A segment of ``2^j·a`` tokens halved ``j`` times removes ``a·(2^j - 1)``, so
    ``R`` is written greedily as ``Σ_j a_j (2^j - 1)`` for ``j = T, T-1, ..., 1`` (the remainder after level ``j``
    is below ``2^j - 1``, so the lower digits are small). Segments go from the most halved (oldest tokens) to the
    least, then the intact recent window. The middle spans ``R + Σ a_j`` tokens; the smallest ``T`` for which it
    fits between the sinks and an intact window of ``n_recent`` is used (unless ``n_halvings`` fixes ``T``); if none
    fits, the tightest plan with a shorter intact window; if even that does not fit, or ``sinks + n_recent >= budget``,
    the plan is plain sinks + recent: ``segments == []``.
    """
    s = min(n_sink, budget)
    if s + n_recent >= budget:
        return s, []
    r_total = t - budget
    m_max = t - s - n_recent
    t_range = [n_halvings] if n_halvings is not None else range(1, max(2, t).bit_length() + 1)
    best = None  # (middle span, digits) of the tightest T
    for T in t_range:
        if T < 1:
            raise ValueError(f"n_halvings must be >= 1, got {T}")
        digits, rem = [], r_total
        for j in range(T, 0, -1):
            a, rem = divmod(rem, 2 ** j - 1)
            digits.append((j, a))
        span = r_total + sum(a for _, a in digits)
        if span <= m_max:  # fits with the full intact window
            best = (span, digits)
            break
        if best is None or span < best[0]:
            best = (span, digits)
    if best[0] > t - s:  # not even with no intact window: sinks + recent
        return s, []
    segs, start = [], s
    for j, a in best[1]:
        if a:
            segs.append((start, (2 ** j) * a, j))
            start += (2 ** j) * a
    return s, segs


class BalanceKVSelector(TokenSelector):
    """BalanceKV, the practical block-parallel variant: sinks + recent intact, the middle halved ``T`` times in
    blocks of ``block_size`` by the self-balancing walk (:func:`kvsplice.select.balance.block_balance`).

    ``T`` (``n_halvings``) defaults to the fewest halvings that reach the budget; the intact recent window is at
    least ``n_recent`` and grows to use the budget exactly (:func:`balance_plan`). The walk's kernel is
    ``exp(kernel_temp·⟨k,k'⟩/√d)·(⟨v,v'⟩ + mean‖v‖²)`` on per-block centred keys, threshold
    ``c = c_scale·median κ(x,x)`` per block (``c_scale = inf``: coin-flip halving, the ablation).
    """

    name = "balancekv"
    _fields = ("n_sink", "n_recent", "block_size", "n_halvings", "c_scale", "kernel_temp", "seed")

    def __init__(self, n_sink: int = 4, n_recent: int = 16, block_size: int = 64, n_halvings: Optional[int] = None,
                 c_scale: float = 1.0, kernel_temp: float = 1.0, center: bool = True, seed: int = 0) -> None:
        super().__init__(seed)
        self.n_sink, self.n_recent = int_arg("n_sink", n_sink), int_arg("n_recent", n_recent)
        self.block_size = int_arg("block_size", block_size, 2)
        if self.block_size % 2:
            raise ValueError(f"block_size must be an even number >= 2, got {block_size}")
        self.n_halvings = int_arg("n_halvings", n_halvings, 1, MAX_HALVINGS, optional=True)
        self.c_scale = float_arg("c_scale", c_scale, inf_ok=True)  # inf: coin-flip halving (the ablation)
        self.kernel_temp = float_arg("kernel_temp", kernel_temp)
        self.center = bool_arg("center", center)

    def _select(self, k, v, budget):
        h, t = k.shape[:2]
        s, segs = balance_plan(t, budget, self.n_sink, self.n_recent, self.n_halvings)
        if not segs:  # nothing to balance: sinks + recent
            idx = _sinks_recent(h, t, s, budget - s, k.device)
            return idx, torch.zeros(idx.shape, dtype=torch.float32, device=k.device)
        zeros = lambda n: torch.zeros(h, n, device=k.device)  # noqa: E731
        idx = [torch.arange(s, device=k.device).expand(h, s)]
        logw = [zeros(s)]
        for a, m, T in segs:
            mid, lvl = block_balance(k[:, a:a + m], v[:, a:a + m], T, self.block_size, c_scale=self.c_scale,
                                     scale=self.kernel_temp / math.sqrt(k.shape[-1]), center=self.center,
                                     generator=self.generator)
            idx.append(a + mid)
            logw.append(lvl.to(torch.float32) * LN2)
        end = segs[-1][0] + segs[-1][1]
        idx.append(torch.arange(end, t, device=k.device).expand(h, t - end))
        logw.append(zeros(t - end))
        return torch.cat(idx, dim=1), torch.cat(logw, dim=1)


def make_selector(name: str, **kw) -> TokenSelector:
    """A selector by its ``name`` (:data:`SELECTORS`); an unknown name or argument is a one-line ``ValueError``
    (each selector checks its arguments' types and ranges itself)."""
    if not isinstance(name, str) or name not in SELECTORS:
        raise ValueError(f"selector must be one of {sorted(SELECTORS)}, got {name!r}")
    cls = SELECTORS[name]
    try:
        return cls(**kw)
    except TypeError as e:  # an argument it does not take
        takes = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
        raise ValueError(f"selector {name} takes {', '.join(takes)}; got {sorted(map(str, kw))} ({e})") from None


__all__ = ["BalanceKVSelector", "SELECTORS", "StreamingLLMSelector", "TokenSelector", "UniformSelector",
           "balance_plan", "make_selector", "split_sink_recent"]
