"""What the training-speed studies (``train_tiny_all.py``, ``fit_busy_machine.py``) measure: a ``training.fit`` run
as a user starts it, timed; a config's unigram entropy; each config's training step timed round-robin."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

from benchmarks.harness.header import machine
from benchmarks.harness.paths import ROOT
from benchmarks.harness.timing import wall_time

__all__ = ["fit_command", "interleaved_step_ms", "timed_fit", "unigram_entropy_of"]


def fit_command(config: str, *args: str) -> list[str]:
    """``python -m training.fit --config CONFIG ARGS`` without W&B or progress bar."""
    return [sys.executable, "-m", "training.fit", "--config", config, *args, "--wandb.mode", "disabled",
            "--trainer.enable_progress_bar", "false"]


def timed_fit(cmd: list[str], busy: bool = False) -> dict:
    """One run of ``cmd`` in the repository: wall seconds, the load average before and its ``note: torch threads``
    line; with ``busy`` beside a spinning child (``while True: pass``). A failure raises ``ValueError``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    try:
        if spinner is not None:
            time.sleep(1.0)  # the spinner holds its core before training starts
        load = machine()["load_average"]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines() or ["no output"]
        raise ValueError(f"training.fit exited {proc.returncode}: {lines[-1]}")
    notes = [line for line in proc.stderr.splitlines() if line.startswith("note: torch threads")]
    return {"wall_s": round(wall, 2), "loadavg_before": load, "threads_note": notes[0] if notes else None}


def unigram_entropy_of(config: Path, cache_dir: str | None) -> tuple[float, str, int]:
    """(unigram entropy, description, vocabulary size) of ``config``'s training data."""
    from data import TinyStoriesDataModule

    cfg = yaml.safe_load(config.read_text())
    d = {**cfg["data"], "block_size": cfg["model"]["block_size"]}
    if cache_dir:
        d["cache_dir"] = cache_dir
    dm = TinyStoriesDataModule(**d)
    dm.prepare_data()
    return dm.unigram_entropy, dm.describe(), dm.vocab_size


def interleaved_step_ms(configs: list[Path], vocab_size: int, rounds: int, threads: int | None) -> list[float]:
    """Median ms per training step of each config's model, timing the models round-robin ``rounds`` times."""
    import torch

    from training.lit import LitGPT

    if threads:
        torch.set_num_threads(threads)
    steps = []
    for cfg_path in configs:
        cfg = yaml.safe_load(cfg_path.read_text())
        m = cfg["model"]
        torch.manual_seed(0)
        lit = LitGPT(vocab_size=vocab_size, **m)
        opt = torch.optim.AdamW(lit.parameters(), lr=1e-4)
        x = torch.randint(0, vocab_size, (cfg["data"]["batch_size"], m["block_size"] + 1))

        def step(lit=lit, opt=opt, x=x) -> None:
            loss, _ = lit._loss((x[:, :-1], x[:, 1:]))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        step()  # warm-up
        steps.append(step)
    times: list[list[float]] = [[] for _ in configs]
    for _ in range(rounds):
        for i, step in enumerate(steps):
            times[i] += wall_time(step, 1)
    return [1000 * sorted(t)[len(t) // 2] for t in times]
