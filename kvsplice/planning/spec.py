"""A compression stack as data — ``tokens × rank × bits`` — and the plan file that carries it from the planner
(``python -m kvsplice.plan``) to ``generate``, ``eval_bases`` and the HF cache.

A :class:`Stack` is an optional token selection (``selector``, keeping a fraction ``keep`` of the prompt) over one
storage method: ``dense`` (full K/V at the cache dtype), ``int8`` (full K/V, int8 rows + fp16 scales), ``kivi``
(``bits``, ``group``, ``residual``) or ``lowrank`` (bases from the plan's bases file, ``rope``, ``cache_quant``).
:meth:`Stack.method` builds the one :class:`~kvsplice.core.method.CompressionMethod` for a prompt length::

    plan = Plan.load("plan.json")                       # + plan.bases.safetensors beside it when it has low rank
    method = plan.method(prompt_len=ids.shape[1])      # TokenSelection(SnapKV, budget, store=KIVI(4)) ...
    Decoder(model, method); KVSpliceHFCache(model, method)

The plan file is JSON: ``format``, ``version``, the ``model_fingerprint`` it was searched for, the ``stack``, the
``bases`` file (relative to the plan) and the search's evidence (``budget``, ``chosen`` and every ``candidate``'s
tuning measurements). Loading checks the format and, given a model, the fingerprint.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from kvsplice.core.method import CompressionMethod
from kvsplice.planning.checks import check_arguments, check_plan_doc

__all__ = ["PLAN_FORMAT", "Plan", "PlanError", "STORES", "Stack"]

PLAN_FORMAT, PLAN_VERSION = "kvsplice-plan", 1
STORES = ("dense", "int8", "kivi", "lowrank")


class PlanError(ValueError):
    """A plan file that cannot be used (another format, another model, a missing bases file); one line."""


@dataclass(frozen=True)
class Stack:
    """``store`` ∈ :data:`STORES` with its settings, under an optional ``selector`` keeping ``keep`` of the prompt."""

    store: str = "dense"
    bits: int = 4  # kivi
    group: int = 32  # kivi
    residual: int = 128  # kivi
    rotate: bool = False  # kivi: over Hadamard-rotated keys and values (RotatedKIVI)
    lowrank_ratio: float = 1.0  # lowrank: 2·L·Hkv·d / Σ ranks
    rope: str = "post"  # lowrank bases' key space
    cache_quant: Optional[str] = None  # lowrank coefficients: None / "int8"
    selector: Optional[str] = None
    selector_kw: dict = field(default_factory=dict)
    keep: float = 1.0  # fraction of the prompt's tokens a selection keeps

    def __post_init__(self) -> None:
        if self.store not in STORES:
            raise PlanError(f"store must be one of {STORES}, got {self.store!r}")
        if not 0.0 < self.keep <= 1.0:
            raise PlanError(f"keep must be in (0, 1], got {self.keep}")
        if self.selector is not None and self.store == "lowrank" and self.rope == "pre":
            raise PlanError("a token selection cannot hold pre-RoPE low-rank coefficients (they need positions)")

    def budget(self, prompt_len: int) -> int:
        """Prompt tokens the selection keeps per KV head (``ceil(keep · prompt_len)``, at least 1)."""
        return max(1, math.ceil(self.keep * prompt_len - 1e-9))

    def label(self) -> str:
        store = {"dense": "fp", "int8": "int8"}.get(self.store)
        if self.store == "kivi":
            store = f"kivi{self.bits}{'h' if self.rotate else ''}(g{self.group},r{self.residual})"
        elif self.store == "lowrank":
            store = f"lowrank×{self.lowrank_ratio:g}({self.rope}{'+int8' if self.cache_quant else ''})"
        return store if self.selector is None else f"{self.selector}×{1 / self.keep:.3g} + {store}"

    def storage(self, bases=None) -> CompressionMethod:
        from kvsplice.decode.dense import DenseKV

        if self.store == "dense":
            return DenseKV()
        if self.store == "int8":
            return DenseKV(cache_quant="int8")
        if self.store == "kivi":
            from kvsplice.quant.method import KIVI
            from kvsplice.quant.rotated import RotatedKIVI

            return (RotatedKIVI if self.rotate else KIVI)(bits=self.bits, group=self.group, residual=self.residual)
        from kvsplice.lowrank.method import LowRank

        if bases is None:
            raise PlanError("a low-rank stack needs its bases (the plan's bases file)")
        return LowRank(bases, cache_quant=self.cache_quant)

    def method(self, prompt_len: Optional[int] = None, bases=None, ids=None) -> CompressionMethod:
        """The stack as one method; a selection needs the ``prompt_len`` it compresses, KVzip (``selector ==
        "kvzip"``, its repeat prompt's token ids in ``selector_kw["repeat_ids"]``) the prompt's ``ids (B, P)``."""
        store = self.storage(bases)
        if self.selector is None:
            return store
        if prompt_len is None:
            prompt_len = None if ids is None else ids.shape[1]
        if prompt_len is None:
            raise PlanError(f"{self.label()} selects prompt tokens: give the prompt length")
        if self.selector == "kvzip":
            return self._kvzip(prompt_len, store, ids)
        from kvsplice.select.method import TokenSelection
        from kvsplice.select.selectors import make_selector

        return TokenSelection(make_selector(self.selector, **self.selector_kw), self.budget(prompt_len), store=store)

    def _kvzip(self, prompt_len: int, store: CompressionMethod, ids) -> CompressionMethod:
        import torch

        from kvsplice.select.kvzip import KVzipSelection

        if ids is None:
            raise PlanError(f"{self.label()} re-reads the prompt (KVzip): give its token ids "
                            f"(plan.method(prompt_len, ids))")
        rep = torch.tensor([self.selector_kw.get("repeat_ids", [])], dtype=torch.long, device=ids.device)
        recon = torch.cat([rep.expand(ids.shape[0], -1), ids], dim=1)  # (B, R + P): "repeat:" + the prompt
        return KVzipSelection(self.budget(prompt_len), recon_ids=recon, store=store)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Plan:
    """A :class:`Stack` for one model, its low-rank bases (if any) and the search's evidence (``info``)."""

    stack: Stack
    model_fingerprint: Optional[str] = None
    bases: Any = None  # KVBases
    bases_file: Optional[str] = None
    info: dict = field(default_factory=dict)

    def method(self, prompt_len: Optional[int] = None, ids=None) -> CompressionMethod:
        return self.stack.method(prompt_len, self.bases, ids)

    def check_model(self, fingerprint: str) -> None:
        if self.model_fingerprint is not None and fingerprint != self.model_fingerprint:
            raise PlanError(f"this plan was made for model {self.model_fingerprint}, not {fingerprint}; run "
                            f"python -m kvsplice.plan for this model")

    def save(self, path: str | Path) -> Path:
        """Write the plan JSON (and the bases file beside it, ``<name>.bases.safetensors``) atomically."""
        from models.checkpoint import atomic_write

        path = Path(path)
        if self.bases is not None:
            bpath = path.with_name(path.stem + ".bases.safetensors")
            atomic_write(bpath, self.bases.save)
            self.bases_file = bpath.name
        doc = {"format": PLAN_FORMAT, "version": PLAN_VERSION, "model_fingerprint": self.model_fingerprint,
               "stack": self.stack.to_dict(), "label": self.stack.label(), "bases": self.bases_file, **self.info}
        atomic_write(path, lambda p: p.write_text(json.dumps(doc, indent=2, default=str) + "\n"))
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
        if not isinstance(doc, dict) or doc.get("format") != PLAN_FORMAT or doc.get("version") != PLAN_VERSION:
            raise PlanError(f"{path} is not a kvsplice plan (python -m kvsplice.plan writes them)")
        try:
            check_plan_doc(doc)
        except ValueError as e:
            raise PlanError(f"{path}: {e}") from None
        try:
            stack = Stack(**doc["stack"])
        except (TypeError, KeyError) as e:
            raise PlanError(f"{path}: bad stack ({e})") from None
        try:
            check_arguments(stack)
        except ValueError as e:
            raise PlanError(f"{path}: {e}") from None
        bases = None
        if doc.get("bases"):
            from kvsplice.lowrank.bases import KVBases

            bpath = path.parent / doc["bases"]
            if not bpath.is_file():
                raise PlanError(f"{path}: its bases file {bpath} is missing")
            bases = KVBases.load(bpath)
        info = {k: v for k, v in doc.items() if k not in ("format", "version", "model_fingerprint", "stack", "bases",
                                                           "label")}
        plan = cls(stack, doc.get("model_fingerprint"), bases, doc.get("bases"), info)
        if model is not None:
            from kvsplice.adapters import model_fingerprint

            plan.check_model(model_fingerprint(model))
        return plan
