"""Trained MHA → MLA conversion and KVSplice insertion into trained MLA, before and after a short fine-tune.

    python -m benchmarks.convert_mla                 # after benchmarks/frontier.py (uses its small_* checkpoints)
    python -m benchmarks.convert_mla --seeds 1       # one source model per experiment instead of three

Sources: the frontier study's trained ``small_mha`` and ``small_mla`` (d_latent 128) checkpoints of each seed
(``checkpoints/frontier/frontier/{mha,mla_128}-s<seed>/last.ckpt``, 500 steps = 1,024,000 tokens of real TinyStories
text); a missing one is trained here with the same command the study uses. For every source seed:

1. MHA → MLA at R = 8 / 16 / 32 / 64 / 128 (32× ... 2× smaller cache than MHA), weights-only and activation-aware
   (``python -m kvsplice.to_mla``, 65,536 calibration tokens from the training text), validation loss before any
   fine-tuning;
2. the R = 32 conversions fine-tuned with ``training.fit --config small_mla_32 --model.init_from ...`` for 1 %, 5 %
   and 10 % of the source's training tokens (5 / 25 / 50 steps; fresh AdamW, 10 % warmup, cosine to 10 %) at two
   peak learning rates (:data:`FT_LRS`: the one fixed in advance, and the source's final one);
3. KVSplice 50 % and 90 % inserted into the trained MLA-128 with PCA vs random-orthogonal init, before and after
   50 steps (10 %) of the same fine-tune (both learning rates).

References from ``results/frontier.json``: the MHA model itself, and MLA-32 / KVSplice trained from scratch on
1,024,000 tokens (the converted models have seen 1,024,000 + the fine-tune's tokens). Validation loss is always the
mean over the same 48 × 8 × 256 = 98,304 tokens of the real validation text as in the study.

Writes ``results/convert_mla.json`` (rows), ``results/convert_mla.md`` (tables) and ``results/convert_mla.png``.
Resumable: rows already in the JSON are skipped.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path


from benchmarks.harness.header import command as command_line, revision
from benchmarks.harness.options import add_out, add_threads, command, parser
from benchmarks.harness.paths import RESULTS
from benchmarks.lib.study import DATA, REPO, last_val, run_module, train

CALIB = DATA / "gusjengis_toy-RNN__tinystories_sample.txt"  # training text
STEPS_SOURCE = 500
TOKENS_PER_STEP = 8 * 256
FT_FRACTIONS = (0.01, 0.05, 0.10)
CONVERT_RANKS = (8, 16, 32, 64, 128)  # 32x ... 2x smaller caches than MHA's 256 numbers per token per layer
FT_LRS = ("1e-3", "2e-4")
"""Fine-tune peak learning rates: 1e-3 (half the pre-training peak) was fixed before any run; it made short
fine-tunes of the already-good conversions worse, so 2e-4 — the source schedule's final learning rate
(min_lr_ratio 0.1 × 2e-3), i.e. continuing where pre-training ended — is reported next to it."""


def val_loss(ckpt: Path) -> float:
    """Mean next-token loss over the study's validation blocks (configs/small_mha.yaml's data section, all 48)."""
    import yaml

    from data import TinyStoriesDataModule
    from models.checkpoint import load_gpt_checkpoint
    from training.evaluate import validation_loss

    data = yaml.safe_load((REPO / "configs" / "small_mha.yaml").read_text())["data"]
    dm = TinyStoriesDataModule(**{**data, "path": str(DATA), "block_size": 256})
    dm.setup()
    return validation_loss(load_gpt_checkpoint(ckpt)[0], dm, max_tokens=len(dm.val_set) * 256)[0]


def source(variant: str, config: str, seed: int, runs: Path, threads: int) -> Path:
    ckpt = runs / f"{variant}-s{seed}" / "last.ckpt"
    if not ckpt.is_file():
        train(config, runs, f"{variant}-s{seed}", seed, STEPS_SOURCE, threads, ["--data.path", str(DATA)])
    return ckpt


def finetune(init: Path, config: str, steps: int, name: str, seed: int, work: Path, threads: int,
             extra: list[str], lr: str) -> float:
    train(config, work / "ft", name, seed, steps, threads,
          ["--model.init_from", str(init), "--model.warmup_steps", str(max(1, steps // 10)), "--model.learning_rate",
           lr, "--data.path", str(DATA), *extra])
    return last_val(work / "ft" / name / "metrics.csv")[1]


def to_mla(src: Path, out: Path, args: list[str], threads: int) -> Path:
    if not out.is_file():
        run_module("kvsplice.to_mla", ["--model", str(src), *args, "--out", str(out), "--force", "--threads",
                                       str(threads)], threads)
    return out


def experiments(seed: int, runs: Path, work: Path, threads: int, done: set, emit) -> None:
    mha = source("mha", "small_mha", seed, runs, threads)
    key = ("mha", seed)
    if key not in done:
        emit({"experiment": "mha", "seed": seed, "val_loss": val_loss(mha), "ft_tokens": 0})
    calib = ["--calib", str(CALIB), "--calib-tokens", "65536"]
    for r in CONVERT_RANKS:
        for method, extra in (("weights-only", []), ("activation-aware", calib)):
            conv = to_mla(mha, work / f"mha-s{seed}-r{r}-{method}.ckpt", ["--d-latent", str(r), *extra], threads)
            if (f"convert r{r} {method}", seed, 0) not in done:
                emit({"experiment": f"convert r{r} {method}", "seed": seed, "d_latent": r, "method": method,
                      "ft_tokens": 0, "val_loss": val_loss(conv)})
            if r != 32:
                continue
            for lr in FT_LRS:
                for frac in FT_FRACTIONS:
                    steps = round(frac * STEPS_SOURCE)
                    if (f"convert r{r} {method}", seed, steps * TOKENS_PER_STEP, lr) in done:
                        continue
                    loss = finetune(conv, "small_mla_32", steps, f"mha-s{seed}-r{r}-{method}-ft{steps}-lr{lr}", seed,
                                    work, threads, ["--model.latent_norm", "false"], lr)
                    emit({"experiment": f"convert r{r} {method}", "seed": seed, "d_latent": r, "method": method,
                          "ft_steps": steps, "ft_tokens": steps * TOKENS_PER_STEP, "ft_fraction": frac, "ft_lr": lr,
                          "val_loss": loss})
    mla = source("mla_128", "small_mla", seed, runs, threads)
    if ("mla_128", seed, 0) not in done:
        emit({"experiment": "mla_128", "seed": seed, "val_loss": val_loss(mla), "ft_tokens": 0})
    for pct, ratio in ((50, "0.5"), (90, "0.1")):
        for init, extra in (("pca", calib), ("random", ["--kvsplice-init", "random", "--seed", str(seed)])):
            name = f"kvsplice{pct} {init}"
            conv = to_mla(mla, work / f"mla-s{seed}-ks{pct}-{init}.ckpt", ["--kvsplice-ratio", ratio, *extra], threads)
            if (name, seed, 0) not in done:
                emit({"experiment": name, "seed": seed, "kvsplice": pct, "init": init, "ft_tokens": 0,
                      "val_loss": val_loss(conv)})
            steps = round(0.10 * STEPS_SOURCE)
            for lr in FT_LRS:
                if (name, seed, steps * TOKENS_PER_STEP, lr) in done:
                    continue
                loss = finetune(conv, f"small_mla_kvsplice_{pct}", steps, f"mla-s{seed}-ks{pct}-{init}-ft{steps}-lr{lr}",
                                seed, work, threads, [], lr)
                emit({"experiment": name, "seed": seed, "kvsplice": pct, "init": init, "ft_steps": steps,
                      "ft_tokens": steps * TOKENS_PER_STEP, "ft_fraction": 0.10, "ft_lr": lr, "val_loss": loss})


# ---------------------------------------------------------------------------------------------------- report
def stats(rows: list[dict], experiment: str, ft_tokens: int, lr: str | None = None) -> tuple[float, float, int]:
    v = [r["val_loss"] for r in rows if r["experiment"] == experiment and r["ft_tokens"] == ft_tokens
         and (ft_tokens == 0 or r.get("ft_lr") == lr)]
    if not v:
        return float("nan"), float("nan"), 0
    return statistics.fmean(v), statistics.stdev(v) if len(v) > 1 else 0.0, len(v)


def frontier_ref(variant: str) -> tuple[float, float, int]:
    f = RESULTS / "frontier.json"
    rows = json.loads(f.read_text())["rows"] if f.is_file() else []
    v = [r["val_loss"] for r in rows if r["variant"] == variant]
    return (statistics.fmean(v), statistics.stdev(v) if len(v) > 1 else 0.0, len(v)) if v else (float("nan"),) * 2 + (0,)


def _fmt(m: float, s: float, k: int) -> str:
    return f"{m:.4f} ± {s:.4f} ({k})"


def _lines(rows: list[dict], exp: str, label: str, ref: float) -> list[str]:
    """Table rows of one experiment: before fine-tuning, then each fine-tune LR and length."""
    src_tokens = STEPS_SOURCE * TOKENS_PER_STEP
    out = []
    m, s, k = stats(rows, exp, 0)
    if k:
        out.append(f"| {label} | 0 | — | {_fmt(m, s, k)} | {m / ref:.4f}× |")
    for lr in FT_LRS:
        for t in sorted({x["ft_tokens"] for x in rows if x["experiment"] == exp and x["ft_tokens"]}):
            m, s, k = stats(rows, exp, t, lr)
            if k:
                out.append(f"| {label} | {t:,} ({t / src_tokens:.0%}) | {lr} | {_fmt(m, s, k)} | {m / ref:.4f}× |")
    return out


def report(rows: list[dict], out: Path) -> str:
    mha, mha_sd, n = stats(rows, "mha", 0)
    lines = [f"MHA source: {_fmt(mha, mha_sd, n)} (mean ± std over source seeds (n))", "",
             "| model | cache vs MHA | fine-tune tokens | fine-tune LR | val loss | vs MHA |", "|---|---|---|---|---|---|"]
    for r in CONVERT_RANKS:
        for method in ("weights-only", "activation-aware"):
            lines += _lines(rows, f"convert r{r} {method}", f"MLA-{r} {method} | {256 // r}× smaller", mha)
    for variant, label in (("mla_32", "MLA-32 from scratch (frontier)"), ("mla_128", "MLA-128 from scratch (frontier)")):
        m, s, k = frontier_ref(variant)
        lines.append(f"| {label} | {256 // int(variant.split('_')[1])}× smaller | 0 | — | {_fmt(m, s, k)} | "
                     f"{m / mha:.4f}× |")
    mla, mla_sd, n = stats(rows, "mla_128", 0)
    lines += ["", f"MLA-128 source: {_fmt(mla, mla_sd, n)}", "",
              "| KVSplice into trained MLA-128 | init | fine-tune tokens | fine-tune LR | val loss | vs MLA-128 |",
              "|---|---|---|---|---|---|"]
    for pct in (50, 90):
        for init in ("pca", "random"):
            lines += _lines(rows, f"kvsplice{pct} {init}", f"KVSplice-{pct} | {init}", mla)
        m, s, k = frontier_ref(f"mla_128_kvsplice_{pct}")
        lines.append(f"| KVSplice-{pct} from scratch (frontier) | — | 0 | — | {_fmt(m, s, k)} | {m / mla:.4f}× |")
    md = "\n".join(lines)
    out.with_suffix(".md").write_text(md + "\n")
    plot(rows, mha, out.with_suffix(".png"))
    return md


def _curves(ax, rows: list[dict], exp: str, label: str, color: str, marker: str = "o") -> None:
    """Mean ± std validation loss of ``exp`` against fine-tune tokens (% of the source's), one line per LR."""
    tok = sorted({x["ft_tokens"] for x in rows if x["experiment"] == exp})
    for lr, ls in zip(FT_LRS, ("-", "--")):
        pts = [stats(rows, exp, t, lr) for t in tok]
        ax.errorbar([t / (STEPS_SOURCE * TOKENS_PER_STEP) * 100 for t in tok], [p[0] for p in pts],
                    yerr=[p[1] for p in pts], marker=marker, ls=ls, color=color, capsize=3, label=f"{label}, LR {lr}")
    ax.set_xlabel("fine-tune tokens (% of the source's training tokens)")
    ax.set_ylabel("validation loss")


def plot(rows: list[dict], mha: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for method, c in (("weights-only", "C0"), ("activation-aware", "C1")):
        _curves(left, rows, f"convert r32 {method}", f"MHA→MLA-32 {method}", c)
    left.axhline(mha, color="k", ls="--", lw=0.8, label="MHA source")
    left.axhline(1.03 * mha, color="k", ls=":", lw=0.8, label="1.03 × MHA")
    m, _, k = frontier_ref("mla_32")
    if k:
        left.axhline(m, color="C2", ls="-.", lw=0.8, label="MLA-32 from scratch")
    for pct, marker in ((50, "o"), (90, "s")):
        for init, c in (("pca", "C1"), ("random", "C0")):
            _curves(right, rows, f"kvsplice{pct} {init}", f"KVSplice-{pct} {init}", c, marker)
    for ax in (left, right):
        ax.legend(fontsize=7)
    fig.suptitle("Converting trained small_* models (real TinyStories text; mean ± std over source seeds)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=130)


@command
def main(argv: list[str] | None = None) -> int:
    p = parser(__file__, __doc__)
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="source model seeds")
    add_threads(p, 2)
    p.add_argument("--runs-dir", type=Path, default=REPO / "checkpoints" / "frontier" / "frontier")
    p.add_argument("--work", type=Path, default=REPO / "checkpoints" / "convert_mla")
    add_out(p, RESULTS / "convert_mla.json")
    p.add_argument("--report-only", action="store_true")
    args = p.parse_args(argv)
    if not DATA.is_dir():
        p.error(f"{DATA} not found: the benchmark reads the local TinyStories text from ../shared/data/tinystories")
    rows = json.loads(args.out.read_text())["rows"] if args.out.is_file() else []

    def emit(row: dict) -> None:
        rows.append(row)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.out.with_suffix(".tmp")
        meta = {"command": command_line(__file__, argv), "revision": revision(), "ft_lrs": FT_LRS,
                "source_tokens": STEPS_SOURCE * TOKENS_PER_STEP}
        tmp.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        os.replace(tmp, args.out)
        print(f"{row['experiment']} seed {row['seed']} ft {row['ft_tokens']:,}: val_loss {row['val_loss']:.4f}",
              flush=True)

    if not args.report_only:
        from tqdm import tqdm

        args.work.mkdir(parents=True, exist_ok=True)
        for seed in tqdm(args.seeds, desc="source seeds", unit="seed"):
            done = {(r["experiment"], r["seed"], r["ft_tokens"]) for r in rows}
            done |= {(r["experiment"], r["seed"], r["ft_tokens"], r.get("ft_lr")) for r in rows if r["ft_tokens"]}
            done |= {(r["experiment"], r["seed"]) for r in rows if r["experiment"] == "mha"}
            experiments(seed, args.runs_dir, args.work, args.threads, done, emit)
    print(report(rows, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
