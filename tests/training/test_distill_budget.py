"""``kvsplice distill`` by default and by the clock, on a converted stories260K: without ``--data`` it trains on the
teacher's own text (generated once, then read from the cache), in mixed 256/512 windows (the model's positions);
``--minutes`` stops the run and writes the model, the snapshots and ``curve.csv``; a resume continues the clock;
``--trainable attention`` moves only the attention; ``--devices`` reaches the Trainer."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from test_distill import TRAIN, stories_pair
from training import distill
from training.distill_budget import time_lr_factor


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return stories_pair(tmp_path_factory.mktemp("budget"), 2048)


def rows(path: Path) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


def test_minutes_budget_on_self_text_snapshots_and_a_resume_that_keeps_the_clock(pair, capsys):
    src, mla, root = pair
    args = ["--model", mla, "--teacher", src, "--self-tokens", 3000, "--val-tokens", 600, "--cache-dir",
            root / "cache", "--val-every", 3, "--lr", 2e-3, "--runs-dir", root / "runs", "--run-name", "t",
            "--no-progress"]
    assert distill.main([str(a) for a in args + ["--minutes", 0.05, "--snapshot-minutes", 0.01, 0.05]]) == 0
    err = capsys.readouterr().err
    assert "self text: generated" in err and len(list((root / "cache").glob("self-*.safetensors"))) == 1
    run = root / "runs" / "t"
    assert (run / "model" / "config.json").is_file() and (run / "last.ckpt").is_file()
    assert (run / "model-0.01min" / "config.json").is_file()
    assert not (run / "model-0.05min").exists()  # a mark at the budget is model/ itself
    curve = rows(run / "curve.csv")
    first_end = float(curve[-1]["minutes"])
    assert curve and first_end >= 0.05 and all(r["val_kl"] for r in curve)
    steps = [int(r["step"]) for r in rows(run / "metrics.csv") if r.get("train_kl")]
    assert steps == list(range(len(steps)))
    # resume with a larger budget: the teacher's text comes from the cache, the clock and the curve continue
    assert distill.main([str(a) for a in args + ["--minutes", 0.08, "--ckpt-path", "last"]]) == 0
    err = capsys.readouterr().err
    assert "from the cache" in err and "generated" not in err
    curve2 = rows(run / "curve.csv")
    assert curve2[:len(curve)] == curve and len(curve2) > len(curve)
    assert first_end < float(curve2[len(curve)]["minutes"]) and 0.08 <= float(curve2[-1]["minutes"]) < 0.08 + 0.5
    more = [int(r["step"]) for r in rows(run / "metrics.csv") if r.get("train_kl")]
    assert more == list(range(len(more))) and len(more) > len(steps)  # every step once
    widths = {int(r["step"]): r for r in rows(run / "metrics.csv") if r.get("tokens")}
    assert float(widths[1]["tokens"]) - float(widths[0]["tokens"]) == 512  # 2 x 256, then 1 x 512: 512 a step


def test_trainable_attention_moves_only_the_attention(pair, capsys):
    from kvsplice.loading import load_model

    src, mla, root = pair
    args = ["--model", mla, "--teacher", src, "--data", TRAIN, "--seq-len", 64, "--batch-size", 2, "--max-steps", 2,
            "--val-tokens", 128, "--lr", 1e-2, "--trainable", "attention", "--runs-dir", root / "runs",
            "--run-name", "attn", "--no-progress"]
    assert distill.main([str(a) for a in args]) == 0, capsys.readouterr().err
    before = load_model(mla).model.state_dict()
    after = load_model(root / "runs" / "attn" / "model").model.state_dict()
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    assert moved and all(".attn." in k for k in moved)  # MLPs, norms, embedding and head as converted


def test_devices_reach_the_trainer_as_ddp(pair, monkeypatch, tmp_path, capsys):
    import lightning

    src, mla, _ = pair
    seen = {}

    class Stop(Exception):
        pass

    def fake_trainer(**kw):
        seen.update(kw)
        raise Stop

    monkeypatch.setattr(lightning, "Trainer", fake_trainer)
    with pytest.raises(Stop):
        distill.main([str(a) for a in ["--model", mla, "--teacher", src, "--data", TRAIN, "--seq-len", 64,
                                       "--max-steps", 1, "--val-tokens", 128, "--devices", 2, "--runs-dir",
                                       tmp_path, "--no-progress"]])
    assert seen["devices"] == 2 and seen["strategy"] == "ddp"


def test_the_time_schedule_warms_up_then_decays_over_the_budget():
    assert time_lr_factor(0, 0.0, 10, 0.1) == pytest.approx(0.1)
    assert time_lr_factor(9, 0.0, 10, 0.1) == pytest.approx(1.0)
    assert time_lr_factor(50, 0.5, 10, 0.1) == pytest.approx(0.55)
    assert time_lr_factor(50, 1.0, 10, 0.1) == pytest.approx(0.1) == time_lr_factor(99, 3.0, 10, 0.1)


@pytest.mark.slow
def test_two_ddp_processes_on_the_cpu_share_the_clock_and_the_steps(pair, tmp_path):
    """``--devices 2`` with gloo: both processes stop at rank 0's clock, every step counts both batches."""
    import os
    import subprocess
    import sys

    src, mla, root = pair
    cmd = [sys.executable, "-m", "training.distill", "--model", mla, "--teacher", src, "--data", TRAIN, "--seq-len", 64,
           128, "--batch-size", 2, "--minutes", 0.05, "--val-every", 2, "--val-tokens", 256, "--devices", 2,
           "--runs-dir", tmp_path, "--run-name", "ddp", "--no-progress", "--threads", 1]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    out = subprocess.run([str(a) for a in cmd], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    run = tmp_path / "ddp"
    assert (run / "model" / "config.json").is_file() and float(rows(run / "curve.csv")[-1]["minutes"]) >= 0.05
    tokens = [float(r["tokens"]) for r in rows(run / "metrics.csv") if r.get("tokens")]
    assert tokens[:2] == [2 * 128, 4 * 128]  # two processes x 128 tokens a step
