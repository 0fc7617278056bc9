"""benchmarks/fit_busy_machine.py's report (its YAML's ``report:``) over its committed rows: the table, the threads
the default picked (from ``training.fit``'s note) and the footer."""

from __future__ import annotations

import json

from benchmarks.harness import report, studies
from tiny_models import load_benchmark


def test_the_report_renders_the_committed_rows():
    bench = load_benchmark("fit_busy_machine")
    doc = json.loads((studies.STUDIES.parents[1] / "results" / "fit_busy_machine.json").read_text())
    rows = [{**r, "picked": bench.picked(r)} for r in doc["rows"]]
    assert [r["picked"] for r in rows] == ["-, 1 of 2", "-, -", "-, -"]
    text = report.markdown(studies.load("fit_busy_machine")["report"], rows, {**doc, "repeats": 3})
    lines = text.split("\n")
    assert lines[0] == "# training.fit on a busy machine (tiny_mla_kvsplice_90, 60 steps, 2 CPUs)"
    assert lines[4] == "| default | 16.9 | 26.7 | 1.58 | 0.33, 1.10 | -, 1 of 2 |"
    assert lines[-1].startswith("Medians of 3 run(s) each;") and lines[-2] == ""
