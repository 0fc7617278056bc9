"""What the engine studies (``engines_trained.py``, ``engines_vllm.py``) share: a trained checkpoint exported as a
transformers folder (``training.export``) for an engine to load."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Optional

__all__ = ["export"]


def export(ckpt: Path, out: Path, fmt: str, pad: Optional[tuple[int, int]] = None) -> Path:
    """``training.export --ckpt CKPT --out OUT --format FMT --force`` (``pad``: ``--pad-latent`` / ``--pad-rope``),
    its own report sent to stderr (stdout is the study's JSON); a failed export raises ``RuntimeError``."""
    from training import export as ex

    args = ["--ckpt", str(ckpt), "--out", str(out), "--format", fmt, "--force"]
    if pad:
        args += ["--pad-latent", str(pad[0]), "--pad-rope", str(pad[1])]
    with contextlib.redirect_stdout(sys.stderr):
        if ex.main(args) != 0:
            raise RuntimeError(f"training.export {' '.join(args)} failed")
    return out

