"""The text windows of the package's standard real-model protocol (SmolLM2-135M-Instruct, the shared GGUF file):
its text (calibration: the first 32,768 tokens of the TinyStories train sample; evaluation: the first 4,096 tokens
of the validation sample, 4 windows of 1,024; a tuning slice of 4 windows after the calibration tokens for every
choice a benchmark or the planner makes) and the calibration statistics, computed once and reused from ``WORK``.
Used by ``benchmarks/smollm2_frontier.py`` and ``benchmarks/smollm2_llama_cpp.py``."""

from __future__ import annotations

from pathlib import Path

import torch

from benchmarks.harness.paths import CALIB, EVAL as VAL, SMOLLM2 as MODEL  # the shared data files

__all__ = ["CALIB", "CALIB_TOKENS", "EVAL_TOKENS", "MODEL", "SEQ", "VAL", "WORK", "eval_windows", "load", "stats",
           "token_windows", "tune_windows"]

ROOT = Path(__file__).resolve().parents[2]
"""The repository."""
WORK = ROOT / "checkpoints" / "smollm2"
CALIB_TOKENS, SEQ, EVAL_TOKENS = 32768, 1024, 4096


def load():
    """SmolLM2-135M-Instruct from the shared GGUF file (``kvsplice.loading``)."""
    from kvsplice.loading import load_model

    return load_model(str(MODEL))


def token_windows(loaded, spec, n_tokens: int, seq: int = SEQ, skip: int = 0) -> torch.Tensor:
    """``(n_tokens // seq, seq)`` windows of ``spec``'s token stream after its first ``skip`` tokens (the
    package's tokenisation: stories joined by the tokenizer's separator)."""
    from kvsplice.loading import iter_texts, token_stream

    ids, _ = token_stream(iter_texts(str(spec)), loaded.tokenizer, skip + n_tokens)
    ids = ids[skip:]
    n = ids.numel() // seq
    return ids[: n * seq].view(n, seq)


def eval_windows(loaded) -> torch.Tensor:
    return token_windows(loaded, VAL, EVAL_TOKENS)


def tune_windows(loaded, n: int = 4) -> torch.Tensor:
    """A tuning slice of the train sample, after the calibration tokens (never the evaluation windows)."""
    return token_windows(loaded, CALIB, n * SEQ, skip=CALIB_TOKENS)


def stats(loaded, progress: bool = True):
    from kvsplice.lowrank.sensitivity import stats_for

    windows = lambda: list(token_windows(loaded, CALIB, CALIB_TOKENS).split(2))  # noqa: E731  (B = 2 for backward)
    return stats_for(loaded.model, windows, path=WORK / "calib_stats.safetensors", ropes=("pre", "post"),
                     source={"calibration_source": str(CALIB), "calibration_tokens": CALIB_TOKENS, "seq_len": SEQ},
                     progress=progress)
