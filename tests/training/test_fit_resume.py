"""Resuming ``python -m training.fit`` (``--ckpt_path``) and starting it from weights (``--model.init_from``).

Exact resume. The training loader follows Lightning's stateful-dataloader protocol
(``state_dict`` / ``load_state_dict``, stored in every checkpoint), so an interrupted and resumed run trains on the same
batches as an uninterrupted one: the final validation loss (and the weights) match bit for bit, ``metrics.csv`` has
every step exactly once, killed checkpoint writes leave no temporary files, and the resumed run continues the same W&B
run id (whatever second each part starts in).

Hostile inputs: a checkpoint to resume from or to start from whose weights hold NaN, have the wrong
dtype or names, of another architecture, or truncated, is refused with one line naming it, exit 2, nothing
overwritten.
"""

from __future__ import annotations

import csv
import math
import importlib.util
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import lightning.pytorch  # noqa: F401  (Lightning's log handler binds to the session's stderr, not one test's capture)
import pytest
import torch
from torch.utils.data import Dataset

from data.sampler import EpochSampler, ResumableDataLoader
from hostile import edit_ckpt, one_error, snapshot, tiny_ckpt
from training.lit import LitGPT
from training.checkpoint import GPT_CONFIG_KEY, atomic_save, load_checkpoint, remove_stale_temp_files
from training.fit import PROG, main
from tiny_models import TINY_FIT_ARGS as TINY

REPO = Path(__file__).resolve().parents[2]
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


class _FrozenClock:
    """``time`` for W&B's run start: every run starts at the same second (as a fast machine's first run and its
    resume do), so W&B names the resume's folder ``offline-run-<time>-<id>-1``; everything else is the real module."""

    def __getattr__(self, name: str):
        return getattr(time, name)

    @staticmethod
    def time() -> float:
        return 1_700_000_000.0


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="needs wandb (a declared dependency)")
def test_resume_continues_the_wandb_run(tmp_path, data_cache, monkeypatch):
    """The resume logs to the same W&B run id: each offline run folder holds that run's ``run-<id>.wandb`` log,
    whatever the folder is named (``offline-run-<start second>-<id>``, plus ``-1`` when two parts start within one
    second: forced here, it happened on fast machines)."""
    import wandb.sdk.wandb_init

    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setattr(wandb.sdk.wandb_init, "time", _FrozenClock())
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
    assert len(offline_runs) == 2, offline_runs
    assert all(sorted(f.name for f in p.glob("*.wandb")) == [f"run-{run_id}.wandb"] for p in offline_runs)
    assert main([*common, "--trainer.max_steps", "2"]) == 0  # a new run (NAME-v1) gets a new id
    new_id = (runs / "tiny_gpt2-v1" / "wandb_id.txt").read_text().strip()
    assert new_id != run_id
    assert [f.name for f in (runs / "tiny_gpt2-v1" / "wandb").glob("offline-run-*/*.wandb")] == [f"run-{new_id}.wandb"]


# ------------------------------------------------------------------------------------------------ SIGKILL, slow
_KILL_DRIVER = r"""
import os, signal, sys
sys.path.insert(0, os.getcwd())  # the repository (the tests run it from there)
import torch
mode, step = sys.argv[1], int(sys.argv[2])
from training.lit import LitGPT
import models.checkpoint as ckpt  # where atomic_save (torch.save + os.replace) lives

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
            out = open(f, "wb") if isinstance(f, (str, os.PathLike)) else f  # atomic_save passes the temp path
            out.write(b"partial checkpoint bytes")
            out.flush()
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
    rc = main(["--config", "tiny_gpt2", *TINY, "--data.cache_dir", str(data_cache), "--wandb.mode", "disabled",
              "--trainer.max_steps", "2", "--runs_dir", str(runs), "--model.init_from", str(bad)])
    line = one_error(rc, capsys.readouterr().err, PROG, f"tensor {w} {expect}")
    assert "model.init_from" in line and str(bad) in line
    assert not runs.exists()


# ------------------------------------------------------------------------------------------------ refused resumes
@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, data_cache) -> Path:
    """A finished 2-step tiny_gpt2 run folder (copied by each test that edits it)."""
    runs = tmp_path_factory.mktemp("finished") / "runs"
    with pytest.MonkeyPatch.context() as mp:
        for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
            mp.setenv(var, "1")
        assert main(["--config", "tiny_gpt2", *TINY, "--runs_dir", str(runs), "--data.cache_dir", str(data_cache),
                     "--wandb.mode", "disabled", "--trainer.max_steps", "2", "--trainer.val_check_interval", "2",
                     "--model.warmup_steps", "1"]) == 0
    return runs / "tiny_gpt2"


W0 = "model.transformer.h.0.attn.c_attn.weight"


def _nan_weight(ckpt: dict) -> None:
    ckpt["state_dict"][W0] = torch.full_like(ckpt["state_dict"][W0], float("nan"))


def _nan_moment(ckpt: dict) -> None:
    state = ckpt["optimizer_states"][0]["state"][0]
    state["exp_avg_sq"] = torch.full_like(state["exp_avg_sq"], float("nan"))


def _renamed_weight(ckpt: dict) -> None:
    ckpt["state_dict"]["model.transformer.h.0.attn.c_attn.weight_old"] = ckpt["state_dict"].pop(W0)


def _other_groups(ckpt: dict) -> None:  # as a run with --model.splice_lr_mult != 1 groups its parameters
    groups = ckpt["optimizer_states"][0]["param_groups"]
    groups.append({**groups[0], "params": groups[0]["params"][-2:], "name": "splice_decay"})
    groups[0]["params"] = groups[0]["params"][:-2]


def _int_weight(ckpt: dict) -> None:
    ckpt["state_dict"][W0] = ckpt["state_dict"][W0].to(torch.int32)


@pytest.mark.parametrize("edit, expect", [
    (_nan_weight, f"tensor {W0} holds 12288 NaN/inf values"),
    (_nan_moment, "tensor optimizer_states[0].state[0].exp_avg_sq holds"),
    (_renamed_weight, f"weights are not this model's: it lacks {W0}"),
    (_int_weight, f"tensor {W0} has dtype int32"),
    (_other_groups, "cannot resume: optimizer groups decay(8), no_decay(18), splice_decay(2) in the checkpoint, "
                    "decay(10), no_decay(18) with these options (give the --model.splice_lr_mult it was trained with)"),
    ("truncated", "not a valid PyTorch checkpoint"),
    ("mla", "cannot resume: the checkpoint's model differs from the configured one"),
    ("weights-only", "holds no training state ('pytorch-lightning_version' missing"),
], ids=["nan-weight", "nan-adam-moment", "renamed-weight", "int-weight", "other-optimizer-groups", "truncated",
        "another-architecture", "weights-only"])
def test_a_bad_checkpoint_is_never_resumed(finished_run, tmp_path, data_cache, offline, capsys, edit, expect):
    """``--ckpt_path last`` of a checkpoint holding NaN trained on NaN and overwrote ``last.ckpt``; a checkpoint whose
    weights are another model's, or whose optimizer groups differ, was a traceback. Each is one line naming the file,
    exit 2, and the run folder is unchanged (byte for byte)."""
    import shutil

    run = tmp_path / "runs" / "tiny_gpt2"
    shutil.copytree(finished_run, run)
    last = run / "last.ckpt"
    if edit == "truncated":
        last.write_bytes(last.read_bytes()[: last.stat().st_size // 2])
    elif edit in ("mla", "weights-only"):  # an MLA model's weights + config in place of the GPT-2 ones
        mla = load_checkpoint(tiny_ckpt(tmp_path / "mla.ckpt", data_cache, attention="mla"))
        ck = load_checkpoint(last) if edit == "mla" else {}  # weights-only: as save_model / kvsplice to-mla write
        ck.update({k: v for k, v in mla.items() if k not in ck or k in ("state_dict", GPT_CONFIG_KEY)})
        atomic_save(ck, last)
    else:
        ck = load_checkpoint(last)
        edit(ck)
        atomic_save(ck, last)
    before = snapshot(run.parent)
    capsys.readouterr()
    rc = main(["--config", "tiny_gpt2", *TINY, "--runs_dir", str(run.parent), "--data.cache_dir", str(data_cache),
               "--wandb.mode", "disabled", "--trainer.max_steps", "4", "--trainer.val_check_interval", "2",
               "--model.warmup_steps", "1", "--ckpt_path", "last"])
    line = one_error(rc, capsys.readouterr().err, PROG, expect)
    assert str(last) in line
    assert snapshot(run.parent) == before


# ------------------------------------------------------------------------------------------------ earlier formats
def test_a_checkpoint_of_the_earlier_format_resumes_starts_and_loads(tmp_path, data_cache, monkeypatch, capsys):
    """A checkpoint written before the kept fraction was renamed (``kvsplice_ratio`` in its ``gpt_config`` and in
    LitGPT's flat hyper-parameters) still resumes (``--ckpt_path``), starts a new run (``--model.init_from``) and
    loads (``LitGPT.load_from_checkpoint``, ``load_gpt_checkpoint``) as the same KVSplice-50 model."""
    from models.checkpoint import load_gpt_checkpoint

    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    runs = tmp_path / "runs"
    common = ["--config", "tiny_mla_kvsplice_50", *TINY, "--runs_dir", str(runs), "--data.cache_dir",
              str(data_cache), "--wandb.mode", "disabled", "--model.warmup_steps", "1",
              "--trainer.val_check_interval", "2"]
    assert main([*common, "--trainer.max_steps", "2"]) == 0, capsys.readouterr().err[-3000:]
    last = runs / "tiny_mla_kvsplice_50" / "last.ckpt"
    ckpt = load_checkpoint(last)
    for d in (ckpt["hyper_parameters"], ckpt[GPT_CONFIG_KEY]):
        assert d["kvsplice_keep"] == 0.5
        d["kvsplice_ratio"] = d.pop("kvsplice_keep")  # the earlier format
    atomic_save(ckpt, last)
    old = tmp_path / "old.ckpt"
    atomic_save(ckpt, old)

    model, cfg, _ = load_gpt_checkpoint(old)
    assert cfg.kvsplice_keep == 0.5 and cfg.variant == "mla_kvsplice_50"
    lit = LitGPT.load_from_checkpoint(old, weights_only=True)
    assert lit.config == cfg and all(torch.equal(a, b) for a, b in zip(lit.model.state_dict().values(),
                                                                        model.state_dict().values()))
    capsys.readouterr()
    assert main([*common, "--trainer.max_steps", "4", "--ckpt_path", "last"]) == 0, capsys.readouterr().err[-3000:]
    assert load_checkpoint(last)["global_step"] == 4
    assert main([*common, "--trainer.max_steps", "2", "--run_name", "ft", "--model.init_from", str(old)]) == 0, \
        capsys.readouterr().err[-3000:]
    assert load_gpt_checkpoint(runs / "ft" / "last.ckpt")[1] == cfg
