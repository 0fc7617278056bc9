"""Refusals come before start-up noise: a pickled checkpoint given to ``kvsplice train --ckpt_path`` (or named by
``ckpt_path:`` / ``model.init_from:`` in a ``--config`` file) or ``kvsplice distill --ckpt-path``, and a bad
``--model.*`` / ``--data.*`` / ``--trainer.*`` value, is refused in the command's first and only line (they came
after Lightning's ``Seed set`` line and the run's notes), and nothing is loaded or built before it. Run as processes: every line the command prints
counts, whatever logging handlers Lightning bound earlier."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hostile import REPO, STORIES260K, one_error
from tiny_models import TINY_FIT_ARGS

pytestmark = pytest.mark.timeout(300)


class _Evil:
    def __reduce__(self):
        return os.system, ("echo pwned",)


def _run(tmp_path: Path, module: str, *args) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], capture_output=True, text=True, cwd=tmp_path,
                          env=env, timeout=280)


@pytest.fixture
def evil(tmp_path) -> Path:
    p = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {}, "payload": _Evil()}, p)
    return p


def test_train_refuses_a_pickle_before_lightning_starts(tmp_path, evil):
    r = _run(tmp_path, "training.fit", "--config", "tiny_gpt2", *TINY_FIT_ARGS, "--runs_dir", tmp_path / "runs",
             "--data.cache_dir", tmp_path / "cache", "--wandb.mode", "disabled", "--ckpt_path", evil)
    one_error(r.returncode, r.stderr + r.stdout, "kvsplice train", "refusing to load")
    assert "pwned" not in r.stdout and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("bad, expect", [
    (["--model.n_layer", "0"], "model.n_layer must be an integer >= 1"),
    (["--trainer.devices", "0"], "trainer:"),
])
def test_train_refuses_a_bad_value_in_its_first_line(tmp_path, bad, expect):
    r = _run(tmp_path, "training.fit", "--config", "tiny_gpt2", *TINY_FIT_ARGS, "--runs_dir", tmp_path / "runs",
             "--data.cache_dir", tmp_path / "cache", "--wandb.mode", "disabled", "--trainer.max_steps", "2",
             "--trainer.accelerator", "cpu", *bad)
    err = r.stderr + r.stdout
    assert err.lstrip().startswith("kvsplice train: error: "), err  # not after "Seed set" or a note
    one_error(r.returncode, err, "kvsplice train", expect)
    assert not (tmp_path / "runs").exists()


def test_train_refuses_a_pickle_named_in_a_config_file(tmp_path, evil):
    key = "ckpt_path"
    cfg = tmp_path / "resume.yaml"
    cfg.write_text(f"ckpt_path: {evil}\n")
    r = _run(tmp_path, "training.fit", "--config", "tiny_gpt2", "--config", cfg, *TINY_FIT_ARGS, "--runs_dir",
             tmp_path / "runs", "--data.cache_dir", tmp_path / "cache", "--wandb.mode", "disabled")
    err = r.stderr + r.stdout
    assert err.lstrip().startswith(f"kvsplice train: error: {key} (in the --config file)"), err
    one_error(r.returncode, err, "kvsplice train", "refusing to load")
    assert "pwned" not in r.stdout and not (tmp_path / "runs").exists()


def test_distill_refuses_a_pickle_before_loading_anything(tmp_path, evil):
    if not (STORIES260K / "stories260K.bin").is_file():
        pytest.skip("stories260K not found")
    from kvsplice.convert.llama2c import convert_llama2c

    model = convert_llama2c(STORIES260K / "stories260K.bin", STORIES260K / "tok512.bin", tmp_path / "m")
    text = tmp_path / "t.txt"
    text.write_text("Once upon a time there was a cat. " * 200)
    r = _run(tmp_path, "training.distill", "--model", model, "--data", text, "--loss", "lm", "--runs-dir",
             tmp_path / "runs", "--ckpt-path", evil, "--no-progress")
    one_error(r.returncode, r.stderr + r.stdout, "kvsplice distill", "refusing to load")
    assert "pwned" not in r.stdout and not (tmp_path / "runs").exists()
