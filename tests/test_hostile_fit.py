"""Hostile inputs to ``python -m training.fit`` (issue 22): two runs started together with the same ``--run_name``
get one folder each (they shared one: every ``metrics.csv`` row twice, ``last-v1.ckpt``), a resume or
``--overwrite`` of a folder in use is refused, a read-only ``--runs_dir`` is one line (was 36 lines of traceback),
a refused run leaves no folder or lock behind, and ``--model.init_from`` checkpoints with NaN / integer weights are
refused naming the tensor."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import lightning.pytorch  # noqa: F401  (Lightning's log handler binds to the session's stderr, not one test's capture)
import pytest
import torch

from hostile import REPO, edit_ckpt, one_error, readonly_dir, tiny_ckpt  # noqa: F401
from tiny_models import TINY_FIT_ARGS as TINY
from training.fit import main as fit
from training.rundir import CLIConfigError


def steps(run: Path) -> list[int]:
    with open(run / "metrics.csv", newline="") as f:
        return [int(r["step"]) for r in csv.DictReader(f) if r.get("train_loss")]


def test_two_concurrent_runs_with_one_name_get_two_folders(tmp_path, data_cache):
    """Item 3, with two real processes started together."""
    from data import TinyStoriesDataModule

    TinyStoriesDataModule(synthetic=True, synthetic_stories=2000, synthetic_vocab_size=512,  # built once, here
                          cache_dir=str(data_cache)).tokenizer
    runs = tmp_path / "runs"
    cmd = [sys.executable, "-m", "training.fit", "--config", "tiny_gpt2", *TINY, "--runs_dir", str(runs),
           "--run_name", "same", "--data.cache_dir", str(data_cache), "--wandb.mode", "disabled",
           "--trainer.max_steps", "3", "--trainer.val_check_interval", "3", "--model.warmup_steps", "1",
           "--torch_threads", "1"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "PYTHONWARNINGS": "ignore",
           "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    errs = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errs
    assert sorted(p.name for p in runs.iterdir()) == ["same", "same-v1"]
    for run in (runs / "same", runs / "same-v1"):
        assert steps(run) == [0, 1, 2], run  # every step once
        assert sorted(p.name for p in run.glob("last*.ckpt")) == ["last.ckpt"] and not (run / ".run.lock").exists()
    assert sum(f"run directory: {runs / 'same'}" in e for e in errs) == 1
    assert sum(f"this run writes to {runs / 'same-v1'}" in e for e in errs) == 1


def test_a_folder_in_use_is_never_shared(tmp_path):
    from training.rundir import LOCK_FILE, take_run_dir

    runs = tmp_path / "runs"
    first = take_run_dir(runs, "exp", None, overwrite=False)  # a run in progress, nothing written yet
    assert first.run_dir == runs / "exp" and (runs / "exp" / LOCK_FILE).is_file()
    second = take_run_dir(runs, "exp", None, overwrite=False)
    assert second.run_dir == runs / "exp-v1"
    for ckpt_path, overwrite in (("last", False), (None, True), (str(runs / "exp" / "last.ckpt"), False)):
        with pytest.raises(CLIConfigError, match="is in use by another running training.fit"):
            take_run_dir(runs, "exp", ckpt_path, overwrite=overwrite)
    second.release()
    first.release()
    assert not runs.exists()  # the runs wrote nothing: their folders (and the runs/ first made) go with the locks
    # a killed run's lock file (no process holds it) does not make a folder busy
    (runs / "exp").mkdir(parents=True)
    (runs / "exp" / LOCK_FILE).write_text("")
    again = take_run_dir(runs, "exp", None, overwrite=False)
    assert again.run_dir == runs / "exp"
    (runs / "exp" / "metrics.csv").write_text("step\n")
    again.release()
    assert sorted(p.name for p in (runs / "exp").iterdir()) == ["metrics.csv"]


def test_ddp_processes_use_the_folder_rank_0_took(tmp_path, monkeypatch):
    from training.rundir import RUN_DIR_ENV, place_run

    monkeypatch.delenv(RUN_DIR_ENV, raising=False)
    runs = tmp_path / "runs"
    rank0 = place_run(runs, "ddp", None, overwrite=False)
    assert os.environ[RUN_DIR_ENV] == str(runs / "ddp")  # inherited by the processes Lightning launches
    monkeypatch.setenv("LOCAL_RANK", "1")
    rank1 = place_run(runs, "ddp", None, overwrite=False)  # the folder is locked by rank 0: still the same one
    assert rank1.run_dir == runs / "ddp" and rank1.lock_fd is None
    rank0.release()
    assert RUN_DIR_ENV not in os.environ


def test_refused_runs_write_nothing(tmp_path, data_cache, readonly_dir, offline, capsys):
    base = ["--config", "tiny_gpt2", *TINY, "--data.cache_dir", str(data_cache), "--wandb.mode", "disabled",
            "--trainer.max_steps", "2"]
    capsys.readouterr()
    rc = fit([*base, "--runs_dir", str(readonly_dir / "runs")])  # item 9
    one_error(rc, capsys.readouterr().err, "", "choose a writable --runs_dir")
    (tmp_path / "a_file").write_text("x")
    rc = fit([*base, "--runs_dir", str(tmp_path / "a_file" / "runs")])
    one_error(rc, capsys.readouterr().err, "", "cannot write the run directory")
    runs = tmp_path / "runs"
    rc = fit([*base, "--runs_dir", str(runs), "--data.val_fraction", "1.5"])  # refused after the folder was taken
    one_error(rc, capsys.readouterr().err, "", "data.val_fraction")
    assert not runs.exists()
    (tmp_path / "noise.txt").write_bytes(os.urandom(4096))  # refused inside trainer.fit (data setup)
    rc = fit([*base, "--runs_dir", str(runs), "--data.synthetic", "false", "--data.path", str(tmp_path / "noise.txt"),
              "--data.tokenizer_path", str(tmp_path / "noise.txt")])
    one_error(rc, capsys.readouterr().err, "", "noise.txt")
    assert not runs.exists()


@pytest.mark.parametrize("name, value, expect", [
    ("nan", torch.full((96, 32), float("nan")), "holds 3072 NaN/inf values"),
    ("int32", torch.ones(96, 32, dtype=torch.int32), "has dtype int32"),
])
def test_init_from_tensors_are_checked(tmp_path, data_cache, offline, capsys, name, value, expect):
    src = tiny_ckpt(tmp_path / "src.ckpt", data_cache)  # refused while loading, before its shapes are compared
    w = "model.transformer.h.0.attn.c_attn.weight"
    bad = edit_ckpt(src, tmp_path / f"{name}.ckpt", w, value)
    runs = tmp_path / "runs"
    capsys.readouterr()
    rc = fit(["--config", "tiny_gpt2", *TINY, "--data.cache_dir", str(data_cache), "--wandb.mode", "disabled",
              "--trainer.max_steps", "2", "--runs_dir", str(runs), "--model.init_from", str(bad)])
    line = one_error(rc, capsys.readouterr().err, "", f"tensor {w} {expect}")
    assert "model.init_from" in line and str(bad) in line
    assert not runs.exists()
