"""The declarative report (``benchmarks.harness.report``): cell templates, tables by part, a study's ``report:`` /
``figure:`` written by the runner."""

from __future__ import annotations

import json

import pytest

from benchmarks.harness import report, studies
from benchmarks.harness.runner import Study


def test_cell_fills_formats_and_marks_missing_fields():
    row = {"ms": 1.23456, "nbytes": 3 * 2**20, "name": "a|b", "none": None}
    assert report.cell("**{ms:.2f}**", row) == "**1.23**"
    assert report.cell("{nbytes!M:.1f}", row) == "3.0"
    assert report.cell("{name}", row) == "a\\|b"
    assert report.cell("{none:.1f}", row) == "-"
    assert report.cell("{absent} x", row) == "-"
    assert report.cell("{absent}", row, missing="—") == "—"


def test_flags_items_missing_text_header_templates_and_empty_columns():
    """``!y`` writes a flag as yes/no, ``{d[k]}`` an item (missing: the spec's ``missing``); headers are templates
    over the values; ``drop_empty`` leaves out a column no row fills."""
    spec = {"missing": "", "drop_empty": True, "columns": {"ok": "{ok!y}", "on": "{t[on]:.1f}", "auto": "{t[auto]}",
                                                           "n ({n:,})": "{x:.1f}"}}
    rows = [{"ok": True, "t": {"on": 1.25}, "x": 2.0}, {"ok": False, "t": {}, "x": None}]
    assert report.markdown(spec, rows, {"n": 2048}).split("\n") == [
        "| ok | on | n (2,048) |", "|---|---|---|", "| yes | 1.2 | 2.0 |", "| no |  |  |", ""]
    assert report.cell("{t[zz]}", rows[0]) == "-" and report.cell("{t[zz]}", rows[0], "—") == "—"


def test_fmt_reads_each_kind_of_value():
    assert [report.fmt(v) for v in (None, float("nan"), True, 12345, 0.0, 0.001, 1.5, 123.45, 12345.6, "x")] == [
        "-", "-", "yes", "12,345", "0", "1.0e-03", "1.500", "123.5", "12,346", "x"]


def test_table_takes_templates_or_keys():
    rows = [{"a": 1, "b": 2.5, "section": "s"}, {"a": 2}]
    assert report.table(rows, {"A": "{a}", "B": "{b:.1f}"}) == [
        "| A | B |", "|---|---|", "| 1 | 2.5 |", "| 2 | - |", ""]
    assert report.table(rows, ["b", "zzz"]) == ["| b |", "|---|", "| 2.500 |", "| - |", ""]
    assert report.table(rows, [])[0] == "| a | b |"
    assert report.table([], ["a"]) == []


def test_markdown_splits_rows_by_part_with_titles_and_fills_the_intro():
    spec = {"title": "T {n}", "intro": "on {n} windows", "columns": {"x": "{x}"}, "by": "part",
            "titles": {"p2": "Second", "p1": "First", "p3": "None here"}}
    rows = [{"part": "p1", "x": 1}, {"part": "p2", "x": 2}, {"part": "p1", "x": 3}]
    assert report.markdown(spec, rows, {"n": 4}).split("\n") == [
        "# T 4", "", "on 4 windows", "", "## Second", "", "| x |", "|---|", "| 2 |", "", "## First", "", "| x |",
        "|---|", "| 1 |", "| 3 |", ""]


def test_markdown_takes_columns_per_part_and_intro_paragraphs_whose_fields_are_there():
    spec = {"intro": ["on {n} windows", "skipped: {why}", "{n} again"], "by": "part",
            "columns": {"p1": ["x"], "p2": {"Y": "{y:.1f}"}}, "titles": {"p1": "First", "p2": "Second"}}
    rows = [{"part": "p1", "x": 1, "y": 2.0}, {"part": "p2", "x": 2, "y": 3.0}]
    assert report.markdown(spec, rows, {"n": 4}).split("\n") == [
        "on 4 windows", "", "4 again", "", "## First", "", "| x |", "|---|", "| 1 |", "", "## Second", "", "| Y |",
        "|---|", "| 3.0 |", ""]
    assert "skipped: no GPU" in report.markdown(spec, rows, {"n": 4, "why": "no GPU"})
    with pytest.raises(KeyError):  # one template: every field it names is needed
        report.markdown({"intro": "skipped: {why}", "columns": ["x"]}, rows, {})


def test_a_study_with_a_report_and_figure_in_its_yaml_writes_both(tmp_path, monkeypatch):
    (tmp_path / "toy.yaml").write_text(
        "sizes: {default: {n: 3}}\nreport: {title: 'Toy of {n}', columns: {k: '{k}', y: '{y:.2f}'}}\n"
        "figure: {x: k, y: y, series: s, panels: [p], xlog: 2, hline: 1.0}\n")
    monkeypatch.setattr(studies, "STUDIES", tmp_path)
    studies._read.cache_clear()

    def rows(run):
        for k in range(1, run["n"] + 1):
            yield {"k": k, "y": k / 3, "s": "a", "p": 1}

    out = tmp_path / "out" / "toy"
    (tmp_path / "out").mkdir()
    assert Study("toy", "A toy.", rows).main(["--out", str(out)]) == 0
    md = (tmp_path / "out" / "toy.md").read_text().split("\n")
    assert md[:6] == ["# Toy of 3", "", "| k | y |", "|---|---|", "| 1 | 0.33 |", "| 2 | 0.67 |"]
    assert (tmp_path / "out" / "toy.png").read_bytes()[:4] == b"\x89PNG"
    assert len(json.loads((tmp_path / "out" / "toy.json").read_text())["rows"]) == 3
    studies._read.cache_clear()


@pytest.mark.parametrize("result", ["smollm2_speed_2k_b1", "smollm2_speed_8k_b8_hf"])
def test_smollm2_speed_report_reads_its_committed_rows(result):
    rows = json.loads((studies.STUDIES.parents[1] / "results" / f"{result}.json").read_text())["rows"]
    text = report.markdown(studies.load("smollm2_speed")["report"], rows)
    assert text.split("\n")[0] == "# SmolLM2-135M-Instruct: decode speed of compressed caches"
    assert text.count("\n| ") == len(rows) + 1
    assert f"**{rows[0]['decode_vs_full']:.2f}**" in text


def test_the_footer_follows_the_tables_filled_from_the_values():
    spec = {"intro": "on {n}", "columns": {"x": "{x}"}, "footer": "best: {best}\n"}
    assert report.markdown(spec, [{"x": 1}], {"n": 2, "best": "a"}).split("\n") == [
        "on 2", "", "| x |", "|---|", "| 1 |", "", "best: a"]


def test_the_runner_fills_a_footer_from_the_summary(tmp_path, monkeypatch):
    (tmp_path / "toy.yaml").write_text(
        "sizes: {default: {n: 2}}\nreport: {columns: {k: '{k}'}, footer: '{m} of {n}'}\n")
    monkeypatch.setattr(studies, "STUDIES", tmp_path)
    studies._read.cache_clear()
    study = Study("toy", "A toy.", lambda run: ({"k": k} for k in range(run["n"])),
                  summary=lambda run, rows: {"m": len(rows)})
    assert study.main(["--out", str(tmp_path / "toy")]) == 0
    assert (tmp_path / "toy.md").read_text().split("\n")[:6] == ["| k |", "|---|", "| 0 |", "| 1 |", "", "2 of 2"]
    studies._read.cache_clear()


def test_a_scatter_figure_marks_each_series_draws_the_front_and_keeps_the_rows_where_asks():
    """``kind: scatter``: a marker per series in ``markers``' order, a dashed line through the ``front`` rows (sorted
    by x), only the rows matching ``where``; ``ylog: symlog``, ``size`` and ``title`` set the axes."""
    rows = [{"x": 4, "y": 0.5, "s": "b", "f": "★", "p": "P"}, {"x": 1, "y": 30.0, "s": "a", "f": "", "p": "P"},
            {"x": 2, "y": 2.0, "s": "a", "f": "★", "p": "P"}, {"x": 8, "y": 9.0, "s": "a", "f": "★", "p": "W"}]
    spec = {"kind": "scatter", "where": {"p": "P"}, "x": "x", "y": "y", "series": "s", "markers": {"b": "D", "a": "^"},
            "front": {"field": "f", "label": "front"}, "ylog": "symlog", "xlog": 10, "size": [9, 5], "title": "T"}
    ax = report.figure(spec, rows).axes[0]
    assert [c.get_label() for c in ax.collections] == ["b", "a"]
    assert [c.get_offsets().tolist() for c in ax.collections] == [[[4, 0.5]], [[1, 30.0], [2, 2.0]]]
    (front,) = ax.get_lines()
    assert front.get_label() == "front" and front.get_xdata().tolist() == [2, 4] and front.get_linestyle() == "--"
    assert ax.get_yscale() == "symlog" and ax.get_xscale() == "log" and ax.get_title() == "T"
    assert ax.figure.get_size_inches().tolist() == [9, 5]


def test_a_report_may_tabulate_the_summarys_statistics_rows():
    spec = {"rows": "stats", "columns": {"variant": "{variant}", "mean": "{mean:.1f}"}}
    runs = [{"variant": "a", "loss": 1.0}, {"variant": "a", "loss": 2.0}]
    assert report.markdown(spec, runs, {"stats": [{"variant": "a", "mean": 1.5}]}).split("\n") == [
        "| variant | mean |", "|---|---|", "| a | 1.5 |", ""]


def test_part_titles_are_templates_over_the_values():
    spec = {"by": "part", "titles": {"a": "against {ref}"}, "columns": {"x": "{x}"}}
    assert report.markdown(spec, [{"part": "a", "x": 1}], {"ref": "mha"}).split("\n")[0] == "## against mha"
