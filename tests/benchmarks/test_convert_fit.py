"""benchmarks/convert_fit.py at its smoke size: stories260K through ``kvsplice to-mla --ratio 2`` with and without the
layer-local correction, then ``kvsplice distill --minutes`` with a snapshot; each row measured against the source
(perplexities, KL, tasks) and written by the runner."""

from __future__ import annotations

import json

import pytest

from benchmarks.harness.paths import STORIES
from tiny_models import load_benchmark


def test_convert_fit_smoke_rows_and_report(tmp_path):
    if not (STORIES / "stories260K.bin").is_file():
        pytest.skip(f"needs the shared stories260K model ({STORIES})")
    study = load_benchmark("convert_fit")
    out = tmp_path / "cf"
    assert study.main(["--smoke", "--out", str(out), "--work", str(tmp_path / "work")]) == 0
    doc = json.loads((tmp_path / "cf.json").read_text())
    rows = {r["model"]: r for r in doc["rows"]}
    tuned = ["r2x-refine3+distill0.05min", "r2x-refine3+distill0.1min"]  # only the last --refine is fine-tuned
    assert set(rows) == {"source", "r2x-refine0", "r2x-refine3", *tuned}
    assert rows["source"]["kl_P"] == 0 and rows["r2x-refine0"]["kl_P"] > 0
    assert all(r["cache_dim"] == 32 for m, r in rows.items() if m != "source")  # stories260K K/V: 64 a token
    assert "--ratio 2 --refine-steps 3" in rows["r2x-refine3"]["command"]
    assert [rows[m]["minutes"] for m in tuned] == [0.05, 0.1]
    assert all("kvsplice distill" in rows[m]["command"] and "--snapshot-minutes 0.05" in rows[m]["command"]
               for m in tuned)
    assert rows[tuned[0]]["kl_P"] != rows["r2x-refine3"]["kl_P"]  # the snapshot is a fine-tuned model, measured
    assert (tmp_path / "work" / "runs" / "d-r2x-refine3" / "model-0.05min" / "config.json").is_file()
    md = (tmp_path / "cf.md").read_text()
    assert "| r2x-refine3 |" in md and "kvsplice to-mla" in md and f"| {tuned[1]} |" in md
    # a second run resumes every row from the JSON (nothing converted or measured again)
    assert study.main(["--smoke", "--out", str(out), "--work", str(tmp_path / "missing"), "--resume"]) == 0
    assert not (tmp_path / "missing" / "r2x-refine0").exists()
