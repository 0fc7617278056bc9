"""Issue 14, item 2: exact resume.

The training loader follows Lightning's stateful-dataloader protocol (``state_dict`` / ``load_state_dict``, stored in
every checkpoint), so an interrupted and resumed run trains on the same batches as an uninterrupted one: the final
validation loss (and the weights) match bit for bit, ``metrics.csv`` has every step exactly once, killed checkpoint
writes leave no temporary files, and the resumed run continues the same W&B run id.
"""

from __future__ import annotations

import csv
import math
import importlib.util
import os
import random
import subprocess
import sys
from pathlib import Path

import lightning.pytorch  # noqa: F401  (Lightning's log handler binds to the session's stderr, not one test's capture)
import pytest
import torch
from torch.utils.data import Dataset

from data.shards import EpochSampler, ResumableDataLoader
from training.lit import LitGPT
from training.checkpoint import atomic_save, load_checkpoint, remove_stale_temp_files
from training.fit import main
from tiny_models import TINY_FIT_ARGS as TINY

REPO = Path(__file__).resolve().parents[1]
#: Columns that depend on wall time, not on the computation.
TIMING = {"tokens_per_sec", "train_time_s"}


def read_rows(run: Path) -> list[dict[str, str]]:
    with open(run / "metrics.csv", newline="") as f:
        return [{k: v for k, v in r.items() if k not in TIMING} for r in csv.DictReader(f)]


def val_losses(run: Path) -> list[tuple[int, float]]:
    return [(int(r["step"]), float(r["val_loss"])) for r in read_rows(run) if r.get("val_loss")]


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


# ------------------------------------------------------------------------------------------------ the loader itself
class Draws(Dataset):
    """Item ``i`` is ``(i,)``: any draw id is valid, as in :class:`data.shards.RandomBlocks`."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> tuple[torch.Tensor]:
        return (torch.tensor(i),)


def test_loader_state_resumes_the_same_batches():
    ds = Draws()
    sampler = EpochSampler(40)
    loader = ResumableDataLoader(ds, batch_size=4, sampler=sampler)
    sampler.set_epoch(2)
    full = [b[0].tolist() for b in loader]
    it = iter(loader)
    seen = [next(it)[0].tolist() for _ in range(3)]
    state = loader.state_dict()
    assert state == {"epoch": 2, "samples": 12, "num_replicas": 1} and seen == full[:3]

    fresh_sampler = EpochSampler(40)
    fresh = ResumableDataLoader(ds, batch_size=4, sampler=fresh_sampler)
    fresh.load_state_dict(state)
    fresh_sampler.set_epoch(2)  # what Lightning does before the epoch's first batch
    assert [b[0].tolist() for b in fresh] == full[3:]
    fresh_sampler.set_epoch(3)  # the skip applies once; the next epoch is whole
    assert len([b for b in fresh]) == 10

    # a finished epoch resumes at the start of the next one
    done = ResumableDataLoader(ds, batch_size=4, sampler=EpochSampler(40))
    done.load_state_dict({"epoch": 2, "samples": 40, "num_replicas": 1})
    done.sampler.set_epoch(3)
    assert next(iter(done))[0].tolist() == [120, 121, 122, 123]


def test_epoch_sampler_shards_like_lightnings_ddp_wrapper_and_skips_per_rank():
    from lightning.fabric.utilities.distributed import DistributedSamplerWrapper

    for n, world in ((10, 2), (11, 3), (2, 4)):
        for rank in range(world):
            ours = EpochSampler(n, num_replicas=world, rank=rank)
            theirs = DistributedSamplerWrapper(EpochSampler(n), num_replicas=world, rank=rank, shuffle=False)
            ours.set_epoch(3)
            theirs.set_epoch(3)
            assert list(ours) == list(theirs) and len(ours) == len(theirs)
            ours.skip_next(1)
            assert list(ours) == list(theirs)[1:]


def test_atomic_save_and_stale_temp_cleanup(tmp_path):
    target = tmp_path / "last.ckpt"
    atomic_save({"a": torch.ones(2)}, target)
    assert torch.equal(load_checkpoint(target)["a"], torch.ones(2))
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]
    stale = tmp_path / f".last.ckpt.{dead_pid()}.tmp"
    stale.write_bytes(b"half a checkpoint")
    live = tmp_path / f".best.ckpt.{os.getppid()}.tmp"  # a live process's write in progress is left alone
    live.write_bytes(b"x")
    assert remove_stale_temp_files(tmp_path) == [stale]
    assert live.exists() and target.exists()


# ------------------------------------------------------------------------------------------------ CLI runs
class Crash(Exception):
    """Stands in for a crash in the middle of training."""


def test_interrupted_run_resumes_exactly(tmp_path, data_cache, offline, monkeypatch):
    """Uninterrupted vs crashed at step 13 (after the checkpoint of step 10, with metrics of steps 10-12 flushed by the
    crash) + a stale temp file of a killed checkpoint write + resume: identical validation losses (to 1e-6: here
    bit-identical), identical final weights, every metric row once, no temp file left."""
    runs = tmp_path / "runs"
    common = ["--config", "tiny_mla_kvsplice_70", *TINY, "--runs_dir", str(runs), "--data.cache_dir",
              str(data_cache), "--wandb.mode", "disabled", "--trainer.max_steps", "20",
              "--trainer.val_check_interval", "5", "--model.warmup_steps", "3"]
    assert main([*common, "--run_name", "full"]) == 0

    original = LitGPT.on_train_batch_end

    def crash_at_13(self, outputs, batch, batch_idx):
        original(self, outputs, batch, batch_idx)
        if self.trainer.global_step == 13:
            raise Crash("simulated crash")

    monkeypatch.setattr(LitGPT, "on_train_batch_end", crash_at_13)
    with pytest.raises(Crash):
        main([*common, "--run_name", "cut"])
    monkeypatch.setattr(LitGPT, "on_train_batch_end", original)
    cut = runs / "cut"
    assert load_checkpoint(cut / "last.ckpt")["global_step"] == 10
    assert max(int(r["step"]) for r in read_rows(cut)) == 11  # rows after the checkpoint (step 10) reached the file
    (cut / f".last.ckpt.{dead_pid()}.tmp").write_bytes(b"a checkpoint write killed half way")

    assert main([*common, "--run_name", "cut", "--ckpt_path", "last"]) == 0
    full = runs / "full"
    a, b = val_losses(full), val_losses(cut)
    assert [s for s, _ in a] == [s for s, _ in b] == [4, 9, 14, 19]
    for (_, x), (_, y) in zip(a, b):
        assert abs(x - y) <= 1e-6, (a, b)
    assert read_rows(cut) == read_rows(full)  # every step once, same losses, lr, tokens
    ka, kb = load_checkpoint(full / "last.ckpt"), load_checkpoint(cut / "last.ckpt")
    for k, v in ka["state_dict"].items():
        assert torch.equal(v, kb["state_dict"][k]), k
    assert kb["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [{"epoch": 0, "samples": 160,
                                                                        "num_replicas": 1}]
    assert not [p for p in cut.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="needs wandb (a declared dependency)")
def test_resume_continues_the_wandb_run(tmp_path, data_cache, monkeypatch):
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    monkeypatch.setenv("WANDB_MODE", "offline")
    runs = tmp_path / "runs"
    common = ["--config", "tiny_gpt2", *TINY, "--runs_dir", str(runs), "--data.cache_dir", str(data_cache),
              "--wandb.mode", "offline", "--trainer.val_check_interval", "2", "--model.warmup_steps", "1"]
    assert main([*common, "--trainer.max_steps", "2"]) == 0
    run = runs / "tiny_gpt2"
    run_id = (run / "wandb_id.txt").read_text().strip()
    assert len(run_id) == 8
    assert main([*common, "--trainer.max_steps", "4", "--ckpt_path", "last"]) == 0
    assert (run / "wandb_id.txt").read_text().strip() == run_id
    offline_runs = sorted((run / "wandb").glob("offline-run-*"))
    assert len(offline_runs) == 2 and all(p.name.endswith(f"-{run_id}") for p in offline_runs)
    assert main([*common, "--trainer.max_steps", "2"]) == 0  # a new run (NAME-v1) gets a new id
    assert (runs / "tiny_gpt2-v1" / "wandb_id.txt").read_text().strip() != run_id


# ------------------------------------------------------------------------------------------------ SIGKILL, slow
_KILL_DRIVER = r"""
import os, signal, sys
sys.path.insert(0, os.getcwd())  # the repository (the tests run it from there)
import torch
mode, step = sys.argv[1], int(sys.argv[2])
from training.lit import LitGPT
import training.checkpoint as ckpt

def die():
    os.kill(os.getpid(), signal.SIGKILL)

if mode in ("step", "group"):  # right after optimizer step `step` (group: every DDP process at once)
    orig = LitGPT.on_train_batch_end
    def hook(self, *a):
        orig(self, *a)
        if self.trainer.global_step == step:
            os.killpg(0, signal.SIGKILL) if mode == "group" else die()
    LitGPT.on_train_batch_end = hook
else:  # during the checkpoint write at `step`: mid torch.save ("write") or before the rename ("rename")
    real_save, real_replace = torch.save, os.replace
    def save(obj, f, *a, **k):
        if isinstance(obj, dict) and obj.get("global_step") == step and mode == "write":
            f.write(b"partial checkpoint bytes")
            f.flush()
            die()
        return real_save(obj, f, *a, **k)
    def replace(src, dst):
        if mode == "rename" and str(dst).endswith(".ckpt") and ".tmp" in str(src):
            if torch.load(src, weights_only=True).get("global_step") == step:
                die()
        return real_replace(src, dst)
    ckpt.torch.save = save
    ckpt.os.replace = replace
from training.fit import main
sys.exit(main(sys.argv[3:]))
"""


@pytest.mark.slow
def test_five_sigkills_then_resume_equals_uninterrupted(tmp_path, data_cache):
    """The issue's goal: SIGKILL a run at 5 random moments (incl. mid-checkpoint-write and between write and rename),
    resume each time; final validation loss equal to 1e-6, metrics.csv every step once, no temp files."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "WANDB_MODE": "disabled", "PYTHONWARNINGS": "ignore"}
    runs = tmp_path / "runs"
    common = ["--config", "tiny_mla_kvsplice_90", *TINY, "--runs_dir", str(runs), "--data.cache_dir",
              str(data_cache), "--wandb.mode", "disabled", "--trainer.max_steps", "40",
              "--trainer.val_check_interval", "4", "--model.warmup_steps", "4", "--torch_threads", "1"]

    driver = tmp_path / "kill_driver.py"
    driver.write_text(_KILL_DRIVER)

    def fit(*args: str, kill: tuple[str, int] | None = None) -> subprocess.CompletedProcess:
        cmd = [sys.executable, str(driver), *(map(str, kill) if kill else ("none", "0")), *common, *args]
        return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)

    done = fit("--run_name", "full")
    assert done.returncode == 0, done.stderr[-3000:]
    rng = random.Random(14)
    steps = sorted(rng.sample(range(2, 39), 5))
    kills = [("step", steps[0]), ("write", 4 * math.ceil(steps[1] / 4)), ("step", steps[2]),
             ("rename", 4 * math.ceil(steps[3] / 4)), ("step", steps[4])]
    first = True
    for mode, step in kills:
        proc = fit("--run_name", "cut", *(() if first else ("--ckpt_path", "last")), kill=(mode, step))
        assert proc.returncode == -9, (mode, step, proc.returncode, proc.stderr[-3000:])
        first = False
    proc = fit("--run_name", "cut", "--ckpt_path", "last")
    assert proc.returncode == 0, proc.stderr[-3000:]
    full, cut = runs / "full", runs / "cut"
    a, b = val_losses(full), val_losses(cut)
    assert [s for s, _ in a] == [s for s, _ in b]
    assert abs(a[-1][1] - b[-1][1]) <= 1e-6, (a[-1], b[-1])
    assert read_rows(cut) == read_rows(full)
    assert not [p for p in cut.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.slow
def test_ddp_two_processes_resume_exactly(tmp_path, data_cache):
    """Two CPU processes (DDP, gloo): the sampler shards each epoch between the ranks itself and every rank resumes at
    its own position, so a run killed (all processes) at step 10 and resumed equals the uninterrupted one."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "WANDB_MODE": "disabled", "PYTHONWARNINGS": "ignore"}
    runs = tmp_path / "runs"
    common = ["--config", "tiny_mla_kvsplice_90", *TINY, "--runs_dir", str(runs), "--data.cache_dir",
              str(data_cache), "--wandb.mode", "disabled", "--trainer.max_steps", "12",
              "--trainer.val_check_interval", "4", "--model.warmup_steps", "2", "--torch_threads", "1",
              "--trainer.devices", "2", "--trainer.strategy", "ddp"]

    driver = tmp_path / "kill_driver.py"  # a file: Lightning starts rank 1 by re-running the script
    driver.write_text(_KILL_DRIVER)

    def fit(*args: str, kill: int = 0) -> subprocess.CompletedProcess:
        cmd = [sys.executable, str(driver), "group" if kill else "none", str(kill), *common, *args]
        return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
                              start_new_session=True)  # its own process group: killpg takes both ranks only

    assert fit("--run_name", "full").returncode == 0
    assert fit("--run_name", "cut", kill=10).returncode == -9
    proc = fit("--run_name", "cut", "--ckpt_path", "last")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert read_rows(runs / "cut") == read_rows(runs / "full")
    assert [s for s, _ in val_losses(runs / "cut")] == [3, 7, 11]
