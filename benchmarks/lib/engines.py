"""What the engine studies (``engines_trained``, ``engines_vllm``, ``engines_vllm_plugin``) share: a checkpoint or
an in-memory model exported as a transformers folder (:func:`training.export.export`) for an engine to load."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Optional

__all__ = ["export", "export_model"]


def export(ckpt: Path, out: Path, fmt: str = "auto", pad: Optional[tuple[int, int]] = None,
           tokenizer: bool = True) -> Path:
    """``ckpt`` exported into ``out`` (replaced) in ``fmt``; ``pad``: the DeepSeek-V3 export's (latent, RoPE) padded
    to these widths. Its report goes to stderr (stdout is the study's)."""
    from training import export as ex

    with contextlib.redirect_stdout(sys.stderr):
        ex.export(ckpt, out, force=True, tokenizer=tokenizer, fmt=fmt, pad_latent=pad[0] if pad else None,
                  pad_rope=pad[1] if pad else None)
    return out


def export_model(model, out: Path, pad: Optional[tuple[int, int]] = None) -> Path:
    """A :class:`models.GPT` (random weights: no tokenizer) exported into ``out`` through a checkpoint beside it."""
    from models.checkpoint import save_model

    ckpt = save_model(model, out.with_suffix(".ckpt"))
    try:
        return export(ckpt, out, pad=pad, tokenizer=False)
    finally:
        ckpt.unlink()
