"""benchmarks.lib.reference_gpt: the nanoGPT-style reference the training-step benchmark (benchmarks/gpu.py) times against the
package's GPT computes the same function given the same weights."""

from __future__ import annotations

import torch

from models.config import GPTConfig
from models.gpt import GPT
from benchmarks.lib.reference_gpt import ReferenceGPT


def _names(n_layer: int) -> dict[str, str]:
    """ReferenceGPT parameter -> GPT parameter (the same weights under nanoGPT's names)."""
    out = {"wte.weight": "transformer.wte.weight", "wpe.weight": "transformer.wpe.weight",
           "ln_f.weight": "transformer.ln_f.weight", "ln_f.bias": "transformer.ln_f.bias"}
    for i in range(n_layer):
        for ref, ours in (("ln_1", "ln_1"), ("ln_2", "ln_2"), ("c_attn", "attn.c_attn"), ("attn_proj", "attn.c_proj"),
                          ("c_fc", "mlp.c_fc"), ("mlp_proj", "mlp.c_proj")):
            for p in ("weight", "bias"):
                out[f"h.{i}.{ref}.{p}"] = f"transformer.h.{i}.{ours}.{p}"
    return out


def test_reference_gpt_matches_gpt_with_the_same_weights() -> None:
    torch.manual_seed(0)
    ours = GPT(GPTConfig(vocab_size=50, n_layer=2, n_head=4, d_model=32, block_size=64)).eval()
    ref = ReferenceGPT(vocab_size=50, n_layer=2, n_head=4, d_model=32, block_size=64).eval()
    state = ours.state_dict()
    names = _names(2)
    assert set(names) == {n for n, _ in ref.named_parameters()}  # every reference weight is mapped
    ref.load_state_dict({k: state[v] for k, v in names.items()} | {"lm_head.weight": state["transformer.wte.weight"]})
    idx = torch.randint(0, 50, (2, 40), generator=torch.Generator().manual_seed(1))  # (B, T)
    with torch.no_grad():
        got, want = ref(idx), ours(idx)
    want = want[0] if isinstance(want, tuple) else want
    assert got.shape == (2, 40, 50)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, ReferenceGPT(vocab_size=50, n_layer=2, n_head=4, d_model=32, block_size=64)(idx))
