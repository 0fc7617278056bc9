"""Choose the shared layout's latent / RoPE split of SmolLM2-135M on the *fine-tune* text (never the evaluation text).

    python -m benchmarks.convert_rope_split [--ratios 2 4 8] [--rope-dims 16 32 64]

At each ratio the cache ``R + Dr`` is fixed (``R = 2·Hkv·D / ratio − Dr``): the RoPE key's width trades against the
latent. Calibration: the first ``--calib-tokens`` of the TinyStories train sample; selection: ``--windows`` × 1,024
of its tokens from ``--skip`` (past every fine-tune's tokens), protocol P (768 prompt, 256 scored). Writes
``results/convert_rope_split.json`` and ``.md``.
"""

from __future__ import annotations

from benchmarks.harness.paths import CALIB, SMOLLM2
from benchmarks.harness.runner import Study


def options(p) -> None:
    p.add_argument("--ratios", type=float, nargs="+", help="cache ratios against K/V")
    p.add_argument("--rope-dims", type=int, nargs="+", help="RoPE key widths Dr")
    p.add_argument("--calib-tokens", type=int, help="calibration tokens")
    p.add_argument("--skip", type=int, help="the selection text's first token in the train sample")
    p.add_argument("--windows", type=int, help="1,024-token selection windows")


def rows(run):
    from benchmarks.lib.smollm2_windows import token_windows
    from kvsplice.convert.llama_mla import calibrate_layers, convert_llama
    from kvsplice.evaluation.protocol import evaluate
    from kvsplice.loading import load_model

    loaded = load_model(SMOLLM2)
    model, cfg = loaded.model, loaded.model.config
    n_kv, hd = cfg.num_key_value_heads, cfg.head_dim
    calib = token_windows(loaded, CALIB, run["calib_tokens"], 512)
    sel = token_windows(loaded, CALIB, run["windows"] * 1024, 1024, skip=run["skip"])
    stats = calibrate_layers(model, list(calib.split(4)))
    src = evaluate(model, None, sel, prompt_len=768, batch_size=2)["ppl"]
    run.notes.update(source_ppl=src, windows=int(sel.shape[0]), calibration_tokens=int(calib.numel()))
    for ratio in run["ratios"]:
        for dr in run["rope_dims"]:
            r = round(2 * n_kv * hd / ratio) - dr
            if r < 1 or dr > hd:
                continue
            mla = convert_llama(model, stats, d_latent=r, rope_dims=dr, layout="shared")
            res = evaluate(mla, None, sel, prompt_len=768, batch_size=2)
            row = {"ratio": ratio, "d_latent": r, "rope_dims": dr, "ppl": res["ppl"],
                   "ratio_measured": res["ratio_vs_fp16_full"], "delta_pct": 100 * (res["ppl"] / src - 1)}
            run.say(str(row))
            yield row


def summary(run, rows) -> dict:
    """The JSON's fields beside the rows: the RoPE width of the lowest perplexity at each ratio (``best_rope_dims``;
    the report's footer, ``best``, in the notes)."""
    best = {str(x): min((r for r in rows if r["ratio"] == x), key=lambda r: r["ppl"])["rope_dims"]
            for x in dict.fromkeys(r["ratio"] for r in rows)}
    out = {"model": str(SMOLLM2), "selection_text": str(CALIB), "skip_tokens": run["skip"], **run.notes,
           "best_rope_dims": best}
    run.notes["best"] = ", ".join(f"{k}x: {v}" for k, v in best.items())
    return out


STUDY = Study("convert_rope_split", __doc__, rows, options=options, summary=summary,
              bounds={"ratios": (1, 1024), "rope_dims": (1, 1024), "calib_tokens": (512, 1 << 24),
                      "skip": (0, 1 << 30), "windows": (1, 10_000)})
main = STUDY.main

if __name__ == "__main__":
    raise SystemExit(main())
