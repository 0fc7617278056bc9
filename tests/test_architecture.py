"""The package's shape, checked: no import cycle between modules, packages or kvsplice subpackages; no library
module over 500 lines; ``kvsplice/`` top level holds command-line tools and subpackages only."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("models", "kvsplice", "training", "data")


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The project module an import of ``name`` loads (the longest known prefix), or None for third-party."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        cand = ".".join(parts[:i])
        if cand in MODULES:
            return cand
    return None


def _edges() -> dict[str, set[str]]:
    """Module → project modules it imports anywhere in its body (function-level imports included)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for mod, path in MODULES.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative import
                    anchor = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                # ``from pkg import sub`` loads the module pkg.sub; ``from pkg import name`` loads pkg itself
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
            for t in targets:
                r = _resolve(t)
                if r is not None and r != mod:
                    graph[mod].add(r)
    return graph


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
def test_no_library_module_over_500_lines(pkg):
    long = {str(p.relative_to(ROOT)): n for m, p in MODULES.items() if m.split(".")[0] == pkg
            and (n := len(p.read_text().splitlines())) > 500}
    assert not long, long


def test_kvsplice_top_level_holds_only_the_compatibility_shims_of_commands():
    """``kvsplice/`` top level: subpackages, and one shim per verb (``python -m kvsplice.TOOL``) that runs
    :mod:`kvsplice.cli` — every command's code lives in ``kvsplice/cli/``."""
    from kvsplice.cli.main import VERBS

    top = ROOT / "kvsplice"
    for path in top.glob("*.py"):
        if path.name == "__init__.py":
            continue
        text = path.read_text()
        verb = path.stem.replace("_", "-")
        assert verb in VERBS and f'shim(__name__, "{verb}")' in text, f"{path.name} is not a command's shim"
        assert len(text.splitlines()) <= 6, f"{path.name}: a shim holds no code"
    for verb, v in VERBS.items():
        if v.module.startswith("kvsplice."):
            assert (top / "cli" / (v.module.rsplit(".", 1)[1] + ".py")).is_file(), verb
