"""Training: the Lightning module (:mod:`training.lit`), ``python -m training.fit`` (entry point; the LightningCLI and
its callbacks in :mod:`training.cli`, the
run-directory rules in :mod:`training.rundir`, ``metrics.csv`` in :mod:`training.loggers`), safe checkpoint loading and
atomic saving (:mod:`training.checkpoint`), and ``python -m training.evaluate``."""

from training.checkpoint import CheckpointError, load_checkpoint, load_gpt_checkpoint

__all__ = ["CheckpointError", "load_checkpoint", "load_gpt_checkpoint"]
