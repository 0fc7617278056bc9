"""Methods and selectors by name: every :class:`~kvsplice.core.method.CompressionMethod` and every
:class:`~kvsplice.select.selectors.TokenSelector` subclass that sets ``name`` registers itself here (:func:`register`),
under one meaning per name; the short-form aliases (:data:`ALIASES`, e.g. ``int8``, ``kivi4``) stand for specs and are
never registered names. :func:`spec_of` gives an object's spec (its name and the constructor arguments away from
their defaults); :mod:`kvsplice.core.build` builds objects from specs, :mod:`kvsplice.core.short_form` reads the
command line's short form.

The built-in method and selector modules are imported on first use (:data:`BUILTIN_MODULES`, by name: the registry
sits below every method package — a new method module of the package goes into that list, which
``tests/kvsplice/core/test_registry.py`` checks); a method defined anywhere else registers when its module is imported.
"""

from __future__ import annotations

import importlib
import inspect
import re
from typing import Any, Optional, Union

from kvsplice.core.spec_args import MethodSpecError

__all__ = ["ALIASES", "BUILTIN_MODULES", "METHODS", "MethodSpecError", "SELECTORS", "Spec", "init_params",
           "known_names", "load_builtins", "lookup", "method_names", "register", "select_names", "selector_names",
           "spec_of", "spec_params"]

METHODS: dict[str, type] = {}
"""Method name → :class:`~kvsplice.core.method.CompressionMethod` subclass."""
SELECTORS: dict[str, type] = {}
"""Selector name → :class:`~kvsplice.select.selectors.TokenSelector` subclass."""

BUILTIN_MODULES = ("kvsplice.decode.dense", "kvsplice.decode.native", "kvsplice.lowrank.method",
                   "kvsplice.lowrank.joint", "kvsplice.select.method", "kvsplice.quant.method",
                   "kvsplice.online.method", "kvsplice.select.selectors", "kvsplice.select.scores",
                   "kvsplice.select.knorm", "kvsplice.select.expected", "kvsplice.quant.rotated",
                   "kvsplice.select.kvzip", "kvsplice.quant.prerope")

_ROT = (("", {}), ("h", {"rotate": True}))  # an alias's suffix h: the rows Hadamard-rotated
_KIVI_FORMS = (("", "kivi"), ("h", "kivi_rotated"), ("p", "kivi_prerope"))
ALIASES: dict[str, dict[str, Any]] = {"fp": {"name": "dense"}, "full": {"name": "dense"},
    **{f"int{b}{h}": {"name": "dense", "cache_quant": f"int{b}", **r} for b in (4, 8) for h, r in _ROT},
    **{f"k8v4{h}": {"name": "dense", "cache_quant": "int8", "value_quant": "int4", **r} for h, r in _ROT},
    **{f"kivi{b}{h}": {"name": n, "bits": b} for b in (2, 4, 8) for h, n in _KIVI_FORMS},
}
"""Short-form names that stand for a spec (never a registered name); a dict spec may name one too."""

Spec = Union[str, dict]


def register(kind: str, cls: type) -> None:
    """Register ``cls`` under ``cls.name`` (``kind``: ``"method"`` or ``"selector"``). One name, one meaning: a
    name taken by another class — of either kind, or an alias — is refused."""
    name = cls.__dict__["name"]
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]*", name):
        raise TypeError(f"{cls.__qualname__}.name must be a word (letters, digits, _ and -), got {name!r}")
    for table in (METHODS, SELECTORS):
        other = table.get(name)
        if other is not None and (other.__module__, other.__qualname__) != (cls.__module__, cls.__qualname__):
            raise TypeError(f"{cls.__module__}.{cls.__qualname__} cannot register as {name!r}: "
                            f"{other.__module__}.{other.__qualname__} has that name")
    if name in ALIASES:
        raise TypeError(f"{cls.__qualname__}.name {name!r} is a short-form alias")
    (METHODS if kind == "method" else SELECTORS)[name] = cls


def load_builtins() -> None:
    """Import the built-in method and selector modules (they register on import)."""
    for module in BUILTIN_MODULES:
        importlib.import_module(module)


def method_names() -> list[str]:
    load_builtins()
    return sorted(METHODS)


def selector_names() -> list[str]:
    load_builtins()
    return sorted(SELECTORS)


def known_names() -> list[str]:
    """Every name a method spec may give: the registered methods and the aliases."""
    return method_names() + sorted(ALIASES)


def select_names() -> list[str]:
    """What ``select:NAME@`` takes: the selectors and the selections that score by a pass of their own."""
    load_builtins()
    return selector_names() + sorted(n for n, c in METHODS.items() if getattr(c, "select_form", False))


def lookup(name: Any, shown: str, table: Optional[dict] = None) -> type:
    """The class registered as ``name`` in ``table`` (default: :data:`METHODS`); ``shown``: the spec as the error
    names it."""
    load_builtins()
    table = METHODS if table is None else table
    cls = table.get(name) if isinstance(name, str) else None
    if cls is None:
        kind, known = ("method", known_names()) if table is METHODS else ("selector", selector_names())
        raise MethodSpecError(f"unknown {kind} {name!r} in {shown}; known: {', '.join(known)}")
    return cls


def init_params(cls: type) -> dict[str, inspect.Parameter]:
    """The named constructor arguments of ``cls``."""
    if cls.__init__ is object.__init__:
        return {}
    sig = inspect.signature(cls.__init__)
    return {n: p for n, p in list(sig.parameters.items())[1:]
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def spec_params(cls: type) -> dict[str, inspect.Parameter]:
    """The constructor arguments a spec may give: all but the prompt's own (``spec_context``)."""
    context = getattr(cls, "spec_context", ())
    return {n: p for n, p in init_params(cls).items() if n not in context}


def spec_of(obj: Any) -> dict[str, Any]:
    """The spec of a method or selector: its ``name`` and every constructor argument whose value (the attribute of
    the same name) differs from the default; methods and selectors inside are nested specs, files a spec named are
    their resolved paths (``_spec_files``)."""
    files = getattr(obj, "_spec_files", {})
    out: dict[str, Any] = {"name": type(obj).name}
    for n, p in spec_params(type(obj)).items():
        if n in files:
            out[n] = files[n]
            continue
        if not hasattr(obj, n):
            raise TypeError(f"{type(obj).__name__} keeps no attribute {n!r} for its argument {n!r}: override spec()")
        v = getattr(obj, n)
        if hasattr(v, "spec") and callable(v.spec) and hasattr(type(v), "name"):
            out[n] = v.spec()
        elif p.default is inspect.Parameter.empty or not _same(v, p.default):
            out[n] = v
    return out


def _same(a: Any, b: Any) -> bool:
    try:
        return type(a) is type(b) and bool(a == b) or (a is b)
    except Exception:  # noqa: BLE001  (tensors and the like: not equal to a default)
        return False

