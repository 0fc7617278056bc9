"""A pytest plugin (``pytest -p benchmarks.harness.testlog``): every test's outcome appended to $GPU_CHECK_TESTLOG as
it ends (so a run stopped at its timeout still has its counts), and each test's start (the one that hung is named);
:func:`read_testlog` reads it back."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

__all__ = ["read_testlog"]


def pytest_runtest_logstart(nodeid, location):  # noqa: ARG001 - pytest hook signature
    _testlog(dict(event="start", test=nodeid))


def pytest_runtest_logreport(report):
    if report.when == "call" or (report.when != "call" and (report.failed or report.skipped)):
        outcome = report.outcome if report.when == "call" or not report.failed else "error"
        msg = ""
        if report.failed:
            lines = [ln for ln in str(report.longrepr).strip().splitlines() if ln.strip()]
            errs = [ln for ln in lines if ln.startswith("E ")]
            msg = (errs[0] if errs else lines[-1] if lines else "")[:300]
        elif report.skipped and isinstance(report.longrepr, tuple):
            msg = str(report.longrepr[2])[:300]
        _testlog(dict(event="end", test=report.nodeid, outcome=outcome, when=report.when,
                      seconds=round(report.duration, 2), message=msg))


def _testlog(entry: dict) -> None:
    path = os.environ.get("GPU_CHECK_TESTLOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(entry) + "\n")


def read_testlog(path: Path) -> tuple[list[dict], dict, Optional[str]]:
    """``(rows, counts, the test started last and never ended)`` from the plugin's log."""
    rows, started = [], []
    if Path(path).exists():
        for line in Path(path).read_text().splitlines():
            try:
                e = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut off by the stop
            if e.get("event") == "start":
                started.append(e["test"])
            elif e.get("event") == "end":
                rows.append({k: e.get(k) for k in ("test", "outcome", "seconds", "message")})
    counts = {k: sum(r["outcome"] == k for r in rows) for k in ("passed", "failed", "error", "skipped")}
    ended = {r["test"] for r in rows}
    hung = next((t for t in reversed(started) if t not in ended), None)
    return rows, counts, hung
