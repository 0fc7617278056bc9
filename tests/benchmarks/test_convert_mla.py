"""benchmarks/convert_mla.py's experiments of one source seed, training and measurement stubbed out: every model is
measured before fine-tuning, only the R = 32 conversions and the KVSplice insertions are fine-tuned (each length and
learning rate a run of its own), and what the resumed rows hold is neither trained nor measured again."""

from __future__ import annotations

import math
from pathlib import Path

from tiny_models import load_benchmark


def test_experiments_measure_each_model_and_fine_tune_and_skip_the_done(monkeypatch):
    m = load_benchmark("convert_mla")
    trained, measured = [], []
    monkeypatch.setattr(m, "source", lambda variant, config, seed, runs, threads: runs / f"{variant}-s{seed}.ckpt")
    monkeypatch.setattr(m, "to_mla", lambda src, out, args, threads: out)
    monkeypatch.setattr(m, "val_loss", lambda ckpt: measured.append(ckpt.name) or 1.0)
    monkeypatch.setattr(m, "train", lambda config, runs, name, *a: trained.append((config, runs.name, name)))
    monkeypatch.setattr(m, "last_val", lambda metrics: (0, 2.0, None, None))
    done = {("mha", 1, 0, None), ("convert r32 weights-only", 1, 5 * m.TOKENS_PER_STEP, "1e-3")}
    rows = list(m.experiments(1, Path("runs"), Path("work"), 1, done))
    before = [r for r in rows if r["ft_tokens"] == 0]
    assert [r["experiment"] for r in before][:3] == ["convert r8 weights-only", "convert r8 activation-aware",
                                                     "convert r16 weights-only"]  # mha: done
    assert len(before) == 10 + 1 + 4 and len(measured) == len(before)  # conversions, MLA-128, KVSplice x init
    tuned = [r for r in rows if r["ft_tokens"]]
    assert len(tuned) == len(trained) == 2 * 2 * 3 - 1 + 2 * 2 * 2  # R = 32 x method x LR x length, less the done
    assert {r["experiment"] for r in tuned if r["experiment"].startswith("convert")} == {
        "convert r32 weights-only", "convert r32 activation-aware"}
    assert ("small_mla_32", "ft", "mha-s1-r32-weights-only-ft25-lr2e-4") in trained
    assert ("small_mla_kvsplice_90", "ft", "mla-s1-ks90-random-ft50-lr1e-3") in trained
    assert all(r["val_loss"] == 2.0 and r["ft_tokens"] == r["ft_steps"] * m.TOKENS_PER_STEP for r in tuned)


def test_stat_rows_average_seeds_per_fine_tune_relative_to_each_source(monkeypatch):
    from benchmarks.lib import convert_mla_report as rep

    monkeypatch.setattr(rep, "frontier_ref", lambda variant: (4.4, 0.0, 3) if variant == "mla_32" else (0.0, 0.0, 0))
    rows = [{"experiment": "mha", "ft_tokens": 0, "val_loss": v} for v in (3.9, 4.1)]
    rows += [{"experiment": "convert r32 weights-only", "ft_tokens": 0, "val_loss": 4.2}]
    rows += [{"experiment": "convert r32 weights-only", "ft_tokens": 51200, "ft_lr": "2e-4", "val_loss": v}
             for v in (4.1, 4.3)]
    rows += [{"experiment": "mla_128", "ft_tokens": 0, "val_loss": 5.0}]
    got = [(r["part"], r["model"], r["ft_tokens"], r["ft_lr"], round(r["val_loss"], 4), r["n"],
            round(r["vs_source"], 4)) for r in rep.stat_rows(rows)]
    assert got == [("mha", "MHA source", 0, None, 4.0, 2, 1.0),
                   ("mha", "MLA-32 weights-only", 0, None, 4.2, 1, 1.05),
                   ("mha", "MLA-32 weights-only", 51200, "2e-4", 4.2, 2, 1.05),
                   ("mha", "MLA-32 from scratch (frontier)", 0, None, 4.4, 3, 1.1),
                   ("mla_128", "MLA-128 source", 0, None, 5.0, 1, 1.0)]
    assert math.isclose(rep.stat_rows(rows)[2]["std"], 0.1414, abs_tol=1e-4)
    assert rep.stat_rows(rows)[2]["ft_share"] == 51200 / (rep.STEPS_SOURCE * rep.TOKENS_PER_STEP)
