"""SVD-family fits (kvsplice.lowrank.fits) against brute-force optima of their own objectives, on small random problems."""

from __future__ import annotations

import pytest
import torch

from kvsplice.lowrank.bases import HeadBases, KVBases
from kvsplice.lowrank.calibrate import CalibrationStats
from kvsplice.lowrank.fit_errors import (
    bases_errors,
    lesens_gap,
    lesens_gaps,
    lesens_terms,
    reconstruction_error,
    score_error,
    value_error,
)
from kvsplice.lowrank.fits import (
    fit_bases,
    fit_eigen,
    fit_gqa_concat,
    fit_gqa_sum,
    fit_kq,
    fit_ksvd,
    fit_values_wo,
    ksvd_basis,
    oblique_basis,
    select_rank,
)

F64 = torch.float64




def decaying(n: int, d: int, decay: float, seed: int) -> torch.Tensor:
    """(n, d) with singular values ~ decay**i in a random basis."""
    g = torch.Generator().manual_seed(seed)
    rot, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=F64))
    return torch.randn(n, d, generator=g, dtype=F64) @ torch.diag(decay ** torch.arange(d, dtype=F64)) @ rot


def tail(m: torch.Tensor, r: int) -> float:
    """Eckart–Young: ‖M − M_r‖_F."""
    return float(torch.linalg.svdvals(m)[r:].pow(2).sum().sqrt())


def fro(m: torch.Tensor) -> float:
    return float(torch.linalg.norm(m))


@pytest.fixture(scope="module")
def problem():
    """One GQA KV head: keys K, values V, g = 3 query heads Q_h (correlated with each other), W_O slices."""
    d, n, g, dm = 10, 120, 3, 24
    k = decaying(n, d, 0.75, 0)
    base = decaying(n, d, 0.8, 1)
    qs = torch.stack([base + 0.6 * decaying(n, d, 0.7, 10 + i) for i in range(g)])  # (g, n, d)
    v = decaying(n, d, 0.7, 2)
    wo = torch.stack([decaying(dm, d, 0.85, 20 + i) for i in range(g)])  # (g, d_model, d)
    return dict(d=d, k=k, qs=qs, v=v, wo=wo, kk=k.T @ k, vv=v.T @ v, qq_heads=torch.einsum("gnd,gne->gde", qs, qs),
                qsum=qs.sum(0).T @ qs.sum(0))


# ------------------------------------------------------------------------------------------------ brute force
@pytest.mark.parametrize("r", [1, 3, 6])
def test_ksvd_is_eckart_young(problem, r):
    k, v = problem["k"], problem["v"]
    h = fit_ksvd(problem["kk"], problem["vv"], rank=r)
    assert torch.equal(h.k_enc, h.k_dec) and h.rank_k == h.rank_v == r
    torch.testing.assert_close(h.k_enc.T @ h.k_enc, torch.eye(r, dtype=F64))
    assert fro(k - k @ h.k_enc @ h.k_dec.T) == pytest.approx(tail(k, r), rel=1e-9)
    assert fro(v - v @ h.v_enc @ h.v_dec.T) == pytest.approx(tail(v, r), rel=1e-9)
    assert reconstruction_error(problem["kk"], h.k_enc, h.k_dec) == pytest.approx(tail(k, r) / fro(k), rel=1e-9)


@pytest.mark.parametrize("r", [1, 4, 7])
def test_eigen_is_joint_eckart_young(problem, r):
    k, q = problem["k"], problem["qs"].reshape(-1, problem["d"])  # the group's queries, concatenated
    h = fit_eigen(problem["kk"], problem["qq_heads"].sum(0), problem["vv"], rank=r)
    kq = torch.cat([k, q])
    assert fro(kq - kq @ h.k_enc @ h.k_dec.T) == pytest.approx(tail(kq, r), rel=1e-9)
    assert torch.equal(h.v_enc, fit_ksvd(problem["kk"], problem["vv"], rank=r).v_enc)  # values: V-only SVD


def _kq_err(k, q, a, b):
    return fro(k @ q.T - k @ a @ b.T @ q.T)


@pytest.mark.parametrize("r", [1, 2, 4, 7])
def test_kq_is_the_truncated_svd_of_the_scores(problem, r):
    k, q = problem["k"], problem["qs"][0]
    b = oblique_basis(problem["kk"], q.T @ q, rank=r)
    assert _kq_err(k, q, b.enc, b.dec) == pytest.approx(tail(k @ q.T, r), rel=1e-8)
    # whitened coefficients: (K A)ᵀ(K A) = I; spectrum = σ(K Qᵀ)²
    torch.testing.assert_close((k @ b.enc).T @ (k @ b.enc), torch.eye(r, dtype=F64))
    torch.testing.assert_close(b.spectrum, torch.linalg.svdvals(k @ q.T)[: problem["d"]] ** 2, rtol=1e-8, atol=1e-6)
    # the Gram-only error formula agrees with the direct one
    assert score_error(problem["kk"], q.T @ q, b.enc, b.dec) == pytest.approx(_kq_err(k, q, b.enc, b.dec) /
                                                                               fro(k @ q.T), rel=1e-8)


@pytest.mark.parametrize("r", [2, 5])
def test_gqa_sum_and_concat_are_optimal_for_their_objectives(problem, r):
    k, qs = problem["k"], problem["qs"]
    qsum, qcat = qs.sum(0), qs.reshape(-1, problem["d"])
    hs = fit_gqa_sum(problem["kk"], problem["qsum"], problem["vv"], problem["wo"], rank=r)
    hc = fit_gqa_concat(problem["kk"], problem["qq_heads"], problem["vv"], problem["wo"], rank=r)
    e_sum = lambda h: fro(sum(k @ qi.T - k @ h.k_enc @ h.k_dec.T @ qi.T for qi in qs))  # noqa: E731
    e_cat = lambda h: sum(_kq_err(k, qi, h.k_enc, h.k_dec) ** 2 for qi in qs) ** 0.5  # noqa: E731
    assert e_sum(hs) == pytest.approx(tail(k @ qsum.T, r), rel=1e-8)
    assert e_cat(hc) == pytest.approx(tail(k @ qcat.T, r), rel=1e-8)
    assert e_sum(hs) <= e_sum(hc) + 1e-9 and e_cat(hc) <= e_cat(hs) + 1e-9  # each wins on its own objective
    # per-head decoders B_h cannot beat the shared one: for the cached subspace K A, the least-squares B_h
    ka = k @ hc.k_enc
    per_head = sum(fro(k @ qi.T - ka @ torch.linalg.lstsq(ka, k @ qi.T).solution) ** 2 for qi in qs) ** 0.5
    assert per_head == pytest.approx(e_cat(hc), rel=1e-8)


def test_mha_gqa_variants_equal_kq(problem):
    q = problem["qs"][0]
    args = (problem["kk"], q.T @ q, problem["vv"], problem["wo"][0])
    a, b = fit_kq(*args, rank=3), fit_gqa_sum(*args, rank=3)
    c = fit_gqa_concat(problem["kk"], (q.T @ q)[None], problem["vv"], problem["wo"][:1], rank=3)
    for x in (b, c):
        torch.testing.assert_close(x.k_enc @ x.k_dec.T, a.k_enc @ a.k_dec.T)
        torch.testing.assert_close(x.v_enc @ x.v_dec.T, a.v_enc @ a.v_dec.T)


@pytest.mark.parametrize("r", [1, 3, 6])
def test_values_wo_is_the_truncated_svd_of_the_output(problem, r):
    v, wo = problem["v"], problem["wo"]
    wcat = wo.reshape(-1, problem["d"])  # the g heads' slices stacked: target V W_catᵀ
    b = fit_values_wo(problem["vv"], wo, rank=r)
    err = fro(v @ wcat.T - v @ b.enc @ b.dec.T @ wcat.T)
    assert err == pytest.approx(tail(v @ wcat.T, r), rel=1e-8)
    assert value_error(problem["vv"], wo, b.enc, b.dec) == pytest.approx(err / fro(v @ wcat.T), rel=1e-8)
    # a single (d_model, d) slice and a precomputed Gram work too
    one = fit_values_wo(problem["vv"], wo[0], rank=r)
    assert fro(v @ wo[0].T - v @ one.enc @ one.dec.T @ wo[0].T) == pytest.approx(tail(v @ wo[0].T, r), rel=1e-8)
    torch.testing.assert_close(fit_values_wo(problem["vv"], wcat.T @ wcat, rank=r).enc, b.enc)


def test_no_oblique_pair_beats_kq(problem):
    """Random rank-R pairs and gradient descent from random starts never do better than the closed form."""
    k, q = problem["k"], problem["qs"][0]
    r, d = 3, problem["d"]
    ob = oblique_basis(problem["kk"], q.T @ q, rank=r)
    best = _kq_err(k, q, ob.enc, ob.dec)
    g = torch.Generator().manual_seed(5)
    for _ in range(20):
        a, b = torch.randn(d, r, generator=g, dtype=F64), torch.randn(d, r, generator=g, dtype=F64)
        # optimally scaled random pair (least squares in the scalar), still ≥ best
        s_full, s_ab = k @ q.T, k @ a @ b.T @ q.T
        c = float((s_full * s_ab).sum() / (s_ab * s_ab).sum())
        assert fro(s_full - c * s_ab) >= best
    for seed in range(2):
        gg = torch.Generator().manual_seed(100 + seed)
        a = (0.3 * torch.randn(d, r, generator=gg, dtype=F64)).requires_grad_()
        b = (0.3 * torch.randn(d, r, generator=gg, dtype=F64)).requires_grad_()
        opt = torch.optim.Adam([a, b], lr=0.05)
        gk, gq = problem["kk"], q.T @ q
        for _ in range(400):  # ‖K X Qᵀ‖² = tr(Xᵀ G_K X G_Q): same loss, d×d work per step
            opt.zero_grad()
            x = torch.eye(d, dtype=F64) - a @ b.T
            loss = torch.trace(x.T @ gk @ x @ gq)
            loss.backward()
            opt.step()
        gd = _kq_err(k, q, a.detach(), b.detach())
        assert best * (1 - 1e-9) <= gd <= best * 1.01  # descent converges to the closed form, never below it
    # small perturbations of the optimum only make it worse
    for _ in range(10):
        da = 1e-3 * torch.randn(d, r, generator=g, dtype=F64)
        db = 1e-3 * torch.randn(d, r, generator=g, dtype=F64)
        assert _kq_err(k, q, ob.enc + da, ob.dec + db) >= best


# ------------------------------------------------------------------------------------------------ properties
@pytest.mark.parametrize("r", [1, 2, 4, 6, 9])
def test_attention_aware_never_worse_and_lesens_identity(problem, r):
    k, kk = problem["k"], problem["kk"]
    for qi in problem["qs"]:
        s = k @ qi.T
        ob = oblique_basis(kk, qi.T @ qi, rank=r)
        p = ksvd_basis(kk, rank=r).enc
        e_kq2 = _kq_err(k, qi, ob.enc, ob.dec) ** 2
        e_k2 = fro(s - k @ p @ p.T @ qi.T) ** 2
        assert e_kq2 <= e_k2 * (1 + 1e-12)
        gap = lesens_gap(kk, qi.T @ qi, r)
        assert gap >= 0
        assert e_k2 == pytest.approx(e_kq2 + gap, rel=1e-9, abs=1e-9 * fro(s) ** 2)  # err_K-only = err_KQᵀ + ε
        # ε from its definition with explicit factors: Σ_{i≤R} σ_i(M)² − ‖Σ_K[:R] V_K[:, :R]ᵀ V_Q Σ_Q‖_F²
        lk, vk = torch.linalg.eigh(kk)
        lq, vq = torch.linalg.eigh(qi.T @ qi)
        lk, vk, lq, vq = lk.flip(0), vk.flip(1), lq.flip(0).clamp_min(0), vq.flip(1)
        m = torch.diag(lk.sqrt()) @ vk.T @ vq @ torch.diag(lq.sqrt())
        eps = float(torch.linalg.svdvals(m)[:r].pow(2).sum() - m[:r].pow(2).sum())
        assert gap == pytest.approx(eps, rel=1e-8, abs=1e-9 * fro(s) ** 2)
        t = lesens_terms(kk, qi.T @ qi, r)
        assert t["total"] == pytest.approx(fro(s) ** 2, rel=1e-10)
        assert t["err_kq"] == pytest.approx(e_kq2, rel=1e-8, abs=1e-9 * fro(s) ** 2)


def test_full_rank_is_exact(problem):
    k, v, d = problem["k"], problem["v"], problem["d"]
    wcat = problem["wo"].reshape(-1, d)
    qcat = problem["qs"].reshape(-1, d)
    heads = [fit_ksvd(problem["kk"], problem["vv"], rank=d),
             fit_eigen(problem["kk"], problem["qq_heads"].sum(0), problem["vv"], rank=d),
             fit_kq(problem["kk"], qcat.T @ qcat, problem["vv"], problem["wo"], rank=d),
             fit_gqa_sum(problem["kk"], problem["qsum"], problem["vv"], problem["wo"], rank=d),
             fit_gqa_concat(problem["kk"], problem["qq_heads"], problem["vv"], problem["wo"], rank=d)]
    s = k @ qcat.T
    for h in heads:
        assert fro(k @ h.k_enc @ h.k_dec.T @ qcat.T - s) <= 1e-6 * fro(s)
        assert fro(v @ h.v_enc @ h.v_dec.T @ wcat.T - v @ wcat.T) <= 1e-6 * fro(v @ wcat.T)
        assert fro(v @ h.v_enc @ h.v_dec.T - v) <= 1e-6 * fro(v)


def test_rank_deficient_keys_are_regularised():
    """Keys spanning only 4 of 8 dims: Σ_K⁻¹ is a pseudo-inverse, the fit stays finite and exact where it can be."""
    k = decaying(100, 4, 0.8, 7) @ torch.randn(4, 8, generator=torch.Generator().manual_seed(8), dtype=F64)
    q = decaying(100, 8, 0.8, 9)
    for r in (2, 4, 8):
        b = oblique_basis(k.T @ k, q.T @ q, rank=r)
        assert torch.isfinite(b.enc).all() and torch.isfinite(b.dec).all()
        assert _kq_err(k, q, b.enc, b.dec) == pytest.approx(tail(k @ q.T, r), rel=1e-6, abs=1e-9 * fro(k @ q.T))


def test_energy_rank_selection_on_a_known_spectrum():
    s = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=F64)
    assert [select_rank(s, energy=e) for e in (0.3, 0.5, 0.8, 0.81, 0.95, 0.96, 1.0)] == [1, 1, 2, 3, 3, 4, 4]
    assert select_rank(s, rank=3) == 3
    for bad in (dict(), dict(rank=2, energy=0.5), dict(rank=0), dict(rank=5), dict(energy=0.0), dict(energy=1.5)):
        with pytest.raises(ValueError):
            select_rank(s, **bad)
    # through the fits: a Gram with eigenvalues s (K-only) / an M with σ² ∝ s (attention-aware)
    rot, _ = torch.linalg.qr(torch.randn(4, 4, generator=torch.Generator().manual_seed(3), dtype=F64))
    gram = rot @ torch.diag(s) @ rot.T
    assert fit_ksvd(gram, gram, energy=0.8).rank_k == 2
    assert fit_ksvd(gram, gram, energy=0.8, energy_v=0.81).rank_v == 3
    assert oblique_basis(torch.eye(4, dtype=F64), gram, energy=0.95).rank == 3  # G_K = I: σ(M)² = eig(G_Q)
    assert oblique_basis(5 * gram, torch.eye(4, dtype=F64), energy=0.96).rank == 4
    assert ksvd_basis(gram, energy=0.8).retained == pytest.approx(0.8)


# ------------------------------------------------------------------------------------------------ fit_bases
def synthetic_stats(problem, n_layer=2) -> CalibrationStats:
    """Stats of a fake 2-layer model with 2 KV heads × g = 3 query heads, built from explicit matrices."""
    d, g = problem["d"], 3
    kk, qq, qsum, vv, wo = [], [], [], [], []
    for l in range(n_layer):
        lk, lq, ls, lv, lw = [], [], [], [], []
        for j in range(2):
            k = decaying(240, d, 0.7 + 0.05 * j, 30 + 10 * l + j)
            qs = torch.stack([k @ torch.randn(d, d, generator=torch.Generator().manual_seed(50 + 10 * l + 3 * j + i),
                                               dtype=F64) * 0.3 + decaying(240, d, 0.8, 70 + i) for i in range(g)])
            v = decaying(240, d, 0.75, 90 + 10 * l + j)
            lk.append(k.T @ k); lv.append(v.T @ v); ls.append(qs.sum(0).T @ qs.sum(0))  # noqa: E702
            lq += list(torch.einsum("gnd,gne->gde", qs, qs))
            lw += [decaying(24, d, 0.9, 110 + 10 * l + 3 * j + i) for i in range(g)]
        kk.append(torch.stack(lk)); qq.append(torch.stack(lq)); qsum.append(torch.stack(ls))  # noqa: E702
        vv.append(torch.stack(lv)); wo.append(torch.stack(lw))  # noqa: E702
    return CalibrationStats(torch.stack(kk), torch.stack(qq), torch.stack(qsum), torch.stack(vv), torch.stack(wo),
                            n_tokens=240, rope="post", family="llama", n_head=6, n_kv_head=2, head_dim=d,
                            fingerprint="llama-test")


@pytest.mark.parametrize("method", ["ksvd", "eigen", "kq", "gqa-sum", "gqa-concat"])
def test_fit_bases_all_methods(problem, method, tmp_path):
    stats = synthetic_stats(problem)
    b = fit_bases(stats, method, rank=3, rank_v=4)
    assert isinstance(b, KVBases) and b.n_layer == 2 and b.n_kv_head == 2 and b.method == method
    assert b.ranks() == {"k": [[3, 3], [3, 3]], "v": [[4, 4], [4, 4]]}
    assert b.layers[0][0].k_enc.dtype == torch.float32
    m = b.meta
    assert (m["method"], m["rope"], m["calibration_tokens"], m["model_fingerprint"]) == (method, "post", 240,
                                                                                        "llama-test")
    assert len(m["retained_k"]) == 2 and all(0 < x <= 1 for row in m["retained_k"] for x in row)
    back = KVBases.load(b.save(tmp_path / "b.safetensors"))
    assert back.meta["model_fingerprint"] == "llama-test" and back.ranks() == b.ranks()
    # full rank: every method reproduces the scores and the output contributions exactly
    full = fit_bases(stats, method, rank=stats.head_dim, dtype=torch.float64)
    errs = bases_errors(stats, full)
    assert max(x for key in ("scores", "scores_sum", "values", "keys", "values_plain") for row in errs[key]
               for x in row) < 1e-6


def test_fit_bases_method_ordering_and_energy(problem):
    stats = synthetic_stats(problem)
    r = 3
    errs = {m: bases_errors(stats, fit_bases(stats, m, rank=r, dtype=F64)) for m in
            ("ksvd", "eigen", "gqa-sum", "gqa-concat", "kq")}
    for l in range(2):
        for j in range(2):
            assert errs["gqa-concat"]["scores"][l][j] <= min(e["scores"][l][j] for e in errs.values()) + 1e-12
            assert errs["gqa-sum"]["scores_sum"][l][j] <= min(e["scores_sum"][l][j] for e in errs.values()) + 1e-12
            assert errs["ksvd"]["keys"][l][j] <= min(e["keys"][l][j] for e in errs.values()) + 1e-12
            assert errs["kq"]["values"][l][j] <= errs["ksvd"]["values"][l][j] + 1e-12
            assert errs["kq"]["scores"][l][j] == pytest.approx(errs["gqa-concat"]["scores"][l][j])
    gaps = lesens_gaps(stats, r)
    assert all(g >= 0 for row in gaps for g in row) and max(max(row) for row in gaps) > 0
    # energy: per-head ranks retain ≥ E; uniform_ranks lifts a layer to its largest rank
    b = fit_bases(stats, "gqa-concat", energy=0.9)
    assert all(x >= 0.9 - 1e-9 for row in b.meta["retained_k"] + b.meta["retained_v"] for x in row)
    u = fit_bases(stats, "gqa-concat", energy=0.9, uniform_ranks=True)
    assert all(len(set(row)) == 1 for row in u.ranks()["k"])
    assert [max(row) for row in u.ranks()["k"]] == [max(row) for row in b.ranks()["k"]]
    for bad in (dict(), dict(rank=2, energy=0.5), dict(rank=11)):
        with pytest.raises(ValueError):
            fit_bases(stats, "kq", **bad)
    with pytest.raises(ValueError, match="unknown fit"):
        fit_bases(stats, "svd", rank=2)


def test_headbases_shapes(problem):
    h = fit_kq(problem["kk"], problem["qq_heads"].sum(0), problem["vv"], problem["wo"], rank=3, rank_v=5)
    assert isinstance(h, HeadBases) and h.k_enc.shape == (10, 3) and h.v_dec.shape == (10, 5)
