"""A study's report as data: the ``report:`` and ``figure:`` sections of its YAML, rendered from its rows by the runner.

``report: {title, intro, columns, by, titles, missing, drop_empty, footer, rows}`` — a markdown table (of the rows, or
of the summary's field ``rows`` names: per-variant statistics) whose ``columns`` map a header to a cell template
(``"{decode_ms:.1f}"``, ``"**{ratio:.2f}**"``, ``"{cache_bytes!M:.1f}"``: ``!M`` is bytes in MiB, ``!y`` a flag as
yes/no; a bare key is formatted by :func:`fmt`); a cell whose field is missing or None reads ``missing`` (default
``-``); ``drop_empty``: a column no row fills is left out. With ``by``, one table per value of that field that
``titles`` names (``## TITLE`` above each, a template); ``columns`` may then map each part to its own. ``title``,
``intro`` (a template, or a list: the paragraphs whose fields are there), the headers and ``footer`` (below the tables)
are templates over the run's settings, notes and summary. ``figure: {x, y, series, panels, xlog, ylog, hline, xlabel,
ylabel, title, size, where, kind, markers, front}`` — one line plot per panel (the distinct values of the ``panels``
fields), a line per ``series``, over the rows matching ``where``; ``kind: scatter``: see :func:`scatter`.
"""

from __future__ import annotations

import math
import string
from typing import Any, Mapping, Optional, Sequence, Union

__all__ = ["cell", "columns", "figure", "fmt", "intro", "markdown", "scatter", "table", "tables"]

Columns = Union[Sequence[str], Mapping[str, str]]


def fmt(v: Any) -> str:
    """One markdown cell of a value with no template: ``-`` for none, ``yes``/``no``, grouped ints, 3-4 digits."""
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        a = abs(v)
        if a == 0:
            return "0"
        if a < 1e-2:
            return f"{v:.1e}"
        if a < 10:
            return f"{v:.3f}"
        return f"{v:.1f}" if a < 1000 else f"{v:,.0f}"
    return str(v).replace("|", "\\|").replace("\n", " ")


class _Cells(string.Formatter):
    """``str.format`` over a row where ``!M`` divides by 2**20, ``!y`` reads yes / no and a None field is missing
    (a ``KeyError``, as an absent one)."""

    def get_value(self, key, args, kwargs):
        value = kwargs.get(key) if isinstance(key, str) else args[key]
        if value is None:
            raise KeyError(key)
        return value

    def convert_field(self, value, conversion):
        if conversion == "y":  # a flag as yes / no
            return "yes" if value else "no"
        return value / 2**20 if conversion == "M" else super().convert_field(value, conversion)


_CELLS = _Cells()


def cell(template: str, row: Mapping[str, Any], missing: str = "-") -> str:
    """``template`` filled from ``row`` (``missing`` where a field it names, or an item of one, is missing or None)."""
    try:
        return _CELLS.vformat(template, (), row).replace("|", "\\|")
    except KeyError:
        return missing


def table(rows: Sequence[dict], columns: Columns, missing: str = "-") -> list[str]:
    """A markdown table of ``rows``: ``columns`` as header -> template, or as keys (those some row has; every field
    but ``section`` when none is given)."""
    if not rows:
        return []
    if isinstance(columns, Mapping):
        heads, cells = list(columns), [lambda r, t=t: cell(t, r, missing) for t in columns.values()]
    else:
        heads = [c for c in columns if any(c in r for r in rows)]
        heads = heads or [c for c in dict.fromkeys(c for r in rows for c in r) if c != "section"]
        cells = [lambda r, c=c: fmt(r.get(c)) for c in heads]
    out = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    return out + ["| " + " | ".join(f(r) for f in cells) + " |" for r in rows] + [""]


def tables(rows: Sequence[dict], columns: Mapping[str, Columns], titles: Mapping[str, str],
           key: str = "section", missing: str = "-") -> list[str]:
    """A :func:`table` per part of ``titles`` that has rows (their ``key`` field), under ``## TITLE``; ``columns``
    per part (a part without its own uses ``columns["*"]`` if given)."""
    out = []
    for name, title in titles.items():
        got = [r for r in rows if r.get(key) == name]
        cols = columns.get(name, columns.get("*", []))
        out += [f"## {title}", "", *table(got, cols, missing)] if got else []
    return out


def columns(spec: Mapping[str, Any], rows: Sequence[dict], values: Mapping[str, Any]) -> Columns:
    """``spec``'s columns, their headers filled from ``values``; with ``drop_empty``, those some row fills only."""
    cols = spec["columns"]
    if not isinstance(cols, Mapping):
        return cols
    keep = [h for h, t in cols.items() if not spec.get("drop_empty") or any(cell(t, r, "") for r in rows)]
    return {h.format_map(values): cols[h] for h in keep}


def markdown(spec: Mapping[str, Any], rows: Sequence[dict], values: Optional[Mapping[str, Any]] = None) -> str:
    """The report ``spec`` (a study's ``report:``) of ``rows``; ``values`` fill its title, intro and footer."""
    values = values or {}
    rows = values[spec["rows"]] if spec.get("rows") else rows  # a table of the summary's rows (statistics)
    lines = [f"# {spec['title'].format_map(values)}", ""] if spec.get("title") else []
    lines += intro(spec.get("intro"), values)
    cols, missing = spec["columns"], spec.get("missing", "-")
    if spec.get("by"):
        part = isinstance(cols, Mapping) and not any(isinstance(c, str) for c in cols.values())  # part -> columns
        titles = {k: t.format_map(values) for k, t in spec["titles"].items()}  # templates, as the title
        lines += tables(rows, cols if part else {"*": columns(spec, rows, values)}, titles, spec["by"], missing)
    else:
        lines += table(rows, columns(spec, rows, values), missing)
    lines += [spec["footer"].format_map(values).strip()] if spec.get("footer") else []
    return "\n".join(lines)


def intro(text: Union[None, str, Sequence[str]], values: Mapping[str, Any]) -> list[str]:
    """``text`` filled from ``values``, a paragraph; a list of templates: a paragraph each, left out where a field it
    names is missing."""
    out = []
    for t in ([text] if isinstance(text, str) else text) if text else []:
        try:
            out += [t.format_map(values).strip(), ""]
        except KeyError:
            if isinstance(text, str):
                raise
    return out


def figure(spec: Mapping[str, Any], rows: Sequence[dict]):
    """The line plots ``spec`` (a study's ``figure:``) of ``rows``: one panel per value of its ``panels`` fields
    (``size``: a panel's inches; ``ylog: symlog``: linear within ±1, log beyond)."""
    import matplotlib.pyplot as plt

    rows = [r for r in rows if all(r.get(k) == v for k, v in spec.get("where", {}).items())]
    keys = list(spec.get("panels", []))
    panels = list(dict.fromkeys(tuple(r.get(k) for k in keys) for r in rows)) or [()]
    w, h = spec.get("size", (4.5, 4))
    fig, axes = plt.subplots(1, len(panels), figsize=(w * len(panels), h), squeeze=False, dpi=110)
    for ax, panel in zip(axes[0], panels):
        got = [r for r in rows if tuple(r.get(k) for k in keys) == panel]
        if spec.get("kind") == "scatter":
            scatter(ax, spec, got)
        else:
            for name in dict.fromkeys(r.get(spec["series"]) for r in got):
                pts = sorted((r[spec["x"]], r[spec["y"]]) for r in got if r.get(spec["series"]) == name)
                ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=str(name))
        if spec.get("hline") is not None:
            ax.axhline(spec["hline"], color="grey", lw=0.8)
        if spec.get("xlog"):
            ax.set_xscale("log", base=spec["xlog"])
        if spec.get("ylog") == "symlog":
            ax.set_yscale("symlog", linthresh=1)
        elif spec.get("ylog"):
            ax.set_yscale("log", base=spec["ylog"])
        ax.set_title(spec.get("title") or ", ".join(f"{k} {v}" for k, v in zip(keys, panel)), fontsize=9)
        ax.set_xlabel(spec.get("xlabel", spec["x"]))
        ax.set_ylabel(spec.get("ylabel", spec["y"]))
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    return fig


def scatter(ax, spec: Mapping[str, Any], rows: Sequence[dict]) -> None:
    """``kind: scatter``: the rows as points, a marker per ``series`` (``markers``: series → marker, in that order
    first); ``front: {field, label}``: a dashed line through the rows whose ``field`` is set (a Pareto front)."""
    marks = spec.get("markers") or {}
    for name in dict.fromkeys([*marks, *(r.get(spec["series"]) for r in rows)]):
        pts = [(r[spec["x"]], r[spec["y"]]) for r in rows if r.get(spec["series"]) == name]
        if pts:
            ax.scatter([x for x, _ in pts], [y for _, y in pts], marker=marks.get(name, "o"), label=str(name))
    if spec.get("front"):
        pts = sorted((r[spec["x"]], r[spec["y"]]) for r in rows if r.get(spec["front"]["field"]))
        ax.plot([x for x, _ in pts], [y for _, y in pts], "k--", lw=1, label=spec["front"]["label"])
    ax.grid(True, which="both", alpha=0.3)
