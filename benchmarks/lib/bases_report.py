"""The checks of ``benchmarks/stories260k_bases.py`` and the summary (with its report's per-layer tables) of
``benchmarks/fd_online_stories260k.py`` (online frequent-directions bases against global bases per rank budget)."""

from __future__ import annotations

from kvsplice.core.diagnostics import format_diagnostics
from kvsplice.decode import Decoder, perplexity
from kvsplice.lowrank.method import LowRank
from kvsplice.lowrank.fit_errors import score_error

__all__ = ["TOL", "checks", "compare_scores", "fd_summary", "summary", "timing"]

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


def checks(ctx, results, fits_all, calib_cache, ranks, ropes, methods, full) -> dict:
    """Attention-aware ≤ K-only score errors, Lesens' gap, bytes == formula, full rank, and chunked decoding: the
    perplexity of the first two windows decoded in chunks of ``ctx.chunk_size`` vs token by token (chunk 1)."""
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
    chunked = {}
    for rope in ropes:
        dec, ids = Decoder(ctx.model, LowRank(fits_all[(rope, 4, "gqa-concat")])), ctx.windows[:2]
        a, b = perplexity(dec, ids, ctx.chunk_size), perplexity(dec, ids, 1)
        chunked[f"gqa-concat {rope} R=4"] = {"windows": 2, f"ppl_chunk_{ctx.chunk_size}": a,
                                               "ppl_token_by_token": b, "rel_diff": abs(a - b) / b}
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
        "chunk_vs_token": chunked,
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
          "tightest_output": "output_tightest"}  # a row's slack field → the per-layer diagnostic it is the min of


def summary(diag: list[dict]) -> dict:
    """Across layers: mean relative head-output error, the largest logit error, bounds held, worst slack."""
    return {"rel_out_mean": sum(d["rel_output_err"] for d in diag) / len(diag),
            "logit_err_max": max(d["logit_err"] for d in diag), "softmax_l1_max": max(d["softmax_l1"] for d in diag),
            "bounds_hold": all(d["holds"] and d.get("holds_recorded", True) for d in diag),
            **{k: min(d[v] for d in diag) for k, v in SLACKS.items()},
            **({"chunks_max": max(d["chunks_max"] for d in diag),
                "chunks_mean": sum(d["chunks_mean"] for d in diag) / len(diag)} if "chunks_max" in diag[0] else {})}


def fd_summary(notes: dict, rows: list[dict]) -> dict:
    """The summary: ``notes`` with the full cache's numbers per token (and in ``notes`` only, ``per_layer``: the
    report's per-layer tables); per budget R each row's ``x_budget`` (bytes / the global rank-R cache's) and ``best``
    (the lowest-ppl attention-aware global row and matched fd-online row)."""
    for r in dict.fromkeys(x["budget_rank"] for x in rows):
        rs = [x for x in rows if x["budget_rank"] == r]
        glob = [x for x in rs if x["kind"] == "global"]
        g = min((x for x in glob if not x["reference_only"]), key=lambda x: x["ppl"])
        f = min((x for x in rs if x["kind"] == "fd-online" and x["matched"]), key=lambda x: x["ppl"], default=None)
        for x in rs:
            x.update(x_budget=x["bytes"] / glob[0]["bytes"], best=x is g or x is f)
    m = notes["model"]
    notes["full_numbers"] = 2 * m["n_layer"] * m["n_kv_head"] * m["head_dim"]
    best = [x for x in rows if x["budget_rank"] == 4 and x.get("best")]
    tables = [format_diagnostics(x["layers"], f"{x['method']} {x.get('label', '')}".strip()) + "\n" for x in best]
    head = ["Per-layer diagnostics at R = 4 (first window, teacher-forced; max over queries and heads; slack = the "
            "tightest per-query bound/observed):", ""] if best else []
    notes["per_layer"] = "\n".join(head + tables)  # the report's footer
    return {k: v for k, v in notes.items() if k != "per_layer"}
