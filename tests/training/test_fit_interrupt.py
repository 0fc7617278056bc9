"""Ctrl-C during ``python -m training.fit``, and runs that never start.

* Ctrl-C is one ``kvsplice train: interrupted`` line and exit status 130 (Lightning answered a KeyboardInterrupt with
  its own shutdown lines and ``sys.exit(1)``), before the first step as after it; SIGINT has its handler back after.
* A run that never took a training step (interrupted before it, or refused: a pickle given to ``--ckpt_path``) leaves
  no run folder (it left an ``-vN`` folder holding only W&B's start-up files).

The SIGINT is real and goes to the main thread (``signal.pthread_kill``), where Python runs signal handlers, from a
hook that runs on the main thread: the handler runs before ``pthread_kill`` returns, whatever the machine's load or
the threads torch started. The subprocess test waits on a handshake file instead of a time.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import lightning.pytorch  # noqa: F401  (Lightning's log handler binds to the session's stderr, not one test's capture)
import pytest
import torch

from tiny_models import TINY_FIT_ARGS
from training.fit import PROG, main
from training.lit import LitGPT

REPO = Path(__file__).resolve().parents[2]
HAVE_WANDB = importlib.util.find_spec("wandb") is not None
WANDB = [] if HAVE_WANDB else ["--wandb.mode", "disabled"]  # W&B (offline) writes into the folder at start-up
INTERRUPTED = f"{PROG}: interrupted"


def ctrl_c() -> None:
    """A real SIGINT to the main thread; called on the main thread, its handler has run when this returns."""
    assert threading.current_thread() is threading.main_thread()
    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)


@pytest.fixture
def runs(tmp_path, monkeypatch):
    """A runs folder whose ``tiny_gpt2`` holds an earlier run, so a new run goes to ``tiny_gpt2-v1``."""
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    runs = tmp_path / "runs"
    (runs / "tiny_gpt2").mkdir(parents=True)
    (runs / "tiny_gpt2" / "earlier.txt").write_text("an earlier run\n")
    return runs


def fit(runs: Path, data_cache: Path, *extra: str) -> int:
    return main(["--config", "tiny_gpt2", *TINY_FIT_ARGS, "--trainer.max_steps", "4", "--runs_dir", str(runs),
                 "--data.cache_dir", str(data_cache), *extra])


def assert_one_interrupted_line(rc: int, err: str) -> None:
    assert rc == 130, err[-3000:]
    assert err.rstrip("\n").splitlines()[-1] == INTERRUPTED and err.count("interrupted") == 1, err[-3000:]
    assert "KeyboardInterrupt" not in err and "Traceback" not in err and "shutdown" not in err, err[-3000:]


def stop_at_data_setup(monkeypatch) -> None:
    from data import TinyStoriesDataModule

    monkeypatch.setattr(TinyStoriesDataModule, "setup", lambda self, stage=None: ctrl_c())


def stop_at_train_start(monkeypatch) -> None:
    monkeypatch.setattr(LitGPT, "on_train_start", lambda self: ctrl_c())


def raise_at_train_start(monkeypatch) -> None:  # a KeyboardInterrupt raised by code, not by a signal
    def interrupt(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(LitGPT, "on_train_start", interrupt)


@pytest.mark.parametrize("stop", [stop_at_data_setup, stop_at_train_start, raise_at_train_start])
def test_ctrl_c_before_the_first_step_is_one_line_and_leaves_no_run_folder(stop, runs, data_cache, monkeypatch,
                                                                          capsys):
    stop(monkeypatch)
    rc = fit(runs, data_cache, *WANDB)
    assert_one_interrupted_line(rc, capsys.readouterr().err)
    assert sorted(os.listdir(runs)) == ["tiny_gpt2"]  # no tiny_gpt2-v1
    assert os.listdir(runs / "tiny_gpt2") == ["earlier.txt"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # Lightning had left SIG_IGN


def test_ctrl_c_after_steps_is_one_line_and_keeps_the_run(runs, data_cache, monkeypatch, capsys):
    """Two optimizer steps taken: the run's folder (its config and metrics) stays, its lock does not."""
    orig = LitGPT.on_train_batch_end

    def hook(self, *args):
        orig(self, *args)
        if self.trainer.global_step == 2:
            ctrl_c()

    monkeypatch.setattr(LitGPT, "on_train_batch_end", hook)
    rc = fit(runs, data_cache, "--wandb.mode", "disabled")
    assert_one_interrupted_line(rc, capsys.readouterr().err)
    run = runs / "tiny_gpt2-v1"
    assert (run / "config.yaml").is_file() and (run / "metrics.csv").is_file() and not (run / ".run.lock").exists()
    assert not list(run.glob("*.ckpt"))  # interrupted before its first checkpoint, as configured
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


class _Evil:
    def __reduce__(self):
        return os.system, ("echo pwned",)


def test_a_refused_pickle_for_ckpt_path_leaves_no_run_folder(runs, data_cache, tmp_path, capsys):
    evil = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {}, "payload": _Evil()}, evil)
    rc = fit(runs, data_cache, *WANDB, "--ckpt_path", str(evil))
    err = capsys.readouterr().err
    assert rc == 2 and err.rstrip("\n").splitlines()[-1].startswith(f"{PROG}: error: ") and "refusing" in err, err
    assert sorted(os.listdir(runs)) == ["tiny_gpt2"]  # no tiny_gpt2-v1


_DRIVER = """
import runpy, sys, time
from pathlib import Path
from training.lit import LitGPT

handshake = Path(sys.argv.pop(1))
orig = LitGPT.on_train_batch_end

def hook(self, *args):
    orig(self, *args)
    if self.trainer.global_step == 2:  # training is under way: say so, then wait for Ctrl-C
        handshake.write_text("step 2")
        while True:
            time.sleep(0.01)

LitGPT.on_train_batch_end = hook
sys.argv[0] = "training.fit"
runpy.run_module("training.fit", run_name="__main__", alter_sys=True)
"""


def test_ctrl_c_to_the_training_process_is_one_line_and_exit_130(tmp_path, data_cache):
    """``python -m training.fit`` as a user runs it, sent SIGINT once it has trained two steps (it says so in a
    handshake file and waits): exit 130, ``kvsplice train: interrupted`` last, no Lightning shutdown lines."""
    handshake = tmp_path / "handshake"
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled",
           "PYTHONWARNINGS": "ignore"}
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with open(out, "w") as o, open(err, "w") as e:  # files, not pipes: a full pipe would stall the child
        proc = subprocess.Popen([sys.executable, "-c", _DRIVER, str(handshake), "--config", "tiny_gpt2",
                                 *TINY_FIT_ARGS, "--trainer.max_steps", "6", "--runs_dir", str(tmp_path / "runs"),
                                 "--data.cache_dir", str(data_cache), "--wandb.mode", "disabled"],
                                cwd=REPO, env=env, stdout=o, stderr=e, text=True)
        try:
            while not handshake.exists():  # bounded by the process: it ends (a failure) or writes the file
                if proc.poll() is not None:
                    pytest.fail(f"training ended before step 2: {err.read_text()[-3000:]}")
                threading.Event().wait(0.05)
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=600)
        finally:
            proc.kill()
    assert_one_interrupted_line(proc.returncode, err.read_text())
    assert "Detected KeyboardInterrupt" not in out.read_text()
