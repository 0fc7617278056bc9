"""The front-page figure: cache bytes against quality, from the committed results files (no training, no model).

    python -m benchmarks.readme_figure --force    # -> docs/figures/overview.png (replaced: --force)

Left: the trained variants' validation loss against fp16 cache bytes per token (``results/frontier_gpu.json``,
``kvsplice_recipe_recipe_gpu.json``). Right: SmolLM2-135M-Instruct's post-training perplexity change (protocol P,
``smollm2_frontier.json``; the planner's picks from ``smollm2_tasks_goals*.json``) against times smaller.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from benchmarks.harness.paths import RESULTS, ROOT
from benchmarks.harness.runner import Study
from benchmarks.harness.studies import load as load_study
from benchmarks.smollm2_frontier import family

OUT = ROOT / "docs" / "figures" / "overview.png"
# variant → [label, family, label offset]; family → [marker, colour]; label positions; the panels' frames
TRAINED, STYLE, WHERE, PANELS = (load_study("readme_figure")[k] for k in ("trained", "style", "where", "panels"))
PPL_PLAN = "planner, --objective ppl (perplexity only)"
MIXED_PLAN = "planner, default --objective mixed (perplexity + tasks)"
PLAN_NAMES = {"mixed": "default plan", "exact": "exact-prefill plan", "plan": "ppl-only plan"}
Y_MAX = 25.0  # post-training panel: rows above +25 % are left out (the figure's note lists them; ylim to +28)
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


def figure(points: list[dict]):
    """The two panels (the points' ``panel``), each framed by its YAML ``panels`` entry."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullLocator

    trained, post = ([p for p in points if p["panel"] == k] for k in ("trained", "post"))
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 6.2), dpi=110)
    for family in dict.fromkeys(p["family"] for p in trained):
        pts = [p for p in trained if p["family"] == family]
        marker, colour = STYLE[family]
        a.errorbar([p["bytes"] for p in pts], [p["loss"] for p in pts], yerr=[p["se"] for p in pts], fmt=marker,
                   color=colour, ms=13 if marker == "*" else 7, capsize=3, label=family,
                   ls="-" if family == "MLA" else "none", lw=1)
    for p in trained:
        dx, dy = p["offset"]
        a.annotate(p["label"], (p["bytes"], p["loss"]), xytext=(dx, dy), textcoords="offset points", fontsize=8,
                   ha="right" if dx < 0 else "center" if dx == 0 else "left", va="center")
    hidden = [p for p in post if p["delta"] > Y_MAX]
    shown = [p for p in post if p["delta"] <= Y_MAX]
    for family in dict.fromkeys(p["family"] for p in shown):
        pts = [p for p in shown if p["family"] == family]
        marker, colour = STYLE[family]
        b.scatter([p["ratio"] for p in pts], [p["delta"] for p in pts], marker=marker, color=colour,
                  s=180 if marker == "*" else 40, label=family, zorder=3 if marker == "*" else 2)
    for p in shown:
        if p["family"] in (MIXED_PLAN, PPL_PLAN):
            kind, x = p["id"].split("_")
            text = f"{PLAN_NAMES[kind]} {x.replace('x', '×')}: {p['delta']:+.2f} %"
            if "tasks" in p:
                text += f", tasks {p['tasks']:.0f} %" + ("" if p["tasks_n"] >= 150 else f" (n={p['tasks_n']})")
            b.annotate(text, (p["ratio"], p["delta"]), xytext=WHERE.get(p["id"], (p["ratio"] * 1.1, p["delta"] + 1)),
                       fontsize=8, color=STYLE[p["family"]][1], ha="left", va="center",
                       fontweight="bold" if p["family"] == MIXED_PLAN else "normal",
                       arrowprops={"arrowstyle": "-", "color": STYLE[p["family"]][1], "lw": 0.6, "shrinkB": 6})
        elif p["id"] in ("kivi4_r128", "int8"):
            b.annotate({"kivi4_r128": "KIVI-4", "int8": "int8"}[p["id"]], (p["ratio"], p["delta"]), xytext=(0, -12),
                       textcoords="offset points", fontsize=8, ha="center")
    b.axhline(0, color="black", lw=0.8)
    for ax, spec in zip((a, b), PANELS):  # log-2 x axis, fixed ticks, limits, labels, grid, the legend below
        ax.set_xscale("log", base=2)
        ax.set_xticks(spec["ticks"], [spec["tick"].format(t) for t in spec["ticks"]])
        ax.xaxis.set_minor_locator(NullLocator())  # (xlim: the trained panel's inverted, smaller caches to the right)
        ax.set(xlim=spec["xlim"], ylim=spec.get("ylim", ax.get_ylim()), xlabel=spec["xlabel"], ylabel=spec["ylabel"])
        ax.set_title(spec["title"], fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2, frameon=False)
    note = "tasks: query-agnostic accuracy, passkey + number in stories + word in facts at 1k tokens (full cache 98 %)"
    if hidden:
        note += f"\n{len(hidden)} rows above +{Y_MAX:g} % not shown (results/smollm2_frontier.md)"
    b.text(0.99, 0.985, note, ha="right", va="top", transform=b.transAxes, fontsize=7, color="#555555")
    fig.text(0.5, 0.005, "python -m benchmarks.readme_figure  (from results/frontier_gpu.json, "
             "kvsplice_recipe_recipe_gpu.json, smollm2_frontier.json, smollm2_tasks.json, smollm2_tasks_goals*.json)",
             ha="center", fontsize=7, color="#555555")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    return fig


def options(p) -> None:
    p.add_argument("--results", type=Path, default=RESULTS, help="folder holding the results files")


def rows(run):
    """The figure's points: the trained variants', then the post-training methods' (``panel`` says which)."""
    try:
        trained, post = load_trained(run.args.results), load_post_training(run.args.results)
    except KeyError as e:
        raise ValueError(f"a results file lacks {e}") from None
    yield from ({"panel": k, **p} for k, points in (("trained", trained), ("post", post)) for p in points)


STUDY = Study("readme_figure", __doc__, rows, options=options, figure=lambda run, points: figure(points),
              json=False, out=OUT, threads=None)
main = STUDY.main

if __name__ == "__main__":
    raise SystemExit(main())
