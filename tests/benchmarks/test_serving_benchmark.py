"""benchmarks/serving.py runs end to end in its smoke mode (tiny shapes, CPU; the kernel columns through Triton's
interpreter when triton is installed), every section (the ones gpu_check runs), and refuses bad input with one
line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from models.kernels import triton_missing_reason
from tiny_models import load_benchmark


@pytest.fixture(scope="module")
def serving():
    return load_benchmark("serving")


def test_smoke_run_writes_every_sections_table(serving, tmp_path: Path):
    out = tmp_path / "s"
    assert serving.main(["--smoke", "--variants", "MHA", "KVSplice-90", "--ctx", "24", "--steps", "1", "--out",
                         str(out), "--kernel-splits", "2", "--sections", *serving.SECTIONS]) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    section = {s: [r for r in report["rows"] if r["section"] == s] for s in serving.SECTIONS}
    cap = {(r["variant"], r["rows"]): r for r in section["capacity"]}
    assert set(cap) == {("MHA", "float32"), ("MHA", "int8"), ("KVSplice-90", "float32"), ("KVSplice-90", "int8")}
    mha, ks = cap[("MHA", "float32")], cap[("KVSplice-90", "float32")]
    assert mha["bytes_per_seq"] == 2 * 25 * 2 * 64 * 4  # 2 layers x 25 tokens x (K + V of 4 x 16) x fp32
    assert ks["max_batch"] == int(report["settings"]["budget_gb"] * 1e9 // ks["bytes_per_seq"]) > mha["max_batch"]
    assert ks["batch_vs_mha"] == ks["max_batch"] / mha["max_batch"]
    assert all(r["sdpa_ms"] > 0 and r["floor_ms"] > 0 and r["compute_floor_ms"] > 0 for r in section["capacity"])
    assert report["matmul_tflops"] > 0 and all(r["bound"] in ("bytes", "compute") for r in section["capacity"])
    decode = {(r["variant"], r["path"]): r for r in section["decode"]}  # eager steps on a CPU, SDPA rows first
    assert decode[("MHA", "sdpa")]["vs_mha_sdpa"] == 1 and decode[("KVSplice-90", "sdpa")]["ms"] > 0
    assert [r["variant"] for r in section["profile"] if r["kernel"] == "(step total)"] == ["MHA", "KVSplice-90"]
    kernel_runs = triton_missing_reason() is None
    assert all(("split_kv_ms" in r) == kernel_runs for r in section["capacity"] + section["kernel"])
    if kernel_runs:  # the kernel agrees with the eager path inside the benchmark too (fp32 on CPU)
        assert all(r["max_abs_diff"] < 1e-4 and r["split_kv_s2_ms"] > 0 for r in section["kernel"])
    md = out.with_suffix(".md").read_text()
    assert "11,700" in md and "Smoke run" in md and "latent 26 int8" in md and "| (step total) |" in md


@pytest.mark.parametrize("argv, msg", [(["--smoke", "--ctx", "0"], "--ctx"),
                                       (["--smoke", "--steps", "0"], "--steps"),
                                       (["--smoke", "--budget-gb", "-1"], "--budget-gb"),
                                       (["--smoke", "--variants", "GPT-5"], "--variants")])
def test_bad_input_is_one_line(serving, capsys, argv, msg):
    assert serving.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("serving: error:") and msg in err[0]


def test_both_floors_and_the_profile_split():
    """A capacity row gets the compute floor beside the byte floor and each path's % of the larger one; the step's
    FLOPs at batch 16,384 / 1k are ~4 TFLOP for the 124M shapes (weights dominate); the profile rows rank the
    kernels by self time with their share of the step."""
    from types import SimpleNamespace

    from benchmarks.lib import serving_bench as sb

    row = sb.add_floors(dict(floor_ms=2.0, sdpa_ms=10.0, split_kv_ms=5.0), flops=4e12, peak=1e15)
    assert row["compute_floor_ms"] == 4.0 and row["bound"] == "compute" and row["larger_floor_ms"] == 4.0
    assert row["sdpa_pct_larger_floor"] == 40.0 and row["split_kv_pct_larger_floor"] == 80.0
    assert sb.add_floors(dict(floor_ms=9.0, sdpa_ms=10.0), 4e12, 1e15)["bound"] == "bytes"
    mha, k90 = (sb.step_flops(n, 16384, 1024, False) for n in ("MHA", "KVSplice-90"))
    assert 3.5e12 < k90 < mha < 5e12
    assert sb.step_flops("MHA", 2, 1024, False) == 2 * sb.step_flops("MHA", 1, 1024, False)
    ev = [SimpleNamespace(key="mm", count=3, self_cpu_time_total=600.0),
          SimpleNamespace(key="softmax", count=1, self_cpu_time_total=200.0),
          SimpleNamespace(key="idle", count=1, self_cpu_time_total=0.0),
          SimpleNamespace(key="copy", count=2, self_cpu_time_total=200.0)]
    rows = sb.profile_rows(ev, "MHA", 4, 32, top=2, cuda=False)
    assert [r["kernel"] for r in rows] == ["mm", "softmax", "(step total)"]
    assert rows[0]["pct_step"] == 60.0 and rows[0]["ms"] == 0.6 and rows[-1]["ms"] == 1.0


def test_latent_sdpa_formulations_agree():
    """The latent-attention formulations the ``latent`` section times compute the same attention (the ones that run
    on CPU: the fused kernels need CUDA)."""
    from benchmarks.lib import serving_bench as bench

    g = torch.Generator().manual_seed(0)
    q, s = torch.randn(2, 1, 12, 26, generator=g), torch.randn(2, 1, 64, 26, generator=g)
    forms = bench.formulations(q, s, 0.125)
    ref = forms["sdpa default"]()[:, 0]  # (B, H, r)
    for name in ("3-op", "3-op bmm", "split-k 16"):
        got = forms[name]()
        got = got[:, 0] if got.dim() == 4 else got
        assert torch.allclose(got, ref, atol=1e-5), name
    assert not math.isnan(ref.sum().item())


def test_a_failed_case_is_one_line_and_out_of_memory_says_so():
    """A case's error (serving's and gpu's rows) is its first line with its type; running out of GPU memory reads
    ``out of memory`` wherever it happens (a capacity step, a kernel call, a model that does not fit)."""
    from benchmarks.lib import serving_bench as sb

    oom = torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore")
    assert sb.err(oom) == "out of memory"
    assert sb.err(ValueError("bad shape\nthe traceback's rest")) == "ValueError: bad shape"
    assert sb.err(RuntimeError("x" * 500)) == "RuntimeError: " + "x" * 200
