"""The figure of ``benchmarks/smollm2_tasks.py``: accuracy against how many times smaller the cache is, a panel per
length and setting (query-agnostic / aware), the full cache's accuracy as the line to reach."""

from __future__ import annotations

from pathlib import Path

__all__ = ["plot"]


def plot(report: dict):
    """The figure of a report (``by_length`` summaries and method ``labels``)."""
    from matplotlib.figure import Figure

    lengths = sorted(report["by_length"], key=int)
    settings = [s for s in ("agnostic", "aware") if any(s in report["by_length"][L]["summary"] for L in report[
        "by_length"])]
    fig = Figure(figsize=(5.0 * max(1, len(settings)), 3.8 * max(1, len(lengths))), dpi=110)
    for i, L in enumerate(lengths):
        for j, s in enumerate(settings):
            ax = fig.add_subplot(len(lengths), len(settings), i * len(settings) + j + 1)
            per = report["by_length"][L]["summary"].get(s, {})
            for m, r in per.items():
                name = Path(m[5:]).stem if m.startswith("plan:") else report["labels"].get(m, m)  # plan4x8k
                label = f"{name} (n={r['n']})"
                if m == "full":
                    ax.axhline(r["acc"], color="k", ls="--", lw=1, label=f"full cache ({r['acc']:.0f} %)")
                    continue
                marker = "s" if m.startswith("kvzip") else ("^" if m.startswith("select") else "o")
                ax.scatter(r["ratio"], r["acc"], marker=marker, label=label)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("× smaller than the fp16 full cache")
            ax.set_ylabel("accuracy % (exact match)")
            ax.set_ylim(-5, 105)
            ax.set_title(f"SmolLM2-135M, {L} tokens, query-{s}", fontsize=9)
            ax.grid(True, alpha=0.3)
            if per:
                ax.legend(fontsize=6, loc="best")
            else:
                ax.text(0.5, 0.5, "not run", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    return fig
