"""What the engine studies (``engines_trained.py``, ``engines_vllm.py``) share: a trained checkpoint exported as a
transformers folder (``training.export``) for an engine to load, and the run's JSON report."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from benchmarks.harness.header import command, revision

__all__ = ["export", "report"]


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



def report(script: str, argv: Optional[Sequence[str]], result: dict[str, Any], json_path: Optional[Path]) -> int:
    """``result`` headed by the command that ran ``script`` with ``argv`` and the revision, as JSON on stdout and,
    with ``json_path``, in that file (written whole or not at all); exit status 0."""
    from kvsplice.io.write import write_json

    out = {"command": command(script, argv), "revision": revision(), **result}
    print(json.dumps(out, indent=1))
    if json_path:
        write_json(out, json_path)
    return 0
