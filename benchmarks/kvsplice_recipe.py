"""KVSplice at 512 B/token: what can make a KVSplice-50 of the 128-dim MLA latent match MLA-64 (same cached bytes)?

    python -m benchmarks.kvsplice_recipe --study ablation --device cuda --batch 64 --steps 2000 --jobs 8
    python -m benchmarks.kvsplice_recipe --study recipe --device cuda --batch 64 --steps 2000 --jobs 3

The small_* shapes, the frontier study's options, runs and report (``benchmarks/frontier.py``).

* ``--study ablation`` — seed 0 on the **tuning split** (never the frontier's validation text): MLA-64 and
  KVSplice-50 from scratch, then KVSplice-50 with an orthogonal splice, a 10x splice learning rate, the latent norm
  after the compress, and the two-stage ``insert``: MLA-128 for half the steps, KVSplice-50 inserted with PCA
  (``kvsplice to-mla --kvsplice-ratio 0.5``, 65,536 calibration tokens), fine-tuned the other half (5 % warmup).
* ``--study recipe`` — ``insert`` on the real validation text, seeds 1 2 3, beside the frontier's MLA-64 and
  KVSplice-50 (``results/frontier_gpu.json``) at equal total tokens.

Writes ``results/kvsplice_recipe_<study>[_gpu].{json,md}``; ``--resume`` continues a stopped study.
"""
from __future__ import annotations

import threading
from collections import defaultdict
from pathlib import Path

from benchmarks.harness.paths import RESULTS
from benchmarks.harness.runner import Study
from benchmarks.harness.studies import load as load_study, variants
from benchmarks.lib.seed_report import report_rows
from benchmarks.lib.study import (BOUNDS, TRAIN_FILES, gpu, last_val, options as study_options, run_args, run_one,
                                  to_mla, train, train_rows)

SECTIONS = {s: variants("kvsplice_recipe", s) for s in ("ablation", "recipe")}  # variant -> (config, overrides)
INSERT_RATIO: dict[str, float] = load_study("kvsplice_recipe")["insert_ratio"]  # the two-stage recipes' ratios
_STAGE1_LOCKS: defaultdict[Path, threading.Lock] = defaultdict(threading.Lock)  # one per shared MLA-128 stage


def insert_recipe(variant: str, seed: int, args, runs_dir: Path) -> float:
    """MLA-128 for steps/2 (shared by every ratio of a seed), KVSplice inserted (PCA) at ``INSERT_RATIO[variant]``,
    fine-tuned steps/2 into ``runs_dir/<variant>-s<seed>``; the wall seconds."""
    half = args.steps // 2
    stage1 = runs_dir / f"insert-s{seed}-mla128"
    stage_args = run_args(args, half)
    with _STAGE1_LOCKS[stage1]:
        if not (stage1 / "last.ckpt").is_file():
            train("small_mla", runs_dir, stage1.name, seed, half, args.threads, stage_args)
    ratio = INSERT_RATIO[variant]
    inserted = runs_dir / f"{variant}-s{seed}-ks{round(100 * (1 - ratio))}.ckpt"  # ks50 / ks90
    to_mla(stage1 / "last.ckpt", inserted, ["--kvsplice-ratio", str(ratio), "--calib", str(args.data / TRAIN_FILES[0]),
                                            "--calib-tokens", "65536"], args.threads)
    return train(SECTIONS[args.study][variant][0], runs_dir, f"{variant}-s{seed}", seed, half, args.threads,
                 ["--model.init_from", str(inserted), "--model.warmup_steps", str(max(1, half // 20)), *stage_args])


def run_variant(variant: str, seed: int, args, runs_dir: Path) -> dict:
    """A variant's row; a two-stage recipe's steps and tokens are both stages', its MLA-128 stage's loss beside."""
    config, extra = SECTIONS[args.study][variant]
    if variant not in INSERT_RATIO:
        return {**run_one(variant, seed, args, runs_dir, config, extra), "stage1_val_loss": None}
    row = run_one(variant, seed, args, runs_dir, config, extra, lambda: insert_recipe(variant, seed, args, runs_dir))
    return {**row, "steps": args.steps, "tokens": args.steps * args.batch * 256,
            "stage1_val_loss": last_val(runs_dir / f"insert-s{seed}-mla128" / "metrics.csv")[1]}


STUDY = Study("kvsplice_recipe", __doc__,
              lambda run: train_rows(run, SECTIONS, {"ablation": [0], "recipe": [1, 2, 3]}, run_variant),
              options=lambda p: study_options(p, ("ablation", "recipe"), "0 (ablation), 1 2 3 (recipe)"),
              out=lambda a: RESULTS / f"kvsplice_recipe_{a.study}{gpu(a)}",
              summary=lambda run, rows: {**run.notes, **report_rows(run, rows, "mla_64")},
              bounds={**BOUNDS, "steps": (2, 10 ** 7)})  # two stages of steps / 2
main = STUDY.main

if __name__ == "__main__":
    raise SystemExit(main())
