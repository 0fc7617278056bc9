"""Helpers shared by the docs tests: a markdown page's text outside code, its relative links, its headings' anchors,
and the links that lead nowhere."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
"""A markdown link or image; group 1 is its target."""


def outside_code(md: str) -> str:
    """``md`` without fenced blocks and inline code (commands, examples and links there are not prose or links)."""
    md = re.sub(r"```.*?```", "", md, flags=re.S)
    return re.sub(r"`[^`\n]*`", "", md)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (hyphens and underscores kept), spaces to '-'."""
    text = re.sub(r"`|\*\*|\*", "", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of the headings of the page ``path`` (headings inside fenced blocks are not headings)."""
    md = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", md, flags=re.M)}


def links(path: Path) -> list[str]:
    """The link and image targets of the page ``path``, outside code, in order."""
    return [m.group(1) for m in LINK.finditer(outside_code(path.read_text(encoding="utf-8")))]


def broken_links(doc: Path) -> list[str]:
    """The relative links of ``doc`` to no file in the repository, or to no heading of a markdown file, each with
    why (``missing.md (no file)``, ``#nope (no heading #nope in x.md)``); URLs with a scheme are not checked."""
    broken = []
    for target in links(doc):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        inside = file.is_relative_to(ROOT) or not doc.is_relative_to(ROOT)  # a test's own page may sit elsewhere
        if not inside or not file.exists():
            broken.append(f"{target} (no file)")
        elif fragment and file.suffix == ".md" and fragment not in anchors(file):
            broken.append(f"{target} (no heading #{fragment} in {file.name})")
    return broken
