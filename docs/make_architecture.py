"""The layer picture of docs/architecture.md, drawn from the real import graph.

``python docs/make_architecture.py`` reads the imports of every module under ``models/``, ``kvsplice/``,
``training/`` and ``data/`` with ``ast`` (nothing is imported, so it needs no torch and takes about a second), groups
the modules by folder (``kvsplice/select``, ``models/kernels``, ...), puts each folder on the lowest layer above
everything it imports, and writes ``docs/figures/architecture.png`` and beside it ``architecture_edges.txt``, the
folder-level edges as text (``tests/test_docs.py`` regenerates those and compares, so the picture cannot go stale).

``python docs/make_architecture.py --missing`` prints a table row for every library module that
docs/architecture.md does not name yet (its docstring's first sentence as the description), ready to paste.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("data", "models", "kvsplice", "training")
FIGURE = ROOT / "docs" / "figures" / "architecture.png"
EDGES = FIGURE.with_name("architecture_edges.txt")
DOC = ROOT / "docs" / "architecture.md"
COLOURS = {"data": "#d9ead3", "models": "#cfe2f3", "kvsplice": "#fff2cc", "training": "#f4cccc"}
MAX_DEPTH = 3  # folders deeper than pkg/sub/subsub are drawn with their parent (kvsplice/convert/engines/x -> engines)


def library_files(root: Path = ROOT) -> list[str]:
    """Every library module, as a repository-relative path (``kvsplice/select/kvzip.py``), sorted."""
    return sorted(p.relative_to(root).as_posix() for pkg in PACKAGES for p in (root / pkg).rglob("*.py")
                  if "__pycache__" not in p.parts)


def module_name(path: str) -> str:
    parts = path[:-3].split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def group_of(path: str) -> str:
    """The folder a module is drawn in: its package directory, at most MAX_DEPTH levels deep."""
    return "/".join(path.split("/")[:-1][:MAX_DEPTH])


def module_edges(root: Path = ROOT) -> dict[str, set[str]]:
    """Module path -> the library module paths it imports anywhere in its body (function-level imports too)."""
    files = library_files(root)
    by_name = {module_name(f): f for f in files}

    def resolve(name: str) -> str | None:
        parts = name.split(".")
        for i in range(len(parts), 0, -1):
            if ".".join(parts[:i]) in by_name:
                return by_name[".".join(parts[:i])]
        return None

    graph: dict[str, set[str]] = defaultdict(set)
    for f in files:
        mod, is_pkg = module_name(f), f.endswith("__init__.py")
        for node in ast.walk(ast.parse((root / f).read_text(encoding="utf-8"), f)):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative import
                    anchor = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in by_name else base for a in node.names]
            else:
                continue
            for t in targets:
                r = resolve(t)
                if r is not None and r != f:
                    graph[f].add(r)
    return graph


def group_edges(root: Path = ROOT) -> tuple[list[str], set[tuple[str, str]]]:
    """The folders and the folder-level import edges (importer, imported)."""
    groups = sorted({group_of(f) for f in library_files(root)})
    edges = {(group_of(a), group_of(b)) for a, bs in module_edges(root).items() for b in bs}
    return groups, {(a, b) for a, b in edges if a != b}


def layers(groups: list[str], edges: set[tuple[str, str]]) -> dict[str, int]:
    """Layer of each folder: 0 when it imports no other folder, else one above the highest folder it imports
    (an edge that would close a cycle is ignored: the architecture test keeps there being none)."""
    deps = defaultdict(set)
    for a, b in edges:
        deps[a].add(b)
    layer: dict[str, int] = {}
    visiting: set[str] = set()

    def visit(g: str) -> int:
        if g in layer:
            return layer[g]
        visiting.add(g)
        below = [visit(d) for d in sorted(deps[g]) if d not in visiting]
        visiting.discard(g)
        layer[g] = 1 + max(below) if below else 0
        return layer[g]

    for g in groups:
        visit(g)
    return layer


def edge_text(groups: list[str], edges: set[tuple[str, str]]) -> str:
    lay = layers(groups, edges)
    lines = ["# folder-level imports of the library (importer -> imported), made by docs/make_architecture.py",
             *[f"layer {lay[g]}: {g}" for g in sorted(groups, key=lambda g: (lay[g], g))],
             *[f"{a} -> {b}" for a, b in sorted(edges)]]
    return "\n".join(lines) + "\n"


def draw(groups: list[str], edges: set[tuple[str, str]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch

    lay = layers(groups, edges)
    rows = defaultdict(list)
    for g in sorted(groups, key=lambda g: (g.split("/")[0] != "models", g)):
        rows[lay[g]].append(g)
    n_rows, widest = max(rows) + 1, max(len(r) for r in rows.values())
    box_w, box_h, gap_x, gap_y = 2.3, 0.55, 0.25, 0.75
    width = widest * (box_w + gap_x)
    fig, ax = plt.subplots(figsize=(max(10.0, width * 0.62), n_rows * (box_h + gap_y) * 0.62 + 0.6))
    pos = {}
    for r, names in rows.items():
        start = (width - len(names) * (box_w + gap_x)) / 2
        for i, g in enumerate(names):
            pos[g] = (start + i * (box_w + gap_x) + gap_x / 2, r * (box_h + gap_y))
    for a, b in sorted(edges):
        (xa, ya), (xb, yb) = pos[a], pos[b]
        ax.annotate("", xy=(xb + box_w / 2, yb + box_h), xytext=(xa + box_w / 2, ya),
                    arrowprops=dict(arrowstyle="-|>", color="#888888", alpha=0.35, lw=0.7, shrinkA=0, shrinkB=0))
    for g, (x, y) in pos.items():
        ax.add_patch(FancyBboxPatch((x, y), box_w, box_h, boxstyle="round,pad=0.02,rounding_size=0.08",
                                    fc=COLOURS[g.split("/")[0]], ec="#444444", lw=0.8, zorder=3))
        label = g + ("/*.py" if g in PACKAGES else "/")  # a package's own modules, or a folder
        ax.text(x + box_w / 2, y + box_h / 2, label, ha="center", va="center", fontsize=8, zorder=4)
    for r in rows:
        ax.text(-0.2, r * (box_h + gap_y) + box_h / 2, f"layer {r}", ha="right", va="center", fontsize=8,
                color="#666666")
    ax.set_xlim(-1.4, width + 0.2)
    ax.set_ylim(-0.3, n_rows * (box_h + gap_y))
    ax.axis("off")
    ax.set_title("Library folders by import layer (arrows: imports, pointing down)", fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, metadata={"Software": None})
    plt.close(fig)


def missing_rows(doc: Path = DOC, root: Path = ROOT) -> list[str]:
    """A table row for each library module the doc does not name (its docstring's first sentence)."""
    text = doc.read_text(encoding="utf-8") if doc.exists() else ""
    rows = []
    for f in library_files(root):
        if f in text:
            continue
        first = (ast.get_docstring(ast.parse((root / f).read_text(encoding="utf-8"))) or "").split(". ")[0]
        rows.append(f"| `{f}` | {' '.join(first.split())[:110]} |")
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="make_architecture", description=__doc__.split("\n\n")[0])
    ap.add_argument("--missing", action="store_true", help="print rows for modules docs/architecture.md lacks")
    ap.add_argument("--out", type=Path, default=FIGURE, help="the PNG (the edge list is written beside it)")
    args = ap.parse_args(argv)
    if args.missing:
        print("\n".join(missing_rows()))
        return 0
    groups, edges = group_edges()
    args.out.with_name("architecture_edges.txt").parent.mkdir(parents=True, exist_ok=True)
    args.out.with_name("architecture_edges.txt").write_text(edge_text(groups, edges), encoding="utf-8")
    draw(groups, edges, args.out)
    print(f"wrote {args.out} and {args.out.with_name('architecture_edges.txt')} ({len(groups)} folders, "
          f"{len(edges)} edges)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
