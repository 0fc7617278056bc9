"""The size of ``benchmarks/``: no script over :data:`SCRIPT_LINES` lines and the folder's Python
(``benchmarks/*.py benchmarks/*/*.py``, as ``wc -l`` counts it) within :data:`FOLDER_LINES` (issue 59). Scripts still
over are listed in :data:`OVER` with their length and the folder has a ceiling :data:`FOLDER_NOW`: both only shrink
(a script that grows, or one that is within the limit and still listed, fails), until they reach the budget."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT_LINES, FOLDER_LINES = 150, 6000
OVER: dict[str, int] = {}
"""Scripts not yet within :data:`SCRIPT_LINES`: their length now (the most they may have)."""
FOLDER_NOW = 0
"""A ceiling above the budget while the folder was over it (it only shrank); 0: the folder is within the budget."""


def lines(path: Path) -> int:
    """Newlines in ``path`` (``wc -l``)."""
    return path.read_bytes().count(b"\n")


def sizes(folder: Path) -> tuple[dict[str, int], int]:
    """``({script: lines}, total)``: the scripts ``folder/*.py`` and the total over ``folder/*.py folder/*/*.py``."""
    scripts = {p.stem: lines(p) for p in folder.glob("*.py")}
    return scripts, sum(scripts.values()) + sum(lines(p) for p in folder.glob("*/*.py"))


def over_budget(folder: Path, over: dict[str, int], folder_now: int) -> list[str]:
    """What breaks the budget (empty: nothing)."""
    scripts, total = sizes(folder)
    bad = [f"{n}.py: {k} lines (at most {over.get(n, SCRIPT_LINES)})" for n, k in sorted(scripts.items())
           if k > over.get(n, SCRIPT_LINES)]
    bad += [f"{n}.py is within {SCRIPT_LINES} lines now (or gone): take it off OVER" for n in sorted(over)
            if scripts.get(n, 0) <= SCRIPT_LINES]
    if total > max(FOLDER_LINES, folder_now):
        bad.append(f"benchmarks/: {total} lines (at most {max(FOLDER_LINES, folder_now)}; the budget {FOLDER_LINES})")
    return bad


def test_the_budget_check_finds_a_long_script_and_a_large_folder(tmp_path):
    (tmp_path / "lib").mkdir()
    (tmp_path / "a.py").write_text("x = 1\n" * 151)
    (tmp_path / "b.py").write_text("x = 1\n" * 150)
    (tmp_path / "lib" / "c.py").write_text("x = 1\n" * 5800)
    assert sizes(tmp_path) == ({"a": 151, "b": 150}, 6101)
    assert over_budget(tmp_path, {}, 0) == ["a.py: 151 lines (at most 150)",
                                            "benchmarks/: 6101 lines (at most 6000; the budget 6000)"]
    assert over_budget(tmp_path, {"a": 151, "b": 150}, 6101) == [
        "b.py is within 150 lines now (or gone): take it off OVER"]
    assert over_budget(tmp_path, {"a": 151}, 6200) == []


def test_benchmarks_keep_within_their_line_budget():
    assert not over_budget(ROOT / "benchmarks", OVER, FOLDER_NOW)
