"""stories260K as the studies use it: the llama2.c checkpoint of the shared data converted into a temporary
transformers folder and loaded, and windows of real TinyStories text through its tokenizer."""

from __future__ import annotations

import tempfile
from pathlib import Path

from benchmarks.harness.options import UsageError
from benchmarks.harness.paths import CALIB, STORIES
from kvsplice.convert.llama2c import convert_llama2c
from kvsplice.loading import LoadError, first_line, iter_texts, load_model, token_stream

__all__ = ["calibration_ids", "convert_stories", "load_stories", "windows"]


def convert_stories(dest: Path) -> Path:
    """stories260K (llama2.c) as the transformers folder ``dest``, converted unless it is there already."""
    for f in (STORIES / "stories260K.bin", STORIES / "tok512.bin"):
        if not f.is_file():
            raise UsageError(f"stories260K not found: {f} (pass --model)")
    if not (dest / "config.json").is_file():
        convert_llama2c(STORIES / "stories260K.bin", STORIES / "tok512.bin", dest)
    return dest


def load_stories(spec=None, need=()):
    """``spec`` loaded (:func:`kvsplice.loading.load_model`), or with None stories260K converted into a temporary
    folder first; a missing checkpoint, or a missing file of ``need``, is a :class:`UsageError`."""
    for f in need:
        if not f.is_file():
            raise UsageError(f"missing reference data: {f}")
    try:
        if spec is not None:
            return load_model(spec)
        with tempfile.TemporaryDirectory(prefix="stories260K-hf-") as tmp:
            return load_model(str(convert_stories(Path(tmp) / "m")))
    except LoadError as e:
        raise UsageError(first_line(e)) from None


def calibration_ids(loaded, tokens: int):
    """The first ``tokens`` token ids ``(tokens,)`` of the TinyStories train sample (the calibration text)."""
    return token_stream(iter_texts(str(CALIB)), loaded.tokenizer, tokens)[0]


def windows(loaded, text, length: int, n: int, split=None, skip: int = 0):
    """``(windows (N, length), stories)``: up to ``n`` windows of ``length`` tokens of ``text`` after its first
    ``skip`` tokens (at least one, and no longer than the model's positions: else a :class:`UsageError`)."""
    limit = getattr(loaded, "max_positions", None)  # (a tokenizer alone: no limit)
    if limit is not None and length > limit:
        raise UsageError(f"a window of {length} tokens exceeds the model's {limit} positions")
    ids, stories = token_stream(iter_texts(str(text), **({"split": split} if split else {})), loaded.tokenizer,
                                max_tokens=skip + length * n)
    ids = ids[skip:]
    count = min(n, ids.numel() // length)
    if count < 1:
        raise UsageError(f"{text} has {ids.numel()} tokens, fewer than one window of {length}")
    return ids[: count * length].view(count, length), stories
