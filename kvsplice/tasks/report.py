"""Summaries of task results: accuracy per task and length beside the full cache's, and each method's cache bytes.

``results`` is what ``kvsplice eval-tasks`` writes under ``"results"``: ``{setting: {instance key: {method
spec: outcome dict}}}``. :func:`summarize` gives per (setting, method) the mean score per ``task/length`` and overall,
the instances counted, and the mean bytes (measured, and at fp16 storage per compressed token, and the ratio to the
fp16 full cache); :func:`markdown` renders one table per setting.

A task and length the **full** cache answers less than :data:`REACH` % of the time is beyond the model itself: its
cells say nothing about compression. They are marked ``"beyond": True`` (``†`` in the tables), and every method's
``acc_within`` is its mean over the cells within the model's reach (``None`` when there are none).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Mapping, Sequence

__all__ = ["REACH", "markdown", "summarize"]

REACH = 90.0  # % the full cache must answer for a task/length to judge compression on it


def summarize(results: Mapping[str, Mapping[str, Mapping[str, dict]]], methods: Sequence[str]) -> dict[str, Any]:
    """``{setting: {method: {"cells": {"task/length": {"acc", "n"}}, "acc", "n", "bytes_per_token_fp16", "ratio",
    "cache_bytes", "seconds"}}}`` (accuracy in %; means over the finished instances)."""
    out: dict[str, Any] = {}
    for setting, by_inst in results.items():
        per: dict[str, Any] = {}
        for m in methods:
            cells: dict[str, list[float]] = defaultdict(list)
            fp16, full, meas, secs, cpu = [], [], [], [], []
            for key, outs in by_inst.items():
                o = outs.get(m)
                if o is None:
                    continue
                task, length, _ = key.split("/")
                cells[f"{task}/{length}"].append(o["score"])
                fp16.append(o["fp16_bytes"] / o["n_compressed"])
                full.append(o["full_fp16_bytes"] / o["n_compressed"])
                meas.append(o["cache_bytes"])
                secs.append(o["seconds"])
                cpu.append(o.get("cpu_seconds", 0.0))
            n = sum(len(v) for v in cells.values())
            if not n:
                continue
            per[m] = {"cells": {c: {"acc": 100 * sum(v) / len(v), "n": len(v)} for c, v in sorted(cells.items())},
                      "acc": 100 * sum(sum(v) for v in cells.values()) / n, "n": n,
                      "bytes_per_token_fp16": sum(fp16) / n, "ratio": sum(full) / max(sum(fp16), 1e-9),
                      "cache_bytes": sum(meas) / n, "seconds": sum(secs) / n, "cpu_seconds": sum(cpu) / n}
        full = per.get("full", {}).get("cells", {})
        for r in per.values():
            within = []
            for c, cell in r["cells"].items():
                cell["beyond"] = c in full and full[c]["acc"] < REACH
                if not cell["beyond"]:
                    within += [cell["acc"]] * cell["n"]
            r["acc_within"] = sum(within) / len(within) if within else None
        out[setting] = per
    return out


def markdown(summary: Mapping[str, Any], labels: Mapping[str, str]) -> str:
    """One table per setting: rows task/length (+ mean, bytes), columns the methods (the full cache first if run)."""
    lines: list[str] = []
    for setting, per in summary.items():
        if not per:
            continue
        methods = list(per)
        cells = sorted({c for m in methods for c in per[m]["cells"]})
        lines += [f"**{setting}** (accuracy %, exact match of the expected strings)", "",
                  "| task / length | " + " | ".join(labels.get(m, m) for m in methods) + " |",
                  "|---|" + "---|" * len(methods)]
        for c in cells:
            row = [f"{per[m]['cells'][c]['acc']:.0f} ({per[m]['cells'][c]['n']})" if c in per[m]["cells"] else "–"
                   for m in methods]
            beyond = any(per[m]["cells"].get(c, {}).get("beyond") for m in methods)
            lines.append(f"| {c}{' †' if beyond else ''} | " + " | ".join(row) + " |")
        lines.append("| **mean** | " + " | ".join(f"**{per[m]['acc']:.1f}**" for m in methods) + " |")
        marked = any(cell.get("beyond") for m in methods for cell in per[m]["cells"].values())
        if marked:
            lines.append("| **mean within reach** (rows without †) | " + " | ".join(
                "–" if per[m]["acc_within"] is None else f"**{per[m]['acc_within']:.1f}**" for m in methods) + " |")
        lines.append("| × smaller than fp16 full | " + " | ".join(f"{per[m]['ratio']:.2f}" for m in methods) + " |")
        lines.append("| bytes / token (fp16 storage) | " + " | ".join(f"{per[m]['bytes_per_token_fp16']:.0f}"
                                                                     for m in methods) + " |")
        lines.append("| s / instance (wall; CPU) | " + " | ".join(f"{per[m]['seconds']:.1f}; {per[m]['cpu_seconds']:.1f}"
                                                             for m in methods) + " |")
        lines.append("")
        if marked:
            lines += [f"† beyond the model: the full cache answers < {REACH:.0f} % — these rows say nothing about "
                      "compression.", ""]
    return "\n".join(lines)
