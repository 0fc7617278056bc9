"""KVSplice at 512 B/token: what can make a KVSplice-50 of the 128-dim MLA latent match MLA-64 (same cached bytes)?

    python -m benchmarks.kvsplice_recipe --study ablation --device cuda --batch 64 --steps 2000 --jobs 8
    python -m benchmarks.kvsplice_recipe --study recipe --device cuda --batch 64 --steps 2000 --jobs 3

Every variant trains the small_* shapes for the same ``--steps`` x ``--batch`` x 256 tokens as the frontier study
(``benchmarks/frontier.py``; :mod:`benchmarks.lib.study` runs each ``training.fit``).

* ``--study ablation`` — seed 0 on a **tuning split** (the training files only, a 5 % tail of them held out; never the
  validation text the frontier reports): MLA-64 and KVSplice-50 from scratch as references, then KVSplice-50 with
  the splice kept orthogonal (``kvsplice_orthogonal``), with a 10x learning rate for the splice
  (``splice_lr_mult``), with the latent norm after the compress instead of before it (``kvsplice_norm``), and the
  two-stage recipe ``insert``: MLA-128 for half the steps, KVSplice-50 inserted with PCA initialisation
  (``python -m kvsplice.to_mla --kvsplice-ratio 0.5``, 65,536 calibration tokens of training text), fine-tuned for
  the other half (fresh AdamW, 5 % warmup).
* ``--study recipe`` — the two-stage ``insert`` recipe on the real validation text, seeds 1 2 3, next to the
  frontier's MLA-64 and KVSplice-50 rows (``results/frontier_gpu.json``) at equal total tokens.

Writes ``results/kvsplice_recipe_<study>[_gpu].json`` (+ ``.md``). Resumable like the frontier study.
"""

from __future__ import annotations

import json
import sys
import threading
from collections import defaultdict
from pathlib import Path


from benchmarks.harness.header import command as command_line, revision
from benchmarks.harness.options import add_out, add_threads, command, parser
from benchmarks.harness.paths import RESULTS
from benchmarks.harness.studies import load as load_study, variants
from benchmarks.lib.study import (DATA, DATA_CACHE, REPO, TRAIN_FILES, cache_bytes, comparison_table, compare,
                                  data_args, final_train_loss, last_val, resume_key, run_args, run_jobs, run_key,
                                  run_module, save_study, summarise, train, train_curve)

ABLATION = variants("kvsplice_recipe", "ablation")  # variant -> (config, overrides): studies/kvsplice_recipe.yaml
RECIPE = variants("kvsplice_recipe", "recipe")
VARIANTS = {**ABLATION, **RECIPE}
INSERT_RATIO: dict[str, float] = load_study("kvsplice_recipe")["insert_ratio"]
"""The two-stage recipes: the KVSplice ratio inserted (``insert90``: the same recipe at 90 %, 104 B/token; run on
the validation text as chosen for 50 % on the tuning split, nothing re-tuned)."""


def insert_recipe(variant: str, seed: int, args, runs_dir: Path) -> Path:
    """MLA-128 for steps/2, KVSplice inserted (PCA) at ``INSERT_RATIO[variant]``, fine-tuned steps/2; returns the
    final run folder. The MLA-128 stage is shared by every ratio of a seed."""
    half = args.steps // 2
    stage1 = runs_dir / f"insert-s{seed}-mla128"
    stage_args = run_args(args, half)
    with _STAGE1_LOCKS[stage1]:
        if not (stage1 / "last.ckpt").is_file():
            train("small_mla", runs_dir, stage1.name, seed, half, args.threads, stage_args)
    ratio = INSERT_RATIO[variant]
    config = VARIANTS[variant][0]
    inserted = runs_dir / f"{variant}-s{seed}-ks{round(100 * (1 - ratio))}.ckpt"  # ks50 / ks90
    if not inserted.is_file():
        calib = args.data / TRAIN_FILES[0]
        run_module("kvsplice.to_mla", ["--model", str(stage1 / "last.ckpt"), "--kvsplice-ratio", str(ratio),
                                       "--calib", str(calib), "--calib-tokens", "65536", "--out", str(inserted),
                                       "--force", "--threads", str(args.threads)], args.threads)
    name = f"{variant}-s{seed}"
    train(config, runs_dir, name, seed, half, args.threads,
          ["--model.init_from", str(inserted), "--model.warmup_steps", str(max(1, half // 20)), *stage_args])
    return runs_dir / name


_STAGE1_LOCKS: defaultdict[Path, threading.Lock] = defaultdict(threading.Lock)
"""One lock per shared MLA-128 stage: two ratios of one seed train it once (``defaultdict`` inserts atomically under
the GIL)."""


def run_variant(variant: str, seed: int, args, runs_dir: Path) -> dict:
    config, extra = VARIANTS[variant]
    if variant in INSERT_RATIO:
        run = insert_recipe(variant, seed, args, runs_dir)
        stage1_val = last_val(runs_dir / f"insert-s{seed}-mla128" / "metrics.csv")[1]
    else:
        run = runs_dir / f"{variant}-s{seed}"
        train(config, runs_dir, run.name, seed, args.steps, args.threads, [*extra, *run_args(args)])
        stage1_val = None
    step, val_loss, tokens, _ = last_val(run / "metrics.csv")
    curve = train_curve(run / "metrics.csv")
    final = final_train_loss(curve)
    return {"variant": variant, "config": config, "overrides": extra, "seed": seed, "steps": args.steps,
            "batch": args.batch, "device": args.device, "tokens": args.steps * args.batch * 256,
            "val_loss": val_loss, "stage1_val_loss": stage1_val, **cache_bytes(run / "last.ckpt", 256),
            "train_loss_final": final, "train_val_gap": None if final is None else val_loss - final,
            "train_loss_curve": curve}


@command
def main(argv: list[str] | None = None) -> int:
    p = parser(__file__, __doc__, raw=True)
    p.add_argument("--study", choices=("ablation", "recipe"), default="ablation")
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="default: 0 (ablation), 1 2 3 (recipe)")
    p.add_argument("--variants", nargs="+", default=None)
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--jobs", type=int, default=2)
    add_threads(p)
    p.add_argument("--data", type=Path, default=DATA)
    p.add_argument("--data-cache", type=Path, default=DATA_CACHE, help="token shards and tokenizer cache")
    p.add_argument("--runs-dir", type=Path, default=None)
    add_out(p, None, "the results JSON (default results/kvsplice_recipe_<study>[_gpu].json)")
    p.add_argument("--report-only", action="store_true", help="rewrite the table from the JSON; train nothing")
    args = p.parse_args(argv)
    if args.steps < 2 or args.batch < 1 or args.jobs < 1:
        p.error("--steps must be >= 2, --batch and --jobs >= 1")
    if not args.data.is_dir() and not args.report_only:
        p.error(f"{args.data} not found (--data: the TinyStories folder)")
    study = ABLATION if args.study == "ablation" else RECIPE
    variants = args.variants or list(study)
    unknown = sorted(set(variants) - set(study))
    if unknown:
        p.error(f"unknown variants {unknown}; choose from {list(study)}")
    seeds = args.seeds or ([0] if args.study == "ablation" else [1, 2, 3])
    gpu = "_gpu" if args.device == "cuda" else ""
    out = args.out or RESULTS / f"kvsplice_recipe_{args.study}{gpu}.json"
    runs_dir = (args.runs_dir or REPO / "checkpoints" / f"kvsplice_recipe{gpu}") / args.study
    runs_dir.mkdir(parents=True, exist_ok=True)
    args.data_args = [] if args.report_only else data_args(args.data, runs_dir, tuning=args.study == "ablation",
                                                                   cache=args.data_cache)
    stored = json.loads(out.read_text()) if out.is_file() else {}
    rows = stored.get("rows", [])
    done = {resume_key(r) for r in rows}
    todo = [] if args.report_only else [(v, s) for s in seeds for v in variants if run_key(v, s, args) not in done]
    meta = stored.get("meta") if args.report_only and stored.get("meta") else {
        "study": args.study, "device": args.device, "batch": args.batch, "steps": args.steps,
        "command": command_line(__file__, argv), "revision": revision()}
    lock = threading.Lock()

    def job(vs):
        row = run_variant(vs[0], vs[1], args, runs_dir)
        with lock:
            rows.append(row)
            save_study(out, meta, rows)
            print(f"{vs[0]} seed {vs[1]}: val_loss {row['val_loss']:.4f}", flush=True)

    failed = run_jobs(todo, job, args.jobs, lambda msg: print(msg, file=sys.stderr))
    if failed is None:
        return 130
    if not rows:
        return 1
    summary = summarise(rows)
    by = {s["variant"]: s for s in summary}
    lines = ["| variant | seeds | val loss (mean ± std) | cache B/token (fp16) | val − train loss |", "|---|---|---|---|---|"]
    for s in summary:
        gap = "" if s.get("gap") is None else f"{s['gap']:.3f}"
        lines.append(f"| {s['variant']} | {s['n']} | {s['val_loss']:.4f} ± {s['std']:.4f} | {s['bytes']:.0f} | {gap} |")
    cmps = [compare(by[v], by[ref]) for ref in ("mla_64", "ks50") if ref in by for v in by if v != ref]
    md = "\n".join(lines) + ("\n\n" + comparison_table(cmps) if cmps else "")
    print(md)
    out.with_suffix(".md").write_text(f"{meta['command']}\n\n{md}\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
