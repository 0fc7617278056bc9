"""The two amounts of compression a user gives, declared once: a **times smaller** ratio (``plan --ratio``, ``to-mla
--ratio``, ``fit-bases --alloc-ratio``: the full K/V cache divided by it, a finite number > 1 and at most
:data:`MAX_TIMES_SMALLER`) and a **kept fraction** (``to-mla --kvsplice-keep``: the part of a latent kept, a finite
number in (0, 1)). "Ratio" never means a kept fraction: ``--ratio 0.25`` where 4x was meant is refused, saying so.

Each comes as an argparse type (:func:`times_smaller`, :func:`times_fewer`, :func:`kept_fraction`: the parser's
error names the option, one line) and as a library check naming the option (:func:`check_times_smaller`,
:func:`check_kept_fraction`: one ``ValueError`` line).
"""

from __future__ import annotations

import argparse
import math
from typing import Any

__all__ = ["MAX_TIMES_SMALLER", "check_kept_fraction", "check_times_smaller", "kept_fraction", "times_fewer",
           "times_smaller"]

MAX_TIMES_SMALLER = 1e6
"""The largest ratio a command takes: far beyond any cache a selection of 1/64 of the prompt over 2-bit codes
reaches (a ratio of 1e9 asks for a billionth of a byte per token)."""

_SMALLER = "times smaller than the full K/V cache; <= 1 keeps it whole or larger"
_FEWER = "times fewer numbers per token than the full K/V cache; 1 keeps every dimension"
_KEPT = "the kept fraction of the latent"


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(value)
    return float(value)


def _ratio_error(value: Any, allow_one: bool) -> str:
    low, what = (">= 1", _FEWER) if allow_one else ("> 1", _SMALLER)
    return f"must be {low}, finite and at most {MAX_TIMES_SMALLER:g} ({what}), got {value}"


def _ratio(value: Any, allow_one: bool) -> float:
    """``value`` as a ratio, or ``ValueError(message)`` (the message without the option's name)."""
    try:
        v = _number(value)
    except ValueError:
        raise ValueError(_ratio_error(value, allow_one)) from None
    if not (math.isfinite(v) and (v >= 1 if allow_one else v > 1) and v <= MAX_TIMES_SMALLER):
        raise ValueError(_ratio_error(value, allow_one))
    return v


def _fraction(value: Any) -> float:
    try:
        v = _number(value)
    except ValueError:
        v = math.nan
    if not (math.isfinite(v) and 0.0 < v < 1.0):
        raise ValueError(f"must be in (0, 1) ({_KEPT}), got {value}")
    return v


def _argtype(check, *args):
    def parse(text: str) -> float:
        try:
            return check(text, *args)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return parse


times_smaller = _argtype(_ratio, False)
"""argparse type: a ratio > 1 (times smaller than the full K/V cache), finite, at most :data:`MAX_TIMES_SMALLER`."""
times_smaller.__name__ = "times_smaller"
times_fewer = _argtype(_ratio, True)
"""argparse type: a ratio >= 1 (times fewer numbers per token; 1 keeps every dimension), finite, bounded."""
times_fewer.__name__ = "times_fewer"
kept_fraction = _argtype(_fraction)
"""argparse type: a kept fraction, finite, in (0, 1)."""
kept_fraction.__name__ = "kept_fraction"


def check_times_smaller(option: str, value: Any, *, allow_one: bool = False) -> float:
    """``value`` as a ratio (> 1; ``allow_one``: >= 1), else one ``ValueError`` line naming ``option``."""
    try:
        return _ratio(value, allow_one)
    except ValueError as e:
        raise ValueError(f"{option} {e}") from None


def check_kept_fraction(option: str, value: Any) -> float:
    """``value`` as a kept fraction in (0, 1), else one ``ValueError`` line naming ``option``."""
    try:
        return _fraction(value)
    except ValueError as e:
        raise ValueError(f"{option} {e}") from None
