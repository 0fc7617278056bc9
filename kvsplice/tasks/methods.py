"""Method specs for the task evaluation: a string → the factory that builds the method for a prompt.

Every spec :func:`kvsplice.build_method` reads (``int8``, ``kivi4``, ``kivi4h(residual=32)``,
``select:observed_attention@x4.19+int8``, ``select:kvzip@x4+int8``, ``lowrank:FILE+int8``, a ``.json`` spec file;
see :mod:`kvsplice.core.registry`) is one, plus::

    full                                   the full K/V cache
    plan:PATH                              a plan from python -m kvsplice.plan

Each method is built per prompt, from the ids it compresses (KVzip re-reads them: ``prompt_ids=``, ``tokenizer=``).
A selection keeps ``ceil(KEEP · P)`` of the ``P`` tokens it compresses (as a plan does). Given the model, a plan —
``plan:PATH``, or a plan file given as a ``.json`` spec — is checked to be this model's
(:func:`kvsplice.planning.spec.check_plan_model`, the check ``generate`` and ``eval_bases`` make).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional


from kvsplice.core.method import CompressionMethod
from kvsplice.core.registry import build_method, check_spec, format_spec, load_spec, needs_prompt, per_prompt
from kvsplice.core.spec_files import PLAN_PREFIX

__all__ = ["MethodSpec", "parse_method"]


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


def parse_method(spec: str, tokenizer=None, model=None) -> MethodSpec:
    """``spec`` (see the module docstring) → :class:`MethodSpec`; ``tokenizer``: the model's (KVzip encodes its
    reconstruction instruction with it); ``model``: a plan must have been made for it."""
    from kvsplice.planning.spec import Plan, check_plan_model
    from kvsplice.tasks.provenance import spec_files

    spec = spec.strip()
    if spec == "full":
        return MethodSpec(spec, "full", lambda ids, shared=None: None)
    if spec.startswith(PLAN_PREFIX):
        plan = Plan.load(spec[len(PLAN_PREFIX):], model)
        if needs_prompt(plan.spec) and tokenizer is None:
            raise ValueError(f"method {spec!r}: {plan.label} re-reads its prompt and needs the model's tokenizer")
        keep = float(plan.spec.get("keep", 1.0)) if plan.selects else 1.0
        files = (Path(spec[5:]).expanduser().resolve(), *spec_files(plan.spec, plan.base_dir))
        return MethodSpec(spec, f"plan {plan.label}", per_prompt(plan.method, tokenizer), keep, files)
    if model is not None:
        check_plan_model(spec, model)
    try:
        d, base_dir = load_spec(spec)
        d = check_spec(d, base_dir=base_dir)
        build_method(d, prompt_len=1, base_dir=base_dir)  # the constructors check the values now, not per prompt
        if needs_prompt(d) and tokenizer is None:
            raise ValueError(f"{format_spec(d)} re-reads its prompt and needs the model's tokenizer")
    except ValueError as e:
        raise ValueError(_named(spec, e)) from None
    keep = float(d["keep"]) if "keep" in d else 1.0
    own = (Path(spec).expanduser().resolve(),) if base_dir is not None else ()  # a .json spec file
    return MethodSpec(spec, format_spec(d), per_prompt(
        lambda **ctx: build_method(d, base_dir=base_dir, **ctx), tokenizer), keep, (*own, *spec_files(d, base_dir)))
