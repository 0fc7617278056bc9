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


def _fmt(m: float, s: float, k: int) -> str:
    return f"{m:.4f} ± {s:.4f} ({k})"


def _lines(rows: list[dict], exp: str, label: str, ref: float) -> list[str]:
    """Table rows of one experiment: before fine-tuning, then each fine-tune LR and length."""
    tokens = sorted({x["ft_tokens"] for x in rows if x["experiment"] == exp and x["ft_tokens"]})
    out = []
    for t, lr in [(0, None), *((t, lr) for lr in FT_LRS for t in tokens)]:
        m, s, k = stats(rows, exp, t, lr)
        ft = f"{t:,} ({t / (STEPS_SOURCE * TOKENS_PER_STEP):.0%}) | {lr}" if t else "0 | —"
        if k:
            out.append(f"| {label} | {ft} | {_fmt(m, s, k)} | {m / ref:.4f}× |")
    return out


def markdown(rows: list[dict]) -> str:
    mha, mha_sd, n = stats(rows, "mha", 0)
    lines = [f"MHA source: {_fmt(mha, mha_sd, n)} (mean ± std over source seeds (n))", "",
             "| model | cache vs MHA | fine-tune tokens | fine-tune LR | val loss | vs MHA |", "|---|---|---|---|---|---|"]
    for r in CONVERT_RANKS:
        for method in ("weights-only", "activation-aware"):
            lines += _lines(rows, f"convert r{r} {method}", f"MLA-{r} {method} | {256 // r}× smaller", mha)
    for variant, label in (("mla_32", "MLA-32 from scratch (frontier)"), ("mla_128", "MLA-128 from scratch (frontier)")):
        m, s, k = frontier_ref(variant)
        lines.append(f"| {label} | {256 // int(variant.split('_')[1])}× smaller | 0 | — | {_fmt(m, s, k)} | "
                     f"{m / mha:.4f}× |")
    mla, mla_sd, n = stats(rows, "mla_128", 0)
    lines += ["", f"MLA-128 source: {_fmt(mla, mla_sd, n)}", "",
              "| KVSplice into trained MLA-128 | init | fine-tune tokens | fine-tune LR | val loss | vs MLA-128 |",
              "|---|---|---|---|---|---|"]
    for pct in (50, 90):
        for init in ("pca", "random"):
            lines += _lines(rows, f"kvsplice{pct} {init}", f"KVSplice-{pct} | {init}", mla)
        m, s, k = frontier_ref(f"mla_128_kvsplice_{pct}")
        lines.append(f"| KVSplice-{pct} from scratch (frontier) | — | 0 | — | {_fmt(m, s, k)} | {m / mla:.4f}× |")
    return "\n".join(lines)


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
