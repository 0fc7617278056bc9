"""Command-line options declared once: a command's typed options dataclass is the declaration (each field's flag,
help, choices and parser in :func:`opt`), the parser is built from it (:func:`add_options`) and the parsed command
line becomes the dataclass (:func:`from_args`) — no second list of ``add_argument`` calls, no field-by-field mapping.

    @dataclass(frozen=True)
    class Opts:
        OPTION_GROUPS: ClassVar = (Exclusive(("budget", "ratio"), required=True),)
        model: str = opt(help="the model")                       # --model, required (no default)
        ratio: Optional[float] = opt(None, help="...", parse=times_smaller)
        tasks: tuple[str, ...] = opt(("passkey",), help="...")    # nargs="+", a tuple
        progress: bool = opt(True, flags=("--no-progress",), help="...")  # store_false
        seeds: int = count(10, hi=1000, help="...")               # in [1, 1000]: check_counts(self)

The flag is ``--`` + the field name with ``_`` → ``-`` unless ``flags`` are given (a flag without a dash is a
positional argument: ``opt(None, flags=("folder",), nargs="?", help=...)``); the type comes from the annotation
(``int``, ``float``, ``str``, ``Optional[X]``, ``tuple[X, ...]`` → ``nargs="+"``, ``bool`` → a switch) or from
``parse``; an option without a default is required; ``OPTION_GROUPS`` declares the mutually exclusive ones. Fields
are listed in ``--help`` as the class declares them, a base class's after the subclass's own.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from dataclasses import MISSING, dataclass
from typing import Any, Callable, Optional, Sequence, TypeVar, Union

__all__ = ["Exclusive", "add_options", "check_counts", "count", "defaults", "flags_of", "from_args", "option_fields",
           "opt"]

OPTION = "kvsplice.option"
"""The key of a field's metadata holding its command-line declaration."""
COUNT = "kvsplice.count"
"""The key of a :func:`count` field's metadata holding its bounds."""

T = TypeVar("T")


@dataclass(frozen=True)
class Exclusive:
    """Options of which at most one may be given (``required``: exactly one), by field name."""

    names: tuple[str, ...]
    required: bool = False


def opt(default: Any = MISSING, *, help: str, flags: Sequence[str] = (), choices: Optional[Sequence[Any]] = None,
        nargs: Optional[str] = None, metavar: Optional[str] = None, parse: Optional[Callable[[str], Any]] = None,
        cli: bool = True, repeat: bool = False) -> Any:
    """A dataclass field that is also a command-line option (keyword-only; ``default`` left out: required).
    ``help`` is shown as written (``%`` needs no escaping); ``parse``: the argparse type (one value's text to its
    value, ``argparse.ArgumentTypeError`` for a bad one); ``cli=False``: a library-only field; ``repeat``: a tuple
    given one value per flag (``--ckpt A --ckpt B``)."""
    if isinstance(default, (list, dict, set)):
        raise TypeError("an option's default must be immutable (a tuple, not a list)")
    meta = {"help": help, "flags": tuple(flags), "choices": None if choices is None else tuple(choices),
            "nargs": nargs, "metavar": metavar, "parse": parse, "cli": cli, "repeat": repeat}
    return dataclasses.field(default=default, kw_only=True, metadata={OPTION: meta})


def count(default: Any = MISSING, *, help: str, lo: int = 1, hi: Optional[int] = None, why: str = "",
          **kw: Any) -> Any:
    """:func:`opt` for a whole number (or each of a tuple of them) in ``[lo, hi]`` (``hi`` None:
    :data:`~kvsplice.core.args.MAX_TOKENS`; ``why``: what sets it), its bounds declared here and checked by
    :func:`check_counts` — not listed a second time in the class's checks."""
    f = opt(default, help=help, **kw)
    return dataclasses.field(default=f.default, kw_only=True, metadata={**f.metadata, COUNT: (lo, hi, why)})


def check_counts(options: Any) -> None:
    """Every :func:`count` field of ``options`` within its bounds, in declaration order (None passes: a count left
    out); else one ``ValueError`` line naming its flag (:func:`~kvsplice.core.limits.check_count`)."""
    from kvsplice.core.limits import check_count  # here: declaring options imports no torch

    for f in dataclasses.fields(options):
        if COUNT not in f.metadata or (value := getattr(options, f.name)) is None:
            continue
        lo, hi, why = f.metadata[COUNT]
        for v in value if isinstance(value, tuple) else (value,):
            check_count(flags_of(f)[0], v, lo, **({} if hi is None else {"hi": hi}), why=why)


def _unwrap(hint: Any) -> tuple[Any, bool]:
    """``(the type of one value, whether the option takes several)`` of a field's annotation."""
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return _unwrap(args[0])
        return str, False
    if origin in (tuple, list):
        args = [a for a in typing.get_args(hint) if a is not Ellipsis]
        return (args[0] if args else str), True
    return hint, False


def option_fields(cls: type, *, skip: Optional[type] = None) -> list[tuple[dataclasses.Field, Any]]:
    """``(field, annotation)`` of ``cls``'s command-line options in ``--help`` order: a class's own fields, then its
    bases' (``skip``: a base whose fields another front adds, e.g. :class:`~kvsplice.io.run_options.RunOptions`)."""
    hints = typing.get_type_hints(cls)
    by_name = {f.name: f for f in dataclasses.fields(cls)}
    skipped = {f.name for f in dataclasses.fields(skip)} if skip is not None else set()
    seen: list[str] = []
    for klass in cls.__mro__:
        for name in klass.__dict__.get("__annotations__", {}):
            if name in by_name and name not in seen and name not in skipped:
                seen.append(name)
    return [(by_name[n], hints[n]) for n in seen if by_name[n].metadata.get(OPTION, {}).get("cli")]


def flags_of(f: dataclasses.Field) -> tuple[str, ...]:
    """A field's flags: its own, else ``--`` + its name with ``_`` → ``-``."""
    return f.metadata[OPTION]["flags"] or ("--" + f.name.replace("_", "-"),)


def _default(f: dataclasses.Field) -> Any:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return MISSING


def _add(container: Any, f: dataclasses.Field, hint: Any, help: Optional[str], in_group: bool) -> None:
    m = f.metadata[OPTION]
    kind, several = _unwrap(hint)
    kind = str if kind is bool and m["parse"] else kind  # a bool with a parser takes a value (--x true), no switch
    default = _default(f)
    flags = flags_of(f)
    positional = not flags[0].startswith("-")  # argparse names a positional's dest by its one flag
    kw: dict[str, Any] = {"help": (help if help is not None else m["help"]).replace("%", "%%")}
    if positional:
        flags, kw["metavar"] = (f.name,), m["metavar"] or flags[0]
    else:
        kw["dest"] = f.name
    if kind is bool and not several:
        kw["action"] = "store_false" if default is True else "store_true"
        kw["default"] = bool(default) if default is not MISSING else False
    else:
        parse = m["parse"] or (kind if kind in (int, float) else None)
        if parse is not None:
            kw["type"] = parse
        for key in ("choices", "metavar"):
            if m[key] is not None:
                kw[key] = list(m[key]) if key == "choices" else m[key]
        nargs = m["nargs"] or ("+" if several and not m["repeat"] else None)
        if nargs is not None:
            kw["nargs"] = nargs
        elif m["repeat"]:
            kw["action"] = "append"
        if default is MISSING:
            if not in_group and not positional:
                kw["required"] = True
        else:
            kw["default"] = list(default) if isinstance(default, tuple) else default
    container.add_argument(*flags, **kw)


def add_options(parser: argparse.ArgumentParser, cls: type, *, skip: Optional[type] = None,
                help: Optional[dict[str, str]] = None, groups: Optional[dict[str, Any]] = None) -> None:
    """The arguments of ``cls``'s option fields (:func:`option_fields`; ``skip``: a base added by its own front),
    its ``OPTION_GROUPS`` as mutually exclusive groups; ``help``: a field's help for this command (``--force``
    says what it overwrites); ``groups``: argument groups (``parser.add_argument_group``) by field name."""
    help, groups = help or {}, groups or {}
    exclusive: dict[str, Any] = {}
    for g in getattr(cls, "OPTION_GROUPS", ()):
        box = parser.add_mutually_exclusive_group(required=g.required)
        exclusive.update({name: box for name in g.names})
    for f, hint in option_fields(cls, skip=skip):
        container = exclusive.get(f.name) or groups.get(f.name) or parser
        _add(container, f, hint, help.get(f.name), f.name in exclusive)


def _value(value: Any, hint: Any) -> Any:
    kind, several = _unwrap(hint)
    if several and isinstance(value, list):
        return tuple(value)
    return value


def from_args(cls: type[T], namespace: argparse.Namespace, **values: Any) -> T:
    """``cls`` built from a command line parsed by a parser with :func:`add_options` of it (``values``: fields
    given otherwise). Every option field of ``cls`` and its bases is read from ``namespace``."""
    got = {f.name: _value(getattr(namespace, f.name), hint) for f, hint in option_fields(cls)
           if hasattr(namespace, f.name)}
    return cls(**{**got, **values})  # type: ignore[call-arg]


def defaults(cls: type) -> dict[str, Any]:
    """Every field of ``cls`` that has a default, by name (the library's defaults, the command's too)."""
    return {f.name: d for f in dataclasses.fields(cls) if (d := _default(f)) is not MISSING}
