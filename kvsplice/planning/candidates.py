"""The planner's candidates — the one module where ``plan`` reads its ``--stores`` and ``--selectors`` specs
(:func:`store_specs`, :func:`check_selector`): the storage methods it tries (:func:`candidate_stores`), the selectors of its trial
(:data:`DEFAULT_SELECTORS`, which of them prefill fast: :func:`fast_prefill`), a store under a selector
(:func:`selection`), each fitted to a byte budget (:func:`fit_budget`, by the methods' closed forms:
:func:`bytes_per_token`) and whether a stack runs a model (:func:`runs_on`). :mod:`kvsplice.planning.search` measures
them."""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, Sequence

import torch

from kvsplice.core.build import build_method
from kvsplice.core.registry import METHODS, SELECTORS
from kvsplice.core.short_form import parse_selector

__all__ = ["DEFAULT_SELECTORS", "DEFAULT_STORES", "FAST_STRIDE", "INT8", "LOWRANK_RATIOS", "bytes_per_token",
           "candidate_stores", "check_selector", "fast_prefill", "fit_budget", "is_selection", "least_bytes_per_token",
           "lowrank_bases", "runs_on",
           "selection", "store_specs"]

INT8 = {"name": "dense", "cache_quant": "int8"}
"""int8 K/V rows: the store of the selector trial (nearly lossless: the selection's own loss)."""
DEFAULT_SELECTORS = ("snapkv", "observed_attention", "kvzip", "kvzip(mix=observed_attention,share=0.1)",
                     "kvzip(mix=observed_attention,share=0.25)", "kvzip(heads=union)",
                     "kvzip(mix=observed_attention,share=0.1,heads=union)", "kvzip(heads=pooled,decoded=int8)",
                     "kvzip(mix=observed_attention,share=0.1,heads=pooled,decoded=int8)",
                     "kvzip(mix=observed_attention,share=0.1,heads=pooled,layers=50%-67%,decoded=int8)",
                     "kvzip(mix=observed_attention,share=0.1,heads=pooled,layers=33%-67%,decoded=int8)",
                     "observed_attention(stride=8)", "kvzip(recon=local)", "kvzip(recon=local,heads=union)",
                     "kvzip(recon=local,heads=pooled,decoded=int8)",
                     "kvzip(recon=local,heads=pooled,layers=50%-67%,decoded=int8)",
                     "kvzip(recon=local,heads=pooled,layers=33%-67%,decoded=int8)")
"""The selector trial's entries: attention-based (the next words), KVzip (a later question), KVzip keeping a
tenth / a quarter of its budget by ObservedAttention (both), KVzip whose KV heads keep one token set per layer, and
KVzip whose KV heads draw from one budget per layer (non-uniform head budgets; dense stores only) — in every layer,
or only in a band of the depth (the others keep each head's own tokens: SmolLM2's tuning passkeys were lost where
the early and the last layers pooled, docs/tasks.md "Where to pool"); the pooled ones hold the tokens decoded after
the prompt (a later question, the answer) as int8 rows whatever the store (under ``k8v4h`` a quarter of SmolLM2's
tuning perplexity loss at 4× was the int4 values of decoded tokens; the budget counts the prompt's bytes); and
the fast-prefill forms (:func:`fast_prefill`): ObservedAttention with every 8th query voting and KVzip scoring by the
prefill's own queries (``recon=local``), which the pick prefers where they hold the tuning tasks
(:data:`kvsplice.planning.search.PREFILL`)."""

MIN_KEEP = 1 / 64
"""The least fraction of the prompt a selection keeps (:func:`fit_budget`): below it no stack fits the budget."""

LOWRANK_RATIOS = (1.5, 2.0, 3.0)
"""The rank ratios (times fewer numbers than the full K/V cache) of the planner's low-rank stores."""


def lowrank_bases(stats: dict, ratio: float, rope: str, cache: Optional[dict] = None):
    """Fisher bases of ``stats[rope]`` with ranks allocated under ``2·L·Hkv·d / ratio`` numbers per token."""
    from kvsplice.lowrank.allocate import allocate_ranks
    from kvsplice.lowrank.fits import fit_bases

    key = (round(ratio, 6), rope)
    if cache is not None and key in cache:
        return cache[key]
    from kvsplice.lowrank.allocate import cost_curves

    s = stats[rope]
    groups = 2 * s.n_layer * s.n_kv_head
    n = max(groups, min(groups * s.head_dim, round(groups * s.head_dim / ratio)))
    curves = None if cache is None else cache.get(("curves", rope))
    if curves is None:
        curves = cost_curves(s, "fisher")
        if cache is not None:
            cache[("curves", rope)] = curves
    alloc = allocate_ranks(s, n, "fisher", curves=curves)
    bases = fit_bases(s, "fisher", ranks=alloc.ranks)
    bases.meta.update({"alloc_ratio": ratio, "alloc_predicted_nll": alloc.predicted_nll, **alloc.split()})
    if cache is not None:
        cache[key] = bases
    return bases


def candidate_stores(has_rope: bool, head_dim: int, lowrank_ratios: Sequence[float] = LOWRANK_RATIOS, *,
                     rotary_dim: Optional[int] = None) -> list[dict[str, Any]]:
    """The storage methods the planner tries (see the module docstring) as specs; KIVI groups of
    ``min(32, head_dim)``; ``rotary_dim``: the dims of a head RoPE rotates (``None``: all — KIVI-2 with keys
    quantised before RoPE needs that). A low-rank store's ``bases`` is the planner's fit of them
    (``{"fit": "fisher", "ratio": r, "rope": mode}``), made from the calibration statistics when measured."""
    stores: list[dict[str, Any]] = [{"name": "dense"}, {"name": "dense", "cache_quant": "int8"}]
    if head_dim % 2 == 0:  # int8 keys, int4 values (Hadamard-rotated where the head dimension is a power of two)
        stores.append({"name": "dense", "cache_quant": "int8", "value_quant": "int4",
                       **({"rotate": True} if head_dim & (head_dim - 1) == 0 else {})})
    g = min(32, head_dim)
    if head_dim % g == 0:
        stores += [{"name": "kivi", "bits": b, "group": g, "residual": r} for b in (4, 2) for r in (128, 32)]
        if has_rope and (rotary_dim is None or rotary_dim == head_dim):
            stores += [{"name": "kivi_prerope", "bits": 2, "group": g, "residual": r} for r in (128, 32)]
    if head_dim % 64 == 0:  # 4-bit codes in groups of 64: 4.5 bits per number (3.56x smaller than fp16)
        stores += [{"name": "kivi", "bits": 4, "group": 64, "residual": r} for r in (128, 32)]
    for ratio in lowrank_ratios:
        for rope in (("post", "pre") if has_rope else ("none",)):
            stores.append({"name": "lowrank", "bases": {"fit": "fisher", "ratio": ratio, "rope": rope},
                           "cache_quant": "int8"})
    return stores


def bytes_per_token(method, adapter, prompt_len: int, held: int, dtype: torch.dtype = torch.float16) -> float:
    """Bytes per prompt token of ``method`` holding ``held`` tokens per layer after a ``prompt_len`` prefill, stored
    at ``dtype`` (the method's closed form)."""
    p = adapter.param()
    bound = method.bind(adapter, dtype=p.dtype, device=p.device)
    return bound.bytes_formula(1, held, dtype) / prompt_len


def selection(store: dict[str, Any], selector: str, keep: float = 1.0) -> dict[str, Any]:
    """The spec of ``selector`` keeping ``keep`` of the prompt over the storage ``store`` (``selector``: a selector
    ``NAME[(KEY=VALUE,...)]``, or a selection that scores by its own pass — ``kvzip``,
    ``kvzip(mix=observed_attention,share=0.5)``)."""
    sel = parse_selector(selector)
    if sel["name"] not in SELECTORS and getattr(METHODS.get(sel["name"]), "select_form", False):
        return {**sel, "keep": keep, "store": store}
    return {"name": "token_selection", "selector": sel, "keep": keep, "store": store}


def check_selector(selector: str) -> str:
    """``selector`` if :func:`selection` can build it (a known name, arguments its class takes), else a one-line
    ``ValueError`` — also for an argument that would do nothing (``reach=`` without ``recon=local``: only the local
    reconstruction looks ``reach`` tokens around each query; a label showing it would claim a difference there is
    not)."""
    sel = parse_selector(selector)
    if sel.get("name") == "kvzip" and "reach" in sel and sel.get("recon", "exact") != "local":
        raise ValueError(f"{selector}: reach= sets how far recon=local's queries look; without recon=local it does "
                         f"nothing (give recon=local, or leave reach out)")
    build_method(selection(INT8, selector, 0.5), prompt_len=2)
    return selector


def is_selection(spec: dict[str, Any]) -> bool:
    """``spec`` keeps a fraction of the prompt (a token selection, KVzip)."""
    return "keep" in spec


def fit_budget(store: dict[str, Any], adapter, prompt_len: int, budget: float, *, selector: str,
               realise: Callable[[dict], dict] = lambda s: s, min_keep: float = MIN_KEEP) -> Optional[dict[str, Any]]:
    """``store`` alone if it fits ``budget`` bytes per prompt token, else under ``selector`` keeping the most prompt
    tokens that fit (``None`` when even ``min_keep`` of them does not, or the store cannot hold a selection — pre-RoPE
    coefficients need their positions). ``realise``: the spec with the planner's bases made."""
    if bytes_per_token(build_method(realise(store)), adapter, prompt_len, prompt_len) <= budget:
        return store
    sel = selection(store, selector)
    try:
        method = build_method(realise(sel), prompt_len=prompt_len)
        bytes_per_token(method, adapter, prompt_len, 1)
    except ValueError:  # a store that cannot hold a token subset
        return None
    lo, hi = 0, prompt_len - 1  # the largest n with bytes(n) <= budget (bytes grow with n)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if bytes_per_token(method, adapter, prompt_len, mid) <= budget:
            lo = mid
        else:
            hi = mid - 1
    if lo < max(1, math.ceil(min_keep * prompt_len)):
        return None
    return selection(store, selector, lo / prompt_len)




def least_bytes_per_token(stores: Sequence[Any], adapter, prompt_len: int, min_keep: float = MIN_KEEP) -> float:
    """A lower bound of the bytes per prompt token any of ``stores`` reaches on a ``prompt_len``-token prompt, alone
    or under a selection keeping ``min_keep`` of it (:func:`fit_budget`'s least), from the model's shapes alone —
    before any calibration: a store's closed form holding that many tokens; the planner's low-rank fits (bases made
    from the statistics) by their rank ratio's int8 coefficients. A budget below it fits nothing."""
    from kvsplice.evaluation.protocol import full_bytes_per_token

    held = max(1, math.ceil(min_keep * prompt_len))
    full = full_bytes_per_token(adapter)
    least = full
    for store in stores:
        bases = store.get("bases") if isinstance(store, dict) else None
        if isinstance(bases, dict):  # int8 coefficients: 1 byte for each 2 of fp16, ratio times fewer numbers
            least = min(least, full / (2 * float(bases.get("ratio", 1.0))) * held / prompt_len)
            continue
        try:
            least = min(least, bytes_per_token(build_method(store), adapter, prompt_len, held))
        except (ValueError, TypeError, OSError):  # a store this model cannot hold: it fits no budget either
            continue
    return least


def runs_on(model, method) -> bool:
    """Whether ``method`` can decode ``model``: a cache that cannot drop the tokens leaving a sliding window (KIVI's,
    a selection over it) cannot run a model with sliding-window layers (Gemma-3, Mistral, ...); a selection refuses
    a store it cannot hold (``kvzip(heads=pooled)``: dense rows only) or a band of the depth holding none of the
    model's layers (``layers=0%-5%`` of a 5-layer model: the planner skips such selectors)."""
    from kvsplice.decode import Decoder

    try:
        Decoder(model, method).new_cache(1, capacity=1)
    except ValueError:
        return False
    return True


def fast_prefill(selector: str) -> bool:
    """Whether ``selector``'s prefill + compression costs about one prefill: not KVzip's exact reconstruction pass
    (``recon=exact`` re-reads the whole prompt through every layer) nor ObservedAttention with every query voting
    (``stride`` below :data:`FAST_STRIDE`: each layer's causal softmax again) — alone or mixed into KVzip."""
    sel = parse_selector(selector) if isinstance(selector, str) else dict(selector)
    name = sel.get("name")
    if name == "kvzip":
        return sel.get("recon", "exact") == "local" and (sel.get("mix") is None or fast_prefill(sel["mix"]))
    if name == "observed_attention":
        return int(sel.get("stride", 1)) >= FAST_STRIDE
    return True


FAST_STRIDE = 8
"""ObservedAttention with every 8th query voting: a tenth of the prefill's attention at 8k (docs/tasks.md)."""


DEFAULT_STORES = "default"
"""``plan --stores default``: the built-in candidate stores (:func:`candidate_stores`)."""


def store_specs(given: Optional[Sequence[str]]) -> list:
    """``--stores``: each a storage method's spec — the short form, inline JSON or a ``.json`` spec file (its files
    named relative to the working directory, :func:`kvsplice.core.spec_files.rebased`) — checked without a model
    (names, and the values of a store that reads no file, by its constructor),
    or :data:`DEFAULT_STORES`; a one-line ``ValueError`` naming the option otherwise."""
    from kvsplice.core.build import check_spec
    from kvsplice.core.short_form import load_spec
    from kvsplice.core.spec_files import rebased

    out: list = []
    for text in given or [DEFAULT_STORES]:
        if text == DEFAULT_STORES:
            out.append(text)
            continue
        try:
            spec, base_dir = load_spec(text)
            spec = check_spec(spec if base_dir is None else rebased(spec, base_dir))
        except ValueError as e:
            raise ValueError(f"--stores {e}" if text in str(e) else f"--stores {text}: {e}") from None
        if not METHODS[spec["name"]].is_storage:
            raise ValueError(f"--stores {text}: {spec['name']} is not a storage method (it cannot hold a token "
                             f"selection); storage methods: {', '.join(n for n, c in METHODS.items() if c.is_storage)}")
        if not METHODS[spec["name"]].spec_files:  # its arguments' values, by its constructor (bits=99 is refused)
            try:
                build_method(spec, prompt_len=1)
            except (ValueError, TypeError) as e:
                raise ValueError(f"--stores {text}: {str(e).splitlines()[0]}") from None
        out.append(spec)
    return out
