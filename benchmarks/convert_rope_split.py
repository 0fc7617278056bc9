"""Choose the shared layout's latent / RoPE split of SmolLM2-135M on the *fine-tune* text (never the evaluation text).

    python benchmarks/convert_rope_split.py [--ratios 2 4 8] [--rope-dims 16 32 64] [--out results/convert_rope_split]

At each cache ratio the cache ``R + Dr`` is fixed (``R = 2·Hkv·D / ratio − Dr``); the RoPE key's width ``Dr`` trades
against the latent. Calibration: the first ``--calib-tokens`` of the TinyStories train sample (as
``benchmarks/convert_smollm2.py``); selection text: ``--windows`` × 1,024 tokens of the same train sample starting at
token ``--skip`` (300k: past the calibration and every fine-tune's tokens, so nothing scored here is trained on),
scored as protocol P (768-token prompt in the cache, 256 scored). Writes ``OUT.json`` and ``OUT.md``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path


if __name__ == "__main__" and not __package__:  # run as a file: the repository first on sys.path (benchmarks/_root.py)
    import _root  # noqa: F401

from benchmarks.harness.header import command as command_line, revision  # noqa: E402
from benchmarks.harness.options import add_out, command, parser  # noqa: E402
from benchmarks.harness.paths import CALIB, RESULTS, SMOLLM2  # noqa: E402


@command
def main(argv=None) -> int:
    ap = parser(__file__, __doc__)
    ap.add_argument("--ratios", type=float, nargs="+", default=[2.0, 4.0, 8.0])
    ap.add_argument("--rope-dims", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--calib-tokens", type=int, default=8192)
    ap.add_argument("--skip", type=int, default=300_000)
    ap.add_argument("--windows", type=int, default=4)
    add_out(ap, RESULTS / "convert_rope_split", "the results' stem: STEM.json and STEM.md")
    args = ap.parse_args(argv)
    from benchmarks.convert_smollm2 import windows
    from kvsplice.convert.llama_mla import calibrate_layers, convert_llama
    from kvsplice.evaluation.protocol import evaluate
    from kvsplice.loading import iter_texts, load_model
    from kvsplice.io.write import write_json
    from models.checkpoint import atomic_write

    t0 = time.perf_counter()
    loaded = load_model(SMOLLM2)
    model, tok = loaded.model, loaded.tokenizer
    cfg = model.config
    n_kv, hd = cfg.num_key_value_heads, cfg.head_dim
    calib = windows(tok, iter_texts(str(CALIB)), args.calib_tokens, 512)
    sel = windows(tok, iter_texts(str(CALIB)), args.windows * 1024, 1024, skip=args.skip)
    stats = calibrate_layers(model, list(calib.split(4)))
    src = evaluate(model, None, sel, prompt_len=768, batch_size=2)["ppl"]
    rows = []
    for ratio in args.ratios:
        for dr in args.rope_dims:
            r = round(2 * n_kv * hd / ratio) - dr
            if r < 1 or dr > hd:
                continue
            mla = convert_llama(model, stats, d_latent=r, rope_dims=dr, layout="shared")
            res = evaluate(mla, None, sel, prompt_len=768, batch_size=2)
            rows.append({"ratio": ratio, "d_latent": r, "rope_dims": dr, "ppl": res["ppl"],
                         "ratio_measured": res["ratio_vs_fp16_full"], "delta_pct": 100 * (res["ppl"] / src - 1)})
            print(rows[-1], flush=True)
    best = {str(ratio): min((x for x in rows if x["ratio"] == ratio), key=lambda x: x["ppl"])["rope_dims"]
            for ratio in args.ratios if any(x["ratio"] == ratio for x in rows)}
    cmd = command_line(__file__, argv)
    report = {"command": cmd, "revision": revision(), "model": str(SMOLLM2), "selection_text": str(CALIB),
              "skip_tokens": args.skip,
              "windows": int(sel.shape[0]), "calibration_tokens": int(calib.numel()), "source_ppl": src,
              "best_rope_dims": best, "rows": rows, "seconds": time.perf_counter() - t0}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(report, out.with_suffix(".json"))
    lines = [f"`{cmd}` — selection on {sel.shape[0]} × 1,024 tokens of the fine-tune text from token {args.skip} "
             f"(protocol P scoring; source ppl {src:.3f})", "",
             "| × smaller | latent R | RoPE dims | ppl (fine-tune text) | Δ |", "|---|---|---|---|---|"]
    for x in rows:
        lines.append(f"| {x['ratio_measured']:.2f} | {x['d_latent']} | {x['rope_dims']} | {x['ppl']:.3f} | "
                     f"{x['delta_pct']:+.1f} % |")
    lines += ["", "best RoPE dims per ratio: " + ", ".join(f"{k}x: {v}" for k, v in best.items())]
    atomic_write(out.with_suffix(".md"), lambda tmp: tmp.write_text("\n".join(lines) + "\n"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
