"""The report of ``benchmarks/convert_mla.py``: mean ± std validation loss per experiment and fine-tune beside the
from-scratch rows of ``results/frontier.json``, as tables and a figure; the study's settings (YAML)."""

from __future__ import annotations

import json
import statistics

from benchmarks.harness.paths import RESULTS
from benchmarks.harness.studies import load

_S = load("convert_mla")  # the study's settings: benchmarks/studies/convert_mla.yaml
STEPS_SOURCE, TOKENS_PER_STEP, FT_LRS = _S["steps_source"], _S["tokens_per_step"], tuple(_S["ft_lrs"])
FT_FRACTIONS, CONVERT_RANKS = tuple(_S["ft_fractions"]), tuple(_S["convert_ranks"])


def _mean_std(v: list[float]) -> tuple[float, float, int]:
    """(mean, std, n) of ``v``; NaN for none."""
    if not v:
        return float("nan"), float("nan"), 0
    return statistics.fmean(v), statistics.stdev(v) if len(v) > 1 else 0.0, len(v)


def stats(rows: list[dict], experiment: str, ft_tokens: int, lr: str | None = None) -> tuple[float, float, int]:
    return _mean_std([r["val_loss"] for r in rows if r["experiment"] == experiment and r["ft_tokens"] == ft_tokens
                      and (ft_tokens == 0 or r.get("ft_lr") == lr)])


def frontier_ref(variant: str) -> tuple[float, float, int]:
    f = RESULTS / "frontier.json"
    rows = json.loads(f.read_text())["rows"] if f.is_file() else []
    return _mean_std([r["val_loss"] for r in rows if r["variant"] == variant])


PARTS = {"mha": [("mha", "MHA source", "1×")]
         + [(f"convert r{r} {m}", f"MLA-{r} {m}", f"{256 // r}× smaller") for r in CONVERT_RANKS
            for m in ("weights-only", "activation-aware")]
         + [(f"frontier {v}", f"MLA-{v[4:]} from scratch (frontier)", f"{256 // int(v[4:])}× smaller")
            for v in ("mla_32", "mla_128")],
         "mla_128": [("mla_128", "MLA-128 source", None)]
         + [(e, f"KVSplice-{pct} {how}", None) for pct in (50, 90)
            for e, how in ((f"kvsplice{pct} pca", "pca"), (f"kvsplice{pct} random", "random"),
                           (f"frontier mla_128_kvsplice_{pct}", "from scratch (frontier)"))]}
"""Each part of the report (named by its source's experiment): (experiment or ``frontier VARIANT``, label, cache)."""


def stat_rows(rows: list[dict]) -> list[dict]:
    """The report's rows: mean ± std (n) validation loss of each experiment before fine-tuning and per fine-tune LR
    and length, and of the frontier's from-scratch variants, relative to the part's source."""
    out = []
    for part, entries in PARTS.items():
        ref = stats(rows, part, 0)[0]
        for exp, label, cache in entries:
            tokens = sorted({x["ft_tokens"] for x in rows if x["experiment"] == exp and x["ft_tokens"]})
            for t, lr in [(0, None), *((t, lr) for lr in FT_LRS for t in tokens)]:
                m, s, k = frontier_ref(exp[9:]) if exp.startswith("frontier ") else stats(rows, exp, t, lr)
                if k:
                    out.append({"part": part, "model": label, "cache": cache, "ft_tokens": t, "ft_lr": lr,
                                "ft_share": t / (STEPS_SOURCE * TOKENS_PER_STEP), "val_loss": m, "std": s, "n": k,
                                "vs_source": m / ref})
    return out


def _curves(ax, rows: list[dict], exp: str, label: str, color: str, marker: str = "o") -> None:
    """Mean ± std validation loss of ``exp`` against fine-tune tokens (% of the source's), one line per LR."""
    tok = sorted({x["ft_tokens"] for x in rows if x["experiment"] == exp})
    for lr, ls in zip(FT_LRS, ("-", "--")):
        pts = [stats(rows, exp, t, lr) for t in tok]
        ax.errorbar([t / (STEPS_SOURCE * TOKENS_PER_STEP) * 100 for t in tok], [p[0] for p in pts],
                    yerr=[p[1] for p in pts], marker=marker, ls=ls, color=color, capsize=3, label=f"{label}, LR {lr}")
    ax.set_xlabel("fine-tune tokens (% of the source's training tokens)")
    ax.set_ylabel("validation loss")


def figure(rows: list[dict]):
    from matplotlib.figure import Figure

    mha = stats(rows, "mha", 0)[0]
    fig = Figure(figsize=(11, 4.2))
    left, right = fig.subplots(1, 2)
    for method, c in (("weights-only", "C0"), ("activation-aware", "C1")):
        _curves(left, rows, f"convert r32 {method}", f"MHA→MLA-32 {method}", c)
    left.axhline(mha, color="k", ls="--", lw=0.8, label="MHA source")
    left.axhline(1.03 * mha, color="k", ls=":", lw=0.8, label="1.03 × MHA")
    m, _, k = frontier_ref("mla_32")
    if k:
        left.axhline(m, color="C2", ls="-.", lw=0.8, label="MLA-32 from scratch")
    for pct, marker in ((50, "o"), (90, "s")):
        for init, c in (("pca", "C1"), ("random", "C0")):
            _curves(right, rows, f"kvsplice{pct} {init}", f"KVSplice-{pct} {init}", c, marker)
    for ax in (left, right):
        ax.legend(fontsize=7)
    fig.suptitle("Converting trained small_* models (real TinyStories text; mean ± std over source seeds)", fontsize=9)
    fig.tight_layout()
    return fig
