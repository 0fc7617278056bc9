"""The files a method spec names: what a run reads through a ``--method`` / ``--stores`` argument or a plan, so
that no output of the run may replace them (:mod:`kvsplice.io.inputs`).

A spec names files through its methods' ``spec_files`` arguments (a ``LowRank``'s ``bases``), nested specs
included (a selection's ``store``); a short form names them relative to the working directory, a spec file
(``--method spec.json``) and a plan relative to their own folder (as :func:`kvsplice.core.build.build_method`
reads them), and ``plan:P`` (``eval_tasks --method``) is the plan ``P``. Reading is lenient — a spec or file that
cannot be parsed names no file here — because the command's own checks refuse it before anything is written.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional, Union

from kvsplice.core.registry import ALIASES, METHODS, MethodSpecError, method_names
from kvsplice.core.short_form import parse_spec

__all__ = ["JSON_SUFFIX", "MAX_DOCUMENT_BYTES", "NamedFile", "PLAN_BASES", "PLAN_PREFIX", "argument_files",
           "document_files", "loaded", "rebased", "spec_file_names", "spec_files"]

PLAN_PREFIX = "plan:"
"""``plan:PATH``: a plan file given where a method spec goes (``eval_tasks --method``)."""
JSON_SUFFIX = ".json"
"""A spec argument ending so is a spec file (:func:`kvsplice.core.short_form.load_spec`)."""
PLAN_BASES = "bases"
"""A version-1 plan's field naming its bases file."""
MAX_DOCUMENT_BYTES = 1 << 24
"""A larger ``.json`` input is no spec or plan: it names no file (and is not read here)."""


def _resolve(value: Union[str, Path], base_dir: Optional[Path]) -> Path:
    """``value`` as :func:`~kvsplice.core.build.build_method` reads it: ``~`` expanded, relative to ``base_dir``."""
    path = Path(value).expanduser()
    return (base_dir / path if base_dir is not None and not path.is_absolute() else path).resolve()


NamedFile = tuple[str, Path]
"""``(argument, resolved path)`` of a file a spec names, e.g. ``("bases", Path("/plans/p.bases.safetensors"))``."""


def spec_file_names(spec: Any) -> list[tuple[str, str]]:
    """Every file name ``spec`` (a dict or the short form) gives for its methods' file arguments, nested specs
    included, as written: ``[(argument, name)]``, e.g. ``[("bases", "plan.bases.safetensors")]`` — the one walk of a
    spec's files (:func:`spec_files` resolves them; a plan checks them against its folder)."""
    method_names()  # the built-in methods registered: their spec_files / spec_nested
    out: list[tuple[str, str]] = []
    todo = [spec]
    while todo:
        d = todo.pop()
        if isinstance(d, str):
            try:
                d = parse_spec(d)
            except (MethodSpecError, RecursionError):
                continue
        if not isinstance(d, dict):
            continue
        cls = _class_of(d)
        for arg in getattr(cls, "spec_files", ()):
            value = d.get(arg)
            if isinstance(value, (str, Path)) and str(value).strip():
                out.append((arg, str(value)))
        nested = getattr(cls, "spec_nested", {})
        todo += [v for k, v in d.items() if isinstance(v, dict) or (nested.get(k) == "method" and isinstance(v, str))]
    return out


def spec_files(spec: Any, base_dir: Optional[Path] = None) -> list[NamedFile]:
    """Every file ``spec`` (a dict or the short form) names, nested specs included, with the argument naming it,
    resolved (:func:`spec_file_names`); ``base_dir``: the folder relative names are read from (default: the working
    directory)."""
    return [(arg, _resolve(name, base_dir)) for arg, name in spec_file_names(spec)]


def loaded(spec: dict, base_dir: Optional[Path] = None) -> dict:
    """A copy of the dict ``spec`` whose file arguments hold what the files hold (each read once, by its method's
    ``load_spec_file``): a spec built for many prompts reads its files once."""
    method_names()
    out = dict(spec)
    cls = _class_of(out)
    for arg in getattr(cls, "spec_files", ()):
        if isinstance(out.get(arg), (str, Path)) and str(out[arg]).strip():
            out[arg] = cls.load_spec_file(arg, _resolve(out[arg], base_dir))
    for k, v in out.items():
        if isinstance(v, dict):
            out[k] = loaded(v, base_dir)
        elif isinstance(v, str) and getattr(cls, "spec_nested", {}).get(k) == "method":
            try:
                out[k] = loaded(parse_spec(v), base_dir)
            except MethodSpecError:
                pass
    return out


def _class_of(d: dict) -> Any:
    """The registered class a dict spec names (an alias: the class it stands for), ``None`` when unknown."""
    name = d.get("name")
    named = ALIASES.get(name, {}).get("name", name) if isinstance(name, str) else None
    return METHODS.get(named) if isinstance(named, str) else None


def rebased(spec: dict, base_dir: Path) -> dict:
    """A copy of ``spec`` (read from a spec file in ``base_dir``) whose files are named relative to the working
    directory, as a short form names them: the same spec where a command reads files from the working directory
    (``plan --stores spec.json``)."""
    method_names()
    out = dict(spec)
    cls = _class_of(out)
    for arg in getattr(cls, "spec_files", ()):
        if isinstance(out.get(arg), (str, Path)) and str(out[arg]).strip():
            out[arg] = os.path.relpath(_resolve(out[arg], base_dir))
    for k, v in out.items():
        if isinstance(v, dict):
            out[k] = rebased(v, base_dir)
        elif isinstance(v, str) and getattr(cls, "spec_nested", {}).get(k) == "method":
            try:
                out[k] = rebased(parse_spec(v), base_dir)
            except MethodSpecError:
                pass
    return out


def document_files(path: Union[str, Path]) -> list[NamedFile]:
    """The files a spec file or a plan names (``[]`` for any other file): a version-1 plan's ``bases``, a
    document's ``spec`` (a version-2 plan), else the document itself as a spec — relative to its folder."""
    p = Path(path).expanduser()
    if p.suffix.lower() != JSON_SUFFIX or not p.is_file() or p.stat().st_size > MAX_DOCUMENT_BYTES:
        return []
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return []
    if not isinstance(doc, dict):
        return []
    folder = p.resolve().parent
    v1 = doc.get("bases")
    out = [(PLAN_BASES, _resolve(v1, folder))] if isinstance(v1, str) and v1.strip() else []
    return out + spec_files(doc["spec"] if isinstance(doc.get("spec"), dict) else doc, folder)


def argument_files(text: str) -> tuple[Optional[Path], list[NamedFile]]:
    """A method-spec argument's files: the document it is (a ``.json`` spec file or ``plan:PATH``; ``None`` for a
    short form or inline JSON) and the files it names (:func:`document_files` / :func:`spec_files`)."""
    if text.startswith(PLAN_PREFIX) or text.endswith(JSON_SUFFIX):
        path = Path(text[len(PLAN_PREFIX):] if text.startswith(PLAN_PREFIX) else text).expanduser()
        return (path.resolve(), document_files(path)) if path.is_file() else (None, [])
    return None, spec_files(text)
