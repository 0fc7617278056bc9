"""The study runner (``benchmarks/harness/runner.py``): sizes and bounds, outputs refused before anything runs (issue
60's footing: no overwrite without ``--force``, no folder, no unwritable place), resume, the header, atomic JSON /
Markdown / PNG writing, one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.harness.runner import Study, check_bounds, check_outputs
from benchmarks.harness.options import UsageError

SIZES = {"default": {"n": [1, 2, 3], "scale": 2}, "smoke": {"n": [1]}, "big": {"n": [4, 5]}}


def _study(calls: list, **kw) -> Study:
    def options(p):
        p.add_argument("--n", type=int, nargs="+")
        p.add_argument("--scale", type=int)

    def rows(run):
        for n in run["n"]:
            row = run.previous(n=n)
            if row is None:
                calls.append(n)
                row = {"n": n, "y": n * run["scale"]}
            yield row

    return Study("toy", "A toy study.\n\nMore.", rows, options=options, sizes=SIZES, bounds={"n": (1, 10)},
                 threads=None, **kw)


def _err(capsys) -> list[str]:
    return capsys.readouterr().err.strip().splitlines()


def test_a_study_writes_its_rows_header_and_report(tmp_path, capsys):
    calls: list = []
    study = _study(calls, markdown=lambda run, rows: f"# toy\n\n{len(rows)} rows", summary=lambda run, rows:
                   {"total": sum(r["y"] for r in rows)})
    assert study.main(["--out", str(tmp_path / "r.json"), "--scale", "3"]) == 0
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["rows"] == [{"n": 1, "y": 3}, {"n": 2, "y": 6}, {"n": 3, "y": 9}] and data["total"] == 18
    assert data["command"] == f"python -m benchmarks.toy --out {tmp_path / 'r.json'} --scale 3"
    assert data["complete"] is True and data["size"] == "default" and data["settings"] == {"n": [1, 2, 3], "scale": 3}
    assert data["machine"]["cores"] >= 1 and "revision" in data
    md = (tmp_path / "r.md").read_text()
    assert md.startswith("# toy\n\n3 rows\n") and "`python -m benchmarks.toy" in md
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json", "r.md"]  # no temporary file left


def test_named_sizes_and_smoke(tmp_path):
    calls: list = []
    assert _study(calls).main(["--smoke", "--out", str(tmp_path / "s")]) == 0
    assert _study(calls).main(["--size", "big", "--out", str(tmp_path / "b")]) == 0
    assert calls == [1, 4, 5]
    assert json.loads((tmp_path / "b.json").read_text())["settings"] == {"n": [4, 5], "scale": 2}


@pytest.mark.parametrize("argv, line", [
    (["--n", "-5"], "toy: error: --n: must be in [1, 10], got -5"),
    (["--n", "1", "11"], "toy: error: --n: must be in [1, 10], got 11"),
    (["--size", "huge"], "toy: error: argument --size: invalid choice: 'huge' (choose from big, default, smoke)"),
])
def test_sizes_are_bounded_before_anything_runs(argv, line, tmp_path, capsys):
    calls: list = []
    assert _study(calls).main([*argv, "--out", str(tmp_path / "r")]) == 2
    assert calls == [] and not list(tmp_path.iterdir())
    err = _err(capsys)
    assert len(err) == 1 and err[0].replace("'", "").replace(",", "") == line.replace("'", "").replace(",", ""), err


def test_outputs_are_refused_before_anything_runs(tmp_path, capsys):
    calls: list = []
    (tmp_path / "old.json").write_text("mine")
    (tmp_path / "dir").mkdir()
    (tmp_path / "file").write_text("x")
    for out, why in [(tmp_path / "old.json", "exists (--force replaces it)"), (tmp_path / "dir", "is a folder"),
                     (Path("/"), "is a folder"), (tmp_path / "file" / "r", "is a file, not a folder"),
                     (Path("/proc/none/r"), "cannot write in /proc")]:
        assert _study(calls).main(["--out", str(out)]) == 2, out
        err = _err(capsys)
        assert len(err) == 1 and err[0].startswith("toy: error: ") and why in err[0], (out, err)
    assert calls == [] and (tmp_path / "old.json").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir", "file", "old.json"]
    assert _study(calls).main(["--out", str(tmp_path / "old"), "--force"]) == 0
    assert json.loads((tmp_path / "old.json").read_text())["rows"][0] == {"n": 1, "y": 2}


def test_check_outputs_refuses_what_is_not_a_regular_file(tmp_path):
    import os

    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "link").symlink_to(tmp_path / "target")
    for name in ("fifo", "link"):
        with pytest.raises(UsageError, match="not a regular file"):
            check_outputs([tmp_path / name], force=True)
    check_outputs([tmp_path / "new" / "deeper" / "r.json"], force=False)  # missing folders are made later
    assert not (tmp_path / "new").exists()


def test_check_bounds_names_the_option():
    check_bounds({"n": [1, 10], "other": -1}, {"n": (1, 10)})
    for bad in ([0], [float("nan")], [True], "3", 1e9):
        with pytest.raises(UsageError, match=r"^--n: must be in \[1, 10\]"):
            check_bounds({"n": bad}, {"n": (1, 10)})


def test_resume_continues_an_earlier_run(tmp_path, capsys):
    out = tmp_path / "r.json"
    calls: list = []
    partial = {"study": "toy", "rows": [{"n": 1, "y": 100}], "complete": False}
    out.write_text(json.dumps(partial))
    assert _study(calls).main(["--out", str(out), "--resume"]) == 0
    assert calls == [2, 3]
    assert [r["y"] for r in json.loads(out.read_text())["rows"]] == [100, 4, 6]
    out.write_text(json.dumps({"study": "other", "rows": []}))
    assert _study(calls).main(["--out", str(out), "--resume"]) == 2
    assert "not a toy results file" in _err(capsys)[0]


def test_a_killed_study_leaves_its_rows_so_far(tmp_path, capsys):
    def rows(run):
        yield {"n": 1}
        raise KeyboardInterrupt

    assert Study("toy", None, rows, sizes={"default": {}}, threads=None).main(["--out", str(tmp_path / "r")]) == 130
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["rows"] == [{"n": 1}] and data["complete"] is False
    assert _err(capsys) == ["toy: interrupted"]


def test_a_figure_only_study_writes_one_png(tmp_path):
    from matplotlib.figure import Figure

    study = Study("fig", None, lambda run: iter([{"x": 1}]), figure=lambda run, rows: Figure(figsize=(1, 1)),
                  json=False, sizes={"default": {}}, threads=None)
    assert study.main(["--out", str(tmp_path / "f.png")]) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["f.png"]
    assert (tmp_path / "f.png").read_bytes()[:4] == b"\x89PNG"
    assert study.main(["--out", str(tmp_path / "f.png")]) == 2  # no overwrite without --force


def test_a_failed_check_writes_the_results_and_exits_1(tmp_path, capsys):
    def rows(run):
        yield {"n": 1}
        run.notes["seen"] = 1
        run.fail("the doors disagree")

    study = Study("toy", None, rows, sizes={"default": {}}, threads=None,
                  summary=lambda run, rows: {"seen": run.notes["seen"]})
    assert study.main(["--out", str(tmp_path / "r")]) == 1
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["complete"] and data["seen"] == 1 and data["rows"] == [{"n": 1}]
    assert _err(capsys) == ["toy: failed: the doors disagree"]


def test_rows_emitted_from_jobs_side_by_side_are_all_written(tmp_path):
    """A study whose runs go side by side adds each row as it finishes (:meth:`Run.emit`, thread-safe)."""
    from concurrent.futures import ThreadPoolExecutor

    def rows(run):
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda i: run.emit({"i": i}), range(16)))
        yield from ()

    assert Study("toy", None, rows, sizes={"default": {}}, threads=None).main(["--out", str(tmp_path / "r")]) == 0
    assert sorted(r["i"] for r in json.loads((tmp_path / "r.json").read_text())["rows"]) == list(range(16))


def test_a_results_file_from_before_the_runner_resumes(tmp_path):
    """A study's JSON written before the runner (``meta`` with its command, rows, no ``study``) can be resumed; one
    from another study (a ``study`` of another name) cannot."""
    out = tmp_path / "r.json"
    out.write_text(json.dumps({"meta": {"command": "python benchmarks/toy.py"}, "rows": [{"n": 1, "y": 7}]}))
    calls: list = []
    assert _study(calls).main(["--out", str(out), "--resume"]) == 0
    assert calls == [2, 3] and json.loads(out.read_text())["rows"][0] == {"n": 1, "y": 7}
