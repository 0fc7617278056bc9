"""Lightning's side of safe checkpoints: resumes (``--ckpt_path``) load through :mod:`models.checkpoint`, saves are
atomic with their temporary file next to the checkpoint.

The loader itself (``weights_only=True``, one clear :class:`~models.checkpoint.CheckpointError`) and the atomic
writer live in :mod:`models.checkpoint` so that evaluation and post-training tools (``kvsplice.to_mla``) can load
and write checkpoints without Lightning; they are re-exported here.

Saving: :func:`atomic_save` writes ``.<name>.<pid>.tmp`` in the checkpoint's own folder, fsyncs it and renames it
over ``<name>`` (``os.replace``: atomic on one filesystem). A process killed mid-write leaves the previous checkpoint
intact and at most that temporary file, which :func:`remove_stale_temp_files` deletes when the run is started or
resumed again. (Lightning's default writer stages the file in the system temp folder, where a killed write is never
cleaned up, and copies it across filesystems.)
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from models.checkpoint import (CKPT_FORMAT, CKPT_FORMAT_KEY, GPT_CONFIG_KEY, CheckpointError, PathLike, atomic_save,
                               load_checkpoint, load_gpt_checkpoint, remove_stale_temp_files)

__all__ = ["CKPT_FORMAT", "CKPT_FORMAT_KEY", "GPT_CONFIG_KEY", "CheckpointError", "atomic_save", "check_resume_file",
           "load_checkpoint", "load_gpt_checkpoint", "remove_stale_temp_files", "safe_checkpoint_io"]


#: What a checkpoint needs to resume a Lightning run from (Lightning reads these without checking).
_RESUME_KEYS = ("pytorch-lightning_version", "state_dict", "global_step", "loops")


def check_resume_file(value: Optional[str], option: str) -> None:
    """A ``--ckpt_path FILE`` checked before anything is built (no start-up lines before its refusal): it loads
    with ``weights_only=True`` (memory-mapped: the tensors are not read), else :class:`CheckpointError` in one
    line naming ``option``. Names a run resolves itself (``last``, ``best``) and missing files are left to it."""
    import os

    import torch

    if value is None or value in ("last", "best", "hpc", "registry") or not os.path.isfile(value):
        return
    try:
        torch.load(value, map_location="cpu", weights_only=True, mmap=True)
        return
    except Exception:  # noqa: BLE001 - the loader below names what is wrong in one line
        pass
    try:
        load_checkpoint(value)
    except CheckpointError as e:
        raise CheckpointError(f"{option} {value}: {e}") from None


def safe_checkpoint_io():
    """A Lightning ``CheckpointIO`` that always loads with ``weights_only=True`` and raises :class:`CheckpointError`,
    and saves with :func:`atomic_save` (Lightning is imported only here, so ``load_gpt_checkpoint`` stays light for
    evaluation tools)."""
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    class SafeCheckpointIO(TorchCheckpointIO):
        def load_checkpoint(  # type: ignore[override]
            self,
            path: PathLike,
            map_location: Optional[Callable] = lambda storage, loc: storage,
            weights_only: Optional[bool] = None,
        ) -> dict[str, Any]:
            ckpt = load_checkpoint(path, map_location=map_location)  # weights_only=True whatever is asked
            missing = [k for k in _RESUME_KEYS if k not in ckpt]
            if missing:  # e.g. models.checkpoint.save_model / kvsplice.to_mla output: weights, no training state
                raise CheckpointError(
                    f"cannot resume from {str(path)!r}: it holds no training state ({missing[0]!r} missing; not a "
                    f"checkpoint python -m training.fit wrote); start a new run from its weights with "
                    f"--model.init_from {path}")
            return ckpt

        def save_checkpoint(  # type: ignore[override]
            self, checkpoint: dict[str, Any], path: PathLike, storage_options: Optional[Any] = None
        ) -> None:
            if storage_options is not None:
                raise TypeError(f"SafeCheckpointIO.save_checkpoint takes no storage_options, got {storage_options}")
            atomic_save(checkpoint, path)

    return SafeCheckpointIO()
