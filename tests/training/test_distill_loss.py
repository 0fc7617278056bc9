"""training.distill_loss: the one-pass KL equals the autograd formula in value and gradient (with a temperature),
and the LM loss it reports is the student's cross-entropy."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from training.distill_loss import SoftTargetKL, kl_and_lm


def reference_kl(z: torch.Tensor, zt: torch.Tensor, t: float) -> torch.Tensor:
    lt = torch.log_softmax(zt / t, -1)
    return (lt.exp() * (lt - torch.log_softmax(z / t, -1))).sum(-1).mean() * t * t


@pytest.mark.parametrize("t", [1.0, 2.0])
def test_kl_and_lm_match_the_autograd_formula(t):
    g = torch.Generator().manual_seed(0)
    zt = torch.randn(2, 5, 37, generator=g, dtype=torch.float64) * 3
    y = torch.randint(0, 37, (2, 5), generator=g)
    z1 = (torch.randn(2, 5, 37, generator=g, dtype=torch.float64) * 3).requires_grad_()
    z2 = z1.detach().clone().requires_grad_()
    ref = reference_kl(z1, zt, t)
    ref.backward()
    out = kl_and_lm(z2, zt, y, t)
    out["kl"].backward()
    assert torch.allclose(out["kl"], ref, atol=1e-12) and torch.allclose(z2.grad, z1.grad, rtol=0, atol=1e-10)
    assert torch.allclose(out["lm"], F.cross_entropy(z1.detach().flatten(0, 1), y.flatten()), atol=1e-12)
    assert not out["lm"].requires_grad


def test_soft_target_kl_is_zero_at_the_teacher_and_positive_elsewhere():
    zt = torch.randn(3, 11, dtype=torch.float64)
    lp = torch.log_softmax(zt, -1)
    kl, log_q = SoftTargetKL.apply(zt.clone().requires_grad_(), lp)
    assert kl.abs().max() < 1e-12 and torch.allclose(log_q, lp)
    kl2, _ = SoftTargetKL.apply(torch.zeros(3, 11, dtype=torch.float64), lp)
    assert (kl2 > 0).all()
