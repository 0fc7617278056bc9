"""The shape of an ``eval_tasks`` results file, checked before a resumed file is trusted (it may be hand-edited).

:func:`check_results_doc` raises a one-line ``ValueError`` naming the first field that is not as ``eval_tasks``
writes it: the header's recorded settings (:data:`HEADER_TYPES`), ``methods`` / ``method_files`` / ``instances``
objects of strings, ``results`` ``{setting: {"task/length/seed": {method: outcome}}}`` and every outcome's numbers
that the summary reads (``score`` a fraction in [0, 1], ``n_compressed`` an integer >= 1, byte counts and seconds
finite and >= 0).
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from kvsplice.tasks.instance import SETTINGS

__all__ = ["FORMAT", "HEADER_TYPES", "VERSION", "check_results_doc", "instance_key"]

FORMAT, VERSION = "kvsplice-eval-tasks", 2
"""``format`` and ``version`` of the file (version 1 recorded the model alone: it cannot be resumed)."""

_STR, _OPT_STR, _INT, _STR_LIST, _INT_LIST = "a string", "a string or null", "an integer", "a list of strings", \
    "a list of integers"
HEADER_TYPES: dict[str, str] = {"model_fingerprint": _STR, "tokenizer_fingerprint": _STR, "stories_digest": _OPT_STR,
                                "door": _STR, "dtype": _STR, "tasks": _STR_LIST, "lengths": _INT_LIST, "n": _INT,
                                "seed0": _INT, "settings": _STR_LIST}
"""The recorded settings of a run (:mod:`kvsplice.tasks.resume`) and their types."""
_COUNTS = ("cache_bytes", "fp16_bytes", "full_fp16_bytes", "seconds")  # numbers >= 0 the summary reads


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _has_type(v: Any, kind: str) -> bool:
    if kind == _STR:
        return isinstance(v, str)
    if kind == _OPT_STR:
        return v is None or isinstance(v, str)
    if kind == _INT:
        return _is_int(v)
    if kind == _STR_LIST:
        return isinstance(v, list) and all(isinstance(x, str) for x in v)
    return isinstance(v, list) and all(_is_int(x) for x in v)


def _str_map(doc: Mapping, name: str, depth: int = 1) -> None:
    """``doc[name]``: an object of strings (``depth`` 2: of objects of strings)."""
    v = doc.get(name)
    if not isinstance(v, dict) or not all(isinstance(k, str) for k in v):
        raise ValueError(f"{name} must be an object, got {type(v).__name__}")
    for k, x in v.items():
        if depth == 2:
            if not isinstance(x, dict) or not all(isinstance(a, str) and isinstance(b, str) for a, b in x.items()):
                raise ValueError(f"{name}[{k!r}] must be an object of strings, got {x!r}")
        elif not isinstance(x, str):
            raise ValueError(f"{name}[{k!r}] must be a string, got {x!r}")


def instance_key(key: str) -> tuple[str, int, int]:
    """``(task, length, seed)`` of an instance key ``task/length/seed``; a ``ValueError`` for any other string."""
    parts = key.split("/")
    if len(parts) != 3 or not parts[0] or not parts[1].isdigit() or not parts[2].lstrip("-").isdigit():
        raise ValueError(f"instance key {key!r} is not task/length/seed")
    return parts[0], int(parts[1]), int(parts[2])


def _check_outcome(o: Any, where: str) -> None:
    if not isinstance(o, dict):
        raise ValueError(f"{where} must be an object, got {type(o).__name__}")
    score = o.get("score")
    if "score" not in o:
        raise ValueError(f"{where} has no score")
    if not _is_number(score) or not 0.0 <= score <= 1.0:
        raise ValueError(f"{where}.score must be a fraction in [0, 1], got {score!r}")
    n = o.get("n_compressed")
    if not _is_int(n) or n < 1:
        raise ValueError(f"{where}.n_compressed must be an integer >= 1, got {n!r}")
    for name in _COUNTS + (("cpu_seconds",) if "cpu_seconds" in o else ()):
        v = o.get(name)
        if not _is_number(v) or v < 0:
            raise ValueError(f"{where}.{name} must be a finite number >= 0, got {v!r}")


def check_results_doc(doc: Any) -> None:
    """``doc`` (a parsed results file of :data:`FORMAT`) has the shape ``eval_tasks`` writes (see the module
    docstring); a ``ValueError`` naming the first field that has not."""
    if not isinstance(doc, dict):
        raise ValueError(f"the file holds {type(doc).__name__}, not an object")
    if doc.get("version") != VERSION:
        raise ValueError(f"version {doc.get('version')!r} (this eval_tasks writes version {VERSION}; version 1 files "
                         f"did not record the settings that produced them)")
    for name, kind in HEADER_TYPES.items():
        if name not in doc or not _has_type(doc[name], kind):
            raise ValueError(f"{name} must be {kind}, got {doc.get(name)!r}")
    _str_map(doc, "methods")
    _str_map(doc, "method_files", depth=2)
    _str_map(doc, "instances")
    results = doc.get("results")
    if not isinstance(results, dict):
        raise ValueError(f"results must be an object, got {type(results).__name__}")
    for setting, by_inst in results.items():
        if setting not in SETTINGS:
            raise ValueError(f"results has setting {setting!r}; settings are {', '.join(SETTINGS)}")
        if not isinstance(by_inst, dict):
            raise ValueError(f"results[{setting!r}] must be an object, got {type(by_inst).__name__}")
        for key, outs in by_inst.items():
            instance_key(key)
            if not isinstance(outs, dict):
                raise ValueError(f"results[{setting!r}][{key!r}] must be an object, got {type(outs).__name__}")
            for m, o in outs.items():
                _check_outcome(o, f"results[{setting!r}][{key!r}][{m!r}]")
