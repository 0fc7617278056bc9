"""benchmarks/convert_rope_split.py's summary and report (its YAML's ``report:``) over its committed rows: the best
RoPE width per ratio in the JSON and as the report's last line."""

from __future__ import annotations

import json

from benchmarks.harness import report, studies
from tiny_models import load_benchmark


class _Run:
    def __init__(self, doc: dict):
        self.settings = {"skip": doc["skip_tokens"]}
        self.notes = {k: doc[k] for k in ("windows", "calibration_tokens", "source_ppl")}

    def __getitem__(self, key):
        return self.settings[key]


def test_the_summary_and_report_of_the_committed_rows():
    bench = load_benchmark("convert_rope_split")
    doc = json.loads((studies.STUDIES.parents[1] / "results" / "convert_rope_split.json").read_text())
    run = _Run(doc)
    extra = bench.summary(run, doc["rows"])
    assert extra["best_rope_dims"] == doc["best_rope_dims"] == {"2.0": 64, "4.0": 64, "8.0": 32}
    assert "best" not in extra  # the report's line, not a JSON field
    text = report.markdown(studies.load("convert_rope_split")["report"], doc["rows"],
                           {**run.settings, **extra, **run.notes})
    lines = text.split("\n")
    assert lines[0] == ("Selection on 4 × 1,024 tokens of the fine-tune text from token 300000 (protocol P scoring; "
                        "source ppl 6.776)")
    assert lines[4] == "| 2.00 | 176 | 16 | 137.183 | +1924.6 % |"
    assert lines[-1] == "best RoPE dims per ratio: 2.0x: 64, 4.0x: 64, 8.0x: 32"
