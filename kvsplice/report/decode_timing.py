"""Decode-step timing of the model variants (``kvsplice bench-decode``): caches filled to a context, single
token steps timed and rolled back, optional profiling for cache copies, and the report table."""

from __future__ import annotations

import gc
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from kvsplice.report.memory import cache_bytes_formula
from kvsplice.io.cli import UsageError
from kvsplice.io.configs import named_config
from kvsplice.report.tables import show_table
from models.config import GPTConfig

DEFAULT_CONFIGS = ("gpt2", "mla:naive", "mla", "mla_kvsplice_50", "mla_kvsplice_70", "mla_kvsplice_90")


@dataclass
class BenchVariant:
    label: str
    cfg: GPTConfig
    graph: bool = False
    """Replay each step from a captured CUDA graph (:class:`models.graph_decode.GraphDecoder`)."""


def parse_variant(spec: str, max_ctx: int) -> BenchVariant:
    """``NAME[:naive|:absorb][:int8][:sdpa|:kernel][:graph]`` → a variant (``:int8``: the same model with an int8
    cache; ``:sdpa``: one-token steps on SDPA — ``decode_kernel="eager"``; ``:kernel``: on the split-KV kernel where
    it can run — ``decode_kernel="auto"``; neither: the default, :data:`models.kernels.DEFAULT_DECODE_KERNEL`;
    ``:graph``: steps replayed from a CUDA graph)."""
    name, impl, quant, graph, sdpa, kernel = spec, None, None, False, False, False
    if name.endswith(":graph"):
        name, graph = name[: -len(":graph")], True
    if name.endswith(":sdpa"):
        name, sdpa = name[: -len(":sdpa")], True
    elif name.endswith(":kernel"):
        name, kernel = name[: -len(":kernel")], True
    if name.endswith(":int8"):
        name, quant = name[: -len(":int8")], "int8"
    if ":" in name and name.rsplit(":", 1)[1] in ("naive", "absorb"):
        name, impl = name.rsplit(":", 1)
    label, cfg, _ = named_config(name)
    if impl is not None and cfg.attention != "mla":
        raise UsageError(f"{spec}: ':{impl}' applies only to MLA configs")
    cfg = cfg.replace(block_size=max(cfg.block_size, max_ctx + 1), dropout=0.0,
                      **({"mla_impl": impl} if impl else {}))
    if cfg.attention == "mla":
        suffix = "naive" if cfg.mla_impl == "naive" else "absorb"
        if label == "mla" or impl is not None or cfg.mla_impl == "naive":
            label = f"{label}_{suffix}"
    if quant:
        cfg = cfg.replace(cache_quant=quant)
        label = f"{label}+{quant}"
    if sdpa:
        cfg = cfg.replace(decode_kernel="eager")
        label = f"{label}+sdpa"
    if kernel:
        cfg = cfg.replace(decode_kernel="auto")
        label = f"{label}+kernel"
    return BenchVariant(label + ("+graph" if graph else ""), cfg, graph)


def variants_from_specs(specs: Sequence[str], max_ctx: int) -> tuple[list[BenchVariant], list[str]]:
    variants = [parse_variant(s, max_ctx) for s in specs]
    notes = []
    labels = [v.label for v in variants]
    if len(set(labels)) != len(labels):
        raise UsageError(f"duplicate variants {labels}")
    if not any(v.cfg.attention == "mha" and not v.graph for v in variants):
        base = variants[0].cfg.replace(attention="mha", kvsplice_keep=None)
        variants.insert(0, BenchVariant("mha", base))
        notes.append(f"added an MHA baseline with the shapes of {variants[1].label} (n_layer={base.n_layer}, "
                     f"d_model={base.d_model})")
    return variants, notes


# ------------------------------------------------------------------------------------------------ timing
def filled_cache(model, batch: int, ctx: int, generator: torch.Generator):
    """A cache of ``capacity=ctx+1`` holding ``ctx`` random tokens per layer (one random block, appended to every
    layer through ``cache.append``): timing only."""
    cache = model.new_cache(batch, capacity=ctx + 1)
    p = next(model.parameters())
    for name, shape in cache.specs[0].items():
        assert all(spec[name] == shape for spec in cache.specs)
    block = {name: torch.randn(batch, *shape[:-1], ctx, shape[-1], generator=generator).to(p.device, p.dtype)
             for name, shape in cache.specs[0].items()}
    for layer in range(cache.n_layer):
        cache.append(layer, **block)
    del block
    return cache


@torch.inference_mode()
def time_steps(model, cache, ctx: int, tok: torch.Tensor, warmup: int, repeats: int,
               max_seconds: Optional[float] = None, graph: bool = False) -> list[float]:
    """Seconds of ``repeats`` single-token steps at context ``ctx`` (after ``warmup`` untimed ones). With
    ``max_seconds``, stop early once warm-up + timed steps have taken that long (at least one timed step).

    On CUDA each step starts on an idle GPU (synchronised) and is timed by CUDA events around it: the time from
    the step's first launch to its last kernel's end, launch gaps included. ``graph``: the steps replay a CUDA graph
    captured over a fixed-capacity view of the cache (:class:`models.graph_decode.GraphDecoder`)."""
    cuda = tok.device.type == "cuda"
    if graph:
        from models.graph_decode import GraphDecoder

        decoder = GraphDecoder(model, cache)
        step = decoder.step
    else:
        step = lambda t: model(t, cache=cache)  # noqa: E731
    out: list[float] = []
    spent = 0.0
    start, end = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if cuda else (None, None)
    for i in range(warmup + repeats):
        if cuda:
            torch.cuda.synchronize(tok.device)
            start.record()
        t0 = time.perf_counter()
        logits = step(tok)
        if cuda:
            end.record()
            end.synchronize()
            dt = start.elapsed_time(end) / 1e3
        else:
            dt = time.perf_counter() - t0
        spent += time.perf_counter() - t0
        cache.truncate(ctx)
        if i >= warmup:
            out.append(dt)
        if max_seconds is not None and spent >= max_seconds and out:
            break
    if not torch.isfinite(logits).all():
        raise RuntimeError("non-finite logits in the benchmark step")
    return out


COPY_OPS = ("aten::copy_", "aten::clone", "aten::contiguous", "aten::_to_copy", "aten::cat", "aten::stack")


def _numel(shape) -> int:
    if not isinstance(shape, (list, tuple)) or not all(isinstance(d, int) for d in shape):
        return 0
    n = 1
    for d in shape:
        n *= d
    return n


@torch.inference_mode()
def profile_step(model, cache, ctx: int, tok: torch.Tensor, steps: int = 2, top: int = 8) -> dict:
    """``torch.profiler`` over ``steps`` decode steps at context ``ctx``: the top ops by self CPU time per step, and
    the largest tensor any copy / concatenation op touched (to check that no step copies the cache)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(steps):
            model(tok, cache=cache)
            cache.truncate(ctx)
    by_shape = prof.key_averages(group_by_input_shape=True)
    ops = sorted(by_shape, key=lambda e: e.self_cpu_time_total, reverse=True)
    total_us = sum(e.self_cpu_time_total for e in by_shape)
    top_ops = [dict(op=e.key, input_shapes=str(e.input_shapes)[:120], calls_per_step=e.count / steps,
                    self_ms_per_step=e.self_cpu_time_total / 1e3 / steps,
                    share=e.self_cpu_time_total / total_us if total_us else 0.0) for e in ops[:top]]
    copies = [(max((_numel(s) for s in (e.input_shapes or [])), default=0), e.key, str(e.input_shapes)[:120])
              for e in by_shape if e.key in COPY_OPS]
    biggest = max(copies, default=(0, None, None))
    per_layer = sum(_numel(t.shape) for t in cache.get(0).values())  # cache elements of one layer at ctx
    return dict(ctx=ctx, steps=steps, total_ms_per_step=total_us / 1e3 / steps, top_ops=top_ops,
                largest_copy_elems=biggest[0], largest_copy_op=biggest[1], largest_copy_shapes=biggest[2],
                cache_elems_per_layer=per_layer, copies_cache=biggest[0] >= per_layer)


def _quantile(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo, hi = int(pos), min(int(pos) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def run(variants: Sequence[BenchVariant], ctxs: Sequence[int], *, batch: int, dtype: torch.dtype,
        repeats: int, warmup: int, rounds: int, device: torch.device, progress: bool = True,
        seed: int = 0, profile: Optional[dict] = None, max_seconds: Optional[float] = None) -> list[dict]:
    """Timed rows, one per (variant, context). With ``profile`` (a dict), :func:`profile_step` at the largest
    context is stored in it per variant (after the timed steps of round 0, so the code paths are warm).
    ``max_seconds`` caps the time spent per (variant, context), split evenly over the rounds."""
    from models.gpt import GPT
    from tqdm.auto import tqdm

    models = {}
    for v in variants:  # same seed per variant: identical weights where shapes agree (mla naive == absorbed)
        torch.manual_seed(seed)
        models[v.label] = GPT(v.cfg).to(device=device, dtype=dtype).eval()
    per_round = [repeats // rounds + (1 if r < repeats % rounds else 0) for r in range(rounds)]
    times: dict[tuple[str, int], list[float]] = {(v.label, c): [] for v in variants for c in ctxs}
    gen = torch.Generator().manual_seed(seed)
    total = len(ctxs) * sum(1 for n in per_round if n) * len(variants)
    with tqdm(total=total, desc="bench_decode", unit="run", file=sys.stderr, disable=not progress,
              dynamic_ncols=True) as bar:
        for r, n in enumerate(per_round):
            if n == 0:
                continue
            # every round visits every context and variant (contexts alternate direction, variants rotate), so
            # slow drifts of the background load hit all (variant, context) cells alike
            for ctx in (ctxs if r % 2 == 0 else ctxs[::-1]):
                order = list(variants[r % len(variants):]) + list(variants[: r % len(variants)])
                for v in order:
                    bar.set_postfix_str(f"round {r + 1} ctx={ctx} {v.label}")
                    model = models[v.label]
                    cache = filled_cache(model, batch, ctx, gen)
                    tok = torch.randint(0, v.cfg.vocab_size, (batch, 1), generator=gen).to(device)
                    times[(v.label, ctx)] += time_steps(model, cache, ctx, tok, warmup, n,
                                                          None if max_seconds is None else max_seconds / rounds,
                                                          graph=v.graph)
                    if profile is not None and ctx == max(ctxs) and r == 0:
                        profile[v.label] = profile_step(model, cache, ctx, tok)
                    del cache
                    gc.collect()
                    bar.update(1)
    rows = []
    for v in variants:
        for ctx in ctxs:
            ts = [t * 1e3 for t in times[(v.label, ctx)]]
            rows.append(dict(
                variant=v.label, attention=v.cfg.attention, mla_impl=v.cfg.mla_impl if v.cfg.attention == "mla"
                else None, cuda_graph=v.graph, cache_dim=v.cfg.cache_dim, ctx=ctx, batch=batch, n=len(ts),
                median_ms=statistics.median(ts), p25_ms=_quantile(ts, 0.25), p75_ms=_quantile(ts, 0.75),
                min_ms=min(ts), times_ms=[round(t, 4) for t in ts],
                cache_bytes=cache_bytes_formula(v.cfg, ctx, dtype, batch),
            ))
    base = next(v.label for v in variants if v.cfg.attention == "mha" and not v.graph)
    mha = {r["ctx"]: r["median_ms"] for r in rows if r["variant"] == base}
    med = {(r["variant"], r["ctx"]): r["median_ms"] for r in rows}
    for r in rows:
        r["baseline"] = base
        r["speedup_vs_mha"] = mha[r["ctx"]] / r["median_ms"]
        name = r["variant"]
        if name.endswith("+int8") and (name[: -len("+int8")], r["ctx"]) in med:  # next to its unquantised twin
            r["time_vs_unquantised"] = r["median_ms"] / med[(name[: -len("+int8")], r["ctx"])]
        if name.endswith("+graph") and (name[: -len("+graph")], r["ctx"]) in med:  # next to its eager twin
            r["time_vs_eager"] = r["median_ms"] / med[(name[: -len("+graph")], r["ctx"])]
    return rows


# ------------------------------------------------------------------------------------------------ output
def title(report: dict) -> str:
    return (f"Decode step time — {report['dtype']}, batch {report['batch']}, {report['device']}, "
            f"{report['threads']} thread{'s' if report['threads'] != 1 else ''}, median of "
            f"{'<=' if report.get('max_seconds') else ''}{report['repeats']} steps")


def growth(rows: Sequence[dict]) -> dict[str, float]:
    """Per variant: median step time at the largest context / at the smallest."""
    out = {}
    for v in dict.fromkeys(r["variant"] for r in rows):
        rs = sorted((r for r in rows if r["variant"] == v), key=lambda r: r["ctx"])
        out[v] = rs[-1]["median_ms"] / rs[0]["median_ms"]
    return out


def table_rows(report: dict) -> tuple[list[str], list[list[str]]]:
    rows, ctxs = report["results"], report["ctx"]
    head = ["variant", "cached/token/layer"] + [f"ctx {c}: ms/step (× vs MHA)" for c in ctxs]
    if len(ctxs) > 1:
        head.append(f"growth {ctxs[0]}→{ctxs[-1]}")
    body = []
    g = report["growth"]
    for v in dict.fromkeys(r["variant"] for r in rows):
        by_ctx = {r["ctx"]: r for r in rows if r["variant"] == v}
        cells = [v, str(by_ctx[ctxs[0]]["cache_dim"])]
        for c in ctxs:
            r = by_ctx[c]
            cells.append(f"{r['median_ms']:.{3 if r['median_ms'] < 1 else 1}f} ({r['speedup_vs_mha']:.2f}×)"
                         + (f", {r['time_vs_unquantised']:.2f}× unquant." if "time_vs_unquantised" in r else "")
                         + (f", {r['time_vs_eager']:.2f}× eager" if "time_vs_eager" in r else ""))
        if len(ctxs) > 1:
            cells.append(f"{g[v]:.2f}×")
        body.append(cells)
    return head, body


def print_table(report: dict, markdown: bool = False) -> None:
    show_table(title(report), *table_rows(report), markdown=markdown, caption=report["note"])


def print_profiles(profiles: dict) -> None:
    for label, p in profiles.items():
        print(f"\nprofile {label} @ ctx {p['ctx']}: {p['total_ms_per_step']:.1f} ms/step of op self time; largest "
              f"copy/cat {p['largest_copy_elems']:,} elements ({p['largest_copy_op']} {p['largest_copy_shapes']}) "
              f"vs {p['cache_elems_per_layer']:,} cached elements per layer -> "
              f"{'a cache-sized copy per step' if p['copies_cache'] else 'no cache-sized copy'}")
        for o in p["top_ops"]:
            print(f"  {o['self_ms_per_step']:8.2f} ms {100 * o['share']:5.1f}%  x{o['calls_per_step']:<5g} {o['op']} "
                  f"{o['input_shapes']}")
