"""One calibration pass for every RoPE mode, joint Grams and loss sensitivities (``kvsplice.lowrank.sensitivity``),
the ``fisher`` fit and rank allocation under a budget (``kvsplice.lowrank.allocate``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvsplice.adapters import adapter_for
from kvsplice.adapters.base import apply_rope
from kvsplice.lowrank.allocate import allocate_ranks, cost_curves
from kvsplice.lowrank.calibrate import calibrate, load_stats
from kvsplice.lowrank.fits import fit_bases
from kvsplice.lowrank.sensitivity import calibrate_all, stats_for
from test_stack import ids_of, tiny


@pytest.fixture(scope="module")
def llama():
    return tiny("llama")


def _grad_wrt_keys(model, ids, layer):
    """∂(Σ NLL)/∂k of one layer's k_proj output, by a perturbation tensor added to it: (B, Hkv, T, d)."""
    a = adapter_for(model)
    delta = torch.zeros(ids.shape[0], ids.shape[1], a.n_kv_head * a.head_dim, requires_grad=True)
    h = a.attention_module(layer).k_proj.register_forward_hook(lambda m, i, o: o + delta)
    try:
        logits = model(input_ids=ids).logits
        F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum").backward()
    finally:
        h.remove()
    return delta.grad.view(*ids.shape, a.n_kv_head, a.head_dim).transpose(1, 2)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_one_pass_gives_every_modes_grams_and_the_true_gradients(family):
    model = tiny(family)
    batches = [ids_of(2, 12, 1), ids_of(2, 12, 2)]
    sets = calibrate_all(model, batches, progress=False)
    assert set(sets) == ({"pre", "post"} if family == "llama" else {"none"})
    for mode, s in sets.items():
        ref = calibrate(model, batches, rope=None if mode == "none" else mode, progress=False)
        for n in ("kk", "qq", "qsum", "vv"):
            torch.testing.assert_close(getattr(s, n), getattr(ref, n))
        d = s.head_dim
        for j in range(s.n_kv_head):  # the joint Gram's diagonal blocks are the per-head Grams
            torch.testing.assert_close(s.kk_joint[1][j * d:(j + 1) * d, j * d:(j + 1) * d], s.kk[1, j])
            torch.testing.assert_close(s.gk_joint[1][j * d:(j + 1) * d, j * d:(j + 1) * d], s.gk[1, j])
        assert s.n_grad_tokens == s.n_tokens == 48
    if family == "llama":
        a = adapter_for(model)
        for layer in (0, 1):
            g = torch.cat([_grad_wrt_keys(model, b, layer) for b in batches]).double()  # (4, Hkv, T, d)
            cos, sin = a.rope(torch.zeros(1, 12, a.head_dim), 0, 12)
            for mode, x in (("pre", g), ("post", apply_rope(g, cos.double(), sin.double()))):
                want = torch.einsum("bhti,bhtj->hij", x, x)
                torch.testing.assert_close(sets[mode].gk[layer], want, rtol=1e-4, atol=1e-6)
    assert all(p.requires_grad for p in model.parameters())  # restored


def test_stats_file_round_trip_and_reuse(llama, tmp_path):
    calls = []

    def batches():
        calls.append(1)
        return [ids_of(2, 12, 3)]

    sets, reused = stats_for(llama, batches, path=tmp_path / "s.safetensors", progress=False)
    assert not reused and calls == [1]
    again, reused = stats_for(llama, batches, path=tmp_path / "s.safetensors", progress=False)
    assert reused and calls == [1]  # no second pass
    for m in sets:
        for n in ("kk", "gk", "gv_joint", "qsum"):
            assert torch.equal(getattr(again[m], n), getattr(sets[m], n))
    with pytest.raises(ValueError, match="another model"):
        stats_for(tiny("gpt2"), batches, path=tmp_path / "s.safetensors", progress=False)
    with pytest.raises(ValueError, match="not a kvsplice calibration-stats file|cannot read"):
        load_stats(_write(tmp_path / "x.safetensors"))


def _write(p):
    from safetensors.torch import save_file

    save_file({"a": torch.zeros(1)}, str(p))
    return p


def test_fisher_fit_minimises_the_predicted_loss_and_allocation_spends_the_budget(llama):
    sets = calibrate_all(llama, [ids_of(4, 16, 5), ids_of(4, 16, 6)], progress=False)
    s = sets["pre"]
    curves = cost_curves(s, "fisher")
    d = s.head_dim
    for g, c in curves.items():
        assert c[d] == pytest.approx(0.0, abs=1e-9 * max(c[0], 1e-12)) and all(a >= b - 1e-12 for a, b in zip(c, c[1:]))
    kq = cost_curves(s, "kq")
    for g in curves:  # the fisher basis is optimal for its own objective at every rank
        assert all(f <= q + 1e-9 * max(q, 1e-12) for f, q in zip(curves[g], kq[g]))
    n_groups = 2 * s.n_layer * s.n_kv_head
    alloc = allocate_ranks(s, 3 * n_groups, curves=curves)
    flat = [r for kind in "kv" for row in alloc.ranks[kind] for r in row]
    assert sum(flat) == alloc.numbers_per_token == 3 * n_groups and min(flat) >= 1 and max(flat) <= d
    uniform = sum(c[3] for c in curves.values())
    assert alloc.predicted_nll <= uniform + 1e-12  # never worse than the uniform split of the same budget
    bases = fit_bases(s, "fisher", ranks=alloc.ranks)
    assert bases.ranks() == alloc.ranks and bases.meta["allocated"]
    with pytest.raises(ValueError, match="numbers_per_token"):
        allocate_ranks(s, n_groups * d + 1, curves=curves)


@pytest.mark.parametrize("fam", ["gemma3_text", "qwen3", "phi3"])
def test_the_true_gradients_of_the_keys_rope_sees_in_every_family(fam):
    """Gemma-3 (a RoPE table per layer type: the pass unpacked them as one table, a TypeError on the real
    Gemma-3-270M), Qwen3 / Gemma-3 (keys normed per head before RoPE) and Phi-3 (one fused q|k|v projection): the
    loss-gradient Grams of every layer equal the true gradients with respect to the keys the rotary embedding
    receives, rotated by that layer's own tables for "post"."""
    from tiny_models import tiny_family

    model = tiny_family(fam, window=None)
    a = adapter_for(model)
    hkv, d = a.n_kv_head, a.head_dim
    batches = [ids_of(2, 12, 1) % 90 + 3, ids_of(2, 12, 2) % 90 + 3]
    sets = calibrate_all(model, batches, progress=False)
    for layer in range(a.n_layer):
        attn = a.attention_module(layer)
        mod = getattr(attn, "k_norm", None) or getattr(attn, "k_proj", None) or attn.qkv_proj
        grads = []
        for ids in batches:
            holder = {}

            def hook(m, i, o):  # o: (B, T, Hkv, d) after k_norm, (B, T, width) after a projection
                holder["delta"] = torch.zeros_like(o, requires_grad=True)
                return o + holder["delta"]

            h = mod.register_forward_hook(hook)
            try:
                logits = model(input_ids=ids).logits
                F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                reduction="sum").backward()
            finally:
                h.remove()
            g = holder["delta"].grad.reshape(*ids.shape, -1)  # (B, T, width)
            if mod is getattr(attn, "qkv_proj", None):
                g = g[..., a.n_head * d:a.n_head * d + hkv * d]  # (B, T, Hkv·d): the keys of q | k | v
            grads.append(g.reshape(*ids.shape, hkv, d).transpose(1, 2))  # (B, Hkv, T, d)
        g = torch.cat(grads).double()
        cos, sin = a.rope(torch.zeros(1, 12, d), 0, 12, layer=layer)
        for mode, x in (("pre", g), ("post", apply_rope(g, cos.double(), sin.double()))):
            if mode in sets:
                want = torch.einsum("bhti,bhtj->hij", x, x)
                torch.testing.assert_close(sets[mode].gk[layer], want, rtol=1e-4, atol=1e-6)
    model.zero_grad()
