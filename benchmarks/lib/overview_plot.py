"""The front-page figure's drawing (``python -m benchmarks.readme_figure``): the trained variants' panel and the
post-training panel, from the points :mod:`benchmarks.readme_figure` reads out of the results files."""

from __future__ import annotations

from benchmarks.harness.studies import load as load_study

PPL_PLAN = "planner, --objective ppl (perplexity only)"
MIXED_PLAN = "planner, default --objective mixed (perplexity + tasks)"
PLAN_NAMES = {"mixed": "default plan", "exact": "exact-prefill plan", "plan": "ppl-only plan"}
Y_MAX = 25.0  # post-training panel: rows above +25 % are left out (the figure's note lists them; ylim to +28)

STYLE, WHERE, PANELS = (load_study("readme_figure")[k] for k in ("style", "where", "panels"))  # (the YAML's)


def figure(points: list[dict]):
    """The two panels (the points' ``panel``): trained variants (loss against bytes), post-training methods
    (perplexity change against times smaller), each framed by its YAML ``panels`` entry."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, NullLocator

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
            name = PLAN_NAMES[p["id"].split("_")[0]]
            x = p["id"].split("_")[1].replace("x", "×")
            text = f"{name} {x}: {p['delta']:+.2f} %"
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
        ax.xaxis.set_major_locator(FixedLocator(spec["ticks"]))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xticklabels([spec["tick"].format(t) for t in spec["ticks"]])
        ax.set_xlim(*spec["xlim"])  # (the trained panel's inverted: smaller caches to the right)
        ax.set_ylim(*spec.get("ylim", ax.get_ylim()))
        ax.set(xlabel=spec["xlabel"], ylabel=spec["ylabel"])
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
