"""Prefill and per-token decode time of compression methods in both doors, side by side
(``benchmarks/smollm2_speed.py``): every method's cache prefilled once (timed; a token selection's compression and
KVzip's reconstruction pass included), then its decode steps timed **round-robin** with the others', so a shared
machine's load falls on all alike; a method's time is its median step, its ratio that over the full cache's (the
first method). Thread-CPU and wall seconds; memory: the cache's bytes and the peak RSS growth during its prefill.
Doors: ``hf`` (transformers' forward with ``KVSpliceHFCache``; ``DynamicCache`` for the full cache) and ``decoder``
(:class:`kvsplice.decode.Decoder`, capacity preallocated). Steps feed the argmax token, last position's logits only.
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

__all__ = ["MethodRun", "PeakRSS", "measure", "method_factories", "prefill_and_steps", "prompt_ids"]


class PeakRSS:
    """The peak resident set size (bytes) of this process while the ``with`` block runs, sampled every
    ``interval`` seconds (``peak - start``: what the block added)."""

    def __init__(self, interval: float = 0.002) -> None:
        self.interval, self.start, self.peak = interval, 0, 0
        self._stop = threading.Event()

    @staticmethod
    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss())
            time.sleep(self.interval)

    def __enter__(self) -> "PeakRSS":
        self.start = self.peak = self.rss()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.rss())

    @property
    def grown(self) -> int:
        return self.peak - self.start


@dataclass
class MethodRun:
    """One method in one door: its step function (``ids (B, 1) → logits (B, 1, V)``), cache and timings."""

    label: str
    step: Callable[[torch.Tensor], torch.Tensor]
    cache: Any
    prefill_cpu: float = 0.0
    prefill_wall: float = 0.0
    prefill_rss: int = 0
    next_ids: Optional[torch.Tensor] = None
    cpu: list[float] = field(default_factory=list)
    wall: list[float] = field(default_factory=list)


def _clock() -> tuple[float, float]:
    return time.thread_time(), time.perf_counter()


def prefill_and_steps(model, door: str, method, ids: torch.Tensor, capacity: int):
    """``(prefill, step, cache)`` of ``method`` (a bound-able method, or ``None`` for the full cache) in ``door``:
    ``prefill()`` and ``step(ids)`` return the last position's logits ``(B, 1, V)``."""
    if door == "hf":
        from transformers import DynamicCache

        from kvsplice.hf import KVSpliceHFCache

        cache = DynamicCache() if method is None else KVSpliceHFCache(model, method)

        def run(x):
            return model(x, past_key_values=cache, use_cache=True, logits_to_keep=1).logits

        return (lambda: run(ids)), run, cache
    if door == "decoder":
        from kvsplice.decode import Decoder

        dec = Decoder(model, method)
        cache = dec.new_cache(ids.shape[0], capacity=capacity)
        return (lambda: dec(ids, cache, last_only=True)), (lambda x: dec(x, cache, last_only=True)), cache
    raise ValueError(f"door must be 'hf' or 'decoder', got {door!r}")


@torch.no_grad()
def measure(model, door: str, methods: Sequence[tuple[str, Any]], ids: torch.Tensor, *, rounds: int,
            warmup: int = 1) -> list[dict]:
    """Prefill every ``(label, method)`` (``method``: a method, or a callable ``ids → method`` for one built per
    prompt; ``None``: the full cache) on ``ids (B, T)``, then ``warmup + rounds`` round-robin decode steps →
    one row per method (the first is the reference of the ratios)."""
    from kvsplice.hf.measure import cache_nbytes

    runs: list[MethodRun] = []
    capacity = ids.shape[1] + warmup + rounds + 1
    for label, method in methods:
        if callable(method) and not hasattr(method, "attend"):
            method = method(ids)
        prefill, step, cache = prefill_and_steps(model, door, method, ids, capacity)
        with PeakRSS() as rss:
            c0, w0 = _clock()
            logits = prefill()
            c1, w1 = _clock()
        run = MethodRun(label, step, cache, c1 - c0, w1 - w0, rss.grown, logits[:, -1:].argmax(-1))
        runs.append(run)
    for r in range(warmup + rounds):
        for run in runs:
            c0, w0 = _clock()
            logits = run.step(run.next_ids)
            c1, w1 = _clock()
            run.next_ids = logits[:, -1:].argmax(-1)
            if r >= warmup:
                run.cpu.append(c1 - c0)
                run.wall.append(w1 - w0)
    ref_cpu, ref_wall = statistics.median(runs[0].cpu), statistics.median(runs[0].wall)
    rows = []
    for run in runs:
        cpu, wall = statistics.median(run.cpu), statistics.median(run.wall)
        nbytes = run.cache.nbytes() if hasattr(run.cache, "nbytes") else cache_nbytes(run.cache)  # transformers'

        rows.append({"method": run.label, "door": door, "batch": ids.shape[0], "context": ids.shape[1],
                     "prefill_s": run.prefill_cpu, "prefill_wall_s": run.prefill_wall,
                     "prefill_vs_full": run.prefill_cpu / runs[0].prefill_cpu,
                     "decode_ms": 1e3 * cpu, "decode_wall_ms": 1e3 * wall, "decode_vs_full": cpu / ref_cpu,
                     "decode_wall_vs_full": wall / ref_wall, "steps": len(run.cpu),
                     "cache_bytes": nbytes, "prefill_peak_rss_bytes": run.prefill_rss})
    return rows


def method_factories(args, model, tok, picks: dict):
    """``[(label, method | None | ids → method)]`` of ``args.methods`` (``picks``: name → spec, or a plan file from
    ``args.plan4`` / ``args.plan8``): the full cache is ``None``; a plan or a KVzip spec is built per prompt (it
    re-reads it); ``args.pick_scores == "random"`` gives the KVzip stacks random token scores."""
    from kvsplice.core.registry import build_method, needs_prompt
    from kvsplice.planning.spec import Plan

    out = []
    for name in args.methods:
        if name == "full":
            out.append(("full", None))
            continue
        plan_path = {"pick4x": args.plan4, "pick8x": args.plan8}.get(name)
        if plan_path:
            plan = Plan.load(plan_path, model)
            out.append((name, lambda ids, plan=plan: plan.method(ids.shape[1], prompt_ids=ids, tokenizer=tok)))
            continue
        spec = picks.get(name, name)
        if needs_prompt(spec) or spec.startswith("select:"):
            out.append((name, lambda ids, spec=spec: _scored(build_method(spec, prompt_len=ids.shape[1],
                                                                          prompt_ids=ids, tokenizer=tok),
                                                             model, ids, args.pick_scores)))
        else:
            out.append((name, build_method(spec)))
    return out


def _scored(method, model, ids: torch.Tensor, scores: str):
    """``method``, a KVzip selection given random token scores (``scores="random"``: its ``shared_scores``, so no
    reconstruction pass runs) — the decode-time layout of the stack without the cost of its prefill."""
    if scores == "random" and hasattr(method, "shared_scores"):
        cfg = model.config
        g = torch.Generator().manual_seed(0)
        method.shared_scores = {l: torch.rand(ids.shape[0], cfg.num_key_value_heads, ids.shape[1], generator=g)
                                for l in range(cfg.num_hidden_layers)}
    return method


def prompt_ids(tok, path: str, t: int, b: int) -> torch.Tensor:
    """``(b, t)`` token ids: consecutive ``t``-token slices of the text."""
    ids = tok.encode(Path(path).read_text())
    need = t * b
    while len(ids) < need:
        ids = ids + ids
    return torch.tensor(ids[:need]).view(b, t)
