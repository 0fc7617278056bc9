"""Checks of a method's or selector's constructor arguments (which may come from a hand-edited plan file, a CLI or
Python): each raises a one-line ``ValueError`` naming the argument, what it must be and what it got, so every door
(the CLIs turn it into ``PROG: error: ...``) refuses the same values before any work.

Integers must be ``int`` (not ``bool``, not ``2.5``, not ``"3"``) within ``[lo, hi]``; the upper bounds are sane
limits (no cache holds 2^30 tokens; BalanceKV halving 2^40 times never ends), not tuning choices.
"""

from __future__ import annotations

import math
from typing import Any, Optional

__all__ = ["MAX_TOKENS", "bool_arg", "choice_arg", "float_arg", "int_arg"]

MAX_TOKENS = 1 << 30
"""Upper bound of any token count (a window, a budget, sinks, a block)."""


def int_arg(name: str, value: Any, lo: int = 0, hi: int = MAX_TOKENS, *, optional: bool = False) -> Optional[int]:
    """``value`` as an integer in ``[lo, hi]`` (``None`` passes when ``optional``)."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer in [{lo}, {hi}], got {value!r}")
    if not lo <= value <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {value}")
    return int(value)


def float_arg(name: str, value: Any, lo: float = 0.0, hi: float = math.inf, *, lo_open: bool = True,
              inf_ok: bool = False) -> float:
    """``value`` as a number ``> lo`` (``>= lo`` unless ``lo_open``) and ``<= hi``; finite unless ``inf_ok``
    (``+inf`` only); never NaN."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    v = float(value)
    if math.isnan(v) or (math.isinf(v) and not (inf_ok and v > 0)):
        raise ValueError(f"{name} must be a finite number{' or inf' if inf_ok else ''}, got {value!r}")
    if v < lo or (lo_open and v == lo) or v > hi:
        raise ValueError(f"{name} must be {'>' if lo_open else '>='} {lo:g}{f' and <= {hi:g}' if hi < math.inf else ''}"
                         f", got {value!r}")
    return v


def bool_arg(name: str, value: Any) -> bool:
    """``value`` as ``True`` / ``False`` (not 0 / 1 / ``"yes"``)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")
    return value


def choice_arg(name: str, value: Any, choices: tuple) -> Any:
    """``value`` when it is one of ``choices``."""
    if value not in choices or (isinstance(value, bool) and not any(c is value for c in choices)):  # True == 1
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")
    return value
