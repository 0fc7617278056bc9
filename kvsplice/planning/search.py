"""The budget planner's search: every storage method that can hold the cache, each with the largest token selection
that fits the byte budget, measured on tuning text — the best measured stack wins.

The search is over method specs (:mod:`kvsplice.core.build`): any registered storage method can be a candidate
(``stores=``, ``kvsplice plan --stores SPEC ...``).

1. **Stores** (:func:`candidate_stores`): full K/V at fp16 and int8, int8 keys with int4 values (``k8v4h``: rows
   rotated by a Hadamard matrix; SmolLM2's tuning text: +1.76 % perplexity at 8× under KVzip's pooled selection where
   int8 rows cost +3.29 %, docs/tasks.md), KIVI at 4 and 2 bits (group 32, full-precision
   windows of 32 and 128 tokens; and 4 bits in groups of 64 where the head dimension allows; on models whose RoPE
   rotates the whole head also KIVI-2 with keys quantised before RoPE, ``kivi_prerope``, which holds no selection: it
   kept more tuning passkeys than KIVI-2 on SmolLM2, docs/tasks.md), and low-rank bases with ranks allocated by the
   predicted calibration loss (:mod:`kvsplice.lowrank.allocate`, the ``fisher`` fit) at a few rank ratios, int8
   coefficients — post-RoPE (they can hold a selection) and pre-RoPE (alone).
2. **Tokens** (:func:`fit_budget`): the exact bytes of each store per prompt token at fp16 (the methods'
   closed forms, measured == formula in every evaluation); where the store alone is over budget a token selection
   keeps the most prompt tokens that fit (its log-weights counted), on a prompt of ``fit_len`` tokens (default the
   tuning windows' prompt: KIVI's 128-token full-precision window is 1/6 of a 768-token prompt, 1/62 of an 8k one).
3. **Measure** (:func:`search`): the selector is chosen first — every ``selectors`` entry on the selection over
   int8 K/V (else the candidate keeping the most tokens), each keeping the most tokens it fits in the budget — then
   every candidate is measured with it on the tuning windows
   (:func:`kvsplice.evaluation.protocol.evaluate`: compressed prompt, scored continuation). Nothing is measured on
   evaluation text: the caller passes tuning windows (the planner takes them from the calibration text, after the
   calibration tokens). The pick (the selector's and the plan's) follows the ``objective`` (:data:`OBJECTIVES`):
   tuning perplexity, or with task instances (``task_eval``) their accuracy too. A store the chosen selector cannot
   hold (KIVI codes under ``kvzip(heads=pooled)``, which keeps dense rows) is measured under the best selector of
   the trial that can, rather than left out: at 8k tokens SmolLM2's pooled pick kept 75 % of its tuning needles
   where the full cache kept 92 %, and only caches keeping nearly every token held them (docs/tasks.md).
"""

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Protocol, Sequence

import torch

from kvsplice.adapters import adapter_for
from kvsplice.evaluation.protocol import evaluate, evaluate_each, full_bytes_per_token
from kvsplice.core.build import build_method, needs_prompt, per_prompt
from kvsplice.planning.candidates import (DEFAULT_SELECTORS, FAST_STRIDE, INT8, LOWRANK_RATIOS, bytes_per_token,
                                          candidate_stores, check_selector, fast_prefill, fit_budget, is_selection,
                                          lowrank_bases, runs_on, selection)
from kvsplice.io.options import defaults
from kvsplice.planning.options import PlanOptions
from kvsplice.planning.spec import spec_label

__all__ = ["DEFAULT_SELECTORS", "FAST_STRIDE", "LOWRANK_RATIOS", "OBJECTIVES", "PREFILL", "SearchOptions", "TaskBench",
           "bytes_per_token", "candidate_stores", "check_selector", "fast_prefill", "fit_budget", "is_selection",
           "lowrank_bases", "rank_key", "search", "selection"]

EXHAUSTIVE_TASKS = False
"""Measure every candidate on every tuning instance (tests: the early stop must give the same pick)."""


def _answered(row: dict, n: int) -> float:
    """Tuning instances ``row`` is sure to answer (of ``n``): all it answered, or so far where it stopped early."""
    if "task_acc" in row:
        return row["task_acc"] * n / 100
    return row.get("task_answered", -1.0)


OBJECTIVES = ("ppl", "tasks", "mixed")
"""What the planner optimises: tuning perplexity; task accuracy on tuning instances (ties: perplexity); or ``mixed``:
the best perplexity among the candidates whose task accuracy is within ``task_tolerance`` points of the best
accuracy — it never trades retrieval for perplexity."""


def rank_key(objective: str, best_acc: float = 100.0, tolerance: float = 0.0) -> Callable[[dict], tuple]:
    """Sort key of candidate rows (smallest first) for ``objective`` (:data:`OBJECTIVES`)."""
    if objective == "ppl":
        return lambda r: (r["tuning_ppl"],)
    if objective == "tasks":
        return lambda r: (-r.get("task_acc", -1.0), r["tuning_ppl"])
    if objective == "mixed":  # a row left unmeasured (task_skipped / task_stopped) loses: one of lower perplexity
        # surely answers at least as many instances
        return lambda r: (r.get("task_acc", -1.0) < best_acc - tolerance - 1e-9, r["tuning_ppl"])
    raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")


class TaskBench(Protocol):
    """Tuning task instances the planner measures candidates on: ``n`` instances; ``full()`` the full cache's
    accuracy (%); ``scores(factory, label)`` each instance's score in [0, 1] for the method ``factory(ids[, shared])``
    builds, in a fixed order (the caller may stop early)."""

    n: int

    def full(self) -> float: ...

    def scores(self, factory: Callable, label: str) -> Iterator[float]: ...


PREFILL = ("fast", "any")
"""How the selector is picked: ``fast`` (default) — among the fast-prefill selectors (:func:`fast_prefill`) when one
holds the tuning tasks (its accuracy within ``task_tolerance`` of the full cache's), the others tried only when none
does; ``any`` — among all, by the objective alone."""


_PLAN = defaults(PlanOptions)  # the command's defaults are the library's: one declaration (PlanOptions)


@dataclass(frozen=True)
class SearchOptions:
    """What the search looks for: stacks within ``budget`` bytes per prompt token (fp16) at a ``fit_len``-token
    prompt (default ``prompt_len``), measured on windows whose first ``prompt_len`` tokens are compressed; the
    ``selectors`` and the ``stores`` (default :func:`candidate_stores` with ``lowrank_ratios``) tried; the pick by
    ``objective`` (:data:`OBJECTIVES`, with ``task_tolerance``) and ``prefill`` (:data:`PREFILL`). The defaults are
    ``plan``'s (:class:`~kvsplice.planning.options.PlanOptions`): objective ``mixed`` needs ``task_eval``."""

    prompt_len: int
    budget: float
    selectors: tuple[str, ...] = _PLAN["selectors"]
    lowrank_ratios: tuple[float, ...] = LOWRANK_RATIOS
    stores: Optional[tuple[dict[str, Any], ...]] = None
    batch_size: int = _PLAN["batch_size"]
    objective: str = _PLAN["objective"]
    task_tolerance: float = _PLAN["task_tolerance"]
    fit_len: Optional[int] = _PLAN["fit_length"]
    prefill: str = _PLAN["prefill"]

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {self.objective!r}")
        if self.prefill not in PREFILL:
            raise ValueError(f"prefill must be one of {PREFILL}, got {self.prefill!r}")

    @property
    def fit_at(self) -> int:
        return self.fit_len or self.prompt_len


class _Search:
    """One search's state and its steps (:func:`search` runs them in order): the full cache's tuning result, the
    usable selectors, the stores fitted to the budget, the selector trial, the stores under the chosen selector,
    the pick."""

    def __init__(self, model, stats: Optional[dict], windows: torch.Tensor, opts: SearchOptions,
                 task_eval: Optional[TaskBench], tokenizer: Any, log: Callable[[str], None]) -> None:
        self.model, self.stats, self.windows, self.opts = model, stats, windows, opts
        self.task_eval, self.tokenizer, self.log = task_eval, tokenizer, log
        self.adapter = adapter_for(model)
        self.full_bpt = full_bytes_per_token(self.adapter)
        self.bases_cache: dict = {}
        self.contexts = [{} for _ in range(windows.shape[0])]  # per tuning window: work its KVzip candidates share
        self.full: dict = {}

    # ------------------------------------------------------------------------------------------ building
    def realise(self, spec: dict) -> dict:
        """``spec`` with the planner's bases fitted (``{"fit": ..}`` → KVBases)."""
        out = {k: self.realise(v) if isinstance(v, dict) and k != "bases" else v for k, v in spec.items()}
        b = spec.get("bases")
        if isinstance(b, dict) and "fit" in b:
            if self.stats is None:
                raise ValueError("low-rank candidate stores need the calibration statistics")
            out["bases"] = lowrank_bases(self.stats, b["ratio"], b["rope"], self.bases_cache)
        return out

    def factory(self, spec: dict) -> Callable:
        """``factory(ids, shared=None)``: ``spec``'s method for the prompt it compresses (its bases made)."""
        return per_prompt(lambda spec=self.realise(spec), **ctx: build_method(spec, **ctx), self.tokenizer)

    # ------------------------------------------------------------------------------------------ measuring
    def measure_full(self) -> None:
        o = self.opts
        self.full = evaluate(self.model, None, self.windows, prompt_len=o.prompt_len, batch_size=o.batch_size)
        self.log(f"full cache: tuning ppl {self.full['ppl']:.4f}; budget {o.budget:.1f} bytes per token "
                 f"({self.full_bpt / o.budget:.2f}x smaller than the fp16 full cache, {self.full_bpt} B) at a "
                 f"{o.fit_at}-token prompt")

    def measure(self, spec: dict) -> dict[str, Any]:
        """``spec``'s row: its bytes per token, ratio and tuning perplexity (and its size at the fit length)."""
        o, full = self.opts, self.full
        if needs_prompt(spec):  # built per window from its prompt
            res = evaluate_each(self.model, self.factory(spec), self.windows, prompt_len=o.prompt_len,
                                contexts=self.contexts)
        else:
            res = evaluate(self.model, build_method(self.realise(spec), prompt_len=o.prompt_len), self.windows,
                           prompt_len=o.prompt_len, batch_size=o.batch_size)
        row = {"label": spec_label(spec), "spec": spec, "bytes_per_token": res["bytes_per_token"],
               "ratio_vs_fp16_full": res["ratio_vs_fp16_full"], "tuning_ppl": res["ppl"],
               "delta_pct": 100 * (res["ppl"] / full["ppl"] - 1), "seconds": res["seconds"]}
        if o.fit_at != o.prompt_len:
            method = build_method(self.realise(spec), prompt_len=o.fit_at)  # a selection's budget: its kept tokens
            b = bytes_per_token(method, self.adapter, o.fit_at,
                                min(method.budget, o.fit_at) if is_selection(spec) else o.fit_at)
            row["at_fit"] = {"prompt_len": o.fit_at, "bytes_per_token": b, "ratio_vs_fp16_full": self.full_bpt / b}
        at = f" ({row['at_fit']['ratio_vs_fp16_full']:.2f}x at {o.fit_at})" if "at_fit" in row else ""
        self.log(f"  {row['label']:<48} {row['ratio_vs_fp16_full']:6.2f}x{at}  tuning ppl {row['tuning_ppl']:.4f} "
                 f"({row['delta_pct']:+.2f} %)")
        return row

    def with_tasks(self, rows: list[dict], against: Sequence[dict] = ()) -> None:
        """Each row's task accuracy, in order of tuning perplexity, instance by instance; a row stops (or is not
        started) once a row of no higher perplexity — of ``rows`` or ``against`` — is sure to answer at least as
        many instances as it still can: it can neither win under ``mixed`` or ``tasks`` nor raise the best accuracy,
        so the pick is the one measuring every row in full gives (``task_stopped`` / ``task_skipped`` say so)."""
        task_eval, full, log = self.task_eval, self.full, self.log
        if task_eval is None:
            return
        full["task_acc"] = task_eval.full()
        n = task_eval.n
        for r in sorted((r for r in rows if "task_acc" not in r), key=lambda r: r["tuning_ppl"]):
            # instances a row of no higher perplexity surely answers (the others are fixed while r is measured)
            floor = max((_answered(d, n) for d in [*rows, *against] if d is not r and d["tuning_ppl"] <=
                         r["tuning_ppl"]), default=-1.0)
            if not EXHAUSTIVE_TASKS and floor >= n - 1e-9:
                r["task_skipped"] = "a candidate of lower tuning perplexity answered every tuning instance"
                log(f"  {r['label']:<48} task accuracy not measured: {r['task_skipped']}")
                continue
            got, seen = 0.0, 0
            for score in task_eval.scores(self.factory(r["spec"]), r["label"]):
                got, seen = got + score, seen + 1
                if not EXHAUSTIVE_TASKS and seen < n and got + (n - seen) <= floor + 1e-9:
                    break
            if seen < n:
                r["task_stopped"] = (f"after {seen} of {n} instances: at most {100 * (got + n - seen) / n:.1f} %, "
                                     f"no more than a candidate of lower tuning perplexity answers")
                r["task_answered"] = got
                log(f"  {r['label']:<48} task accuracy stopped {r['task_stopped']}")
            else:
                r["task_acc"] = 100 * got / n
                log(f"  {r['label']:<48} task accuracy {r['task_acc']:.1f} % (full cache {full['task_acc']:.1f} %)")

    def key(self, rows: Sequence[dict]) -> Callable[[dict], tuple]:
        best_acc = max((r.get("task_acc", 0.0) for r in rows), default=0.0)
        return rank_key(self.opts.objective, best_acc, self.opts.task_tolerance)

    def best_of(self, rows: list[dict]) -> dict:
        return min(rows, key=self.key(rows))

    def holds_tasks(self, row: dict) -> bool:
        """``row`` answers the tuning instances as the full cache does (within ``task_tolerance`` points)."""
        return "task_acc" in row and row["task_acc"] >= self.full.get("task_acc", 100.0) - \
            self.opts.task_tolerance - 1e-9

    # ------------------------------------------------------------------------------------------ fitting
    def usable_selectors(self) -> list[str]:
        """The selectors that can run this model (the others are logged and left out)."""
        o = self.opts
        usable = [name for name in o.selectors if runs_on(self.model, build_method(selection(INT8, name, 0.5),
                                                                                   prompt_len=o.prompt_len))]
        for name in o.selectors:
            if name not in usable:
                self.log(f"  selector {name} skipped: it cannot run this model")
        if not usable:
            raise ValueError(f"none of the selectors {', '.join(o.selectors)} can run this model")
        if any(needs_prompt(selection(INT8, name)) for name in usable) and self.tokenizer is None:
            raise ValueError(f"the selectors {', '.join(usable)} include one that re-reads its prompt: give "
                             f"tokenizer=")
        return usable

    def fit_under(self, store: dict, names: Sequence[str]) -> Optional[dict]:
        """``store`` alone if it fits the budget, else under the first of ``names`` that can hold it (KIVI codes
        cannot sit under kvzip(heads=pooled)), keeping the most tokens that selector fits; ``None`` when no such
        stack runs this model (a cache that cannot drop a sliding window's tokens, or over budget at 1/64)."""
        o = self.opts
        for name in dict.fromkeys(names):
            st = fit_budget(store, self.adapter, o.fit_at, o.budget, selector=name, realise=self.realise)
            if st is not None and runs_on(self.model, build_method(self.realise(st), prompt_len=o.prompt_len)):
                return st
            if st is not None and not is_selection(st):
                return None  # alone: no selector changes it
        return None

    def fit_stores(self, selectors: Sequence[str]) -> list[dict]:
        """Every candidate store fitted to the budget (alone, or under the first selector that holds it)."""
        o, a = self.opts, self.adapter
        stores = o.stores if o.stores is not None else candidate_stores(a.has_rope, a.head_dim, o.lowrank_ratios,
                                                                       rotary_dim=a.rotary_dim)
        fits = []
        for store in stores:
            st = self.fit_under(store, selectors)
            if st is None:
                self.log(f"  {spec_label(store):<48} skipped: no stack of it fits the budget and runs this model")
            else:
                fits.append(st)
        if not fits:
            raise ValueError(f"no stack fits {o.budget:.1f} bytes per token (the smallest keeps 1/64 of the prompt)")
        return fits

    # ------------------------------------------------------------------------------------------ choosing
    def trial(self, store: dict, names: Sequence[str]) -> list[tuple[str, dict]]:
        """Each of ``names`` over ``store``, keeping the most tokens it fits, measured (tuning perplexity and
        tasks); ``[(selector, row)]`` (a selector that cannot hold the store sits the trial out)."""
        tried = [(name, self.fit_under(store, [name])) for name in names]
        tried = [(name, st) for name, st in tried if st is not None]
        rows = [self.measure(st) for _, st in tried]
        self.with_tasks(rows)
        return [(name, row) for (name, _), row in zip(tried, rows)]

    def choose_selector(self, fits: list[dict], selectors: list[str]) -> tuple[list[str], list[dict], list[str]]:
        """The selector trial on the selection over int8 K/V (nearly lossless storage: the selection's own loss),
        else on the candidate keeping the most tokens: ``(selectors ranked best first, the trial's rows, the slow
        selectors left out)``. With ``prefill="fast"`` and tuning tasks, the fast-prefill selectors are tried first
        and the others only when none holds the tuning tasks."""
        o = self.opts
        with_sel = sorted((s for s in fits if is_selection(s)), key=lambda s: (s["store"] != INT8, -s["keep"]))
        if not with_sel or len(selectors) == 1:
            return [selectors[0]], [], []
        store = with_sel[0]["store"]
        fast = [n for n in selectors if fast_prefill(n)]
        slow = [n for n in selectors if n not in fast]
        staged = o.prefill == "fast" and self.task_eval is not None and fast and slow
        tried = self.trial(store, fast if staged else selectors)
        left_out: list[str] = []
        if staged:
            held = [(n, r) for n, r in tried if self.holds_tasks(r)]
            if held:
                left_out = slow
                self.log(f"selectors {', '.join(slow)} not tried: a fast-prefill selector holds the tuning tasks")
                tried = held + [(n, r) for n, r in tried if not self.holds_tasks(r)]
                rows = [r for _, r in tried]
                best = min(held, key=lambda p: self.key(rows)(p[1]))[0]
                ranked = [best] + [n for n, r in sorted(tried, key=lambda p: self.key(rows)(p[1])) if n != best]
                self.log(f"selector: {best} (fast prefill)")
                return ranked, rows, left_out
            tried += self.trial(store, slow)
        rows = [r for _, r in tried]
        key = self.key(rows)
        ranked = [n for n, _ in sorted(tried, key=lambda p: key(p[1]))]
        self.log(f"selector: {ranked[0]}")
        return ranked, rows, left_out

    def measure_stores(self, fits: list[dict], ranked: list[str], done: set) -> list[dict]:
        """Each fitted store under the chosen selector (else the next trial selector that can hold it), measured."""
        rows = []
        for fit in fits:
            st = self.fit_under(fit["store"], ranked) if is_selection(fit) else fit
            label = spec_label(st if st is not None else selection(fit["store"], ranked[0], fit["keep"]))
            if label in done:
                continue
            done.add(label)
            if st is None:
                self.log(f"  {label:<48} skipped: no selector tried can hold this store")
            else:
                rows.append(self.measure(st))
        return rows


def search(model, stats: Optional[dict], windows: torch.Tensor, options: SearchOptions, *,
           task_eval: Optional[TaskBench] = None, tokenizer: Any = None,
           log: Optional[Callable[[str], None]] = None) -> dict[str, Any]:
    """Search the specs that fit ``options.budget`` bytes per prompt token (at fp16) on the tuning ``windows``;
    returns ``{"best": spec (its bases in memory), "full": the full cache's tuning result, "candidates": [...],
    "selector": the chosen one, "selectors_left_out": slow selectors not tried}`` (each candidate: its spec — the
    planner's bases as their fit —, label, bytes per token, ratio vs the fp16 full cache, tuning perplexity).
    ``stats``: the calibration statistics per RoPE mode the low-rank fits need.

    With ``options.objective`` ``tasks`` / ``mixed``, ``task_eval`` (a :class:`TaskBench`: tuning task instances,
    e.g. :class:`kvsplice.tasks.tuning.TuningTasks`) measures each candidate's accuracy, in order of tuning
    perplexity and instance by instance; every candidate row then has a ``task_acc`` — or ``task_stopped`` /
    ``task_skipped``: a row of no higher perplexity surely answers as many instances as it still could, so it cannot
    win (the pick is the one measuring all gives). ``tokenizer``: the model's, for candidates that re-read their
    prompt (KVzip: measured window by window). ``options.fit_len``: the prompt length at which the budget holds: a
    store with a fixed-size part (KIVI's full-precision window) costs fewer bytes per token on a longer prompt, so
    fitted there it keeps more tokens; its rows then also give ``at_fit``, the bytes per token at that length.

    Steps: the full cache; the usable selectors; the stores fitted to the budget; the selector trial
    (:meth:`_Search.choose_selector`); the stores under the chosen selector; their tasks; the pick."""
    if options.objective != "ppl" and task_eval is None:
        raise ValueError(f"objective {options.objective!r} needs task_eval (task instances to measure accuracy on)")
    s = _Search(model, stats, windows, options, task_eval, tokenizer, log or (lambda line: None))
    s.measure_full()
    selectors = s.usable_selectors()
    fits = s.fit_stores(selectors)
    ranked, trial_rows, left_out = s.choose_selector(fits, selectors)
    rows = list(trial_rows)
    rows += s.measure_stores(fits, ranked, {r["label"] for r in rows})
    s.with_tasks([r for r in rows if r not in trial_rows], against=trial_rows)
    best_row = s.best_of(rows)
    full = s.full
    return {"best": s.realise(best_row["spec"]), "chosen": best_row,
            "full": {"tuning_ppl": full["ppl"], "bytes_per_token": s.full_bpt,
                     **({"task_acc": full["task_acc"]} if "task_acc" in full else {})},
            "candidates": rows, "selector": ranked[0], "selectors_left_out": left_out,
            "objective": options.objective}
