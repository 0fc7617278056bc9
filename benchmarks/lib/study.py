"""A training study (``frontier.py``, ``kvsplice_recipe.py``, ``convert_mla.py``): ``training.fit`` runs as subprocesses
side by side (ended with the study), each finished run read back into a row (validation loss, tokens, the decode
cache's measured bytes per token, the training curve); a run already in the resumed JSON is not trained again."""

from __future__ import annotations

import csv
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterator, Optional

from benchmarks.harness.options import UsageError, device_dtype
from benchmarks.harness.paths import ROOT as REPO, TINYSTORIES as DATA

__all__ = ["BOUNDS", "DATA", "DATA_CACHE", "REPO", "RUN_KEY", "TRAIN_FILES", "cache_bytes", "data_args", "gpu",
           "last_val", "options", "resume_key", "run_args", "run_jobs", "run_key", "run_module", "run_one", "to_mla",
           "train", "train_curve", "train_rows", "trained"]

DATA_CACHE = REPO / ".cache" / "data"  # the runs' token shards and tokenizers
TRAIN_FILES = ("gusjengis_toy-RNN__tinystories_sample.txt", "maxme1_tiny-stories__tiny-stories.json",
               "mines-opt-ml_decoding-gpt__tinystories_10k.txt")  # DATA's other file (*val*) is the validation text
RUN_KEY = "frontier_key.json"  # in a finished run's folder: the resume key it was trained with
BOUNDS = {"steps": (1, 10 ** 7), "batch": (1, 65536), "jobs": (1, 256), "cache_tokens": (1, 1 << 16)}


def last_val(metrics: Path) -> tuple[int, float, float | None, float | None]:
    """(step, val_loss, tokens, train_time_s) of the last validation in a run's metrics.csv (``step`` from 0); the
    last *logged* step's tokens and seconds (None: a run shorter than the logging interval; :func:`trained`: totals)."""
    rows = list(csv.DictReader(metrics.open()))
    vals = [r for r in rows if r.get("val_loss")]
    if not vals:
        raise RuntimeError(f"{metrics}: no val_loss")
    train = [r for r in rows if r.get("tokens")]
    tokens, seconds = (float(train[-1]["tokens"]), float(train[-1]["train_time_s"])) if train else (None, None)
    return int(vals[-1]["step"]), float(vals[-1]["val_loss"]), tokens, seconds


def trained(ckpt: Path) -> tuple[int, float]:
    """(tokens, train_time_s) a run trained in all, as its final checkpoint's ``kvsplice_train_stats`` records them."""
    from models.checkpoint import load_checkpoint

    stats = load_checkpoint(ckpt).get("kvsplice_train_stats") or {}
    if "tokens" not in stats:
        raise RuntimeError(f"{ckpt}: no kvsplice_train_stats (not a finished training.fit run)")
    return int(stats["tokens"]), float(stats.get("train_time_s", 0.0))


def train_curve(metrics: Path) -> list[list[float]]:
    """``[[step, train_loss], ...]`` as logged (every ``log_every_n_steps``), steps counted from 1."""
    rows = csv.DictReader(metrics.open())
    return [[int(r["step"]) + 1, round(float(r["train_loss"]), 4)] for r in rows if r.get("train_loss")]


def cache_bytes(ckpt: Path, tokens: int) -> dict:
    """``tokens`` random ids through the checkpoint's model and its real decode cache, fp16 and fp32 (the package's
    :func:`training.evaluate.measure_cache_per_token`)."""
    import torch

    from models.checkpoint import load_gpt_checkpoint
    from training.evaluate import measure_cache_per_token

    model = load_gpt_checkpoint(ckpt)[0]
    out = {"cache_dim": model.cfg.cache_dim, "params": model.num_params(), "variant_name": model.cfg.variant}
    for dtype, key in ((torch.float16, "cache_bytes_per_token"), (torch.float32, "cache_bytes_per_token_fp32")):
        out[key] = measure_cache_per_token(model, model.cfg, tokens, dtype)["bytes_per_token"]
    return out


_CHILDREN: set[subprocess.Popen] = set()
_CHILDREN_LOCK = threading.Lock()


def _die_with_parent() -> None:  # runs in the child before exec (Linux): SIGTERM when the study process dies
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def run_module(module: str, argv: list[str], threads: int) -> float:
    """``python -m MODULE ARGV`` in the repository with ``threads`` threads; returns the wall seconds. The child ends
    with the study (SIGTERM when this process dies, even by SIGKILL; :func:`run_jobs` on an interrupt). A non-zero
    exit raises ``RuntimeError`` with the last lines of its output."""
    path = os.environ.get("PYTHONPATH")
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(REPO) + (os.pathsep + path if path else ""))
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", module, *argv], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
    with _CHILDREN_LOCK:
        _CHILDREN.add(proc)
    try:
        stdout, stderr = proc.communicate()
    finally:
        with _CHILDREN_LOCK:
            _CHILDREN.discard(proc)
    if proc.returncode != 0:
        tail = (stderr or stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"python -m {module} {' '.join(argv[:4])} ... failed (exit {proc.returncode}): "
                           f"{' | '.join(tail)}")
    return time.perf_counter() - t0


def to_mla(src: Path, out: Path, args: list[str], threads: int) -> Path:
    """``kvsplice to-mla --model SRC ARGS --out OUT`` unless ``out`` exists (made before: reused)."""
    if not out.is_file():
        run_module("kvsplice.cli.main", ["to-mla", "--model", str(src), *args, "--out", str(out), "--force",
                                         "--threads", str(threads)], threads)
    return out


def train(config: str, runs_dir: Path, name: str, seed: int, steps: int, threads: int, extra: list[str]) -> float:
    """One ``training.fit`` run of ``steps`` steps into ``runs_dir/name`` (replaced), validated at the end; wall s."""
    return run_module("training.fit", ["--config", config, "--runs_dir", str(runs_dir), "--run_name", name,
                                       "--overwrite", "--seed_everything", str(seed), "--torch_threads", str(threads),
                                       "--trainer.max_steps", str(steps), "--trainer.val_check_interval", str(steps),
                                       "--wandb.mode", "disabled", *extra], threads)


def resume_key(row: dict) -> tuple:
    """What makes two runs the same: variant, seed, steps, batch and device (older rows: batch 8, CPU)."""
    return row["variant"], row["seed"], row["steps"], row.get("batch", 8), row.get("device", "cpu")


def run_key(variant: str, seed: int, args) -> tuple:
    """The resume key (:func:`resume_key`) of a run this invocation would train."""
    return variant, seed, args.steps, args.batch, args.device


def run_args(args, steps: int | None = None) -> list[str]:
    """The ``training.fit`` options every run shares: data, batch, device (an epoch = ``steps``, or ``args.steps``)."""
    out = [*args.data_args, "--data.batch_size", str(args.batch), "--data.train_batches_per_epoch",
           str(steps or args.steps)]
    if args.device == "cuda":
        out += ["--trainer.accelerator", "gpu", "--data.num_workers", "0"]
    return out


def data_args(data: Path, runs_dir: Path, *, tuning: bool, cache: Path = DATA_CACHE) -> list[str]:
    """``training.fit``'s data options: ``data``, or with ``tuning`` a folder of links to its training files only (a
    5 % tail of them validates: the tuning split never sees the reported validation text); shards go to ``cache``."""
    cached = ["--data.cache_dir", str(cache)]
    if not tuning:
        return ["--data.path", str(data), *cached]
    tune = runs_dir / "tune_data"
    tune.mkdir(parents=True, exist_ok=True)
    for f in TRAIN_FILES:
        if not (tune / f).exists():
            (tune / f).symlink_to((data / f).resolve())
    return ["--data.path", str(tune), *cached]


def run_one(variant: str, seed: int, args, runs_dir: Path, config: str, extra: list[str],
            train_it: Optional[Callable[[], float]] = None) -> dict:
    """The row of run ``runs_dir/<variant>-s<seed>``, trained by ``train_it()`` (default: :func:`train` of ``config``
    with ``extra``) unless a finished run of the same resume key is there."""
    run = runs_dir / f"{variant}-s{seed}"
    key = list(run_key(variant, seed, args))
    try:  # trained before the results were written, with the same resume key
        if json.loads((run / RUN_KEY).read_text()) == key:
            return _row(variant, config, extra, seed, run, args, wall=None)
    except (OSError, RuntimeError, ValueError):
        pass
    wall = train_it() if train_it else train(config, runs_dir, run.name, seed, args.steps, args.threads,
                                             [*extra, *run_args(args)])
    (run / RUN_KEY).write_text(json.dumps(key) + "\n")
    return _row(variant, config, extra, seed, run, args, wall)


def _row(variant: str, config: str, extra: list[str], seed: int, run: Path, args, wall) -> dict:
    step, val_loss, _, _ = last_val(run / "metrics.csv")
    tokens, train_time = trained(run / "last.ckpt")
    curve = train_curve(run / "metrics.csv")
    tail = [loss for s, loss in curve if s > 0.95 * curve[-1][0]]  # the last 5 % of the steps: the final train loss
    train_final = statistics.fmean(tail) if tail else None
    return {"variant": variant, "config": config, "overrides": extra, "seed": seed, "steps": step + 1,
            "batch": args.batch, "device": args.device, "tokens": tokens, "val_loss": val_loss,
            **cache_bytes(run / "last.ckpt", args.cache_tokens),
            "wall_s": None if wall is None else round(wall, 1), "train_time_s": round(train_time, 1),
            "tokens_per_s": round(tokens / train_time, 1) if train_time else None,
            "train_loss_final": None if train_final is None else round(train_final, 4),
            "train_val_gap": None if train_final is None else round(val_loss - train_final, 4),
            "train_loss_curve": curve}


def run_jobs(todo: list, job: Callable, jobs: int, say: Callable[[str], None]) -> list | None:
    """``job(item)`` for every ``(variant, seed)``, ``jobs`` side by side (a failure reported, the others go on);
    Ctrl-C or SIGTERM cancels the rest and ends the children. Returns the failed items, None when interrupted."""
    def stop(signum, frame):  # SIGTERM: end the children, then leave like Ctrl-C
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, stop)
    failed: list = []
    futures: dict = {}
    try:
        with ThreadPoolExecutor(jobs) as pool:
            futures = {pool.submit(job, item): item for item in todo}
            for f, item in futures.items():
                try:
                    f.result()
                except Exception as e:  # noqa: BLE001 - one failed run must not stop the study
                    failed.append(item)
                    say(f"error: {item[0]} seed {item[1]}: {e}")
    except KeyboardInterrupt:  # cancel what has not started, terminate the running children
        for f in futures:
            f.cancel()
        with _CHILDREN_LOCK:
            procs = list(_CHILDREN)
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
        return None
    finally:
        signal.signal(signal.SIGTERM, previous)
    return failed


def gpu(args) -> str:
    """``_gpu`` in the names of a study's results and runs on a GPU."""
    return "_gpu" if args.device == "cuda" else ""


def options(p, studies: tuple[str, ...], seeds: str, report: str = "--report-only") -> None:
    """A training study's options: which study, seeds, variants, the runs' size, where data and runs go, ``report``."""
    p.add_argument("--study", choices=studies, default=studies[0])
    p.add_argument("--seeds", type=int, nargs="+", help=f"default: {seeds}")
    p.add_argument("--variants", nargs="+", help="a subset of the study's variants")
    p.add_argument("--steps", type=int, help="optimizer steps per run")
    p.add_argument("--batch", type=int, help="sequences of 256 tokens per optimizer step")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: every run on the one GPU")
    p.add_argument("--jobs", type=int, help="runs side by side")
    p.add_argument("--cache-tokens", dest="cache_tokens", type=int, help="tokens prefilled to measure the cache")
    p.add_argument("--data", type=Path, default=DATA, help="the TinyStories folder (a *val* file + training files)")
    p.add_argument("--data-cache", type=Path, default=DATA_CACHE, help="where the runs cache token shards and the "
                   "tokenizer (default: the repository's .cache/data)")
    p.add_argument("--runs-dir", type=Path, default=None, help="default checkpoints/STUDY[_gpu]/<--study>")
    p.add_argument(report, dest="report_only", action="store_true", help="the report from the resumed JSON; "
                   "train nothing")


def train_rows(run, sections: dict, seeds: dict, one: Callable[..., dict]) -> Iterator[dict]:
    """The resumed rows, then ``one(variant, seed, args, runs_dir)`` for each other run of ``sections[--study]``
    (seeds ``seeds[study]``), ``--jobs`` side by side. A failed run fails the study; ``--resume`` retries it."""
    a = run.args
    a.steps, a.batch, a.jobs, a.cache_tokens = run["steps"], run["batch"], run["jobs"], run["cache_tokens"]
    section, train_now = sections[a.study], not a.report_only
    variants = a.variants or list(section)
    if set(variants) - set(section):
        raise UsageError(f"unknown variants {sorted(set(variants) - set(section))}; choose from {list(section)}")
    if train_now and not a.data.is_dir():
        raise UsageError(f"{a.data} not found: the study reads the local TinyStories text (default ../shared/data/"
                         "tinystories; --data to name another folder)")
    if train_now:
        device_dtype(a)  # --device cuda where there is none: one line
    run.notes.setdefault("meta", {}).update(study=a.study, device=a.device, dtype_train="fp32", batch=a.batch,
                                            steps=a.steps, threads_per_run=a.threads, jobs=a.jobs)
    yield from run.done  # the resumed rows (--resume)
    done = {resume_key(r) for r in run.done}
    todo = [(v, s) for s in a.seeds or seeds[a.study] for v in variants if run_key(v, s, a) not in done]
    if not todo or not train_now:
        return
    runs_dir = (a.runs_dir or REPO / "checkpoints" / f"{run.study.name}{gpu(a)}") / a.study
    runs_dir.mkdir(parents=True, exist_ok=True)
    a.data_args = data_args(a.data, runs_dir, tuning=a.study == "ablation", cache=a.data_cache)
    from tqdm import tqdm

    bar = tqdm(total=len(todo), desc=f"{a.study} runs", unit="run")

    def job(vs):
        row = one(*vs, a, runs_dir)
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
