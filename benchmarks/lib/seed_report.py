"""The report of a training study (``frontier.py``, ``kvsplice_recipe.py``): per variant the mean ± std validation
loss over seeds, cache bytes, the Pareto front and ``a − b`` in standard errors (the rows of the YAML's tables), and
the loss-vs-bytes figure."""

from __future__ import annotations

import statistics

from benchmarks.lib.study import resume_key

__all__ = ["compare", "comparisons", "figure", "late_drop", "report_rows", "summarise"]


def late_drop(curve: list[list[float]]) -> float | None:
    """Mean training loss over the 4th fifth of the steps minus that over the last fifth (0: flat at the end)."""
    if not curve:
        return None
    n = curve[-1][0]
    fourth = [l for s, l in curve if 0.6 * n < s <= 0.8 * n]
    last = [l for s, l in curve if s > 0.8 * n]
    return statistics.fmean(fourth) - statistics.fmean(last) if fourth and last else None


def summarise(rows: list[dict]) -> list[dict]:
    """Per variant: mean and std (n-1) of val_loss over seeds, cache bytes, the late loss drop, Pareto membership."""
    out = []
    for v in dict.fromkeys(r["variant"] for r in rows):
        rs = [r for r in rows if r["variant"] == v]
        losses = [r["val_loss"] for r in rs]
        drops = [d for d in (late_drop(r.get("train_loss_curve") or []) for r in rs) if d is not None]
        gaps = [r["train_val_gap"] for r in rs if r.get("train_val_gap") is not None]
        out.append({"variant": v, "n": len(rs), "val_loss": statistics.fmean(losses),
                    "std": statistics.stdev(losses) if len(losses) > 1 else 0.0,
                    "bytes": rs[0]["cache_bytes_per_token"], "tokens": rs[0]["tokens"],
                    "late_drop": statistics.fmean(drops) if drops else None,
                    "gap": statistics.fmean(gaps) if gaps else None})
    for s in out:  # on the front: no other variant has fewer-or-equal bytes and a lower mean loss
        s["pareto"] = not any(o is not s and o["bytes"] <= s["bytes"] and o["val_loss"] < s["val_loss"] for o in out)
    return sorted(out, key=lambda s: -s["bytes"])


def compare(a: dict, b: dict) -> dict:
    """Mean val-loss ``a − b`` of two summaries, its SE ``sqrt(sa²/na + sb²/nb)``; ``tie`` when ``|d| < 2 SE``."""
    d = a["val_loss"] - b["val_loss"]
    se = (a["std"] ** 2 / a["n"] + b["std"] ** 2 / b["n"]) ** 0.5
    if se == 0:  # one seed each: no spread to judge by
        verdict = "no SE (one seed each)"
    else:
        verdict = "tie" if abs(d) < 2 * se else f"{a['variant'] if d < 0 else b['variant']} better"
    return {"a": a["variant"], "b": b["variant"], "diff": d, "se": se, "z": d / se if se else None,
            "verdict": verdict}


def comparisons(summary: list[dict], ref: str = "mha") -> list[dict]:
    """Each pair at equal cache bytes, each ``ds_X`` against its GPT-2 twin ``X``, each variant against ``ref``."""
    by = {s["variant"]: s for s in summary}
    pairs = [(b, a) for i, a in enumerate(summary) for b in summary[i + 1:] if a["bytes"] == b["bytes"]]
    pairs += [(s, by[s["variant"][3:]]) for s in summary if s["variant"].startswith("ds_") and s["variant"][3:] in by]
    pairs += [(s, by[ref]) for s in summary if ref in by and s["variant"] != ref]
    unique: dict = {}  # each pair once, in the order first met
    for a, b in pairs:
        unique.setdefault(frozenset((a["variant"], b["variant"])), (a, b))
    return [compare(a, b) for a, b in unique.values()]


def figure(run, rows):
    """Validation loss against cache bytes: every seed, the mean ± std per variant, the Pareto front."""
    import matplotlib.pyplot as plt

    rows = _now(run, rows)
    if not rows:
        return plt.figure(figsize=(2, 1))
    summary = summarise(rows)
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    colors = {"mha": "C0", "gqa": "C0", "mqa": "C0", "mla": "C1"}
    offsets = {}  # variants sharing a byte count get their labels stacked instead of overprinted
    for s in summary:
        c = "C2" if "kvsplice" in s["variant"] else colors.get(s["variant"][:3], "C3")
        k = offsets[s["bytes"]] = offsets.get(s["bytes"], -1) + 1
        seeds = [r["val_loss"] for r in rows if r["variant"] == s["variant"]]
        ax.scatter([s["bytes"]] * len(seeds), seeds, color=c, alpha=0.3, s=12)
        ax.errorbar(s["bytes"], s["val_loss"], yerr=s["std"], fmt="o", color=c, capsize=3,
                    markeredgecolor="k" if s["pareto"] else c)
        ax.annotate(s["variant"], (s["bytes"], s["val_loss"]), textcoords="offset points", xytext=(6, 4 - 10 * k),
                    fontsize=7)
    front = sorted((s for s in summary if s["pareto"]), key=lambda s: s["bytes"])
    ax.step([s["bytes"] for s in front], [s["val_loss"] for s in front], where="post", color="k", lw=0.8, ls="--",
            label="Pareto front")
    for label, c in (("MHA / GQA / MQA", "C0"), ("MLA", "C1"), ("MLA-128 + KVSplice", "C2")):
        ax.scatter([], [], color=c, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("decode cache bytes per token (fp16, all layers, measured)")
    ax.set_ylabel("validation loss (nats)")
    ax.set_title(_title(run, rows), fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.set_dpi(130)
    return fig


def _now(run, rows) -> list[dict]:
    """The rows of this invocation's steps, batch and device (all rows when none are)."""
    key = (run["steps"], run["batch"], run.args.device)
    return [r for r in rows if resume_key(r)[2:] == key] or rows


def _title(run, rows) -> str:
    """The study, the tokens per run, the seeds and the machine (the header's)."""
    tokens = sorted({r["tokens"] for r in rows if r["tokens"] is not None})
    m = run.header["machine"]
    gpu = f", {m['cuda_device']}" if run.args.device == "cuda" and "cuda_device" in m else ""
    return (f"{run.args.study}: small_* (4L, d128, BPE-4096), {', '.join(f'{t:,}' for t in tokens)} tokens/run, "
            f"seeds {sorted({r['seed'] for r in rows})}, {m['processor']}, {m['cores']} cores{gpu}")


def report_rows(run, rows: list[dict], ref: str = "mha") -> dict:
    """The report's fields (the studies' YAML ``report:``): the title, ``ref``, ``base`` (``ref``, or the first variant
    without it) and ``stats``: the rows of the variant table (bytes and loss relative to ``base``) and of the
    :func:`comparisons` (``part``) of this invocation's rows."""
    rows = _now(run, rows)
    if not rows:
        return {"title": "no results yet", "ref": ref, "base": ref, "stats": []}
    summary = summarise(rows)
    base = next((s for s in summary if s["variant"] == ref), summary[0])
    stats = [{**s, "part": "variants", "bytes_vs": s["bytes"] / base["bytes"],
              "loss_vs": s["val_loss"] / base["val_loss"]} for s in summary]
    return {"title": _title(run, rows), "ref": ref, "base": base["variant"],
            "stats": stats + [{**c, "part": "comparisons"} for c in comparisons(summary, ref)]}
