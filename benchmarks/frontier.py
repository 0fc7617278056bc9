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

Outputs: ``results/frontier.json`` (rows: ``variant``, ``config``, ``seed``, ``steps``, ``tokens``, ``val_loss``,
``cache_bytes_per_token`` (fp16, measured, all layers), ``cache_bytes_per_token_fp32``, ``cache_dim``, params,
wall time, tokens/s, the logged training-loss curve), ``results/frontier.png`` (validation loss vs cache bytes per token, log x, mean ± std per
variant, Pareto front marked) and a Markdown table on stdout and in ``results/frontier.md``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data" / "tinystories"

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
    the validation after N optimizer steps is logged at step N - 1). ``tokens`` / ``train_time_s`` are None for a
    run shorter than the logging interval."""
    rows = list(csv.DictReader(metrics.open()))
    vals = [r for r in rows if r.get("val_loss")]
    if not vals:
        raise RuntimeError(f"{metrics}: no val_loss")
    train = [r for r in rows if r.get("tokens")]
    tokens, seconds = (float(train[-1]["tokens"]), float(train[-1]["train_time_s"])) if train else (None, None)
    return int(vals[-1]["step"]), float(vals[-1]["val_loss"]), tokens, seconds


def train_curve(metrics: Path) -> list[list[float]]:
    """``[[step, train_loss], ...]`` as logged (every ``log_every_n_steps``), steps counted from 1."""
    rows = csv.DictReader(metrics.open())
    return [[int(r["step"]) + 1, round(float(r["train_loss"]), 4)] for r in rows if r.get("train_loss")]


def cache_bytes(ckpt: Path, tokens: int) -> dict:
    """Prefill ``tokens`` random ids through the checkpoint's model and its real decode cache (fp16 and fp32)."""
    import torch

    from models.checkpoint import load_model

    model = load_model(ckpt)[0]
    out = {"cache_dim": model.cfg.cache_dim, "params": model.num_params(), "variant_name": model.cfg.variant}
    ids = torch.randint(0, model.cfg.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    for dtype, key in ((torch.float16, "cache_bytes_per_token"), (torch.float32, "cache_bytes_per_token_fp32")):
        m = model.to(dtype)
        cache = m.new_cache(1, capacity=tokens)
        with torch.no_grad():
            m(ids, cache=cache)
        out[key] = cache.nbytes() / tokens
    return out


def run_module(module: str, argv: list[str], threads: int) -> float:
    """``python -m MODULE ARGV`` in the repository with ``threads`` torch threads; returns the wall seconds.

    Raises:
        RuntimeError: non-zero exit, with the last lines of its output.
    """
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(REPO))
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", module, *argv], cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
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


def run_one(variant: str, config: str, extra: list[str], seed: int, args, runs_dir: Path) -> dict:
    name = f"{variant}-s{seed}"
    run = runs_dir / name
    if (run / "last.ckpt").is_file() and (run / "metrics.csv").is_file():  # trained before the results were written
        try:
            if last_val(run / "metrics.csv")[0] + 1 == args.steps:  # metrics.csv counts steps from 0
                return _row(variant, config, extra, seed, run, args, wall=None)
        except RuntimeError:
            pass
    wall = train(config, runs_dir, name, seed, args.steps, args.threads, [*extra, *args.data_args])
    return _row(variant, config, extra, seed, run, args, wall)


def _row(variant: str, config: str, extra: list[str], seed: int, run: Path, args, wall) -> dict:
    step, val_loss, tokens, train_time = last_val(run / "metrics.csv")
    return {"variant": variant, "config": config, "overrides": extra, "seed": seed, "steps": step + 1,
            "tokens": None if tokens is None else int(tokens), "val_loss": val_loss, **cache_bytes(run / "last.ckpt", args.cache_tokens),
            "wall_s": None if wall is None else round(wall, 1), "train_time_s": None if train_time is None else round(train_time, 1),
            "tokens_per_s": round(tokens / train_time, 1) if train_time else None,
            "train_loss_curve": train_curve(run / "metrics.csv")}


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
        out.append({"variant": v, "n": len(rs), "val_loss": statistics.fmean(losses),
                    "std": statistics.stdev(losses) if len(losses) > 1 else 0.0,
                    "bytes": rs[0]["cache_bytes_per_token"], "tokens": rs[0]["tokens"],
                    "late_drop": statistics.fmean(drops) if drops else None})
    for s in out:  # on the front: no other variant has fewer-or-equal bytes and a lower mean loss
        s["pareto"] = not any(o is not s and o["bytes"] <= s["bytes"] and o["val_loss"] < s["val_loss"] for o in out)
    return sorted(out, key=lambda s: -s["bytes"])


def table(summary: list[dict], ref: str = "mha") -> str:
    base = next((s for s in summary if s["variant"] == ref), summary[0])
    lines = [f"| variant | cache B/token (fp16) | vs {base['variant']} | val loss (mean ± std) | seeds | "
             f"loss vs {base['variant']} | train-loss drop, last 20 % of steps | Pareto |",
             "|---|---|---|---|---|---|---|---|"]
    for s in summary:
        drop = "" if s["late_drop"] is None else f"{s['late_drop']:.3f}"
        lines.append(f"| {s['variant']} | {s['bytes']:.0f} | {s['bytes'] / base['bytes']:.3f}× | "
                     f"{s['val_loss']:.4f} ± {s['std']:.4f} | {s['n']} | {s['val_loss'] / base['val_loss']:.4f}× | "
                     f"{drop} | {'yes' if s['pareto'] else ''} |")
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
    p.add_argument("--steps", type=int, default=500, help="optimizer steps per run (batch 8 x 256 tokens)")
    p.add_argument("--jobs", type=int, default=2, help="runs side by side")
    p.add_argument("--threads", type=int, default=1, help="torch threads per run")
    p.add_argument("--cache-tokens", type=int, default=256, help="tokens prefilled to measure the cache")
    p.add_argument("--runs-dir", type=Path, default=REPO / "checkpoints" / "frontier")
    p.add_argument("--out", type=Path, default=None, help="default results/frontier.json (frontier_ablation.json)")
    p.add_argument("--plot-only", action="store_true")
    args = p.parse_args(argv)
    study = FRONTIER if args.study == "frontier" else ABLATION
    seeds = args.seeds or ([1, 2, 3] if args.study == "frontier" else [0])
    out = args.out or REPO / "results" / ("frontier.json" if args.study == "frontier" else "frontier_ablation.json")
    variants = args.variants or list(study)
    unknown = sorted(set(variants) - set(study))
    if unknown:
        p.error(f"unknown variants {unknown}; choose from {list(study)}")
    if not DATA.is_dir() and not args.plot_only:
        p.error(f"{DATA} not found: the study reads the local TinyStories text from ../shared/data/tinystories")
    runs_dir = args.runs_dir / args.study
    args.data_args = []
    if args.study == "ablation":  # tuning split: the training files only, 5 % tail held out (never the val file)
        tune = runs_dir / "tune_data"
        tune.mkdir(parents=True, exist_ok=True)
        for f in TRAIN_FILES:
            if not (tune / f).exists():
                (tune / f).symlink_to(DATA / f)
        args.data_args = ["--data.path", str(tune)]
    else:
        args.data_args = ["--data.path", str(DATA)]

    rows = json.loads(out.read_text())["rows"] if out.is_file() else []
    if args.study == "ablation":
        meta_extra = {"init_kv_rms": init_kv_rms()}
        print("q/k/v RMS at init (layer 0, unit-RMS inputs):", json.dumps(meta_extra["init_kv_rms"]))
    else:
        meta_extra = {}
    done = {(r["variant"], r["seed"]) for r in rows}
    todo = [(v, s) for s in seeds for v in variants if (v, s) not in done]
    lock = threading.Lock()
    meta = {"study": args.study, "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
            "python": platform.python_version(), "command": "python " + " ".join([sys.argv[0], *(argv or sys.argv[1:])]),
            "dtype_train": "fp32", "threads_per_run": args.threads, "jobs": args.jobs, **meta_extra}

    def save() -> None:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        os.replace(tmp, out)

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
                save()
                bar.update(1)
                bar.write(f"{v} seed {s}: val_loss {row['val_loss']:.4f}, {row['cache_bytes_per_token']:.0f} B/token,"
                          f" {row['tokens_per_s']:.0f} tok/s")
            return row

        with ThreadPoolExecutor(args.jobs) as pool:
            futures = {pool.submit(job, vs): vs for vs in todo}
            for f, vs in futures.items():
                try:
                    f.result()
                except Exception as e:  # noqa: BLE001 - one failed run must not stop the study
                    failed.append(vs)
                    bar.write(f"error: {vs[0]} seed {vs[1]}: {e}")
        bar.close()
        if failed:
            print(f"{len(failed)} runs failed: {failed}; re-run the same command to retry them", file=sys.stderr)
    if not rows:
        print("no results yet", file=sys.stderr)
        return 1
    summary = summarise(rows)
    md = table(summary)
    print(md)
    tokens = sorted({r["tokens"] for r in rows})
    title = (f"{args.study}: small_* (4L, d128, BPE-4096), {', '.join(f'{t:,}' for t in tokens)} tokens/run, "
             f"seeds {sorted({r['seed'] for r in rows})}")
    out.with_suffix(".md").write_text(f"{title}\n\n{md}\n")
    plot(summary, rows, out.with_suffix(".png"), title)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
