"""The package's shape, checked: no import cycle between modules, packages or kvsplice subpackages; no library
module over 400 lines; ``kvsplice/`` top level holds command-line tools and subpackages only."""

from __future__ import annotations

from collections import defaultdict

import pytest

from docs import make_architecture as mk

ROOT = mk.ROOT
PACKAGES = mk.PACKAGES
MODULES = {mk.module_name(f): ROOT / f for f in mk.library_files()}
"""Module name (``kvsplice.select.kvzip``) → its file, for every library module."""


def _edges() -> dict[str, set[str]]:
    """Module → project modules it imports anywhere in its body (function-level imports included), read by the
    same import-graph reader that draws docs/figures/architecture.png."""
    return {mk.module_name(a): {mk.module_name(b) for b in bs} for a, bs in mk.module_edges().items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` (as a path), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def _collapse(graph: dict[str, set[str]], key) -> dict[str, set[str]]:
    out: dict[str, set[str]] = defaultdict(set)
    for a, bs in graph.items():
        for b in bs:
            ka, kb = key(a), key(b)
            if ka != kb:
                out[ka].add(kb)
    return out


def _package_of(mod: str) -> str:
    """Package-level node; the package ``__init__`` of a parent re-exporting its children is not a cycle."""
    return mod.split(".")[0]


def _kvsplice_unit(mod: str) -> str:
    """kvsplice's subpackages and its top-level modules (CLIs) as units; other packages as a whole."""
    parts = mod.split(".")
    if parts[0] != "kvsplice":
        return parts[0]
    return ".".join(parts[:2]) if len(parts) > 1 else "kvsplice"


def test_the_checker_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}}) is None


def test_no_import_cycle_between_modules():
    assert _cycle(_edges()) is None


def test_no_import_cycle_between_packages():
    graph = _edges()
    # a package's __init__ may re-export from its own modules: edges within one package are not package edges
    assert _cycle(_collapse(graph, _package_of)) is None


def test_no_import_cycle_between_kvsplice_subpackages():
    graph = {a: bs for a, bs in _edges().items() if a != "kvsplice"}  # the top-level __init__ only re-exports
    assert _cycle(_collapse(graph, _kvsplice_unit)) is None


@pytest.mark.parametrize("pkg", PACKAGES)
def test_no_library_module_over_400_lines(pkg):
    long = {str(p.relative_to(ROOT)): n for m, p in MODULES.items() if m.split(".")[0] == pkg
            and (n := len(p.read_text().splitlines())) > 400}
    assert not long, long


def test_kvsplice_top_level_holds_only_subpackages():
    """``kvsplice/`` top level: ``__init__.py`` and subpackages — every command's code lives in ``kvsplice/cli/``,
    reached as ``kvsplice VERB`` (no ``kvsplice/TOOL.py`` module runs a verb another way)."""
    from kvsplice.cli.main import VERBS

    top = ROOT / "kvsplice"
    assert [p.name for p in top.glob("*.py")] == ["__init__.py"]
    for verb, v in VERBS.items():
        if v.module.startswith("kvsplice."):
            assert (top / "cli" / (v.module.rsplit(".", 1)[1] + ".py")).is_file(), verb
