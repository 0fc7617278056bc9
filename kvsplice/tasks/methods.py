"""Method specs for the task evaluation: a string → the factory that builds the method for a prompt — the one
module where ``eval_tasks`` reads its ``--plan`` / ``--method`` arguments.

Every spec :func:`kvsplice.build_method` reads (``int8``, ``kivi4``, ``kivi4h(residual=32)``,
``select:observed_attention@x4.19+int8``, ``select:kvzip@x4+int8``, ``lowrank:FILE+int8``, a ``.json`` spec file;
see :mod:`kvsplice.core.short_form`) is one, plus::

    full                                   the full K/V cache
    plan:PATH                              a plan from kvsplice plan

Each spec is read once: a spec or plan file is opened once (a ``.json`` file holding a plan is checked to be this
model's — :meth:`kvsplice.planning.spec.Plan.check_model`, the check ``generate`` and ``eval_bases`` make), the
files it names (low-rank bases) are read once, and its values are checked by one build before any prompt. A method
that does not depend on the prompt (no ``keep`` fraction, no re-reading) is that one build for every prompt; the
others are built once per prompt, from the ids they compress (KVzip re-reads them: ``prompt_ids=``,
``tokenizer=``). A selection keeps ``ceil(KEEP · P)`` of the ``P`` tokens it compresses (as a plan does).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from kvsplice.core.method import CompressionMethod
from kvsplice.core.build import build_method, check_spec, needs_prompt, per_prompt
from kvsplice.core.short_form import format_spec, load_spec
from kvsplice.core.spec_files import JSON_SUFFIX, PLAN_PREFIX, loaded, spec_files
from kvsplice.core.spec_args import unique_keys

__all__ = ["MethodSpec", "method_specs", "parse_method"]


@dataclass
class MethodSpec:
    """A parsed spec: ``label`` and ``factory(ids (1, P)[, shared]) -> method | None`` (None: the full cache);
    ``shared``: a dict per compressed context, in which KVzip keeps its reconstruction scores for every budget."""

    spec: str
    label: str
    factory: Callable[..., Optional[CompressionMethod]]
    keep: float = 1.0  # the fraction of the compressed tokens a selection keeps
    files: tuple[Path, ...] = ()  # the files it reads: its spec or plan file and the files the spec names


def _named(spec: str, e: ValueError) -> str:
    """The registry's one-line error, naming ``spec`` when it does not already."""
    return str(e) if repr(spec) in str(e) else f"method {spec!r}: {e}"


def _per_prompt(d: Any) -> bool:
    """Whether the method of the dict spec ``d`` depends on the prompt it compresses: a ``keep`` fraction anywhere
    in it, or a method that re-reads the prompt."""
    if isinstance(d, dict):
        return "keep" in d or any(_per_prompt(v) for v in d.values())
    return False


def _factory(d: dict, base_dir: Optional[Path], tokenizer) -> Callable[..., Optional[CompressionMethod]]:
    """The factory of the checked dict spec ``d``: its files read once, its values checked by one build now."""
    spec = loaded(d, base_dir)
    first = build_method(spec, prompt_len=1, base_dir=base_dir)  # the constructors check the values now
    if not _per_prompt(d) and not needs_prompt(d):
        return lambda ids, shared=None: first  # the same method for every prompt: built once
    return per_prompt(lambda **ctx: build_method(spec, base_dir=base_dir, **ctx), tokenizer)


def _read_document(path: Path) -> Any:
    """A ``.json`` spec or plan file, read once (``None``: not readable as JSON — the spec reader says why)."""
    try:
        return json.loads(path.read_text(encoding="utf-8"), object_pairs_hook=unique_keys)
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return None


def _plan_method(arg: str, path: Path, tokenizer, model) -> MethodSpec:
    """A plan (``plan:PATH``) as a method of this model."""
    from kvsplice.planning.spec import Plan

    plan = Plan.load(path, model)
    if needs_prompt(plan.spec) and tokenizer is None:
        raise ValueError(f"method {arg!r}: {plan.label} re-reads its prompt and needs the model's tokenizer")
    keep = float(plan.spec.get("keep", 1.0)) if plan.selects else 1.0
    files = (path.expanduser().resolve(), *(p for _, p in spec_files(plan.spec, plan.base_dir)))
    spec = loaded(plan.spec, plan.base_dir)
    return MethodSpec(arg, f"plan {plan.label}", per_prompt(
        lambda **ctx: build_method(spec, base_dir=plan.base_dir, **ctx), tokenizer), keep, files)


def parse_method(spec: str, tokenizer=None, model=None) -> MethodSpec:
    """``spec`` (see the module docstring) → :class:`MethodSpec`; ``tokenizer``: the model's (KVzip encodes its
    reconstruction instruction with it); ``model``: a plan must have been made for it."""
    from kvsplice.planning.spec import PLAN_FORMAT

    spec = spec.strip()
    if spec == "full":
        return MethodSpec(spec, "full", lambda ids, shared=None: None)
    if spec.startswith(PLAN_PREFIX):
        return _plan_method(spec, Path(spec[len(PLAN_PREFIX):]), tokenizer, model)
    doc = None
    if spec.endswith(JSON_SUFFIX) and Path(spec).is_file():
        doc = _read_document(Path(spec))
        if isinstance(doc, dict) and doc.get("format") == PLAN_FORMAT and model is not None:
            from kvsplice.planning.spec import Plan

            Plan.from_doc(doc, Path(spec), model)  # a plan given as a spec file: this model's, as --plan
    try:
        if isinstance(doc, dict):  # the file read above: its spec, the folder its files are named from
            d, base_dir = (doc["spec"] if isinstance(doc.get("spec"), dict) else doc), Path(spec).resolve().parent
        else:
            d, base_dir = load_spec(spec)
        d = check_spec(d, base_dir=base_dir)
        if needs_prompt(d) and tokenizer is None:
            raise ValueError(f"{format_spec(d)} re-reads its prompt and needs the model's tokenizer")
        factory = _factory(d, base_dir, tokenizer)
    except ValueError as e:
        raise ValueError(_named(spec, e)) from None
    keep = float(d["keep"]) if "keep" in d else 1.0
    own = (Path(spec).expanduser().resolve(),) if base_dir is not None else ()  # a .json spec file
    return MethodSpec(spec, format_spec(d), factory, keep, (*own, *(p for _, p in spec_files(d, base_dir))))


def method_specs(plans: Sequence[str], methods: Sequence[str], tokenizer, model) -> dict[str, MethodSpec]:
    """``{spec: MethodSpec}`` of the full cache, the ``--plan`` files and the ``--method`` specs (a plan — by either
    option — must be this model's); a bad one is a one-line :class:`~kvsplice.io.cli.UsageError` naming the
    option."""
    from kvsplice.io.cli import UsageError

    specs = {"full": parse_method("full")}
    for p in plans:
        if not Path(p).is_file():
            raise UsageError(f"--plan file not found: {p}")
        specs[f"{PLAN_PREFIX}{p}"] = parse_method(f"{PLAN_PREFIX}{p}", tokenizer, model)
    for s in methods:
        if not s.strip():
            raise UsageError("--method is empty: give a method spec (e.g. int8, kivi4, select:snapkv@x4)")
        try:
            specs[s] = parse_method(s, tokenizer, model)
        except ValueError as e:
            raise UsageError(f"--method {e}") from None
    return specs
