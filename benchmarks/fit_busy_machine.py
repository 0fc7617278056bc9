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


from benchmarks.harness.header import header
from benchmarks.harness.options import add_out, command, parser, pos_int
from benchmarks.harness.paths import ROOT as REPO
from benchmarks.harness.results import result_stem, write_markdown, write_result

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


def build_parser():
    p = parser(__file__, __doc__)
    p.add_argument("--steps", type=pos_int, default=60)
    p.add_argument("--repeats", type=pos_int, default=1, help="runs per (setting, condition); the median is reported")
    p.add_argument("--threads", nargs="+", default=["default", "1", "2"],
                   help="'default' (training.fit's own choice) and/or --torch_threads values")
    add_out(p, default=result_stem("fit_busy_machine"), help="the results' stem (.json and .md are written)")
    return p


@command
def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    head = header(__file__, argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cache = str(REPO / ".cache" / "data")
        timed_fit(fit_command(2, "1", tmp, cache), busy=False)  # warm-up: tokenizer + data cache built once
        for threads in args.threads:
            cmd = ["python", *fit_command(args.steps, threads, "RUNS", cache)[1:]]
            row: dict = {"threads": threads, "fit_command": " ".join(cmd).replace(str(REPO) + "/", "")}
            for cond in ("idle", "busy"):
                runs = [timed_fit(fit_command(args.steps, threads, tmp, cache), busy=cond == "busy")
                        for _ in range(args.repeats)]
                row[cond] = runs
                row[f"{cond}_median_s"] = statistics.median(r["wall_s"] for r in runs)
                print(threads, cond, [r["wall_s"] for r in runs], runs[-1]["loadavg_before"], flush=True)
            row["busy_over_idle"] = round(row["busy_median_s"] / row["idle_median_s"], 2)
            rows.append(row)
    report = {**head, "config": CONFIG, "steps": args.steps, "cpus": len(os.sched_getaffinity(0)),
              "loadavg_end": loadavg(), "rows": rows}
    write_result(Path(args.out), report)
    write_markdown(Path(args.out), render(report))
    print(render(report))
    return 0


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


if __name__ == "__main__":
    sys.exit(main())
