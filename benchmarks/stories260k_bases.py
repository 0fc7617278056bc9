"""Post-training KV bases on a real pretrained GQA + RoPE model: stories260K (llama2.c) on TinyStories.

    python -m benchmarks.stories260k_bases                # → results/stories260k_bases.json + .md (≈ 5 min, 1 CPU)

Steps (all through the CLIs' own code: :mod:`kvsplice.fit_bases` / :mod:`kvsplice.eval_bases`):

1. convert ``../shared/data/stories260K/stories260K.bin`` + ``tok512.bin`` into a temporary HF Llama directory
   (``python -m kvsplice.convert_llama2c``) and load it with :func:`kvsplice.loading.load_model`;
2. calibrate on the TinyStories **train** sample (``gusjengis_toy-RNN__tinystories_sample.txt``, first
   ``--calib-tokens``, windows of 512 = the model's context), once per RoPE mode (post, pre), timing one plain
   forward pass over the same windows;
3. fit every method (ksvd, eigen, kq, gqa-sum, gqa-concat) at every rank (2, 4, 6, 8 of head_dim 8; value rank =
   key rank) from those Grams;
4. evaluate each on the TinyStories **validation** sample (``yuninxia_moe-routing-bench__tinystories_val.txt``,
   first ``--eval-tokens``): perplexity through the coefficient cache vs the full K/V cache (chunks of 64 tokens
   appended to the cache; checked equal to token-by-token decoding on two windows), per-layer held-out errors,
   Lesens' gap, measured cache bytes vs the formula;
5. checks: attention-aware score error ≤ K-only score error for every layer, KV head and rank (held-out Grams, and
   calibration Grams where it is a theorem); measured bytes == formula; full rank reproduces the full cache;
   calibration statistics' size with the calibration text doubled.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch


from benchmarks.harness.header import command as command_line, machine, revision
from benchmarks.harness.options import add_json, add_threads, command, parser
from benchmarks.harness.paths import CALIB, EVAL, RESULTS, STORIES
from kvsplice.evaluation.context import EvalContext, load_windows
from kvsplice.evaluation.lowrank import evaluate_bases
from kvsplice.cli.fit_bases import build_parser as fit_parser, fit_from_args
from kvsplice.io.outputs import write_json
from kvsplice.lowrank.fits import FITS, score_error


TOL = 1e-6
"""Slack on the relative score errors: the bases are saved in fp32, so at full rank the attention-aware (oblique)
pair reconstructs to ~3e-7 (sqrt of fp32 rounding) while K-only's orthogonal P gives ~0."""


def _fit_args(method: str, rank: int, rope: str, a: argparse.Namespace) -> argparse.Namespace:
    return fit_parser().parse_args(["--model", "stories260K", "--fit", method, "--rank", str(rank), "--rope", rope,
                                    "--calib", str(CALIB), "--calib-tokens", str(a.calib_tokens), "--seq-len",
                                    str(a.seq_len), "--batch-size", str(a.batch_size), "--out", "unused",
                                    "--no-progress"])


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


@command
def main(argv=None) -> int:
    p = parser(__file__, __doc__)
    p.add_argument("--calib-tokens", type=int, default=65536)
    p.add_argument("--eval-tokens", type=int, default=32768)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--chunk-size", type=int, default=64)
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 6, 8])
    p.add_argument("--methods", nargs="+", default=list(FITS), choices=FITS)
    p.add_argument("--ropes", nargs="+", default=["post", "pre"], choices=["post", "pre"])
    add_threads(p)
    add_json(p, RESULTS / "stories260k_bases.json")
    p.add_argument("--md", default=str(RESULTS / "stories260k_bases.md"))
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    for f in (STORIES / "stories260K.bin", STORIES / "tok512.bin", CALIB, EVAL):
        if not f.is_file():
            print(f"missing reference data: {f}", file=sys.stderr)
            return 1
    if "ksvd" not in a.methods:
        a.methods = ["ksvd"] + a.methods
    from kvsplice.lowrank.calibrate import calibrate, calibration_batches
    from kvsplice.convert.llama2c import convert_llama2c
    from kvsplice.loading import iter_texts, load_model, token_stream

    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = convert_llama2c(STORIES / "stories260K.bin", STORIES / "tok512.bin", Path(tmp) / "stories260K")
        loaded = load_model(model_dir)
    windows, eval_info = load_windows(loaded, str(EVAL), a.eval_tokens, a.seq_len)
    ctx = EvalContext(loaded, windows, batch_size=a.batch_size, chunk_size=a.chunk_size, err_windows=2,
                      data_info=eval_info)
    full = ctx.full()
    print(f"full K/V cache ppl {full['ppl']:.4f} (model forward {full['model_forward_ppl']:.4f})", flush=True)

    calib_cache: dict = {}
    results, fits_all, fit_reports = [], {}, {}
    for rope in a.ropes:
        for r in a.ranks:
            for m in a.methods:
                bases, rep = fit_from_args(_fit_args(m, r, rope, a), loaded=loaded, calib_cache=calib_cache)
                fits_all[(rope, r, m)] = bases
                fit_reports[(rope, r, m)] = rep
                res = evaluate_bases(ctx, bases, label=f"{m}-{rope}-r{r}")
                res["rank"] = r
                res["score_err_mean"] = sum(x["scores"] for x in res["layers"]) / len(res["layers"])
                res["score_sum_err_mean"] = sum(x["scores_sum"] for x in res["layers"]) / len(res["layers"])
                res["value_err_mean"] = sum(x["values"] for x in res["layers"]) / len(res["layers"])
                res["attn_out_err_mean"] = sum(x["attn_out"] for x in res["layers"]) / len(res["layers"])
                res["fit"] = {k: rep[k] for k in ("timings_s", "retained_k", "retained_v")}
                res.pop("per_head")
                results.append(res)
                print(f"{m:>10} {rope:>4} R={r}: ppl {res['ppl']:.4f} (×{res['ppl_ratio']:.3f}), score err "
                      f"{res['score_err_mean']:.3f}, attn-out err {res['attn_out_err_mean']:.3f}, bytes "
                      f"{res['cache']['measured_live_bytes']:,} {'==' if res['cache']['bytes_match'] else '!='} "
                      f"formula  [{time.perf_counter() - t_start:.0f} s]", flush=True)

    # ---- checks
    viol_cal, viol_ho, n_cal, n_ho = [], [], 0, 0
    lesens_ok, lesens_r4 = True, {}
    for rope in a.ropes:
        cal = next(v["stats"] for k, v in calib_cache.items() if k[-1] == rope)
        ho = ctx.stats(rope)
        for r in a.ranks:
            fits = {m: fits_all[(rope, r, m)] for m in a.methods}
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
    for rope in a.ropes:
        chunk[f"gqa-concat {rope} R=4"] = chunk_check(ctx, fits_all[(rope, 4, "gqa-concat")])
    ex = by.get(("gqa-concat", a.ropes[0], 4)) or results[0]
    fc = full["cache"]
    checks = {
        "aa_le_konly": {"calibration": {"violations": len(viol_cal), "comparisons": n_cal, "list": viol_cal},
                        "held_out": {"violations": len(viol_ho), "comparisons": n_ho, "list": viol_ho}},
        "lesens_nonneg": lesens_ok, "lesens_r4_mean": lesens_r4,
        "bytes": {"n": len(results), "all_match": all(x["cache"]["bytes_match"] for x in results) and
                  fc["bytes_match"], "example_r4": ex["cache"]["measured_live_bytes"],
                  "full": fc["measured_live_bytes"], "batch": fc["batch_size"], "seq_len": fc["seq_len"]},
        "full_rank_max_rel": max(abs(x["ppl_ratio"] - 1) for x in results if x["rank"] == 8) if 8 in a.ranks
        else None,
        "chunk_vs_token": chunk,
    }
    # ---- timing and memory
    timing = {}
    for rope in a.ropes:
        run = next(v for k, v in calib_cache.items() if k[-1] == rope)
        fit_s = [fit_reports[k]["timings_s"]["fit"] for k in fit_reports if k[0] == rope]
        ratios = [(run["calibrate_s"] + f) / run["forward_s"] for f in fit_s]
        timing[rope] = {"calibrate_s": run["calibrate_s"], "forward_s": run["forward_s"], "fit_s_min": min(fit_s),
                        "fit_s_max": max(fit_s), "ratio_min": min(ratios), "ratio_max": max(ratios)}
    ids, _ = token_stream(iter_texts(str(CALIB)), loaded.tokenizer, a.calib_tokens)
    half = calibrate(loaded.model, calibration_batches(ids, a.seq_len, a.batch_size, a.calib_tokens // 2),
                     progress=False)
    full_cal = next(v["stats"] for k, v in calib_cache.items())
    memory = {"stats_nbytes": {half.n_tokens: half.nbytes(), full_cal.n_tokens: full_cal.nbytes()}}

    fr = next(iter(fit_reports.values()))
    report = {
        "command": command_line(__file__, argv), "revision": revision(),
        "config": {"ranks": a.ranks, "methods": a.methods, "ropes": a.ropes, "chunk_size": a.chunk_size,
                   "batch_size": a.batch_size, "seq_len": a.seq_len, "threads": a.threads},
        "environment": machine(a.threads),
        "model": {"source": str(STORIES / "stories260K.bin"), "shapes": fr["shapes"],
                  "fingerprint": fr["model_fingerprint"]},
        "calibration": {**fr["calibration"], "source": CALIB.name},
        "eval": {**eval_info, "source": EVAL.name},
        "full": full, "results": results, "checks": checks, "timing": timing, "memory": memory,
        "wall_s": time.perf_counter() - t_start,
    }
    write_json(report, a.json)
    md = fmt_md(report)
    Path(a.md).write_text(f"<!-- made by: {report['command'].strip()} -->\n" + md)
    print(md)
    print(f"wrote {a.json} and {a.md} in {report['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
