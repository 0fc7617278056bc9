"""The short form of a method spec (the command line's ``--method``) and its inverse, :func:`format_spec`; a
``--method`` argument that names a ``.json`` spec file (:func:`load_spec`)::

    spec      := selection | method
    selection := "select:" selector "@" amount [ "+" method ]      the store defaults to full K/V (dense)
    selector  := NAME [ "(" args ")" ]                             select:snapkv(window=32)@64; or a selection
                                                                   that scores by its own pass: select:kvzip@x4
    amount    := INTEGER                                           budget: prompt tokens kept per KV head
               | DECIMAL | PERCENT                                 keep: a fraction of the prompt (0.25, 25%)
               | "x" RATIO                                         keep 1/RATIO of the prompt (x4 = 0.25)
    method    := NAME [ ":" FILE ] [ "(" args ")" ] [ "+int8" ]    lowrank:r4.safetensors+int8, kivi(bits=2)
    args      := KEY "=" VALUE { "," KEY "=" VALUE }               ints, floats, true/false/none, else strings

``:FILE`` is the class's first file argument (``bases``); ``+int8`` sets ``cache_quant="int8"``. Aliases
(:data:`ALIASES`): ``fp`` / ``full`` = dense, ``int8`` / ``int4`` = dense int8 / 4-bit rows, ``int8h`` / ``int4h``
= those rows Hadamard-rotated, ``k8v4`` / ``k8v4h`` = int8 keys and int4 values (rotated), ``kivi2`` / ``kivi4`` /
``kivi8`` = KIVI at those bits, ``kivi2h`` … = KIVI over Hadamard-rotated K/V (``kivi_rotated``), ``kivi2p`` … =
KIVI with keys quantised before RoPE (``kivi_prerope``); an alias takes arguments too (``kivi4(residual=32)``). A
FILE or VALUE may not contain ``+ ( ) , @``: use the dict form (a JSON file: ``--method spec.json``) for those.
Each argument is given once: a repeated key (``heads=pooled,heads=union``, a repeated JSON key), an alias's own
field (``kivi4(bits=2)``), ``NAME:FILE`` with the file argument again, ``+int8`` with ``cache_quant`` — and an empty
spec — are refused, never resolved by keeping the last.
Errors are one line (:class:`MethodSpecError`, a ``ValueError``) naming the known names.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Optional

from kvsplice.core.registry import (ALIASES, METHODS, SELECTORS, Spec, known_names, load_builtins, lookup,
                                    select_names)
from kvsplice.core.spec_args import MethodSpecError, args_of as _args, merge as _merge, unique_keys as _unique_keys

__all__ = ["format_spec", "load_spec", "parse_amount", "parse_selector", "parse_spec"]


_METHOD = re.compile(r"(?P<name>[A-Za-z][A-Za-z0-9_-]*)(?::(?P<file>[^+()@,]+))?(?:\((?P<args>[^()]*)\))?"
                     r"(?P<mods>(?:\+[A-Za-z0-9_]+)*)")
_SELECT = re.compile(r"select:(?P<sel>[A-Za-z][A-Za-z0-9_-]*)(?:\((?P<args>[^()]*)\))?@(?P<amount>x?[0-9.eE]+%?)"
                     r"(?:\+(?P<store>.+))?")


def parse_amount(s: str, text: str) -> dict[str, Any]:
    """A selection's amount (see the grammar) → ``{"budget": n}`` or ``{"keep": fraction}``."""
    try:
        if s.startswith("x"):
            return {"keep": 1.0 / float(s[1:])}
        if s.endswith("%"):
            return {"keep": float(s[:-1]) / 100}
        return {"budget": int(s)} if re.fullmatch(r"[0-9]+", s) else {"keep": float(s)}
    except (ValueError, ZeroDivisionError):
        raise MethodSpecError(f"{text!r}: after @ give a token budget (64), a fraction of the prompt (0.25 or 25%) "
                              f"or a ratio (x4), got {s!r}") from None


def parse_spec(text: str) -> dict[str, Any]:
    """The dict spec of the short form ``text`` (see the module docstring); a string starting with ``{`` is JSON."""
    if not isinstance(text, str) or not text.strip():
        raise MethodSpecError("the method spec is empty: give a method (e.g. int8, kivi4, select:snapkv@0.25+int8)")
    text = text.strip()
    if text.startswith("{"):
        try:
            spec = json.loads(text, object_pairs_hook=_unique_keys)
        except MethodSpecError:
            raise
        except ValueError as e:
            raise MethodSpecError(f"the method spec is not valid JSON: {str(e).splitlines()[0]}") from None
        if not isinstance(spec, dict):
            raise MethodSpecError("a JSON method spec is an object with a \"name\"")
        return spec
    m = _SELECT.fullmatch(text)
    if m:
        load_builtins()
        cls = None if m["sel"] in SELECTORS else METHODS.get(m["sel"])
        if getattr(cls, "select_form", False):  # a selection that scores by a pass of its own (kvzip)
            spec = _merge({"name": m["sel"], **_args(m["args"], text)}, parse_amount(m["amount"], text), text)
        else:
            spec = {"name": "token_selection", "selector": _merge({"name": m["sel"]}, _args(m["args"], text), text),
                    **parse_amount(m["amount"], text)}
        if m["store"]:
            spec = _merge(spec, {"store": _parse_method(m["store"], text)}, text)
        return spec
    if text.startswith("select:"):
        raise MethodSpecError(f"{text!r}: a selection is select:SELECTOR@AMOUNT[+STORE], e.g. "
                              f"select:snapkv@0.25+int8 (selectors: {', '.join(select_names())})")
    return _parse_method(text, text)


def _parse_method(part: str, text: str) -> dict[str, Any]:
    m = _METHOD.fullmatch(part.strip())
    if not m:
        raise MethodSpecError(f"{text!r} is not a method spec: NAME[:FILE][(KEY=VALUE,...)][+int8] or "
                              f"select:SELECTOR@AMOUNT[+STORE] (methods: {', '.join(known_names())})")
    name = m["name"]
    spec = dict(ALIASES[name]) if name in ALIASES else {"name": name}
    if m["file"]:
        files = getattr(METHODS.get(spec["name"]) or lookup(spec["name"], repr(text)), "spec_files", ())
        if not files:
            raise MethodSpecError(f"{text!r}: {spec['name']} takes no file (NAME:FILE is for "
                                  f"{', '.join(n for n, c in METHODS.items() if getattr(c, 'spec_files', ()))})")
        spec[files[0]] = m["file"].strip()
    spec = _merge(spec, _args(m["args"], text), repr(text))
    for mod in filter(None, m["mods"].split("+")):
        if mod != "int8":
            raise MethodSpecError(f"{text!r}: the only modifier is +int8 (int8 storage), got +{mod}")
        spec = _merge(spec, {"cache_quant": "int8"}, repr(text))
    return spec


def format_spec(spec: Spec) -> str:
    """The short form of a spec (the inverse of :func:`parse_spec` where the values allow it; objects such as
    in-memory bases print as ``<KVBases>``) — a label."""
    spec = parse_spec(spec) if isinstance(spec, str) else dict(spec)
    name = spec.pop("name", "?")
    own_pass = getattr(METHODS.get(name), "select_form", False)
    if name == "token_selection" or own_pass:
        sel = {"name": name} if own_pass else spec.pop("selector", {})
        sel = {"name": sel} if isinstance(sel, str) else dict(sel)
        if own_pass:
            sel.update({k: spec.pop(k) for k in list(spec) if k not in ("budget", "keep", "store")})
        amount = spec.pop("budget", None)
        amount = f"{spec.pop('keep'):g}" if amount is None and "keep" in spec else str(amount)
        store = spec.pop("store", None)
        sel_name = sel.pop("name", "?")
        head = f"select:{sel_name}{_fmt_args(sel)}@{amount}"
        if spec:
            head += _fmt_args(spec)
        return head if store is None else f"{head}+{format_spec(store)}"
    cls = METHODS.get(name)
    files = getattr(cls, "spec_files", ())
    out = name
    if files and files[0] in spec:
        f = spec.pop(files[0])
        out += f":{f}" if isinstance(f, (str, Path)) else f":<{type(f).__name__}>"
    quant = spec.pop("cache_quant", None)
    full = {"name": name, "cache_quant": quant, **{k: v for k, v in spec.items() if v}}
    alias = next((a for a, f in ALIASES.items() if f == full), None) if quant else None  # int8, int4h, k8v4h, …
    if alias:
        return alias
    if quant not in (None, "int8"):  # +int8 is the only modifier: another mode is an argument
        spec, quant = {"cache_quant": quant, **spec}, None
    out += _fmt_args(spec)
    return out + ("+int8" if quant == "int8" else "")


def _fmt_args(args: dict) -> str:
    def fmt(v):
        if isinstance(v, dict):
            return format_spec(v)
        return {True: "true", False: "false", None: "none"}.get(v, v) if isinstance(v, (bool, type(None))) else v

    return "" if not args else "(" + ",".join(f"{k}={fmt(v)}" for k, v in args.items()) + ")"


def load_spec(arg: str) -> tuple[dict[str, Any], Optional[Path]]:
    """A ``--method`` argument: a ``.json`` file holding a dict spec (its folder is returned as the ``base_dir`` of
    the files it names) or the short form / inline JSON."""
    path = Path(arg)
    if arg.endswith(".json"):
        if not path.is_file():
            raise MethodSpecError(f"method spec file not found: {arg}")
        try:
            spec = json.loads(path.read_text(encoding="utf-8"), object_pairs_hook=_unique_keys)
        except MethodSpecError as e:
            raise MethodSpecError(f"{arg}: {e}") from None
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise MethodSpecError(f"cannot read the method spec {arg}: {str(e).splitlines()[0]}") from None
        if isinstance(spec, dict) and isinstance(spec.get("spec"), dict):  # a document that carries a spec
            spec = spec["spec"]
        if not isinstance(spec, dict):
            raise MethodSpecError(f"{arg}: a method spec file holds a JSON object with a \"name\"")
        return spec, path.resolve().parent
    return parse_spec(arg), None



def parse_selector(text: str) -> dict[str, Any]:
    """A selector's short form ``NAME[(KEY=VALUE,...)]`` → its dict spec (no check of the name)."""
    m = re.fullmatch(r"([A-Za-z][A-Za-z0-9_-]*)(?:\(([^()]*)\))?", text.strip())
    if not m:
        raise MethodSpecError(f"a selector is NAME[(KEY=VALUE,...)], got {text!r}")
    return {"name": m[1], **_args(m[2], text)}

