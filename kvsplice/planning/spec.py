"""The plan file: a method spec (:mod:`kvsplice.core.build`) found by the planner (``kvsplice plan``)
for one model, carried to ``generate``, ``eval_bases`` and the HF cache.

A plan's ``spec`` is any method or stack — typically a token selection keeping a fraction ``keep`` of the prompt
over a storage method (full K/V, int8, KIVI, low rank, or any registered store). :meth:`Plan.method` builds it for a
prompt length::

    plan = Plan.load("plan.json")                      # + plan.bases.safetensors beside it when it has low rank
    method = plan.method(prompt_len=ids.shape[1])     # build_method(plan.spec, prompt_len=, base_dir=plan's folder)
    method = plan.method(prompt_ids=ids, tokenizer=tok)  # any plan; needed when it re-reads its prompt (KVzip)
    Decoder(model, method); KVSpliceHFCache(model, method)

The plan file is JSON: ``format``, ``version`` (2), the ``model_fingerprint`` it was searched for, the ``spec`` (files
it names — low-rank bases — relative to the plan's folder), its ``label`` and the search's evidence (``budget``,
``chosen`` and every ``candidate``'s tuning measurements). Version 1 files (a ``stack`` and a ``bases`` file) are read
and converted (:func:`stack_to_spec`). Loading checks the format, that the files the spec names exist and, given a
model, the fingerprint.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from kvsplice.core.method import CompressionMethod
from kvsplice.core.build import build_method, needs_prompt
from kvsplice.core.registry import METHODS
from kvsplice.core.short_form import format_spec
from kvsplice.core.spec_files import spec_file_names
from kvsplice.planning.checks import check_arguments, check_bases_name, check_plan_doc

__all__ = ["PLAN_FORMAT", "PLAN_VERSION", "Plan", "PlanError", "check_plan_model", "is_plan_file", "spec_label",
           "stack_to_spec"]

PLAN_FORMAT, PLAN_VERSION = "kvsplice-plan", 2


class PlanError(ValueError):
    """A plan file that cannot be used (another format, another model, a missing bases file); one line."""


def stack_to_spec(stack: dict[str, Any], bases_file: Optional[str]) -> dict[str, Any]:
    """The spec of a version-1 plan's ``stack`` (store ∈ dense / int8 / kivi / lowrank under an optional
    ``selector`` keeping ``keep`` of the prompt) and its ``bases`` file name."""
    store = stack.get("store", "dense")
    if store == "dense":
        spec: dict[str, Any] = {"name": "dense"}
    elif store == "int8":
        spec = {"name": "dense", "cache_quant": "int8"}
    elif store == "kivi":
        spec = {"name": "kivi", "bits": stack.get("bits", 4), "group": stack.get("group", 32),
                "residual": stack.get("residual", 128)}
    elif store == "lowrank":
        if not bases_file:
            raise PlanError("a low-rank stack needs its bases (the plan's bases file)")
        spec = {"name": "lowrank", "bases": bases_file}
        if stack.get("cache_quant"):
            spec["cache_quant"] = stack["cache_quant"]
    else:
        raise PlanError(f"store must be one of dense, int8, kivi, lowrank, got {store!r}")
    if stack.get("selector") is None:
        return spec
    return {"name": "token_selection", "selector": {"name": stack["selector"], **stack.get("selector_kw", {})},
            "keep": stack.get("keep", 1.0), "store": spec}


_KIVI_SUFFIX = {"kivi": "", "kivi_rotated": "h", "kivi_prerope": "p"}  # a KIVI store's label: its aliases' letter


def spec_label(spec: dict[str, Any]) -> str:
    """A short label of a spec, as the planner reports its candidates: ``fp``, ``int8``, ``int4h`` (rows rotated),
    ``kivi4(g32,r128)``
    (``kivi4h(…)``: Hadamard-rotated, ``kivi2p(…)``: keys before RoPE), ``lowrank×1.5(post+int8)`` (the planner's
    bases, by their fit), a selection keeping ``keep`` of the prompt as
    ``selector×ratio + store``; any other spec by its short form (:func:`~kvsplice.core.short_form.format_spec`)."""
    name = spec.get("name")
    if "keep" in spec and getattr(METHODS.get(name), "select_form", False):  # kvzip: scores by its own pass
        spec = {"name": "token_selection", "keep": spec["keep"], "store": spec.get("store", {"name": "dense"}),
                "selector": {k: v for k, v in spec.items() if k not in ("keep", "store")}}
        name = "token_selection"
    if name == "token_selection" and "keep" in spec:
        sel = spec.get("selector", {})
        if isinstance(sel, dict):
            args = ",".join(f"{k}={v}" for k, v in sel.items() if k != "name")
            sel = sel.get("name", "?") + (f"({args})" if args else "")
        store = spec.get("store", {"name": "dense"})
        return f"{sel}×{1 / spec['keep']:.3g} + {spec_label(store) if isinstance(store, dict) else store}"
    rest = {k: v for k, v in spec.items() if k != "name"}
    if name == "dense" and not rest.get("cache_quant") and not rest.get("rotate"):
        return "fp"
    if name == "dense":  # int8, int4h, k8v4h, ...: the alias (format_spec)
        return format_spec(spec)
    if name in _KIVI_SUFFIX and set(rest) <= {"bits", "group", "residual"}:  # kivi4, kivi4h, kivi4p as the aliases
        return (f"kivi{rest.get('bits', 4)}{_KIVI_SUFFIX[name]}(g{rest.get('group', 32)},"
                f"r{rest.get('residual', 128)})")
    bases = rest.get("bases")
    meta = getattr(bases, "meta", None)
    if isinstance(bases, dict) and "fit" in bases:  # the planner's fit, before it is made
        meta = {"alloc_ratio": bases["ratio"]}
        rope = bases["rope"]
    else:
        rope = getattr(bases, "rope", None)
    if name == "lowrank" and isinstance(meta, dict) and "alloc_ratio" in meta:
        return f"lowrank×{meta['alloc_ratio']:g}({rope}{'+int8' if rest.get('cache_quant') else ''})"
    return format_spec(spec)


@dataclass
class Plan:
    """A method ``spec`` for one model (files it names relative to ``base_dir``) and the search's evidence
    (``info``). In-memory objects in the spec (the planner's bases) are written beside the plan by :meth:`save`."""

    spec: dict[str, Any]
    model_fingerprint: Optional[str] = None
    base_dir: Optional[Path] = None
    info: dict = field(default_factory=dict)

    def method(self, prompt_len: Optional[int] = None, *, prompt_ids: Any = None,
               tokenizer: Any = None) -> CompressionMethod:
        """The plan's method; a selection keeping a fraction of the prompt needs ``prompt_len``, a plan that re-reads
        its prompt (KVzip, :attr:`needs_prompt`) the prompt's ids (``prompt_ids (B or 1, P)``) and the tokenizer."""
        try:
            return build_method(self.spec, prompt_len=prompt_len, base_dir=self.base_dir, prompt_ids=prompt_ids,
                                tokenizer=tokenizer)
        except ValueError as e:
            raise PlanError(str(e)) from None

    @property
    def label(self) -> str:
        return spec_label(self.spec)

    @property
    def needs_prompt(self) -> bool:
        """Whether the plan's method re-reads the prompt it compresses (build it with ``prompt_ids`` / ``tokenizer``)."""
        return needs_prompt(self.spec)

    @property
    def selects(self) -> bool:
        """The plan's method is a token selection (it compresses a prompt)."""
        return "keep" in self.spec or "budget" in self.spec  # token_selection, kvzip

    def files(self) -> list[tuple[dict, str]]:
        """``(the dict holding it, key)`` of every in-memory object of the spec a file must hold (bases)."""
        out, todo = [], [self.spec]
        while todo:
            d = todo.pop()
            for k, v in d.items():
                if isinstance(v, dict):
                    todo.append(v)
                elif hasattr(v, "save") and k != "name":
                    out.append((d, k))
        return out

    def check_model(self, fingerprint: str) -> None:
        """The plan was searched for the model of ``fingerprint``: a plan of another model — or one that does not
        say which (no ``model_fingerprint``: hand-made or damaged) — is a :class:`PlanError`."""
        if not isinstance(self.model_fingerprint, str) or not self.model_fingerprint:
            raise PlanError(f"this plan records no model_fingerprint (the model it was made for); make it with "
                            f"kvsplice plan, or build a method spec instead (--method)")
        if fingerprint != self.model_fingerprint:
            raise PlanError(f"this plan was made for model {self.model_fingerprint}, not {fingerprint}; run "
                            f"kvsplice plan for this model")

    def save(self, path: str | Path, also: Optional[dict[Path, Callable[[Path], None]]] = None) -> Path:
        """Write the plan JSON — and, for in-memory bases in the spec, the file beside it
        (``<name>.bases.safetensors``) named in the written spec relative to the plan — and the files of ``also``
        (``{path: write(tmp)}``, e.g. the planner's report): each is written at its temporary name first and all
        are renamed into place together (:class:`kvsplice.io.staged.Staged`), so an interrupted save leaves the
        earlier plan, its bases and its report as they were, never a plan beside another plan's bases."""
        from kvsplice.io.staged import Staged

        path = Path(path)
        spec = _copy(self.spec)
        holders = Plan(spec).files()
        names = [path.stem + (".bases" if i == 0 else f".bases{i}") + ".safetensors" for i in range(len(holders))]
        with Staged([path, *(path.with_name(n) for n in names), *(also or {})]) as staged:
            for name, (d, k) in zip(names, holders):
                d[k].save(staged.temp(path.with_name(name)))
                d[k] = name
            doc = {"format": PLAN_FORMAT, "version": PLAN_VERSION, "model_fingerprint": self.model_fingerprint,
                   "spec": spec, "label": self.label, **self.info}
            staged.temp(path).write_text(json.dumps(doc, indent=2, default=str) + "\n")
            for other, write in (also or {}).items():
                write(staged.temp(other))
            staged.commit()
        return path

    @classmethod
    def load(cls, path: str | Path, model=None) -> "Plan":
        path = Path(path)
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except RecursionError:
            raise PlanError(f"cannot read the plan {path}: nested too deeply (not a plan)") from None
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise PlanError(f"cannot read the plan {path}: {str(e).splitlines()[0]}") from None
        return cls.from_doc(doc, path, model)

    @classmethod
    def from_doc(cls, doc: Any, path: str | Path, model=None) -> "Plan":
        """The plan of ``doc``, the parsed JSON of the plan file ``path`` (read once by the caller): the checks of
        :meth:`load`."""
        path = Path(path)
        if not isinstance(doc, dict) or doc.get("format") != PLAN_FORMAT or doc.get("version") not in (1, 2):
            raise PlanError(f"{path} is not a kvsplice plan (kvsplice plan writes them)")
        try:
            check_plan_doc(doc)  # version 1: the stack's fields; both: the evidence, the bases name
        except ValueError as e:
            raise PlanError(f"{path}: {e}") from None
        if doc["version"] == 1:
            if not isinstance(doc.get("stack"), dict):
                raise PlanError(f"{path}: bad stack")
            spec = stack_to_spec(doc["stack"], doc.get("bases"))
            drop = ("format", "version", "model_fingerprint", "stack", "bases", "label")
        else:
            spec = doc.get("spec")
            if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
                raise PlanError(f"{path}: its spec is not a method spec (a dict with a \"name\")")
            drop = ("format", "version", "model_fingerprint", "spec", "label")
        names = [name for _, name in spec_file_names(spec)]
        try:
            for f in names:
                check_bases_name(f)
        except ValueError as e:
            raise PlanError(f"{path}: {e}") from None
        for f in names:
            if not (path.parent / f).is_file():
                raise PlanError(f"{path}: its bases file {path.parent / f} is missing")
        try:
            check_arguments(spec, base_dir=path.parent)
        except ValueError as e:
            raise PlanError(f"{path}: {e}") from None
        info = {k: v for k, v in doc.items() if k not in drop}
        plan = cls(spec, doc.get("model_fingerprint"), path.resolve().parent, info)
        if model is not None:
            from kvsplice.adapters import model_fingerprint

            plan.check_model(model_fingerprint(model))
        return plan


def is_plan_file(arg: str) -> bool:
    """Whether ``arg`` (a ``--method`` argument) names a plan file: a ``.json`` file whose ``format`` is a plan's."""
    path = Path(arg).expanduser()
    if not arg.endswith(".json") or not path.is_file():
        return False
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return False  # not readable as JSON: the spec reader reports it
    return isinstance(doc, dict) and doc.get("format") == PLAN_FORMAT


def check_plan_model(arg: str, model) -> None:
    """A ``--method`` argument that is a plan file (a plan given as a ``.json`` spec) must be ``model``'s, as
    ``--plan`` must (:meth:`Plan.check_model`); any other spec names no model."""
    if is_plan_file(arg):
        Plan.load(arg, model)


def _copy(spec: Any) -> Any:
    return {k: _copy(v) for k, v in spec.items()} if isinstance(spec, dict) else spec
