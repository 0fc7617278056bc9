"""benchmarks/smollm2_frontier.py on the runner: a resumed run with ``--only`` and no id measures nothing and renders
the committed rows into the same tables as the committed report."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tiny_models import load_benchmark

ROOT = Path(__file__).resolve().parents[2]


def test_the_report_is_rendered_from_the_resumed_rows_alone(tmp_path, monkeypatch):
    import benchmarks.lib.smollm2_frontier_runs as runs

    monkeypatch.setattr(runs, "Bench", None)  # measuring a row would fail: none is measured
    bench = load_benchmark("smollm2_frontier")
    shutil.copy(ROOT / "results" / "smollm2_frontier.json", tmp_path / "f.json")
    assert bench.main(["--out", str(tmp_path / "f"), "--resume", "--force", "--only", "--threads", "1"]) == 0
    old, new = json.loads((ROOT / "results" / "smollm2_frontier.json").read_text()), \
        json.loads((tmp_path / "f.json").read_text())
    assert new["rows"] == old["rows"] and new["kvpress_quoted"] == old["kvpress_quoted"]
    md = (tmp_path / "f.md").read_text().splitlines()
    table = [line for line in md if line.startswith("| ★ |") or line.startswith("|  | ")]
    assert len(table) == sum(r["protocol"] == "P" for r in old["rows"])
    assert set(table) <= set((ROOT / "results" / "smollm2_frontier.md").read_text().splitlines())
    assert (tmp_path / "f.png").read_bytes()[:4] == b"\x89PNG"
