"""Grouped-head joint bases (``kvsplice.lowrank.joint``): lossless at full rank in both doors (pre- and post-RoPE),
bytes == formula, a selection held by post-RoPE latents, the joint fit never worse than per-head bases of the same
numbers on its objective, and the allocation spends its budget."""

from __future__ import annotations

import pytest
import torch

from kvsplice.lowrank.allocate import cost_curves
from kvsplice.lowrank.joint import JointBases, JointLowRank, allocate_joint, fit_joint
from kvsplice.lowrank.sensitivity import calibrate_all
from kvsplice.report.memory import measure_cache
from kvsplice.select.method import TokenSelection
from kvsplice.select.selectors import make_selector
from test_stack import assert_same, both_doors, ids_of, tiny


@pytest.fixture(scope="module")
def calibrated():
    model = tiny("llama")
    return model, calibrate_all(model, [ids_of(4, 16, 7), ids_of(4, 16, 8)], progress=False)


@pytest.mark.parametrize("rope", ["pre", "post"])
def test_full_rank_joint_latents_are_the_model_in_both_doors(calibrated, rope):
    model, sets = calibrated
    full = 2 * 8  # Hkv · d
    bases = fit_joint(sets[rope], [full, full], [full, full])
    ids = ids_of(2, 14, 9)
    runs = both_doors(model, JointLowRank(bases), ids[:, :10], [ids[:, 10:11], ids[:, 11:14]])
    with torch.no_grad():
        want = model(ids).logits
    for door, (logits, cache) in runs.items():
        torch.testing.assert_close(torch.cat(logits, 1), want, atol=2e-4, rtol=0, msg=lambda m: door + m)
    _, hf = runs["hf"]
    assert measure_cache(hf).live_bytes == hf.formula_nbytes() == 2 * 14 * (full + full) * 2 * 4


def test_low_rank_joint_doors_agree_and_hold_a_selection(calibrated, tmp_path):
    model, sets = calibrated
    bases = fit_joint(sets["post"], [5, 7], [6, 4])
    back = JointBases.load(bases.save(tmp_path / "j.safetensors"))
    assert back.ranks() == bases.ranks() == {"k": [5, 7], "v": [6, 4]}
    ids = ids_of(2, 20, 10)
    steps = [ids[:, 14:15], ids[:, 15:20]]
    runs = both_doors(model, JointLowRank(back), ids[:, :14], steps)
    assert_same(runs["decoder"][0], runs["hf"][0], atol=1e-4, what="joint decoder vs hf")
    sel = TokenSelection(make_selector("knorm"), 6, store=JointLowRank(back))
    runs = both_doors(model, sel, ids[:, :14], steps)
    assert_same(runs["decoder"][0], runs["hf"][0], atol=1e-4, what="joint under a selection")
    with pytest.raises(ValueError, match="positions"):
        both_doors(model, TokenSelection(make_selector("knorm"), 6, store=JointLowRank(fit_joint(
            sets["pre"], [5, 7], [6, 4]))), ids[:, :14], steps)


def test_joint_fit_is_no_worse_than_per_head_and_allocation_spends_the_budget(calibrated):
    _, sets = calibrated
    s = sets["pre"]
    per_head = cost_curves(s, "fisher")  # (layer, head, kind) → predicted loss at each rank
    for r in (1, 3, 6):
        joint = allocate_joint(s, 2 * s.n_layer * s.n_kv_head * r)  # same numbers as per-head rank r everywhere
        assert joint.elements_per_token() == 2 * s.n_layer * s.n_kv_head * r
        assert joint.meta["predicted_nll"] <= sum(c[r] for c in per_head.values()) + 1e-9
