"""The text of the package's standard real-model protocol (SmolLM2-135M-Instruct, the shared GGUF file): evaluation,
the first 4,096 tokens of the validation sample (4 windows of 1,024); calibration, the first 32,768 tokens of the
train sample (statistics computed once, reused from ``WORK``); a tuning slice of windows after the calibration tokens
for every choice a benchmark or the planner makes. Used by ``smollm2_frontier`` and ``smollm2_llama_cpp``."""

from __future__ import annotations

import torch

from benchmarks.harness.paths import CALIB, EVAL as VAL, ROOT, SMOLLM2 as MODEL  # noqa: F401  (read as C.VAL)
from benchmarks.lib.stories import windows

WORK = ROOT / "checkpoints" / "smollm2"
CALIB_TOKENS, SEQ, EVAL_TOKENS = 32768, 1024, 4096


def load():
    """SmolLM2-135M-Instruct from the shared GGUF file (``kvsplice.loading``)."""
    from kvsplice.loading import load_model

    return load_model(str(MODEL))


def token_windows(loaded, spec, n_tokens: int, seq: int = SEQ, skip: int = 0) -> torch.Tensor:
    """``(n_tokens // seq, seq)`` windows of ``spec``'s token stream after its first ``skip`` tokens."""
    return windows(loaded, spec, seq, n_tokens // seq, skip=skip)[0]


def eval_windows(loaded) -> torch.Tensor:
    return token_windows(loaded, VAL, EVAL_TOKENS)


def stats(loaded, progress: bool = True):
    from kvsplice.lowrank.sensitivity import stats_for

    windows = lambda: list(token_windows(loaded, CALIB, CALIB_TOKENS).split(2))  # noqa: E731  (B = 2 for backward)
    return stats_for(loaded.model, windows, path=WORK / "calib_stats.safetensors", ropes=("pre", "post"),
                     source={"calibration_source": str(CALIB), "calibration_tokens": CALIB_TOKENS, "seq_len": SEQ},
                     progress=progress)
