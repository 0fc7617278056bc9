"""Training: the Lightning module (:mod:`training.lit`), ``python -m training.fit`` (entry point; the LightningCLI and
its callbacks in :mod:`training.lightning_cli`, the
run-directory rules in :mod:`training.rundir`, ``metrics.csv`` in :mod:`training.loggers`), safe checkpoint loading and
atomic saving (:mod:`training.checkpoint`), and ``kvsplice evaluate``.

The names below load on first use: ``kvsplice VERB`` imports this package before a training verb's first line, and
the verb answers Ctrl-C during its heavy imports with one line (:mod:`kvsplice.io.interrupt`) only when this
package imports nothing heavy itself."""

from __future__ import annotations

from typing import Any

__all__ = ["CheckpointError", "load_checkpoint", "load_gpt_checkpoint"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from training import checkpoint

        return getattr(checkpoint, name)
    raise AttributeError(f"module 'training' has no attribute {name!r}")
