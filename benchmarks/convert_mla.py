"""Trained MHA → MLA conversion and KVSplice insertion into trained MLA, before and after a short fine-tune.

    python -m benchmarks.convert_mla                 # after benchmarks/frontier.py (uses its small_* checkpoints)
    python -m benchmarks.convert_mla --seeds 1       # one source model per experiment instead of three
    python -m benchmarks.convert_mla --report-only --resume   # the report again from results/convert_mla.json

Sources: the frontier study's ``small_mha`` and ``small_mla`` of each seed (``checkpoints/frontier/frontier/``,
1,024,000 tokens; a missing one is trained here). For each: 1. MHA → MLA at R = 8 ... 128 (32× ... 2× smaller cache),
weights-only and activation-aware (``kvsplice to-mla``, 65,536 calibration tokens of training text); 2. the R = 32
conversions fine-tuned (``training.fit --config small_mla_32 --model.init_from ...``, fresh AdamW, 10 % warmup) for
1 / 5 / 10 % of the source's tokens at two peak learning rates (``FT_LRS``: fixed in advance, and the source's
final one); 3. KVSplice 50 % and 90 % inserted into MLA-128 (PCA vs random-orthogonal init), before and after 10 %.
References: the MHA model, ``results/frontier.json``'s from-scratch rows. Validation loss: 98,304 tokens of the real
validation text. Writes ``results/convert_mla.{json,md,png}``; ``--resume`` keeps the rows already in the JSON.
"""
from __future__ import annotations

from pathlib import Path

from benchmarks.harness.options import UsageError
from benchmarks.harness.runner import Study
from benchmarks.harness.paths import CALIB
from benchmarks.lib.convert_mla_report import (CONVERT_RANKS, FT_FRACTIONS, FT_LRS, STEPS_SOURCE, TOKENS_PER_STEP,
                                               figure, stat_rows)
from benchmarks.lib.study import DATA, REPO, last_val, to_mla, train


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


def experiments(seed: int, runs: Path, work: Path, threads: int, done: set):
    """Yields the rows of one source seed not in ``done`` (``(experiment, seed, ft_tokens, ft_lr)``)."""

    def measured(name: str, ckpt: Path, fields: dict, config: str = "", extra: tuple = (), fractions: tuple = ()):
        """The row of ``ckpt`` as it is, then one per fine-tune LR and fraction of the source's steps."""
        if (name, seed, 0, None) not in done:
            yield {"experiment": name, "seed": seed, **fields, "ft_tokens": 0, "val_loss": val_loss(ckpt)}
        for lr in FT_LRS:
            for frac in fractions:
                steps = round(frac * STEPS_SOURCE)
                if (name, seed, steps * TOKENS_PER_STEP, lr) in done:
                    continue
                ft = f"{ckpt.stem}-ft{steps}-lr{lr}"  # fresh AdamW, 10 % warmup
                train(config, work / "ft", ft, seed, steps, threads,
                      ["--model.init_from", str(ckpt), "--model.warmup_steps", str(max(1, steps // 10)),
                       "--model.learning_rate", lr, "--data.path", str(DATA), *extra])
                yield {"experiment": name, "seed": seed, **fields, "ft_steps": steps,
                       "ft_tokens": steps * TOKENS_PER_STEP, "ft_fraction": frac, "ft_lr": lr,
                       "val_loss": last_val(work / "ft" / ft / "metrics.csv")[1]}

    mha = source("mha", "small_mha", seed, runs, threads)
    yield from measured("mha", mha, {})
    calib = ["--calib", str(CALIB), "--calib-tokens", "65536"]
    for r in CONVERT_RANKS:
        for method, extra in (("weights-only", []), ("activation-aware", calib)):
            conv = to_mla(mha, work / f"mha-s{seed}-r{r}-{method}.ckpt", ["--d-latent", str(r), *extra], threads)
            yield from measured(f"convert r{r} {method}", conv, {"d_latent": r, "method": method}, "small_mla_32",
                                ("--model.latent_norm", "false"), FT_FRACTIONS if r == 32 else ())
    mla = source("mla_128", "small_mla", seed, runs, threads)
    yield from measured("mla_128", mla, {})
    for pct, ratio in ((50, "0.5"), (90, "0.1")):
        for init, extra in (("pca", calib), ("random", ["--kvsplice-init", "random", "--seed", str(seed)])):
            conv = to_mla(mla, work / f"mla-s{seed}-ks{pct}-{init}.ckpt", ["--kvsplice-ratio", ratio, *extra], threads)
            yield from measured(f"kvsplice{pct} {init}", conv, {"kvsplice": pct, "init": init},
                                f"small_mla_kvsplice_{pct}", (), (0.10,))


def options(p) -> None:
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="source model seeds")
    p.add_argument("--runs-dir", type=Path, default=REPO / "checkpoints" / "frontier" / "frontier")
    p.add_argument("--work", type=Path, default=REPO / "checkpoints" / "convert_mla")
    p.add_argument("--report-only", action="store_true", help="the report from the rows of --resume's JSON")


def rows(run):
    a = run.args
    if not DATA.is_dir():
        raise UsageError(f"{DATA} not found: the benchmark reads the TinyStories text of ../shared/data/tinystories")
    yield from run.done
    if a.report_only:
        return
    from tqdm import tqdm
    a.work.mkdir(parents=True, exist_ok=True)
    for seed in tqdm(a.seeds, desc="source seeds", unit="seed"):
        done = {(r["experiment"], r["seed"], r["ft_tokens"], r.get("ft_lr")) for r in run.rows}
        for row in experiments(seed, a.runs_dir, a.work, a.threads, done):
            run.say(f"{row['experiment']} seed {row['seed']} ft {row['ft_tokens']:,}: val_loss {row['val_loss']:.4f}")
            yield row


STUDY = Study("convert_mla", __doc__, rows, options=options, threads=2, figure=lambda run, rows: figure(rows),
              summary=lambda run, rows: {"ft_lrs": FT_LRS, "source_tokens": STEPS_SOURCE * TOKENS_PER_STEP,
                                         "stats": stat_rows(rows)})
main = STUDY.main

if __name__ == "__main__":
    raise SystemExit(main())
