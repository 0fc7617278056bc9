"""The results writer: ``results/<study>[_<tag>].{json,md,png}``, each JSON carrying the run's header (command,
machine, revision: :mod:`benchmarks.harness.header`), written whole or not at all (a temporary sibling renamed into
place)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Union

from benchmarks.harness.paths import RESULTS, portable

__all__ = ["result_stem", "write_figure", "write_markdown", "write_result"]


def result_stem(study: str, tag: str = "", out_dir: Union[str, Path, None] = None) -> Path:
    """``OUT_DIR/<study>[_<tag>]`` (default ``results/``), without a suffix: the stem of a study's three files."""
    return Path(out_dir if out_dir is not None else RESULTS) / f"{study}{'_' + tag if tag else ''}"


def write_result(stem: Path, data: dict, header: Optional[dict] = None) -> Path:
    """``stem.json``: ``header``'s keys (command, machine, revision) first, then ``data`` (whose own keys win); this
    machine's paths named as the repository names them (:func:`~benchmarks.harness.paths.portable`)."""
    from kvsplice.io.write import write_json  # (the library and torch: only when a result is written)

    path = Path(stem).with_suffix(".json")
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_json(portable({**(header or {}), **data}), path)


def write_markdown(stem: Path, text: str) -> Path:
    """``stem.md`` (a trailing newline added when missing; paths as in :func:`write_result`)."""
    from models.checkpoint import atomic_write

    path = Path(stem).with_suffix(".md")
    path.parent.mkdir(parents=True, exist_ok=True)
    text = portable(text)
    atomic_write(path, lambda tmp: Path(tmp).write_text(text if text.endswith("\n") else text + "\n"))
    return path


def write_figure(stem: Path, fig: Any, **savefig: Any) -> Path:
    """``stem.png`` from a matplotlib figure."""
    from models.checkpoint import atomic_write

    path = Path(stem).with_suffix(".png")
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", **savefig))
    return path
