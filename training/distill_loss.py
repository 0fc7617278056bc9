"""The distillation loss of ``kvsplice distill``: KL(teacher ‖ student) per token, written so that a
49k-word vocabulary costs one pass over the logits each way.

Autograd through ``Σ p_t (log p_t − log_softmax(z))`` keeps the teacher's log-probabilities, their exponent, the
difference and the product (four ``(N, V)`` tensors) and walks back through each; the gradient is simply
``softmax(z) − p_t``. :class:`SoftTargetKL` computes the forward in one log-softmax and the backward in one
expression, and hands back the student's log-probabilities (not differentiable) so the LM loss logged beside it
needs no second log-softmax. Equal to the autograd formula in value and gradient (tests/training/test_distill_loss.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["SoftTargetKL", "kl_and_lm"]


class SoftTargetKL(torch.autograd.Function):
    """``(kl (N,), log_q (N, V)) = f(z (N, V), log_p (N, V))``: per-row ``KL(p ‖ softmax z)`` and ``log_softmax z``
    (returned without gradient). ``log_p`` is the teacher's log-probabilities (never differentiated)."""

    @staticmethod
    def forward(ctx, z: torch.Tensor, log_p: torch.Tensor):  # type: ignore[override]
        log_q = torch.log_softmax(z, -1)  # (N, V)
        p = log_p.exp()  # (N, V)
        kl = (p * (log_p - log_q)).sum(-1)  # (N,)
        ctx.save_for_backward(log_q, p)
        ctx.mark_non_differentiable(log_q)
        return kl, log_q

    @staticmethod
    def backward(ctx, grad_kl: torch.Tensor, _grad_log_q: torch.Tensor):  # type: ignore[override]
        log_q, p = ctx.saved_tensors
        return log_q.exp().sub_(p).mul_(grad_kl[:, None]), None  # d KL / d z = softmax(z) − p


def kl_and_lm(student_logits: torch.Tensor, teacher_logits: torch.Tensor, targets: torch.Tensor,
              temperature: float = 1.0) -> dict[str, torch.Tensor]:
    """``{"kl": mean KL(teacher ‖ student) · T², "lm": the student's next-token CE}`` for logits ``(B, S, V)`` and
    ``targets (B, S)``; ``lm`` carries no gradient (the KL is what trains)."""
    t = float(temperature)
    z = student_logits.flatten(0, 1)  # (B·S, V)
    with torch.no_grad():
        zt = teacher_logits.flatten(0, 1)  # (B·S, V)
        log_p = torch.log_softmax(zt if t == 1.0 else zt / t, -1)
    kl, log_q = SoftTargetKL.apply(z if t == 1.0 else z / t, log_p)
    with torch.no_grad():
        lm = F.nll_loss(log_q, targets.flatten()) if t == 1.0 else F.cross_entropy(z, targets.flatten())
    return {"kl": kl.mean() * (t * t), "lm": lm}
