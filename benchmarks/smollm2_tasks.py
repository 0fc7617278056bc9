"""SmolLM2-135M-Instruct on generated long-context tasks: accuracy vs cache bytes for the perplexity frontier's
methods and stacks, the planner's picks and KVzip, in both settings, beside the full cache's accuracy (the ceiling).

    python -m benchmarks.smollm2_tasks [--size NAME]      # the sizes of benchmarks/studies/smollm2_tasks.yaml
    python -m benchmarks.smollm2_tasks --report-only      # write results/ from the finished instances

The planner's picks (``planned``: ``kvsplice plan``) are made once into ``WORK/plans/`` and kept; each length is one
resumable ``kvsplice eval-tasks`` run into ``WORK/<size>_<L>.json`` (``WORK``: ``--work``).
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Optional

from benchmarks.harness.options import add_progress
from benchmarks.harness.paths import CALIB, EVAL as STORIES, ROOT, SMOLLM2 as MODEL
from benchmarks.harness.runner import Study
from benchmarks.harness.studies import load as load_study
from benchmarks.lib.stories import convert_stories
from kvsplice.planning.options import PLAN_CALIB_TOKENS
from kvsplice.tasks.report import markdown, summarize

WORK = ROOT / "checkpoints" / "smollm2_tasks"
PLANS = WORK / "plans"

# the planner's picks (PLANS/plan<name>.json: its options); --size NAME: methods, plans, tasks, lengths, n
PLANNED, SIZES = (load_study("smollm2_tasks")[k] for k in ("planned", "sizes"))


def plan_path(name: str) -> Path:
    return PLANS / f"plan{name}.json"


def plans_of(cfg: dict, length: Optional[int] = None) -> list[str]:
    """The plans ``cfg`` runs at ``length`` (every length's, then that length's own; every plan with None)."""
    extra = [p for L, ps in cfg.get("plans_at", {}).items() if length is None or L == length for p in ps]
    return [*cfg.get("plans", ()), *dict.fromkeys(extra)]


def plan_argv(name: str) -> list[str]:
    """The documented planner command for SmolLM2 with ``PLANNED[name]`` (its defaults: the mixed objective)."""
    args = PLANNED[name]
    tokens = args[args.index("--calib-tokens") + 1] if "--calib-tokens" in args else PLAN_CALIB_TOKENS
    stats = PLANS / f"smol_stats_{tokens}.safetensors"  # one calibration per token count, shared by the plans
    return ["--model", str(MODEL), "--calib", str(CALIB), "--calib-stats", str(stats), *args, "--out",
            str(plan_path(name)), "--json", str(PLANS / f"plan{name}_report.json")]


def protocol_p_argv(name: str) -> list[str]:
    """Protocol P of the plan: 4 validation windows of 1,024 tokens, 768-token prompts compressed, 256 scored."""
    return ["--model", str(MODEL), "--plan", str(plan_path(name)), "--data", str(STORIES), "--tokens", "4096",
            "--seq-len", "1024", "--json", str(PLANS / f"plan{name}_P.json")]


def model_for(size: str) -> str:
    """SmolLM2, or for the smoke size stories260K converted into ``WORK/s260k``."""
    return str(convert_stories(WORK / "s260k")) if size == "smoke" else str(MODEL)


def eval_argv(size: str, cfg: dict, length: int, out: Path, threads: int, progress: bool) -> list[str]:
    plans = [str(plan_path(p)) for p in plans_of(cfg, length)]
    methods = ["--method", *cfg["methods"]] if cfg["methods"] else []
    return ["--model", model_for(size), "--stories", str(STORIES), *methods,
            *(["--plan", *plans] if plans else []), "--tasks", *cfg["tasks"],
            "--lengths", str(length), "--n", str(cfg["n"]), "--setting", cfg.get("setting", "both"),
            "--threads", str(threads), "--out", str(out)] + ([] if progress else ["--no-progress"])


def build_report(size: str, cfg: dict) -> tuple[dict, str]:
    """The report of the finished lengths and the plans' evidence, and its Markdown."""
    report = {"size": size, "config": cfg, "model": model_for(size), "by_length": {}, "labels": {}}
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
            eval_argv(size, cfg, L, path, 2, False))}
        md += [f"## {L} tokens", "", markdown(summary, doc["methods"])]
    for name in plans_of(cfg):  # the planner's evidence: its pick and every candidate, both metrics
        if plan_path(name).is_file():
            doc, ppl_p = json.loads(plan_path(name).read_text()), PLANS / f"plan{name}_P.json"
            got = report.setdefault("plans", {})[name] = {k: doc.get(k) for k in (
                "label", "spec", "budget", "objective", "tasks", "full", "chosen", "selector", "candidates")}
            got["command"] = "kvsplice plan " + shlex.join(plan_argv(name))
            if ppl_p.is_file():
                got["protocol_P"] = json.loads(ppl_p.read_text())["results"][0]
                got["protocol_P_command"] = "kvsplice eval-bases " + shlex.join(protocol_p_argv(name))
    return report, "\n".join(md)


def options(p) -> None:
    p.add_argument("--work", default=str(WORK), help="folder of the runs and plans (default checkpoints/smollm2_tasks)")
    p.add_argument("--report-only", action="store_true", help="the report from the finished instances")
    add_progress(p)


def rows(run):
    global WORK, PLANS  # (every path below, from now on, under --work)
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
            eval_argv(size, cfg, L, WORK / f"{size}_{L}.json", a.threads, a.progress))) for L in cfg["lengths"]]
        for what, step in steps:
            if rc := step():
                run.fail(f"{what} exited {rc}")
                break
    report, md = build_report(size, cfg)
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
