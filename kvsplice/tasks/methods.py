"""Method specs for the task evaluation: a string → the factory that builds the method for a prompt.

Every spec :func:`kvsplice.build_method` reads (``int8``, ``kivi4``, ``kivi4h(residual=32)``,
``select:observed_attention@x4+int8``, ``lowrank:FILE+int8``, a ``.json`` spec file; see
:mod:`kvsplice.core.registry`) is one, plus::

    full                                   the full K/V cache
    kvzip@KEEP[+STORE]                     KVzip: kept by the attention of a reconstruction pass (query-agnostic);
                                           KEEP a fraction or xR; it holds the prompt's ids, so it is built here,
                                           per prompt, not by build_method
    plan:PATH                              a plan from python -m kvsplice.plan
    e.g.  select:observed_attention@x4.19+int8,  kvzip@x4+int8,  kivi4(residual=32)

A selection keeps ``ceil(KEEP · P)`` of the ``P`` tokens it compresses (as a plan does).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from kvsplice.core.method import CompressionMethod
from kvsplice.core.registry import build_method, check_spec, format_spec, load_spec, parse_amount

__all__ = ["MethodSpec", "parse_method"]


@dataclass
class MethodSpec:
    """A parsed spec: ``label`` and ``factory(ids (1, P)[, shared]) -> method | None`` (None: the full cache);
    ``shared``: a dict per compressed context, in which KVzip keeps its reconstruction scores for every budget."""

    spec: str
    label: str
    factory: Callable[[torch.Tensor], Optional[CompressionMethod]]
    keep: float = 1.0  # the fraction of the compressed tokens a selection keeps
    kvzip: bool = False


def _keep(text: str, spec: str) -> float:
    """KVzip's KEEP: a fraction or a ratio ``xR``, as a selection's amount in the registry's grammar."""
    try:
        v = parse_amount(text, spec).get("keep", -1.0)
    except ValueError:
        v = -1.0
    if not 0.0 < v <= 1.0:
        raise ValueError(f"method {spec!r}: KEEP must be a fraction in (0, 1] or a ratio xR with R >= 1, got {text!r}")
    return v


def _named(spec: str, e: ValueError) -> str:
    """The registry's one-line error, naming ``spec`` when it does not already."""
    return str(e) if repr(spec) in str(e) else f"method {spec!r}: {e}"


def parse_method(spec: str, tokenizer=None) -> MethodSpec:
    """``spec`` (see the module docstring) → :class:`MethodSpec`; ``tokenizer`` encodes KVzip's repeat prompt."""
    spec = spec.strip()
    if spec == "full":
        return MethodSpec(spec, "full", lambda ids: None)
    if spec.startswith("plan:"):
        from kvsplice.planning.spec import Plan

        plan = Plan.load(spec[5:])
        keep = float(plan.spec.get("keep", 1.0)) if plan.selects else 1.0
        return MethodSpec(spec, f"plan {plan.label}", lambda ids: plan.method(ids.shape[1]), keep)
    if spec.startswith("kvzip@"):
        return _kvzip(spec, tokenizer)
    try:
        d, base_dir = load_spec(spec)
        d = check_spec(d, base_dir=base_dir)
        build_method(d, prompt_len=1, base_dir=base_dir)  # the constructors check the values now, not per prompt
    except ValueError as e:
        raise ValueError(_named(spec, e)) from None
    keep = float(d["keep"]) if "keep" in d else 1.0
    return MethodSpec(spec, format_spec(d), lambda ids, d=d: build_method(d, prompt_len=ids.shape[1],
                                                                           base_dir=base_dir), keep)


def _kvzip(spec: str, tokenizer) -> MethodSpec:
    from kvsplice.select.kvzip import REPEAT_PROMPT, KVzipSelection

    keep_text, _, store_text = spec[6:].partition("+")
    keep = _keep(keep_text, spec)
    if tokenizer is None:
        raise ValueError(f"method {spec!r}: KVzip needs the tokenizer (its repeat prompt)")
    store = None
    if store_text:
        try:
            store = check_spec(load_spec(store_text)[0])
            build_method(store, prompt_len=1)
        except ValueError as e:
            raise ValueError(_named(spec, e)) from None
    prefix = tokenizer.encode(REPEAT_PROMPT)

    def kvzip(ids: torch.Tensor, shared: Optional[dict] = None) -> CompressionMethod:
        recon = torch.cat([torch.tensor([prefix], device=ids.device), ids], dim=1)  # (1, Tr)
        budget = max(1, math.ceil(keep * ids.shape[1] - 1e-9))
        scores = None if shared is None else shared.setdefault("kvzip", {})  # one pass per context
        return KVzipSelection(budget, recon_ids=recon, store=None if store is None else build_method(store),
                              shared_scores=scores)

    store_label = "" if store is None or store == {"name": "dense"} else f" + {format_spec(store)}"
    return MethodSpec(spec, f"kvzip×{1 / keep:.3g}{store_label}", kvzip, keep, kvzip=True)
