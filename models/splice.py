"""LearnedKVSplice: a learned compress/expand pair that shrinks the MLA latent before it is cached."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import orthogonal


class LearnedKVSplice(nn.Module):
    """``s = C c`` (compress, ``C``: d_compressed × d_in) and ``ĉ = E s`` (expand, ``E``: d_in × d_compressed).

    ``C`` starts with orthonormal rows and ``E = Cᵀ``, so at init ``E C`` is an orthogonal projection onto a random
    d_compressed-dimensional subspace. With ``orthogonal=True`` both matrices are kept exactly orthonormal during
    training by ``torch.nn.utils.parametrizations.orthogonal`` (each one separately, so both still learn); otherwise
    they train freely from the orthogonal init.

    :meth:`models.gpt.GPT.reset_parameters` skips this module's layers in its GPT-2 init and calls
    :meth:`reset_parameters` afterwards, so the orthogonal init is never overwritten.
    """

    def __init__(self, d_in: int, d_compressed: int, *, orthogonal: bool = False) -> None:
        super().__init__()
        if not 1 <= d_compressed <= d_in:
            raise ValueError(f"d_compressed must be in [1, d_in={d_in}], got {d_compressed}")
        self.d_in = d_in
        self.d_compressed = d_compressed
        self.orthogonal = orthogonal
        self.compress = nn.Linear(d_in, d_compressed, bias=False)
        self.expand = nn.Linear(d_compressed, d_in, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Orthonormal rows for ``compress`` and ``expand = compressᵀ`` (re-applies the parametrisation)."""
        for lin in (self.compress, self.expand):
            if parametrize.is_parametrized(lin, "weight"):
                parametrize.remove_parametrizations(lin, "weight", leave_parametrized=False)
        w = torch.empty(self.d_compressed, self.d_in, device=self.compress.weight.device)
        nn.init.orthogonal_(w)  # (r, d_in), orthonormal rows
        self.compress.weight.copy_(w)
        self.expand.weight.copy_(w.T)
        if self.orthogonal:
            # The parametrisation starts at the current (orthonormal) weight. "matrix_exp", not torch's default
            # "householder" for non-square weights: with Householder reflectors the gradient vanished after the
            # first optimiser step in our tests (tests/models/test_models.py::test_kvsplice_both_layers_learn).
            orthogonal(self.compress, "weight", orthogonal_map="matrix_exp")
            orthogonal(self.expand, "weight", orthogonal_map="matrix_exp")

    def forward(self, c: torch.Tensor) -> torch.Tensor:
        """Round trip used in training: ``E C c`` (both layers are in the graph)."""
        return self.expand(self.compress(c))

    def compress_weight(self) -> torch.Tensor:
        return self.compress.weight  # (r, d_in)

    def expand_weight(self) -> torch.Tensor:
        return self.expand.weight  # (d_in, r)

    def extra_repr(self) -> str:
        return f"d_in={self.d_in}, d_compressed={self.d_compressed}, orthogonal={self.orthogonal}"
