"""The front-page figure: cache bytes against quality, from the committed results files (no training, no model).

    python -m benchmarks.readme_figure --force    # -> docs/figures/overview.png (replaced: --force)

Left: the models trained from scratch (``results/frontier_gpu.json``, ``results/kvsplice_recipe_recipe_gpu.json``):
validation loss against fp16 cache bytes per token. Right: post-training compression of SmolLM2-135M-Instruct
(``results/smollm2_frontier.json``, protocol P; the planner's picks from ``results/smollm2_tasks_goals*.json``):
perplexity change against how many times smaller the cache is than the fp16 full K/V cache.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from benchmarks.harness.paths import RESULTS, ROOT
from benchmarks.harness.runner import Study
from benchmarks.harness.studies import load as load_study
from benchmarks.lib.overview_plot import MIXED_PLAN, PLAN_NAMES, PPL_PLAN, figure
from benchmarks.smollm2_frontier import family

OUT = ROOT / "docs" / "figures" / "overview.png"
TRAINED = load_study("readme_figure")["trained"]  # variant → [label, family, label offset]
PPL_PLANS = load_study("smollm2_tasks")["ppl_planner"]  # the frontier's plan_<x> as smollm2_tasks.py names them


def load_trained(results: Path) -> list[dict]:
    """One point per variant: mean and std of the validation loss over its seeds, fp16 cache bytes per token."""
    groups: dict[str, list[dict]] = {}
    for name in ("frontier_gpu.json", "kvsplice_recipe_recipe_gpu.json"):
        for row in json.loads((results / name).read_text())["rows"]:
            groups.setdefault(row["variant"], []).append(row)
    points = []
    for variant, rows in groups.items():
        losses = [r["val_loss"] for r in rows]
        label, fam, offset = TRAINED.get(variant, (variant, "MHA / GQA / MQA", (8, 0)))
        points.append({"variant": variant, "label": label, "family": fam, "offset": offset, "seeds": len(losses),
                       "bytes": rows[0]["cache_bytes_per_token"], "loss": statistics.mean(losses),
                       "se": statistics.stdev(losses) / len(losses) ** 0.5 if len(losses) > 1 else 0.0})
    return sorted(points, key=lambda p: -p["bytes"])


def load_post_training(results: Path) -> list[dict]:
    """Protocol-P rows of the SmolLM2 frontier plus the planner's default (--objective mixed) picks."""
    rows = {r["id"]: r for r in json.loads((results / "smollm2_frontier.json").read_text())["rows"]}
    full = rows["full"]["ppl"]
    tasks = json.loads((results / "smollm2_tasks.json").read_text())["by_length"]["1024"]["summary"]["agnostic"]
    points = []
    for key, row in rows.items():
        fam, got = family(row), tasks.get(PPL_PLANS.get(key.removeprefix("plan_")))  # the ppl-only picks' tasks
        if row.get("protocol") != "P" or fam == "full":
            continue
        points.append({"id": key, "label": row["label"], "family": PPL_PLAN if fam == "planner" else fam,
                       "ratio": row["ratio_vs_fp16_full"], "delta": 100 * (row["ppl"] / full - 1),
                       **({"tasks": got["acc"], "tasks_n": got["n"]} if got else {})})
    # the default command's pick (fast prefill: goalsfast) and the exact-prefill picks (--prefill any: goals)
    for study, kind in (("smollm2_tasks_goalsfast.json", "mixed"), ("smollm2_tasks_goals.json", "exact")):
        goals = json.loads((results / study).read_text())
        summary = goals["by_length"]["1024"]["summary"]["agnostic"]
        for name, plan in goals["plans"].items():
            p = plan["protocol_P"]
            mine = [v for k, v in summary.items() if k.endswith(f"plan{name}.json")]
            ratio = name.removeprefix("default")
            points.append({"id": f"{kind}_{ratio}", "label": f"{PLAN_NAMES[kind]} {ratio}", "family": MIXED_PLAN,
                           "ratio": p["ratio_vs_fp16_full"], "delta": 100 * (p["ppl_ratio"] - 1),
                           "tasks": mine[0]["acc"], "tasks_n": sum(v["n"] for v in mine)})
    return points


def options(p) -> None:
    p.add_argument("--results", type=Path, default=RESULTS, help="folder holding the results files")


def rows(run):
    """The figure's points: the trained variants', then the post-training methods' (``panel`` says which)."""
    try:
        trained, post = load_trained(run.args.results), load_post_training(run.args.results)
    except KeyError as e:
        raise ValueError(f"a results file lacks {e}") from None
    yield from ({"panel": "trained", **p} for p in trained)
    yield from ({"panel": "post", **p} for p in post)


STUDY = Study("readme_figure", __doc__, rows, options=options, figure=lambda run, points: figure(points),
              json=False, out=OUT, threads=None)
main = STUDY.main

if __name__ == "__main__":
    raise SystemExit(main())
