"""The repository, its ``results/`` and the reference data beside the checkout (``../shared/data``, never copied in):
TinyStories text, stories260K, SmolLM2-135M-Instruct. Absent files stop a benchmark (a message) and skip a test."""

from __future__ import annotations

import re
from pathlib import Path

__all__ = ["CALIB", "DATA", "EVAL", "RESULTS", "ROOT", "SMOLLM2", "STORIES", "TINYSTORIES", "portable"]

ROOT = Path(__file__).resolve().parents[2]  # the repository
RESULTS = ROOT / "results"  # where the studies write their results
DATA = ROOT.parent / "shared" / "data"
STORIES = DATA / "stories260K"  # stories260K.bin + tok512.bin
CALIB = DATA / "tinystories" / "gusjengis_toy-RNN__tinystories_sample.txt"  # calibration: the train sample
EVAL = DATA / "tinystories" / "yuninxia_moe-routing-bench__tinystories_val.txt"  # held-out: the validation sample
SMOLLM2 = DATA / "smollm2-135m-instruct"
TINYSTORIES = DATA / "tinystories"  # the local TinyStories folder the small_* training configs read


def portable(value):
    """``value`` (strings, lists / dicts of them) with this machine's paths as a results file records them:
    ``../shared/data/...`` for the reference data, repository-relative for the checkout (any clone reruns it)."""
    if isinstance(value, str):
        end = r"(?![\w.-])"  # the whole folder name: /work/main, not /work/main2
        value = re.sub(re.escape(str(DATA)) + end, "../shared/data", value)
        return re.sub(re.escape(str(ROOT)) + end + "/?", lambda m: "" if m.group().endswith("/") else ".", value)
    if isinstance(value, dict):
        return {portable(k): portable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(portable(v) for v in value)
    return value
