"""The run folder of ``python -m training.fit`` (:mod:`training.rundir`).

Re-using a run name never destroys an earlier run. A new run with an existing run name goes to
``NAME-v1`` (``-v2``...), ``--overwrite`` replaces the earlier run, a resume (``--ckpt_path``) continues the directory
without rewriting its ``config.yaml``, no config ever records ``ckpt_path``, and a failed resume writes nothing. Runs
are in-process (``training.fit.main``) with tiny shapes and a few steps.

Hostile inputs: two runs started together with the same ``--run_name`` get one folder each (they shared
one: every ``metrics.csv`` row twice, ``last-v1.ckpt``), a resume or ``--overwrite`` of a folder in use is refused, a
read-only ``--runs_dir`` is one line (was 36 lines of traceback), a refused run leaves no folder or lock behind.
"""

from __future__ import annotations

import csv
import hashlib
import os
import subprocess
import sys
from pathlib import Path

import lightning.pytorch  # noqa: F401  (Lightning's log handler binds to the session's stderr, not one test's capture)
import pytest
import yaml

from hostile import REPO, one_error, readonly_dir  # noqa: F401
from training.fit import PROG, main
from training.rundir import CLIConfigError, clear_run_files, next_free_run_dir, plan_run
from tiny_models import TINY_FIT_ARGS as TINY


def snapshot(folder: Path) -> dict[str, str]:
    """{relative path: sha256} of every file under ``folder``."""
    return {str(f.relative_to(folder)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(folder.rglob("*")) if f.is_file()}


def steps(run: Path, key: str) -> list[int]:
    with open(run / "metrics.csv", newline="") as f:
        return [int(r["step"]) for r in csv.DictReader(f) if r.get(key)]


def quick_start(runs: Path, cache: Path, *extra: str) -> list[str]:
    """The README's quick start (``--config tiny_mla_kvsplice_90``) on tiny shapes, 4 steps."""
    return ["--config", "tiny_mla_kvsplice_90", *TINY, "--runs_dir", str(runs), "--data.cache_dir", str(cache),
            "--wandb.mode", "disabled", "--trainer.max_steps", "4", "--trainer.val_check_interval", "2", *extra]


def test_quick_start_twice_keeps_both_runs_and_overwrite_replaces(tmp_path, data_cache, offline, capsys):
    runs = tmp_path / "checkpoints"
    assert main(quick_start(runs, data_cache)) == 0
    first_dir = runs / "tiny_mla_kvsplice_90"
    first = snapshot(first_dir)
    assert {"config.yaml", "metrics.csv", "last.ckpt"} <= set(first)
    assert steps(first_dir, "val_loss") == [1, 3]
    capsys.readouterr()

    assert main(quick_start(runs, data_cache)) == 0  # the same command again
    err = capsys.readouterr().err
    second_dir = runs / "tiny_mla_kvsplice_90-v1"
    assert f"this run writes to {second_dir}" in err and "--overwrite" in err
    assert snapshot(first_dir) == first, "the first run's files changed"
    assert steps(second_dir, "val_loss") == [1, 3]
    assert yaml.safe_load((second_dir / "config.yaml").read_text())["run_name"] == "tiny_mla_kvsplice_90-v1"

    # re-running the second run's saved config is a new run again (NAME-v2, not NAME-v1-v1)
    assert main(["--config", str(second_dir / "config.yaml"), "--data.cache_dir", str(data_cache)]) == 0
    assert (runs / "tiny_mla_kvsplice_90-v2" / "last.ckpt").is_file()
    second = snapshot(second_dir)

    # --overwrite replaces the first run (and only it)
    assert main(quick_start(runs, data_cache, "--overwrite", "--trainer.max_steps", "2")) == 0
    assert "--overwrite: replacing the earlier run" in capsys.readouterr().err
    saved = yaml.safe_load((first_dir / "config.yaml").read_text())
    assert saved["trainer"]["max_steps"] == 2 and saved["overwrite"] is False and "ckpt_path" not in saved
    assert steps(first_dir, "val_loss") == [1]
    assert snapshot(second_dir) == second
    assert sorted(p.name for p in runs.iterdir()) == ["tiny_mla_kvsplice_90", "tiny_mla_kvsplice_90-v1",
                                                     "tiny_mla_kvsplice_90-v2"]


def test_resume_keeps_config_and_failed_resume_writes_nothing(tmp_path, data_cache, offline, capsys):
    runs = tmp_path / "runs"
    run = runs / "tiny_mla_kvsplice_90"
    assert main(quick_start(runs, data_cache)) == 0
    config_before = (run / "config.yaml").read_bytes()
    assert "ckpt_path" not in yaml.safe_load(config_before)  # never recorded (null values are not written)

    # a failing resume (the checkpoint's model differs from the configured one): nothing is written
    before = snapshot(run)
    capsys.readouterr()
    assert main(quick_start(runs, data_cache, "--ckpt_path", "last", "--model.n_layer", "3")) == 2
    one_error(2, capsys.readouterr().err, PROG, f"--ckpt_path {run / 'last.ckpt'}: cannot resume")
    assert snapshot(run) == before
    corrupt = run / "broken.ckpt"
    corrupt.write_bytes(b"\x00 not a checkpoint")
    before = snapshot(run)
    assert main(quick_start(runs, data_cache, "--ckpt_path", str(corrupt))) == 2
    assert snapshot(run) == before
    corrupt.unlink()

    # a successful resume with a longer schedule: config.yaml untouched, the change recorded beside it
    assert main(quick_start(runs, data_cache, "--ckpt_path", "last", "--trainer.max_steps", "6")) == 0
    assert (run / "config.yaml").read_bytes() == config_before
    resumed = yaml.safe_load((run / "config.resume-4.yaml").read_text())
    assert resumed["trainer"]["max_steps"] == 6 and "ckpt_path" not in resumed
    assert steps(run, "val_loss") == [1, 3, 5]
    assert steps(run, "train_loss") == [0, 1, 2, 3, 4, 5]  # every step once
    # resuming again with the same options records nothing new
    assert main(quick_start(runs, data_cache, "--ckpt_path", "last", "--trainer.max_steps", "6")) == 0
    assert sorted(p.name for p in run.glob("config*.yaml")) == ["config.resume-4.yaml", "config.yaml"]


def test_plan_run_rules(tmp_path):
    runs = tmp_path / "runs"
    plan = plan_run(runs, "exp", None, overwrite=False)
    assert plan.run_dir == runs / "exp" and not plan.resume and plan.ckpt_path is None
    (runs / "exp").mkdir(parents=True)
    assert plan_run(runs, "exp", None, overwrite=False).run_dir == runs / "exp"  # empty folder: used as is
    (runs / "exp" / "metrics.csv").write_text("step\n")
    assert plan_run(runs, "exp", None, overwrite=False).run_dir == runs / "exp-v1"
    (runs / "exp-v1").mkdir()
    (runs / "exp-v1" / "config.yaml").write_text("x: 1\n")
    assert next_free_run_dir(runs, "exp") == runs / "exp-v2"
    assert next_free_run_dir(runs, "exp-v1") == runs / "exp-v2"
    over = plan_run(runs, "exp", None, overwrite=True)
    assert over.run_dir == runs / "exp" and over.clear

    # --ckpt_path last without a checkpoint starts from scratch in that folder (auto-resume loops)
    fresh = plan_run(runs, "exp", "last", overwrite=False)
    assert fresh.run_dir == runs / "exp" and fresh.ckpt_path is None and "from scratch" in fresh.notes[0]
    (runs / "exp" / "best-step=3-val_loss=1.0000.ckpt").write_bytes(b"x")
    with pytest.raises(CLIConfigError, match="no last.ckpt"):
        plan_run(runs, "exp", "last", overwrite=False)
    best = plan_run(runs, "exp", "best", overwrite=False)
    assert best.resume and best.ckpt_path.endswith("best-step=3-val_loss=1.0000.ckpt")
    (runs / "exp" / "last.ckpt").write_bytes(b"x")
    last = plan_run(runs, "exp", "last", overwrite=False)
    assert last.resume and last.run_dir == runs / "exp" and last.ckpt_path.endswith("last.ckpt")
    # a checkpoint of another run starts a new run from it
    other = plan_run(runs, "exp", str(tmp_path / "elsewhere" / "last.ckpt"), overwrite=False)
    assert not other.resume and other.run_dir == runs / "exp-v2"
    with pytest.raises(CLIConfigError, match="give only one"):
        plan_run(runs, "exp", "last", overwrite=True)
    with pytest.raises(CLIConfigError, match="no best"):
        plan_run(runs, "new", "best", overwrite=False)
    with pytest.raises(CLIConfigError, match="--run_name"):
        plan_run(runs, "../up", None, overwrite=False)
    (tmp_path / "file").write_text("x")
    with pytest.raises(CLIConfigError, match="--runs_dir"):
        plan_run(tmp_path / "file", "exp", None, overwrite=False)

    # --overwrite removes exactly the run's own files
    d = runs / "exp"
    (d / "wandb").mkdir()
    (d / "notes.txt").write_text("mine")
    clear_run_files(d)
    assert sorted(p.name for p in d.iterdir()) == ["notes.txt"]


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
        assert steps(run, "train_loss") == [0, 1, 2], run  # every step once
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
    rc = main([*base, "--runs_dir", str(readonly_dir / "runs")])  # item 9
    one_error(rc, capsys.readouterr().err, PROG, "choose a writable --runs_dir")
    (tmp_path / "a_file").write_text("x")
    rc = main([*base, "--runs_dir", str(tmp_path / "a_file" / "runs")])
    one_error(rc, capsys.readouterr().err, PROG, "cannot write the run directory")
    runs = tmp_path / "runs"
    rc = main([*base, "--runs_dir", str(runs), "--data.val_fraction", "1.5"])  # refused after the folder was taken
    one_error(rc, capsys.readouterr().err, PROG, "data.val_fraction")
    assert not runs.exists()
    (tmp_path / "noise.txt").write_bytes(os.urandom(4096))  # refused inside trainer.fit (data setup)
    rc = main([*base, "--runs_dir", str(runs), "--data.synthetic", "false", "--data.path", str(tmp_path / "noise.txt"),
              "--data.tokenizer_path", str(tmp_path / "noise.txt")])
    one_error(rc, capsys.readouterr().err, PROG, "noise.txt")
    assert not runs.exists()
