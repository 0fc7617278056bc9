"""The chunked cache: exact at full rank, ≡ naive softmax over the reconstructed K̂/V̂ at low rank, the online rule,
bytes, merging, and agreement with the §3.5 bounds."""

import math

import pytest
import torch

from kvsplice.core.bounds import attention_error_report
from kvsplice.online.chunked import ChunkedCache
from kvsplice.online.attention import chunked_attention
from kvsplice.report.memory import measure_cache
from models.attention import attend, causal_mask

B, HKV, HQ, D = 2, 2, 4, 8
SIZES = (5, 3, 1, 7, 2, 11, 1, 1, 9)  # prefill, then multi-token chunks and single-token decode steps




def low_rank_stream(t: int, d: int, rank: int, noise: float, seed: int, drift: bool = True):
    """(B, HKV, T, d) keys/values living near a rank-``rank`` subspace that drifts halfway (so residuals jump)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(2):
        w1 = torch.randn(B, HKV, rank, d, generator=gen)
        w2 = torch.randn(B, HKV, rank, d, generator=gen) if drift else w1
        c = torch.randn(B, HKV, t, rank, generator=gen)
        x = torch.cat([c[..., : t // 2, :] @ w1, c[..., t // 2 :, :] @ w2], -2)
        out.append(x + noise * torch.randn(B, HKV, t, d, generator=gen))
    return out


def run(cache, k, v, q, sizes=SIZES, scale=0.4, reference="raw"):
    """Append ``k, v`` in ``sizes`` steps; after each compare chunked_attention with attend() over raw or K̂/V̂."""
    start, worst = 0, 0.0
    for n in sizes:
        cache.append(0, k=k[:, :, start : start + n], v=v[:, :, start : start + n])
        start += n
        assert cache.seq_len == start
        qs = q[:, :, start - n : start]
        out = chunked_attention(cache, 0, qs, scale)
        if reference == "raw":
            ref = attend(qs.double(), k[:, :, :start].double(), v[:, :, :start].double(), scale=scale)
        else:
            kh, vh = cache.reconstruct(0)
            ref = attend(qs.double(), kh.double(), vh.double(), scale=scale)
        assert out.shape == (B, HQ, n, v.shape[-1]) and out.dtype == q.dtype
        worst = max(worst, (out.double() - ref).abs().max().item())
    return worst


@pytest.mark.parametrize("granularity", ["head", "layer"])
@pytest.mark.parametrize("warmup", [0, 4])
def test_full_rank_is_exact_attention(granularity, warmup):
    """r = d: every token fits its chunk's basis (residual ~1e-7), chunks close only at L; output ≡ exact attention."""
    gen = torch.Generator().manual_seed(0)
    t = sum(SIZES)
    k, v = torch.randn(B, HKV, t, D, generator=gen), torch.randn(B, HKV, t, D, generator=gen)
    q = torch.randn(B, HQ, t, D, generator=gen)
    cache = ChunkedCache(1, HKV, D, B, rank_k=D, max_chunk_len=6, warmup=warmup, tau_k=1e-3, tau_v=1e-3,
                         granularity=granularity)
    assert run(cache, k, v, q) <= 1e-5
    rest = t - warmup
    expect = ([warmup] if warmup else []) + [6] * (rest // 6) + ([rest % 6] if rest % 6 else [])
    assert all(lengths == expect for lengths in cache.chunk_lengths(0))
    # τ = 0: rounding-level residuals (~1e-7) close a chunk at almost every token; each chunk is still exact
    zero = ChunkedCache(1, HKV, D, B, rank_k=D, max_chunk_len=6, warmup=warmup, tau_k=0.0, tau_v=0.0,
                        granularity=granularity)
    assert run(zero, k, v, q) <= 1e-5


@pytest.mark.parametrize("granularity", ["head", "layer"])
@pytest.mark.parametrize("shared", [False, True])
def test_low_rank_equals_naive_softmax_over_reconstruction(granularity, shared):
    t = sum(SIZES)
    k, v = low_rank_stream(t, D, rank=3, noise=0.05, seed=1)
    q = torch.randn(B, HQ, t, D, generator=torch.Generator().manual_seed(2))
    cache = ChunkedCache(1, HKV, D, B, rank_k=3, rank_v=4, ell=6, max_chunk_len=12, warmup=3, tau_k=0.3, tau_v=0.3,
                         shared_value_basis=shared, granularity=granularity)
    assert run(cache, k, v, q, reference="reconstruction") <= 1e-5
    counts = cache.num_chunks(0)
    assert max(counts) > 4  # residual closes happened, not only length closes
    kh, vh = cache.reconstruct(0)
    torch.testing.assert_close(kh[:, :, :3], k[:, :, :3], atol=1e-6, rtol=0)  # the warm-up chunk is exact
    assert (kh - k).norm(dim=-1).max() > 1e-3  # and the rest is really compressed


def test_online_rule_thresholds_lengths_and_no_reprojection():
    t = 60
    k, v = low_rank_stream(t, D, rank=2, noise=0.02, seed=3)
    tau = 0.15
    cache = ChunkedCache(1, HKV, D, B, rank_k=2, rank_v=2, ell=4, max_chunk_len=10, warmup=5, tau_k=tau, tau_v=tau)
    cache.append(0, k=k[:, :, :30], v=v[:, :, :30])
    snapshot = [[(c.a.clone(), c.b.clone(), c.bk.clone() if c.bk is not None else None) for c in s.closed]
                for s in cache.streams(0)]
    for i in range(30, t):
        cache.append(0, k=k[:, :, i : i + 1], v=v[:, :, i : i + 1])
    kh, vh = cache.reconstruct(0)
    for s, snap in zip(cache.streams(0), snapshot):
        b, h = s.sel
        chunks = s.chunks()
        assert chunks[0].n == 5 and chunks[0].bk is None  # warm-up
        assert all(c.n <= 10 for c in chunks) and sum(c.n for c in chunks) == t
        assert [c.start for c in chunks] == [sum(c2.n for c2 in chunks[:j]) for j in range(len(chunks))]
        for c in chunks[1:]:
            # every token after a chunk's first fits the chunk's bases within τ
            rk = (k[b, h, c.start + 1 : c.start + c.n] - kh[b, h, c.start + 1 : c.start + c.n]).norm(dim=-1)
            rv = (v[b, h, c.start + 1 : c.start + c.n] - vh[b, h, c.start + 1 : c.start + c.n]).norm(dim=-1)
            assert (rk <= tau + 1e-5).all() and (rv <= tau + 1e-5).all()
            # a chunk shorter than L closed because the next token exceeded τ on its bases
            if c is not chunks[-1] and c.n < 10:
                nxt = c.start + c.n
                x, y = k[b, h, nxt], v[b, h, nxt]
                res_k = (x - c.bk @ (c.bk.T @ x)).norm()
                res_v = (y - c.be @ (c.be.T @ y)).norm()
                assert max(res_k, res_v) > tau
            assert torch.allclose(c.bk.T @ c.bk, torch.eye(2), atol=1e-5)
        for c, (a, bb, bk) in zip(s.closed, snap):  # closed chunks were never touched again
            assert torch.equal(c.a, a) and torch.equal(c.b, bb)
            assert (c.bk is None and bk is None) or torch.equal(c.bk, bk)
        # recorded residual maxima bound the true ones
    rk_max, rv_max = cache.residual_maxima(0)
    assert ((k - kh).norm(dim=-1).amax(-1) <= rk_max + 1e-5).all()
    assert ((v - vh).norm(dim=-1).amax(-1) <= rv_max + 1e-5).all()


def test_relative_threshold_and_same_chunks_for_any_append_split():
    t = 40
    k, v = low_rank_stream(t, D, rank=3, noise=0.05, seed=4)
    kw = dict(rank_k=3, rank_v=3, ell=5, max_chunk_len=9, warmup=2, tau_k=0.05, tau_v=0.05, relative=True)
    one = ChunkedCache(1, HKV, D, B, **kw)
    one.append(0, k=k, v=v)
    steps = ChunkedCache(1, HKV, D, B, **kw)
    for i in range(t):
        steps.append(0, k=k[:, :, i : i + 1], v=v[:, :, i : i + 1])
    assert one.chunk_lengths(0) == steps.chunk_lengths(0)
    kh1, _ = one.reconstruct(0)
    kh2, _ = steps.reconstruct(0)
    torch.testing.assert_close(kh1, kh2, atol=1e-5, rtol=0)
    # relative rule: ‖k − k̂‖ ≤ τ ‖k‖ for tokens after a chunk's first
    for s in one.streams(0):
        b, h = s.sel
        for c in s.chunks()[1:]:
            sl = slice(c.start + 1, c.start + c.n)
            assert ((k[b, h, sl] - kh1[b, h, sl]).norm(dim=-1) <= 0.05 * k[b, h, sl].norm(dim=-1) + 1e-5).all()


@pytest.mark.parametrize("shared", [False, True])
def test_nbytes_counts_coefficients_bases_and_sketch(shared):
    t = 37
    k, v = low_rank_stream(t, D, rank=3, noise=0.1, seed=5)
    cache = ChunkedCache(1, HKV, D, B, rank_k=3, rank_v=2, ell=4, max_chunk_len=8, warmup=4, tau_k=0.4, tau_v=0.4,
                         shared_value_basis=shared, dtype=torch.float16)
    cache.append(0, k=k[:, :, :20], v=v[:, :, :20])
    for i in range(20, t):
        cache.append(0, k=k[:, :, i : i + 1], v=v[:, :, i : i + 1])
    el = 2  # fp16
    parts = cache.nbytes_breakdown()
    coeff = basis_k = basis_v = 0
    for s in cache.streams(0):
        for c in s.chunks():
            rk, rv = (D, D) if c.bk is None else (3, 2)
            coeff += c.n * (rk + rv) * el
            basis_k += 0 if c.bk is None else D * 3 * el
            basis_v += 0 if c.be is None or shared else D * 2 * el
        basis_v += D * 2 * el if shared else 0
    sketch = 2 * (2 * 4 * D * 4) * B * HKV  # two fp32 sketches (keys, values) of 2ℓ × d per sequence and head
    assert parts["key_coefficients"] + parts["value_coefficients"] == coeff
    assert parts["key_bases"] == basis_k and parts["value_bases"] == basis_v and parts["sketch"] == sketch
    assert parts["key_bases"] > 0 and parts["value_bases"] > 0
    assert cache.nbytes() == sum(parts.values()) == sum(x.numel() * x.element_size() for x in cache.tensors())
    m = measure_cache(cache)
    assert m.live_bytes == cache.nbytes()
    assert m.storage_bytes == cache.storage_nbytes() >= cache.nbytes()  # + the active chunk's unused buffer tail
    cache.reset()
    assert cache.seq_len == 0 and cache.nbytes() == parts["sketch"]  # the (zeroed) sketches stay allocated


def test_merge_caps_chunk_count_and_stays_consistent():
    t = sum(SIZES) * 2
    k, v = low_rank_stream(t, D, rank=3, noise=0.05, seed=6)
    q = torch.randn(B, HQ, t, D, generator=torch.Generator().manual_seed(7))
    cache = ChunkedCache(1, HKV, D, B, rank_k=4, rank_v=4, ell=6, max_chunk_len=4, warmup=3, tau_k=0.5, tau_v=0.5,
                         max_chunks=4)
    assert run(cache, k, v, q, sizes=SIZES * 2, reference="reconstruction") <= 1e-5
    for s in cache.streams(0):
        assert len(s.closed) - 1 <= 4  # warm-up + at most J_max closed chunks
        assert s.closed[0].warmup and s.closed[0].n == 3
        assert sum(c.n for c in s.chunks()) == t
    kh, vh = cache.reconstruct(0)
    rk_max, rv_max = cache.residual_maxima(0)
    assert ((k - kh).norm(dim=-1).amax(-1) <= rk_max + 1e-5).all()  # merge re-projection is inside the bound
    assert ((v - vh).norm(dim=-1).amax(-1) <= rv_max + 1e-5).all()


def test_given_shared_value_basis_and_low_precision():
    t = sum(SIZES)
    k, v = low_rank_stream(t, D, rank=3, noise=0.05, seed=8)
    q = torch.randn(B, HQ, t, D, generator=torch.Generator().manual_seed(9))
    e = torch.linalg.qr(torch.randn(HKV, D, 5))[0]
    kw = dict(rank_k=3, rank_v=5, ell=6, max_chunk_len=7, warmup=2, tau_k=0.3, value_bases=[e])
    c32 = ChunkedCache(1, HKV, D, B, **kw)
    assert run(c32, k, v, q, reference="reconstruction") <= 1e-5
    for s in c32.streams(0):
        assert all(c.be is s.shared_e for c in s.chunks()[1:])
        torch.testing.assert_close(s.shared_e, e[s.sel[1]])
    for dtype, tol in ((torch.float16, 2e-2), (torch.bfloat16, 1e-1)):
        c16 = ChunkedCache(1, HKV, D, B, dtype=dtype, **kw)
        worst = run(c16, k.to(dtype), v.to(dtype), q.to(dtype), reference="reconstruction")
        assert worst <= tol
        o16 = chunked_attention(c16, 0, q[:, :, -3:].to(dtype), 0.4)
        assert torch.isfinite(o16).all()


def test_errors_match_bounds_on_the_cache():
    t = 48
    k, v = low_rank_stream(t, D, rank=3, noise=0.1, seed=10)
    q = torch.randn(B, HQ, 5, D, generator=torch.Generator().manual_seed(11))
    cache = ChunkedCache(1, HKV, D, B, rank_k=3, rank_v=3, ell=6, max_chunk_len=16, warmup=4, tau_k=0.4, tau_v=0.4)
    cache.append(0, k=k, v=v)
    kh, vh = cache.reconstruct(0)
    g = HQ // HKV
    rep = attention_error_report(q.view(B, HKV, g * 5, D), k, v, kh, vh, scale=0.4,
                                 mask=causal_mask(5, t, q.device).repeat(g, 1))
    assert (rep["logit_err"] <= rep["logit_bound"] + 1e-6).all()
    assert (rep["softmax_l1"] <= rep["softmax_bound"] + 1e-6).all()
    assert (rep["output_err"] <= rep["output_bound"] + 1e-6).all()
    out = chunked_attention(cache, 0, q, 0.4).double()
    exact = attend(q.double(), k.double(), v.double(), scale=0.4)
    assert ((out - exact).norm(dim=-1).view(B, HKV, g * 5) <= rep["output_bound"] + 1e-5).all()


def test_bad_shapes():
    cache = ChunkedCache(2, HKV, D, B, rank_k=3)
    with pytest.raises(ValueError):
        cache.append(0, k=torch.zeros(B, HKV, 1, D + 1), v=torch.zeros(B, HKV, 1, D))
    with pytest.raises(KeyError):
        cache.append(0, c=torch.zeros(B, 1, D))
    with pytest.raises(ValueError):
        ChunkedCache(1, HKV, D, B, rank_k=D + 1)
    cache.append(0, k=torch.zeros(B, HKV, 2, D), v=torch.zeros(B, HKV, 2, D))
    with pytest.raises(ValueError):
        chunked_attention(cache, 0, torch.zeros(B, HQ, 3, D), 1.0)  # more queries than cached tokens
    assert cache.seq_len == 0 and cache.layer_len(0) == 2  # layer 1 is still empty
    assert math.isfinite(cache.elements_per_token())


@pytest.mark.parametrize("granularity", ["head", "layer"])
def test_fit_first_token_min_chunk_len_and_decay(granularity):
    t = 80
    k, v = low_rank_stream(t, D, rank=3, noise=0.05, seed=12)
    q = torch.randn(B, HQ, t, D, generator=torch.Generator().manual_seed(13))
    tau = 0.3
    kw = dict(rank_k=3, rank_v=3, ell=6, max_chunk_len=16, warmup=3, tau_k=tau, tau_v=tau, granularity=granularity)
    # fit_first_token: the closing token is represented exactly by its fresh bases → every token has ρ ≤ τ
    fit = ChunkedCache(1, HKV, D, B, fit_first_token=True, fd_decay=0.9, **kw)
    assert run(fit, k, v, q, sizes=(20, 1, 1, 30, 3, 25), reference="reconstruction") <= 1e-5
    kh, vh = fit.reconstruct(0)
    assert (k - kh).norm(dim=-1).max() <= tau + 1e-4 and (v - vh).norm(dim=-1).max() <= tau + 1e-4
    rk, rv = fit.residual_maxima(0)
    assert (rk <= tau + 1e-4).all() and (rv <= tau + 1e-4).all()
    for s in fit.streams(0):
        for c in s.chunks()[1:]:
            torch.testing.assert_close(c.bk.float().transpose(-1, -2) @ c.bk.float(), torch.eye(3).expand_as(
                c.bk.transpose(-1, -2) @ c.bk), atol=1e-5, rtol=0)
    # min_chunk_len: no residual close before a chunk holds m tokens (at the price of larger residuals)
    m = 6
    lazy = ChunkedCache(1, HKV, D, B, min_chunk_len=m, **kw)
    assert run(lazy, k, v, q, sizes=(20, 1, 1, 30, 3, 25), reference="reconstruction") <= 1e-5
    for lengths in lazy.chunk_lengths(0):
        assert all(n >= m for n in lengths[1:-1])
    eager = ChunkedCache(1, HKV, D, B, **kw)
    eager.append(0, k=k, v=v)
    assert max(eager.num_chunks(0)) > max(lazy.num_chunks(0))
    with pytest.raises(ValueError):
        ChunkedCache(1, HKV, D, B, rank_k=3, min_chunk_len=0)


@pytest.mark.parametrize("rank", [D, 3])
def test_truncate_rolls_back_and_appending_continues(rank):
    t = 30
    k, v = low_rank_stream(t, D, rank=3, noise=0.05, seed=14)
    q = torch.randn(B, HQ, t, D, generator=torch.Generator().manual_seed(15))
    cache = ChunkedCache(1, HKV, D, B, rank_k=rank, ell=6, max_chunk_len=5, warmup=3, tau_k=0.3, tau_v=0.3,
                         max_chunks=3)
    cache.append(0, k=k[:, :, :20], v=v[:, :, :20])
    full_bytes = cache.nbytes()
    for n in (19, 12, 3, 2):
        cache.truncate(n)
        assert cache.seq_len == n and all(sum(lens) == n for lens in cache.chunk_lengths(0))
    assert cache.nbytes() < full_bytes
    # re-append one token at a time from 2: still ≡ attention over the reconstruction (exact attention at full rank)
    worst = run_from(cache, k, v, q, 2, sizes=[1] * 10 + [7, 1], reference="raw" if rank == D else "reconstruction")
    assert worst <= 1e-5
    cache.truncate(0)
    assert cache.seq_len == 0 and cache.chunk_lengths(0) == [[]] * (B * HKV)
    with pytest.raises(ValueError):
        cache.truncate(1)


def run_from(cache, k, v, q, start, sizes, reference):
    worst = 0.0
    for n in sizes:
        cache.append(0, k=k[:, :, start : start + n], v=v[:, :, start : start + n])
        start += n
        qs = q[:, :, start - n : start]
        out = chunked_attention(cache, 0, qs, 0.4).double()
        kk, vv = (k[:, :, :start], v[:, :, :start]) if reference == "raw" else cache.reconstruct(0)
        worst = max(worst, (out - attend(qs.double(), kk.double(), vv.double(), scale=0.4)).abs().max().item())
    return worst
