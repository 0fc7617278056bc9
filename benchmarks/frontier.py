"""The loss-vs-cache-bytes frontier: MHA, GQA, MQA, MLA at three latent sizes and KVSplice 50/70/90, trained at
equal tokens on real TinyStories text, several seeds each.

    python benchmarks/frontier.py                    # the study: every variant x seeds 1 2 3 (resumable)
    python benchmarks/frontier.py --study ablation   # MLA options on a tuning split (seed 0), run before the study
    python benchmarks/frontier.py --plot-only        # redraw the plot / table from the JSON

Every run is ``python -m training.fit --config small_<variant> --seed_everything S --trainer.max_steps N`` (fp32,
CPU, one torch thread per run, ``--jobs`` runs side by side). After a run, its last checkpoint is loaded and a
prefill of one validation block through the model's real decode cache measures the cache bytes per token (fp16
and fp32 caches: ``cache.nbytes() / tokens``). Each finished run is appended to the results JSON at once, and runs
already in it are skipped, so an interrupted study continues where it stopped (``--runs-dir`` keeps the checkpoints).

Data (``configs/small_*.yaml``): the local TinyStories folder, whose ``*val*`` file (the start of the real HF
validation split) is the validation text and whose other files are the training text, with a 4096-entry BPE trained
on them. ``--study ablation`` never looks at that validation text: it trains on the same training files (through a
folder of symlinks under ``--runs-dir``, no copies) and validates on a held-out 5 % tail of them, so the option it
picks for MLA is not tuned on the data the frontier reports.

On a GPU (``--device cuda``): the same runs with ``--trainer.accelerator gpu``, ``--batch`` sequences per step and
``--jobs`` runs side by side on the one GPU; results go to ``results/frontier_gpu.json`` (``.md`` / ``.png``). The
GPU study of the README: ``python benchmarks/frontier.py --device cuda --batch 64 --steps 2000 --jobs 9`` (32.8M tokens
per run). A finished run is reused only for the same variant, seed, steps, batch and device (its resume key); a
killed study ends its ``training.fit`` children with it.

Outputs: ``results/frontier.json`` (rows: ``variant``, ``config``, ``seed``, ``steps``, ``tokens``, ``val_loss``,
``cache_bytes_per_token`` (fp16, measured, all layers), ``cache_bytes_per_token_fp32``, ``cache_dim``, params,
wall time, tokens/s, the logged training-loss curve, the final training loss and the train/validation gap),
``results/frontier.png`` (validation loss vs cache bytes per token, log x, mean ± std per
variant, Pareto front marked) and a Markdown table on stdout and in ``results/frontier.md``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data" / "tinystories"
DATA_CACHE = REPO / ".cache" / "data"
"""Where the studies' runs cache token shards and tokenizers (shared by every run of a study)."""

FRONTIER = {  # variant -> (config, overrides)
    "mha": ("small_mha", []),
    "gqa2": ("small_gqa2", []),
    "mqa": ("small_mqa", []),
    "mla_128": ("small_mla", []),
    "mla_64": ("small_mla_64", []),
    "mla_32": ("small_mla_32", []),
    "mla_128_kvsplice_50": ("small_mla_kvsplice_50", []),
    "mla_128_kvsplice_70": ("small_mla_kvsplice_70", []),
    "mla_128_kvsplice_90": ("small_mla_kvsplice_90", []),
}
ABLATION = {  # MLA options, on the tuning split
    "mha": ("small_mha", []),
    "mla_64": ("small_mla_64", ["--model.latent_norm", "false"]),
    "mla_64+latent_norm": ("small_mla_64", ["--model.latent_norm", "true"]),
    "mla_64_lr1e-3": ("small_mla_64", ["--model.latent_norm", "false", "--model.learning_rate", "1e-3"]),
    "mla_64_lr4e-3": ("small_mla_64", ["--model.latent_norm", "false", "--model.learning_rate", "4e-3"]),
    "mla_64+latent_norm_lr4e-3": ("small_mla_64", ["--model.latent_norm", "true", "--model.learning_rate", "4e-3"]),
    "mha_lr4e-3": ("small_mha", ["--model.learning_rate", "4e-3"]),
}
TRAIN_FILES = ("gusjengis_toy-RNN__tinystories_sample.txt", "maxme1_tiny-stories__tiny-stories.json",
               "mines-opt-ml_decoding-gpt__tinystories_10k.txt")


# ---------------------------------------------------------------------------------------------------- one run
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


def resume_key(row: dict) -> tuple:
    """What makes two runs the same: variant, seed, optimizer steps, batch and device (rows written before batch /
    device were recorded are the CPU study's: batch 8, CPU)."""
    return row["variant"], row["seed"], row["steps"], row.get("batch", 8), row.get("device", "cpu")


def run_args(args, steps: int | None = None) -> list[str]:
    """The ``training.fit`` options every run of this study shares: data, batch, device (an epoch = the run's
    ``steps``, default ``args.steps``)."""
    out = [*args.data_args, "--data.batch_size", str(args.batch), "--data.train_batches_per_epoch",
           str(steps or args.steps)]
    if args.device == "cuda":
        out += ["--trainer.accelerator", "gpu", "--data.num_workers", "0"]
    return out


def run_one(variant: str, config: str, extra: list[str], seed: int, args, runs_dir: Path) -> dict:
    name = f"{variant}-s{seed}"
    run = runs_dir / name
    if (run / "last.ckpt").is_file() and (run / "metrics.csv").is_file() and (run / RUN_KEY).is_file():
        try:  # trained before the results were written, with the same resume key
            if json.loads((run / RUN_KEY).read_text()) == list(run_key(variant, seed, args)):
                return _row(variant, config, extra, seed, run, args, wall=None)
        except (RuntimeError, ValueError):
            pass
    wall = train(config, runs_dir, name, seed, args.steps, args.threads, [*extra, *run_args(args)])
    (run / RUN_KEY).write_text(json.dumps(list(run_key(variant, seed, args))) + "\n")
    return _row(variant, config, extra, seed, run, args, wall)


RUN_KEY = "frontier_key.json"
"""Written into a finished run's folder: the resume key it was trained with."""


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


def save_study(out: Path, meta: dict, rows: list[dict]) -> None:
    """Write a study's JSON through a temporary sibling (a killed study leaves the last complete file)."""
    from models.checkpoint import atomic_write

    atomic_write(out, lambda p: p.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1)))


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


def run_key(variant: str, seed: int, args) -> tuple:
    """The resume key (:func:`resume_key`) of a run this invocation would train."""
    return variant, seed, args.steps, args.batch, args.device


def final_train_loss(curve: list[list[float]], frac: float = 0.05) -> float | None:
    """Mean logged training loss over the last ``frac`` of the steps (at least the last logged value)."""
    if not curve:
        return None
    n = curve[-1][0]
    tail = [l for s, l in curve if s > (1 - frac) * n] or [curve[-1][1]]
    return statistics.fmean(tail)


def _row(variant: str, config: str, extra: list[str], seed: int, run: Path, args, wall) -> dict:
    step, val_loss, _, _ = last_val(run / "metrics.csv")
    tokens, train_time = trained(run / "last.ckpt")
    curve = train_curve(run / "metrics.csv")
    train_final = final_train_loss(curve)
    return {"variant": variant, "config": config, "overrides": extra, "seed": seed, "steps": step + 1,
            "batch": args.batch, "device": args.device,
            "tokens": tokens, "val_loss": val_loss, **cache_bytes(run / "last.ckpt", args.cache_tokens),
            "wall_s": None if wall is None else round(wall, 1), "train_time_s": round(train_time, 1),
            "tokens_per_s": round(tokens / train_time, 1) if train_time else None,
            "train_loss_final": None if train_final is None else round(train_final, 4),
            "train_val_gap": None if train_final is None else round(val_loss - train_final, 4),
            "train_loss_curve": curve}


def init_kv_rms() -> dict:
    """RMS of layer 0's queries, keys and values at initialisation for unit-RMS inputs (what ``ln_1`` gives): MLA's
    keys/values are a product of two N(0, 0.02) maps, so they start several times smaller than MHA's unless the
    latent is normalised."""
    import torch

    from models.config import GPTConfig
    from models.gpt import GPT

    out = {}
    for label, name, kw in (("mha", "small_mha", {}), ("mla_64", "small_mla_64", {}),
                            ("mla_64+latent_norm", "small_mla_64", {"latent_norm": True}),
                            ("mla_128", "small_mla", {}), ("mla_128+latent_norm", "small_mla", {"latent_norm": True})):
        torch.manual_seed(0)
        model = GPT(GPTConfig.from_name(name, vocab_size=4096, latent_norm=kw.get("latent_norm", False)))
        attn = model.transformer.h[0].attn
        x = torch.randn(4, 64, model.cfg.d_model, generator=torch.Generator().manual_seed(1))  # (B, T, d), RMS 1
        with torch.no_grad():
            if model.cfg.attention == "mha":
                q, k, v = attn.c_attn(x).split(model.cfg.d_model, -1)
            else:
                c = attn._c(x)  # (B, T, d_latent)
                q, k, v = attn.w_q(x), attn.w_uk(c), attn.w_uv(c)
        out[label] = {n: round(float(t.pow(2).mean().sqrt()), 4) for n, t in (("q", q), ("k", k), ("v", v))}
    return out


# ---------------------------------------------------------------------------------------------------- report
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


def table(summary: list[dict], ref: str = "mha") -> str:
    base = next((s for s in summary if s["variant"] == ref), summary[0])
    gap = any(s.get("gap") is not None for s in summary)
    lines = [f"| variant | cache B/token (fp16) | vs {base['variant']} | val loss (mean ± std) | seeds | "
             f"loss vs {base['variant']} | train-loss drop, last 20 % of steps |"
             + (" val − train loss |" if gap else "") + " Pareto |",
             "|---|---|---|---|---|---|---|" + ("---|" if gap else "") + "---|"]
    for s in summary:
        drop = "" if s["late_drop"] is None else f"{s['late_drop']:.3f}"
        g = ("" if s.get("gap") is None else f" {s['gap']:.3f} |") if gap else ""
        lines.append(f"| {s['variant']} | {s['bytes']:.0f} | {s['bytes'] / base['bytes']:.3f}× | "
                     f"{s['val_loss']:.4f} ± {s['std']:.4f} | {s['n']} | {s['val_loss'] / base['val_loss']:.4f}× | "
                     f"{drop} |{g} {'yes' if s['pareto'] else ''} |")
    return "\n".join(lines)


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


def comparisons(summary: list[dict], ref: str = "mha") -> list[dict]:
    """Every pair of variants with the same cache bytes, and every variant against ``ref``."""
    out = []
    by = {s["variant"]: s for s in summary}
    for i, a in enumerate(summary):
        for b in summary[i + 1:]:
            if a["bytes"] == b["bytes"]:
                out.append(compare(b, a))
    if ref in by:
        out += [compare(s, by[ref]) for s in summary if s["variant"] != ref]
    return out


def comparison_table(cmps: list[dict]) -> str:
    lines = ["| a | b | a − b (val loss) | SE | a − b / SE | verdict (tie if < 2 SE) |", "|---|---|---|---|---|---|"]
    for c in cmps:
        z = "" if c["z"] is None else f"{c['z']:+.1f}"
        lines.append(f"| {c['a']} | {c['b']} | {c['diff']:+.4f} | {c['se']:.4f} | {z} | {c['verdict']} |")
    return "\n".join(lines)


def plot(summary: list[dict], rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    colors = {"mha": "C0", "gqa": "C0", "mqa": "C0", "mla": "C1"}
    offsets = {}  # variants sharing a byte count get their labels stacked instead of overprinted
    for s in summary:
        c = "C2" if "kvsplice" in s["variant"] else colors.get(s["variant"][:3], "C3")
        k = offsets[s["bytes"]] = offsets.get(s["bytes"], -1) + 1
        seeds = [r["val_loss"] for r in rows if r["variant"] == s["variant"]]
        ax.scatter([s["bytes"]] * len(seeds), seeds, color=c, alpha=0.3, s=12)
        ax.errorbar(s["bytes"], s["val_loss"], yerr=s["std"], fmt="o", color=c, capsize=3,
                    markeredgecolor="k" if s["pareto"] else c)
        ax.annotate(s["variant"], (s["bytes"], s["val_loss"]), textcoords="offset points", xytext=(6, 4 - 10 * k),
                    fontsize=7)
    front = sorted((s for s in summary if s["pareto"]), key=lambda s: s["bytes"])
    ax.step([s["bytes"] for s in front], [s["val_loss"] for s in front], where="post", color="k", lw=0.8, ls="--",
            label="Pareto front")
    for label, c in (("MHA / GQA / MQA", "C0"), ("MLA", "C1"), ("MLA-128 + KVSplice", "C2")):
        ax.scatter([], [], color=c, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("decode cache bytes per token (fp16, all layers, measured)")
    ax.set_ylabel("validation loss (nats)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)


# ---------------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--study", choices=("frontier", "ablation"), default="frontier")
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="default: 1 2 3 (frontier), 0 (ablation)")
    p.add_argument("--variants", nargs="+", default=None, help="a subset of the study's variants")
    p.add_argument("--steps", type=int, default=500, help="optimizer steps per run")
    p.add_argument("--batch", type=int, default=8, help="sequences of 256 tokens per optimizer step")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: every run on the one GPU")
    p.add_argument("--jobs", type=int, default=2, help="runs side by side")
    p.add_argument("--threads", type=int, default=1, help="torch threads per run")
    p.add_argument("--cache-tokens", type=int, default=256, help="tokens prefilled to measure the cache")
    p.add_argument("--data", type=Path, default=DATA, help="the TinyStories folder (a *val* file + training files)")
    p.add_argument("--data-cache", type=Path, default=DATA_CACHE, help="where the runs cache token shards and the "
                   "tokenizer (default: the repository's .cache/data)")
    p.add_argument("--runs-dir", type=Path, default=None, help="default checkpoints/frontier (frontier_gpu on cuda)")
    p.add_argument("--out", type=Path, default=None, help="default results/frontier.json (frontier_ablation.json; "
                   "_gpu before .json on cuda)")
    p.add_argument("--plot-only", action="store_true")
    args = p.parse_args(argv)
    if args.steps < 1 or args.batch < 1 or args.jobs < 1 or args.threads < 1 or args.cache_tokens < 1:
        p.error("--steps, --batch, --jobs, --threads and --cache-tokens must be >= 1")
    study = FRONTIER if args.study == "frontier" else ABLATION
    seeds = args.seeds or ([1, 2, 3] if args.study == "frontier" else [0])
    gpu = "_gpu" if args.device == "cuda" else ""
    out = args.out or REPO / "results" / (f"frontier{gpu}.json" if args.study == "frontier"
                                          else f"frontier_ablation{gpu}.json")
    variants = args.variants or list(study)
    unknown = sorted(set(variants) - set(study))
    if unknown:
        p.error(f"unknown variants {unknown}; choose from {list(study)}")
    if not args.data.is_dir() and not args.plot_only:
        p.error(f"{args.data} not found: the study reads the local TinyStories text (default ../shared/data/"
                f"tinystories; --data to name another folder)")
    if args.device == "cuda" and not args.plot_only:
        import torch

        if not torch.cuda.is_available():
            p.error("--device cuda: no CUDA device here")
    runs_dir = (args.runs_dir or REPO / "checkpoints" / f"frontier{gpu}") / args.study
    args.data_args = data_args(args.data, runs_dir, tuning=args.study == "ablation", cache=args.data_cache)

    stored = json.loads(out.read_text()) if out.is_file() else {}
    rows = stored.get("rows", [])
    if args.study == "ablation":
        meta_extra = {"init_kv_rms": init_kv_rms()}
        print("q/k/v RMS at init (layer 0, unit-RMS inputs):", json.dumps(meta_extra["init_kv_rms"]))
    else:
        meta_extra = {}
    done = {resume_key(r) for r in rows}
    todo = [(v, s) for s in seeds for v in variants if run_key(v, s, args) not in done]
    lock = threading.Lock()
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    if args.device == "cuda" and not args.plot_only:
        import torch

        machine += f", {torch.cuda.get_device_name()}"
    if args.plot_only and stored.get("meta", {}).get("machine"):
        machine = stored["meta"]["machine"]  # redrawing: the machine that ran the study
    meta = {"study": args.study, "machine": machine, "device": args.device,
            "python": platform.python_version(), "command": "python " + " ".join([sys.argv[0], *(argv or sys.argv[1:])]),
            "dtype_train": "fp32", "batch": args.batch, "threads_per_run": args.threads, "jobs": args.jobs,
            **meta_extra}

    failed: list = []
    if not args.plot_only and todo:
        from tqdm import tqdm

        bar = tqdm(total=len(todo), desc=f"{args.study} runs", unit="run")

        def job(vs):
            v, s = vs
            cfg, extra = study[v]
            row = run_one(v, cfg, extra, s, args, runs_dir)
            with lock:
                rows.append(row)
                save_study(out, meta, rows)
                bar.update(1)
                rate = "-" if row["tokens_per_s"] is None else f"{row['tokens_per_s']:.0f}"
                bar.write(f"{v} seed {s}: val_loss {row['val_loss']:.4f}, {row['cache_bytes_per_token']:.0f} B/token,"
                          f" {rate} tok/s")
            return row

        try:
            failed = run_jobs(todo, job, args.jobs, bar.write)
        finally:
            bar.close()
        if failed is None:
            print("interrupted: finished runs are in the JSON; re-run the same command to continue", file=sys.stderr)
            return 130
        if failed:
            print(f"{len(failed)} runs failed: {failed}; re-run the same command to retry them", file=sys.stderr)
    key = (args.steps, args.batch, args.device)
    rows_now = [r for r in rows if resume_key(r)[2:] == key] or rows
    if not rows_now:
        print("no results yet", file=sys.stderr)
        return 1
    summary = summarise(rows_now)
    md = table(summary)
    cmp_md = comparison_table(comparisons(summary))
    print(md)
    print()
    print(cmp_md)
    tokens = sorted({r["tokens"] for r in rows_now if r["tokens"] is not None})
    title = (f"{args.study}: small_* (4L, d128, BPE-4096), {', '.join(f'{t:,}' for t in tokens)} tokens/run, "
             f"seeds {sorted({r['seed'] for r in rows_now})}, {meta['machine']}")
    out.with_suffix(".md").write_text(f"{title}\n\n{md}\n\nDifferences at equal cache bytes, and against MHA "
                                      f"(SE of the difference of seed means):\n\n{cmp_md}\n")
    plot(summary, rows_now, out.with_suffix(".png"), title)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
