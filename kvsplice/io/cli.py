"""Helpers every command-line tool of ``kvsplice`` shares: argument types, one-line usage errors, output paths
that are never overwritten silently, JSON writing and the device choice."""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path
from typing import Any, Optional

import torch

__all__ = ["UsageError", "check_out_path", "default_seq_len", "pick_device", "pos_int", "write_json"]


class UsageError(Exception):
    """A bad argument: reported as one line on stderr, non-zero exit status."""


def pos_int(s: str) -> int:
    """argparse type: an integer >= 1."""
    v = int(s)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {s}")
    return v


def default_seq_len(max_positions: Optional[int], cap: int = 1024) -> int:
    """Calibration / evaluation window: the model's context, at most ``cap`` (512 when unknown)."""
    return min(max_positions or 512, cap)


def pick_device(name: Optional[str] = None) -> torch.device:
    if name:
        return torch.device(name)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def check_out_path(out: str | os.PathLike, force: bool, option: str = "--out") -> Path:
    """``out`` as a Path; :class:`UsageError` if it is a directory, or exists and ``force`` is not set."""
    path = Path(out)
    if path.is_dir():
        raise UsageError(f"{option} {path} is a directory")
    if path.exists() and not force:
        raise UsageError(f"{option} {path} already exists (use --force to overwrite)")
    return path


def _json_default(o: Any) -> Any:
    if isinstance(o, float) and (math.isnan(o) or math.isinf(o)):
        return None
    return str(o)


def write_json(obj: Any, path: str | os.PathLike) -> Path:
    """Write ``obj`` as indented JSON (NaN/inf → null), through a temporary file renamed into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=_json_default) + "\n")
    os.replace(tmp, path)
    return path
