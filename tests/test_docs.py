"""The docs are a map, checked: docs/architecture.md names every library module and shows the import layers as
they are; docs/ stays small (<= 100k characters, no page over 20k), each page leads with a table or figure; no issue
numbers, history or machine paths in docs/, README.md or results/; every relative link resolves; docs/reference.md
lists every verb of ``kvsplice --help`` and every name of the Python API; every docs/ page the code cites exists."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from doc_links import broken_links, outside_code
from docs import make_architecture as mk

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
PAGES = sorted(DOCS.glob("*.md"))
MAX_TOTAL, MAX_PAGE = 100_000, 20_000


# --- (a) every library module is on the map ------------------------------------------------------------------------

def test_architecture_names_every_library_module():
    text = (DOCS / "architecture.md").read_text(encoding="utf-8")
    missing = [f for f in mk.library_files() if f not in text]
    assert not missing, ("docs/architecture.md does not name these library modules (add them to its concept table; "
                         "`python docs/make_architecture.py --missing` prints rows to paste):\n  " + "\n  ".join(missing))


def test_architecture_names_no_module_that_is_gone():
    files = set(mk.library_files())
    text = outside_code((DOCS / "architecture.md").read_text(encoding="utf-8")) + " ".join(
        re.findall(r"`([^`\n]*)`", (DOCS / "architecture.md").read_text(encoding="utf-8")))
    named = set(re.findall(r"\b(?:models|kvsplice|training|data)/[\w/]*\.py\b", text))
    assert not named - files, f"docs/architecture.md names modules that do not exist: {sorted(named - files)}"


# --- (b) small docs, each page a table first -----------------------------------------------------------------------

def test_docs_are_small():
    sizes = {p.name: len(p.read_text(encoding="utf-8")) for p in PAGES}
    total = sum(sizes.values())
    over = {name: n for name, n in sizes.items() if n > MAX_PAGE}
    assert total <= MAX_TOTAL, f"docs/ holds {total:,} characters (at most {MAX_TOTAL:,}): {sizes}"
    assert not over, f"pages over {MAX_PAGE:,} characters: {over} (split by what the user does, or point to results/)"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_page_leads_with_a_table_or_figure(page):
    first = next(line for line in page.read_text(encoding="utf-8").splitlines()
                 if line.strip() and not line.startswith("#"))
    assert first.startswith(("|", "![")), f"{page.name} opens with prose: {first[:80]!r}"


# --- (c) what is, not what happened --------------------------------------------------------------------------------

ISSUE = re.compile(r"\bissues?\s*#?\d+|(?<![\w&/\]#])#\d+\b|\bthe issue\b|\bthe issue's\b", re.I)
NARRATION = re.compile(
    r"\b20\d\d-\d\d-\d\d\b|\b(?:this|that|last|previous|an earlier|the earlier|earlier) (?:session|version|build|"
    r"attempt|pick)s?\b|\bre-(?:made|measured|timed)\b|\bused to\b|\bformerly\b|\bpreviously\b|"
    r"\b(?:was|were)\b|\bbefore\s*/\s*after\b|\bbefore → after\b", re.I)


def _hits(pattern: re.Pattern, path: Path) -> list[str]:
    name = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    out = []
    for n, line in enumerate(outside_code(path.read_text(encoding="utf-8")).splitlines(), 1):
        for m in pattern.finditer(line):
            out.append(f"{name}: {m.group(0)!r} in {line.strip()[:90]!r}")
    return out


def test_narration_check_catches_history(tmp_path):
    md = tmp_path / "x.md"
    md.write_text("| a |\n\nFixed in issue 41 (#41), re-made on 2026-11-27; the pick was 3x. `was` in code is fine.\n")
    found = " ".join(_hits(ISSUE, md) + _hits(NARRATION, md))
    for word in ("issue 41", "#41", "re-made", "2026-11-27", "was"):
        assert repr(word) in found, word
    assert found.count("'was'") == 1


@pytest.mark.parametrize("path", [README, *PAGES], ids=lambda p: p.name)
def test_no_issue_numbers_or_history(path):
    hits = _hits(ISSUE, path) + _hits(NARRATION, path)
    assert not hits, ("say what is, in the present tense, without issue numbers or history:\n  " + "\n  ".join(hits))


# --- (d) no machine paths in what ships ----------------------------------------------------------------------------

MACHINE = re.compile(r"(?<![\w.$}])/(?:work|tmp|root|home)/|pytest-of-")


def _shipped_text_files() -> list[Path]:
    files = [README, *DOCS.rglob("*")]
    files += [p for p in (ROOT / "results").rglob("*")]
    return sorted(p for p in files if p.is_file() and p.suffix in (".md", ".json", ".txt", ".csv", ".py", ".yaml"))


def test_machine_path_check_catches_one():
    assert MACHINE.search('"model": "/tmp/s260k/hf"') and MACHINE.search("in /work/main/x")
    assert MACHINE.search("tmp/pytest-of-root/x") and not MACHINE.search("../shared/data/x $TMPDIR/x a/tmp/b")


def test_no_machine_paths():
    hits = []
    for path in _shipped_text_files():
        for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if MACHINE.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:100]}")
    assert not hits, ("name paths relative to the repository (../shared/data/..., checkpoints/...) or as placeholders "
                      "($TMPDIR, $OUT):\n  " + "\n  ".join(hits[:40]) + (f"\n  ... {len(hits)} in all" if len(hits) > 40
                                                                               else ""))


# --- (e) links resolve -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("doc", [README, *PAGES], ids=lambda p: p.name)
def test_relative_links_resolve(doc):
    assert not broken_links(doc), f"{doc.relative_to(ROOT)}: broken links: {broken_links(doc)}"


def test_link_check_catches_a_broken_link(tmp_path):
    md = tmp_path / "x.md"
    md.write_text("| t |\n\n# Title\n\n[a](missing.md) [c](#title) [d](#nope) `[e](code.md)`\n")
    broken = broken_links(md)
    assert len(broken) == 2 and broken[0] == "missing.md (no file)" and broken[1].startswith("#nope (no heading")


CITED = re.compile(r"\bdocs/([\w-]+\.md)")


def test_every_docs_page_the_code_cites_exists():
    cited = {}
    for folder in ("models", "kvsplice", "training", "data", "benchmarks", "configs"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in (".py", ".yaml") and path.is_file():
                for name in CITED.findall(path.read_text(encoding="utf-8")):
                    cited.setdefault(name, []).append(path.relative_to(ROOT).as_posix())
    gone = {name: files for name, files in cited.items() if not (DOCS / name).is_file()}
    assert not gone, f"code cites docs pages that do not exist: {gone}"


# --- (f) the picture is the import graph -----------------------------------------------------------------------------

def test_architecture_picture_is_up_to_date():
    groups, edges = mk.group_edges()
    written = mk.EDGES.read_text(encoding="utf-8")
    assert written == mk.edge_text(groups, edges), (
        "docs/figures/architecture_edges.txt differs from the import graph: run `python docs/make_architecture.py` "
        "and commit the PNG and the edge list")
    assert mk.FIGURE.is_file() and mk.FIGURE.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "figures/architecture.png" in (DOCS / "architecture.md").read_text(encoding="utf-8")


def test_layers_put_every_folder_above_what_it_imports():
    groups, edges = mk.group_edges()
    layer = mk.layers(groups, edges)
    assert {"models", "data", "kvsplice/core", "kvsplice/cli", "training"} <= set(groups)
    back = sorted((a, b) for a, b in edges if layer[a] <= layer[b])
    assert not back, f"folder-level imports that point back up (a cycle between folders): {back}"
    assert layer["models"] < layer["kvsplice/core"] < layer["kvsplice/cli"]


# --- (g) the reference lists the front door and the API --------------------------------------------------------------

def _exports() -> list[str]:
    tree = ast.parse((ROOT / "kvsplice" / "__init__.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_EXPORTS" for t in node.targets):
            return [k.value for k in node.value.keys]
    raise AssertionError("kvsplice/__init__.py has no _EXPORTS")


def test_reference_lists_every_verb_and_api_name():
    from kvsplice.cli.main import VERBS

    text = (DOCS / "reference.md").read_text(encoding="utf-8")
    verbs = [v for v in VERBS if f"`kvsplice {v}" not in text]
    names = [n for n in [*_exports(), "load_model", "Plan", "perplexity"] if f"`{n}`" not in text]
    assert not verbs, f"docs/reference.md lacks the verbs {verbs} (a row `kvsplice VERB ...` each)"
    assert not names, f"docs/reference.md lacks the Python API names {names}"
