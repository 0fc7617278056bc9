"""Sections of a study, each in its own process under a time budget (``benchmarks/gpu_check.py``): the plan (which
sections fit the budget, each stopped at its own limit), the process runner (its process group ended at the
limit, on Ctrl-C or SIGTERM), and the sectioned report rewritten whole after every row (a run cut off keeps every
finished row)."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
from collections import deque
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional

from benchmarks.harness.paths import ROOT, portable
from benchmarks.harness.runner import write_atomic

__all__ = ["Report", "Section", "Terminated", "decide", "fmt", "on_sigterm", "plan", "print_plan", "run_process"]


class Section(NamedTuple):
    name: str
    what: str
    estimate_s: float  # expected seconds, process start included
    limit_s: float  # the section's own budget: its process is stopped there


def decide(section: Section, remaining_s: float, estimate_s: Optional[float] = None,
           limit_s: Optional[float] = None) -> tuple[bool, float, Optional[str]]:
    """``(run, timeout_s, skip reason)``: a section runs when its estimate fits what is left of the global budget,
    and is stopped at its own limit or the end of the budget, whichever comes first."""
    est = section.estimate_s if estimate_s is None else estimate_s
    lim = section.limit_s if limit_s is None else limit_s
    if remaining_s < est:
        return False, 0.0, f"{remaining_s:.0f} s of the budget left, the section's estimate is {est:.0f} s"
    return True, min(lim, remaining_s), None


def plan(sections: dict, names: list[str], budget_s: float, startup_s: float, estimates: Optional[dict] = None,
         limit_s: Optional[float] = None) -> list[dict]:
    """Each of ``names`` (of ``sections``) with its estimate (``estimates`` override), its limit (``limit_s``
    overrides) and whether it would run if every section before it took its estimate (``startup_s`` first)."""
    left = budget_s - startup_s
    out = []
    for name in names:
        s = sections[name]
        est = estimates[name] if estimates else s.estimate_s
        lim = limit_s if limit_s is not None else s.limit_s
        run, timeout, reason = decide(s, left, est, lim)
        out.append(dict(section=name, what=s.what, estimate_s=est, limit_s=lim, runs=run,
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



def _finite(o: Any) -> Any:
    """JSON-safe: non-finite floats -> None, tuples -> lists, anything else unknown -> str."""
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {str(k): _finite(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_finite(v) for v in o]
    if o is None or isinstance(o, (str, int, bool)):
        return o
    if hasattr(o, "item"):  # a 0-d tensor / numpy scalar
        return _finite(o.item())
    return str(o)


def fmt(v: Any) -> str:
    """One markdown cell."""
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        a = abs(v)
        if a == 0:
            return "0"
        if a < 1e-2:
            return f"{v:.1e}"
        if a < 10:
            return f"{v:.3f}"
        if a < 1000:
            return f"{v:.1f}"
        return f"{v:,.0f}"
    return str(v).replace("|", "\\|").replace("\n", " ")


class Report:
    """A sectioned report, ``<stem>.json`` and its ``.md``, rewritten whole (atomically) after every change: ``meta``
    (device, versions, command, budget) and ``sections`` (name -> status, reason, timings, ``summary`` and ``rows``);
    :attr:`columns` / :attr:`shown`: each section's table columns and the rows it shows (the JSON keeps all).

    Section status: ``pending`` (planned, not reached), ``running`` (started; left so when the run was killed),
    ``ok``, ``failed`` (tests that failed), ``error``, ``timeout`` (stopped at its limit), ``stopped`` (Ctrl-C or
    SIGTERM), ``skipped``."""

    columns: dict[str, list[str]] = {}
    shown: dict[str, Callable[[dict], bool]] = {}
    title = "GPU check"

    def __init__(self, path: Path, data: Optional[dict] = None) -> None:
        self.path = Path(path)
        self.data = data if data is not None else dict(meta={}, sections={})

    @classmethod
    def load(cls, path: Path) -> "Report":
        return cls(path, json.loads(Path(path).read_text()))

    @property
    def md_path(self) -> Path:
        return self.path.with_suffix(".md")

    def section(self, name: str) -> dict:
        return self.data["sections"].setdefault(name, dict(status="pending", rows=[]))

    def update(self, name: str, **fields) -> None:
        self.section(name).update(_finite(fields))
        self.flush()

    def add_row(self, name: str, row: dict) -> None:
        self.section(name).setdefault("rows", []).append(_finite(row))
        self.flush()

    def set_rows(self, name: str, rows: list[dict]) -> None:
        self.section(name)["rows"] = _finite(rows)
        self.flush()

    def flush(self) -> None:
        """Both files replaced at once (a reader never sees half a file)."""
        write_atomic(self.path, lambda tmp: tmp.write_text(json.dumps(self.data, indent=1) + "\n"))
        write_atomic(self.md_path, lambda tmp: tmp.write_text(portable(self.markdown()) + "\n"))

    def markdown(self) -> str:
        m = self.data.get("meta", {})
        out = [f"# {self.title} — {m.get('device', '?')}", ""]
        facts = [f"{k} {m[k]}" for k in ("torch", "cuda", "triton", "transformers", "revision") if m.get(k)]
        if m.get("capability"):
            facts.append(f"compute capability {'.'.join(map(str, m['capability']))}")
        if m.get("decode_kernel_default"):
            facts.append(f"decode_kernel default {m['decode_kernel_default']!r}")
        out += [", ".join(facts) + f". Budget {fmt(m.get('budget_s'))} s; started {m.get('started', '?')}"
                + (f", took {m['elapsed_s']:.0f} s" if m.get("elapsed_s") is not None else "") + ". "
                f"Command: `{m.get('command', '?')}`", ""]
        if m.get("smoke"):
            out += ["**Smoke run**: tiny sizes; the numbers say nothing about speed.", ""]
        for name, s in self.data.get("sections", {}).items():
            head = f"## {name}: {s.get('status', '?')}"
            if s.get("elapsed_s") is not None:
                head += f" ({s['elapsed_s']:.0f} s"
                head += f" of ~{s['estimate_s']:.0f} s estimated)" if s.get("estimate_s") else ")"
            out += [head, ""]
            if s.get("what"):
                out += [s["what"], ""]
            if s.get("reason"):
                out += [f"**{s.get('status')}**: {fmt(s['reason'])}", ""]
            if s.get("summary"):
                out += ["; ".join(f"{k}: {fmt(v)}" for k, v in s["summary"].items()), ""]
            rows = [r for r in s.get("rows", []) if self.shown.get(name, lambda r: True)(r)]
            if rows:
                cols = [c for c in self.columns.get(name, []) if any(c in r for r in rows)]
                cols += [c for r in rows for c in r if c not in cols and name not in self.columns]
                cols = list(dict.fromkeys(cols))
                out += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
                out += ["| " + " | ".join(fmt(r.get(c)) for c in cols) + " |" for r in rows]
                out.append("")
        return "\n".join(out)


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
