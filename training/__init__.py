"""Training: the ``python -m training.fit`` LightningCLI and safe checkpoint loading (:mod:`training.checkpoint`)."""

from training.checkpoint import CheckpointError, load_checkpoint, load_model

__all__ = ["CheckpointError", "load_checkpoint", "load_model"]
