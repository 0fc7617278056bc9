"""The arguments of a method spec's short form (``KEY=VALUE,...``) and the rule that each is given once.

``args_of`` reads ``KEY=VALUE`` pairs (ints, floats, true/false/none, else strings); :func:`merge` joins the parts of
a spec (an alias's own fields, ``NAME:FILE``'s file argument, ``+int8``, the amount after ``@``, the arguments in
parentheses) and :func:`unique_keys` reads JSON specs: an argument given twice is a :class:`MethodSpecError`, never
resolved by keeping the last (``heads=pooled,heads=union`` would silently be ``heads=union``).
"""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["MethodSpecError", "args_of", "merge", "unique_keys"]


class MethodSpecError(ValueError):
    """A spec that names no registered method, or gives it arguments it does not take; one line."""


def _value(s: str) -> Any:
    low = s.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for cast in (int, float):
        try:
            return cast(s)
        except ValueError:
            pass
    return s.strip()


def args_of(text: Optional[str], where: str) -> dict[str, Any]:
    """The arguments ``KEY=VALUE,...`` of ``text`` (``where``: the spec, for messages)."""
    out: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in (text or "").split(","))):
        key, eq, val = part.partition("=")
        if not eq or not key.strip():
            raise MethodSpecError(f"{where}: arguments are KEY=VALUE separated by commas, got {part!r}")
        out = merge(out, {key.strip(): _value(val)}, where)
    return out


def merge(spec: dict[str, Any], more: dict[str, Any], where: str) -> dict[str, Any]:
    """``spec`` with the arguments ``more``; an argument given twice (``heads=pooled,heads=union``, an alias's own
    field, ``NAME:FILE`` and the file's argument, ``+int8`` and ``cache_quant``) is refused."""
    twice = sorted(set(spec) & set(more))
    if twice:
        raise MethodSpecError(f"{where}: {', '.join(twice)} given twice; give each argument once")
    return {**spec, **more}


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads``' ``object_pairs_hook``: an object with a repeated key is refused (JSON keeps the last)."""
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise MethodSpecError(f"the method spec gives {k!r} twice; give each argument once")
        out[k] = v
    return out
