"""The stories260K bases studies' reports (their YAML ``report:``, :mod:`benchmarks.lib.bases_report`) render every
number of their committed results: each row's perplexity, the checks, the best rows and their per-layer tables."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.harness import report, studies
from benchmarks.lib.bases_report import fd_summary

ROOT = Path(__file__).resolve().parents[2]


def test_fd_online_report_marks_the_best_rows_and_renders_every_row():
    notes = json.loads((ROOT / "results" / "fd_online_stories260k.json").read_text())
    rows = notes.pop("rows")
    assert "per_layer" not in fd_summary(notes, rows)  # (the per-layer tables: in the notes, not the JSON)
    md = report.markdown(studies.load("fd_online_stories260k")["report"], rows, notes)
    main, layers = md.split("Per-layer diagnostics")
    table = [line.split(" | ") for line in main.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(table) == len(rows) and all(f"{r['ppl']:.3f}" in line for r, line in zip(rows, table))
    best = {(x["budget_rank"], x.get("label", x["method"])) for x in rows if x["best"]}
    assert best == {(2, "kq (post-RoPE)"), (2, "r=1/1, L=16, γ=0.95"), (4, "gqa-sum (post-RoPE)"),
                    (4, "r=3/3, L=128, τ_k=0.3 rel, m=16, J_max=16, γ=0.95"), (6, "gqa-sum (post-RoPE)"),
                    (6, "r=6/4, L=64, γ=0.95")}
    assert sum(line[4] == "yes" for line in table) == 6  # the best column
    assert "ppl **3.847** (320 numbers/token)" in main and layers.count("| layer | ε obs |") == 2


def test_stories260k_bases_report_renders_the_checks_and_every_fit():
    notes = json.loads((ROOT / "results" / "stories260k_bases.json").read_text())
    rows = notes.pop("results")  # (made before the runner: its rows under "results", its settings under "config")
    md = report.markdown(studies.load("stories260k_bases")["report"], rows, {**notes["config"], **notes})
    for r in rows:
        assert f"| {r['method']} | {r['rope']} | {r['rank']} | {r['elements_per_token']} | {r['ppl']:.3f} |" in md
    for text in ("Full K/V cache: **4.0775**", "**0 violations / 480**", "**0 / 480** on the held-out",
                 "post-RoPE: 0.045", "pre-RoPE: 0.070", "2,621,440 B vs full K/V 5,242,880 B", "= 3.9e-08",
                 "rel. diff 2.4e-08", "rel. diff 2.3e-07", "ratio 0.97–0.99", "ratio 1.13–1.13"):
        assert text in md, text
