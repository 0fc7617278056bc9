"""benchmarks/convert_smollm2.py in its smoke mode (stories260K, tiny token counts): conversion, fine-tunes of the
converted model and of the source (the same-text baseline), int8 / int4 stores, task rows, and the three outputs;
a second run reuses the work folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny_models import load_benchmark

ROOT = Path(__file__).resolve().parents[2]
STORIES = ROOT.parent / "shared" / "data" / "stories260K" / "stories260K.bin"


@pytest.mark.skipif(not STORIES.is_file(), reason="stories260K not found")
def test_convert_smollm2_smoke_training_free(tmp_path):
    bench = load_benchmark("convert_smollm2")
    out = tmp_path / "res"
    assert bench.main(["--smoke", "--ratios", "4", "--calib-tokens", "2048", "--work", str(tmp_path / "w"),
                       "--out", str(out)]) == 0
    rows = {r["key"]: r for r in json.loads(out.with_suffix(".json").read_text())["rows"]}
    assert set(rows) == {"source", "shared-R8-Dr8/fp16", "shared-R8-Dr8/int4"}
    assert rows["shared-R8-Dr8/fp16"]["ratio_P"] == 4.0 and rows["shared-R8-Dr8/int4"]["ratio_P"] == 8.0
    assert out.with_suffix(".md").is_file() and out.with_suffix(".png").stat().st_size > 0


@pytest.mark.slow  # two fine-tunes and three task runs as subprocesses: about a minute
@pytest.mark.skipif(not STORIES.is_file(), reason="stories260K not found")
def test_convert_smollm2_smoke(tmp_path):
    bench = load_benchmark("convert_smollm2")
    out, work = tmp_path / "res", tmp_path / "work"
    args = ["--smoke", "--ratios", "4", "--calib-tokens", "2048", "--finetune-steps", "2", "--tasks",
            "--task-length", "256", "--task-n", "1", "--work", str(work), "--out", str(out)]
    assert bench.main(args) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    rows = {r["key"]: r for r in report["rows"]}
    assert set(rows) == {"source", "source-lm2", "shared-R8-Dr8/fp16", "shared-R8-Dr8/int4",
                         *(f"shared-R8-Dr8-kl2/{s}" for s in ("fp16", "int8", "int4"))}
    assert rows["source"]["ratio_P"] == 1.0 and rows["shared-R8-Dr8/fp16"]["ratio_P"] == 4.0  # measured == formula
    # int4: 8 + 8 numbers -> (4 + 4) code bytes + 4 per row's one group each: 16 bytes vs 4·2·8·2 = 128 of K/V
    assert rows["shared-R8-Dr8/int4"]["ratio_P"] == 128 / 16
    assert rows["shared-R8-Dr8/fp16"]["ppl_P"] > rows["source"]["ppl_P"]
    assert all("delta_P_vs_tuned_source_pct" in r for r in rows.values())
    assert set(report["tasks"]) == {"source", "shared-R8-Dr8", "shared-R8-Dr8-kl2"}
    assert out.with_suffix(".md").is_file() and out.with_suffix(".png").stat().st_size > 0
    assert bench.main(args) == 0  # everything reused from the work folder
    again = json.loads(out.with_suffix(".json").read_text())
    assert [r["ppl_P"] for r in again["rows"]] == [r["ppl_P"] for r in report["rows"]]
    assert all(c.endswith("# reused") for c in again["commands"])
