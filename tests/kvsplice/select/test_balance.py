"""BalanceKV: the self-balancing walk, MergeAndReduce, the estimator, the block-parallel variant, the selectors."""

import math

import pytest
import torch

from kvsplice.select.balance import (
    LN2, MergeAndReduce, WalkFailure, balance_kv, block_balance, discrepancy, halving_counts, kernel_diag,
    merge_and_reduce, softmax_balance, value_norm_buckets,
)
from kvsplice.select.selectors import (
    BalanceKVSelector, StreamingLLMSelector, UniformSelector, balance_plan, make_selector,
)




def low_dim(h, n, d=4, dv=4, key_scale=0.5, seed=0):
    """Points whose kernel features have low effective dimension, so n >> dim and balancing is possible."""
    g = torch.Generator().manual_seed(seed)
    return key_scale * torch.randn(h, n, d, generator=g), torch.randn(h, n, dv, generator=g)


def exact_attention(q, k, v, scale):
    return torch.softmax((q.double() @ k.double().T) * scale, -1) @ v.double()


# ------------------------------------------------------------------------------------------------- walk
@pytest.mark.parametrize("use_values", [True, False])
def test_walk_balances_far_better_than_random_signs(use_values):
    k, v = low_dim(7, 256)  # 7 independent instances ("seeds"), walked in lockstep
    vals = v if use_values else None
    res = softmax_balance(k, vals, threshold="median", c_scale=1.0, on_fail="clamp",
                          generator=torch.Generator().manual_seed(1))
    assert res.signs.shape == (7, 256) and set(res.signs.unique().tolist()) <= {-1.0, 1.0}
    rnd = torch.randint(0, 2, (7, 256), generator=torch.Generator().manual_seed(2)).double() * 2 - 1
    ratio = discrepancy(k, vals, res.signs) / discrepancy(k, vals, rnd)
    assert ratio.median() < 0.5, ratio
    # the kept side is the smaller half
    assert bool((res.keep.sum(-1) <= 128).all())
    assert torch.equal(res.keep, res.signs == torch.where((res.signs > 0).sum(-1, keepdim=True) < 128, 1.0, -1.0))


def test_walk_paper_threshold_and_failure_modes():
    k, v = low_dim(3, 96)
    res = softmax_balance(k, v, generator=torch.Generator().manual_seed(0))  # the paper's c = 30 log(n/δ) max‖φ‖²
    expect_c = 30 * math.log(96 / 0.01) * kernel_diag(k.double(), v.double(), 0.5, 0.0).amax(-1)
    torch.testing.assert_close(res.c, expect_c)
    assert not bool(res.failed.any()) and res.restarts == 0
    with pytest.raises(WalkFailure):
        softmax_balance(k, v, c=1e-6, on_fail="raise", max_restarts=1, generator=torch.Generator().manual_seed(0))
    clamped = softmax_balance(k, v, c=1e-6, on_fail="clamp", generator=torch.Generator().manual_seed(0))
    assert bool(clamped.failed.all())  # greedy steps beyond the threshold are counted
    half = softmax_balance(k, v, c=1e-6, on_fail="clamp", exact_half=True, generator=torch.Generator().manual_seed(0))
    assert torch.equal((half.signs > 0).sum(-1), torch.full((3,), 48))
    assert isinstance(res.indices(), list) and len(res.indices()) == 3
    one = softmax_balance(k[0], v[0], generator=torch.Generator().manual_seed(0))
    assert one.indices().dim() == 1


# -------------------------------------------------------------------------------------- merge and reduce
def test_merge_and_reduce_never_exceeds_its_memory_bound():
    k, v = low_dim(1, 600, seed=3)
    k, v = k[0], v[0]
    every_other = lambda kk, vv: torch.arange(kk.shape[0]) % 2 == 0  # noqa: E731 — an exact halving
    mr = MergeAndReduce(t=16, T=3, reduce=every_other)
    g = torch.Generator().manual_seed(0)
    start = 0
    while start < 600:
        m = int(torch.randint(1, 40, (1,), generator=g))
        mr.push(k[start:start + m], v[start:start + m])
        start += m
        assert mr.held <= mr.bound and mr.max_held <= mr.bound
    assert mr.n_seen == 600 and mr.max_held <= (3 + 1) * 16 + 600 // 8
    idx, kk, vv, lvl = mr.result()
    # every input token is represented exactly once in weight: Σ 2^level == n
    assert int((2 ** lvl).sum()) == 600
    assert mr.n_final <= 600 // 8 and torch.equal(kk, k[idx]) and torch.equal(vv, v[idx])
    assert bool((idx[1:] > idx[:-1]).all())
    # with the walk as the reducer (smaller half): still within the bound, never more weight than tokens
    walk = merge_and_reduce(((k[i:i + 16], v[i:i + 16]) for i in range(0, 600, 16)), t=16, T=3,
                            threshold="median", on_fail="clamp", generator=torch.Generator().manual_seed(0))
    assert walk.max_held <= walk.bound
    assert int((2 ** walk.result()[3]).sum()) <= 600


# ---------------------------------------------------------------------------------------- the estimator
def test_no_halving_reproduces_exact_attention():
    k, v = low_dim(1, 200, d=8, dv=6, key_scale=1.0, seed=4)
    k, v = k[0], v[0]
    q = torch.randn(5, 8)
    sk = balance_kv(k, v, T=0, t=32)
    assert sk.n_tokens == 200 and int(sk.num_level.abs().sum()) == 0
    torch.testing.assert_close(sk.estimate(q).double(), exact_attention(q, k, v, 8 ** -0.5), atol=1e-6, rtol=0)
    idx, lvl = block_balance(k[None], v[None], 0)
    assert torch.equal(idx[0], torch.arange(200)) and int(lvl.abs().sum()) == 0


def test_balance_kv_estimator_buckets_and_memory():
    k, v = low_dim(1, 384, d=4, dv=4, seed=5)
    k, v = k[0], v[0]
    v[7] = 0.0  # a zero value adds nothing to the numerator and lives in no bucket
    sk = balance_kv(k, v, T=2, t=32, threshold="median", on_fail="clamp", generator=torch.Generator().manual_seed(0))
    buckets = value_norm_buckets(v)
    assert sum(sk.buckets.values()) == 383 and set(sk.buckets) == set(buckets[buckets > -(2 ** 62)].tolist())
    assert 7 not in sk.num_idx.tolist() and sk.n_tokens < 384
    assert sk.max_held <= sk.bound
    # the estimate is exactly the 2^l-weighted ratio over the kept tokens
    q = torch.randn(3, 4, dtype=torch.float64)
    s = 0.5
    wn = 2.0 ** sk.num_level.double() * torch.exp(q @ k[sk.num_idx].double().T * s)
    wd = 2.0 ** sk.den_level.double() * torch.exp(q @ k[sk.den_idx].double().T * s)
    direct = (wn @ v[sk.num_idx].double()) / wd.sum(-1, keepdim=True)
    torch.testing.assert_close(sk.estimate(q), direct, atol=1e-10, rtol=1e-10)


def _sketch_errors(sk, q, k, v, s):
    """Relative errors of the sketch's denominator and numerator (numerator relative to Σ e^{qk}‖v‖, the scale of
    the guarantee: on random values the exact attention output itself is ~0)."""
    e = torch.exp(q @ k.double().T * s)
    wd = 2.0 ** sk.den_level.double() * torch.exp(q @ k[sk.den_idx].double().T * s)
    wn = 2.0 ** sk.num_level.double() * torch.exp(q @ k[sk.num_idx].double().T * s)
    den_err = ((wd.sum(-1) - e.sum(-1)).abs() / e.sum(-1)).mean()
    num_err = ((wn @ v[sk.num_idx].double() - e @ v.double()).norm(dim=-1) / (e @ v.double().norm(dim=-1))).mean()
    return float(den_err), float(num_err)


def test_balance_kv_beats_random_halving():
    """Same MergeAndReduce, same T and t: the walk's halves vs coin-flip halves (c = ∞)."""
    k, v = low_dim(1, 384, d=4, dv=4, seed=5)
    k, v = k[0], v[0]
    q = torch.randn(50, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    errs = {}
    for name, kw in {"walk": dict(threshold="median", on_fail="clamp"), "random": dict(c=1e300)}.items():
        runs = [_sketch_errors(balance_kv(k, v, T=2, t=32, generator=torch.Generator().manual_seed(seed), **kw),
                               q, k, v, 0.5) for seed in range(3)]
        errs[name] = [sum(r[i] for r in runs) / len(runs) for i in range(2)]
    assert errs["walk"][0] < 0.5 * errs["random"][0], errs  # denominator
    assert errs["walk"][1] < 0.5 * errs["random"][1], errs  # numerator


# ----------------------------------------------------------------------------------------- block-parallel
def test_block_balance_halves_exactly_per_block():
    k, v = low_dim(3, 96, seed=6)
    idx, lvl = block_balance(k, v, 1, block_size=8, generator=torch.Generator().manual_seed(0))
    assert idx.shape == (3, 48) and bool((lvl == 1).all())
    for h in range(3):
        assert bool((idx[h, 1:] > idx[h, :-1]).all())
        assert torch.equal(torch.bincount(idx[h] // 8, minlength=12), torch.full((12,), 4))  # 4 of each block of 8
    idx3, lvl3 = block_balance(k, v, 3, block_size=16, generator=torch.Generator().manual_seed(0))
    assert idx3.shape == (3, 12) and bool((lvl3 == 3).all())
    # odd counts: one token per odd round sits out at its level; Σ 2^level stays the token count
    idx5, lvl5 = block_balance(k[:, :90], v[:, :90], 3, block_size=16, generator=torch.Generator().manual_seed(0))
    surv, left = halving_counts(90, 3)
    assert idx5.shape[1] == surv + sum(left) and bool(((2 ** lvl5).sum(-1) == 90).all())


def test_balance_plan_hits_every_budget_exactly():
    for t in range(2, 130):
        for budget in range(1, t):
            for n_halvings in (None, 1, 3):
                s, segs = balance_plan(t, budget, 4, 16, n_halvings)
                end = segs[-1][0] + segs[-1][1] if segs else None
                kept = s + sum(m >> j for _, m, j in segs) + (t - end if segs else budget - s)
                assert kept == budget, (t, budget, segs)
                assert all(m % 2 ** j == 0 for _, m, j in segs)
                assert all(a0 + m0 == a1 for (a0, m0, _), (a1, _, _) in zip(segs, segs[1:]))


# ----------------------------------------------------------------------------------------------- selectors
def test_streaming_llm_keeps_exactly_sinks_and_recent():
    k, v = low_dim(2, 50)
    idx, logw = StreamingLLMSelector(n_sink=4).select(k, v, 20)
    expect = torch.cat([torch.arange(4), torch.arange(34, 50)])
    assert torch.equal(idx, expect.expand(2, -1)) and bool((logw == 0).all())


def test_selectors_budget_weights_and_full_budget():
    k, v = low_dim(3, 120, seed=7)
    for name in ("balancekv", "uniform", "streaming_llm"):
        sel = make_selector(name)
        idx, logw = sel.select(k, v, 40)
        assert idx.shape == logw.shape == (3, 40)
        for h in range(3):
            assert bool((idx[h, 1:] > idx[h, :-1]).all()) and int(idx[h, 0]) == 0 and int(idx[h, -1]) == 119
        total = logw.double().exp().sum(-1)
        if name == "streaming_llm":
            torch.testing.assert_close(total, torch.full((3,), 40.0, dtype=torch.float64))
        else:  # each kept token stands for e^{logw} tokens: the weights add up to the sequence length
            torch.testing.assert_close(total, torch.full((3,), 120.0, dtype=torch.float64))
        assert bool((logw[:, :4] == 0).all()) and bool((logw[:, -16:] == 0).all())  # sinks and recent exact
        full_idx, full_w = sel.select(k, v, 120)
        assert torch.equal(full_idx, torch.arange(120).expand(3, -1)) and bool((full_w == 0).all())
    idx, logw = UniformSelector(n_sink=4, n_recent=16).select(k, v, 40)
    torch.testing.assert_close(logw[:, 4:24], torch.full((3, 20), math.log(100 / 20)))
    idx, logw = BalanceKVSelector(n_halvings=2).select(k, v, 40)
    assert set((logw / LN2).round().unique().tolist()) <= {0.0, 1.0, 2.0}
