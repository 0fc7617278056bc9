"""The main job on a busy machine: wall time of ``python -m training.fit --config tiny_mla_kvsplice_90`` for a few
steps, idle and beside one CPU-bound process, for each thread setting.

Run:    python -m benchmarks.fit_busy_machine [--steps 60] [--repeats 1] [--threads default 1 2]
Writes: results/fit_busy_machine.json and .md (the load average before each run, wall seconds, the busy / idle ratio
        per setting). ``default`` is the command as the README gives it (``training.fit`` picks its threads); a
        number adds ``--torch_threads N``. "Beside one CPU-bound process": a child spinning ``while True: pass`` for
        the whole run. Each run is a fresh process (start-up, data loading and the final validation included).
"""

from __future__ import annotations

import os
import statistics
import tempfile

from benchmarks.harness.options import UsageError
from benchmarks.harness.paths import ROOT as REPO
from benchmarks.harness.runner import Study
from benchmarks.lib.train_step import fit_command, loadavg, timed_fit

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
            yield row


def summary(run, rows) -> dict:
    return {"config": CONFIG, "steps": run["steps"], "cpus": len(os.sched_getaffinity(0)), "loadavg_end": loadavg()}


def markdown(run, rows) -> str:
    """The table (``results/fit_busy_machine.md``)."""
    lines = [f"# training.fit on a busy machine ({CONFIG}, {run['steps']} steps, {len(os.sched_getaffinity(0))} "
             "CPUs)", "", "| threads | idle s | beside 1 CPU-bound process s | busy / idle | load avg (1 min) before "
             "idle, busy | threads the default picked (idle, busy) |", "|---|---|---|---|---|---|"]
    for r in rows:
        picked = [(x["threads_note"] or "").split(" (")[0].replace("note: torch threads: ", "") or "-"
                  for x in (r["idle"][0], r["busy"][0])]
        lines.append(f"| {r['threads']} | {r['idle_median_s']:.1f} | {r['busy_median_s']:.1f} | "
                     f"{r['busy_over_idle']:.2f} | {r['idle'][0]['loadavg_before'][0]:.2f}, "
                     f"{r['busy'][0]['loadavg_before'][0]:.2f} | {', '.join(picked)} |")
    lines += ["", f"Medians of {run['repeats']} run(s) each; wall time of the whole command, start-up and the final "
              "validation included. `default` is `python -m training.fit --config tiny_mla_kvsplice_90` as the README "
              "gives it; a number adds `--torch_threads N`. \"Idle\" means without the spinning process this script "
              "starts; the load average is the machine's, other users' jobs included, so figures taken on a shared "
              "machine are noisy (compare rows taken at similar load)."]
    return "\n".join(lines) + "\n"


STUDY = Study("fit_busy_machine", __doc__, rows, options=options, markdown=markdown, summary=summary, threads=None,
              bounds={"steps": (1, 100000), "repeats": (1, 100)})
main = STUDY.main

if __name__ == "__main__":
    raise SystemExit(main())
