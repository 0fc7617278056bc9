"""One meaning of "ratio" in the planner's and the fits' options: times smaller than the full K/V cache (> 1 for a
budget, >= 1 for a rank allocation), never a kept fraction — ``plan --ratio 0.25`` and ``fit_bases --alloc-ratio
0.25`` (a fraction where "4x" was meant) are refused in one line saying what a ratio is, before any model loads."""

from __future__ import annotations

import pytest

from hostile import one_error
from kvsplice.cli import fit_bases, plan


@pytest.mark.parametrize("value", ["0.25", "0.9"])
def test_a_fraction_given_as_a_ratio_is_refused_saying_times_smaller(tmp_path, capsys, value):
    rc = plan.main(["--model", str(tmp_path / "none"), "--calib", "x.txt", "--ratio", value,
                    "--out", str(tmp_path / "p.json")])
    one_error(rc, capsys.readouterr().err, "plan", "times smaller")
    rc = fit_bases.main(["--model", str(tmp_path / "none"), "--data", "x.txt", "--fit", "fisher", "--alloc-ratio",
                         value, "--out", str(tmp_path / "b.safetensors")])
    one_error(rc, capsys.readouterr().err, "fit_bases", "times fewer numbers per token")


def test_the_help_says_what_each_ratio_is():
    text = " ".join(plan.build_parser().format_help().split())
    assert "times smaller than the fp16 full K/V cache (> 1)" in text
    text = " ".join(fit_bases.build_parser().format_help().split())
    assert "times smaller than the full K/V cache, >= 1" in text
