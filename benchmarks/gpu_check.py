"""Every open GPU question in one command of at most 8 minutes on one H100 / H200: the CUDA tests, the split-KV kernel
against SDPA, the CUDA-graph decode step, serving capacity at a 24 GB budget, the compiled training step and
FlashAttention-4.

    python -m benchmarks.gpu_check --out-dir "$OUT"      # all sections: gpu_check_<device>.json and .md there
    python -m benchmarks.gpu_check --dry-run             # the plan and its time estimate (no CUDA touched)
    python -m benchmarks.gpu_check --sections kernel decode --budget-s 200
    python -m benchmarks.gpu_check --smoke --out-dir /tmp/g  # tiny sizes on CPU (or GPU): proves the script runs

Sections, in this order (``--sections`` picks some; the order stays):

* ``tests`` — ``pytest -m gpu`` on the kernel, graph and memory test files (compiled Triton, CUDA graphs, the CUDA
  allocator), in a subprocess with a timeout: passed / failed / skipped counts, every test's outcome, the failures'
  names and messages, and the test that was running if it timed out.
* ``kernel`` — the split-KV kernel (:mod:`models.kernels`) against SDPA (the eager path), batch 64 over 16k keys:
  latents of 26 / 77 / 128 / 256 under 12 heads, int8 latents, MHA and GQA-4 rows; ms, % of the copy bandwidth
  measured in the same run, max |kernel - eager|, and the kernel at forced split counts
  (``benchmarks/serving.py``'s ``kernel`` section, one case at a time).
* ``decode`` — one decode step replayed from a CUDA graph at batch 8 / 16k context, 124M shapes, bf16, random
  weights: MHA, MLA, KVSplice-90 (and KVSplice-90 int8), each with SDPA and with the kernel; ms, tokens/s, % of the
  bandwidth floor (``serving.build`` / ``serving.decode_step_ms``).
* ``capacity`` — sequences that fit a 24 GB KV budget and the CUDA-graph step at that batch, SDPA and kernel, for
  MHA / MLA / KVSplice-90 at 1k and 16k, bf16 and int8 rows (``serving.py``'s ``capacity`` section, fewer variants);
  per row both floors — bytes (cache + weights over the measured copy bandwidth) and compute (the step's FLOPs over
  the bf16 matmul peak measured in the same process) — and each path's time as a % of the larger one.
* ``profile`` — one eager decode step at the capacity batch (≤ 16,384) at 1k, MHA and KVSplice-90, under
  ``torch.profiler``: the kernels by self device time, each one's share of the step.
* ``train`` — one optimizer step of the 124M MHA and KVSplice-90, eager and ``torch.compile``-d (``gpu.py``'s
  ``train`` section, two models, few steps).
* ``flash4`` — FlashAttention-4 (``flash_attn.cute``) against SDPA on a training-shaped call if it is importable,
  else the reason.

Each section but ``tests`` runs in its own process (``--child``): a hang is cut off at the section's limit, and a
CUDA error (an illegal address in a kernel) cannot spoil the sections after it. Every row is written to the JSON
and the markdown the moment it is measured (atomic replace), so a run cut off still leaves every finished row; a
section whose estimate no longer fits the remaining ``--budget-s`` is skipped with the reason recorded. Nothing here
imports jsonargparse, wandb or datasets. ``--merge`` keeps the sections of an earlier run on the same device that
this run does not redo (a second call finishes a cut-off first one).
"""

from __future__ import annotations


import argparse
import importlib
import json
import math
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import deque
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional

from benchmarks.harness.header import command as command_line, revision
from benchmarks.harness.options import UsageError, command, parser
from benchmarks.harness.paths import RESULTS, ROOT
from benchmarks.harness.results import write_markdown

PROG = "gpu_check.py"
"""The name on the plan and progress lines (errors: the harness's ``gpu_check: error: ...``)."""
DEFAULT_BUDGET_S = 480.0
STARTUP_S = 10.0
"""The parent's own start (python, torch import, device query) before the first section."""
TEST_FILES = ["tests/models/test_decode_kernel.py", "tests/models/test_decode_kernel_paths.py", "tests/models/test_graph_decode.py",
              "tests/kvsplice/cli/test_memory_tools.py"]
SMOKE_TEST_FILES = ["tests/models/test_graph_decode.py"]
FLASH4_REASON = ("its wheels with the CUTLASS-DSL runtime (flash-attn-4 + nvidia-cutlass-dsl) are > 90 MB, more than "
                 "the 64 MiB one device call can carry")


def cuda_test_split(root: Path = ROOT) -> tuple[list[str], list[str]]:
    """The test suite split for one device call: the files with CUDA tests (``pytest.mark.gpu``: the ``tests``
    section runs them) and every other test file (the CPU suite, which CI runs; left unrun on the device)."""
    files = sorted(p.relative_to(root).as_posix() for p in (root / "tests").rglob("test_*.py"))
    cuda = [f for f in files if "mark.gpu" in (root / f).read_text(encoding="utf-8", errors="replace")]
    return cuda, [f for f in files if f not in cuda]


class Section(NamedTuple):
    name: str
    what: str
    estimate_s: float  # expected seconds on one H100 / H200, process start included
    limit_s: float  # the section's own budget: its process is stopped there


SECTIONS = {s.name: s for s in [
    Section("tests", "pytest -m gpu -x: " + " ".join(Path(f).name for f in TEST_FILES) + " (per-test timeout 120 s)",
            120, 200),
    Section("kernel", "split-KV vs SDPA, batch 64 x 16,384 keys, bf16: latents 26/77/128/256 (12 heads), int8 "
            "latents 26/128, MHA 12x64, GQA-4 4x64; splits auto + 1/4/16/64; 20 calls each", 45, 90),
    Section("decode", "CUDA-graph step, batch 8 x 16,384, 124M bf16: MHA, MLA, KVSplice-90, KVSplice-90 int8; "
            "SDPA and kernel; 20 steps each", 50, 100),
    Section("capacity", "24 GB budget: MHA, MLA, KVSplice-90 x ctx 1,024/16,384 x bf16/int8 rows, CUDA-graph step "
            "at the batch that fits (<= 16,384), SDPA and kernel; 10 steps each", 90, 150),
    Section("profile", "torch.profiler split of one eager decode step by kernel, batch <= 16,384 x 1,024, 124M bf16: "
            "MHA and KVSplice-90", 30, 60),
    Section("train", "124M step, batch 16 x 1024, bf16 autocast, fused AdamW: MHA and KVSplice-90, eager and "
            "torch.compile; 2 rounds x 3 steps", 110, 170),
    Section("flash4", "FlashAttention-4 vs SDPA (if importable): causal prefill, batch 16 x 1024, 12 query heads of "
            "64, MHA and GQA-4, bf16", 15, 45),
]}
SMOKE_ESTIMATE_S = {"tests": 40, "kernel": 40, "decode": 30, "capacity": 30, "profile": 20, "train": 10, "flash4": 10}
SMOKE_LIMIT_S = 180.0

# Sizes of each section (``smoke``: tiny, on CPU too).
FULL = dict(kernel_splits=[1, 4, 16, 64], kernel_steps=20,
            decode_batch=8, decode_ctx=16384, decode_steps=20,
            decode_variants=[("MHA", None), ("MLA", None), ("KVSplice-90", None), ("KVSplice-90", "int8")],
            capacity_variants=["MHA", "MLA", "KVSplice-90"], capacity_ctx=[1024, 16384], capacity_budget_gb=24.0,
            capacity_max_batch=16384, capacity_steps=10, matmul_n=8192,
            profile_variants=["MHA", "KVSplice-90"], profile_ctx=1024, profile_batch=16384, profile_top=12,
            train_models=["ours mha", "ours mla_kvsplice_90"], train_batch=16, train_t=1024, train_rounds=2,
            train_steps=3, flash_shape=(16, 12, 1024, 64), flash_calls=20)
SMOKE = dict(FULL, kernel_splits=[2], kernel_steps=2, decode_batch=2, decode_ctx=32, decode_steps=2,
             decode_variants=[("MHA", None), ("KVSplice-90", None)], capacity_variants=["MHA", "KVSplice-90"],
             capacity_ctx=[32], capacity_budget_gb=0.0002, capacity_max_batch=4, capacity_steps=1, matmul_n=256,
             profile_ctx=32, profile_batch=2, profile_top=5,
             train_batch=2, train_t=128, train_rounds=1, train_steps=2, flash_shape=(2, 4, 128, 64), flash_calls=2)

# Columns of each section's markdown table (the JSON keeps every field); rows shown: all, or those ``MD_ROWS`` keeps.
MD_COLUMNS = {
    "tests": ["test", "outcome", "seconds", "message"],
    "kernel": ["case", "bytes_read", "sdpa_ms", "sdpa_pct_bandwidth", "split_kv_ms", "split_kv_pct_bandwidth",
               "speedup", "max_abs_diff", "split_kv_s1_ms", "split_kv_s2_ms", "split_kv_s4_ms", "split_kv_s16_ms",
               "split_kv_s64_ms", "error"],
    "decode": ["variant", "rows", "path", "batch", "ctx", "graph", "ms", "tokens_per_s", "floor_ms", "pct_floor",
               "vs_mha_sdpa", "error"],
    "capacity": ["variant", "rows", "ctx", "bytes_per_seq", "max_batch", "batch_vs_mha", "batch", "sdpa_ms",
                 "sdpa_tokens_per_s", "split_kv_ms", "split_kv_tokens_per_s", "split_kv_vs_mha_sdpa", "floor_ms",
                 "compute_floor_ms", "bound", "sdpa_pct_larger_floor", "split_kv_pct_larger_floor", "sdpa_error",
                 "split_kv_error"],
    "profile": ["variant", "batch", "ctx", "kernel", "calls", "ms", "pct_step"],
    "train": ["model", "mode", "optimizer", "median_ms", "tokens_per_s", "mfu", "vs_ours_mha_same_mode",
              "first_steps_s", "n", "error"],
    "flash4": ["call", "impl", "sdpa_ms", "flash_ms", "speedup", "max_abs_diff", "error"],
}
MD_ROWS: dict[str, Callable[[dict], bool]] = {"tests": lambda r: r.get("outcome") != "passed"}


# ----------------------------------------------------------------------------------------------- the plan
def device_tag(name: str) -> str:
    """A file-name-safe tag for a device name: ``NVIDIA H100 80GB HBM3`` -> ``h100``, ``NVIDIA H200`` -> ``h200``;
    other names lower-cased with every run of other characters as one ``_``."""
    m = re.search(r"\b([A-Z]\d{2,4}[A-Z]?)\b", name.upper().replace("NVIDIA", " "))
    if m:
        return m.group(1).lower()
    tag = re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")
    return tag[:40] or "device"


def decide(section: Section, remaining_s: float, estimate_s: Optional[float] = None,
           limit_s: Optional[float] = None) -> tuple[bool, float, Optional[str]]:
    """``(run, timeout_s, skip reason)``: a section runs when its estimate fits what is left of the global budget,
    and is stopped at its own limit or the end of the budget, whichever comes first."""
    est = section.estimate_s if estimate_s is None else estimate_s
    lim = section.limit_s if limit_s is None else limit_s
    if remaining_s < est:
        return False, 0.0, f"{remaining_s:.0f} s of the budget left, the section's estimate is {est:.0f} s"
    return True, min(lim, remaining_s), None


def plan(names: list[str], budget_s: float, smoke: bool = False) -> list[dict]:
    """Each section with its estimate, its limit and whether it would run if every section before it took its
    estimate (the parent's start counted first)."""
    left = budget_s - STARTUP_S
    out = []
    for name in names:
        s = SECTIONS[name]
        est = SMOKE_ESTIMATE_S[name] if smoke else s.estimate_s
        lim = SMOKE_LIMIT_S if smoke else s.limit_s
        run, timeout, reason = decide(s, left, est, lim)
        out.append(dict(section=name, what=s.what, estimate_s=est, limit_s=lim, runs=run,
                        timeout_s=round(timeout), skip_reason=reason))
        if run:
            left -= est
    return out


def print_plan(rows: list[dict], budget_s: float, smoke: bool, file=None) -> None:
    total = STARTUP_S + sum(r["estimate_s"] for r in rows if r["runs"])
    lines = [f"{PROG} plan{' (smoke sizes)' if smoke else ''}: budget {budget_s:.0f} s, estimate {total:.0f} s "
             f"({total / 60:.1f} min) including {STARTUP_S:.0f} s start"]
    for i, r in enumerate(rows, 1):
        state = f"~{r['estimate_s']:.0f} s, stopped at {r['timeout_s']} s" if r["runs"] else \
            f"SKIPPED ({r['skip_reason']})"
        lines.append(f"  {i}. {r['section']:<8} {state}: {r['what']}")
    lines.append(f"total estimate: {total:.0f} s <= budget {budget_s:.0f} s: {'yes' if total <= budget_s else 'NO'}")
    print("\n".join(lines), file=file or sys.stdout, flush=True)


# ----------------------------------------------------------------------------------------- the report
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
    """``results/gpu_check_<device>.json`` and its ``.md``, rewritten whole (atomically) after every change: ``meta``
    (device, versions, command, budget) and ``sections`` (name -> status, reason, timings, ``summary`` and ``rows``).

    Section status: ``pending`` (planned, not reached), ``running`` (started; left so when the run was killed),
    ``ok``, ``failed`` (tests that failed), ``error``, ``timeout`` (stopped at its limit), ``stopped`` (Ctrl-C or
    SIGTERM), ``skipped``."""

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
        from models.checkpoint import atomic_write  # (torch: only where a report is written)

        atomic_write(self.path, lambda tmp: tmp.write_text(json.dumps(self.data, indent=1) + "\n"))
        write_markdown(self.md_path, self.markdown())

    def markdown(self) -> str:
        m = self.data.get("meta", {})
        out = [f"# GPU check — {m.get('device', '?')}", ""]
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
            rows = [r for r in s.get("rows", []) if MD_ROWS.get(name, lambda r: True)(r)]
            if rows:
                cols = [c for c in MD_COLUMNS.get(name, []) if any(c in r for r in rows)]
                cols += [c for r in rows for c in r if c not in cols and name not in MD_COLUMNS]
                cols = list(dict.fromkeys(cols))
                out += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
                out += ["| " + " | ".join(fmt(r.get(c)) for c in cols) + " |" for r in rows]
                out.append("")
        return "\n".join(out)


# -------------------------------------------------------------------------------------- subprocesses
def run_process(cmd: list[str], timeout_s: float, env: dict, tail_lines: int = 40) -> tuple[Optional[int], str]:
    """Runs ``cmd`` in its own process group, its output passed through; ``(exit code or None if it was stopped at
    ``timeout_s``, the last lines of its output)``. A stopped process is ended with its children (compile workers)."""
    tail: deque[str] = deque(maxlen=tail_lines)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
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


def child_env(smoke: bool, cuda: bool) -> dict:
    """The environment of a section's process: the checkout first on the path (no install needed; pytest finds
    ``-p benchmarks.gpu_check`` there), Triton's interpreter for a CPU smoke run."""
    env = dict(os.environ)
    path = [str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env["PYTHONPATH"] = os.pathsep.join(path)
    env.setdefault("PYTHONUNBUFFERED", "1")
    if smoke and not cuda:
        env.setdefault("TRITON_INTERPRET", "1")  # the kernel on CPU tensors: Triton's interpreter
    return env


# ------------------------------------------------------------------------------------- pytest plugin
# ``pytest -p benchmarks.gpu_check``: every test's outcome appended to $GPU_CHECK_TESTLOG as it ends (so a run
# stopped at its timeout still has its counts), and each test's start (the one that hung is named).
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


def run_tests(report: Report, timeout_s: float, smoke: bool, cuda: bool) -> None:
    files = SMOKE_TEST_FILES if smoke else TEST_FILES
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "tests.jsonl"
        env = child_env(smoke, cuda)
        env["GPU_CHECK_TESTLOG"] = str(log)
        cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-x", "-q", "-p", "no:cacheprovider", "-p",
               "benchmarks.gpu_check", "--timeout", "120", *files]
        try:
            import pytest_timeout  # noqa: F401
        except ImportError:
            cmd.remove("--timeout"), cmd.remove("120")
        report.update("tests", command=" ".join(cmd[1:]))
        try:
            rc, tail = run_process(cmd, timeout_s, env)
        except BaseException:  # stopped from outside: keep the outcomes so far
            report.set_rows("tests", read_testlog(log)[0])
            raise
        rows, counts, hung = read_testlog(log)
    left = cuda_test_split()[1]
    summary = dict(counts, seconds=round(sum(r["seconds"] or 0 for r in rows), 1), exit_code=rc,
                   left_unrun=f"{len(left)} CPU-suite files (no CUDA test in them; CI runs them)")
    bad = [r["test"] for r in rows if r["outcome"] in ("failed", "error")]
    if rc is None:
        status, reason = "timeout", f"stopped at {timeout_s:.0f} s" + (f" while running {hung}" if hung else "")
    elif bad:
        status, reason = "failed", "failed: " + ", ".join(bad)
    elif rc == 5 or (rc == 0 and not rows):
        status, reason = "ok", "no test selected (-m gpu needs CUDA)"
    elif rc == 0:
        status, reason = "ok", None
    else:
        status, reason = "error", f"pytest exit code {rc}: " + " / ".join(tail.splitlines()[-3:])
    report.data["sections"]["tests"]["rows"] = _finite(rows)
    report.update("tests", status=status, reason=reason, summary=summary)


# ------------------------------------------------------------------------------------ the child sections
def _free(device) -> None:
    import gc

    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"


def section_kernel(rep: Report, sz: dict, ctx: dict) -> None:
    from types import SimpleNamespace

    serving = importlib.import_module("benchmarks.serving")
    device, dtype = ctx["device"], ctx["dtype"]
    args = SimpleNamespace(smoke=ctx["smoke"], kernel_splits=sz["kernel_splits"], steps=sz["kernel_steps"])
    reason = serving.kernel_runs_here(device)
    rep.update("kernel", summary=dict(bandwidth_gbs=ctx["bandwidth"] / 1e9, kernel="runs" if reason is None else
                                      f"not run ({reason})"))
    for case in serving.kernel_cases(ctx["smoke"]):
        try:
            row = serving.bench_kernel(args, device, dtype, ctx["bandwidth"], lambda xs, desc: xs, cases=[case])[0]
            if row.get("split_kv_ms"):
                row["speedup"] = row["sdpa_ms"] / row["split_kv_ms"]
        except Exception as e:  # noqa: BLE001 - one case's failure must not end the section
            row = dict(case=case[0], error=_err(e))
        rep.add_row("kernel", row)
        _free(device)


def section_decode(rep: Report, sz: dict, ctx: dict) -> None:
    import torch

    serving = importlib.import_module("benchmarks.serving")
    device, dtype, smoke = ctx["device"], ctx["dtype"], ctx["smoke"]
    batch, n_ctx = sz["decode_batch"], sz["decode_ctx"]
    graph = device.type == "cuda"
    reason = serving.kernel_runs_here(device)
    kernels = ["eager"] + (["triton"] if reason is None else [])
    rep.update("decode", summary=dict(bandwidth_gbs=ctx["bandwidth"] / 1e9, graph=graph,
                                      kernel="runs" if reason is None else f"not run ({reason})"))
    for kernel in kernels:  # every SDPA row first: a kernel fault (a sticky CUDA error) cannot cost the baselines
        for name, quant in sz["decode_variants"]:
            row = dict(variant=name, rows=quant or str(dtype).split(".")[-1],
                       path="sdpa" if kernel == "eager" else "split_kv", batch=batch, ctx=n_ctx, graph=graph)
            try:
                model = serving.build(name, kernel, n_ctx, smoke, device, dtype)
                weights = sum(p.numel() * p.element_size() for p in model.parameters())
                step_bytes = batch * serving.seq_bytes(model, n_ctx, quant) + weights
                row.update(bytes_per_step=step_bytes, floor_ms=step_bytes / ctx["bandwidth"] * 1e3)
                ms = serving.decode_step_ms(model, batch, n_ctx, quant, sz["decode_steps"], graph,
                                            warmup=1 if smoke else 2)
                row.update(ms=ms, tokens_per_s=batch / (ms / 1e3), pct_floor=100 * row["floor_ms"] / ms)
            except torch.cuda.OutOfMemoryError:
                row["error"] = "out of memory"
            except Exception as e:  # noqa: BLE001
                row["error"] = _err(e)
            model = None
            _free(device)
            rows = rep.section("decode")["rows"] + [row]
            base = next((r.get("ms") for r in rows if r["variant"] == "MHA" and r["path"] == "sdpa"
                         and r["rows"] == row["rows"] and r.get("ms")), None)
            for r in rows:
                if r.get("ms") and base:
                    r["vs_mha_sdpa"] = r["ms"] / base
            rep.set_rows("decode", rows)


def section_capacity(rep: Report, sz: dict, ctx: dict) -> None:
    from types import SimpleNamespace

    serving = importlib.import_module("benchmarks.serving")
    device, dtype = ctx["device"], ctx["dtype"]
    rep.update("capacity", summary=dict(bandwidth_gbs=ctx["bandwidth"] / 1e9, matmul_tflops=ctx["matmul_peak"] / 1e12,
                                        budget_gb=sz["capacity_budget_gb"],
                                        max_batch_run=sz["capacity_max_batch"], claim=serving.CLAIM))
    for name in sz["capacity_variants"]:
        args = SimpleNamespace(variants=[name], ctx=sz["capacity_ctx"], budget_gb=sz["capacity_budget_gb"],
                               max_batch=sz["capacity_max_batch"], steps=sz["capacity_steps"], smoke=ctx["smoke"])
        try:
            new = serving.bench_capacity(args, device, dtype, ctx["bandwidth"], lambda xs, desc: xs)
        except Exception as e:  # noqa: BLE001
            new = [dict(variant=name, rows="-", ctx=0, bytes_per_seq=0, max_batch=0, sdpa_error=_err(e))]
        _free(device)
        for row in new:
            add_floors(row, step_flops(name, row.get("batch", 0), row.get("ctx", 0), ctx["smoke"]),
                       ctx["matmul_peak"])
        rep.set_rows("capacity", serving.compare_to_mha(rep.section("capacity")["rows"] + new))


def model_shapes(name: str, smoke: bool):
    """The config ``serving.build`` gives variant ``name`` (no weights built)."""
    serving = importlib.import_module("benchmarks.serving")
    return serving.preset(serving.VARIANTS[name], **(serving.SMOKE_SHAPES if smoke else {}))


def step_flops(name: str, batch: int, n_ctx: int, smoke: bool) -> float:
    """FLOPs of one decode step of ``batch`` tokens at ``n_ctx`` cached tokens: 2 per weight of every matmul
    (attention projections, MLP, lm_head; the embedding lookup is free) per token, plus attention — MHA: q·k and
    p·v over ``head_size`` per head; MLA (absorbed): q·row over ``latent + rope`` and p·latent per head."""
    import torch

    from models import GPT

    cfg = model_shapes(name, smoke)
    with torch.device("meta"):
        model = GPT(cfg.replace(block_size=max(n_ctx + 2, 2)))
    weights = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "wte" not in n
                  and "wpe" not in n)
    if cfg.tie_embeddings:
        weights += cfg.vocab_size * cfg.d_model  # the tied lm_head is a matmul too
    if cfg.attention == "mha":
        attn = 2 * cfg.n_head * n_ctx * (cfg.head_size + cfg.head_size)
    else:
        attn = 2 * cfg.n_head * n_ctx * (2 * cfg.d_cached_latent + cfg.qk_rope_head_dim)
    return float(batch) * (2 * weights + cfg.n_layer * attn)


def add_floors(row: dict, flops: float, peak: float) -> dict:
    """Both floors of a capacity row: bytes (``floor_ms``, already there) and compute (``flops`` over ``peak``
    FLOP/s); ``bound`` names the larger; each path's ``*_pct_larger_floor`` is that floor over its time."""
    row["flops_per_step"] = flops
    row["compute_floor_ms"] = flops / peak * 1e3 if peak else None
    floors = [f for f in (row.get("floor_ms"), row["compute_floor_ms"]) if f]
    if not floors:
        return row
    larger = max(floors)
    row["bound"] = "compute" if row["compute_floor_ms"] and row["compute_floor_ms"] >= (row.get("floor_ms") or 0) \
        else "bytes"
    row["larger_floor_ms"] = larger
    for label in ("sdpa", "split_kv"):
        if row.get(f"{label}_ms"):
            row[f"{label}_pct_larger_floor"] = 100 * larger / row[f"{label}_ms"]
    return row


def matmul_peak(device, dtype, n: int) -> float:
    """FLOP/s of an ``n``×``n``×``n`` matmul in ``dtype`` (median of 10)."""
    import statistics

    import torch

    serving = importlib.import_module("benchmarks.serving")
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    ms = statistics.median(serving.timer(device)(lambda: a @ b, 10))
    return 2 * n ** 3 / (ms / 1e3)


def profile_rows(events, variant: str, batch: int, n_ctx: int, top: int, cuda: bool) -> list[dict]:
    """The ``top`` kernels of a profiled step by self device time (self CPU time on CPU), with their share."""
    key = "self_device_time_total" if cuda else "self_cpu_time_total"

    def t(e) -> float:
        return float(getattr(e, key, 0) or getattr(e, "self_cuda_time_total", 0) or 0) if cuda else \
            float(e.self_cpu_time_total)

    evs = [e for e in events if t(e) > 0]
    total = sum(t(e) for e in evs) or 1.0
    rows = [dict(variant=variant, batch=batch, ctx=n_ctx, kernel=e.key[:80], calls=e.count, ms=t(e) / 1e3,
                 pct_step=100 * t(e) / total) for e in sorted(evs, key=t, reverse=True)[:top]]
    rows.append(dict(variant=variant, batch=batch, ctx=n_ctx, kernel="(step total)", calls=None, ms=total / 1e3,
                     pct_step=100.0))
    return rows


def section_profile(rep: Report, sz: dict, ctx: dict) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    serving = importlib.import_module("benchmarks.serving")
    device, dtype, smoke = ctx["device"], ctx["dtype"], ctx["smoke"]
    n_ctx, cuda = sz["profile_ctx"], device.type == "cuda"
    for name in sz["profile_variants"]:
        try:
            model = serving.build(name, "eager", n_ctx, smoke, device, dtype)
            per_seq = serving.seq_bytes(model, n_ctx, None)
            budget = sz["capacity_budget_gb"] * 1e9
            if cuda:
                budget = min(budget, torch.cuda.mem_get_info()[0] - serving.RESERVE_BYTES)
            batch = max(1, min(int(budget // per_seq), sz["profile_batch"]))
            cache = serving.filled_cache(model, batch, n_ctx, None)
            tok = torch.randint(0, model.cfg.vocab_size, (batch, 1), device=device)
            with torch.inference_mode():
                model(tok, cache=cache)  # warm-up
                cache.truncate(n_ctx)
                acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
                with profile(activities=acts) as prof:
                    model(tok, cache=cache)
                    if cuda:
                        torch.cuda.synchronize()
            for row in profile_rows(prof.key_averages(), name, batch, n_ctx, sz["profile_top"], cuda):
                rep.add_row("profile", row)
        except Exception as e:  # noqa: BLE001 - one variant's failure must not end the section
            rep.add_row("profile", dict(variant=name, kernel="-", error=_err(e)))
        model = cache = None
        _free(device)


def section_train(rep: Report, sz: dict, ctx: dict) -> None:
    import torch

    if ctx["device"].type != "cuda":
        rep.update("train", status="skipped", reason="the training step is timed on CUDA only")
        return
    gpu = importlib.import_module("benchmarks.gpu")
    torch.backends.cuda.matmul.allow_tf32 = True
    for label in sz["train_models"]:
        try:
            new = gpu.bench_train(sz["train_batch"], sz["train_t"], sz["train_rounds"], sz["train_steps"], True,
                                  ctx["smoke"], only=[label])
        except Exception as e:  # noqa: BLE001
            new = [dict(model=label, mode="-", optimizer="-", error=_err(e))]
        _free(ctx["device"])
        rows = rep.section("train")["rows"] + new
        mha = {r["mode"]: r["median_ms"] for r in rows
               if r["model"] == "ours mha" and r["optimizer"].startswith("fused") and r.get("median_ms")}
        for r in rows:
            r["vs_ours_mha_same_mode"] = r["median_ms"] / mha[r["mode"]] if r.get("median_ms") and r["mode"] in mha \
                else None
            r.pop("vs_reference_same_mode", None)
        rep.set_rows("train", rows)


def flash4_reason() -> Optional[str]:
    """Why FlashAttention-4 cannot run here, or None."""
    import torch

    try:
        from flash_attn.cute import flash_attn_func  # noqa: F401  # type: ignore[import-not-found]
    except Exception as e:  # noqa: BLE001 - ImportError, or a broken install
        return f"FlashAttention-4 is not importable ({_err(e)}): {FLASH4_REASON}"
    if not torch.cuda.is_available():
        return "FlashAttention-4 needs CUDA"
    if torch.cuda.get_device_capability() < (9, 0):
        return f"FlashAttention-4 needs compute capability >= 9.0, this is {torch.cuda.get_device_capability()}"
    return None


def section_flash4(rep: Report, sz: dict, ctx: dict) -> None:
    import statistics

    import torch

    reason = flash4_reason()
    if reason is not None:
        rep.update("flash4", status="skipped", reason=reason)
        return
    from flash_attn.cute import flash_attn_func  # type: ignore[import-not-found]

    from benchmarks.harness.timing import cuda_time
    from models.attention import FlashImpl, attend

    impl = FlashImpl("flash-attn-4", flash_attn_func, (9, 0), returns_lse=True)
    b, h, t, d = sz["flash_shape"]
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    for call, (qq, kk, vv) in {f"MHA prefill {b}x{h}x{t}x{d}": (q, k, v),
                               f"GQA-4 prefill {b}x{h}x{t}x{d}": (q, k[:, :h // 4], v[:, :h // 4])}.items():
        row = dict(call=call, impl=impl.name)
        try:
            sd = lambda: attend(qq, kk, vv, scale=d ** -0.5, backend="sdpa")  # noqa: E731
            fl = lambda: attend(qq, kk, vv, scale=d ** -0.5, backend="flash", flash=impl)  # noqa: E731
            row["max_abs_diff"] = (fl().float() - sd().float()).abs().max().item()
            row["sdpa_ms"] = statistics.median(cuda_time(sd, sz["flash_calls"]))
            row["flash_ms"] = statistics.median(cuda_time(fl, sz["flash_calls"]))
            row["speedup"] = row["sdpa_ms"] / row["flash_ms"]
        except Exception as e:  # noqa: BLE001
            row["error"] = _err(e)
        rep.add_row("flash4", row)


CHILD_SECTIONS = {"kernel": section_kernel, "decode": section_decode, "capacity": section_capacity,
                  "profile": section_profile, "train": section_train, "flash4": section_flash4}


def child_main(name: str, report_path: Path, smoke: bool) -> int:
    """One section in this process, its rows added to the report at ``report_path`` as they come."""
    rep = Report.load(report_path)
    try:
        import torch

        serving = importlib.import_module("benchmarks.serving")
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        ctx = dict(device=device, dtype=dtype, smoke=smoke, bandwidth=0.0, matmul_peak=0.0)
        sz = SMOKE if smoke else FULL
        if name in ("kernel", "decode", "capacity"):  # the copy bandwidth, measured in this section's process
            ctx["bandwidth"] = serving.copy_bandwidth(device, 2**21 if smoke else 2**31)
        if name == "capacity":  # and the matmul peak: the compute floor
            ctx["matmul_peak"] = matmul_peak(device, dtype, sz["matmul_n"])
        CHILD_SECTIONS[name](rep, sz, ctx)
    except BaseException as e:  # a section's failure is recorded in the report, then reported by the exit code
        rep = Report.load(report_path) if report_path.exists() else rep
        rep.update(name, status="error", reason=_err(e), traceback=traceback.format_exc().splitlines()[-8:])
        traceback.print_exc()
        return 1
    return 0


# --------------------------------------------------------------------------------------------- main
def parse(argv: Optional[list[str]]) -> argparse.Namespace:
    """The options; a bad one raises :class:`~benchmarks.harness.options.UsageError` (one line, exit 2 through
    :func:`main`)."""
    p = parser(__file__, __doc__, raw=True)
    p.add_argument("--sections", nargs="+", choices=list(SECTIONS), default=list(SECTIONS), metavar="NAME",
                   help=f"sections to run, in this order whatever the order given (default all: {' '.join(SECTIONS)})")
    p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                   help="seconds for the whole run (default 480): a section whose estimate no longer fits is skipped")
    p.add_argument("--out-dir", type=Path, default=RESULTS,
                   help="where gpu_check_<device>.json and .md go (default results/; on the device tool: \"$OUT\")")
    p.add_argument("--dry-run", action="store_true", help="print the plan and its time estimate; touch no GPU")
    p.add_argument("--smoke", action="store_true", help="tiny sizes (CPU or GPU): proves the script runs")
    p.add_argument("--merge", action="store_true",
                   help="keep the sections of an earlier report on the same device that this run does not redo")
    p.add_argument("--child", choices=list(CHILD_SECTIONS), help=argparse.SUPPRESS)
    p.add_argument("--report", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.budget_s <= 0 or not math.isfinite(args.budget_s):
        p.error(f"--budget-s must be > 0, got {args.budget_s:g}")
    if args.out_dir.exists() and not args.out_dir.is_dir():
        p.error(f"--out-dir must be a folder, {args.out_dir} is a file")
    if args.child and args.report is None:
        p.error("--child needs --report")
    args.sections = [s for s in SECTIONS if s in args.sections]  # the fixed order, no repeats
    return args


class Terminated(SystemExit):
    """SIGTERM (the device tool's timeout, ``kill``): unwinds like Ctrl-C, so the running section is stopped."""


def _terminated(signum, frame):  # noqa: ARG001 - signal handler signature
    raise Terminated(128 + signal.SIGTERM)


def run_section(report: Report, step: dict, remaining_s: float, smoke: bool, cuda: bool) -> Report:
    """One planned section: skipped (budget), or run under its time limit; its status, reason and time recorded.
    A stop from outside (Ctrl-C, SIGTERM) records the section as ``stopped`` before it goes on up."""
    sec = step["section"]
    go, timeout, reason = decide(SECTIONS[sec], remaining_s, step["estimate_s"], step["limit_s"])
    if not go:
        report.update(sec, status="skipped", reason=f"budget: {reason}")
        print(f"{PROG}: {sec} skipped: {reason}", file=sys.stderr, flush=True)
        return report
    print(f"{PROG}: {sec} (~{step['estimate_s']:.0f} s, stopped at {timeout:.0f} s)", file=sys.stderr, flush=True)
    s0 = time.monotonic()
    report.update(sec, status="running", timeout_s=round(timeout))
    try:
        if sec == "tests":
            run_tests(report, timeout, smoke, cuda)
        else:
            cmd = [sys.executable, str(Path(__file__).resolve()), "--child", sec, "--report", str(report.path)]
            rc, tail = run_process(cmd + (["--smoke"] if smoke else []), timeout, child_env(smoke, cuda))
            report = Report.load(report.path)  # the child's rows
            if rc is None:
                report.update(sec, status="timeout", reason=f"stopped at its limit, {timeout:.0f} s")
            elif report.section(sec).get("status") == "running":
                report.update(sec, status="ok" if rc == 0 else "error",
                              reason=None if rc == 0 else f"exit code {rc}: " + " / ".join(tail.splitlines()[-3:]))
    except BaseException as e:
        report = Report.load(report.path)
        report.update(sec, status="stopped", reason=f"the run was stopped ({type(e).__name__})",
                      elapsed_s=round(time.monotonic() - s0, 1))
        raise
    report.update(sec, elapsed_s=round(time.monotonic() - s0, 1))
    s = report.section(sec)
    print(f"{PROG}: {sec} {s['status']} in {s['elapsed_s']:.0f} s" + (f": {s['reason']}" if s.get("reason") else ""),
          file=sys.stderr, flush=True)
    return report


@command
def main(argv: Optional[list[str]] = None) -> int:
    t0 = time.monotonic()
    args = parse(argv)
    if args.child:
        return child_main(args.child, args.report, args.smoke)
    steps = plan(args.sections, args.budget_s, args.smoke)
    if args.dry_run:
        print_plan(steps, args.budget_s, args.smoke)
        return 0
    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        raise UsageError("no CUDA device (--dry-run prints the plan, --smoke runs tiny sizes on CPU)")
    name = torch.cuda.get_device_name() if cuda else f"CPU ({platform.machine()})"
    tag = device_tag(name) if cuda else "cpu"
    out = args.out_dir / f"gpu_check_{tag}{'_smoke' if args.smoke else ''}.json"
    try:
        import triton

        triton_v = triton.__version__
    except Exception:  # noqa: BLE001
        triton_v = None
    try:
        import transformers

        tf_v = transformers.__version__
    except Exception:  # noqa: BLE001
        tf_v = None
    try:
        from models.kernels import DEFAULT_DECODE_KERNEL as kernel_default
    except Exception as e:  # noqa: BLE001
        kernel_default = _err(e)
    meta = dict(device=name, tag=tag, revision=revision(), decode_kernel_default=kernel_default,
                capability=list(torch.cuda.get_device_capability()) if cuda else None,
                torch=torch.__version__, cuda=torch.version.cuda, triton=triton_v, transformers=tf_v,
                python=platform.python_version(), budget_s=args.budget_s, smoke=args.smoke,
                started=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), command=command_line(__file__, argv))
    report = Report(out)
    if args.merge and out.exists():
        try:
            old = Report.load(out).data
            if old.get("meta", {}).get("device") == name:
                report.data["sections"] = {k: v for k, v in old.get("sections", {}).items()
                                           if k not in args.sections}
        except (json.JSONDecodeError, OSError, AttributeError):
            pass
    report.data["meta"] = meta
    for step in steps:
        what = ("smoke sizes; full run: " if args.smoke else "") + step["what"]
        report.data["sections"][step["section"]] = dict(status="pending", what=what,
                                                        estimate_s=step["estimate_s"], rows=[])
    report.data["sections"] = {k: report.data["sections"][k] for k in SECTIONS if k in report.data["sections"]}
    report.flush()
    print_plan(steps, args.budget_s, args.smoke, file=sys.stderr)
    print(f"{PROG}: {name}; writing {out} and {out.with_suffix('.md')}", file=sys.stderr, flush=True)
    previous = signal.signal(signal.SIGTERM, _terminated)  # a stop from outside ends the section's processes too
    try:
        for step in steps:
            report = run_section(report, step, args.budget_s - (time.monotonic() - t0), args.smoke, cuda)
    finally:
        signal.signal(signal.SIGTERM, previous)
    report.data["meta"]["elapsed_s"] = round(time.monotonic() - t0, 1)
    report.flush()
    print(report.markdown())
    print(f"{PROG}: {time.monotonic() - t0:.0f} s; wrote {out} and {out.with_suffix('.md')}", file=sys.stderr)
    bad = [k for k in args.sections if report.section(k).get("status") not in ("ok", "skipped")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
