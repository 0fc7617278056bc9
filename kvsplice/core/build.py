"""Methods and selectors from a **spec** (:func:`build_method`, :func:`build_selector`), checked before a model
loads (:func:`check_spec`), and built per prompt for a method that re-reads it (:func:`needs_prompt`,
:func:`per_prompt`).

A spec is a dict: ``name`` plus the class's constructor arguments; an argument that is itself a method or a selector
(``TokenSelection``'s ``store`` and ``selector``) is a nested spec (a dict, or a string in the short form,
:mod:`kvsplice.core.short_form`)::

    build_method({"name": "token_selection", "selector": {"name": "observed_attention"}, "keep": 0.25,
                  "store": {"name": "dense", "cache_quant": "int8"}}, prompt_len=512)
    build_method("select:observed_attention@0.25+int8", prompt_len=512)     # the same, short form
    build_method("kivi4"); build_method("lowrank:r4.safetensors+int8", base_dir="plans/")
    method.spec()                                                            # a dict that rebuilds an equal method

A token selection takes ``budget`` (prompt tokens kept per KV head) or ``keep`` (a fraction of the prompt,
``budget = max(1, ceil(keep · prompt_len))``: it needs ``prompt_len`` when built). Files named by a spec (a
``LowRank``'s ``bases``) are read relative to ``base_dir`` (the folder of the plan / spec file); an in-memory object
(``KVBases``) may stand in their place. The constructors check the values.
Errors are one line (:class:`MethodSpecError`, a ``ValueError``) naming the known names.
"""

from __future__ import annotations

import inspect
import math
from pathlib import Path
from typing import Any, Callable, Optional, Union

from kvsplice.core.registry import ALIASES, SELECTORS, Spec, init_params, lookup, spec_params
from kvsplice.core.short_form import format_spec, parse_selector, parse_spec
from kvsplice.core.spec_args import MethodSpecError

__all__ = ["build_method", "build_selector", "check_spec", "needs_prompt", "per_prompt"]


def _shown(text: Any) -> str:
    """A spec as an error message shows it: its short form."""
    if isinstance(text, dict):
        try:
            return repr(format_spec(text))
        except Exception:  # noqa: BLE001  (a spec too broken to format)
            return repr(text)
    return repr(text)


def _as_dict(spec: Any, what: str) -> dict[str, Any]:
    if isinstance(spec, str):
        return parse_spec(spec)
    if not isinstance(spec, dict) or "name" not in spec:
        raise MethodSpecError(f"a {what} spec is a dict with a \"name\" or a short-form string, got {spec!r}")
    alias = ALIASES.get(spec["name"]) if what == "method" and isinstance(spec["name"], str) else None  # "int8"
    return dict(spec) if alias is None else {**alias, **{k: v for k, v in spec.items() if k != "name"}}


def _check_args(cls: type, kw: dict, text: Any, context: tuple[str, ...] = ()) -> None:
    """``kw`` against ``cls``'s spec arguments; ``context``: the prompt's own arguments (``spec_context``) given."""
    params = {**spec_params(cls), **{n: p for n, p in init_params(cls).items() if n in context}}
    takes_any = cls.__init__ is not object.__init__ and \
        any(p.kind == p.VAR_KEYWORD for p in inspect.signature(cls.__init__).parameters.values())
    bad = [k for k in kw if k not in params and not takes_any]
    if bad:
        raise MethodSpecError(f"{cls.name} takes {', '.join(params) or 'no arguments'}; got {', '.join(bad)} "
                              f"(in {_shown(text)})")
    missing = [n for n, p in params.items() if p.default is inspect.Parameter.empty and n not in kw]
    if missing:
        raise MethodSpecError(f"{cls.name} needs {', '.join(missing)} (in {_shown(text)})")


def build_selector(spec: Spec) -> Any:
    """A :class:`~kvsplice.select.selectors.TokenSelector` from its spec (a dict or ``NAME[(args)]``)."""
    if isinstance(spec, str):
        spec = parse_selector(spec)
    text = format_spec({"name": "token_selection", "selector": spec, "budget": "N"}) if isinstance(spec, dict) \
        and "name" in spec else spec
    kw = _as_dict(spec, "selector")
    cls = lookup(kw.pop("name"), _shown(text), SELECTORS)
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
    cls = lookup(kw.pop("name"), _shown(text))
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
    if "keep" in kw and "keep" not in init_params(cls):
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
    cls = lookup(kw.get("name"), _shown(spec))
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
    cls = lookup(kw.get("name"), _shown(spec))
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
            _check_args(lookup(sel["name"], _shown(spec), SELECTORS), {k: v for k, v in sel.items() if k != "name"}
                        if not isinstance(value, str) else {}, spec)
        else:
            args[arg] = check_spec(value, base_dir=base_dir)
    if "keep" in args and "keep" not in init_params(cls):
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
