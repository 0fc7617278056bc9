"""Lightning's side of safe checkpoint loading: resumes (``--ckpt_path``) go through :mod:`models.checkpoint`.

The loader itself (``weights_only=True``, one clear :class:`~models.checkpoint.CheckpointError`) lives in
:mod:`models.checkpoint` so that evaluation and post-training tools can load checkpoints without Lightning; it is
re-exported here.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from models.checkpoint import (CKPT_FORMAT, CKPT_FORMAT_KEY, GPT_CONFIG_KEY, CheckpointError, PathLike,
                               load_checkpoint, load_model)

__all__ = ["CKPT_FORMAT", "CKPT_FORMAT_KEY", "GPT_CONFIG_KEY", "CheckpointError", "load_checkpoint", "load_model",
           "safe_checkpoint_io"]


def safe_checkpoint_io():
    """A Lightning ``CheckpointIO`` that always loads with ``weights_only=True`` and raises :class:`CheckpointError`
    (Lightning is imported only here, so ``load_model`` stays light for evaluation tools)."""
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    class SafeCheckpointIO(TorchCheckpointIO):
        def load_checkpoint(  # type: ignore[override]
            self,
            path: PathLike,
            map_location: Optional[Callable] = lambda storage, loc: storage,
            weights_only: Optional[bool] = None,
        ) -> dict[str, Any]:
            return load_checkpoint(path, map_location=map_location)  # weights_only=True whatever is asked

    return SafeCheckpointIO()
