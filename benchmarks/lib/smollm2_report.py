"""The SmolLM2 frontier report's rows and figure from the rows of ``benchmarks/smollm2_frontier.py``: a table per
protocol (Pareto front marked), the planner's stacks, the energy ranks, the kvpress comparison."""

from __future__ import annotations

from pathlib import Path

__all__ = ["FAMILIES", "energy_claims", "family", "figure", "report_rows"]

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


def report_rows(rows: list[dict], kvpress: dict, claims: dict) -> list[dict]:
    """The YAML ``report:``'s rows, largest caches first: each with its ``part`` (protocol), Δ %, ★ (P's Pareto
    front), S's ratio and kvpress's quoted best press; the planner's rows again (part ``plan``); the energy ranks."""
    base = {r["protocol"]: r["ppl"] for r in rows if r["id"] in ("full", "S_full", "W_full")}
    p = [r for r in rows if r["protocol"] == "P"]  # ★: no other row of P both ≤ in bytes per token and < in ppl
    front = {r["id"] for r in p if not any(o["bytes_per_token"] <= r["bytes_per_token"] and o["ppl"] < r["ppl"]
                                           for o in p)}
    kv_best = {x: f"{n} {v:+.1f} %" for (n, x), v in kvpress.items()}  # ratio → kvpress's best press
    out = []
    for r in sorted(rows, key=lambda r: (-r["bytes_per_token"], r["ppl"])):
        x = r["spec"].get("x") or 1
        row = {**r, "part": r["protocol"], "star": "★" if r["id"] in front else "", "x": x, "kvpress": kv_best.get(x),
               "delta_pct": 100 * (r["ppl"] / base[r["protocol"]] - 1),
               "selector": r["spec"].get("selector", "full K/V")}
        out.append(row)
        if r["id"].startswith("plan_"):
            tuned = min(r["candidates"], key=lambda c: c["tuning_ppl"])
            out.append({**row, "part": "plan", "tuning_delta_pct": tuned["delta_pct"],
                        "n_candidates": len(r["candidates"])})
    return out + [{"part": "energy", "stream": k, **v, "share_le_d4_pct": 100 * v["share_le_d4"]}
                  for k, v in claims.items()]


def figure(rows: list[dict]):
    """Protocol P's rows: perplexity increase against bytes per token, by method family, the Pareto front dashed."""
    import matplotlib.pyplot as plt

    rows = [r for r in report_rows(rows, {}, {}) if r["part"] == "P"]
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for name, marker in FAMILIES.items():
        pts = [r for r in rows if family(r) == name]
        if pts:
            ax.scatter([r["bytes_per_token"] for r in pts], [r["delta_pct"] for r in pts], marker=marker,
                       s=90 if name == "planner" else 40, label=name)
    fr = sorted((r for r in rows if r["star"]), key=lambda r: r["bytes_per_token"])
    ax.plot([r["bytes_per_token"] for r in fr], [r["delta_pct"] for r in fr], "k--", lw=1, label="Pareto front")
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

