"""The frontier study's runs and report (``benchmarks/frontier.py``): one ``training.fit`` run read back into a row
(validation loss, tokens, measured cache bytes, the training curve), the q/k/v scale at initialisation (the MLA
ablation), the per-variant table, the comparisons at equal cache bytes and against MHA, and the loss-vs-bytes
figure."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.lib.study import (RUN_KEY, cache_bytes, compare, comparison_table, final_train_loss, last_val,
                                  resume_key, run_args, run_key, summarise, train, train_curve, trained)

__all__ = ["comparisons", "figure", "init_kv_rms", "markdown", "plot", "run_one", "table"]


def run_one(variant: str, config: str, extra: list[str], seed: int, args, runs_dir: Path) -> dict:
    name = f"{variant}-s{seed}"
    run = runs_dir / name
    if (run / "last.ckpt").is_file() and (run / "metrics.csv").is_file() and (run / RUN_KEY).is_file():
        try:  # trained before the results were written, with the same resume key
            if json.loads((run / RUN_KEY).read_text()) == list(run_key(variant, seed, args)):
                return _row(variant, config, extra, seed, run, args, wall=None)
        except (RuntimeError, ValueError):
            pass
    wall = train(config, runs_dir, name, seed, args.steps, args.threads, [*extra, *run_args(args)])
    (run / RUN_KEY).write_text(json.dumps(list(run_key(variant, seed, args))) + "\n")
    return _row(variant, config, extra, seed, run, args, wall)


def _row(variant: str, config: str, extra: list[str], seed: int, run: Path, args, wall) -> dict:
    step, val_loss, _, _ = last_val(run / "metrics.csv")
    tokens, train_time = trained(run / "last.ckpt")
    curve = train_curve(run / "metrics.csv")
    train_final = final_train_loss(curve)
    return {"variant": variant, "config": config, "overrides": extra, "seed": seed, "steps": step + 1,
            "batch": args.batch, "device": args.device,
            "tokens": tokens, "val_loss": val_loss, **cache_bytes(run / "last.ckpt", args.cache_tokens),
            "wall_s": None if wall is None else round(wall, 1), "train_time_s": round(train_time, 1),
            "tokens_per_s": round(tokens / train_time, 1) if train_time else None,
            "train_loss_final": None if train_final is None else round(train_final, 4),
            "train_val_gap": None if train_final is None else round(val_loss - train_final, 4),
            "train_loss_curve": curve}


def init_kv_rms() -> dict:
    """RMS of layer 0's queries, keys and values at initialisation for unit-RMS inputs (what ``ln_1`` gives): MLA's
    keys/values are a product of two N(0, 0.02) maps, so they start several times smaller than MHA's unless the
    latent is normalised."""
    import torch

    from models.config import GPTConfig
    from models.gpt import GPT

    out = {}
    for label, name, kw in (("mha", "small_mha", {}), ("mla_64", "small_mla_64", {}),
                            ("mla_64+latent_norm", "small_mla_64", {"latent_norm": True}),
                            ("mla_128", "small_mla", {}), ("mla_128+latent_norm", "small_mla", {"latent_norm": True})):
        torch.manual_seed(0)
        model = GPT(GPTConfig.from_name(name, vocab_size=4096, latent_norm=kw.get("latent_norm", False)))
        attn = model.transformer.h[0].attn
        x = torch.randn(4, 64, model.cfg.d_model, generator=torch.Generator().manual_seed(1))  # (B, T, d), RMS 1
        with torch.no_grad():
            if model.cfg.attention == "mha":
                q, k, v = attn.c_attn(x).split(model.cfg.d_model, -1)
            else:
                c = attn._c(x)  # (B, T, d_latent)
                q, k, v = attn.w_q(x), attn.w_uk(c), attn.w_uv(c)
        out[label] = {n: round(float(t.pow(2).mean().sqrt()), 4) for n, t in (("q", q), ("k", k), ("v", v))}
    return out


# ---------------------------------------------------------------------------------------------------- report
def table(summary: list[dict], ref: str = "mha") -> str:
    base = next((s for s in summary if s["variant"] == ref), summary[0])
    gap = any(s.get("gap") is not None for s in summary)
    lines = [f"| variant | cache B/token (fp16) | vs {base['variant']} | val loss (mean ± std) | seeds | "
             f"loss vs {base['variant']} | train-loss drop, last 20 % of steps |"
             + (" val − train loss |" if gap else "") + " Pareto |",
             "|---|---|---|---|---|---|---|" + ("---|" if gap else "") + "---|"]
    for s in summary:
        drop = "" if s["late_drop"] is None else f"{s['late_drop']:.3f}"
        g = ("" if s.get("gap") is None else f" {s['gap']:.3f} |") if gap else ""
        lines.append(f"| {s['variant']} | {s['bytes']:.0f} | {s['bytes'] / base['bytes']:.3f}× | "
                     f"{s['val_loss']:.4f} ± {s['std']:.4f} | {s['n']} | {s['val_loss'] / base['val_loss']:.4f}× | "
                     f"{drop} |{g} {'yes' if s['pareto'] else ''} |")
    return "\n".join(lines)


def comparisons(summary: list[dict], ref: str = "mha") -> list[dict]:
    """Every pair of variants with the same cache bytes, every DeepSeek-layout variant (``ds_X``) against its GPT-2
    twin ``X``, and every variant against ``ref`` — each pair once."""
    out, seen = [], set()
    by = {s["variant"]: s for s in summary}

    def add(a: dict, b: dict) -> None:
        if frozenset((a["variant"], b["variant"])) not in seen:
            seen.add(frozenset((a["variant"], b["variant"])))
            out.append(compare(a, b))

    for i, a in enumerate(summary):
        for b in summary[i + 1:]:
            if a["bytes"] == b["bytes"]:
                add(b, a)
    for s in summary:
        if s["variant"].startswith("ds_") and s["variant"][3:] in by:
            add(s, by[s["variant"][3:]])
    if ref in by:
        for s in summary:
            if s["variant"] != ref:
                add(s, by[ref])
    return out


def plot(summary: list[dict], rows: list[dict], title: str):
    """Validation loss against cache bytes: every seed, the mean ± std per variant, the Pareto front."""
    import matplotlib.pyplot as plt

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
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.set_dpi(130)
    return fig


def _now(run, rows) -> list[dict]:
    """The rows of this invocation's steps, batch and device (all rows when none are)."""
    key = (run["steps"], run["batch"], run.args.device)
    return [r for r in rows if resume_key(r)[2:] == key] or rows


def _title(run, rows) -> str:
    tokens = sorted({r["tokens"] for r in rows if r["tokens"] is not None})
    return (f"{run.args.study}: small_* (4L, d128, BPE-4096), {', '.join(f'{t:,}' for t in tokens)} tokens/run, "
            f"seeds {sorted({r['seed'] for r in rows})}, {run.notes['meta']['machine']}")


def markdown(run, rows) -> str:
    rows = _now(run, rows)
    if not rows:
        return "no results yet"
    summary = summarise(rows)
    return (f"{_title(run, rows)}\n\n{table(summary)}\n\nDifferences at equal cache bytes, and against MHA (SE of the "
            f"difference of seed means):\n\n{comparison_table(comparisons(summary))}")


def figure(run, rows):
    rows = _now(run, rows)
    if not rows:
        import matplotlib.pyplot as plt

        return plt.figure(figsize=(2, 1))
    return plot(summarise(rows), rows, _title(run, rows))
