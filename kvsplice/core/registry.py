"""Methods and selectors by name: every :class:`~kvsplice.core.method.CompressionMethod` and every
:class:`~kvsplice.select.selectors.TokenSelector` subclass that sets ``name`` registers itself here, and
:func:`build_method` builds any method — or stack — from a **spec**.

A spec is a dict: ``name`` plus the class's constructor arguments; an argument that is itself a method or a selector
(``TokenSelection``'s ``store`` and ``selector``) is a nested spec (a dict, or a string in the short form below)::

    build_method({"name": "token_selection", "selector": {"name": "observed_attention"}, "keep": 0.25,
                  "store": {"name": "dense", "cache_quant": "int8"}}, prompt_len=512)
    build_method("select:observed_attention@0.25+int8", prompt_len=512)     # the same, short form
    build_method("kivi4"); build_method("lowrank:r4.safetensors+int8", base_dir="plans/")
    method.spec()                                                            # a dict that rebuilds an equal method

A token selection takes ``budget`` (prompt tokens kept per KV head) or ``keep`` (a fraction of the prompt,
``budget = max(1, ceil(keep · prompt_len))``: it needs ``prompt_len`` when built). Files named by a spec (a
``LowRank``'s ``bases``) are read relative to ``base_dir`` (the folder of the plan / spec file); an in-memory object
(``KVBases``) may stand in their place. The constructors check the values.

**Short form** (the command line's ``--method``)::

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

The built-in method and selector modules are imported on first use (:data:`BUILTIN_MODULES`, by name: the registry
sits below every method package — a new method module of the package goes into that list, which
``tests/kvsplice/core/test_registry.py`` checks); a method defined anywhere else registers when its module is imported.
"""

from __future__ import annotations

import importlib
import inspect
import json
import math
import re
from pathlib import Path
from typing import Any, Callable, Optional, Union

from kvsplice.core.spec_args import MethodSpecError, args_of as _args, merge as _merge, unique_keys as _unique_keys

__all__ = ["ALIASES", "BUILTIN_MODULES", "METHODS", "MethodSpecError", "SELECTORS", "build_method", "parse_amount",
           "build_selector", "check_spec", "format_spec", "load_spec", "method_names", "needs_prompt",
           "parse_selector", "per_prompt", "parse_spec", "select_names", "register", "selector_names", "spec_of"]

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


def _load_builtins() -> None:
    for module in BUILTIN_MODULES:
        importlib.import_module(module)


def method_names() -> list[str]:
    _load_builtins()
    return sorted(METHODS)


def selector_names() -> list[str]:
    _load_builtins()
    return sorted(SELECTORS)


# ---------------------------------------------------------------------------------------------------- spec_of
def _params(cls: type) -> dict[str, inspect.Parameter]:
    """The named constructor arguments of ``cls``."""
    if cls.__init__ is object.__init__:
        return {}
    sig = inspect.signature(cls.__init__)
    return {n: p for n, p in list(sig.parameters.items())[1:]
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def _spec_params(cls: type) -> dict[str, inspect.Parameter]:
    """The constructor arguments a spec may give: all but the prompt's own (``spec_context``)."""
    context = getattr(cls, "spec_context", ())
    return {n: p for n, p in _params(cls).items() if n not in context}


def spec_of(obj: Any) -> dict[str, Any]:
    """The spec of a method or selector: its ``name`` and every constructor argument whose value (the attribute of
    the same name) differs from the default; methods and selectors inside are nested specs, files a spec named are
    their resolved paths (``_spec_files``)."""
    files = getattr(obj, "_spec_files", {})
    out: dict[str, Any] = {"name": type(obj).name}
    for n, p in _spec_params(type(obj)).items():
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


# -------------------------------------------------------------------------------------------------- the grammar
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
        _load_builtins()
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
                              f"select:SELECTOR@AMOUNT[+STORE] (methods: {', '.join(_known())})")
    name = m["name"]
    spec = dict(ALIASES[name]) if name in ALIASES else {"name": name}
    if m["file"]:
        files = getattr(METHODS.get(spec["name"]) or _lookup(spec["name"], text), "spec_files", ())
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


# ------------------------------------------------------------------------------------------------- building
def _known() -> list[str]:
    return method_names() + sorted(ALIASES)


def select_names() -> list[str]:
    """What ``select:NAME@`` takes: the selectors and the selections that score by a pass of their own."""
    _load_builtins()
    return selector_names() + sorted(n for n, c in METHODS.items() if getattr(c, "select_form", False))


def _shown(text: Any) -> str:
    """A spec as an error message shows it: its short form."""
    if isinstance(text, dict):
        try:
            return repr(format_spec(text))
        except Exception:  # noqa: BLE001  (a spec too broken to format)
            return repr(text)
    return repr(text)


def _lookup(name: Any, text: Any, table: Optional[dict] = None) -> type:
    _load_builtins()
    table = METHODS if table is None else table
    cls = table.get(name) if isinstance(name, str) else None
    if cls is None:
        kind, known = ("method", _known()) if table is METHODS else ("selector", selector_names())
        raise MethodSpecError(f"unknown {kind} {name!r} in {_shown(text)}; known: {', '.join(known)}")
    return cls


def _as_dict(spec: Any, what: str) -> dict[str, Any]:
    if isinstance(spec, str):
        return parse_spec(spec)
    if not isinstance(spec, dict) or "name" not in spec:
        raise MethodSpecError(f"a {what} spec is a dict with a \"name\" or a short-form string, got {spec!r}")
    alias = ALIASES.get(spec["name"]) if what == "method" and isinstance(spec["name"], str) else None  # "int8"
    return dict(spec) if alias is None else {**alias, **{k: v for k, v in spec.items() if k != "name"}}


def _check_args(cls: type, kw: dict, text: Any, context: tuple[str, ...] = ()) -> None:
    """``kw`` against ``cls``'s spec arguments; ``context``: the prompt's own arguments (``spec_context``) given."""
    params = {**_spec_params(cls), **{n: p for n, p in _params(cls).items() if n in context}}
    takes_any = cls.__init__ is not object.__init__ and \
        any(p.kind == p.VAR_KEYWORD for p in inspect.signature(cls.__init__).parameters.values())
    bad = [k for k in kw if k not in params and not takes_any]
    if bad:
        raise MethodSpecError(f"{cls.name} takes {', '.join(params) or 'no arguments'}; got {', '.join(bad)} "
                              f"(in {_shown(text)})")
    missing = [n for n, p in params.items() if p.default is inspect.Parameter.empty and n not in kw]
    if missing:
        raise MethodSpecError(f"{cls.name} needs {', '.join(missing)} (in {_shown(text)})")


def parse_selector(text: str) -> dict[str, Any]:
    """A selector's short form ``NAME[(KEY=VALUE,...)]`` → its dict spec (no check of the name)."""
    m = re.fullmatch(r"([A-Za-z][A-Za-z0-9_-]*)(?:\(([^()]*)\))?", text.strip())
    if not m:
        raise MethodSpecError(f"a selector is NAME[(KEY=VALUE,...)], got {text!r}")
    return {"name": m[1], **_args(m[2], text)}


def build_selector(spec: Spec) -> Any:
    """A :class:`~kvsplice.select.selectors.TokenSelector` from its spec (a dict or ``NAME[(args)]``)."""
    if isinstance(spec, str):
        spec = parse_selector(spec)
    text = format_spec({"name": "token_selection", "selector": spec, "budget": "N"}) if isinstance(spec, dict) \
        and "name" in spec else spec
    kw = _as_dict(spec, "selector")
    cls = _lookup(kw.pop("name"), text, SELECTORS)
    _check_args(cls, kw, text)
    return cls(**kw)


def build_method(spec: Spec, *, prompt_len: Optional[int] = None,
                 base_dir: Optional[Union[str, Path]] = None, prompt_ids: Any = None, tokenizer: Any = None) -> Any:
    """The :class:`~kvsplice.core.method.CompressionMethod` of ``spec`` (a dict or the short form; see the module
    docstring). ``prompt_len``: the prompt a ``keep`` fraction applies to; ``base_dir``: the folder relative file
    names are read from (default: the working directory). ``prompt_ids (B or 1, P)`` (it sets ``prompt_len``) and
    ``tokenizer``: the prompt being compressed, for a method that re-reads it (``spec_context``: KVzip); the others
    ignore them."""
    text = spec
    if prompt_ids is not None and prompt_len is None:
        prompt_len = int(prompt_ids.shape[-1])
    kw = _as_dict(spec, "method")
    cls = _lookup(kw.pop("name"), text)
    context = {"prompt_ids": prompt_ids, "tokenizer": tokenizer}
    bad = [n for n in getattr(cls, "spec_context", ()) if n in kw]
    if bad:
        raise MethodSpecError(f"{cls.name}'s {', '.join(bad)} come from the prompt, not from a spec: "
                              f"build_method(spec, prompt_ids=..., tokenizer=...) (in {_shown(text)})")
    files: dict[str, str] = {}
    for arg in getattr(cls, "spec_files", ()):
        value = kw.get(arg)
        if isinstance(value, (str, Path)):
            path = Path(value).expanduser()
            path = (Path(base_dir) / path if base_dir is not None and not path.is_absolute() else path).resolve()
            kw[arg] = cls.load_spec_file(arg, path)
            files[arg] = str(path)
    for arg, kind in getattr(cls, "spec_nested", {}).items():
        if arg in kw and kw[arg] is not None and not hasattr(kw[arg], "spec"):
            kw[arg] = build_selector(kw[arg]) if kind == "selector" else \
                build_method(kw[arg], prompt_len=prompt_len, base_dir=base_dir, prompt_ids=prompt_ids,
                             tokenizer=tokenizer)
    if "keep" in kw and "keep" not in _params(cls):
        kw = _keep_to_budget(kw, prompt_len, text)
    given = tuple(n for n in getattr(cls, "spec_context", ()) if context.get(n) is not None)
    kw.update({n: context[n] for n in given})
    _check_args(cls, kw, text, given)
    method = cls(**kw)
    if files:
        method._spec_files = files
    return method


def needs_prompt(spec: Any) -> bool:
    """Whether the method of ``spec`` (a spec or a built method) — or one inside it — re-reads the prompt it
    compresses (``spec_context``): build it per prompt, ``build_method(spec, prompt_ids=ids, tokenizer=tok)``."""
    if hasattr(spec, "spec") and callable(spec.spec) and not isinstance(spec, dict):
        spec = spec.spec()
    kw = _as_dict(spec, "method")
    cls = _lookup(kw.get("name"), spec)
    if getattr(cls, "spec_context", ()):
        return True
    return any(needs_prompt(kw[a]) for a, kind in getattr(cls, "spec_nested", {}).items()
               if kind == "method" and isinstance(kw.get(a), (dict, str)))


def per_prompt(build: Callable[..., Any], tokenizer=None) -> Callable[..., Any]:
    """``factory(ids (1, P), shared=None)`` of a method built by ``build(prompt_ids=, tokenizer=)`` for the ids it
    compresses; a method that keeps per-context work (``share_context(context)``: KVzip's reconstruction scores and its
    mixed-in selector's votes) keeps it in ``shared``, one dict per context — one pass per context for every
    budget and every method built for it."""

    def factory(ids: Any, shared: Optional[dict] = None) -> Any:
        method = build(prompt_ids=ids, tokenizer=tokenizer)
        if shared is not None and hasattr(method, "share_context"):
            method.share_context(shared)
        return method

    return factory


def check_spec(spec: Spec, *, base_dir: Optional[Union[str, Path]] = None) -> dict[str, Any]:
    """Check a spec without building it (before a model loads): its names, argument names and files (a missing
    one is a :class:`MethodSpecError`); the values are the constructors' to check. Returns the dict spec."""
    kw = _as_dict(spec, "method")
    cls = _lookup(kw.get("name"), spec)
    args = {k: v for k, v in kw.items() if k != "name"}
    for arg in getattr(cls, "spec_files", ()):
        value = args.get(arg)
        if isinstance(value, (str, Path)):
            path = Path(value).expanduser()
            path = Path(base_dir) / path if base_dir is not None and not path.is_absolute() else path
            if not path.is_file():
                raise MethodSpecError(f"{cls.name}'s {arg} file not found: {path}")
    for arg, kind in getattr(cls, "spec_nested", {}).items():
        value = args.get(arg)
        if value is None or hasattr(value, "spec"):
            continue
        if kind == "selector":
            sel = _as_dict(value, "selector") if not isinstance(value, str) else {"name": value.split("(")[0]}
            _check_args(_lookup(sel["name"], spec, SELECTORS), {k: v for k, v in sel.items() if k != "name"}
                        if not isinstance(value, str) else {}, spec)
        else:
            args[arg] = check_spec(value, base_dir=base_dir)
    if "keep" in args and "keep" not in _params(cls):
        if "budget" in args:
            raise MethodSpecError(f"give keep (a fraction of the prompt) or budget (tokens), not both (in {spec!r})")
        args["budget"] = args.pop("keep")
    _check_args(cls, args, spec)
    return kw


def _keep_to_budget(kw: dict, prompt_len: Optional[int], text: Any) -> dict:
    keep = kw.pop("keep")
    if "budget" in kw:
        raise MethodSpecError(f"give keep (a fraction of the prompt) or budget (tokens), not both (in {_shown(text)})")
    if isinstance(keep, bool) or not isinstance(keep, (int, float)) or not 0.0 < keep <= 1.0:
        raise MethodSpecError(f"keep must be a fraction of the prompt in (0, 1], got {keep!r} (in {_shown(text)})")
    if prompt_len is None:
        raise MethodSpecError(f"{_shown(text)} keeps a fraction of the prompt: build it with the prompt length "
                              f"(prompt_len=), or give budget= tokens")
    kw["budget"] = max(1, math.ceil(keep * int(prompt_len) - 1e-9))
    return kw
