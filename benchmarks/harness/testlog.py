"""A pytest plugin (``pytest -p benchmarks.harness.testlog``): every test's outcome appended to $GPU_CHECK_TESTLOG as
it ends (so a run stopped at its timeout still has its counts), and each test's start (the one that hung is named);
:func:`read_testlog` reads it back, :func:`tests_end` makes a section's status of it."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional

__all__ = ["cuda_test_split", "gpu_test_command", "read_testlog", "tests_end"]


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


def gpu_test_command(files: list[str]) -> list[str]:
    """``pytest -m gpu -x`` on ``files`` with this plugin (and a per-test timeout where pytest-timeout is there)."""
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-x", "-q", "-p", "no:cacheprovider", "-p",
           "benchmarks.harness.testlog"]
    try:
        import pytest_timeout  # noqa: F401

        cmd += ["--timeout", "120"]
    except ImportError:
        pass
    return cmd + files


def tests_end(rc: Optional[int], tail: str, log: Path, timeout_s: float) -> tuple[list[dict], dict]:
    """``(a row per test, {status, reason, summary})`` of a :func:`gpu_test_command` that ended with ``rc`` (None:
    stopped at ``timeout_s``) and wrote ``log``."""
    rows, counts, hung = read_testlog(log)
    bad = [r["test"] for r in rows if r["outcome"] in ("failed", "error")]
    if rc is None:
        status, reason = "timeout", f"stopped at {timeout_s:.0f} s" + (f" while running {hung}" if hung else "")
    elif bad:
        status, reason = "failed", "failed: " + ", ".join(bad)
    elif rc == 5 or (rc == 0 and not rows):
        status, reason = "ok", "no test selected (-m gpu needs CUDA)"
    else:
        status, reason = ("ok", None) if rc == 0 else ("error", f"pytest exit code {rc}: " + " / ".join(
            tail.splitlines()[-3:]))
    summary = dict(counts, seconds=round(sum(r["seconds"] or 0 for r in rows), 1), exit_code=rc)
    return rows, dict(status=status, reason=reason, summary=summary)


def cuda_test_split(root: Optional[Path] = None) -> tuple[list[str], list[str]]:
    """The test files with CUDA tests (``pytest.mark.gpu``: what a device runs) and every other test file (the CPU
    suite, which CI runs; left unrun on the device)."""
    from benchmarks.harness.paths import ROOT

    root = root or ROOT
    files = sorted(p.relative_to(root).as_posix() for p in (root / "tests").rglob("test_*.py"))
    cuda = [f for f in files if "mark.gpu" in (root / f).read_text(encoding="utf-8", errors="replace")]
    return cuda, [f for f in files if f not in cuda]
