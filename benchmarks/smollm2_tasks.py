"""SmolLM2-135M-Instruct on generated long-context tasks: accuracy vs cache bytes for the perplexity frontier's
methods and stacks, the planner's picks and KVzip, in both settings, beside the full cache's accuracy (the ceiling).

    python -m benchmarks.smollm2_tasks [--size NAME]      # the sizes of benchmarks/studies/smollm2_tasks.yaml
    python -m benchmarks.smollm2_tasks --report-only      # write results/ from the finished instances

The planner's picks (``planned``: ``kvsplice plan``) are made once into ``WORK/plans/`` and kept; each length is one
resumable ``kvsplice eval-tasks`` run into ``WORK/<size>_<L>.json``; the report is
``results/smollm2_tasks[_<size>].{json,md,png}``.
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.harness.options import add_progress
from benchmarks.harness.runner import Study
from benchmarks.lib import smollm2_tasks_runs as R
from benchmarks.lib.smollm2_tasks_runs import PLANNED, SIZES, plan_argv, plans_of  # noqa: F401  (the tests read them)


def options(p) -> None:
    p.add_argument("--work", default=str(R.WORK), help="folder of the runs and plans (default checkpoints/smollm2_tasks)")
    p.add_argument("--report-only", action="store_true", help="the report from the finished instances")
    add_progress(p)


def rows(run):
    a, cfg, size = run.args, run.settings, run.size
    R.use_work(a.work)
    if not a.report_only:
        from kvsplice.cli import eval_bases, eval_tasks, plan

        R.WORK.mkdir(parents=True, exist_ok=True)
        steps = []
        for name in R.plans_of(cfg):
            if not R.plan_path(name).is_file():  # made once, kept (the planner's tuning never sees reported seeds)
                R.PLANS.mkdir(parents=True, exist_ok=True)
                steps.append(("kvsplice plan", lambda name=name: plan.main(
                    R.plan_argv(name) + ["--threads", str(a.threads)] + ([] if a.progress else ["--no-progress"]))))
            if not (R.PLANS / f"plan{name}_P.json").is_file():  # the plan's protocol-P perplexity (docs/plan.md)
                steps.append(("kvsplice eval-bases", lambda name=name: eval_bases.main(
                    R.protocol_p_argv(name) + ["--threads", str(a.threads), "--no-progress"])))
        steps += [("kvsplice eval-tasks", lambda L=L: eval_tasks.main(
            R.eval_argv(size, cfg, L, R.WORK / f"{size}_{L}.json", a.threads, a.progress))) for L in cfg["lengths"]]
        for what, step in steps:
            rc = step()
            if rc:
                run.fail(f"{what} exited {rc}")
                break
    report, md = R.build_report(size, cfg)
    run.notes.update(report=report, markdown=md)
    for L, v in report["by_length"].items():  # a row per length, setting and method (the figure's points)
        for setting, per in v["summary"].items():
            for m, r in per.items():
                label = Path(m[5:]).stem if m.startswith("plan:") else report["labels"].get(m, m)  # plan4x8k
                yield {"length": int(L), "setting": setting, "method": m, "label": label, **r}


STUDY = Study("smollm2_tasks", __doc__, rows, options=options, threads=2, default_size="reduced", inherit=False,
              sizes=SIZES, summary=lambda run, rows: run.notes["report"],
              markdown=lambda run, rows: run.notes["markdown"],
              bounds={"lengths": (16, 1 << 17), "n": (1, 100000)})
main = STUDY.main

if __name__ == "__main__":
    raise SystemExit(main())
