"""The SmolLM2 frontier report's rows (and its YAML ``figure:``'s) from the rows of ``benchmarks/smollm2_frontier.py``:
a table per protocol (Pareto front marked), the planner's stacks, the energy ranks, the kvpress comparison."""

from __future__ import annotations

from pathlib import Path

__all__ = ["energy_claims", "family", "report_rows"]


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
    """The YAML ``report:``'s rows, largest caches first: each with its ``part`` (protocol), ``family``, Δ %, ★ (P's
    Pareto front), S's ratio and kvpress's quoted best press; the planner's rows again (part ``plan``); the energy
    ranks."""
    base = {r["protocol"]: r["ppl"] for r in rows if r["id"] in ("full", "S_full", "W_full")}
    p = [r for r in rows if r["protocol"] == "P"]  # ★: no other row of P both ≤ in bytes per token and < in ppl
    front = {r["id"] for r in p if not any(o["bytes_per_token"] <= r["bytes_per_token"] and o["ppl"] < r["ppl"]
                                           for o in p)}
    kv_best = {x: f"{n} {v:+.1f} %" for (n, x), v in kvpress.items()}  # ratio → kvpress's best press
    out = []
    for r in sorted(rows, key=lambda r: (-r["bytes_per_token"], r["ppl"])):
        x = r["spec"].get("x") or 1
        row = {**r, "part": r["protocol"], "family": family(r), "star": "★" if r["id"] in front else "", "x": x,
               "kvpress": kv_best.get(x), "delta_pct": 100 * (r["ppl"] / base[r["protocol"]] - 1),
               "selector": r["spec"].get("selector", "full K/V")}
        out.append(row)
        if r["id"].startswith("plan_"):
            tuned = min(r["candidates"], key=lambda c: c["tuning_ppl"])
            out.append({**row, "part": "plan", "tuning_delta_pct": tuned["delta_pct"],
                        "n_candidates": len(r["candidates"])})
    return out + [{"part": "energy", "stream": k, **v, "share_le_d4_pct": 100 * v["share_le_d4"]}
                  for k, v in claims.items()]
