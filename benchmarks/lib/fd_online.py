"""What ``benchmarks/fd_online_stories260k.py`` compares and reports: the fd-online configurations per rank budget,
their labels, a row's diagnostics summed over layers, and the report (online frequent-directions bases against
global bases per rank budget, every bound's slack, the per-layer diagnostics at R = 4)."""

from __future__ import annotations

from kvsplice.core.diagnostics import format_diagnostics

__all__ = ["FD_CONFIGS", "RANKS", "label", "markdown", "summary"]

RANKS = (2, 4, 6)

# fd-online candidates per global rank R (budget 2R numbers per token and KV head); each has its bytes measured.
FD_CONFIGS: dict[int, list[dict]] = {
    2: [dict(rank_k=1, rank_v=1, max_chunk_len=16, fd_decay=0.95),
        dict(rank_k=2, rank_v=1, max_chunk_len=64, fd_decay=0.95),
        dict(rank_k=2, rank_v=1, max_chunk_len=64)],
    4: [dict(rank_k=3, rank_v=3, max_chunk_len=32),
        dict(rank_k=3, rank_v=3, max_chunk_len=32, fd_decay=0.9),
        dict(rank_k=3, rank_v=2, max_chunk_len=16, fd_decay=0.95),
        dict(rank_k=4, rank_v=3, max_chunk_len=128, fd_decay=0.95),
        dict(rank_k=3, rank_v=3, tau_k=0.3, relative=True, min_chunk_len=16, max_chunk_len=128, max_chunks=16,
             fd_decay=0.95)],
    6: [dict(rank_k=5, rank_v=5, max_chunk_len=64, fd_decay=0.95),
        dict(rank_k=5, rank_v=4, max_chunk_len=32, fd_decay=0.95),
        dict(rank_k=6, rank_v=4, max_chunk_len=64, fd_decay=0.95),
        dict(rank_k=6, rank_v=5, max_chunk_len=128, fd_decay=0.95)],
}


def label(kw: dict) -> str:
    parts = [f"r={kw['rank_k']}/{kw['rank_v']}", f"L={kw['max_chunk_len']}"]
    if kw.get("tau_k") is not None:
        parts.append(f"τ_k={kw['tau_k']}{' rel' if kw.get('relative') else ''}")
    if kw.get("min_chunk_len", 1) > 1:
        parts.append(f"m={kw['min_chunk_len']}")
    if kw.get("max_chunks"):
        parts.append(f"J_max={kw['max_chunks']}")
    if kw.get("fd_decay", 1.0) != 1.0:
        parts.append(f"γ={kw['fd_decay']}")
    return ", ".join(parts)


def summary(diag: list[dict]) -> dict:
    """Across layers: mean relative head-output error, the largest logit error, bounds held, worst slack."""
    return {
        "rel_out_mean": sum(d["rel_output_err"] for d in diag) / len(diag),
        "logit_err_max": max(d["logit_err"] for d in diag),
        "softmax_l1_max": max(d["softmax_l1"] for d in diag),
        "bounds_hold": all(d["holds"] and d.get("holds_recorded", True) for d in diag),
        "slack_logit": min(d["logit_slack"] for d in diag),
        "slack_softmax_tanh": min(d["softmax_slack"] for d in diag),
        "slack_softmax_sinh": min(d["softmax_sinh_slack"] for d in diag),
        "slack_output": min(d["output_slack"] for d in diag),
        "tightest_logit": min(d["logit_tightest"] for d in diag),
        "tightest_output": min(d["output_tightest"] for d in diag),
        **({"chunks_max": max(d["chunks_max"] for d in diag),
            "chunks_mean": sum(d["chunks_mean"] for d in diag) / len(diag)} if "chunks_max" in diag[0] else {}),
    }


def markdown(rep: dict, ranks=(2, 4, 6)) -> str:
    """The report of a run: ``rep`` holds the header, the model, eval and calibration, ``full_ppl`` and the rows."""
    L = rep["model"]
    per_tok = 2 * L["n_layer"] * L["n_kv_head"] * L["head_dim"]
    lines = [f"stories260K ({L['n_layer']} layers, {L['n_head']}/{L['n_kv_head']} heads, head_dim {L['head_dim']}) on "
             f"{rep['eval']['tokens']:,} TinyStories validation tokens ({rep['eval']['windows']} windows × "
             f"{rep['eval']['seq_len']}); global bases calibrated on {rep['calibration']['tokens']:,} train-sample "
             f"tokens. Full K/V cache: ppl **{rep['full_ppl']:.3f}** ({per_tok} numbers/token). Bytes are per "
             f"512-token sequence, fp32, coefficients + bases (fd-online: FD sketches listed separately); "
             f"'×budget' = bytes / the global rank-R cache's bytes. rel_out: teacher-forced head-output error "
             f"(Σ‖o−ô‖²/Σ‖o‖²)^½, mean over layers; ε: max logit error; J: chunks per stream at T = 512 (max / mean "
             f"over layers and KV heads).", ""]
    lines += ["| R (budget) | method | config | ppl | bytes | ×budget | sketch bytes | J max / mean | rel_out | ε max "
              "| bounds hold |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in ranks:
        rs = [x for x in rep["rows"] if x["budget_rank"] == r]
        budget = next(x["bytes"] for x in rs if x["kind"] == "global")
        glob = [x for x in rs if x["kind"] == "global"]
        fd = sorted((x for x in rs if x["kind"] == "fd-online"), key=lambda x: x["ppl"])
        best_g = min((x for x in glob if not x["reference_only"]), key=lambda x: x["ppl"])
        best_fd = min((x for x in fd if x["matched"]), key=lambda x: x["ppl"], default=None)
        for x in glob + fd:
            name = x["method"] + (" (reference)" if x.get("reference_only") else "")
            cfg = x.get("label", f"R={r}")
            if x is best_g or x is best_fd:
                name = f"**{name}**"
            j = f"{x['chunks_max']} / {x['chunks_mean']:.1f}" if "chunks_max" in x else "—"
            sk = f"{x['sketch_bytes']:,}" if x["kind"] == "fd-online" else "—"
            match = "" if x["kind"] == "global" or x["matched"] else " (over)"
            lines.append(f"| {r} ({2 * r}/token) | {name} | {cfg} | {x['ppl']:.3f} | {x['bytes']:,} | "
                         f"{x['bytes'] / budget:.3f}{match} | {sk} | {j} | {x['rel_out_mean']:.3f} | "
                         f"{x['logit_err_max']:.1f} | {'yes' if x['bounds_hold'] else 'NO'} |")
    lines += ["", "Best matched fd-online vs best global attention-aware post-RoPE method (ppl):", ""]
    for r in ranks:
        rs = [x for x in rep["rows"] if x["budget_rank"] == r]
        g = min((x for x in rs if x["kind"] == "global" and not x["reference_only"]), key=lambda x: x["ppl"])
        f = min((x for x in rs if x["kind"] == "fd-online" and x["matched"]), key=lambda x: x["ppl"], default=None)
        k = next(x for x in rs if x["method"].startswith("ksvd"))
        if f is not None:
            lines.append(f"* R={r}: fd-online {f['ppl']:.2f} ({f['label']}, {f['bytes'] / g['bytes']:.3f}× bytes, "
                         f"J={f['chunks_max']}) vs {g['method']} {g['ppl']:.2f}; K-only global (ksvd post) "
                         f"{k['ppl']:.2f}.")
    lines += ["", "Bound slack on every row (bound / observed, ratio of the maxima over queries and heads, worst "
              "layer): logit ‖q‖·max ρ_k · s, softmax 2 tanh(δ̄/4) and 2 sinh(δ̄/2) (δ̄ = 2 × logit bound), output "
              "‖Δα‖₁ max‖v‖ + max‖Δv‖:", "",
              "| R | method | config | logit | softmax tanh | softmax sinh | output |", "|---|---|---|---|---|---|---|"]
    for x in rep["rows"]:
        lines.append(f"| {x['budget_rank']} | {x['method']} | {x.get('label', '')} | {x['slack_logit']:.2f} | "
                     f"{x['slack_softmax_tanh']:.2f} | {x['slack_softmax_sinh']:.3g} | {x['slack_output']:.2f} |")
    r4 = [x for x in rep["rows"] if x["budget_rank"] == 4]
    if not r4:
        return "\n".join(lines)
    best_fd = min((x for x in r4 if x["kind"] == "fd-online" and x["matched"]), key=lambda x: x["ppl"])
    best_g = min((x for x in r4 if x["kind"] == "global" and not x["reference_only"]), key=lambda x: x["ppl"])
    lines += ["", "Per-layer diagnostics at R = 4 (first window, teacher-forced; max over queries and heads; "
              "slack = the tightest per-query bound/observed):", "",
              format_diagnostics(best_fd["layers"], f"fd-online {best_fd['label']}"), "",
              format_diagnostics(best_g["layers"], best_g["method"]), ""]
    return "\n".join(lines)
