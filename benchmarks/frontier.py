"""The loss-vs-cache-bytes frontier: MHA, GQA, MQA, MLA at three latent sizes and KVSplice 50/70/90, and the
DeepSeek-V3 layout's MHA / MLA / KVSplice 50/90 (``ds_*``), trained at equal tokens on real TinyStories text, several
seeds each.

    python -m benchmarks.frontier                    # the study: every variant x seeds 1 2 3 (--resume continues)
    python -m benchmarks.frontier --study ablation   # MLA options on a tuning split (seed 0), run before the study
    python -m benchmarks.frontier --plot-only --resume   # redraw the plot / table from the JSON

Every run is ``python -m training.fit --config small_<variant> --seed_everything S --trainer.max_steps N`` (fp32,
CPU, one torch thread per run, ``--jobs`` runs side by side). After a run, its last checkpoint is loaded and a
prefill of one validation block through the model's real decode cache measures the cache bytes per token (fp16
and fp32 caches: ``cache.nbytes() / tokens``). Each finished run is added to the results JSON at once; ``--resume``
skips the runs already in it (``--runs-dir`` keeps the checkpoints).

Data (``configs/small_*.yaml``): the local TinyStories folder, whose ``*val*`` file (the start of the real HF
validation split) is the validation text and whose other files are the training text, with a 4096-entry BPE trained
on them. ``--study ablation`` never looks at that validation text: it trains on the same training files (through a
folder of symlinks under ``--runs-dir``, no copies) and validates on a held-out 5 % tail of them, so the option it
picks for MLA is not tuned on the data the frontier reports.

On a GPU (``--device cuda``): the same runs with ``--trainer.accelerator gpu``, ``--batch`` sequences per step and
``--jobs`` runs side by side on the one GPU; results go to ``results/frontier_gpu.json`` (``.md`` / ``.png``). The
GPU study of the README: ``python -m benchmarks.frontier --device cuda --batch 64 --steps 2000 --jobs 9`` (32.8M tokens
per run). A finished run is reused only for the same variant, seed, steps, batch and device (its resume key); a
killed study ends its ``training.fit`` children with it.

Outputs: ``results/frontier.json`` (a row per run: variant, config, seed, steps, tokens, val_loss, measured cache
bytes per token fp16 / fp32, cache_dim, params, wall time, tokens/s, the training-loss curve, the train/validation
gap), ``.png`` (validation loss vs cache bytes, mean ± std per variant, Pareto front marked) and ``.md``.
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

from benchmarks.harness.options import UsageError
from benchmarks.harness.paths import RESULTS
from benchmarks.harness.runner import Study
from benchmarks.harness.studies import variants
from benchmarks.lib.frontier_runs import comparisons, figure, init_kv_rms, markdown, plot, run_one, table  # noqa: F401
from benchmarks.lib.study import DATA, DATA_CACHE, REPO, data_args, resume_key, run_jobs, run_key

FRONTIER = variants("frontier", "frontier")  # variant -> (config, overrides): benchmarks/studies/frontier.yaml
ABLATION = variants("frontier", "ablation")  # MLA options, on the tuning split


# ---------------------------------------------------------------------------------------------------- one run
# ---------------------------------------------------------------------------------------------------- the study
def options(p) -> None:
    p.add_argument("--study", choices=("frontier", "ablation"), default="frontier")
    p.add_argument("--seeds", type=int, nargs="+", help="default: 1 2 3 (frontier), 0 (ablation)")
    p.add_argument("--variants", nargs="+", help="a subset of the study's variants")
    p.add_argument("--steps", type=int, help="optimizer steps per run")
    p.add_argument("--batch", type=int, help="sequences of 256 tokens per optimizer step")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: every run on the one GPU")
    p.add_argument("--jobs", type=int, help="runs side by side")
    p.add_argument("--cache-tokens", dest="cache_tokens", type=int, help="tokens prefilled to measure the cache")
    p.add_argument("--data", type=Path, default=DATA, help="the TinyStories folder (a *val* file + training files)")
    p.add_argument("--data-cache", type=Path, default=DATA_CACHE, help="where the runs cache token shards and the "
                   "tokenizer (default: the repository's .cache/data)")
    p.add_argument("--runs-dir", type=Path, default=None, help="default checkpoints/frontier (frontier_gpu on cuda)")
    p.add_argument("--plot-only", action="store_true", help="the report from the resumed JSON; train nothing")


def out_stem(args) -> Path:  # results/frontier[_ablation][_gpu]
    study = "" if args.study == "frontier" else "_ablation"
    return RESULTS / f"frontier{study}{'_gpu' if args.device == 'cuda' else ''}"


def rows(run):
    a = run.args
    a.steps, a.batch, a.jobs, a.cache_tokens = run["steps"], run["batch"], run["jobs"], run["cache_tokens"]
    study = FRONTIER if a.study == "frontier" else ABLATION
    seeds = a.seeds or ([1, 2, 3] if a.study == "frontier" else [0])
    variants = a.variants or list(study)
    if set(variants) - set(study):
        raise UsageError(f"unknown variants {sorted(set(variants) - set(study))}; choose from {list(study)}")
    if not a.data.is_dir() and not a.plot_only:
        raise UsageError(f"{a.data} not found: the study reads the local TinyStories text (default ../shared/data/"
                         "tinystories; --data to name another folder)")
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    if a.device == "cuda" and not a.plot_only:
        import torch

        if not torch.cuda.is_available():
            raise UsageError("--device cuda: no CUDA device here")
        machine += f", {torch.cuda.get_device_name()}"
    run.notes["meta"] = {"study": a.study, "machine": machine, "device": a.device, "dtype_train": "fp32",
                         "python": platform.python_version(), "batch": a.batch, "threads_per_run": a.threads,
                         "jobs": a.jobs}
    if a.study == "ablation":
        run.notes["meta"]["init_kv_rms"] = init_kv_rms()
        run.say(f"q/k/v RMS at init (layer 0, unit-RMS inputs): {json.dumps(run.notes['meta']['init_kv_rms'])}")
    yield from run.done  # the resumed rows (--resume)
    done = {resume_key(r) for r in run.done}
    todo = [] if a.plot_only else [(v, s) for s in seeds for v in variants if run_key(v, s, a) not in done]
    if not todo:
        return
    runs_dir = (a.runs_dir or REPO / "checkpoints" / f"frontier{'_gpu' if a.device == 'cuda' else ''}") / a.study
    a.data_args = data_args(a.data, runs_dir, tuning=a.study == "ablation", cache=a.data_cache)
    from tqdm import tqdm

    bar = tqdm(total=len(todo), desc=f"{a.study} runs", unit="run")

    def job(vs):
        row = run_one(vs[0], *study[vs[0]], vs[1], a, runs_dir)
        run.emit(row)
        bar.update(1)
        rate = "-" if row["tokens_per_s"] is None else f"{row['tokens_per_s']:.0f}"
        bar.write(f"{vs[0]} seed {vs[1]}: val_loss {row['val_loss']:.4f}, {row['cache_bytes_per_token']:.0f} B/token,"
                  f" {rate} tok/s")

    try:
        failed = run_jobs(todo, job, a.jobs, bar.write)
    finally:
        bar.close()
    if failed is None:  # Ctrl-C or SIGTERM: the children ended, the finished runs kept (--resume continues)
        raise KeyboardInterrupt
    if failed:
        run.fail(f"{len(failed)} runs failed: {failed}; --resume retries them")


STUDY = Study("frontier", __doc__, rows, options=options, markdown=markdown, figure=figure, out=out_stem,
              summary=lambda run, rows: run.notes,
              sizes={"default": {"steps": 500, "batch": 8, "jobs": 2, "cache_tokens": 256}},
              bounds={"steps": (1, 10 ** 7), "batch": (1, 65536), "jobs": (1, 256), "cache_tokens": (1, 1 << 16)})
main = STUDY.main

if __name__ == "__main__":
    raise SystemExit(main())
