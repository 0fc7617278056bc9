"""One documented way in: ``kvsplice VERB`` (and the specified ``python -m training.fit --config NAME``).

The sources, docs, README and configs never teach ``python -m kvsplice.X`` / ``python -m kvsplice.cli.X`` /
``python -m training.X`` (X other than ``fit``), and code that starts a tool as a process runs the front door
(``-m kvsplice.cli.main VERB``); the modules that only ran the old way are gone."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from hostile import REPO

SCANNED = [*(f"{d}/**/*.py" for d in ("kvsplice", "models", "training", "data", "benchmarks", "docs")),
           "benchmarks/**/*.yaml", "docs/*.md", "README.md", "configs/*.yaml"]
TAUGHT = re.compile(r"python3?\s+-m\s+(kvsplice\b[\w.]*|training\.(?!fit\b)\w+)")
"""A command line that runs a kvsplice module, or a training module other than ``training.fit``."""
SPAWNED = re.compile(r"""["']-m["'],\s*["'](kvsplice(?!\.cli\.main["'])[\w.]*|training\.(?!fit\b)\w+)["']""")
"""Code that starts such a module as a process (``[sys.executable, "-m", "kvsplice.generate", ...]``)."""
RUN_MODULE = re.compile(r"""run_module\(\s*["'](kvsplice(?!\.cli\.main["'])[\w.]*|training\.(?!fit\b)\w+)["']""")
"""The same through the benchmarks' ``run_module("kvsplice.to_mla", ...)``."""


def old_forms(root: Path = REPO) -> list[str]:
    """``file:line: form`` for every old form under ``root``'s scanned files."""
    hits = []
    files = sorted({p for pattern in SCANNED for p in root.glob(pattern) if p.is_file()})
    for path in files:
        text = path.read_text(encoding="utf-8")
        for rx in (TAUGHT, SPAWNED, RUN_MODULE):
            for m in rx.finditer(text):
                line = text.count("\n", 0, m.start()) + 1
                hits.append((str(path.relative_to(root)), line, " ".join(m.group(0).split())))
    return [f"{f}:{n}: {form}" for f, n, form in sorted(hits)]


def test_no_file_teaches_or_runs_an_old_form():
    hits = old_forms()
    assert not hits, f"{len(hits)} old forms (say `kvsplice VERB`):\n" + "\n".join(hits)


def test_the_scan_finds_each_old_form(tmp_path):
    """The patterns catch what they are for (a line break inside the form too) and leave the front door alone."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("run `python -m kvsplice.generate --model M`\n"
                                            "or `python -m\n   kvsplice.cli.plan`, `python3 -m training.export`\n"
                                            "fine: `kvsplice generate`, `python -m training.fit --config tiny`\n")
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "b.py").write_text('a = [sys.executable, "-m", "kvsplice.to_mla"]\n'
                                                  'b = [sys.executable, "-m", "kvsplice.cli.main", "to-mla"]\n'
                                                  "c = ['-m', 'training.distill']\n")
    assert old_forms(tmp_path) == [
        'benchmarks/b.py:1: "-m", "kvsplice.to_mla"',
        "benchmarks/b.py:3: '-m', 'training.distill'",
        "docs/a.md:1: python -m kvsplice.generate",
        "docs/a.md:2: python -m kvsplice.cli.plan",
        "docs/a.md:3: python3 -m training.export",
    ]


def test_python_m_kvsplice_generate_no_longer_runs():
    """``-S``: only this checkout is on the path (an editable install of another checkout could supply the module)."""
    r = subprocess.run([sys.executable, "-S", "-m", "kvsplice.generate", "--help"], capture_output=True, text=True,
                       cwd=REPO, timeout=120)
    assert r.returncode != 0 and "No module named kvsplice.generate" in r.stderr, (r.returncode, r.stderr[-500:])
