"""A training study: ``training.fit`` runs as subprocesses of a benchmark script (several side by side, ended with the
study on Ctrl-C, SIGTERM or its death), each finished run read back from its ``metrics.csv`` and last checkpoint (the
validation loss, the tokens trained, the decode cache's measured bytes per token), the rows kept in a resumable JSON
(a run already in it, with the same resume key, is not trained again), and the per-variant seed statistics (mean ± std,
Pareto front, ``a − b`` in standard errors).

Used by ``benchmarks/frontier.py`` (the loss-vs-cache-bytes frontier), ``benchmarks/kvsplice_recipe.py`` and
``benchmarks/convert_mla.py``; each script keeps only its own variants, options and report.
"""

from __future__ import annotations

import csv
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from benchmarks.harness.paths import TINYSTORIES

__all__ = ["DATA", "DATA_CACHE", "REPO", "RUN_KEY", "TRAIN_FILES", "cache_bytes", "compare", "comparison_table",
           "data_args", "end_children", "final_train_loss", "last_val", "late_drop", "resume_key", "run_args",
           "run_jobs", "run_key", "run_module", "seed_table", "summarise", "train", "train_curve",
           "trained"]

REPO = Path(__file__).resolve().parents[2]
"""The repository: the working directory of every ``python -m`` run (and first on its PYTHONPATH)."""
DATA = TINYSTORIES
"""The local TinyStories folder the ``small_*`` training configs read (:mod:`benchmarks.harness.paths`)."""
DATA_CACHE = REPO / ".cache" / "data"
"""Where the studies' runs cache token shards and tokenizers (shared by every run of a study)."""
TRAIN_FILES = ("gusjengis_toy-RNN__tinystories_sample.txt", "maxme1_tiny-stories__tiny-stories.json",
               "mines-opt-ml_decoding-gpt__tinystories_10k.txt")
"""The training files of :data:`DATA` (its other file, ``*val*``, is the validation text the studies report)."""
RUN_KEY = "frontier_key.json"
"""Written into a finished run's folder: the resume key it was trained with."""

# ---------------------------------------------------------------------------------------------------- one run's results
def last_val(metrics: Path) -> tuple[int, float, float | None, float | None]:
    """(step, val_loss, tokens, train_time_s) of the last validation in a run's metrics.csv (``step`` counts from 0:
    the validation after N optimizer steps is logged at step N - 1). ``tokens`` / ``train_time_s`` are those of the
    last *logged* step (None for a run shorter than the logging interval): :func:`trained` has the run's totals."""
    rows = list(csv.DictReader(metrics.open()))
    vals = [r for r in rows if r.get("val_loss")]
    if not vals:
        raise RuntimeError(f"{metrics}: no val_loss")
    train = [r for r in rows if r.get("tokens")]
    tokens, seconds = (float(train[-1]["tokens"]), float(train[-1]["train_time_s"])) if train else (None, None)
    return int(vals[-1]["step"]), float(vals[-1]["val_loss"]), tokens, seconds


def trained(ckpt: Path) -> tuple[int, float]:
    """(tokens, train_time_s) a run trained in all, as its final checkpoint records them (``kvsplice_train_stats``:
    every optimizer step's tokens, not only the logged steps')."""
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
    """Prefill ``tokens`` random ids through the checkpoint's model and its real decode cache (fp16 and fp32)."""
    import torch

    from models.checkpoint import load_gpt_checkpoint

    model = load_gpt_checkpoint(ckpt)[0]
    out = {"cache_dim": model.cfg.cache_dim, "params": model.num_params(), "variant_name": model.cfg.variant}
    ids = torch.randint(0, model.cfg.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    for dtype, key in ((torch.float16, "cache_bytes_per_token"), (torch.float32, "cache_bytes_per_token_fp32")):
        m = model.to(dtype)
        cache = m.new_cache(1, capacity=tokens)
        with torch.no_grad():
            m(ids, cache=cache)
        out[key] = cache.nbytes() / tokens
    return out



# ---------------------------------------------------------------------------------------------------- runs as subprocesses
_CHILDREN: set[subprocess.Popen] = set()
_CHILDREN_LOCK = threading.Lock()


def _die_with_parent() -> None:  # runs in the child before exec (Linux): SIGTERM when the study process dies
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def end_children() -> None:
    """Terminate every ``training.fit`` child still running (the study was interrupted)."""
    with _CHILDREN_LOCK:
        procs = list(_CHILDREN)
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


def run_module(module: str, argv: list[str], threads: int) -> float:
    """``python -m MODULE ARGV`` in the repository with ``threads`` torch threads; returns the wall seconds. The child
    ends with the study: on Linux it gets SIGTERM when this process dies (even by SIGKILL), and :func:`end_children`
    terminates it on an interrupt.

    Raises:
        RuntimeError: non-zero exit, with the last lines of its output.
    """
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


def train(config: str, runs_dir: Path, name: str, seed: int, steps: int, threads: int, extra: list[str]) -> float:
    """One ``training.fit`` run of ``steps`` optimizer steps into ``runs_dir/name`` (replacing an earlier one), one
    validation at the end, W&B off; returns the wall seconds."""
    return run_module("training.fit", ["--config", config, "--runs_dir", str(runs_dir), "--run_name", name,
                                       "--overwrite", "--seed_everything", str(seed), "--torch_threads", str(threads),
                                       "--trainer.max_steps", str(steps), "--trainer.val_check_interval", str(steps),
                                       "--wandb.mode", "disabled", *extra], threads)



# ---------------------------------------------------------------------------------------------------- the resumable study
def resume_key(row: dict) -> tuple:
    """What makes two runs the same: variant, seed, optimizer steps, batch and device (rows written before batch /
    device were recorded are the CPU study's: batch 8, CPU)."""
    return row["variant"], row["seed"], row["steps"], row.get("batch", 8), row.get("device", "cpu")


def run_key(variant: str, seed: int, args) -> tuple:
    """The resume key (:func:`resume_key`) of a run this invocation would train."""
    return variant, seed, args.steps, args.batch, args.device


def run_args(args, steps: int | None = None) -> list[str]:
    """The ``training.fit`` options every run of this study shares: data, batch, device (an epoch = the run's
    ``steps``, default ``args.steps``)."""
    out = [*args.data_args, "--data.batch_size", str(args.batch), "--data.train_batches_per_epoch",
           str(steps or args.steps)]
    if args.device == "cuda":
        out += ["--trainer.accelerator", "gpu", "--data.num_workers", "0"]
    return out


def data_args(data: Path, runs_dir: Path, *, tuning: bool, cache: Path = DATA_CACHE) -> list[str]:
    """``training.fit``'s data options for a study: ``data`` itself, or with ``tuning`` a folder of links to its
    training files only (the data module holds out a 5 % tail of them for validation: a tuning split that never
    sees the validation text the studies report); the token shards and tokenizer are cached in ``cache``."""
    cached = ["--data.cache_dir", str(cache)]
    if not tuning:
        return ["--data.path", str(data), *cached]
    tune = runs_dir / "tune_data"
    tune.mkdir(parents=True, exist_ok=True)
    for f in TRAIN_FILES:
        if not (tune / f).exists():
            (tune / f).symlink_to((data / f).resolve())
    return ["--data.path", str(tune), *cached]


def run_jobs(todo: list, job: Callable, jobs: int, say: Callable[[str], None]) -> list | None:
    """``job(item)`` for every ``(variant, seed)`` item, ``jobs`` side by side; a failed run is reported and the
    others go on. Ctrl-C or SIGTERM cancels what has not started and ends the running ``training.fit`` children.
    Returns the failed items, or None when interrupted."""
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
    except KeyboardInterrupt:
        for f in futures:
            f.cancel()
        end_children()
        return None
    finally:
        signal.signal(signal.SIGTERM, previous)
    return failed



# ---------------------------------------------------------------------------------------------------- seed statistics
def final_train_loss(curve: list[list[float]], frac: float = 0.05) -> float | None:
    """Mean logged training loss over the last ``frac`` of the steps (at least the last logged value)."""
    if not curve:
        return None
    n = curve[-1][0]
    tail = [l for s, l in curve if s > (1 - frac) * n] or [curve[-1][1]]
    return statistics.fmean(tail)


def late_drop(curve: list[list[float]]) -> float | None:
    """Mean training loss over the 4th fifth of the steps minus the mean over the last fifth: how much the loss
    still fell at the end of the schedule (0 = flat)."""
    if not curve:
        return None
    n = curve[-1][0]
    fourth = [l for s, l in curve if 0.6 * n < s <= 0.8 * n]
    last = [l for s, l in curve if s > 0.8 * n]
    return statistics.fmean(fourth) - statistics.fmean(last) if fourth and last else None


def summarise(rows: list[dict]) -> list[dict]:
    """Per variant: mean and std (sample, n-1) of val_loss over seeds, cache bytes, the late training-loss drop, and
    Pareto membership."""
    out = []
    for v in dict.fromkeys(r["variant"] for r in rows):
        rs = [r for r in rows if r["variant"] == v]
        losses = [r["val_loss"] for r in rs]
        drops = [d for d in (late_drop(r.get("train_loss_curve") or []) for r in rs) if d is not None]
        gaps = [r["train_val_gap"] for r in rs if r.get("train_val_gap") is not None]
        out.append({"variant": v, "n": len(rs), "val_loss": statistics.fmean(losses),
                    "std": statistics.stdev(losses) if len(losses) > 1 else 0.0,
                    "bytes": rs[0]["cache_bytes_per_token"], "tokens": rs[0]["tokens"],
                    "late_drop": statistics.fmean(drops) if drops else None,
                    "gap": statistics.fmean(gaps) if gaps else None})
    for s in out:  # on the front: no other variant has fewer-or-equal bytes and a lower mean loss
        s["pareto"] = not any(o is not s and o["bytes"] <= s["bytes"] and o["val_loss"] < s["val_loss"] for o in out)
    return sorted(out, key=lambda s: -s["bytes"])


def compare(a: dict, b: dict) -> dict:
    """Mean val-loss difference ``a − b`` of two summaries with its standard error ``sqrt(sa²/na + sb²/nb)``;
    ``verdict``: ``tie`` when ``|d| < 2 SE``, else which is better (lower loss)."""
    d = a["val_loss"] - b["val_loss"]
    se = (a["std"] ** 2 / a["n"] + b["std"] ** 2 / b["n"]) ** 0.5
    if se == 0:  # one seed each: no spread to judge by
        verdict = "no SE (one seed each)"
    else:
        verdict = "tie" if abs(d) < 2 * se else f"{a['variant'] if d < 0 else b['variant']} better"
    return {"a": a["variant"], "b": b["variant"], "diff": d, "se": se, "z": d / se if se else None,
            "verdict": verdict}


def comparison_table(cmps: list[dict]) -> str:
    lines = ["| a | b | a − b (val loss) | SE | a − b / SE | verdict (tie if < 2 SE) |", "|---|---|---|---|---|---|"]
    for c in cmps:
        z = "" if c["z"] is None else f"{c['z']:+.1f}"
        lines.append(f"| {c['a']} | {c['b']} | {c['diff']:+.4f} | {c['se']:.4f} | {z} | {c['verdict']} |")
    return "\n".join(lines)


def seed_table(rows: list[dict], refs: tuple[str, ...]) -> str:
    """Markdown: per variant the seeds, mean ± std validation loss, cache bytes and the val − train gap, then each
    variant against each of ``refs`` present (:func:`compare`)."""
    summary = summarise(rows)
    by = {s["variant"]: s for s in summary}
    lines = ["| variant | seeds | val loss (mean ± std) | cache B/token (fp16) | val − train loss |",
             "|---|---|---|---|---|"]
    for s in summary:
        gap = "" if s.get("gap") is None else f"{s['gap']:.3f}"
        lines.append(f"| {s['variant']} | {s['n']} | {s['val_loss']:.4f} ± {s['std']:.4f} | {s['bytes']:.0f} | {gap} |")
    cmps = [compare(by[v], by[ref]) for ref in refs if ref in by for v in by if v != ref]
    return "\n".join(lines) + ("\n\n" + comparison_table(cmps) if cmps else "")
