"""benchmarks/serving.py runs end to end in its smoke mode (tiny shapes, CPU; the kernel columns through Triton's
interpreter when triton is installed) and refuses bad input with one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from models.kernels import triton_missing_reason
from tiny_models import load_benchmark


@pytest.fixture(scope="module")
def serving():
    return load_benchmark("serving")


def test_smoke_run_writes_the_capacity_and_kernel_tables(serving, tmp_path: Path):
    out = tmp_path / "s"
    assert serving.main(["--smoke", "--variants", "MHA", "KVSplice-90", "--ctx", "24", "--steps", "1", "--out",
                         str(out), "--no-progress", "--kernel-splits", "2"]) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    section = {s: [r for r in report["rows"] if r["section"] == s] for s in ("capacity", "kernel")}
    cap = {(r["variant"], r["rows"]): r for r in section["capacity"]}
    assert set(cap) == {("MHA", "float32"), ("MHA", "int8"), ("KVSplice-90", "float32"), ("KVSplice-90", "int8")}
    mha, ks = cap[("MHA", "float32")], cap[("KVSplice-90", "float32")]
    assert mha["bytes_per_seq"] == 2 * 25 * 2 * 64 * 4  # 2 layers x 25 tokens x (K + V of 4 x 16) x fp32
    assert ks["max_batch"] == int(report["settings"]["budget_gb"] * 1e9 // ks["bytes_per_seq"]) > mha["max_batch"]
    assert ks["batch_vs_mha"] == ks["max_batch"] / mha["max_batch"]
    assert all(r["sdpa_ms"] > 0 and r["floor_ms"] > 0 for r in section["capacity"])
    kernel_runs = triton_missing_reason() is None
    assert all(("split_kv_ms" in r) == kernel_runs for r in report["rows"])
    if kernel_runs:  # the kernel agrees with the eager path inside the benchmark too (fp32 on CPU)
        assert all(r["max_abs_diff"] < 1e-4 and r["split_kv_s2_ms"] > 0 for r in section["kernel"])
    md = out.with_suffix(".md").read_text()
    assert "11,700" in md and "Smoke run" in md and "latent 26 int8" in md


@pytest.mark.parametrize("argv, msg", [(["--smoke", "--ctx", "0"], "--ctx"),
                                       (["--smoke", "--steps", "0"], "--steps"),
                                       (["--smoke", "--budget-gb", "-1"], "--budget-gb"),
                                       (["--smoke", "--variants", "GPT-5"], "--variants")])
def test_bad_input_is_one_line(serving, capsys, argv, msg):
    assert serving.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("serving: error:") and msg in err[0]
