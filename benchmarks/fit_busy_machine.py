"""The main job on a busy machine: wall time of ``python -m training.fit --config tiny_mla_kvsplice_90`` for a few
steps, idle and beside one CPU-bound process, for each thread setting.

Run:    python -m benchmarks.fit_busy_machine [--steps 60] [--repeats 1] [--threads default 1 2]
Writes: results/fit_busy_machine.json and .md (the command, the load average before each run, wall seconds, the
        busy / idle ratio per setting). ``default`` is the command as the README gives it (the thread count
        ``training.fit`` picks itself); a number adds ``--torch_threads N``.

"Beside one CPU-bound process" = a child process spinning ``while True: pass`` on any core for the whole run.
Each run is a fresh process (start-up, data loading and the end-of-run validation included), as a user sees it.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness.options import UsageError
from benchmarks.harness.paths import ROOT as REPO
from benchmarks.harness.runner import Study

CONFIG = "tiny_mla_kvsplice_90"


def loadavg() -> list[float]:
    """The 1, 5 and 15-minute load averages (``/proc/loadavg``)."""
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def fit_command(steps: int, threads: str, runs_dir: str, cache_dir: str) -> list[str]:
    cmd = [sys.executable, "-m", "training.fit", "--config", CONFIG, "--trainer.max_steps", str(steps),
           "--runs_dir", runs_dir, "--data.cache_dir", cache_dir, "--wandb.mode", "disabled",
           "--trainer.enable_progress_bar", "false"]
    return cmd + ([] if threads == "default" else ["--torch_threads", threads])


def timed_fit(cmd: list[str], busy: bool) -> dict:
    """One run of ``cmd``; with ``busy`` a spinning child runs from before its start to after its end."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    try:
        if spinner is not None:
            time.sleep(1.0)  # the spinner holds its core before training starts
        load = loadavg()
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines() or ["no output"]
        raise ValueError(f"training.fit exited {proc.returncode}: {lines[-1]}")
    notes = [line for line in proc.stderr.splitlines() if line.startswith("note: torch threads")]
    return {"wall_s": round(wall, 2), "loadavg_before": load, "threads_note": notes[0] if notes else None}


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
        timed_fit(fit_command(2, "1", tmp, cache), busy=False)  # warm-up: tokenizer + data cache built once
        for threads in run["thread_settings"]:
            cmd = ["python", *fit_command(steps, threads, "RUNS", cache)[1:]]
            row: dict = {"threads": threads, "fit_command": " ".join(cmd).replace(str(REPO) + "/", "")}
            for cond in ("idle", "busy"):
                runs = [timed_fit(fit_command(steps, threads, tmp, cache), busy=cond == "busy")
                        for _ in range(run["repeats"])]
                row[cond] = runs
                row[f"{cond}_median_s"] = statistics.median(r["wall_s"] for r in runs)
                run.say(f"{threads} {cond} {[r['wall_s'] for r in runs]} {runs[-1]['loadavg_before']}")
            row["busy_over_idle"] = round(row["busy_median_s"] / row["idle_median_s"], 2)
            yield row


def summary(run, rows) -> dict:
    return {"config": CONFIG, "steps": run["steps"], "cpus": len(os.sched_getaffinity(0)), "loadavg_end": loadavg()}


def markdown(run, rows) -> str:
    return render({**summary(run, rows), "rows": rows, "command": run.header["command"]})


def render(report: dict) -> str:
    """The Markdown table of a report (``results/fit_busy_machine.md``)."""
    lines = [f"# training.fit on a busy machine ({report['config']}, {report['steps']} steps, {report['cpus']} CPUs)",
             "", "| threads | idle s | beside 1 CPU-bound process s | busy / idle | load avg (1 min) before idle, "
             "busy | threads the default picked (idle, busy) |", "|---|---|---|---|---|---|"]
    for r in report["rows"]:
        picked = [(x["threads_note"] or "").split(" (")[0].replace("note: torch threads: ", "") or "-"
                  for x in (r["idle"][0], r["busy"][0])]
        lines.append(f"| {r['threads']} | {r['idle_median_s']:.1f} | {r['busy_median_s']:.1f} | "
                     f"{r['busy_over_idle']:.2f} | {r['idle'][0]['loadavg_before'][0]:.2f}, "
                     f"{r['busy'][0]['loadavg_before'][0]:.2f} | {', '.join(picked)} |")
    repeats = len(report["rows"][0]["idle"]) if report["rows"] else 0
    lines += ["", f"Command: `{report['command'].strip()}` (medians of {repeats} run(s) each; wall time of the whole "
              f"command, start-up and the final validation included).",
              "`default` is `python -m training.fit --config tiny_mla_kvsplice_90` as the README gives it; a number "
              "adds `--torch_threads N`. \"Idle\" means without the spinning process this script starts; the load "
              "average is the machine's, other users' jobs included, so figures taken on a shared machine are noisy "
              "(compare rows taken at similar load)."]
    return "\n".join(lines) + "\n"


STUDY = Study("fit_busy_machine", __doc__, rows, options=options, markdown=markdown, summary=summary, threads=None,
              bounds={"steps": (1, 100000), "repeats": (1, 100)})
main = STUDY.main

if __name__ == "__main__":
    raise SystemExit(main())
