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
  (``kvsplice to-mla --kvsplice-ratio 0.5``, 65,536 calibration tokens of training text), fine-tuned for
  the other half (fresh AdamW, 5 % warmup).
* ``--study recipe`` — the two-stage ``insert`` recipe on the real validation text, seeds 1 2 3, next to the
  frontier's MLA-64 and KVSplice-50 rows (``results/frontier_gpu.json``) at equal total tokens.

Writes ``results/kvsplice_recipe_<study>[_gpu].{json,md}``; ``--resume`` continues a stopped study (a run already in
its JSON, with the same resume key, is not trained again).
"""

from __future__ import annotations

import sys
import threading
from collections import defaultdict
from pathlib import Path

from benchmarks.harness.options import UsageError
from benchmarks.harness.paths import RESULTS
from benchmarks.harness.runner import Study
from benchmarks.harness.studies import load as load_study, variants
from benchmarks.lib.study import (DATA, DATA_CACHE, REPO, TRAIN_FILES, cache_bytes, data_args, final_train_loss,
                                  last_val, resume_key, run_args, run_jobs, run_key, run_module, seed_table, train,
                                  train_curve)

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
        run_module("kvsplice.cli.main", ["to-mla", "--model", str(stage1 / "last.ckpt"), "--kvsplice-ratio", str(ratio),
                                         "--calib", str(calib), "--calib-tokens", "65536", "--out", str(inserted),
                                         "--force", "--threads", str(args.threads)], args.threads)
    name = f"{variant}-s{seed}"
    train(config, runs_dir, name, seed, half, args.threads,
          ["--model.init_from", str(inserted), "--model.warmup_steps", str(max(1, half // 20)), *stage_args])
    return runs_dir / name


_STAGE1_LOCKS: defaultdict[Path, threading.Lock] = defaultdict(threading.Lock)  # one per shared MLA-128 stage


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


def options(p) -> None:
    p.add_argument("--study", choices=("ablation", "recipe"), default="ablation")
    p.add_argument("--seeds", type=int, nargs="+", help="default: 0 (ablation), 1 2 3 (recipe)")
    p.add_argument("--variants", nargs="+")
    p.add_argument("--steps", type=int, help="optimizer steps per run (>= 2)")
    p.add_argument("--batch", type=int, help="sequences per step")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--jobs", type=int, help="runs side by side")
    p.add_argument("--data", type=Path, default=DATA)
    p.add_argument("--data-cache", type=Path, default=DATA_CACHE, help="token shards and tokenizer cache")
    p.add_argument("--runs-dir", type=Path, default=None)
    p.add_argument("--report-only", action="store_true", help="the report from the resumed JSON; train nothing")


def out_stem(args) -> Path:
    return RESULTS / f"kvsplice_recipe_{args.study}{'_gpu' if args.device == 'cuda' else ''}"


def rows(run):
    a = run.args
    a.steps, a.batch = run["steps"], run["batch"]  # (run_args / run_key read them from the options)
    if not a.data.is_dir() and not a.report_only:
        raise UsageError(f"{a.data} not found (--data: the TinyStories folder)")
    study = ABLATION if a.study == "ablation" else RECIPE
    variants = a.variants or list(study)
    if set(variants) - set(study):
        raise UsageError(f"unknown variants {sorted(set(variants) - set(study))}; choose from {list(study)}")
    seeds = a.seeds or ([0] if a.study == "ablation" else [1, 2, 3])
    gpu = "_gpu" if a.device == "cuda" else ""
    runs_dir = (a.runs_dir or REPO / "checkpoints" / f"kvsplice_recipe{gpu}") / a.study
    yield from run.done  # the resumed rows (--resume)
    if a.report_only:
        return
    runs_dir.mkdir(parents=True, exist_ok=True)
    a.data_args = data_args(a.data, runs_dir, tuning=a.study == "ablation", cache=a.data_cache)
    done = {resume_key(r) for r in run.done}
    todo = [(v, s) for s in seeds for v in variants if run_key(v, s, a) not in done]

    def job(vs):
        row = run_variant(vs[0], vs[1], a, runs_dir)
        run.emit(row)
        run.say(f"{vs[0]} seed {vs[1]}: val_loss {row['val_loss']:.4f}")

    failed = run_jobs(todo, job, run["jobs"], lambda msg: print(msg, file=sys.stderr))
    if failed is None:  # Ctrl-C or SIGTERM: the children are ended, the rows so far kept
        raise KeyboardInterrupt
    if failed:
        run.fail(f"{len(failed)} run(s) failed: {failed}")


STUDY = Study("kvsplice_recipe", __doc__, rows, options=options, out=out_stem,
              markdown=lambda run, rows: seed_table(rows, ("mla_64", "ks50")),
              summary=lambda run, rows: {"meta": {"study": run.args.study, "device": run.args.device,
                                                  "batch": run["batch"], "steps": run["steps"]}},
              sizes={"default": {"steps": 500, "batch": 8, "jobs": 2}},
              bounds={"steps": (2, 10 ** 7), "batch": (1, 65536), "jobs": (1, 256)})
main = STUDY.main

if __name__ == "__main__":
    raise SystemExit(main())
