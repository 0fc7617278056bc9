"""benchmarks/gpu.py on the runner, on CPU: no CUDA is one line and exit 2 with nothing written, and the report's
three tables come from the rows of each section (the rows themselves need a GPU: gpu_check runs them there)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.harness import report, studies
from tiny_models import load_benchmark


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_no_cuda_is_one_line_and_nothing_written(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert load_benchmark("gpu").main(["--smoke"]) == 2
    assert load_benchmark("gpu").main(["--size", "check", "--sections", "train"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == ["gpu: error: no CUDA device (this benchmark measures a GPU)"] * 2
    assert load_benchmark("gpu").main(["--smoke", "--out", str(tmp_path / "g")]) == 2  # --out: the same check
    assert not list(tmp_path.iterdir())


def test_the_report_tables_come_from_each_sections_rows():
    notes = dict(device="NVIDIA H200", torch="2.13", cuda="12.8", transformers="5.2", flash_impl="none (PyTorch SDPA kernels)",
                 bandwidth_gbs=4000.0, flash4="FlashAttention-4 is not importable")
    rows = [dict(section="sdpa", keys=256, default=0.01, flash=0.02),
            dict(section="train", model="ours mha", mode="eager", optimizer="fused", median_ms=100.0,
                 tokens_per_s=163840.0, mfu=0.4, vs_reference_same_mode=0.9, vs_ours_mha_same_mode=1.0),
            dict(section="decode", batch=8, ctx=1024, variant="ours mha", median_ms=1.5, vs_ours_mha=1.0,
                 vs_hf_static=0.5, floor_ms=0.5, vs_floor=3.0),
            dict(section="decode", batch=8, ctx=1024, variant="hf dynamic", error="out of memory")]
    md = report.markdown(studies.load("gpu")["report"], rows, notes)
    assert md.startswith("# GPU benchmark — NVIDIA H200") and "copy bandwidth 4000 GB/s" in md
    assert "| keys | default | flash |" in md and "| 256 | 0.010 | 0.020 |" in md
    assert "| ours mha | eager | fused | 100.0 | 163,840 | 0.400 | 0.900 | 1.000 |" in md
    assert "| 8 | 1,024 | ours mha | 1.500 | 1.000 | 0.500 | 0.500 | 3.000 | - |" in md
    assert "| 8 | 1,024 | hf dynamic | - | - | - | - | - | out of memory |" in md
    assert "flash4: FlashAttention-4 is not importable" in md and "## FlashAttention-4" not in md  # no rows, a reason
