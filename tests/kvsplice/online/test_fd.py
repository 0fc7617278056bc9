"""Frequent Directions: the covariance guarantee, Δ bounds, residual bounds, batching and chunked updates."""

import pytest
import torch

from kvsplice.online.fd import FrequentDirections, best_rank_k_residual, fd_bound




def low_rank_plus_noise(n: int, d: int, rank: int, noise: float, gen: torch.Generator) -> torch.Tensor:
    u = torch.randn(n, rank, generator=gen, dtype=torch.float64)
    w = torch.randn(rank, d, generator=gen, dtype=torch.float64)
    w = w * torch.linspace(3, 1, rank, dtype=torch.float64)[:, None]
    return u @ w + noise * torch.randn(n, d, generator=gen, dtype=torch.float64)


def check_guarantee(a: torch.Tensor, fd: FrequentDirections, n_x: int = 32, tol: float = 1e-9) -> None:
    """0 ≤ ‖Ax‖² − ‖Sx‖² ≤ Δ ≤ (‖A‖² − ‖S‖²)/ℓ ≤ ‖A − A_k‖²/(ℓ − k) for all k < ℓ; x random + top directions of A."""
    a = a.double()
    s = fd.sketch.double()
    ell, d = fd.ell, a.shape[-1]
    gen = torch.Generator().manual_seed(1)
    xs = torch.randn(d, n_x, generator=gen, dtype=torch.float64)
    _, _, vh = torch.linalg.svd(a, full_matrices=False)
    xs = torch.cat([xs, vh[: min(8, vh.shape[0])].T], 1)  # include the top singular directions of A
    xs = xs / xs.norm(dim=0, keepdim=True)
    gap = (a @ xs).pow(2).sum(0) - (s @ xs).pow(2).sum(0)
    scale = a.pow(2).sum().item()
    delta = fd.shrinkage.item()
    assert gap.min() >= -tol * scale
    assert gap.max() <= delta + tol * scale
    # spectral norm of the covariance error
    cov_err = torch.linalg.matrix_norm(a.T @ a - s.T @ s, ord=2).item()
    assert cov_err <= delta + tol * scale
    assert torch.linalg.eigvalsh(a.T @ a - s.T @ s).min() >= -tol * scale  # AᵀA − SᵀS ⪰ 0
    assert delta <= (scale - s.pow(2).sum().item()) / ell + tol * scale
    for k in range(min(ell, d)):
        assert delta <= fd_bound(best_rank_k_residual(a, k).item(), k, ell) + tol * scale
    assert abs(fd.total_energy.item() - scale) <= 1e-9 * scale


@pytest.mark.parametrize("ell,d,n", [(4, 16, 200), (8, 12, 333), (3, 5, 50), (10, 6, 97)])
def test_guarantee_random_stream(ell, d, n):
    gen = torch.Generator().manual_seed(ell * 100 + d)
    a = torch.randn(n, d, generator=gen, dtype=torch.float64)
    fd = FrequentDirections(ell, d, dtype=torch.float64)
    for chunk in a.split(7):
        fd.update(chunk)
    assert fd.n_rows == n
    check_guarantee(a, fd)


def test_guarantee_low_rank_plus_noise_and_residual_bounds():
    gen = torch.Generator().manual_seed(0)
    a = low_rank_plus_noise(500, 24, rank=5, noise=0.05, gen=gen)
    fd = FrequentDirections(8, 24, dtype=torch.float64).update(a)
    check_guarantee(a, fd)
    assert fd.n_shrinks > 0 and fd.shrinkage.item() > 0
    for r in (1, 3, 5, 7):
        v = fd.basis(r)
        assert torch.allclose(v.T @ v, torch.eye(r, dtype=torch.float64), atol=1e-10)
        resid = (a - a @ v @ v.T).pow(2).sum().item()
        bound = fd.residual_bound(r).item()
        tail = best_rank_k_residual(a, r).item()
        assert tail - 1e-9 <= resid <= bound + 1e-9
        assert bound <= tail + r * fd.shrinkage.item() + 1e-9
        lo, hi = fd.tail_energy_bounds(r)
        assert lo.item() - 1e-9 <= tail <= hi.item() + 1e-9
    # rank 5 signal: the top-5 basis captures it, so the residual is the noise level
    assert fd.residual_bound(5).item() < 2 * best_rank_k_residual(a, 5).item() + 1e-9


def test_guarantee_on_transformer_keys():
    """A "real" stream: the keys of a small random GPT, batched over (layers, heads)."""
    from models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, n_layer=2, n_head=2, d_model=32, block_size=128, attention="mha")).eval()
    cache = model.new_cache(1)
    with torch.no_grad():
        model(torch.randint(0, 64, (1, 120)), cache=cache)
    keys = torch.stack([cache.get(l)["k"][0] for l in range(2)])  # (L, H, T, hs)
    fd = FrequentDirections(6, 16, batch_shape=(2, 2))
    for chunk in keys.split(9, dim=-2):
        fd.update(chunk)
    for l in range(2):
        for h in range(2):
            item = FrequentDirections(6, 16, dtype=torch.float64)
            item.buffer = fd.buffer[l, h].double().clone()
            item.filled, item.shrinkage, item.total_energy = fd.filled, fd.shrinkage[l, h], fd.total_energy[l, h]
            check_guarantee(keys[l, h], item, tol=1e-5)  # float32 sketch


def test_batched_equals_loop_and_chunking_is_irrelevant():
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(3, 2, 50, 10, generator=gen)
    fd = FrequentDirections(4, 10, batch_shape=(3, 2))
    for chunk in a.split(13, dim=-2):
        fd.update(chunk)
    for i, j in ((0, 0), (2, 1)):
        one = FrequentDirections(4, 10)
        for t in range(50):  # row by row
            one.update(a[i, j, t : t + 1])
        s_b, s_1 = fd.sketch[i, j], one.sketch
        torch.testing.assert_close(s_b.T @ s_b, s_1.T @ s_1, atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(fd.shrinkage[i, j], one.shrinkage, atol=1e-6, rtol=1e-6)
        p_b, p_1 = fd.basis(3)[i, j], one.basis(3)
        torch.testing.assert_close(p_b @ p_b.T, p_1 @ p_1.T, atol=1e-4, rtol=0)
    assert fd.basis(3).shape == (3, 2, 10, 3)


def test_exact_when_ell_exceeds_dim_and_low_precision_rows():
    gen = torch.Generator().manual_seed(4)
    a = torch.randn(100, 6, generator=gen)
    fd = FrequentDirections(8, 6).update(a.half())  # rows in fp16, sketch in fp32
    assert fd.dtype == torch.float32 and fd.shrinkage.item() == 0.0 and fd.n_shrinks > 0
    a16 = a.half().float()
    torch.testing.assert_close(fd.sketch.T @ fd.sketch, a16.T @ a16, atol=1e-3, rtol=1e-5)
    fd = FrequentDirections(4, 6, dtype=torch.bfloat16)
    assert fd.dtype == torch.float32
    fd.update(a.bfloat16())
    assert torch.isfinite(fd.sketch).all()


def test_basis_full_rank_and_reset():
    fd = FrequentDirections(2, 9).update(torch.randn(3, 9))
    v = fd.basis(9)  # needs more directions than the 4-row buffer has: completed to an orthonormal basis
    torch.testing.assert_close(v.T @ v, torch.eye(9), atol=1e-5, rtol=0)
    with pytest.raises(ValueError):
        fd.basis(10)
    with pytest.raises(ValueError):
        fd.update(torch.randn(3, 8))
    fd.reset()
    assert fd.n_rows == 0 and fd.filled == 0 and fd.total_energy.item() == 0 and fd.sketch.shape == (0, 9)


def test_decay_tracks_the_decayed_stream():
    """With γ < 1 the guarantees hold for A_γ (row s weighted γ^{(T-1-s)/2}); chunking does not matter."""
    gen = torch.Generator().manual_seed(5)
    n, d, gamma = 120, 8, 0.97
    a = low_rank_plus_noise(n, d, rank=3, noise=0.1, gen=gen)
    fd = FrequentDirections(4, d, dtype=torch.float64, decay=gamma)
    for chunk in a.split(11):
        fd.update(chunk)
    w = gamma ** ((n - 1 - torch.arange(n, dtype=torch.float64)) / 2)
    check_guarantee(a * w[:, None], fd)
    rows = FrequentDirections(4, d, dtype=torch.float64, decay=gamma)
    for t in range(n):
        rows.update(a[t : t + 1])
    torch.testing.assert_close(fd.sketch.T @ fd.sketch, rows.sketch.T @ rows.sketch, atol=1e-9, rtol=1e-9)
    torch.testing.assert_close(fd.shrinkage, rows.shrinkage, atol=1e-9, rtol=1e-9)
    with pytest.raises(ValueError):
        FrequentDirections(4, d, decay=0.0)
