"""The checks and report of ``benchmarks/stories260k_bases.py``: attention-aware score error against K-only's per
layer and KV head, chunked against token-by-token decoding, and the Markdown report."""

from __future__ import annotations

import torch

from kvsplice.evaluation.context import EvalContext
from kvsplice.lowrank.fit_errors import score_error

__all__ = ["TOL", "checks", "chunk_check", "compare_scores", "fmt_md", "timing"]

TOL = 1e-6
"""Slack on the relative score errors: the bases are saved in fp32, so at full rank the attention-aware (oblique)
pair reconstructs to ~3e-7 (sqrt of fp32 rounding) while K-only's orthogonal P gives ~0."""


def compare_scores(stats, fits: dict, rank: int, rope: str, where: str) -> tuple[list[dict], int]:
    """Every (layer, KV head): attention-aware score error ≤ K-only's on its own objective (gqa-concat / kq on the
    per-head scores, gqa-sum on the group-summed scores). Returns the violations and the number of comparisons."""
    bad, n = [], 0
    for l in range(stats.n_layer):
        for j in range(stats.n_kv_head):
            kk = stats.key_gram(l, j, True)
            for obj, methods in (("concat", ("gqa-concat", "kq")), ("sum", ("gqa-sum",))):
                qq = stats.query_gram(l, j, obj, True)
                ko = fits["ksvd"].layers[l][j]
                e_k = score_error(kk, qq, ko.k_enc, ko.k_dec)
                for m in methods:
                    h = fits[m].layers[l][j]
                    e_a = score_error(kk, qq, h.k_enc, h.k_dec)
                    n += 1
                    if e_a > e_k + TOL:
                        bad.append({"where": where, "rope": rope, "rank": rank, "layer": l, "kv_head": j,
                                    "objective": obj, "method": m, "attention_aware": e_a, "k_only": e_k})
    return bad, n


@torch.no_grad()
def chunk_check(ctx: EvalContext, bases, n_windows: int = 2) -> dict:
    """Perplexity of the first windows decoded in chunks of ctx.chunk_size vs token by token (chunk 1)."""
    from kvsplice.decode import Decoder
    from kvsplice.lowrank.method import LowRank

    sub = EvalContext(ctx.loaded, ctx.windows[:n_windows], batch_size=n_windows, chunk_size=ctx.chunk_size)
    dec = Decoder(ctx.model, LowRank(bases))
    a = sub.decode(dec)["ppl"]
    sub.chunk_size = 1
    b = sub.decode(dec)["ppl"]
    return {"windows": n_windows, f"ppl_chunk_{ctx.chunk_size}": a, "ppl_token_by_token": b,
            "rel_diff": abs(a - b) / b}


def fmt_md(report: dict) -> str:
    ranks, ropes, methods = report["config"]["ranks"], report["config"]["ropes"], report["config"]["methods"]
    full = report["full"]
    res = {(r["method"], r["rope"], r["rank"]): r for r in report["results"]}
    d = report["model"]["shapes"]
    per_tok = {r: 2 * d["n_layer"] * d["n_kv_head"] * r for r in ranks}
    full_tok = 2 * d["n_layer"] * d["n_kv_head"] * d["head_dim"]
    lines = [f"Perplexity of stories260K ({d['n_layer']} layers, {d['n_head']} query / {d['n_kv_head']} KV heads, "
             f"head_dim {d['head_dim']}) on {report['eval']['tokens']:,} held-out TinyStories validation tokens "
             f"({report['eval']['windows']} windows × {report['eval']['seq_len']}), bases calibrated on "
             f"{report['calibration']['tokens']:,} train-sample tokens. Every token attends over the cache (chunks of "
             f"{report['config']['chunk_size']} tokens appended, then attended); value rank = key rank. "
             f"Full K/V cache: **{full['ppl']:.4f}** (model's own forward: {full['model_forward_ppl']:.4f}).", "",
             "| method | RoPE | " + " | ".join(f"R={r} ({per_tok[r]}/{full_tok} numbers/token)" for r in ranks)
             + " |",
             "|---|---|" + "---|" * len(ranks)]
    for m in methods:
        for rope in ropes:
            cells = [f"{res[(m, rope, r)]['ppl']:.3f}" for r in ranks]
            lines.append(f"| {m} | {rope} | " + " | ".join(cells) + " |")
    lines += ["", "Held-out attention-score error ‖KQᵀ − K A BᵀQᵀ‖/‖KQᵀ‖ (per-head queries; mean over layers) / "
              "attention-output error after W_O (mean over layers):", "",
              "| method | RoPE | " + " | ".join(f"R={r}" for r in ranks[:-1]) + " |",
              "|---|---|" + "---|" * (len(ranks) - 1)]
    for m in methods:
        for rope in ropes:
            cells = []
            for r in ranks[:-1]:
                x = res[(m, rope, r)]
                cells.append(f"{x['score_err_mean']:.3f} / {x['attn_out_err_mean']:.3f}")
            lines.append(f"| {m} | {rope} | " + " | ".join(cells) + " |")
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
    viol_cal, viol_ho, n_cal, n_ho = [], [], 0, 0
    lesens_ok, lesens_r4 = True, {}
    for rope in ropes:
        cal = next(v["stats"][rope] for v in calib_cache.values() if rope in v["stats"])
        ho = ctx.stats(rope)
        for r in ranks:
            fits = {m: fits_all[(rope, r, m)] for m in methods}
            b, n = compare_scores(cal, fits, r, rope, "calibration")
            viol_cal += b
            n_cal += n
            b, n = compare_scores(ho, fits, r, rope, "held_out")
            viol_ho += b
            n_ho += n
        for res in results:
            if res["rope"] == rope:
                gaps = [g for row in res["layers"] for g in row["lesens"]["gap_rel_per_head"]]
                lesens_ok &= all(g >= -1e-12 for g in gaps)
                if res["rank"] == 4 and res["method"] == "ksvd":
                    lesens_r4[rope] = sum(row["lesens"]["gap_rel"] for row in res["layers"]) / len(res["layers"])
    by = {(x["method"], x["rope"], x["rank"]): x for x in results}
    chunk = {}
    for rope in ropes:
        chunk[f"gqa-concat {rope} R=4"] = chunk_check(ctx, fits_all[(rope, 4, "gqa-concat")])
    ex = by.get(("gqa-concat", ropes[0], 4)) or results[0]
    fc = full["cache"]
    return {
        "aa_le_konly": {"calibration": {"violations": len(viol_cal), "comparisons": n_cal, "list": viol_cal},
                        "held_out": {"violations": len(viol_ho), "comparisons": n_ho, "list": viol_ho}},
        "lesens_nonneg": lesens_ok, "lesens_r4_mean": lesens_r4,
        "bytes": {"n": len(results), "all_match": all(x["cache"]["bytes_match"] for x in results) and
                  fc["bytes_match"], "example_r4": ex["cache"]["measured_live_bytes"],
                  "full": fc["measured_live_bytes"], "batch": fc["batch_size"], "seq_len": fc["seq_len"]},
        "full_rank_max_rel": max(abs(x["ppl_ratio"] - 1) for x in results if x["rank"] == 8) if 8 in ranks
        else None,
        "chunk_vs_token": chunk,
    }


def timing(calib_cache, fit_reports, ropes) -> dict:
    """Per RoPE mode: calibration and fit time against one plain forward pass."""
    timing = {}
    for rope in ropes:
        cal = next(v for v in calib_cache.values() if rope in v["stats"])
        fit_s = [fit_reports[k]["timings_s"]["fit"] for k in fit_reports if k[0] == rope]
        ratios = [(cal["calibrate_s"] + f) / cal["forward_s"] for f in fit_s]
        timing[rope] = {"calibrate_s": cal["calibrate_s"], "forward_s": cal["forward_s"], "fit_s_min": min(fit_s),
                        "fit_s_max": max(fit_s), "ratio_min": min(ratios), "ratio_max": max(ratios)}
    return timing
