"""benchmarks/convert_fit.py at its smoke size: stories260K through ``kvsplice to-mla --ratio 2`` with and without the
layer-local correction, each row measured against the source (perplexities, KL, tasks) and written by the runner."""

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
    assert set(rows) == {"source", "r2x-refine0", "r2x-refine3"}
    assert rows["source"]["kl_P"] == 0 and rows["r2x-refine0"]["kl_P"] > 0
    assert all(rows[m]["cache_dim"] == 32 for m in ("r2x-refine0", "r2x-refine3"))  # stories260K K/V: 64 a token
    assert "--ratio 2 --refine-steps 3" in rows["r2x-refine3"]["command"]
    md = (tmp_path / "cf.md").read_text()
    assert "| r2x-refine3 |" in md and "kvsplice to-mla" in md
    # a second run resumes every row from the JSON (nothing converted or measured again)
    assert study.main(["--smoke", "--out", str(out), "--work", str(tmp_path / "missing"), "--resume"]) == 0
    assert not (tmp_path / "missing" / "r2x-refine0").exists()
