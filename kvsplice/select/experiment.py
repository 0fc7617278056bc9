"""The BalanceKV paper's single-layer experiment (``kvsplice bench-balance``, whose docstring says what
is measured): per layer and number of halvings ``T``, the attention approximation error of BalanceKV vs uniform
sampling vs coin-flip halving over real text windows."""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Optional

import torch

from kvsplice.adapters import adapter_for, model_info
from kvsplice.loading import iter_texts, token_stream
from kvsplice.adapters.capture import extract_qkv
from kvsplice.core.attention import reference_attention, weighted_attend
from kvsplice.select.experiment_options import ARMS, BenchBalanceOptions
from kvsplice.select.selectors import BalanceKVSelector, TokenSelector, UniformSelector

THRESHOLD_RULE = ("median: c = c_scale * median_i kappa(x_i, x_i) per block of block_size tokens, clamped greedy "
                  "steps beyond c; kernel exp(<k,k'>s)(<v,v'> + mean|v|^2) on block-centred keys")

__all__ = ["ARMS", "BenchError", "keep_plan", "layer_errors", "make_arm", "plot", "print_table", "run_bench",
           "to_markdown"]


class BenchError(RuntimeError):
    """A bad argument / input for the benchmark (printed as one line)."""


# ---------------------------------------------------------------------------------------------------- plan
def keep_plan(c: int, T: int, n_sink: int, n_recent: int, t_max: Optional[int] = None) -> dict:
    """Exactly what is kept of a context of ``c`` tokens at ``T`` halvings (see the module docstring); the middle
    is a multiple of ``2^t_max`` (default ``T``) so that runs over several ``T`` keep the same intact tokens."""
    t_max = T if t_max is None else max(T, t_max)
    if T < 0:
        raise BenchError(f"T must be >= 0, got {T}")
    s = min(n_sink, c)
    r = min(n_recent, c - s)
    m = c - s - r
    rem = m % (2 ** t_max)
    middle = m - rem
    kept_middle = middle // (2 ** T)
    budget = s + r + rem + kept_middle
    return {"T": T, "context": c, "sinks": s, "recent_intact": r + rem, "middle": middle,
            "middle_kept": kept_middle, "middle_weight": 2 ** T, "budget": budget,
            "compression_middle": 2 ** T, "compression_total": c / budget}


def make_arm(name: str, plan: dict, *, block_size: int = 64, c_scale: float = 1.0, kernel_temp: float = 1.0,
             seed: int = 0) -> TokenSelector:
    """The selector of ``name`` for ``plan`` (:func:`keep_plan`); identical intact tokens for every arm."""
    s, r = plan["sinks"], plan["recent_intact"]
    T = plan["T"]
    if name == "uniform":
        return UniformSelector(n_sink=s, n_recent=r, seed=seed)
    if name in ("balancekv", "coinflip"):
        cs = math.inf if name == "coinflip" else c_scale
        # n_recent is the planned intact window; plan fits exactly (middle % 2^T == 0), so one segment of T halvings
        return BalanceKVSelector(n_sink=s, n_recent=r, block_size=block_size, n_halvings=max(T, 1), c_scale=cs,
                                 kernel_temp=kernel_temp, seed=seed)
    raise BenchError(f"unknown selector {name!r}; choose from {', '.join(ARMS)}")


# ---------------------------------------------------------------------------------------------- measure
def _exact(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(q·kᵀ·s)·v, no mask: q (B, Hq, n, d), k, v (B, Hkv, C, d) → (B, Hq, n, dv) in float64."""
    b, hq, n, d = q.shape
    hkv = k.shape[1]
    qq = q.reshape(b, hkv, (hq // hkv) * n, d)  # (B, Hkv, g·n, d): a group's queries share their KV head
    return reference_attention(qq, k, v, scale)[2].reshape(b, hq, n, -1)  # (B, Hq, n, dv)


def layer_errors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, selector: TokenSelector,
                 budget: int) -> tuple[float, float]:
    """``(rel, rel_q)`` of the selector's estimate vs exact attention of the queries over the context.

    q (B, Hq, n, d) queries, k, v (B, Hkv, C, d) the context. One selection per (sequence, KV head)."""
    b, hkv, c, d = k.shape
    n = q.shape[2]
    a = _exact(q, k, v, scale)
    idx, logw = selector.select(k.reshape(b * hkv, c, d), v.reshape(b * hkv, c, -1), budget)  # (B·Hkv, n_keep) each
    # (B, Hkv, n_keep, d)
    kk = torch.gather(k.reshape(b * hkv, c, d), 1, idx[..., None].expand(-1, -1, d)).view(b, hkv, -1, d)
    # (B, Hkv, n_keep, dv)
    vv = torch.gather(v.reshape(b * hkv, c, -1), 1, idx[..., None].expand(-1, -1, v.shape[-1])).view(b, hkv, -1,
                                                                                                       v.shape[-1])
    # every query sees every kept key: fold the queries into the head axis (Tq = 1, no causal mask), keeping the
    # grouped layout (query head h, query i) -> KV head h // g
    qf = q.double().reshape(b, q.shape[1] * n, 1, d)  # (B, Hq·n, 1, d): one query per row, Tq = 1
    # logw (B, Hkv, n_keep) → z (B, Hq·n, 1, dv)
    z = weighted_attend(qf, kk.double(), vv.double(), logw.view(b, hkv, -1).double(), scale=scale)
    z = z.reshape(b, q.shape[1], n, -1)  # (B, Hq, n, dv)
    err = z - a
    rel = (err.norm() / a.norm()).item()
    rel_q = (err.norm(dim=-1) / a.norm(dim=-1).clamp_min(1e-30)).mean().item()
    return rel, rel_q


# ------------------------------------------------------------------------------------------------- run
def _windows(ids: torch.Tensor, context: int, n_windows: int) -> torch.Tensor:
    n = ids.numel() // context
    if n < 1:
        raise BenchError(f"the text has {ids.numel()} tokens, fewer than one context of {context}")
    return ids[: min(n, n_windows) * context].view(-1, context)  # (N, C): N windows of C tokens


def run_bench(model, tokenizer, opts: BenchBalanceOptions, *, max_positions: Optional[int] = None,
              progress: bool = True) -> dict:
    """Run the experiment ``opts`` asks for on ``opts.data`` (``opts.model``: what ``model`` was loaded from);
    returns the JSON-able report (``rows``: one per layer × T × method)."""
    data, layers, Ts, seeds, n_queries = opts.data, opts.layers, opts.T, opts.seeds, opts.n_queries
    context, windows, n_sink, n_recent = opts.context, opts.windows, opts.n_sink, opts.n_recent
    block_size, c_scale, kernel_temp, methods = opts.block_size, opts.c_scale, opts.kernel_temp, opts.methods
    info = model_info(model)
    adapter = adapter_for(model)
    ctx = context or min(max_positions or 1024, 1024)
    if max_positions is not None and ctx > max_positions:
        raise BenchError(f"--context {ctx} exceeds the model's {max_positions} positions")
    if not 1 <= n_queries < ctx:
        raise BenchError(f"--n-queries must be in [1, {ctx - 1}], got {n_queries}")
    windowed = [l for l in range(info.n_layer) if (adapter.window(l) or ctx) < ctx]  # a window cuts the context
    asked = bool(layers)
    layers = [l for l in range(info.n_layer) if l not in windowed] if not layers else list(layers)
    bad = [l for l in layers if not 0 <= l < info.n_layer]
    if bad:
        raise BenchError(f"--layers {bad} out of range: the model has {info.n_layer} layers")
    cut = [l for l in layers if l in windowed] if asked else ([] if layers else windowed)
    if cut:
        full = [l for l in range(info.n_layer) if l not in windowed]
        raise BenchError(f"layers {cut} attend only their last {adapter.window(cut[0])} tokens (sliding window), "
                         f"fewer than --context {ctx}: use --context <= {adapter.window(cut[0])}"
                         + (f" or the full-attention --layers {' '.join(map(str, full))}" if full else ""))
    ids, n_stories = token_stream(iter_texts(data), tokenizer, max_tokens=ctx * windows)
    batch = _windows(ids, ctx, windows)  # (W, ctx)
    c = ctx - n_queries
    t0 = time.time()
    qkv = extract_qkv(model, batch, rope="post" if info.has_rope else None)
    plans = {T: keep_plan(c, T, n_sink, n_recent, max(Ts)) for T in Ts}
    if any(p["middle_kept"] < 1 for p in plans.values()):
        raise BenchError(f"context {c} is too short for T up to {max(Ts)} with {n_sink} sinks + {n_recent} recent")
    rows = []
    for l in layers:
        q = qkv[l]["q"][:, :, c:].double()  # (W, Hq, n, d)
        k = qkv[l]["k"][:, :, :c].double()  # (W, Hkv, C, d)
        v = qkv[l]["v"][:, :, :c].double()
        scale = adapter.scale(l)
        for T in Ts:
            plan = plans[T]
            for name in methods:
                rel, rel_q = [], []
                for seed in range(seeds):
                    sel = make_arm(name, plan, block_size=block_size, c_scale=c_scale, kernel_temp=kernel_temp,
                                      seed=seed)
                    e, eq = layer_errors(q, k, v, scale, sel, plan["budget"])
                    rel.append(e)
                    rel_q.append(eq)
                rt = torch.tensor(rel)
                rq = torch.tensor(rel_q)
                sd = lambda x: float(x.std(unbiased=True)) if x.numel() > 1 else 0.0  # noqa: E731
                rows.append({"layer": l, "T": T, "method": name, "budget": plan["budget"],
                             "mean": float(rt.mean()), "std": sd(rt), "rel_q_mean": float(rq.mean()),
                             "rel_q_std": sd(rq), "per_seed": rel})
            if progress:
                msg = ", ".join(f"{r['method']} {r['mean']:.4f}" for r in rows[-len(methods):])
                print(f"[bench_balance] layer {l} T={T}: {msg} ({time.time() - t0:.0f}s)", file=sys.stderr)
    verdict = _verdict(rows, layers, Ts)
    return {
        "experiment": "single-layer attention approximation (BalanceKV paper, Sec. experiments)",
        "config": {
            "family": info.family, "n_layer": info.n_layer, "n_head": info.n_head, "n_kv_head": info.n_kv_head,
            "head_dim": info.head_dim, "data": str(data), "context": ctx, "compressed_context": c,
            "n_queries": n_queries, "windows": int(batch.shape[0]), "seeds": seeds, "layers": layers, "T": list(Ts),
            "n_sink": n_sink, "n_recent": n_recent, "block_size": block_size, "c_scale": c_scale,
            "kernel_temp": kernel_temp, "threshold": THRESHOLD_RULE, "methods": list(methods),
            "keys": "post-RoPE" if info.has_rope else "keys",
            "metric": "rel = ||Z - A||_F / ||A||_F over windows x query heads x queries x dims; mean +- std over "
                      "seeds (rel_q: mean per-query ||z - a|| / ||a||)",
            "tokens": int(batch.numel()), "stories": n_stories,
        },
        "plans": [plans[T] for T in Ts],
        "rows": rows,
        "verdict": verdict,
        "seconds": round(time.time() - t0, 1),
    }


def _get(rows, l, T, m):
    for r in rows:
        if r["layer"] == l and r["T"] == T and r["method"] == m:
            return r
    return None


def _verdict(rows, layers, Ts) -> dict:
    out = {}
    for other in ("uniform", "coinflip"):
        cells = []
        for l in layers:
            for T in Ts:
                a, b = _get(rows, l, T, "balancekv"), _get(rows, l, T, other)
                if a is None or b is None or T == 0:
                    continue
                cells.append({"layer": l, "T": T, "balancekv": a["mean"], other: b["mean"],
                              "ratio": a["mean"] / b["mean"] if b["mean"] > 0 else float("nan"),
                              "below": a["mean"] < b["mean"],
                              "below_by_2std": a["mean"] + a["std"] < b["mean"] - b["std"]})
        if cells:
            out[f"vs_{other}"] = {"cells": cells, "below_everywhere": all(c["below"] for c in cells),
                                  "n_below": sum(c["below"] for c in cells), "n": len(cells),
                                  "median_ratio": float(torch.tensor([c["ratio"] for c in cells]).median())}
    return out


# ----------------------------------------------------------------------------------------------- output
def to_markdown(report: dict) -> str:
    methods = report["config"]["methods"]
    Ts = report["config"]["T"]
    head = "| layer | T | kept / context | " + " | ".join(methods) + " |"
    if "balancekv" in methods and "uniform" in methods:
        head += " balancekv / uniform |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    plans = {p["T"]: p for p in report["plans"]}
    for l in report["config"]["layers"]:
        for T in Ts:
            cells = []
            for m in methods:
                r = _get(report["rows"], l, T, m)
                cells.append(f"{r['mean']:.4f} ± {r['std']:.4f}")
            line = f"| {l} | {T} | {plans[T]['budget']} / {plans[T]['context']} | " + " | ".join(cells) + " |"
            if "balancekv" in methods and "uniform" in methods:
                a, b = _get(report["rows"], l, T, "balancekv"), _get(report["rows"], l, T, "uniform")
                line += f" {a['mean'] / b['mean']:.3f} |" if b["mean"] > 0 else " – |"
            lines.append(line)
    return "\n".join(lines)


def print_table(report: dict, markdown: bool = False) -> None:
    if markdown:
        print(to_markdown(report))
        return
    from rich.console import Console
    from rich.table import Table

    cfg = report["config"]
    methods = cfg["methods"]
    tab = Table(title=f"relative attention error ‖z−Attn‖/‖Attn‖ (mean ± std over {cfg['seeds']} seeds; "
                      f"context {cfg['compressed_context']} compressed, last {cfg['n_queries']} queries)")
    for col in ["layer", "T", "kept/ctx", *methods]:
        tab.add_column(col, justify="right")
    plans = {p["T"]: p for p in report["plans"]}
    for l in cfg["layers"]:
        for T in cfg["T"]:
            rs = [_get(report["rows"], l, T, m) for m in methods]
            best = min(r["mean"] for r in rs)
            cells = [(f"[bold]{r['mean']:.4f}[/bold]" if r["mean"] == best and best > 0 else f"{r['mean']:.4f}")
                     + f" ± {r['std']:.4f}" for r in rs]
            tab.add_row(str(l), str(T), f"{plans[T]['budget']}/{plans[T]['context']}", *cells)
    Console().print(tab)
    v = report["verdict"].get("vs_uniform")
    if v:
        print(f"BalanceKV below uniform in {v['n_below']}/{v['n']} (layer, T) cells; median ratio "
              f"{v['median_ratio']:.3f}")


def plot(report: dict, out_png: str | Path) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    cfg = report["config"]
    layers = cfg["layers"]
    ncol = min(len(layers), 3)
    nrow = math.ceil(len(layers) / ncol)
    fig = Figure(figsize=(4.2 * ncol, 3.4 * nrow), dpi=110)
    FigureCanvasAgg(fig)
    Ts = [T for T in cfg["T"] if T > 0] or cfg["T"]
    for i, l in enumerate(layers):
        ax = fig.add_subplot(nrow, ncol, i + 1)
        for m in cfg["methods"]:
            rs = [_get(report["rows"], l, T, m) for T in Ts]
            ax.errorbar([2 ** T for T in Ts], [r["mean"] for r in rs], yerr=[r["std"] for r in rs], marker="o",
                        capsize=3, label=m)
        ax.set_xscale("log", base=2)
        if all(_get(report["rows"], l, T, m)["mean"] > 0 for T in Ts for m in cfg["methods"]):
            ax.set_yscale("log")
        ax.set_xlabel("middle compression 2^T")
        ax.set_ylabel("‖z − Attn‖ / ‖Attn‖")
        ax.set_title(f"layer {l}")
        ax.grid(alpha=0.3)
        if i == 0:
            ax.legend(fontsize=8)
    fig.suptitle(f"{cfg['family']}: context {cfg['compressed_context']} (+{cfg['n_queries']} queries), "
                 f"{cfg['windows']} windows, {cfg['seeds']} seeds", fontsize=9)
    fig.tight_layout()
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    return out
