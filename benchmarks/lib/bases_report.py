"""The checks and reports of the stories260K bases studies: ``benchmarks/stories260k_bases.py`` and
``benchmarks/fd_online_stories260k.py`` (online frequent-directions bases against global bases per rank budget)."""

from __future__ import annotations

from kvsplice.core.diagnostics import format_diagnostics
from kvsplice.lowrank.fit_errors import score_error

__all__ = ["TOL", "best", "checks", "chunk_check", "compare_scores", "fd_markdown", "fmt_md", "summary", "timing"]

TOL = 1e-6  # slack on the score errors: at full rank the fp32 oblique pair reconstructs to ~3e-7, K-only's to ~0


def compare_scores(stats, fits: dict, rank: int, rope: str, where: str) -> tuple[list[dict], int]:
    """Every (layer, KV head): attention-aware score error ≤ K-only's on its own objective (gqa-concat / kq on the
    per-head scores, gqa-sum on the group-summed scores). Returns the violations and the number of comparisons."""
    bad, n = [], 0
    for l in range(stats.n_layer):
        for j in range(stats.n_kv_head):
            kk = stats.key_gram(l, j, True)
            for obj, methods in (("concat", ("gqa-concat", "kq")), ("sum", ("gqa-sum",))):
                qq = stats.query_gram(l, j, obj, True)
                e_k = score_error(kk, qq, fits["ksvd"].layers[l][j].k_enc, fits["ksvd"].layers[l][j].k_dec)
                for m in methods:
                    e_a, n = score_error(kk, qq, fits[m].layers[l][j].k_enc, fits[m].layers[l][j].k_dec), n + 1
                    if e_a > e_k + TOL:
                        bad.append({"where": where, "rope": rope, "rank": rank, "layer": l, "kv_head": j,
                                    "objective": obj, "method": m, "attention_aware": e_a, "k_only": e_k})
    return bad, n


def chunk_check(ctx, bases, n_windows: int = 2) -> dict:
    """Perplexity of the first windows decoded in chunks of ctx.chunk_size vs token by token (chunk 1)."""
    from kvsplice.decode import Decoder, perplexity
    from kvsplice.lowrank.method import LowRank

    dec, ids = Decoder(ctx.model, LowRank(bases)), ctx.windows[:n_windows]
    a, b = perplexity(dec, ids, ctx.chunk_size), perplexity(dec, ids, 1)
    return {"windows": n_windows, f"ppl_chunk_{ctx.chunk_size}": a, "ppl_token_by_token": b,
            "rel_diff": abs(a - b) / b}


def setting(shapes: dict, ev: dict, calibration: dict) -> str:
    """The model, its held-out text and its calibration text, in words."""
    return (f"stories260K ({shapes['n_layer']} layers, {shapes['n_head']} query / {shapes['n_kv_head']} KV heads, "
            f"head_dim {shapes['head_dim']}) on {ev['tokens']:,} held-out TinyStories validation tokens "
            f"({ev['windows']} windows × {ev['seq_len']}), bases calibrated on {calibration['tokens']:,} train-sample "
            "tokens")


def fmt_md(report: dict) -> str:
    ranks, ropes, methods = report["config"]["ranks"], report["config"]["ropes"], report["config"]["methods"]
    full = report["full"]
    res = {(r["method"], r["rope"], r["rank"]): r for r in report["results"]}
    d = report["model"]["shapes"]

    def grid(cols, name, cell) -> list[str]:  # a row per method and RoPE mode, a column per rank
        return ["| method | RoPE | " + " | ".join(map(name, cols)) + " |", "|---|---|" + "---|" * len(cols),
                *(f"| {m} | {rope} | " + " | ".join(cell(res[(m, rope, r)]) for r in cols) + " |"
                  for m in methods for rope in ropes)]

    per_tok = {r: 2 * d["n_layer"] * d["n_kv_head"] * r for r in ranks}
    full_tok = 2 * d["n_layer"] * d["n_kv_head"] * d["head_dim"]
    lines = [f"Perplexity of {setting(d, report['eval'], report['calibration'])}. Every token attends over the "
             f"cache (chunks of {report['config']['chunk_size']} tokens appended, then attended); value rank = key "
             f"rank. Full K/V cache: **{full['ppl']:.4f}** (model's own forward: {full['model_forward_ppl']:.4f}).", "",
             *grid(ranks, lambda r: f"R={r} ({per_tok[r]}/{full_tok} numbers/token)", lambda x: f"{x['ppl']:.3f}"),
             "", "Held-out attention-score error ‖KQᵀ − K A BᵀQᵀ‖/‖KQᵀ‖ (per-head queries; mean over layers) / "
             "attention-output error after W_O (mean over layers):", "",
             *grid(ranks[:-1], "R={}".format, lambda x: f"{x['score_err_mean']:.3f} / {x['attn_out_err_mean']:.3f}")]
    c = report["checks"]
    lines += ["", f"* Attention-aware ≤ K-only score error (+{TOL:g}), every layer × KV head × rank × RoPE mode × "
              f"objective (gqa-concat and kq on per-head scores, gqa-sum on group-summed scores): "
              f"**{c['aa_le_konly']['calibration']['violations']} violations / "
              f"{c['aa_le_konly']['calibration']['comparisons']}** on the calibration Grams (a theorem), "
              f"**{c['aa_le_konly']['held_out']['violations']} / {c['aa_le_konly']['held_out']['comparisons']}** "
              f"on the held-out Grams.",
              f"* Lesens' gap ε ≥ 0 on held-out Grams for every layer/head/rank: {c['lesens_nonneg']}; layer-mean "
              f"ε/‖KQᵀ‖² at R=4: " + ", ".join(f"{rope} {c['lesens_r4_mean'].get(rope, float('nan')):.3f}" for rope in ropes) + ".",
              f"* Measured cache bytes == formula for all {c['bytes']['n']} compressed caches and the full cache: "
              f"{c['bytes']['all_match']} (e.g. R=4: {c['bytes']['example_r4']:,} B vs full K/V "
              f"{c['bytes']['full']:,} B for {c['bytes']['batch']} × {c['bytes']['seq_len']} tokens, fp32).",
              f"* Full rank (R=8) reproduces the full cache: max |ppl/ppl_full − 1| = {c['full_rank_max_rel']:.1e}.",
              "* Chunked (64) vs token-by-token decode: " + ", ".join(
                  f"{k} rel. diff {v['rel_diff']:.1e}" for k, v in c["chunk_vs_token"].items()) + ".",
              f"* Calibration + fit time / one plain forward pass over the same {report['calibration']['tokens']:,} "
              f"tokens: " + ", ".join(f"{rope}: calibration {t['calibrate_s']:.2f} s, forward {t['forward_s']:.2f} s, "
                                      f"fit {t['fit_s_min'] * 1e3:.0f}–{t['fit_s_max'] * 1e3:.0f} ms → ratio "
                                      f"{t['ratio_min']:.2f}–{t['ratio_max']:.2f}"
                                      for rope, t in report["timing"].items()) + ".",
              "* Calibration statistics with the calibration text doubled: "
              + ", ".join(f"{int(k):,} tokens → {v:,} bytes" for k, v in report["memory"]["stats_nbytes"].items())
              + " (flat: the Grams are d×d per head).", ""]
    return "\n".join(lines)


def checks(ctx, results, fits_all, calib_cache, ranks, ropes, methods, full) -> dict:
    """Attention-aware ≤ K-only score errors, Lesens' gap, bytes == formula, full rank, chunked decoding."""
    viol, n = {"calibration": [], "held_out": []}, {"calibration": 0, "held_out": 0}
    lesens_ok, lesens_r4 = True, {}
    for rope in ropes:
        grams = {"calibration": next(v["stats"][rope] for v in calib_cache.values() if rope in v["stats"]),
                 "held_out": ctx.stats(rope)}
        for r in ranks:
            for where, stats in grams.items():
                bad, k = compare_scores(stats, {m: fits_all[(rope, r, m)] for m in methods}, r, rope, where)
                viol[where], n[where] = viol[where] + bad, n[where] + k
        for res in (x for x in results if x["rope"] == rope):
            lesens_ok &= all(g >= -1e-12 for row in res["layers"] for g in row["lesens"]["gap_rel_per_head"])
            if res["rank"] == 4 and res["method"] == "ksvd":
                lesens_r4[rope] = sum(row["lesens"]["gap_rel"] for row in res["layers"]) / len(res["layers"])
    ex = next((x for x in results if (x["method"], x["rope"], x["rank"]) == ("gqa-concat", ropes[0], 4)), results[0])
    fc = full["cache"]
    return {
        "aa_le_konly": {w: {"violations": len(viol[w]), "comparisons": n[w], "list": viol[w]} for w in viol},
        "lesens_nonneg": lesens_ok, "lesens_r4_mean": lesens_r4,
        "bytes": {"n": len(results), "all_match": all(x["cache"]["bytes_match"] for x in results) and
                  fc["bytes_match"], "example_r4": ex["cache"]["measured_live_bytes"],
                  "full": fc["measured_live_bytes"], "batch": fc["batch_size"], "seq_len": fc["seq_len"]},
        "full_rank_max_rel": max(abs(x["ppl_ratio"] - 1) for x in results if x["rank"] == 8) if 8 in ranks
        else None,
        "chunk_vs_token": {f"gqa-concat {rope} R=4": chunk_check(ctx, fits_all[(rope, 4, "gqa-concat")])
                           for rope in ropes},
    }


def timing(calib_cache, fit_reports, ropes) -> dict:
    """Per RoPE mode: calibration and fit time against one plain forward pass."""
    out = {}
    for rope in ropes:
        cal = next(v for v in calib_cache.values() if rope in v["stats"])
        fit_s = [fit_reports[k]["timings_s"]["fit"] for k in fit_reports if k[0] == rope]
        out[rope] = {"calibrate_s": cal["calibrate_s"], "forward_s": cal["forward_s"], "fit_s_min": min(fit_s),
                     "fit_s_max": max(fit_s), "ratio_min": (cal["calibrate_s"] + min(fit_s)) / cal["forward_s"],
                     "ratio_max": (cal["calibrate_s"] + max(fit_s)) / cal["forward_s"]}
    return out


SLACKS = {"slack_logit": "logit_slack", "slack_softmax_tanh": "softmax_slack", "slack_softmax_sinh":
          "softmax_sinh_slack", "slack_output": "output_slack", "tightest_logit": "logit_tightest",
          "tightest_output": "output_tightest"}
"""A row's slack field → the per-layer diagnostic it is the minimum of."""


def summary(diag: list[dict]) -> dict:
    """Across layers: mean relative head-output error, the largest logit error, bounds held, worst slack."""
    return {"rel_out_mean": sum(d["rel_output_err"] for d in diag) / len(diag),
            "logit_err_max": max(d["logit_err"] for d in diag), "softmax_l1_max": max(d["softmax_l1"] for d in diag),
            "bounds_hold": all(d["holds"] and d.get("holds_recorded", True) for d in diag),
            **{k: min(d[v] for d in diag) for k, v in SLACKS.items()},
            **({"chunks_max": max(d["chunks_max"] for d in diag),
                "chunks_mean": sum(d["chunks_mean"] for d in diag) / len(diag)} if "chunks_max" in diag[0] else {})}


def best(rows: list[dict]) -> tuple[dict, dict | None]:
    """The best attention-aware global row and the best matched fd-online row (None: none matched)."""
    return (min((x for x in rows if x["kind"] == "global" and not x["reference_only"]), key=lambda x: x["ppl"]),
            min((x for x in rows if x["kind"] == "fd-online" and x["matched"]), key=lambda x: x["ppl"], default=None))


def fd_markdown(rep: dict, ranks=(2, 4, 6)) -> str:
    """The report of a run: ``rep`` holds the header, the model, eval and calibration, ``full_ppl`` and the rows."""
    L = rep["model"]
    per_tok = 2 * L["n_layer"] * L["n_kv_head"] * L["head_dim"]
    lines = [f"{setting(L, rep['eval'], rep['calibration'])} (global bases). Full K/V cache: ppl "
             f"**{rep['full_ppl']:.3f}** ({per_tok} numbers/token). Bytes are per 512-token sequence, fp32, "
             "coefficients + bases (fd-online: FD sketches listed separately); '×budget' = bytes / the global rank-R "
             "cache's bytes. rel_out: teacher-forced head-output error (Σ‖o−ô‖²/Σ‖o‖²)^½, mean over layers; ε: max "
             "logit error; J: chunks per stream at T = 512 (max / mean over layers and KV heads).", ""]
    lines += ["| R (budget) | method | config | ppl | bytes | ×budget | sketch bytes | J max / mean | rel_out | ε max "
              "| bounds hold |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    by = {r: [x for x in rep["rows"] if x["budget_rank"] == r] for r in ranks}
    for r, rs in by.items():
        glob = [x for x in rs if x["kind"] == "global"]
        budget, winners = glob[0]["bytes"], best(rs)
        for x in glob + sorted((x for x in rs if x["kind"] == "fd-online"), key=lambda x: x["ppl"]):
            fd, name = x["kind"] == "fd-online", x["method"] + (" (reference)" if x.get("reference_only") else "")
            j = f"{x['chunks_max']} / {x['chunks_mean']:.1f}" if "chunks_max" in x else "—"
            sk = f"{x['sketch_bytes']:,}" if fd else "—"
            lines.append(f"| {r} ({2 * r}/token) | {f'**{name}**' if any(x is w for w in winners) else name} | "
                         f"{x.get('label', f'R={r}')} | {x['ppl']:.3f} | {x['bytes']:,} | {x['bytes'] / budget:.3f}"
                         f"{' (over)' if fd and not x['matched'] else ''} | {sk} | {j} | {x['rel_out_mean']:.3f} | "
                         f"{x['logit_err_max']:.1f} | {'yes' if x['bounds_hold'] else 'NO'} |")
    lines += ["", "Best matched fd-online vs best global attention-aware post-RoPE method (ppl):", ""]
    for r, rs in by.items():
        (g, f), k = best(rs), next(x for x in rs if x["method"].startswith("ksvd"))
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
    best_g, best_fd = best(r4)
    lines += ["", "Per-layer diagnostics at R = 4 (first window, teacher-forced; max over queries and heads; "
              "slack = the tightest per-query bound/observed):", "",
              format_diagnostics(best_fd["layers"], f"fd-online {best_fd['label']}"), "",
              format_diagnostics(best_g["layers"], best_g["method"]), ""]
    return "\n".join(lines)
