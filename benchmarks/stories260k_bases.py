"""Post-training KV bases on a real pretrained GQA + RoPE model: stories260K (llama2.c) on TinyStories.

    python -m benchmarks.stories260k_bases                # → results/stories260k_bases.json + .md (≈ 5 min, 1 CPU)

Through the CLIs' own code (:mod:`kvsplice.cli.fit_bases`, :mod:`kvsplice.evaluation.lowrank`): calibrate on the
train sample once per RoPE mode, fit every method at every rank, evaluate each on the validation sample (perplexity
through the coefficient cache, held-out errors, Lesens' gap, bytes vs formula). Checks: attention-aware ≤ K-only
score error per layer, KV head and rank; bytes == formula; full rank == full cache; chunked == token by token.
"""

from __future__ import annotations

import itertools

from benchmarks.harness.options import UsageError
from benchmarks.harness.paths import CALIB, EVAL, STORIES
from benchmarks.harness.runner import Study
from benchmarks.lib.bases_report import checks, timing
from benchmarks.lib.stories import calibration_ids, load_stories
from kvsplice.evaluation.context import EvalContext, load_windows
from kvsplice.evaluation.lowrank import evaluate_bases
from kvsplice.cli.fit_bases import fit_one
from kvsplice.lowrank.calibrate import calibrate, calibration_batches
from kvsplice.lowrank.options import FitBasesOptions
from kvsplice.lowrank.fits import FITS


def options(p) -> None:
    p.add_argument("--calib-tokens", dest="calib_tokens", type=int, help="calibration tokens")
    p.add_argument("--eval-tokens", dest="eval_tokens", type=int, help="held-out tokens")
    p.add_argument("--seq-len", dest="seq_len", type=int, help="window length (the model's context: 512)")
    p.add_argument("--batch-size", dest="batch_size", type=int, help="windows per batch")
    p.add_argument("--chunk-size", dest="chunk_size", type=int, help="tokens appended per decode call")
    p.add_argument("--ranks", type=int, nargs="+", help="ranks (head_dim 8; 4 is checked chunked)")
    p.add_argument("--methods", nargs="+", choices=FITS, help="fits (ksvd always: the reference)")
    p.add_argument("--ropes", nargs="+", choices=["post", "pre"], help="RoPE modes")


def rows(run):
    ranks, ropes = run["ranks"], run["ropes"]
    methods = run["methods"] if "ksvd" in run["methods"] else ["ksvd", *run["methods"]]
    if 4 not in ranks or "gqa-concat" not in methods:
        raise UsageError("--ranks needs 4 and --methods gqa-concat (the chunked-decode check)")
    loaded = load_stories(need=(CALIB, EVAL))
    windows, eval_info = load_windows(loaded, str(EVAL), run["eval_tokens"], run["seq_len"])
    ctx = EvalContext(loaded, windows, batch_size=run["batch_size"], chunk_size=run["chunk_size"], err_windows=2,
                      data_info=eval_info)
    full = ctx.full()
    run.say(f"full K/V cache ppl {full['ppl']:.4f} (model forward {full['model_forward_ppl']:.4f})")
    calib_cache, fits_all, fit_reports = {}, {}, {}
    for rope, r, m in itertools.product(ropes, ranks, methods):
        opts = FitBasesOptions(model="stories260K", fit=(m,), rank=(r,), rope=(rope,), calib=str(CALIB),
                               calib_tokens=run["calib_tokens"], seq_len=run["seq_len"],
                               batch_size=run["batch_size"], out="unused", progress=False)
        fits_all[(rope, r, m)], fit_reports[(rope, r, m)] = bases, rep = fit_one(opts, loaded, calib_cache=calib_cache)
        res = {**evaluate_bases(ctx, bases, label=f"{m}-{rope}-r{r}"), "rank": r}
        for key, part in (("score_err_mean", "scores"), ("score_sum_err_mean", "scores_sum"),
                          ("value_err_mean", "values"), ("attn_out_err_mean", "attn_out")):
            res[key] = sum(x[part] for x in res["layers"]) / len(res["layers"])
        res["fit"] = {k: rep[k] for k in ("timings_s", "retained_k", "retained_v")}
        res.pop("per_head")
        run.say(f"{m:>10} {rope:>4} R={r}: ppl {res['ppl']:.4f} (×{res['ppl_ratio']:.3f}), score err "
                f"{res['score_err_mean']:.3f}, attn-out err {res['attn_out_err_mean']:.3f}, bytes "
                f"{res['cache']['measured_live_bytes']:,} {'==' if res['cache']['bytes_match'] else '!='} formula")
        yield res
    ids = calibration_ids(loaded, run["calib_tokens"])
    half = calibrate(loaded.model, calibration_batches(ids, run["seq_len"], run["batch_size"],
                                                       run["calib_tokens"] // 2), progress=False)
    full_cal = next(iter(next(iter(calib_cache.values()))["stats"].values()))  # (a calibration run: mode → stats)
    fr = next(iter(fit_reports.values()))
    run.notes.update(
        methods=methods, model={"source": str(STORIES / "stories260K.bin"), "shapes": fr["shapes"],
               "fingerprint": fr["model_fingerprint"]},
        calibration={**fr["calibration"], "source": CALIB.name}, eval={**eval_info, "source": EVAL.name}, full=full,
        checks=checks(ctx, run.rows, fits_all, calib_cache, ranks, ropes, methods, full),
        timing=timing(calib_cache, fit_reports, ropes),
        memory={"tokens": [half.n_tokens, full_cal.n_tokens], "stats_nbytes": [half.nbytes(), full_cal.nbytes()]})


STUDY = Study("stories260k_bases", __doc__, rows, options=options, summary=lambda run, rows: run.notes,
              bounds={"calib_tokens": (512, 1 << 22), "eval_tokens": (512, 1 << 22), "seq_len": (2, 512),
                      "batch_size": (1, 1024), "chunk_size": (1, 512), "ranks": (1, 8)})
main = STUDY.main

if __name__ == "__main__":
    raise SystemExit(main())
