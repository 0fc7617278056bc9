"""The main job on a busy machine: wall time of ``python -m training.fit --config tiny_mla_kvsplice_90`` for a few
steps, idle and beside one CPU-bound process, for each thread setting.

Run:    python -m benchmarks.fit_busy_machine [--steps 60] [--repeats 1] [--threads default 1 2]
Writes: results/fit_busy_machine.json and .md (load average before each run, wall seconds, busy / idle ratio).
        ``default``: the README's command (``training.fit`` picks its threads); a number adds ``--torch_threads N``.
        "Busy": a child spinning ``while True: pass`` for the whole run. Each run a fresh process, start-up included.
"""

from __future__ import annotations

import os
import statistics
import tempfile

from benchmarks.harness.header import machine
from benchmarks.harness.options import UsageError
from benchmarks.harness.paths import ROOT as REPO
from benchmarks.harness.runner import Study
from benchmarks.lib.train_step import fit_command, timed_fit

CONFIG = "tiny_mla_kvsplice_90"


def _fit(steps: int, threads: str, runs_dir: str, cache_dir: str) -> list[str]:
    cmd = fit_command(CONFIG, "--trainer.max_steps", str(steps), "--runs_dir", runs_dir, "--data.cache_dir", cache_dir)
    return cmd + ([] if threads == "default" else ["--torch_threads", threads])


def options(p) -> None:
    p.add_argument("--steps", type=int, help="optimizer steps per run")
    p.add_argument("--repeats", type=int, help="runs per (setting, condition); the median is reported")
    p.add_argument("--threads", dest="thread_settings", nargs="+",
                   help="'default' (training.fit's own choice) and/or --torch_threads values")


def rows(run):
    steps = run["steps"]
    for t in run["thread_settings"]:
        if t != "default" and not (t.isdigit() and 1 <= int(t) <= 256):
            raise UsageError(f"--threads: 'default' or a count in [1, 256], got {t!r}")
    with tempfile.TemporaryDirectory() as tmp:
        cache = str(REPO / ".cache" / "data")
        timed_fit(_fit(2, "1", tmp, cache))  # warm-up: tokenizer + data cache built once
        for threads in run["thread_settings"]:
            cmd = ["python", *_fit(steps, threads, "RUNS", cache)[1:]]
            row: dict = {"threads": threads, "fit_command": " ".join(cmd).replace(str(REPO) + "/", "")}
            for cond in ("idle", "busy"):
                runs = [timed_fit(_fit(steps, threads, tmp, cache), busy=cond == "busy") for _ in range(run["repeats"])]
                row[cond] = runs
                row[f"{cond}_median_s"] = statistics.median(r["wall_s"] for r in runs)
                run.say(f"{threads} {cond} {[r['wall_s'] for r in runs]} {runs[-1]['loadavg_before']}")
            row["busy_over_idle"] = round(row["busy_median_s"] / row["idle_median_s"], 2)
            yield {**row, "picked": picked(row)}


def picked(row: dict) -> str:
    """The threads the default picked in the first idle and busy runs (``training.fit``'s note)."""
    notes = [(row[cond][0]["threads_note"] or "").split(" (")[0] for cond in ("idle", "busy")]
    return ", ".join(n.replace("note: torch threads: ", "") or "-" for n in notes)


def summary(run, rows) -> dict:
    return {"config": CONFIG, "steps": run["steps"], "cpus": len(os.sched_getaffinity(0)),
            "loadavg_end": machine()["load_average"]}


STUDY = Study("fit_busy_machine", __doc__, rows, options=options, summary=summary, threads=None,
              bounds={"steps": (1, 100000), "repeats": (1, 100)})
main = STUDY.main

if __name__ == "__main__":
    raise SystemExit(main())
