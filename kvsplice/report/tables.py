"""Tables for the command-line tools and benchmarks: one markdown writer, one rich printer, one cell format."""

from __future__ import annotations

from typing import Callable, Optional, Sequence


def cell(x, fmt: str = "{:.3f}") -> str:
    """A table cell: ``x`` formatted with ``fmt``, or ``-`` for None (not measured)."""
    return "-" if x is None else fmt.format(x)


def markdown_table(title: str, head: Sequence[str], body: Sequence[Sequence[str]]) -> str:
    lines = [f"**{title}**", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    return "\n".join(lines)


def show_table(title: str, head: Sequence[str], body: Sequence[Sequence[str]], *, markdown: bool = False,
               **rich_kw) -> None:
    """The table as markdown (``markdown=True``) or as a rich table (``rich_kw``: ``caption``, ``row_style``)."""
    if markdown:
        print(markdown_table(title, head, body))
    else:
        print_rich_table(title, head, body, **rich_kw)


def print_rich_table(title: str, head: Sequence[str], body: Sequence[Sequence[str]], *, caption: Optional[str] = None,
                     row_style: Optional[Callable[[Sequence[str]], Optional[str]]] = None) -> None:
    """A rich table; first column left-aligned, the rest right-aligned. Piped or captured output is not squeezed
    into 80 columns."""
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title, caption=caption)
    for i, h in enumerate(head):
        t.add_column(h, justify="left" if i == 0 else "right")
    for row in body:
        t.add_row(*row, style=row_style(row) if row_style else None)
    console = Console()
    if not console.is_terminal:
        console = Console(width=max(console.width, 160))
    console.print(t)
