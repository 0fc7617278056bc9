"""The SmolLM2 frontier report from the rows of ``benchmarks/smollm2_frontier.py`` (the runner writes it): the
frontier table (Pareto front marked), the goals, the planner's stacks, the paper's claims, the kvpress comparison."""

from __future__ import annotations

from pathlib import Path

__all__ = ["FAMILIES", "energy_claims", "family", "figure", "markdown", "pareto"]

FAMILIES = {"full": "s", "quantisation": "o", "low rank (bases)": "^", "token selection alone": "v",
            "token selection + quantisation": "D", "planner": "*"}
"""A frontier row's method family → its marker."""


def family(row: dict) -> str:
    """The method family of a frontier row, by its id and label."""
    rid, label = row["id"], row["label"]
    if rid == "full" or rid.startswith("plan_"):
        return "full" if rid == "full" else "planner"
    if rid.startswith(("lr_", "joint_")):
        return "low rank (bases)"
    if "×" in label:
        return "token selection + quantisation" if "+ int8" in label or "+ kivi" in label else "token selection alone"
    return "quantisation"


def energy_claims(stats_path: Path) -> dict:
    """90 %-energy ranks (K-only / V-only spectra) of pre- and post-RoPE keys and of values, from the calibration
    stats: mean over layers and KV heads, and the share of heads at or below d/4."""
    from kvsplice.lowrank.calibrate import load_stats
    from kvsplice.lowrank.fits import ksvd_basis

    if not stats_path.is_file():
        return {}
    sets = load_stats(stats_path)
    out = {}
    for name, mode, gram in (("keys_pre", "pre", "kk"), ("keys_post", "post", "kk"), ("values", "pre", "vv")):
        s = sets[mode]
        ranks = [ksvd_basis(getattr(s, gram)[l, j], energy=0.9).rank for l in range(s.n_layer)
                 for j in range(s.n_kv_head)]
        out[name] = {"mean_rank_90": sum(ranks) / len(ranks), "share_le_d4": sum(r <= s.head_dim // 4 for r in ranks)
                     / len(ranks), "head_dim": s.head_dim}
    return out


def pareto(rows: list[dict]) -> set[str]:
    """Ids of the rows no other row beats on both bytes per token (≤) and perplexity (<)."""
    return {r["id"] for r in rows if not any(o is not r and o["bytes_per_token"] <= r["bytes_per_token"] and
                                             o["ppl"] < r["ppl"] for o in rows)}


def _pct(ppl: float, base: float) -> float:
    return 100 * (ppl / base - 1)


def _section(title: str, header: str, rows: list[str]) -> list[str]:
    """A markdown section of the report: ``## title``, the table (``header``, its rule, ``rows``) and a blank line."""
    return [f"## {title}", "", header, "|" + "---|" * (header.count("|") - 1), *rows, ""]


def markdown(rows: list[dict], kvpress: dict, issue: dict, claims: dict) -> str:
    """results/smollm2_frontier.md: a table per protocol, the planner's stacks and the energy ranks."""
    by = {p: [r for r in rows if r.get("protocol") == p] for p in "PSW"}
    base = {p: next((r["ppl"] for r in rows if r["id"] in ("full", "S_full", "W_full")), None) for p, rows in by.items()}
    md = ["# SmolLM2-135M-Instruct: perplexity vs KV-cache bytes, every method family", "",
          "Made by `python -m benchmarks.smollm2_frontier` (protocols and text in its docstring). Bytes per token: "
          "each method's closed form at fp16 storage for the tokens held after the 768-token prompt, per prompt "
          "token; measured == formula in every batch of every row. Ratio: vs the fp16 full K/V cache (23,040 B per "
          "token). Δ: vs the full cache on the same windows and protocol. ★ = on the Pareto front (no other row is "
          "both smaller and better).", ""]
    if by["P"]:
        front = pareto(by["P"])
        md += _section(
            f"Protocol P: 4 windows × 1,024 of the validation text, 768-token prompt compressed, 256 tokens scored "
            f"(full cache ppl {base['P']:.4f})",
            "| | method / stack | ppl | Δ % | bytes / token | × smaller than fp16 full |",
            [f"| {'★' if r['id'] in front else ''} | {r['label']} | {r['ppl']:.4f} | {_pct(r['ppl'], base['P']):+.2f} | "
             f"{r['bytes_per_token']:,.0f} | {r['ratio_vs_fp16_full']:.2f} |"
             for r in sorted(by["P"], key=lambda r: -r["bytes_per_token"])])
    if by["W"]:
        md += _section(
            f"Protocol W (the low-rank protocol): every token of the 4 windows over the compressed cache (full cache "
            f"ppl {base['W']:.4f}; reference {issue['full_W']})",
            "| method | ppl | Δ % | × smaller than fp16 full | mean R_k / R_v |",
            [f"| {r['label']} | {r['ppl']:.4f} | {_pct(r['ppl'], base['W']):+.2f} | {r['ratio_vs_fp16_full']:.2f} | "
             f"{_ranks(r.get('ranks'))} |" for r in sorted(by["W"], key=lambda r: -r["bytes_per_token"])])
    if by["S"]:
        kv_best = {x: f"{n} {v:+.1f} %" for (n, x), v in kvpress.items()}  # ratio → kvpress's best press
        md += _section(
            f"Protocol S (kvpress's protocol): 5 windows of 832, 768-token prompt compressed 2/4/8×, 64 tokens "
            f"scored (full cache ppl {base['S']:.4f})",
            "| selector | ratio | ppl | Δ % | kvpress's best press at this ratio (kvpress 0.5.5, quoted) |",
            [f"| {r['spec'].get('selector', 'full K/V')} | {r['spec'].get('x') or 1}× | {r['ppl']:.4f} | "
             f"{_pct(r['ppl'], base['S']):+.2f} | {kv_best.get(r['spec'].get('x'), '')} |"
             for r in sorted(by["S"], key=lambda r: (r["spec"].get("x", 1), r["ppl"]))])
    plans = [r for r in by["P"] if r["id"].startswith("plan_")]
    if plans:
        md += _section(
            "The planner's stacks (chosen on the tuning slice, then measured here)",
            "| budget | chosen stack | tuning Δ % | eval ppl | eval Δ % | × smaller | candidates measured |",
            [f"| {r['spec']['plan']}× | {r['label']} | "
             f"{min(r['candidates'], key=lambda c: c['tuning_ppl'])['delta_pct']:+.2f} | {r['ppl']:.4f} | {_pct(r['ppl'], base['P']):+.2f} | {r['ratio_vs_fp16_full']:.2f} | {len(r['candidates'])} |"
             for r in sorted(plans, key=lambda r: r["spec"]["plan"])])
    if claims:
        md += _section(
            "Energy ranks (90 % of the K-only / V-only spectrum, calibration Grams)",
            "| stream | mean rank of 64 | heads with rank ≤ d/4 = 16 |",
            [f"| {k} | {v['mean_rank_90']:.1f} | {100 * v['share_le_d4']:.0f} % |" for k, v in claims.items()])
    return "\n".join(md)


def figure(rows: list[dict]):
    """Protocol P's rows: perplexity increase against bytes per token, by method family, the Pareto front dashed."""
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r.get("protocol") == "P"]
    base = next((r["ppl"] for r in rows if r["id"] == "full"), None)
    front = pareto(rows)
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for name, marker in FAMILIES.items():
        pts = [r for r in rows if family(r) == name]
        if pts:
            ax.scatter([r["bytes_per_token"] for r in pts], [_pct(r["ppl"], base) for r in pts], marker=marker,
                       s=90 if name == "planner" else 40, label=name)
    fr = sorted((r for r in rows if r["id"] in front), key=lambda r: r["bytes_per_token"])
    ax.plot([r["bytes_per_token"] for r in fr], [_pct(r["ppl"], base) for r in fr], "k--", lw=1, label="Pareto front")
    ax.set_xscale("log")
    ax.set_yscale("symlog", linthresh=1)
    ax.set(xlabel="cache bytes per token (fp16 storage; full K/V = 23,040)",
           ylabel="perplexity increase vs full cache (%)",
           title="SmolLM2-135M-Instruct: 768-token prompt compressed, 256 tokens scored (4 windows)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.set_dpi(120)
    fig.tight_layout()
    return fig


def _ranks(rk) -> str:
    return "" if rk is None else f"{rk['mean_k']:.1f} / {rk['mean_v']:.1f}"
