"""Method specs for the task evaluation: a short string → the factory that builds the method for a prompt.

Grammar (parts joined by ``+``: at most one selection, then at most one storage)::

    full                                   the full K/V cache
    int8 | fp | kivi4 | kivi2 | kivi8 | kivi4/r32     storage alone (KIVI: bits, residual window; group 32)
    kivi4h | kivi2h/r32                    KIVI over Hadamard-rotated keys and values (RotatedKIVI)
    select:NAME@KEEP                       a token selection (a registered selector) keeping KEEP of the prompt:
                                           a fraction (0.25) or a ratio (x4 = 1/4)
    kvzip@KEEP                             KVzip: kept by the attention of a reconstruction pass (query-agnostic)
    plan:PATH                              a plan from python -m kvsplice.plan
    e.g.  select:observed_attention@x4.19+int8,  kvzip@x4+int8,  kivi4/r32

A selection keeps ``ceil(KEEP · P)`` of the ``P`` tokens it compresses (as a plan does). ``kvsplice.build_method``
(the method registry, when the branch that builds it is merged) takes over this grammar.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from kvsplice.core.method import CompressionMethod
from kvsplice.planning.spec import Stack

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
    try:
        v = 1.0 / float(text[1:]) if text.startswith("x") else float(text)
    except ValueError:
        v = -1.0
    if not 0.0 < v <= 1.0:
        raise ValueError(f"method {spec!r}: KEEP must be a fraction in (0, 1] or a ratio xR with R >= 1, got {text!r}")
    return v


def _storage(part: str, spec: str) -> Stack:
    if part in ("fp", "dense"):
        return Stack(store="dense")
    if part == "int8":
        return Stack(store="int8")
    if part.startswith("kivi"):
        bits, _, res = part[4:].partition("/r")
        rotate = bits.endswith("h")
        bits = bits.rstrip("h")
        if bits in ("2", "4", "8") and (not res or res.isdigit()):
            return Stack(store="kivi", bits=int(bits), residual=int(res) if res else 128, rotate=rotate)
    raise ValueError(f"method {spec!r}: unknown storage {part!r} (int8, fp, kivi2/4/8[h][/rN])")


def parse_method(spec: str, tokenizer=None) -> MethodSpec:
    """``spec`` (see the module docstring) → :class:`MethodSpec`; ``tokenizer`` encodes KVzip's repeat prompt."""
    from kvsplice.select.selectors import SELECTORS

    spec = spec.strip()
    if spec == "full":
        return MethodSpec(spec, "full", lambda ids: None)
    if spec.startswith("plan:"):
        from kvsplice.planning.spec import Plan

        plan = Plan.load(spec[5:])
        return MethodSpec(spec, f"plan {plan.stack.label()}", lambda ids: plan.method(ids.shape[1], ids),
                          plan.stack.keep, plan.stack.selector == "kvzip")
    parts = spec.split("+")
    sel, store = None, Stack(store="dense")
    if parts[0].startswith(("select:", "kvzip@")):
        sel = parts.pop(0)
    if len(parts) > 1:
        raise ValueError(f"method {spec!r}: one selection then one storage, joined by '+'")
    if parts:
        store = _storage(parts[0], spec)
    if sel is None:
        return MethodSpec(spec, store.label(), lambda ids, s=store: s.method(ids.shape[1]))
    if sel.startswith("kvzip@"):
        keep = _keep(sel[6:], spec)
        if tokenizer is None:
            raise ValueError(f"method {spec!r}: KVzip needs the tokenizer (its repeat prompt)")
        from kvsplice.select.kvzip import REPEAT_PROMPT, KVzipSelection

        prefix = tokenizer.encode(REPEAT_PROMPT)

        def kvzip(ids: torch.Tensor, shared: Optional[dict] = None, keep=keep, store=store) -> CompressionMethod:
            recon = torch.cat([torch.tensor([prefix], device=ids.device), ids], dim=1)  # (1, Tr)
            budget = max(1, math.ceil(keep * ids.shape[1] - 1e-9))
            scores = None if shared is None else shared.setdefault("kvzip", {})  # one pass per context
            return KVzipSelection(budget, recon_ids=recon, store=store.storage(), shared_scores=scores)

        store_label = "" if store.store == "dense" else f" + {store.label()}"
        return MethodSpec(spec, f"kvzip×{1 / keep:.3g}{store_label}", kvzip, keep, kvzip=True)
    name, _, keep_text = sel[7:].partition("@")
    if name not in SELECTORS or name == "kvzip":
        raise ValueError(f"method {spec!r}: selector must be one of {sorted(set(SELECTORS) - {'kvzip'})}, got {name!r}")
    stack = Stack(store=store.store, bits=store.bits, residual=store.residual, rotate=store.rotate, selector=name,
                  keep=_keep(keep_text, spec))
    return MethodSpec(spec, stack.label(), lambda ids, s=stack: s.method(ids.shape[1]), stack.keep)
