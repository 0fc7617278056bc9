"""Prefill and per-token decode time of compression methods in both doors (``hf``: transformers' forward with
``KVSpliceHFCache`` or ``DynamicCache``; ``decoder``: ``Decoder``), the timings interleaved across methods
(:func:`interleaved`), and the cache's bytes and its prefill's peak RSS growth (``benchmarks/smollm2_speed.py``).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
from transformers import DynamicCache

from benchmarks.harness.timing import sampled
from kvsplice.core.build import build_method, needs_prompt
from kvsplice.decode import Decoder
from kvsplice.hf import KVSpliceHFCache
from kvsplice.hf.measure import cache_nbytes
from kvsplice.planning.spec import Plan

__all__ = ["interleaved", "measure", "method_factories", "peak_rss", "prefill_and_steps", "prompt_ids", "rss"]


def rss() -> int:
    """This process's resident set size (bytes)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@contextlib.contextmanager
def peak_rss(interval: float = 0.002) -> Iterator[dict]:
    """``{start, peak, grown}``: this process's peak resident set size (bytes) while the ``with`` block runs, sampled
    every ``interval`` seconds (``grown = peak - start``, what the block added; set as it ends)."""
    got = {}
    with sampled(rss, interval) as x:
        got.update(start=x[0], peak=x[0], grown=0)
        yield got
    got.update(peak=max(x), grown=max(x) - x[0])


def prefill_and_steps(model, door: str, method, ids: torch.Tensor, capacity: int):
    """``(prefill, step, cache)`` of ``method`` (a bound-able method, or ``None`` for the full cache) in ``door``:
    ``prefill()`` and ``step(ids)`` return the last position's logits ``(B, 1, V)``."""
    if door == "hf":
        cache = DynamicCache() if method is None else KVSpliceHFCache(model, method)
        run = lambda x: model(x, past_key_values=cache, use_cache=True, logits_to_keep=1).logits  # noqa: E731
        return (lambda: run(ids)), run, cache
    if door == "decoder":
        dec = Decoder(model, method)
        cache = dec.new_cache(ids.shape[0], capacity=capacity)
        return (lambda: dec(ids, cache, last_only=True)), (lambda x: dec(x, cache, last_only=True)), cache
    raise ValueError(f"door must be 'hf' or 'decoder', got {door!r}")


def interleaved(names: Sequence, repeats: int, one: Callable[[Any], Sequence[float]]) -> tuple[dict, dict]:
    """``(runs, medians)``: ``runs[name]``, ``repeats`` results of ``one(name)`` (a tuple of timings), the names
    interleaved within each repeat so a shared machine's load falls on all alike; ``medians[name]``: each timing's."""
    runs: dict = {n: [] for n in names}
    for _ in range(repeats):
        for n in names:
            runs[n].append(one(n))
    return runs, {n: [statistics.median(t) for t in zip(*v)] for n, v in runs.items()}


@torch.no_grad()
def measure(model, door: str, methods: Sequence[tuple[str, Any]], ids: torch.Tensor, *, rounds: int,
            warmup: int = 1) -> list[dict]:
    """Prefill every ``(label, method)`` (``method``: a method, a callable ``ids → method``, or ``None``: the full
    cache) on ``ids (B, T)`` once (timed), then ``warmup + rounds`` round-robin decode steps (argmax token, last
    logits only) → a row per method: median step, its ratio to the first method's, thread-CPU and wall."""
    runs = []  # per method: its step, cache, prefill times and next ids
    capacity = ids.shape[1] + warmup + rounds + 1
    for label, method in methods:
        if callable(method) and not hasattr(method, "attend"):
            method = method(ids)
        prefill, step, cache = prefill_and_steps(model, door, method, ids, capacity)
        with peak_rss() as mem:
            c0, w0 = time.thread_time(), time.perf_counter()
            logits = prefill()
            c1, w1 = time.thread_time(), time.perf_counter()
        runs.append(dict(label=label, step=step, cache=cache, prefill_cpu=c1 - c0, prefill_wall=w1 - w0, mem=mem,
                         next_ids=logits[:, -1:].argmax(-1)))

    def one_step(i: int) -> tuple[float, float]:
        c0, w0 = time.thread_time(), time.perf_counter()
        logits = runs[i]["step"](runs[i]["next_ids"])
        c1, w1 = time.thread_time(), time.perf_counter()
        runs[i]["next_ids"] = logits[:, -1:].argmax(-1)
        return c1 - c0, w1 - w0

    interleaved(range(len(runs)), warmup, one_step)
    steps, med = interleaved(range(len(runs)), rounds, one_step)  # med[i]: [CPU, wall] seconds
    rows = []
    for i, run in enumerate(runs):
        (cpu, wall), (ref_cpu, ref_wall), cache = med[i], med[0], run["cache"]
        rows.append({"method": run["label"], "door": door, "batch": ids.shape[0], "context": ids.shape[1],
                     "prefill_s": run["prefill_cpu"], "prefill_wall_s": run["prefill_wall"],
                     "prefill_vs_full": run["prefill_cpu"] / runs[0]["prefill_cpu"],
                     "decode_ms": 1e3 * cpu, "decode_wall_ms": 1e3 * wall, "decode_vs_full": cpu / ref_cpu,
                     "decode_wall_vs_full": wall / ref_wall, "steps": len(steps[i]),
                     "cache_bytes": cache.nbytes() if hasattr(cache, "nbytes") else cache_nbytes(cache),  # HF's
                     "prefill_peak_rss_bytes": run["mem"]["grown"]})
    return rows


def method_factories(args, model, tok, picks: dict):
    """``[(label, method | None | ids → method)]`` of ``args.methods`` (``picks``: name → spec, or a plan file from
    ``args.plan4`` / ``args.plan8``): the full cache is ``None``; a plan or a KVzip spec is built per prompt (it
    re-reads it); ``args.pick_scores == "random"`` gives the KVzip stacks random token scores."""
    out = []
    for name in args.methods:
        plan_path, spec = {"pick4x": args.plan4, "pick8x": args.plan8}.get(name), picks.get(name, name)
        if name == "full":
            out.append(("full", None))
        elif plan_path:
            plan = Plan.load(plan_path, model)
            out.append((name, lambda ids, plan=plan: plan.method(ids.shape[1], prompt_ids=ids, tokenizer=tok)))
        elif needs_prompt(spec) or spec.startswith("select:"):
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
    return torch.tensor((ids * -(-t * b // len(ids)))[: t * b]).view(b, t)  # the text repeated as needed
