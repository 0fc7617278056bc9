"""SmolLM2-135M-Instruct on generated long-context tasks: accuracy vs cache bytes for every method family and stack of
the perplexity frontier (results/smollm2_frontier.*), the planner's picks and KVzip, in both settings, beside the full
cache's accuracy (the ceiling).

    python -m benchmarks.smollm2_tasks                    # --size reduced (what was run; see docs/tasks.md)
    python -m benchmarks.smollm2_tasks --size passkey     # the passkey table: 8 at 1k + 8 at 2k, both settings
    python -m benchmarks.smollm2_tasks --size goals       # the goals: the planner's picks, 3 tasks x 50 at 1k
    python -m benchmarks.smollm2_tasks --size goals2k     # the same for the passkey at 2k (50, both settings)
    python -m benchmarks.smollm2_tasks --size ceiling     # the full cache (+ int8) at 4k / 8k, 3 tasks x 10: the model's ceiling
    python -m benchmarks.smollm2_tasks --size long        # the picks made at 1k at 4k / 8k (+ a 4x pick re-made for 8k):
                                                          # number in stories x 20, both settings
    python -m benchmarks.smollm2_tasks --size goalsfast   # the goals for the default 4x pick (fast prefill)
    python -m benchmarks.smollm2_tasks --size fastpick    # the default 4x pick (fast prefill) vs the full cache, 2k / 4k
    python -m benchmarks.smollm2_tasks --size full        # every family and stack, 7 tasks, 1k/2k/4k, n = 16
    python -m benchmarks.smollm2_tasks --size smoke       # stories260K, seconds: checks the script end to end
    python -m benchmarks.smollm2_tasks --report-only      # write results/ from the finished instances

The planner's picks are made first by the documented command (``kvsplice plan --model M --calib CALIB
--calib-stats ... --ratio R --out plan<R>x.json``, its defaults: the ``mixed`` objective on tuning instances with
seeds >= 1,000,000, tuning windows from the calibration file; ``4x8k``: the same with ``--tune-length 8000``) into
``checkpoints/smollm2_tasks/plans/`` and kept;
the perplexity-only planner's stacks (``--objective ppl``, the frontier's plans: ObservedAttention keeping 1/2.09,
1/4.19 of the prompt + int8 rows = 4x / 8x) are rebuilt by spec beside them. Each length is one
``kvsplice eval-tasks`` run into ``checkpoints/smollm2_tasks/<size>_<L>.json`` (resumable: rerun the command
and finished instances are kept); the report is ``results/smollm2_tasks[_<size>].{json,md,png}``. Instances use seeds
0 .. n-1. Low-rank rows are cut in every size (off the perplexity frontier).
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Optional

from benchmarks.harness.options import add_progress
from benchmarks.harness.paths import CALIB, DATA, EVAL as STORIES, ROOT, SMOLLM2 as MODEL
from benchmarks.harness.runner import Study
from benchmarks.harness.studies import load as load_study
from benchmarks.lib.tasks_figure import plot
from kvsplice.planning.options import PLAN_CALIB_TOKENS

WORK = ROOT / "checkpoints" / "smollm2_tasks"
PLANS = WORK / "plans"

SETTINGS = load_study("smollm2_tasks")  # benchmarks/studies/smollm2_tasks.yaml
PPL_PLANNER: dict[str, str] = SETTINGS["ppl_planner"]  # the planner with --objective ppl (the frontier's picks)
PLANNED: dict[str, list[str]] = SETTINGS["planned"]  # the planner's default picks: plan:PLANS/plan<name>.json
SIZES: dict[str, dict] = SETTINGS["sizes"]  # --size NAME: methods, plans, tasks, lengths, instances per task


def plan_path(name: str) -> Path:
    return PLANS / f"plan{name}.json"


def plans_of(cfg: dict, length: Optional[int] = None) -> list[str]:
    """The plans ``cfg`` runs at ``length`` (every length's, then that length's own); every plan when ``length`` is
    None."""
    at = cfg.get("plans_at", {})
    extra = [p for L, ps in at.items() if length is None or L == length for p in ps]
    return [*cfg.get("plans", ()), *dict.fromkeys(extra)]


def plan_argv(name: str) -> list[str]:
    """The documented planner command for SmolLM2 with ``PLANNED[name]`` (its defaults: the mixed objective)."""
    args = PLANNED[name]
    tokens = args[args.index("--calib-tokens") + 1] if "--calib-tokens" in args else PLAN_CALIB_TOKENS
    stats = PLANS / f"smol_stats_{tokens}.safetensors"  # one calibration per token count, shared by the plans
    return ["--model", str(MODEL), "--calib", str(CALIB), "--calib-stats", str(stats),
            *args, "--out", str(plan_path(name)), "--json",
            str(PLANS / f"plan{name}_report.json")]


def protocol_p_argv(name: str) -> list[str]:
    """Protocol P of the plan: 4 validation windows of 1,024 tokens, 768-token prompts compressed, 256 scored."""
    return ["--model", str(MODEL), "--plan", str(plan_path(name)), "--data", str(STORIES), "--tokens", "4096",
            "--seq-len", "1024", "--json", str(PLANS / f"plan{name}_P.json")]


def _model(size: str) -> str:
    if size != "smoke":
        return str(MODEL)
    d = WORK / "s260k"
    if not (d / "config.json").is_file():
        from kvsplice.convert.llama2c import convert_llama2c

        convert_llama2c(DATA / "stories260K" / "stories260K.bin", DATA / "stories260K" / "tok512.bin", d)
    return str(d)


def _argv(size: str, cfg: dict, length: int, out: Path, threads: int, progress: bool) -> list[str]:
    plans = [str(plan_path(p)) for p in plans_of(cfg, length)]
    methods = ["--method", *cfg["methods"]] if cfg["methods"] else []
    return ["--model", _model(size), "--stories", str(STORIES), *methods,
            *(["--plan", *plans] if plans else []), "--tasks", *cfg["tasks"],
            "--lengths", str(length), "--n", str(cfg["n"]), "--setting", cfg.get("setting", "both"),
            "--threads", str(threads),
            "--out", str(out)] + ([] if progress else ["--no-progress"])


def build_report(size: str, cfg: dict) -> tuple[dict, str]:
    """The report of the finished lengths and the plans' evidence, and its Markdown."""
    from kvsplice.tasks.report import markdown, summarize

    report = {"size": size, "config": cfg, "model": _model(size), "by_length": {}, "labels": {}}
    md = [f"# Long-context tasks on {'stories260K (smoke)' if size == 'smoke' else 'SmolLM2-135M-Instruct'}", "",
          f"`python -m benchmarks.smollm2_tasks --size {size}` — tasks {', '.join(cfg['tasks'])}; n = {cfg['n']} per "
          f"task and length; greedy answers, exact match; fp32 on the CPU.", ""]
    for L in cfg["lengths"]:
        path = WORK / f"{size}_{L}.json"
        if not path.is_file():
            continue
        doc = json.loads(path.read_text())
        methods = ["full", *cfg["methods"], *(f"plan:{plan_path(p)}" for p in plans_of(cfg, L))]
        summary = summarize(doc["results"], methods)
        report["labels"].update(doc["methods"])
        report["by_length"][str(L)] = {"summary": summary, "command": "kvsplice eval-tasks " + shlex.join(
            _argv(size, cfg, L, path, 2, False))}
        md += [f"## {L} tokens", "", markdown(summary, doc["methods"])]
    for name in plans_of(cfg):  # the planner's evidence: its pick and every candidate, both metrics
        if plan_path(name).is_file():
            doc = json.loads(plan_path(name).read_text())
            report.setdefault("plans", {})[name] = {k: doc.get(k) for k in (
                "label", "spec", "budget", "objective", "tasks", "full", "chosen", "selector", "candidates")}
            report["plans"][name]["command"] = "kvsplice plan " + shlex.join(plan_argv(name))
            ppl_p = PLANS / f"plan{name}_P.json"
            if ppl_p.is_file():
                report["plans"][name]["protocol_P"] = json.loads(ppl_p.read_text())["results"][0]
                report["plans"][name]["protocol_P_command"] = "kvsplice eval-bases " + shlex.join(
                    protocol_p_argv(name))
    return report, "\n".join(md)


def options(p) -> None:
    p.add_argument("--work", default=str(WORK), help="folder of the runs and plans (default checkpoints/smollm2_tasks)")
    p.add_argument("--report-only", action="store_true", help="the report from the finished instances")
    add_progress(p)


def rows(run):
    global WORK, PLANS
    a, cfg, size = run.args, run.settings, run.size
    WORK, PLANS = Path(a.work), Path(a.work) / "plans"
    if not a.report_only:
        from kvsplice.cli import eval_bases, eval_tasks, plan

        WORK.mkdir(parents=True, exist_ok=True)
        steps = []
        for name in plans_of(cfg):
            if not plan_path(name).is_file():  # made once, kept (the planner's tuning never sees reported seeds)
                PLANS.mkdir(parents=True, exist_ok=True)
                steps.append(("kvsplice plan", lambda name=name: plan.main(
                    plan_argv(name) + ["--threads", str(a.threads)] + ([] if a.progress else ["--no-progress"]))))
            if not (PLANS / f"plan{name}_P.json").is_file():  # the plan's protocol-P perplexity (docs/plan.md)
                steps.append(("kvsplice eval-bases", lambda name=name: eval_bases.main(
                    protocol_p_argv(name) + ["--threads", str(a.threads), "--no-progress"])))
        steps += [("kvsplice eval-tasks", lambda L=L: eval_tasks.main(
            _argv(size, cfg, L, WORK / f"{size}_{L}.json", a.threads, a.progress))) for L in cfg["lengths"]]
        for what, step in steps:
            rc = step()
            if rc:
                run.fail(f"{what} exited {rc}")
                break
    report, md = build_report(size, cfg)
    run.notes.update(report=report, markdown=md)
    yield from ({"length": int(L), **v} for L, v in report["by_length"].items())


STUDY = Study("smollm2_tasks", __doc__, rows, options=options, threads=2, default_size="reduced", inherit=False,
              sizes=SIZES, summary=lambda run, rows: run.notes["report"],
              markdown=lambda run, rows: run.notes["markdown"], figure=lambda run, rows: plot(run.notes["report"]),
              bounds={"lengths": (16, 1 << 17), "n": (1, 100000)})
main = STUDY.main

if __name__ == "__main__":
    raise SystemExit(main())
