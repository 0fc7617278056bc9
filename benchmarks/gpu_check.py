"""Every open GPU question in one command of at most 8 minutes on one H100 / H200: the CUDA tests, the split-KV kernel,
the CUDA-graph decode step, capacity at 24 GB, a profiled step, the compiled training step and FlashAttention-4.

    python -m benchmarks.gpu_check --out-dir "$OUT"      # all sections: gpu_check_<device>.json and .md there
    python -m benchmarks.gpu_check --dry-run             # the plan and its time estimate (no CUDA touched)
    python -m benchmarks.gpu_check --sections kernel decode --budget-s 200
    python -m benchmarks.gpu_check --smoke --out-dir /tmp/g  # tiny sizes on CPU (or GPU): proves the script runs

Sections (``studies/gpu_check.yaml``): ``tests`` (``pytest -m gpu``), then ``serving``'s and ``gpu``'s at their
``check`` size, each in its own process: a hang is cut off at its limit, a CUDA error cannot spoil the next, one whose
estimate no longer fits ``--budget-s`` is skipped. Rows: each section's status (the last counts) and measurements.
``--resume`` keeps the sections this run does not redo. No jsonargparse, wandb, datasets.
"""

from __future__ import annotations

import signal
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness import report, studies
from benchmarks.harness.header import device_tag, version
from benchmarks.harness.options import UsageError
from benchmarks.harness.paths import RESULTS
from benchmarks.harness.runner import Study
from benchmarks.harness.sections import by_section, on_sigterm, plan, print_plan, run_section

PROG = "gpu_check.py"
SETTINGS = studies.load("gpu_check")
SECTIONS: dict = SETTINGS["sections"]
TEST_FILES: list = SECTIONS["tests"]["files"]
STARTUP_S: float = SETTINGS["startup_s"]


def options(p) -> None:
    p.add_argument("--sections", nargs="+", choices=list(SECTIONS), metavar="NAME",
                   help=f"sections to run, in this order whatever the order given (default all: {' '.join(SECTIONS)})")
    p.add_argument("--budget-s", type=float, help="seconds for the run (default 480): a section past it is skipped")
    p.add_argument("--out-dir", type=Path, default=RESULTS, help="where the .json and .md go (default results/)")
    p.add_argument("--dry-run", action="store_true", help="print the plan and its time estimate; touch no GPU")


def out(args) -> Path:
    """``--out-dir/gpu_check_<device>`` (the runner adds ``_smoke``); without CUDA only ``--smoke`` runs."""
    if args.out_dir.exists() and not args.out_dir.is_dir():
        raise UsageError(f"--out-dir must be a folder, {args.out_dir} is a file")
    if args.dry_run:
        return args.out_dir / "gpu_check_plan"  # never written: the plan ends the command
    import torch

    cuda = torch.cuda.is_available()
    if not cuda and args.size != "smoke":
        raise UsageError("no CUDA device (--dry-run prints the plan, --smoke runs tiny sizes on CPU)")
    return args.out_dir / f"gpu_check_{device_tag(torch.cuda.get_device_name()) if cuda else 'cpu'}"


def rows(run):
    smoke, names = run.size == "smoke", [k for k in SECTIONS if k in run["sections"]]
    steps = plan(SETTINGS, names, run["budget_s"], smoke)
    print_plan(PROG, steps, run["budget_s"], STARTUP_S, smoke, file=None if run.args.dry_run else sys.stderr)
    if run.args.dry_run:
        raise SystemExit(0)  # as --help: nothing written
    import torch

    from models.kernels import DEFAULT_DECODE_KERNEL

    cuda, t0 = torch.cuda.is_available(), time.monotonic()
    if smoke:
        run.notes["smoke_run"] = "tiny sizes"
    run.notes.update(device=torch.cuda.get_device_name() if cuda else "CPU",
                     decode_kernel_default=DEFAULT_DECODE_KERNEL,
                     capability=list(torch.cuda.get_device_capability()) if cuda else None, cuda=torch.version.cuda,
                     torch=torch.__version__, triton=version("triton"), transformers=version("transformers"),
                     started=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()))
    yield from (dict(section=s["section"], status="pending", estimate_s=s["estimate_s"]) for s in steps)
    previous = signal.signal(signal.SIGTERM, on_sigterm)  # a stop from outside ends the section's processes too
    try:
        with tempfile.TemporaryDirectory(dir=run.stem.parent, prefix=f".{run.stem.name}.") as tmp:
            for name in SECTIONS:
                if name in names:
                    left = run["budget_s"] - STARTUP_S - (time.monotonic() - t0)
                    step = next(s for s in steps if s["section"] == name)
                    yield from run_section(PROG, step, SECTIONS[name], left, smoke, cuda, Path(tmp))
                else:  # --resume: the earlier run's rows of the sections this run does not redo
                    yield from (r for r in run.done if r.get("section") == name)
    finally:
        signal.signal(signal.SIGTERM, previous)
    run.notes["elapsed_s"] = round(time.monotonic() - t0, 1)
    bad = [k for k, s in by_section(run.rows, names).items() if s["status"] not in ("ok", "skipped")]
    if bad:
        run.fail("sections not ok: " + ", ".join(bad))


def markdown(run, rows) -> str:
    """The YAML's ``report:`` of a table of each section's last status and a table per section of its measurements
    (passed tests: the JSON only), under the columns of the study that measures it."""
    secs = by_section(rows, list(SECTIONS))
    got = [dict(s, part="sections", summary="; ".join(f"{k}: {report.fmt(v)}" for k, v in s.get("summary", {}).items()))
           for s in secs.values()]
    got += [dict(r, part=k) for k, s in secs.items() for r in s["rows"] if r.get("outcome") != "passed"]
    spec = STUDY.spec("report")
    cols = {k: s.get("columns") or studies.load(s["study"])["report"]["columns"][k] for k, s in SECTIONS.items()}
    values = {**run.settings, **{k: v for k, v in run.notes.items() if v is not None}}
    return report.markdown(dict(spec, columns={**spec["columns"], **cols}), got, values)


STUDY = Study("gpu_check", __doc__, rows, options=options, markdown=markdown, summary=lambda run, rows: run.notes,
              out=out, threads=None, bounds={"budget_s": (1, 1e6)})
main = STUDY.main

if __name__ == "__main__":
    raise SystemExit(main())
