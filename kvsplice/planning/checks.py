"""Checks of a plan file's JSON before anything in it is used (a plan may be hand-edited or hostile): each raises
a one-line ``ValueError`` that :meth:`kvsplice.planning.spec.Plan.load` reports as a ``PlanError`` naming the file.

* the stack's fields have their types (``keep`` a number in (0, 1], ``bits`` an integer, ``selector_kw`` an
  object of named arguments, ...); the values of the selector's and the stores' arguments are checked by their own
  constructors (:mod:`kvsplice.core.args`) when the plan's method is built;
* the search's evidence the plan carries is sane: ``budget`` numbers finite and > 0, ``prompt_len`` / ``seq_len``
  integers >= 1;
* the bases file is a plain name (or a relative path) inside the plan's folder: an absolute path or ``..`` is
  refused, never followed.
"""

from __future__ import annotations

import math
from pathlib import PurePosixPath, PureWindowsPath
from typing import Any

from kvsplice.core.args import float_arg, int_arg

__all__ = ["check_arguments", "check_bases_name", "check_evidence", "check_plan_doc", "check_stack_fields"]

_NUMBER, _INT, _STR, _OPT_STR = "number", "integer", "string", "string or null"
STACK_TYPES = {"store": _STR, "bits": _INT, "group": _INT, "residual": _INT, "lowrank_ratio": _NUMBER,
               "rope": _STR, "cache_quant": _OPT_STR, "selector": _OPT_STR, "keep": _NUMBER}


def _is(value: Any, kind: str) -> bool:
    if kind == _INT:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == _NUMBER:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == _STR:
        return isinstance(value, str)
    return value is None or isinstance(value, str)


def check_stack_fields(stack: Any) -> None:
    """The ``stack`` object: known fields of the right types, ``selector_kw`` an object, finite numbers."""
    if not isinstance(stack, dict):
        raise ValueError(f"stack must be an object, got {type(stack).__name__}")
    for name, value in stack.items():
        if name == "selector_kw":
            if not isinstance(value, dict):
                raise ValueError(f"stack.selector_kw must be an object of the selector's arguments, got {value!r}")
            continue
        kind = STACK_TYPES.get(name)
        if kind is None:
            raise ValueError(f"stack has an unknown field {name!r} (known: {', '.join([*STACK_TYPES, 'selector_kw'])})")
        if not _is(value, kind):
            raise ValueError(f"stack.{name} must be a {kind}, got {value!r}")
    if "lowrank_ratio" in stack:
        float_arg("stack.lowrank_ratio", stack["lowrank_ratio"], 1.0, lo_open=False)
    if "keep" in stack and not (math.isfinite(stack["keep"]) and 0 < stack["keep"] <= 1):
        raise ValueError(f"stack.keep must be in (0, 1], got {stack['keep']!r}")


def check_evidence(doc: dict) -> None:
    """The search's record: ``budget`` numbers finite and > 0; ``prompt_len`` / ``seq_len`` integers >= 1."""
    budget = doc.get("budget")
    if budget is not None:
        if not isinstance(budget, dict):
            raise ValueError(f"budget must be an object, got {budget!r}")
        for name in ("bytes_per_token", "ratio_vs_fp16_full", "full_fp16_bytes_per_token"):
            if name in budget:
                float_arg(f"budget.{name}", budget[name])
    for name in ("prompt_len", "seq_len"):
        if doc.get(name) is not None:
            int_arg(name, doc[name], 1)


def check_bases_name(name: Any) -> None:
    """The plan's ``bases``: a relative path inside the plan's folder (no absolute path, no ``..``)."""
    if name is None:
        return
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"bases must be the name of the bases file beside the plan, got {name!r}")
    for pure in (PurePosixPath(name), PureWindowsPath(name)):
        if pure.is_absolute() or pure.anchor or ".." in pure.parts:
            raise ValueError(f"bases {name!r} points outside the plan's folder; plans name their bases file beside "
                             f"them (e.g. plan.bases.safetensors)")


def check_plan_doc(doc: dict) -> None:
    """Every check above on a plan's JSON object (a version-1 plan's ``stack``; the spec of a version-2 plan is
    :func:`check_arguments`')."""
    if "stack" in doc:
        check_stack_fields(doc["stack"])
    check_evidence(doc)
    check_bases_name(doc.get("bases"))


def check_arguments(spec: dict, base_dir=None) -> None:
    """The plan's method spec checked before the model loads: its names and argument names
    (:func:`kvsplice.core.build.check_spec`), then its selector and every store that reads no file built once
    (their constructors check every argument: a selector's ``{"n_halvings": 1000000}`` is refused here, at load)."""
    from kvsplice.core.build import build_method, build_selector, check_spec
    from kvsplice.core.registry import METHODS

    spec = check_spec(spec, base_dir=base_dir)
    todo = [spec]
    while todo:
        d = todo.pop()
        if d.get("name") == "token_selection" and d.get("selector") is not None:
            keep = d.get("keep")
            if "keep" in d and (isinstance(keep, bool) or not isinstance(keep, (int, float))
                                or not 0.0 < keep <= 1.0):
                raise ValueError(f"keep must be a fraction of the prompt in (0, 1], got {keep!r}")
            build_selector(d["selector"])
            if isinstance(d.get("store"), dict):
                todo.append(d["store"])
        elif not getattr(METHODS.get(d.get("name")), "spec_files", ()):
            build_method(d, prompt_len=1)
