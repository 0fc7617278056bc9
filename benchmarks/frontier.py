"""The loss-vs-cache-bytes frontier: MHA, GQA, MQA, MLA at three latent sizes and KVSplice 50/70/90, and the
DeepSeek-V3 layout's MHA / MLA / KVSplice 50/90 (``ds_*``), trained at equal tokens on real TinyStories text, several
seeds each.

    python -m benchmarks.frontier                    # the study: every variant x seeds 1 2 3 (resumable)
    python -m benchmarks.frontier --study ablation   # MLA options on a tuning split (seed 0), run before the study
    python -m benchmarks.frontier --plot-only        # redraw the plot / table from the JSON

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
GPU study of the README: ``python -m benchmarks.frontier --device cuda --batch 64 --steps 2000 --jobs 9`` (32.8M tokens
per run). A finished run is reused only for the same variant, seed, steps, batch and device (its resume key); a
killed study ends its ``training.fit`` children with it.

Outputs: ``results/frontier.json`` (rows: ``variant``, ``config``, ``seed``, ``steps``, ``tokens``, ``val_loss``,
``cache_bytes_per_token`` (fp16, measured, all layers), ``cache_bytes_per_token_fp32``, ``cache_dim``, params,
wall time, tokens/s, the logged training-loss curve, the final training loss and the train/validation gap),
``results/frontier.png`` (validation loss vs cache bytes per token, log x, mean ± std per
variant, Pareto front marked) and a Markdown table on stdout and in ``results/frontier.md``.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import threading
from pathlib import Path


from benchmarks.harness.header import command as command_line, revision
from benchmarks.harness.options import add_out, add_threads, command, parser
from benchmarks.harness.paths import RESULTS
from benchmarks.harness.studies import variants
from benchmarks.lib.study import (DATA, DATA_CACHE, REPO, RUN_KEY, cache_bytes, compare, comparison_table, data_args,
                                  final_train_loss, last_val, resume_key, run_args, run_jobs, run_key, save_study,
                                  summarise, train, train_curve, trained)

FRONTIER = variants("frontier", "frontier")  # variant -> (config, overrides): benchmarks/studies/frontier.yaml
ABLATION = variants("frontier", "ablation")  # MLA options, on the tuning split


# ---------------------------------------------------------------------------------------------------- one run
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


def comparisons(summary: list[dict], ref: str = "mha") -> list[dict]:
    """Every pair of variants with the same cache bytes, every DeepSeek-layout variant (``ds_X``) against its GPT-2
    twin ``X``, and every variant against ``ref`` — each pair once."""
    out, seen = [], set()
    by = {s["variant"]: s for s in summary}

    def add(a: dict, b: dict) -> None:
        if frozenset((a["variant"], b["variant"])) not in seen:
            seen.add(frozenset((a["variant"], b["variant"])))
            out.append(compare(a, b))

    for i, a in enumerate(summary):
        for b in summary[i + 1:]:
            if a["bytes"] == b["bytes"]:
                add(b, a)
    for s in summary:
        if s["variant"].startswith("ds_") and s["variant"][3:] in by:
            add(s, by[s["variant"][3:]])
    if ref in by:
        for s in summary:
            if s["variant"] != ref:
                add(s, by[ref])
    return out


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
@command
def main(argv: list[str] | None = None) -> int:
    p = parser(__file__, __doc__, raw=True)
    p.add_argument("--study", choices=("frontier", "ablation"), default="frontier")
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="default: 1 2 3 (frontier), 0 (ablation)")
    p.add_argument("--variants", nargs="+", default=None, help="a subset of the study's variants")
    p.add_argument("--steps", type=int, default=500, help="optimizer steps per run")
    p.add_argument("--batch", type=int, default=8, help="sequences of 256 tokens per optimizer step")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: every run on the one GPU")
    p.add_argument("--jobs", type=int, default=2, help="runs side by side")
    add_threads(p, help="torch threads per run")
    p.add_argument("--cache-tokens", type=int, default=256, help="tokens prefilled to measure the cache")
    p.add_argument("--data", type=Path, default=DATA, help="the TinyStories folder (a *val* file + training files)")
    p.add_argument("--data-cache", type=Path, default=DATA_CACHE, help="where the runs cache token shards and the "
                   "tokenizer (default: the repository's .cache/data)")
    p.add_argument("--runs-dir", type=Path, default=None, help="default checkpoints/frontier (frontier_gpu on cuda)")
    add_out(p, None, help="default results/frontier.json (frontier_ablation.json; "
                   "_gpu before .json on cuda)")
    p.add_argument("--plot-only", action="store_true")
    args = p.parse_args(argv)
    if args.steps < 1 or args.batch < 1 or args.jobs < 1 or args.threads < 1 or args.cache_tokens < 1:
        p.error("--steps, --batch, --jobs, --threads and --cache-tokens must be >= 1")
    study = FRONTIER if args.study == "frontier" else ABLATION
    seeds = args.seeds or ([1, 2, 3] if args.study == "frontier" else [0])
    gpu = "_gpu" if args.device == "cuda" else ""
    out = args.out or RESULTS / (f"frontier{gpu}.json" if args.study == "frontier"
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
            "python": platform.python_version(), "command": command_line(__file__, argv), "revision": revision(),
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
