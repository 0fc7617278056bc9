"""The §3.5 error bounds hold on random data (many trials) and the softmax bound is tight."""

import math

import torch

from kvsplice.core.bounds import (attention_error_report, logit_error, logit_error_bound, logit_oscillation,
                             output_error, output_error_bound, softmax_l1_bound, softmax_l1_error)
from models.attention import causal_mask




def test_softmax_bound_holds_many_trials():
    gen = torch.Generator().manual_seed(0)
    trials, t = 4000, 12
    scales = torch.logspace(-2, 1.5, trials, dtype=torch.float64)[:, None]
    logits = torch.randn(trials, t, generator=gen, dtype=torch.float64) * scales * 3
    err = torch.randn(trials, t, generator=gen, dtype=torch.float64) * scales
    err = torch.where(torch.rand(trials, t, generator=gen) < 0.3, err * 5, err)  # heavy-ish tails
    logits_hat = logits - err
    l1 = softmax_l1_error(logits, logits_hat)
    delta = logit_oscillation(logits, logits_hat)
    eps = logit_error(logits, logits_hat)
    tanh_b, sinh_b = softmax_l1_bound(delta), softmax_l1_bound(delta, kind="sinh")
    assert (l1 <= tanh_b + 1e-12).all()
    assert (tanh_b <= sinh_b + 1e-12).all()  # the 2 sinh(δ/2) holds too, and is looser
    assert (delta <= 2 * eps + 1e-12).all()
    assert (l1 <= softmax_l1_bound(2 * eps) + 1e-12).all() and (softmax_l1_bound(2 * eps) <= eps + 1e-12).all()
    # a constant shift of the error changes nothing (δ, not ε, is what matters)
    torch.testing.assert_close(softmax_l1_error(logits, logits_hat + 7.0), l1)


def test_softmax_bound_is_tight():
    for delta in (1e-3, 0.1, 1.0, 4.0, 20.0):
        # two tokens; the one whose logit drops by δ gets weight 1/(1 + e^{δ/2}) after the drop
        logits = torch.tensor([delta / 2, 0.0], dtype=torch.float64)  # α ∝ (e^{δ/2}, 1)
        logits_hat = logits - torch.tensor([delta, 0.0], dtype=torch.float64)  # oscillation δ
        l1 = softmax_l1_error(logits, logits_hat).item()
        assert math.isclose(l1, softmax_l1_bound(delta).item(), rel_tol=1e-9)


def test_logit_and_output_bounds_hold_random_attention():
    gen = torch.Generator().manual_seed(1)
    for trial in range(60):
        d, t, tq = 8, 20, 4
        q = torch.randn(3, tq, d, generator=gen, dtype=torch.float64) * (0.5 + trial / 10)
        k = torch.randn(3, t, d, generator=gen, dtype=torch.float64)
        v = torch.randn(3, t, 5, generator=gen, dtype=torch.float64)
        noise = 10 ** (-3 + 3 * trial / 60)
        k_hat = k + noise * torch.randn(k.shape, generator=gen, dtype=torch.float64)
        v_hat = v + noise * torch.randn(v.shape, generator=gen, dtype=torch.float64)
        rep = attention_error_report(q, k, v, k_hat, v_hat, scale=0.3, mask=causal_mask(tq, t, q.device))
        assert (rep["logit_err"] <= rep["logit_bound"] + 1e-12).all()
        assert (rep["oscillation"] <= 2 * rep["logit_err"] + 1e-12).all()
        assert (rep["softmax_l1"] <= rep["softmax_bound_observed"] + 1e-12).all()
        assert (rep["softmax_l1"] <= rep["softmax_bound"] + 1e-12).all()
        assert (rep["output_err"] <= rep["output_bound"] + 1e-12).all()


def test_pure_helpers_on_a_projection():
    """k̂ = P k (orthogonal projection): the per-token logit bound and the output bound with the diameter form."""
    gen = torch.Generator().manual_seed(2)
    for _ in range(50):
        d, t = 10, 15
        p = torch.linalg.qr(torch.randn(d, 6, generator=gen, dtype=torch.float64))[0]
        q = torch.randn(2, d, generator=gen, dtype=torch.float64)
        k = torch.randn(t, d, generator=gen, dtype=torch.float64)
        v = torch.randn(t, 3, generator=gen, dtype=torch.float64)
        k_hat, v_hat = k @ p @ p.T, v + 0.05 * torch.randn(t, 3, generator=gen, dtype=torch.float64)
        l, lh = q @ k.T, q @ k_hat.T
        rho = (k - k_hat).norm(dim=-1)
        assert (logit_error(l, lh) <= logit_error_bound(q, rho.max()) + 1e-12).all()
        tighter = (q - q @ p @ p.T).norm(dim=-1) * rho.max()  # ‖(I − P)q‖ max ρ
        assert (logit_error(l, lh) <= tighter + 1e-12).all()
        a, ah = torch.softmax(l, -1), torch.softmax(lh, -1)
        o, oh = a @ v, ah @ v_hat
        l1 = (a - ah).abs().sum(-1)
        diam = torch.cdist(v, v).max()
        dv = (v - v_hat).norm(dim=-1).max()
        b1 = output_error_bound(l1, v.norm(dim=-1).max(), dv)
        b2 = output_error_bound(l1, v.norm(dim=-1).max(), dv, v_diameter=diam)
        err = output_error(o, oh)
        assert (err <= b2 + 1e-12).all() and (b2 <= b1 + 1e-12).all()


def test_masked_and_degenerate_inputs():
    l = torch.tensor([[0.0, -math.inf, 1.0], [2.0, -math.inf, -math.inf]])
    lh = torch.tensor([[0.5, -math.inf, 1.0], [5.0, -math.inf, -math.inf]])
    assert torch.allclose(logit_error(l, lh), torch.tensor([0.5, 3.0]))
    assert torch.allclose(logit_oscillation(l, lh), torch.tensor([0.5, 0.0]))  # one visible key: δ = 0
    assert torch.allclose(softmax_l1_error(l, lh)[1], torch.tensor(0.0))
