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
import signal
import subprocess  # noqa: F401 - the tests stub its Popen (harness.sections runs the processes)
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable, Optional

from benchmarks.harness.header import command as command_line, device_tag, revision, version
from benchmarks.harness.options import UsageError, command, parser
from benchmarks.harness.paths import RESULTS, ROOT
from benchmarks.harness.runner import check_outputs
from benchmarks.harness.sections import Report as SectionReport, Section, _finite, decide, on_sigterm
from benchmarks.harness.sections import plan as plan_sections, print_plan as print_sections, run_process
from benchmarks.harness.testlog import read_testlog
from benchmarks.lib.gpu_sections import (CHILD_SECTIONS, _err, add_floors, matmul_peak, profile_rows,  # noqa: F401
                                         step_flops)

PROG = "gpu_check.py"
"""The name on the plan and progress lines (errors: the harness's ``gpu_check: error: ...``)."""
DEFAULT_BUDGET_S = 480.0
STARTUP_S = 10.0
"""The parent's own start (python, torch import, device query) before the first section."""
TEST_FILES = ["tests/models/test_decode_kernel.py", "tests/models/test_decode_kernel_paths.py", "tests/models/test_graph_decode.py",
              "tests/kvsplice/cli/test_memory_tools.py"]
SMOKE_TEST_FILES = ["tests/models/test_graph_decode.py"]


def cuda_test_split(root: Path = ROOT) -> tuple[list[str], list[str]]:
    """The test suite split for one device call: the files with CUDA tests (``pytest.mark.gpu``: the ``tests``
    section runs them) and every other test file (the CPU suite, which CI runs; left unrun on the device)."""
    files = sorted(p.relative_to(root).as_posix() for p in (root / "tests").rglob("test_*.py"))
    cuda = [f for f in files if "mark.gpu" in (root / f).read_text(encoding="utf-8", errors="replace")]
    return cuda, [f for f in files if f not in cuda]


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


def plan(names: list[str], budget_s: float, smoke: bool = False) -> list[dict]:
    """Each section with its estimate, its limit and whether it would run if every section before it took its
    estimate (the parent's start counted first)."""
    return plan_sections(SECTIONS, names, budget_s, STARTUP_S, SMOKE_ESTIMATE_S if smoke else None,
                         SMOKE_LIMIT_S if smoke else None)


def print_plan(rows: list[dict], budget_s: float, smoke: bool, file=None) -> None:
    print_sections(PROG, rows, budget_s, STARTUP_S, smoke, file)


class Report(SectionReport):
    """``results/gpu_check_<device>.json`` and its ``.md`` (:class:`benchmarks.harness.sections.Report`).

    Section status: ``pending`` (planned, not reached), ``running`` (started; left so when the run was killed),
    ``ok``, ``failed`` (tests that failed), ``error``, ``timeout`` (stopped at its limit), ``stopped`` (Ctrl-C or
    SIGTERM), ``skipped``."""

    columns = MD_COLUMNS
    shown = MD_ROWS


def child_env(smoke: bool, cuda: bool) -> dict:
    """The environment of a section's process: the checkout first on the path (no install needed; pytest finds
    ``-p benchmarks.harness.testlog`` there), Triton's interpreter for a CPU smoke run."""
    env = dict(os.environ)
    path = [str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env["PYTHONPATH"] = os.pathsep.join(path)
    env.setdefault("PYTHONUNBUFFERED", "1")
    if smoke and not cuda:
        env.setdefault("TRITON_INTERPRET", "1")  # the kernel on CPU tensors: Triton's interpreter
    return env


def run_tests(report: Report, timeout_s: float, smoke: bool, cuda: bool) -> None:
    files = SMOKE_TEST_FILES if smoke else TEST_FILES
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "tests.jsonl"
        env = child_env(smoke, cuda)
        env["GPU_CHECK_TESTLOG"] = str(log)
        cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-x", "-q", "-p", "no:cacheprovider", "-p",
               "benchmarks.harness.testlog", "--timeout", "120", *files]
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


# ------------------------------------------------------------------------------------------------ sections
def child_main(name: str, report_path: Path, smoke: bool) -> int:
    """One section in this process, its rows added to the report at ``report_path`` as they come."""
    rep = Report.load(report_path)
    try:
        import torch

        serving = importlib.import_module("benchmarks.lib.serving_bench")
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
    p.add_argument("--force", action="store_true", help="replace an earlier report of this device")
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
            cmd = [sys.executable, "-m", "benchmarks.gpu_check", "--child", sec, "--report", str(report.path)]
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
    check_outputs([out, out.with_suffix(".md")], force=args.force or args.merge)
    try:
        from models.kernels import DEFAULT_DECODE_KERNEL as kernel_default
    except Exception as e:  # noqa: BLE001
        kernel_default = _err(e)
    meta = dict(device=name, tag=tag, revision=revision(), decode_kernel_default=kernel_default,
                capability=list(torch.cuda.get_device_capability()) if cuda else None,
                torch=torch.__version__, cuda=torch.version.cuda, triton=version("triton"),
                transformers=version("transformers"),
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
    previous = signal.signal(signal.SIGTERM, on_sigterm)  # a stop from outside ends the section's processes too
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
