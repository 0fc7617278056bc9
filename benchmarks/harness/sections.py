"""Sections of ``benchmarks/gpu_check.py``, each a study's command (or pytest) in its own process group under a time
budget: the plan, and a section run, ended at its limit, on Ctrl-C or SIGTERM. Also a pytest plugin (``-p
benchmarks.harness.sections``) logging each test's start and end to $GPU_CHECK_TESTLOG: a stopped run names the hang."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Iterator, Optional

from benchmarks.harness.paths import ROOT

__all__ = ["Terminated", "by_section", "child_rows", "cuda_test_split", "decide", "on_sigterm", "plan", "print_plan",
           "read_testlog", "run_process", "run_section"]


def decide(estimate_s: float, limit_s: float, remaining_s: float) -> tuple[bool, float, Optional[str]]:
    """``(run, timeout_s, skip reason)``: a section runs when its estimate fits what is left of the budget, and is
    stopped at its own limit or the budget's end, whichever comes first."""
    if remaining_s < estimate_s:
        return False, 0.0, f"{remaining_s:.0f} s of the budget left, the section's estimate is {estimate_s:.0f} s"
    return True, min(limit_s, remaining_s), None


def plan(settings: dict, names: list[str], budget_s: float, smoke: bool) -> list[dict]:
    """Each of ``names`` in ``settings["sections"]``' order (smoke: ``smoke_s`` and ``smoke_limit_s``) with whether it
    would run if every one before it took its estimate (``startup_s`` first) and the time it would be stopped at."""
    left = budget_s - settings["startup_s"]
    out = []
    for name in (k for k in settings["sections"] if k in names):
        s = settings["sections"][name]
        est, limit = (s["smoke_s"], settings["smoke_limit_s"]) if smoke else (s["estimate_s"], s["limit_s"])
        run, timeout, reason = decide(est, limit, left)
        out.append(dict(section=name, what=s["what"], estimate_s=est, limit_s=limit, runs=run,
                        timeout_s=round(timeout), skip_reason=reason))
        if run:
            left -= est
    return out


def print_plan(prog: str, rows: list[dict], budget_s: float, startup_s: float, smoke: bool, file=None) -> None:
    """The plan, a line per section, and whether its estimate fits the budget."""
    total = startup_s + sum(r["estimate_s"] for r in rows if r["runs"])
    lines = [f"{prog} plan{' (smoke sizes)' if smoke else ''}: budget {budget_s:.0f} s, estimate {total:.0f} s "
             f"({total / 60:.1f} min) including {startup_s:.0f} s start"]
    for i, r in enumerate(rows, 1):
        state = f"~{r['estimate_s']:.0f} s, stopped at {r['timeout_s']} s" if r["runs"] else \
            f"SKIPPED ({r['skip_reason']})"
        lines.append(f"  {i}. {r['section']:<8} {state}: {r['what']}")
    lines.append(f"total estimate: {total:.0f} s <= budget {budget_s:.0f} s: {'yes' if total <= budget_s else 'NO'}")
    print("\n".join(lines), file=file or sys.stdout, flush=True)


def by_section(rows: list[dict], names: list[str]) -> dict[str, dict]:
    """``section -> its last status row, with ``rows``: its measurements`` for each of ``names`` that has one."""
    out = {k: dict(rows=[]) for k in names if any(r.get("section") == k and "status" in r for r in rows)}
    for r in rows:
        if "status" in r and r.get("section") in out:
            out[r["section"]].update(r)
        elif r.get("section") in out:
            out[r["section"]]["rows"].append(r)
    return out


def child_rows(stem: Path) -> tuple[list[dict], dict]:
    """The rows a section's process wrote (its JSON, rewritten after every row) and its notes (the fields beside them
    less the header and the run's facts)."""
    try:
        data = json.loads(stem.with_suffix(".json").read_text())
    except (OSError, ValueError):
        return [], {}
    skip = {"rows", "command", "machine", "revision", "study", "size", "settings", "complete", "device", "torch",
            "triton", "cuda", "python", "transformers", "capability", "smoke_run", "dtype"}
    return data.get("rows", []), {k: v for k, v in data.items() if k not in skip}


def run_section(prog: str, step: dict, spec: dict, left_s: float, smoke: bool, cuda: bool,
                folder: Path) -> Iterator[dict]:
    """One planned section's rows: ``skipped`` with the reason, or ``running``, its measurements and its end (``ok``,
    ``failed``, ``error``, ``timeout``; ``stopped`` before a stop from outside goes on up). ``spec["study"]``: its
    command ``python -m benchmarks.STUDY --size check|smoke --sections NAME`` (+ ``args`` on a full run), or pytest."""
    name = step["section"]
    head = dict(section=name, what=("smoke sizes; full run: " if smoke else "") + spec["what"],
                estimate_s=step["estimate_s"])
    go, timeout, reason = decide(step["estimate_s"], step["limit_s"], left_s)
    if not go:
        reason = f"budget: {reason}"
    elif spec.get("cuda") and not cuda:
        reason = "needs CUDA (a CPU smoke run)"
    print(f"{prog}: {name} " + (f"skipped: {reason}" if reason else f"(stopped at {timeout:.0f} s)"), file=sys.stderr)
    if reason:
        yield dict(head, status="skipped", reason=reason)
        return
    yield dict(head, status="running", timeout_s=round(timeout))
    path = [str(ROOT)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path), PYTHONUNBUFFERED="1")
    if smoke and not cuda:
        env.setdefault("TRITON_INTERPRET", "1")  # the kernel on CPU tensors: Triton's interpreter
    s0, stem, log = time.monotonic(), folder / name, folder / f"{name}.tests.jsonl"
    tests = spec["study"] == "pytest"
    if tests:  # pytest -m gpu -x with the plugin below (and a per-test timeout where pytest-timeout is there)
        timeout_opt = ["--timeout", "120"] if importlib.util.find_spec("pytest_timeout") else []
        cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-x", "-q", "-p", "no:cacheprovider", "-p",
               "benchmarks.harness.sections", *timeout_opt, *spec["smoke_files" if smoke else "files"]]
        env["GPU_CHECK_TESTLOG"] = str(log)
    else:
        cmd = [sys.executable, "-m", f"benchmarks.{spec['study']}", "--size", "smoke" if smoke else "check",
               "--sections", name, "--out", str(stem), "--force", *([] if smoke else spec.get("args", []))]
    try:
        rc, tail = run_process(cmd, timeout, env)
    except BaseException as e:  # stopped from outside: the rows so far and the section marked, then the stop
        yield from ({"section": name, **r} for r in (read_testlog(log)[0] if tests else child_rows(stem)[0]))
        yield dict(head, status="stopped", reason=f"the run was stopped ({type(e).__name__})",
                   elapsed_s=round(time.monotonic() - s0, 1))
        raise
    if tests:
        got, counts, hung = read_testlog(log)
        notes = dict(counts, seconds=round(sum(r["seconds"] or 0 for r in got), 1), exit_code=rc,
                     left_unrun=f"{len(cuda_test_split()[1])} CPU-suite files (no CUDA test in them)")
    else:
        (got, notes), hung = child_rows(stem), None
    bad = [r["test"] for r in got if r.get("outcome") in ("failed", "error")]
    if rc is None:
        reason = f"stopped at its limit, {timeout:.0f} s" + (f" while running {hung}" if hung else "")
        end = dict(status="timeout", reason=reason)
    elif bad:
        end = dict(status="failed", reason="failed: " + ", ".join(bad))
    elif tests and (rc == 5 or (rc == 0 and not got)):
        end = dict(status="ok", reason="no test selected (-m gpu needs CUDA)")
    elif rc:
        end = dict(status="error", reason=f"exit code {rc}: " + " / ".join(tail.splitlines()[-3:]))
    elif isinstance(notes.get(name), str) and not got:  # the study says why it cannot run here
        end = dict(status="skipped", reason=notes.pop(name))
    else:
        end = dict(status="ok")
    end["summary"] = notes
    if tests:
        end["command"] = " ".join(cmd[1:])
    yield from ({"section": name, **r} for r in got)
    yield dict(head, **end, elapsed_s=round(time.monotonic() - s0, 1))
    print(f"{prog}: {name} {end['status']} in {time.monotonic() - s0:.0f} s", file=sys.stderr, flush=True)


def run_process(cmd: list[str], timeout_s: float, env: dict, tail_lines: int = 40,
                cwd: Path = ROOT) -> tuple[Optional[int], str]:
    """``(exit code, or None when stopped at ``timeout_s``; the last lines of its output)`` of ``cmd`` run in its own
    process group (ended with its children, e.g. compile workers), its output passed through."""
    tail: deque[str] = deque(maxlen=tail_lines)
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", start_new_session=True)

    def pump():
        for line in proc.stdout:
            print(line, end="", flush=True)
            tail.append(line.rstrip("\n"))

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        rc: Optional[int] = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        rc = None
    finally:  # past its limit, or Ctrl-C: end the section's processes too, each signal given 5 s
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if proc.poll() is not None:
                break
            try:
                os.killpg(proc.pid, sig)
                proc.wait(timeout=5)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
    reader.join(timeout=5)
    return rc, "\n".join(tail)


class Terminated(SystemExit):
    """SIGTERM (the device tool's timeout, ``kill``): unwinds like Ctrl-C, so the running section is stopped."""


def on_sigterm(signum, frame):  # noqa: ARG001 - signal handler signature
    raise Terminated(128 + signal.SIGTERM)


def pytest_runtest_logstart(nodeid, location):  # noqa: ARG001 - pytest hook signature
    _testlog(dict(event="start", test=nodeid))


def pytest_runtest_logreport(report):
    if report.when == "call" or report.failed or report.skipped:  # a setup / teardown only when it failed or skipped
        outcome = report.outcome if report.when == "call" or not report.failed else "error"
        msg = ""
        if report.failed:  # the first "E " line, else the last
            lines = [ln for ln in str(report.longrepr).strip().splitlines() if ln.strip()]
            msg = ([ln for ln in lines if ln.startswith("E ")] or lines[-1:] or [""])[0][:300]
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


def cuda_test_split(root: Path = ROOT) -> tuple[list[str], list[str]]:
    """The test files with CUDA tests (``pytest.mark.gpu``: what a device runs) and every other test file (the CPU
    suite, which CI runs; left unrun on the device)."""
    files = sorted(p.relative_to(root).as_posix() for p in (root / "tests").rglob("test_*.py"))
    cuda = [f for f in files if "mark.gpu" in (root / f).read_text(encoding="utf-8", errors="replace")]
    return cuda, [f for f in files if f not in cuda]
