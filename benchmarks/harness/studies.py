"""A study's settings: ``benchmarks/studies/<study>.yaml`` beside the scripts (data, not code), read once."""

from __future__ import annotations

import functools
from pathlib import Path

import yaml

__all__ = ["STUDIES", "load", "variants"]

STUDIES = Path(__file__).resolve().parents[1] / "studies"


@functools.lru_cache(maxsize=None)
def _read(path: Path) -> dict:
    with path.open() as f:
        data = yaml.safe_load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path.name}: a study's settings are a mapping, got {type(data).__name__}")
    return data


def load(study: str) -> dict:
    """The settings of ``study`` (``benchmarks/studies/<study>.yaml``) as a mapping; a missing file is an
    ``OSError``, a file that is not a mapping a ``ValueError``."""
    return _read(STUDIES / f"{study}.yaml")


def variants(study: str, key: str) -> dict[str, tuple[str, list[str]]]:
    """``variant -> (config, overrides)`` of a training study's ``key`` section: ``configs/<config>.yaml`` and the
    ``training.fit`` options added to it."""
    return {name: (v["config"], list(v["overrides"])) for name, v in load(study)[key].items()}
