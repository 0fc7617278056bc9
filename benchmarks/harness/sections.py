"""Sections of a study, each in its own process under a time budget (``benchmarks/gpu_check.py``): the plan (which
sections fit the budget, each stopped at its own limit), a section run as a study's command (or pytest) in a process
group ended at the limit, on Ctrl-C or SIGTERM, its rows and status rows."""

from __future__ import annotations

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

__all__ = ["Terminated", "by_section", "child_rows", "decide", "on_sigterm", "plan", "print_plan", "run_process",
           "run_section"]


def decide(estimate_s: float, limit_s: float, remaining_s: float) -> tuple[bool, float, Optional[str]]:
    """``(run, timeout_s, skip reason)``: a section runs when its estimate fits what is left of the global budget,
    and is stopped at its own limit or the end of the budget, whichever comes first."""
    if remaining_s < estimate_s:
        return False, 0.0, f"{remaining_s:.0f} s of the budget left, the section's estimate is {estimate_s:.0f} s"
    return True, min(limit_s, remaining_s), None


def plan(sections: dict, names: list[str], budget_s: float, startup_s: float) -> list[dict]:
    """Each of ``names`` (``sections``: name -> ``{what, estimate_s, limit_s}``) with whether it would run if every
    section before it took its estimate (``startup_s`` first) and the time it would be stopped at."""
    left = budget_s - startup_s
    out = []
    for name in names:
        s = sections[name]
        run, timeout, reason = decide(s["estimate_s"], s["limit_s"], left)
        out.append(dict(section=name, what=s["what"], estimate_s=s["estimate_s"], limit_s=s["limit_s"], runs=run,
                        timeout_s=round(timeout), skip_reason=reason))
        if run:
            left -= s["estimate_s"]
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
    """``section -> its last status row (``pending``, ``running``, then its end), with ``rows``: its measurements``
    for each of ``names`` that has a status row, in that order (a row with a ``status`` is a status row)."""
    out = {k: dict(rows=[]) for k in names if any(r.get("section") == k and "status" in r for r in rows)}
    for r in rows:
        if r.get("section") not in out:
            continue
        if "status" in r:
            out[r["section"]].update(r)
        else:
            out[r["section"]]["rows"].append(r)
    return out


def child_rows(stem: Path) -> tuple[list[dict], dict]:
    """The rows a section's process wrote (the runner's JSON, rewritten after every row) and its notes (the fields
    beside them, less the header and the run's facts)."""
    try:
        data = json.loads(stem.with_suffix(".json").read_text())
    except (OSError, ValueError):
        return [], {}
    skip = {"rows", "command", "machine", "revision", "study", "size", "settings", "complete", "device", "torch",
            "triton", "cuda", "python", "transformers", "capability", "smoke_run", "dtype"}
    return data.get("rows", []), {k: v for k, v in data.items() if k not in skip}


def run_section(prog: str, step: dict, spec: dict, left_s: float, smoke: bool, cuda: bool,
                folder: Path) -> Iterator[dict]:
    """One planned section's rows: its status (``skipped`` with the reason, or ``running``), then its measurements
    and its end (``ok``, ``failed``, ``error``, ``timeout``; ``stopped`` before a stop from outside goes on up).
    ``spec["study"]``: ``python -m benchmarks.STUDY --size check --sections NAME --out folder/NAME`` (its ``args``
    added on a full run; ``--smoke`` size on a smoke run) in its own process, or ``pytest`` on ``spec["files"]``."""
    from benchmarks.harness.testlog import cuda_test_split, gpu_test_command, read_testlog, tests_end

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
    if tests:
        cmd = gpu_test_command(spec["smoke_files" if smoke else "files"])
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
        got, end = tests_end(rc, tail, log, timeout)
        end.update(command=" ".join(cmd[1:]))
        end["summary"]["left_unrun"] = f"{len(cuda_test_split()[1])} CPU-suite files (no CUDA test in them)"
    else:
        got, notes = child_rows(stem)
        if rc is None:
            end = dict(status="timeout", reason=f"stopped at its limit, {timeout:.0f} s")
        elif rc:
            end = dict(status="error", reason=f"exit code {rc}: " + " / ".join(tail.splitlines()[-3:]))
        elif isinstance(notes.get(name), str) and not got:  # the study says why it cannot run here
            end = dict(status="skipped", reason=notes.pop(name))
        else:
            end = dict(status="ok")
        end["summary"] = notes
    yield from ({"section": name, **r} for r in got)
    yield dict(head, **end, elapsed_s=round(time.monotonic() - s0, 1))
    print(f"{prog}: {name} {end['status']} in {time.monotonic() - s0:.0f} s", file=sys.stderr, flush=True)


def run_process(cmd: list[str], timeout_s: float, env: dict, tail_lines: int = 40,
                cwd: Path = ROOT) -> tuple[Optional[int], str]:
    """Runs ``cmd`` in its own process group, its output passed through; ``(exit code or None if it was stopped at
    ``timeout_s``, the last lines of its output)``. A stopped process is ended with its children (compile workers)."""
    tail: deque[str] = deque(maxlen=tail_lines)
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", start_new_session=True)

    def pump():
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            tail.append(line.rstrip("\n"))

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        rc: Optional[int] = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        rc = None
    except BaseException:  # Ctrl-C: end the section's processes too
        _stop(proc)
        raise
    if rc is None:
        _stop(proc)
    reader.join(timeout=5)
    return rc, "\n".join(tail)


def _stop(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


class Terminated(SystemExit):
    """SIGTERM (the device tool's timeout, ``kill``): unwinds like Ctrl-C, so the running section is stopped."""


def on_sigterm(signum, frame):  # noqa: ARG001 - signal handler signature
    raise Terminated(128 + signal.SIGTERM)
