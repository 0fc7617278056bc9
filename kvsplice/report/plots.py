"""Plots for the memory / decode-speed / quality reports (PNG files, matplotlib's Agg canvas).

Figures are made with ``matplotlib.figure.Figure`` and saved through the Agg canvas, so importing this module
never touches pyplot's global state or the user's interactive backend.

* :func:`plot_cache_vs_seqlen` — cache MiB vs sequence length per variant (log y), from ``verify_memory`` rows;
* :func:`plot_decode_times` — decode step time vs context per variant, from ``bench_decode`` rows;
* :func:`plot_val_loss` — validation loss vs step from Lightning ``CSVLogger`` ``metrics.csv`` files;
* :func:`plot_quality_vs_cache` — validation loss vs cache bytes per token, one point per variant.

:func:`plot_report` redraws a report's PNGs from its JSON (``results/memory_fp16.json``, ``results/bench_decode.json``).
"""

from __future__ import annotations

import csv
import json
import math
import sys
from collections import defaultdict
from pathlib import Path
from typing import Iterable, Mapping, Optional, Sequence

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

MIB = 2**20


def _new_figure(figsize=(8.0, 4.5)) -> Figure:
    fig = Figure(figsize=figsize, dpi=120)
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Figure, out_png: str | Path) -> Path:
    from models.checkpoint import atomic_write

    fig.tight_layout()
    return atomic_write(Path(out_png), lambda tmp: fig.savefig(tmp, format="png"))


def _group(rows: Iterable[Mapping], key: str) -> dict[str, list[Mapping]]:
    groups: dict[str, list[Mapping]] = defaultdict(list)
    for r in rows:
        groups[str(r["variant"])].append(r)
    return {k: sorted(v, key=lambda r: r[key]) for k, v in groups.items()}


def _log_log_axes(ax, xticks: Sequence[int], xlabel: str, ylabel: str, title: str) -> None:
    """log2 x axis with the measured points as ticks, log y axis, grid, legend outside on the right."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(xticks, [str(x) for x in xticks])
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))


def plot_cache_vs_seqlen(rows: Sequence[Mapping], out_png: str | Path, title: Optional[str] = None) -> Path:
    """Cache MiB (``measured_bytes``, else ``formula_bytes``) vs ``seq_len`` per ``variant``, log-scale y."""
    fig = _new_figure()
    ax = fig.add_subplot()
    for variant, rs in _group(rows, "seq_len").items():
        xs = [r["seq_len"] for r in rs]
        ys = [r.get("measured_bytes", r.get("formula_bytes")) / MIB for r in rs]
        ax.plot(xs, ys, marker="o", label=variant)
        ax.annotate(f"{ys[-1]:.3g}", (xs[-1], ys[-1]), textcoords="offset points", xytext=(4, 0), fontsize=7,
                    va="center")
    _log_log_axes(ax, sorted({r["seq_len"] for r in rows}), "sequence length (tokens)", "KV cache (MiB, log scale)",
                  title or "KV cache size vs sequence length")
    return _save(fig, out_png)


def plot_decode_times(rows: Sequence[Mapping], out_png: str | Path, title: Optional[str] = None) -> Path:
    """Per-token decode step time (``median_ms``, with the ``p25_ms``–``p75_ms`` band when present) vs ``ctx`` per
    ``variant``; log2 x axis, log y axis."""
    fig = _new_figure()
    ax = fig.add_subplot()
    for variant, rs in _group(rows, "ctx").items():
        xs = [r["ctx"] for r in rs]
        ys = [r["median_ms"] for r in rs]
        (line,) = ax.plot(xs, ys, marker="o", label=variant)
        if all("p25_ms" in r and "p75_ms" in r for r in rs):
            ax.fill_between(xs, [r["p25_ms"] for r in rs], [r["p75_ms"] for r in rs], color=line.get_color(),
                            alpha=0.15, linewidth=0)
    _log_log_axes(ax, sorted({r["ctx"] for r in rows}), "context length (cached tokens)",
                  "decode step time (ms, median, log scale)", title or "Per-token decode step time vs context")
    return _save(fig, out_png)


def _to_float(x) -> float:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return math.nan
    return v


def read_metric_csv(path: str | Path, column: str = "val_loss", step_column: str = "step") -> list[tuple[float, float]]:
    """``(step, value)`` pairs of a Lightning ``CSVLogger`` ``metrics.csv`` where both are finite numbers.

    Rows logging other metrics (empty cells) and files without the columns give no pairs; when ``step`` is
    absent the row index is used."""
    out = []
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        if not reader.fieldnames or column not in reader.fieldnames:
            return []
        for i, row in enumerate(reader):
            y = _to_float(row.get(column))
            x = _to_float(row.get(step_column)) if step_column in reader.fieldnames else float(i)
            if math.isfinite(x) and math.isfinite(y):
                out.append((x, y))
    return sorted(out)


def _run_label(path: Path) -> str:
    parts = [p for p in path.parent.parts[-2:] if p not in ("", ".")]
    return "/".join(parts) or path.stem


def plot_val_loss(csv_paths: Sequence[str | Path], out_png: str | Path, labels: Optional[Sequence[str]] = None,
                  title: Optional[str] = None) -> Path:
    """Validation loss vs step, one line per ``metrics.csv`` (label: ``labels[i]`` or the run's directories).
    Missing files, missing columns and NaN/empty rows are skipped; a figure is written even if nothing is left."""
    fig = _new_figure()
    ax = fig.add_subplot()
    plotted = 0
    for i, p in enumerate(csv_paths):
        p = Path(p)
        pts = read_metric_csv(p) if p.is_file() else []
        if not pts:
            print(f"plot_val_loss: no val_loss values in {p}", file=sys.stderr)
            continue
        label = labels[i] if labels is not None and i < len(labels) else _run_label(p)
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="." if len(pts) < 50 else None, label=label)
        plotted += 1
    if plotted:
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no val_loss values", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss")
    ax.set_title(title or "Validation loss", fontsize=9)
    ax.grid(True, alpha=0.3)
    return _save(fig, out_png)


def plot_quality_vs_cache(points: Sequence[Mapping], out_png: str | Path, title: Optional[str] = None) -> Path:
    """Validation loss vs cache bytes per token (log x), one annotated point per ``{variant, val_loss,
    cache_bytes_per_token}``; points with a missing or non-finite value are skipped."""
    fig = _new_figure()
    ax = fig.add_subplot()
    good = [p for p in points if math.isfinite(_to_float(p.get("val_loss")))
            and _to_float(p.get("cache_bytes_per_token")) > 0]
    for p in good:
        x, y = float(p["cache_bytes_per_token"]), float(p["val_loss"])
        ax.scatter([x], [y], s=30)
        ax.annotate(str(p.get("variant", "?")), (x, y), textcoords="offset points", xytext=(5, 4), fontsize=8)
    if not good:
        ax.text(0.5, 0.5, "no points", ha="center", va="center", transform=ax.transAxes)
    else:
        ax.set_xscale("log")
    ax.set_xlabel("KV cache bytes per token (log scale)")
    ax.set_ylabel("validation loss")
    ax.set_title(title or "Quality vs cache size", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    return _save(fig, out_png)


def plot_report(json_path: str | Path) -> Path:
    """Redraw the PNG of a ``verify_memory`` or ``bench_decode`` JSON report next to it."""
    json_path = Path(json_path)
    report = json.loads(json_path.read_text())
    tool = report.get("tool", "")
    title = report.get("title")  # each tool writes its title into its JSON
    if tool.endswith("verify_memory"):
        return plot_cache_vs_seqlen(report["rows"], json_path.with_suffix(".png"), title=title)
    if tool.endswith("bench_decode"):
        return plot_decode_times(report["results"], json_path.with_suffix(".png"), title=title)
    raise ValueError(f"{json_path}: not a verify_memory or bench_decode report (tool={tool!r})")


if __name__ == "__main__":
    for p in sys.argv[1:]:
        print(plot_report(p))
